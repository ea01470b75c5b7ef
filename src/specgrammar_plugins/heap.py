"""Handing the memory a costly piece of work freed back to the operating system (issue 33).

glibc's malloc (2.36 on the test machine) keeps what a thread frees in that thread's arena for later reuse; only
the top of a heap is ever returned by ``free``.  After a costly valid request (a 20,000-option choice: xgrammar's
compile, the budget's walk over its automaton) hundreds of MB stay in the process's RSS though nothing holds them
any more: measured 2026-11-26, the mlx-lm server went from 464 to 1,018 MB and the vLLM launcher's API server
from 685 to 1,211 MB, its EngineCore from 1,738 to 2,046 MB and a compile worker from 273 to 698-1,102 MB, each
at the same figure when the body was sent again (a high-water mark, not a leak).  ``malloc_trim(0)`` (glibc
>= 2.8 trims every arena, not only the top of the main heap) gave back all but the caches' share: 540, 752,
1,939 and 330 MB.

``give_back`` calls it after such work (the end of a request's preparation, ``bounds.prepare_deadline``; a
compile worker's job; vLLM's grammar compile), but only when the process's RSS has grown by more than ``SLACK``
since the last trim: a trim walks every arena (tens of ms on a GB heap), so ordinary requests, which grow
nothing, only pay for reading ``/proc/self/statm``.  A no-op where the C library has no ``malloc_trim`` (macOS,
musl) or there is no ``/proc``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading

# Growth of RSS since the last trim past which the next ``give_back`` trims (``SPECGRAMMAR_TRIM_SLACK_MB``).
SLACK = int(os.environ.get("SPECGRAMMAR_TRIM_SLACK_MB", "64")) << 20


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # (ctypes releases the GIL during the call)
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_LOCK = threading.Lock()


def rss_bytes() -> int | None:
    """This process's resident set size (``/proc/self/statm``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_mark = rss_bytes()  # the RSS after the last trim (or at import), lowered whenever the RSS is found below it
_pending = False  # a trim ran with ``again``: the next ``give_back(again=True)`` collects and trims once more
TRIMS = 0  # the trims ``trim`` ran (a count for tests and logs)


def give_back(slack: int | None = None, *, again: bool = False) -> int:
    """``malloc_trim(0)`` when this process's RSS has grown by more than ``slack`` (default ``SLACK``) since the
    last trim; the bytes of RSS it gave back (0 when it did not run).  Never blocks on another thread's trim.

    ``again`` (a caller that runs at the start of each request's work, while the costly request that grew the heap
    may still hold what it built: vLLM's grammar compile in the EngineCore): after such a trim, the next call with
    ``again`` runs a full ``gc.collect()`` (vLLM 0.32 freezes the EngineCore's start-up heap, so no full
    collection runs on its own) and trims once more, whatever the growth: by then that request is usually over
    and its grammars freed, which glibc would otherwise keep (issue 33)."""
    global _mark, _pending
    if _TRIM is None or not _LOCK.acquire(blocking=False):
        return 0
    try:
        rss = rss_bytes()
        if rss is None:
            return 0
        if _mark is None or rss < _mark:
            _mark = rss
        grown = rss - _mark > (SLACK if slack is None else slack)
        if not grown and not (again and _pending):
            return 0
        if again:
            if not grown:
                gc.collect()
            _pending = grown
        _TRIM(0)
        after = rss_bytes() or rss
        _mark = after
        return max(0, rss - after)
    finally:
        _LOCK.release()


def trim() -> int:
    """``malloc_trim(0)`` now, whatever the growth (unless another thread is trimming); the bytes of RSS it gave
    back.  For what is freed after the costly work's own trim: a costly request's grammar, freed when the request
    ends (``serving.trim_when_freed``)."""
    global _mark, TRIMS
    if _TRIM is None or not _LOCK.acquire(blocking=False):
        return 0
    try:
        rss = rss_bytes()
        _TRIM(0)
        TRIMS += 1
        after = rss_bytes()
        if after is not None:
            _mark = after
        return max(0, rss - after) if rss is not None and after is not None else 0
    finally:
        _LOCK.release()


__all__ = ["SLACK", "give_back", "rss_bytes", "trim"]
