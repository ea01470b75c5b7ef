"""What a constraint is (``ConstraintSpec``), how it is compiled once and cached, and the ``Matcher`` protocol
every engine implements.

Masks are packed int32 bitmask rows: bit ``j`` of word ``i`` set <=> token ``32*i + j`` allowed
(the layout xgrammar and llguidance use), ``mask_words(vocab_size)`` words per row.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from .errors import ConstraintError
from .tokenizer import TokenizerInfo

KINDS = ("regex", "json_schema", "grammar", "json", "choice")
GRAMMAR_SYNTAXES = ("gbnf", "lark", "ebnf")


# ---------------------------------------------------------------------------------------------- packed masks
def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_mask(vocab_size: int, rows: int | None = None, fill: int = 0) -> np.ndarray:
    shape = (mask_words(vocab_size),) if rows is None else (rows, mask_words(vocab_size))
    return np.full(shape, fill, dtype=np.int32)


def unpack_mask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed int32 rows [..., W] -> bool [..., vocab_size]."""
    m = np.ascontiguousarray(mask, dtype=np.int32)
    bits = np.unpackbits(m.view(np.uint8).reshape(*m.shape[:-1], -1), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """bool [..., V] -> packed int32 [..., ceil(V/32)]."""
    a = np.asarray(allowed, dtype=bool)
    v = a.shape[-1]
    pad = mask_words(v) * 32 - v
    if pad:
        a = np.concatenate([a, np.zeros((*a.shape[:-1], pad), dtype=bool)], axis=-1)
    return np.packbits(a, axis=-1, bitorder="little").view(np.int32)


def mask_allows(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def clear_bit(mask: np.ndarray, token: int) -> None:
    """Disallow ``token`` in a packed row, in place."""
    mask.view(np.uint32)[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)


def set_bit(mask: np.ndarray, token: int) -> None:
    mask.view(np.uint32)[token >> 5] |= np.uint32(1 << (token & 31))


def allowed_ids(mask: np.ndarray, vocab_size: int | None = None) -> np.ndarray:
    bits = unpack_mask(mask, vocab_size or mask.shape[-1] * 32)
    return np.flatnonzero(bits)


def full_mask(vocab_size: int, exclude: Iterable[int] = ()) -> np.ndarray:
    """Every token id below vocab_size allowed (minus ``exclude``)."""
    allowed = np.ones(vocab_size, dtype=bool)
    for t in exclude:
        if 0 <= t < vocab_size:
            allowed[t] = False
    return pack_mask(allowed)


# ---------------------------------------------------------------------------------------------- the spec
def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ConstraintSpec:
    """One request's constraint.

    kind: ``regex`` | ``json_schema`` | ``grammar`` | ``json`` (any JSON value... an object, like ``json_object``) | ``choice``
    value: the regex, the schema (canonical JSON text), the grammar text, or the tuple of choices
    syntax: for ``grammar``: ``gbnf`` (llama.cpp dialect), ``lark`` or ``ebnf`` (W3C-style EBNF, as xgrammar reads it)
    trigger: when set, the constraint is inactive until this string has been generated, then constrains the rest
    options: engine-neutral options, e.g. ``(("any_whitespace", False),)``
    """

    kind: str
    value: Any = None
    syntax: str | None = None
    trigger: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.kind == "grammar" and self.syntax not in GRAMMAR_SYNTAXES:
            raise ConstraintError(f"grammar syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}, got {self.syntax!r}")
        if self.kind in ("regex", "grammar") and (not isinstance(self.value, str) or not self.value):
            raise ConstraintError(f"{self.kind} must be a non-empty string", kind=self.kind)
        if self.kind == "choice":
            if not self.value or not all(isinstance(c, str) and c for c in self.value):
                raise ConstraintError("choice needs a non-empty list of non-empty strings", kind="choice")
        if self.trigger is not None and not (isinstance(self.trigger, str) and self.trigger):
            raise ConstraintError("trigger must be a non-empty string", kind=self.kind)

    # -------- constructors
    @classmethod
    def regex(cls, pattern: str, **kw) -> "ConstraintSpec":
        return cls("regex", pattern, **kw)

    @classmethod
    def json_schema(cls, schema: dict | str | bool, **kw) -> "ConstraintSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"JSON schema is not valid JSON: {e}", kind="json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"JSON schema must be an object or a boolean, got {type(schema).__name__}",
                                  kind="json_schema")
        from .schema import normalize

        # compact but order-preserving: engines generate properties in the schema's declared order, so two
        # schemas that differ only in key order are different constraints (and different cache keys)
        return cls("json_schema", json.dumps(normalize(schema), separators=(",", ":"), ensure_ascii=False), **kw)

    @classmethod
    def grammar(cls, text: str, syntax: str = "gbnf", **kw) -> "ConstraintSpec":
        return cls("grammar", text, syntax=syntax, **kw)

    @classmethod
    def json(cls, **kw) -> "ConstraintSpec":
        return cls("json", None, **kw)

    @classmethod
    def choice(cls, choices: Sequence[str], **kw) -> "ConstraintSpec":
        return cls("choice", tuple(choices), **kw)

    # -------- views
    @property
    def schema(self) -> Any:
        return json.loads(self.value) if self.kind == "json_schema" else None

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def key(self) -> str:
        return _canonical_json([self.kind, self.value, self.syntax, self.trigger, [list(o) for o in self.options]])

    def without_trigger(self) -> "ConstraintSpec":
        return ConstraintSpec(self.kind, self.value, self.syntax, None, self.options)

    def as_regex(self) -> str | None:
        """The constraint as a regex, when it is regular by construction (regex, choice)."""
        if self.kind == "regex":
            return self.value
        if self.kind == "choice":
            return "(" + "|".join(escape_regex(c) for c in self.value) + ")"
        return None


def escape_regex(text: str) -> str:
    """Escape every regex metacharacter in a way all four engines read the same."""
    return re.sub(r"([\\.^$|?*+()\[\]{}\-/])", r"\\\1", text)


# ---------------------------------------------------------------------------------------------- matcher protocol
@dataclass(frozen=True)
class Forced:
    """What the grammar forces next from the current state: tokens (each the only allowed token in turn)
    and the jump-forward text (bytes every continuation starts with; may span several tokens)."""

    tokens: tuple[int, ...] = ()
    text: bytes = b""


@runtime_checkable
class Matcher(Protocol):
    """A walk through one compiled constraint. Engines implement this; one per request (fork for drafts)."""

    vocab_size: int

    def fill_mask(self, out: np.ndarray) -> None:
        """Write this position's packed allowed-token row into ``out`` (int32, ``mask_words(vocab_size)``)."""

    def accept(self, token: int) -> bool:
        """Advance by ``token``; return False (state unchanged) if the grammar rejects it."""

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""

    def fork(self) -> "Matcher":
        """An independent copy at the same state."""

    def is_terminated(self) -> bool:
        """True once a stop token was accepted (or the grammar can only stop and did)."""

    def forced(self) -> Forced:
        """Tokens / text the grammar forces next."""

    def accept_bytes(self, data: bytes) -> bool:
        """Advance by raw bytes (used when a trigger completes mid-token); False if rejected (state unchanged)."""


@dataclass(eq=False)
class CompiledConstraint:
    """A constraint compiled for one tokenizer by one engine. ``matcher()`` makes a fresh walk."""

    spec: ConstraintSpec
    tokenizer: TokenizerInfo
    engine: str
    compiled: Any
    make_matcher: Any = field(repr=False)
    compile_ms: float = 0.0
    memory_bytes: int = 0

    def matcher(self) -> Matcher:
        m = self.make_matcher(self)
        if self.spec.trigger is not None:
            from .trigger import TriggeredMatcher

            return TriggeredMatcher(self, m)
        return m


class Engine(Protocol):
    """What an engine plugin registers: ``compile`` a trigger-free spec for a tokenizer."""

    name: str

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, options: dict) -> CompiledConstraint: ...


# ---------------------------------------------------------------------------------------------- compile cache
class CompileCache:
    """LRU of compiled constraints keyed by (spec, tokenizer fingerprint, width, engine, options), bounded in
    entries and in (engine-reported) bytes."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 512 << 20):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple, CompiledConstraint] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> CompiledConstraint | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return item

    def put(self, key: tuple, item: CompiledConstraint) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.memory_bytes
            self._items[key] = item
            self._bytes += item.memory_bytes
            while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
                _, ev = self._items.popitem(last=False)
                self._bytes -= ev.memory_bytes

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


CACHE = CompileCache()
DEFAULT_ENGINE = "xgrammar"


@dataclass
class Limits:
    """Process-wide limits, configurable by environment (``SPECGRAMMAR_MAX_CONSTRAINT_BYTES``,
    ``SPECGRAMMAR_COMPILE_TIMEOUT_S``, ``SPECGRAMMAR_COMPILE_ISOLATION``) or by assigning
    ``constraint.LIMITS.<name>``.

    compile_timeout_s: a compile that takes longer is abandoned: the request gets a ``ConstraintError`` at once.
    With ``engine="auto"`` every engine but the last gets ``auto_try_s`` before the next is tried.
    compile_isolation: how an abandoned compile is stopped, for engines with no resource limits of their own
    (xgrammar, outlines-core, dfa: ``isolate = True``):

    - ``"process"``: the compile runs in a worker process (``compile_worker``), which is killed at the limit: the
      CPU and memory it used are given back at once.  The mlx-lm server plugin turns this on.
    - ``"thread"`` (the library default): the compile runs in a thread; native code cannot be interrupted, so
      the thread finishes in the background and its result is dropped.

    llguidance always compiles in-process: its own fuel limits bound every compile and mask.
    """

    max_constraint_bytes: int = int(os.environ.get("SPECGRAMMAR_MAX_CONSTRAINT_BYTES", 1 << 20))
    compile_timeout_s: float = float(os.environ.get("SPECGRAMMAR_COMPILE_TIMEOUT_S", 30.0))
    auto_try_s: float = 2.0
    compile_isolation: str = os.environ.get("SPECGRAMMAR_COMPILE_ISOLATION", "thread")


LIMITS = Limits()
_POOL = None
_SLOW: set[tuple] = set()  # (spec key, tokenizer, engine) that ran out of compile time under "auto"


def _compile_with_timeout(eng, spec, tokenizer, options, timeout: float):
    global _POOL
    prepare = getattr(eng, "prepare", None)
    if prepare is not None:
        # the engine's per-tokenizer set-up (its import, vocabulary index: importing xgrammar imports
        # transformers, 5-15 s on a loaded 2-core machine) is not the grammar's compile: outside the limit
        prepare(tokenizer)
    if timeout is None or timeout <= 0:
        return eng.compile(spec, tokenizer, options)
    if LIMITS.compile_isolation == "process" and getattr(eng, "isolate", False):
        from .compile_worker import POOL

        return POOL.compile(eng, spec, tokenizer, options, timeout)
    if LIMITS.compile_isolation != "thread":
        raise ConstraintError(f"compile_isolation must be 'process' or 'thread', got {LIMITS.compile_isolation!r}")
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="specgrammar-compile")
    fut = _POOL.submit(eng.compile, spec, tokenizer, options)
    from concurrent.futures import TimeoutError as FutTimeout

    try:
        return fut.result(timeout=timeout)
    except FutTimeout:
        raise ConstraintError(f"compiling took longer than {timeout:g} s (the compile time limit); abandoned",
                              engine=getattr(eng, "name", None), kind=spec.kind) from None


# The engine policy ``engine="auto"``: per constraint kind, the engines to try in order (first that compiles wins).
# JSON Schema: llguidance compiles in ~1-2 ms where xgrammar takes 100 ms to seconds, and refuses what it cannot
# enforce; GBNF: llguidance takes llama.cpp's grammars verbatim; regex: xgrammar has the fastest masks.
POLICY: dict[str, tuple[str, ...]] = {
    "json_schema": ("llguidance", "xgrammar"),
    "json": ("xgrammar", "llguidance"),
    "regex": ("xgrammar", "llguidance", "outlines_core", "dfa"),
    "choice": ("xgrammar", "llguidance", "outlines_core", "dfa"),
    "grammar:gbnf": ("llguidance", "xgrammar"),
    "grammar:lark": ("llguidance", "xgrammar"),
    "grammar:ebnf": ("xgrammar",),
}


def policy_engines(spec: ConstraintSpec) -> tuple[str, ...]:
    return POLICY[f"grammar:{spec.syntax}" if spec.kind == "grammar" else spec.kind]


def compile_constraint(spec: ConstraintSpec, tokenizer: TokenizerInfo, engine: str | None = None,
                       cache: CompileCache | None = CACHE, *, _timeout: float | None = None,
                       **options) -> CompiledConstraint:
    """Compile ``spec`` for ``tokenizer`` with ``engine`` (default xgrammar; ``"auto"`` = the policy above), once:
    later calls hit the cache.

    JSON Schemas are checked first in strict mode (the default; spec option ``strict``): a keyword the engine does
    not enforce is an error naming it and its JSON pointer (see ``schema.py``).
    Raises ``ConstraintError`` with the engine's reason for anything the engine refuses.
    """
    engine = engine or DEFAULT_ENGINE
    size = len(spec.value.encode("utf-8")) if isinstance(spec.value, str) else len(spec.key())
    if size > LIMITS.max_constraint_bytes:
        raise ConstraintError(f"the constraint is {size} bytes; the limit is {LIMITS.max_constraint_bytes} "
                              "(SPECGRAMMAR_MAX_CONSTRAINT_BYTES)", engine=engine, kind=spec.kind)
    from .emptiness import check_not_empty

    check_not_empty(spec, engine)  # a language with no string at all: refused before any engine runs
    if engine == "auto":
        errors: list[ConstraintError] = []
        names = policy_engines(spec)
        for i, name in enumerate(names):
            slow_key = (spec.without_trigger().key(), tokenizer.fingerprint, name)
            if slow_key in _SLOW and i < len(names) - 1:
                continue  # this engine already ran out of time on this constraint: go straight to the next
            try:
                timeout = LIMITS.compile_timeout_s if i == len(names) - 1 else min(LIMITS.auto_try_s,
                                                                                    LIMITS.compile_timeout_s)
                return compile_constraint(spec, tokenizer, name, cache, _timeout=timeout, **options)
            except ConstraintError as e:
                if "compile time limit" in e.reason:
                    if len(_SLOW) > 4096:
                        _SLOW.clear()
                    _SLOW.add(slow_key)
                if "needs the" in e.reason and "package" in e.reason:  # engine not installed: try the next one
                    continue
                errors.append(e)
        if not errors:
            raise ConstraintError("no engine for this constraint is installed", engine="auto", kind=spec.kind)
        if len(errors) == 1:
            raise errors[0]
        raise ConstraintError("; ".join(f"{e.engine}: {e.reason}" for e in errors), engine="auto", kind=spec.kind)
    from .plugins import get_engine

    key = (spec.without_trigger().key(), tokenizer.fingerprint, tokenizer.vocab_size, engine,
           _canonical_json(sorted(options.items())))
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        if spec.kind == "json_schema" and spec.option("strict", True):
            from .schema import ENFORCED, require_supported

            if engine in ENFORCED:
                require_supported(spec.schema, engine)
        eng = get_engine(engine)
        t0 = time.perf_counter()
        try:
            hit = _compile_with_timeout(eng, spec.without_trigger(), tokenizer, options,
                                        LIMITS.compile_timeout_s if _timeout is None else _timeout)
        except ConstraintError:
            raise
        except Exception as e:  # an engine's own exception type: report its words under ours
            raise ConstraintError(f"{type(e).__name__}: {e}", engine=engine, kind=spec.kind) from e
        hit.compile_ms = (time.perf_counter() - t0) * 1e3
        if cache is not None:
            cache.put(key, hit)
    if spec.trigger is None:
        return hit
    # same compiled grammar, a spec that remembers the trigger
    return CompiledConstraint(spec, hit.tokenizer, hit.engine, hit.compiled, hit.make_matcher, hit.compile_ms,
                              hit.memory_bytes)
