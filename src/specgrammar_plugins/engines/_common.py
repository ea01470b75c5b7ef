"""What the three native-engine adapters (xgrammar, llguidance, outlines-core) share: the per-tokenizer object
cache, mask padding, error-message cleanup, forced-token chains from masks, and the rollback bookkeeping that makes
``accept_bytes`` merge into the current position (as in the reference ``DFAMatcher``) whatever the engine counts
as a step.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator

import numpy as np

from ..constraint import Forced
from ..masks import mask_words, single_allowed
from ..errors import ConstraintError
from ..tokenizer import TokenizerInfo

MAX_FORCED = 32


def forced_cap(limit: int | None) -> int:
    """The most bytes a ``jump_forward`` may return: ``limit`` (the caller's: a request's budget in bytes), never
    more than ``bounds.BOUNDS.max_forced_bytes`` (``bounds.py``: no grammar that passed the cheap bounds forces more)."""
    from ..bounds import BOUNDS

    cap = BOUNDS.max_forced_bytes
    return cap if limit is None else max(0, min(int(limit), cap))


class PerTokenizerCache:
    """Engine tokenizer objects, built once per ``(tokenizer.fingerprint, vocab_size)``."""

    def __init__(self, build: Callable[[TokenizerInfo], Any], max_entries: int = 8):
        self._build = build
        self._items: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.builds = 0

    def get(self, tok: TokenizerInfo) -> Any:
        key = (tok.fingerprint, tok.vocab_size)
        with self._lock:
            item = self._items.get(key)
            if item is None:
                item = self._build(tok)
                self.builds += 1
                if len(self._items) >= self.max_entries:
                    self._items.pop(next(iter(self._items)))
                self._items[key] = item
            return item


_FD2_LOCK = threading.Lock()


@contextlib.contextmanager
def native_stderr() -> Iterator[list[str]]:
    """Capture what native code writes to file descriptor 2 inside the block (xgrammar logs its warnings there from
    C++, beyond the reach of ``logging`` and ``warnings``); the lines are in the yielded list after the block.

    The descriptor is process-wide: keep the block short (a schema's conversion, not a compile).  Whatever other
    threads write meanwhile is captured too, so the caller writes back every line it does not act on
    (``write_stderr``)."""
    lines: list[str] = []
    with _FD2_LOCK:
        try:
            sys.stderr.flush()
        except Exception:  # pragma: no cover - a closed or odd sys.stderr
            pass
        saved = os.dup(2)
        try:
            with tempfile.TemporaryFile() as tmp:
                os.dup2(tmp.fileno(), 2)
                try:
                    yield lines
                finally:
                    os.dup2(saved, 2)
                    tmp.seek(0)
                    lines.extend(tmp.read().decode("utf-8", "replace").splitlines())
        finally:
            os.close(saved)


def write_stderr(lines: list[str]) -> None:
    if lines:
        os.write(2, ("\n".join(lines) + "\n").encode("utf-8", "replace"))


def clear_past(out: np.ndarray, n_tokens: int) -> None:
    """Disallow every id >= ``n_tokens`` (ids past the tokenizer: padding up to the model's output width)."""
    w = n_tokens >> 5
    if w >= out.shape[-1]:
        return
    r = n_tokens & 31
    if r:
        out.view(np.uint32)[w] &= np.uint32((1 << r) - 1)
        w += 1
    out[w:] = 0


def popcount(row: np.ndarray) -> int:
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return int(np.bitwise_count(row.view(np.uint32)).sum())
    return int(np.unpackbits(row.view(np.uint8)).sum())


_TS_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+?:\d+: ")


def engine_words(e: BaseException) -> str:
    """An engine exception's message without C++ source locations and timestamps."""
    msg = str(e).strip()
    msg = _TS_PREFIX.sub("", msg)
    return msg or type(e).__name__


def empty_choice(schema, pointer: str = "") -> str | None:
    """Where ``schema`` has an empty ``enum`` / ``anyOf`` / ``oneOf`` (``"anyOf at /properties/a"``), if anywhere.
    Each matches no value, but outlines-core 0.2.14 turns it into ``()`` (the empty string: ``{"a": {"enum": []}}``
    allowed ``{"a":}``) and xgrammar 0.2.8 does the same with an empty ``anyOf`` (``{"anyOf": []}`` allowed
    only EOS, the empty output)."""
    if isinstance(schema, dict):
        for key in ("enum", "anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and not schema[key]:
                return f"{key} at {pointer or '/'}"
        items = schema.items()
    elif isinstance(schema, list):
        items = enumerate(schema)
    else:
        return None
    for k, v in items:
        if k in ("enum", "const", "default", "examples"):
            continue
        found = empty_choice(v, f"{pointer}/{k}")
        if found:
            return found
    return None


def refuse_empty_choices(spec, engine: str) -> None:
    """``ConstraintError`` for a JSON Schema with an empty enum / anyOf / oneOf (see ``empty_choice``)."""
    where = empty_choice(spec.schema) if spec.kind == "json_schema" else None
    if where:
        raise ConstraintError(f"{where} is empty: it matches no value", engine=engine, kind=spec.kind)


def no_start_error(engine: str, kind: str) -> ConstraintError:
    return ConstraintError("the constraint matches no string: no token is allowed at the start",
                           engine=engine, kind=kind)


def forced_from_masks(m, tok: TokenizerInfo, max_tokens: int = MAX_FORCED) -> Forced:
    """Tokens that are each the only allowed token in turn (never a stop token), walked on a fork."""
    if m.is_terminated():
        return Forced()
    row = np.zeros(mask_words(m.vocab_size), dtype=np.int32)
    m.fill_mask(row)
    t = single_allowed(row)
    if t is None or t in tok.stop_token_ids:
        return Forced()
    f = m.fork()
    tokens: list[int] = []
    while t is not None and t not in tok.stop_token_ids and len(tokens) < max_tokens:
        if not f.accept(t):
            break
        tokens.append(t)
        f.fill_mask(row)
        t = single_allowed(row)
    return Forced(tuple(tokens), tok.decode(tokens))


class StepBook:
    """Maps protocol steps (accepted tokens) to engine steps.

    ``steps[i]`` is how many engine steps the i-th accepted token took, plus the engine steps of any
    ``accept_bytes`` that followed it (bytes merge into the current position, as in the reference engine);
    ``base`` counts engine steps of bytes accepted before any token (they cannot be rolled back).
    ``stop_at`` is the index of the accepted stop token, if any.
    """

    __slots__ = ("steps", "base", "stop_at")

    def __init__(self, steps: list[int] | None = None, base: int = 0, stop_at: int | None = None):
        self.steps = steps if steps is not None else []
        self.base = base
        self.stop_at = stop_at

    def copy(self) -> "StepBook":
        return StepBook(list(self.steps), self.base, self.stop_at)

    def push(self, engine_steps: int = 1) -> None:
        self.steps.append(engine_steps)

    def merge(self, engine_steps: int) -> None:
        if self.steps:
            self.steps[-1] += engine_steps
        else:
            self.base += engine_steps

    def pop(self, n: int) -> int:
        """Forget the last ``n`` tokens; return how many engine steps to undo."""
        if n > len(self.steps):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self.steps)} accepted")
        k = len(self.steps) - n
        undo = sum(self.steps[k:])
        del self.steps[k:]
        if self.stop_at is not None and self.stop_at >= k:
            self.stop_at = None
        return undo

    @property
    def terminated(self) -> bool:
        return self.stop_at is not None

    def __len__(self) -> int:
        return len(self.steps)


class GreedyBytes:
    """Spells a byte string with vocabulary tokens, longest match first (any spelling will do for engines that
    match bytes: it is how ``accept_bytes`` is done on engines that only take tokens)."""

    def __init__(self, tok: TokenizerInfo):
        table: dict[bytes, int] = {}
        for i, b in enumerate(tok.token_bytes):
            if b and i not in tok.special_ids and i not in tok.stop_token_ids:
                table.setdefault(b, i)
        self.table = table
        self.max_len = max((len(b) for b in table), default=1)
        # the longest token per first byte (81 bytes at SmolLM2's vocabulary, a `{` spells at most 4): the longest
        # match is looked for from there, not from the longest token of all
        self.max_at = [0] * 256
        for b in table:
            self.max_at[b[0]] = max(self.max_at[b[0]], len(b))

    def __call__(self, data: bytes) -> list[int] | None:
        """Token ids spelling ``data``, or None when some byte has no token."""
        out: list[int] = []
        i, n = 0, len(data)
        get, max_at = self.table.get, self.max_at
        while i < n:
            for k in range(min(max_at[data[i]], n - i), 0, -1):
                t = get(data[i:i + k])
                if t is not None:
                    out.append(t)
                    i += k
                    break
            else:
                return None
        return out


# ---------------------------------------------------------------------------------------------- regex dialect
# Shorthand classes mean ASCII in every engine, as in the reference engine (interegular), xgrammar (for \d, \w),
# ECMAScript / JSON Schema (for \d, \w): llguidance and outlines-core (Rust regex) read them as Unicode classes
# (\d would allow Arabic-Indic digits), xgrammar's \s includes U+00A0.  Spelled out, all engines agree.
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\x0B\\x0C\\r "}


def ascii_shorthands(pattern: str, dot: bool = False) -> str:
    r"""Rewrite ``\d \w \s`` (and ``\D \W \S`` outside brackets) as explicit ASCII classes; with ``dot``, also
    ``.`` as ``[^\n]`` (what it means everywhere but in xgrammar, whose ``.`` also matches a newline).

    Escaped backslashes are honoured (``\\d`` stays a backslash and a ``d``); a negated shorthand inside a
    bracket class (``[\D]``) is left to the engine.
    """
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            low = e.lower()
            if low in _ASCII_CLASSES:
                body = _ASCII_CLASSES[low]
                if in_class:
                    out.append(body if e.islower() else pattern[i:i + 2])
                else:
                    out.append(f"[{body}]" if e.islower() else f"[^{body}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if not in_class and c == "[":
            in_class = True
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":  # a leading ']' is a literal
                j += 1
            out.append(pattern[i:j])
            i = j
            continue
        if in_class and c == "]":
            in_class = False
        elif dot and not in_class and c == ".":
            out.append("[^\\n]")
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)
