"""``heap.give_back`` (issue 33): what a thread freed in glibc's arena goes back to the system after costly work,
and only when the process grew past the slack."""

from __future__ import annotations

import ctypes
import threading

import pytest

from specgrammar_plugins import heap

pytestmark = pytest.mark.skipif(heap._TRIM is None or heap.rss_bytes() is None,
                                reason="no glibc malloc_trim or no /proc here")

BLOCK = 64 << 10  # under glibc's mmap threshold: served from the thread's arena, not by mmap
BLOCKS = 2400  # ~150 MB


def _churn_in_a_thread() -> None:
    """Allocate and touch ~150 MB in a thread's arena, then free all but the last block (it pins the heap's top,
    so glibc's free cannot shrink the heap: the freed memory stays resident, as after a costly compile)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def run():
        ptrs = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
        for p in ptrs:
            ctypes.memset(p, 1, BLOCK)
        for p in ptrs[:-1]:
            libc.free(p)
        _kept.append(ptrs[-1])

    t = threading.Thread(target=run)
    t.start()
    t.join()


_kept: list = []


def test_freed_arena_memory_is_given_back_past_the_slack():
    heap.give_back(slack=0)  # (the mark: now)
    before = heap.rss_bytes()
    _churn_in_a_thread()
    grown = heap.rss_bytes() - before
    assert grown > 100 << 20, grown  # the freed blocks are still resident
    assert heap.give_back(slack=grown + (64 << 20)) == 0  # under the slack: no trim
    given = heap.give_back(slack=32 << 20)
    assert given > 100 << 20, (grown, given)
    assert heap.rss_bytes() - before < 32 << 20


def test_a_preparation_gives_back_what_it_freed():
    """The end of ``prepare_deadline`` (every host's preparation) trims past the slack."""
    from specgrammar_plugins.bounds import prepare_deadline

    heap.give_back(slack=0)
    before = heap.rss_bytes()
    with prepare_deadline():
        _churn_in_a_thread()
        assert heap.rss_bytes() - before > 100 << 20
    assert heap.rss_bytes() - before < heap.SLACK


def _held_in_a_thread(cls) -> list:
    """~150 MB of blocks malloc'd and touched in a thread's arena, held by one ``cls(blocks)`` (in the returned
    list); a last block, kept, pins the heap's top."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    held: list = []

    def build():
        ptrs = [libc.malloc(BLOCK) for _ in range(BLOCKS + 1)]
        for p in ptrs:
            ctypes.memset(p, 1, BLOCK)
        held.append(cls(ptrs[:-1]))
        _kept.append(ptrs[-1])

    t = threading.Thread(target=build)
    t.start()
    t.join()
    return held


class _Grammar:
    """A costly request's grammar: blocks freed when it is (no cycle)."""

    def __init__(self, ptrs):
        self.ptrs = ptrs

    def __del__(self):
        libc = ctypes.CDLL(None)
        libc.free.argtypes = [ctypes.c_void_p]
        for p in self.ptrs:
            libc.free(p)


class _Held(_Grammar):
    """Blocks a costly request built, held in a reference cycle (freed only by a full collection)."""

    def __init__(self, ptrs):
        super().__init__(ptrs)
        self.me = self


def test_again_collects_and_trims_what_was_freed_after_the_costly_trim():
    """``give_back(again=True)`` (vLLM's EngineCore, whose heap vLLM freezes): the call after a trim of a grown
    heap collects cycles and trims, though the heap did not grow since; without ``again`` nothing runs."""
    import gc

    gc.disable()
    try:
        heap.give_back(slack=0)
        before = heap.rss_bytes()
        held = _held_in_a_thread(_Held)
        assert heap.rss_bytes() - before > 100 << 20
        heap.give_back(slack=32 << 20, again=True)  # the costly request's own trim: its blocks are still held
        held.clear()  # the request ends: its blocks are garbage in a cycle, not yet freed
        assert heap.rss_bytes() - before > 100 << 20
        assert heap.give_back(slack=1 << 40) == 0  # no growth, no ``again``: nothing runs
        given = heap.give_back(slack=1 << 40, again=True)
        assert given > 100 << 20, given
        assert heap.give_back(slack=1 << 40, again=True) == 0  # once only
    finally:
        gc.enable()



def test_a_costly_requests_grammar_is_trimmed_away_when_it_is_freed():
    """``serving.trim_when_freed`` (vLLM's EngineCore after a costly compile): the request frees its grammars
    after the compile's own trim, when it ends; the heap is trimmed as each is freed, with no other call."""
    from specgrammar_plugins.serving import trim_when_freed

    heap.give_back(slack=0)
    before = heap.rss_bytes()
    held = _held_in_a_thread(_Grammar)
    heap.give_back(slack=32 << 20)  # the compile's own trim: the grammar is still held
    assert heap.rss_bytes() - before > 100 << 20
    assert trim_when_freed(held[0], None, 1) == 1  # (None and an int cannot be watched)
    trims = heap.TRIMS
    held.clear()  # the request ends
    assert heap.TRIMS == trims + 1
    assert heap.rss_bytes() - before < 32 << 20
