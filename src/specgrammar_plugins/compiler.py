"""Compiling a constraint once per (spec, tokenizer, engine, options): the LRU compile cache, the process-wide
limits (size, compile time, isolation), and the engine policy ``engine="auto"``.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from .constraint import CompiledConstraint, ConstraintSpec, canonical_json
from .errors import ConstraintError
from .nesting import constraint_depth, too_deep
from .tokenizer import TokenizerInfo


# The compile cache's bound in engine-reported bytes (``SPECGRAMMAR_COMPILE_CACHE_MB``); a compiled grammar's RSS
# is about 1.5x what its engine reports (xgrammar 0.2.8: a 20,000-option choice reports 43 MB, holds ~65 MB).
CACHE_BYTES = int(os.environ.get("SPECGRAMMAR_COMPILE_CACHE_MB", "512")) << 20


class CompileCache:
    """LRU of compiled constraints keyed by (spec, tokenizer fingerprint, width, engine, options), bounded in
    entries and in (engine-reported) bytes.  An entry past the bound is still found while something else holds it
    (a live request's matcher or budget: ``_alive``, weak references), so a bound below one grammar never compiles
    it twice for one request (issue 33: vLLM's EngineCore compiles a request's constraint in its grammar thread for
    the budget, and the proposer looks it up again in the engine's step)."""

    def __init__(self, max_entries: int = 256, max_bytes: int | None = None):
        self.max_entries = max_entries
        self.max_bytes = CACHE_BYTES if max_bytes is None else max_bytes
        self._items: OrderedDict[tuple, CompiledConstraint] = OrderedDict()
        self._alive: "weakref.WeakValueDictionary[tuple, CompiledConstraint]" = weakref.WeakValueDictionary()
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
            elif (item := self._alive.get(key)) is not None:  # evicted, but still held elsewhere
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
            self._alive[key] = item
            self._bytes += item.memory_bytes
            while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
                _, ev = self._items.popitem(last=False)
                self._bytes -= ev.memory_bytes

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._alive.clear()
            self._bytes = 0

    def evict(self) -> None:
        """Drop every entry; one that a live request still holds stays found (``_alive``) until it is freed."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


CACHE = CompileCache()
# The default engine per constraint kind (``compile_constraint`` without an engine), chosen by measurement:
# correctness first (no invalid output accepted), then coverage, then compile time.  JSON Schema: ``auto``, i.e.
# llguidance then xgrammar (docs/BENCHMARKS.md, "JSON Schema coverage on the MaskBench dev split": strict mode, 0
# invalid instances accepted, 90.7% of schemas compiled vs xgrammar's ..., compile p50 ~4 ms vs 100 ms to seconds).
# Every other kind keeps xgrammar: it has the fastest regex masks, and llguidance's GBNF (llama.cpp's grammars
# through gbnf_to_lark) refuses " ORDER" after "WHERE age < 276" in the sql workload's grammar, which llama.cpp
# and xgrammar allow (tests/test_llama_cpp_adapter.py::test_greedy_equals_stock_every_k).
DEFAULTS: dict[str, str] = {"json_schema": "auto"}
DEFAULT_ENGINE = "xgrammar"


def default_engine(spec: ConstraintSpec) -> str:
    return DEFAULTS.get(spec.kind, DEFAULT_ENGINE)


@dataclass
class Limits:
    """Process-wide limits, configurable by environment (``SPECGRAMMAR_MAX_CONSTRAINT_BYTES``,
    ``SPECGRAMMAR_COMPILE_TIMEOUT_S``, ``SPECGRAMMAR_COMPILE_ISOLATION``) or by assigning
    ``constraint.LIMITS.<name>``.  How deeply a constraint may nest: ``nesting.MAX_NESTING``
    (``SPECGRAMMAR_MAX_NESTING``, 128).  The cheap bounds on what a constraint may cost (repetition counts,
    choices, rules, properties, item counts, forced lengths) and the per-request preparation deadline:
    ``bounds.BOUNDS`` (issue 33), checked here before any engine runs.

    compile_timeout_s: a compile that takes longer is abandoned: the request gets a ``ConstraintError`` at once.
    With ``engine="auto"`` every engine but the last gets ``auto_try_s`` before the next is tried.
    compile_isolation: how an abandoned compile is stopped, for engines with no resource limits of their own
    (xgrammar, outlines-core, dfa: ``isolate = True``):

    - ``"process"``: the compile runs in a worker process (``compile_worker``), which is killed at the limit: the
      CPU and memory it used are given back at once.  The mlx-lm server plugin turns this on.
    - ``"thread"`` (the library default): the compile runs in a thread; native code cannot be interrupted, so
      the thread finishes in the background and its result is dropped; a pure-Python engine's compile (dfa:
      ``interruptible``) is stopped at the limit instead (``bounds.run_stoppable``).

    llguidance always compiles in-process: its own fuel limits bound every compile and mask (its lexer fuel per
    step: ``SPECGRAMMAR_LLGUIDANCE_STEP_FUEL``, 5M, see ``engines/llguidance_engine.py``).
    """

    max_constraint_bytes: int = int(os.environ.get("SPECGRAMMAR_MAX_CONSTRAINT_BYTES", 1 << 20))
    compile_timeout_s: float = float(os.environ.get("SPECGRAMMAR_COMPILE_TIMEOUT_S", 30.0))
    auto_try_s: float = 2.0
    compile_isolation: str = os.environ.get("SPECGRAMMAR_COMPILE_ISOLATION", "thread")


LIMITS = Limits()
_POOL = None
_SLOW: set[tuple] = set()  # (spec key, tokenizer, engine) that ran out of compile time under "auto"


def _compile_with_timeout(eng, spec, tokenizer, options, timeout: float, deadline=None):
    """``deadline`` (a ``bounds.Deadline``, the request's share for this compile): the compile's CPU (this thread's,
    the compile thread's or the worker process's) and wall-clock time are charged to it, and it is abandoned when
    the deadline is past; without one, ``timeout`` is wall-clock seconds."""
    global _POOL
    prepare = getattr(eng, "prepare", None)
    if prepare is not None:
        # the engine's per-tokenizer set-up (its import, vocabulary index: importing xgrammar imports
        # transformers, 5-15 s on a loaded 2-core machine) is not the grammar's compile: outside the limit
        prepare(tokenizer)
    if deadline is None and (timeout is None or timeout <= 0):
        return eng.compile(spec, tokenizer, options)
    if LIMITS.compile_isolation not in ("process", "thread"):
        raise ConstraintError(f"compile_isolation must be 'process' or 'thread', got {LIMITS.compile_isolation!r}")
    if LIMITS.compile_isolation == "process" and getattr(eng, "isolate", False):
        from .compile_worker import POOL

        return POOL.compile(eng, spec, tokenizer, options, timeout, deadline=deadline)
    # a thread: the "thread" setting, or an engine with limits of its own (llguidance) under "process", which
    # compiles in-process by design (it used to fall through to the error above: "got 'process'")
    if getattr(eng, "interruptible", False):
        return _compile_stoppable(eng, spec, tokenizer, options, timeout, deadline)
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="specgrammar-compile")
    from concurrent.futures import TimeoutError as FutTimeout

    if deadline is None:
        fut = _POOL.submit(eng.compile, spec, tokenizer, options)
        try:
            return fut.result(timeout=timeout)
        except FutTimeout:
            raise ConstraintError(f"compiling took longer than {timeout:g} s (the compile time limit); abandoned",
                                  engine=getattr(eng, "name", None), kind=spec.kind) from None

    def charged():
        with deadline.charging():  # the compile thread's CPU is the request's while it compiles for it
            return eng.compile(spec, tokenizer, options)

    fut = _POOL.submit(charged)
    from .bounds import SLICE_S

    while True:
        try:
            return fut.result(timeout=SLICE_S)
        except FutTimeout:
            if deadline.expired():
                raise ConstraintError(f"compiling used more than {deadline.seconds:g} s of CPU or "
                                      f"{deadline.wall_seconds:g} s of wall-clock time (the compile time limit); "
                                      "abandoned", engine=getattr(eng, "name", None), kind=spec.kind) from None


def _compile_stoppable(eng, spec, tokenizer, options, timeout: float | None, deadline=None):
    """``_compile_with_timeout`` for an engine whose compile is pure Python (``interruptible = True``: the dfa
    engine, interegular's subset construction): past the limit the compile is stopped (``bounds.run_stoppable``),
    not left running.  Before, an abandoned compile ran on in the shared pool: ``(a|b)*a(a|b){25}`` (2^26 DFA
    states) in the vLLM EngineCore's exact budget kept a core busy and its heap growing for as long as the server
    lived (50,000 objects in two minutes), and four such requests would have taken every thread of the pool
    (issue 33)."""
    from .bounds import Deadline, run_stoppable

    limit = deadline if deadline is not None else Deadline(timeout, timeout)
    done, result = run_stoppable(lambda: eng.compile(spec, tokenizer, options), limit)
    if not done:
        what = (f"used more than {deadline.seconds:g} s of CPU or {deadline.wall_seconds:g} s of wall-clock time"
                if deadline is not None else f"took longer than {timeout:g} s")
        raise ConstraintError(f"compiling {what} (the compile time limit); stopped",
                              engine=getattr(eng, "name", None), kind=spec.kind)
    return result


# The engine policy ``engine="auto"``: per constraint kind, the engines to try in order (first that
# compiles wins).  JSON Schema: on the MaskBench dev split (docs/BENCHMARKS.md, "JSON Schema coverage") llguidance
# accepts no invalid instance, compiles the most schemas in strict mode and compiles in ~3 ms where xgrammar takes
# 100 ms to seconds; GBNF: llguidance takes llama.cpp's grammars verbatim (xgrammar needs them rewritten and its
# JSON string rule costs ~100 ms per mask); regex, choice, any-JSON: xgrammar has the fastest masks.
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
                       _checked: bool = False, **options) -> CompiledConstraint:
    """Compile ``spec`` for ``tokenizer`` with ``engine`` (default: ``DEFAULTS`` per kind, else xgrammar; ``"auto"``:
    the policy above), once: later calls hit the cache.

    JSON Schemas are first rewritten exactly (``schema_rewrite.py``: what engines refuse, in forms they enforce;
    spec option ``rewrite=False`` skips it; the result's ``rewrites`` lists them), then checked in strict mode (the
    default; spec option ``strict``): a keyword the engine does not enforce is an error naming it and its JSON
    pointer (see ``schema.py``).  Raises ``ConstraintError`` with the engine's reason for anything it refuses.
    """
    from .bounds import check_cost
    from .emptiness import check_not_empty

    engine = engine or default_engine(spec)
    # _checked: the "auto" policy's call per engine, after its own call made the checks below (the depth scan of
    # an 80 KB schema costs ~1.5 ms, once per engine tried otherwise)
    if not _checked:
        size = len(spec.value.encode("utf-8")) if isinstance(spec.value, str) else len(spec.key())
        if size > LIMITS.max_constraint_bytes:
            raise ConstraintError(f"the constraint is {size} bytes; the limit is {LIMITS.max_constraint_bytes} "
                                  "(SPECGRAMMAR_MAX_CONSTRAINT_BYTES)", engine=engine, kind=spec.kind)
    if cache is not None and engine != "auto":  # compiled before: the checks below passed then (on a large schema
        hit = cache.get(_cache_key(spec, tokenizer, engine, options))  # the depth scan and emptiness walk cost ms)
        if hit is not None:
            return _for_spec(spec, hit)
    try:
        if not _checked:
            why = too_deep(f"the {spec.kind}", constraint_depth(spec.kind, spec.value, spec.syntax))
            if why:  # engines and our walkers recurse per level: bounded before any of them runs
                raise ConstraintError(why, engine=engine, kind=spec.kind)
            check_cost(spec)  # counts, sizes, rules, forced lengths (bounds.py): before any engine or walker
            check_not_empty(spec, engine)  # a language with no string at all: refused before any engine runs
        return _compile_checked(spec, tokenizer, engine, cache, _timeout, options)
    except RecursionError:  # a shape the nesting bound does not measure: still a refusal, never a crash
        raise ConstraintError("the constraint nests too deeply to compile", engine=engine, kind=spec.kind) from None


def _compile_checked(spec: ConstraintSpec, tokenizer: TokenizerInfo, engine: str, cache: CompileCache | None,
                     _timeout: float | None, options: dict) -> CompiledConstraint:
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
                return compile_constraint(spec, tokenizer, name, cache, _timeout=timeout, _checked=True, **options)
            except ConstraintError as e:
                if "preparation time limit" in e.reason:  # the request's deadline: no time for another engine
                    raise
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

    # (compile_constraint looked it up in the cache: a miss)
    t0 = time.perf_counter()
    target, rewrites = spec.without_trigger(), ()
    if spec.kind == "json_schema":
        target, rewrites = _rewritten_schema(target, engine)
    eng = get_engine(engine)
    from .bounds import current

    limit = LIMITS.compile_timeout_s if _timeout is None else _timeout
    d = current()  # the request's deadline (bounds.prepare_deadline), when the host opened one
    prepare = getattr(eng, "prepare", None)
    if prepare is not None and d is not None:  # the engine's per-tokenizer set-up (its import: seconds, once per
        with d.excluded():  # process) is not the request's work: neither its CPU nor its wall-clock time counts
            prepare(tokenizer)
    part = None
    if d is not None:  # the compile's own limit, in CPU seconds, as a share of the request's deadline
        d.check("compiling the constraint", engine=engine, kind=spec.kind)
        part = d.part(limit)
    try:
        hit = _compile_with_timeout(eng, target, tokenizer, options, limit, deadline=part)
    except ConstraintError as e:
        if d is not None and "compile time limit" in e.reason and d.expired():
            raise d.overrun("compiling the constraint", engine=engine, kind=spec.kind) from None
        raise
    except Exception as e:  # an engine's own exception type: report its words under ours
        raise ConstraintError(f"{type(e).__name__}: {e}", engine=engine, kind=spec.kind) from e
    hit.compile_ms = (time.perf_counter() - t0) * 1e3
    hit.rewrites = rewrites
    if cache is not None:
        cache.put(_cache_key(spec, tokenizer, engine, options), hit)
    return _for_spec(spec, hit)


def _cache_key(spec: ConstraintSpec, tokenizer: TokenizerInfo, engine: str, options: dict) -> tuple:
    return (spec.without_trigger().key(), tokenizer.fingerprint, tokenizer.vocab_size, engine,
            canonical_json(sorted(options.items())))


def _for_spec(spec: ConstraintSpec, hit: CompiledConstraint) -> CompiledConstraint:
    """The compiled grammar for ``spec``: itself, or with a trigger a spec that remembers it (free text until the
    trigger, then the grammar)."""
    if spec.trigger is None:
        return hit
    from .trigger import TriggeredMatcher

    return CompiledConstraint(spec, hit.tokenizer, hit.engine, hit.compiled, hit.make_matcher, hit.compile_ms,
                              hit.memory_bytes, wrap=TriggeredMatcher, rewrites=hit.rewrites)


def _rewritten_schema(spec: ConstraintSpec, engine: str) -> tuple[ConstraintSpec, tuple]:
    """The JSON Schema spec an engine compiles: exact rewrites applied (unless ``rewrite=False``), then, in strict
    mode, every keyword checked against what ``engine`` enforces (pointers as in the schema given)."""
    from .schema import DOUBLE_BOUNDS, ENFORCED, LIST_REQUIRED, NO_FALSE_PROPERTIES, require_supported
    from .schema_rewrite import Rewritten, rewrite

    # narrow_bounds: integer bounds past 2^53 narrowed to doubles for llguidance (stricter, not exact; issue 33:
    # int64 bounds sent Kubernetes schemas to xgrammar's 0.3-30 s compiles)
    rw = (rewrite(spec.schema, ENFORCED.get(engine, frozenset()), engine in LIST_REQUIRED,
                  false_properties=engine not in NO_FALSE_PROPERTIES, narrow_bounds=engine in DOUBLE_BOUNDS)
          if spec.option("rewrite", True) else Rewritten(spec.schema))
    if spec.option("strict", True) and engine in ENFORCED:
        require_supported(rw.schema, engine, rw.origins)
    if not rw.rewrites:
        return spec, ()
    text = json.dumps(rw.schema, separators=(",", ":"), ensure_ascii=False)
    return ConstraintSpec("json_schema", text, options=spec.options), rw.rewrites
