"""The outlines-core engine: regex, choice and JSON Schema (through outlines-core's schema-to-regex, which bounds
nesting at ``max_recursion_depth``, default 3).  No context-free grammars, and no any-JSON (see ``regex_for``).

outlines-core's ``Index`` is a token-level DFA (state id x token id -> state id).  The adapter walks it itself and
keeps the state ids: ``fork`` copies a list of ints (``copy.copy`` of a ``Guide`` would pickle the whole index),
``rollback`` drops ids.  Masks are built once per state from ``Index.get_allowed_tokens`` and cached on the
compiled constraint (bounded).  outlines-core has no transition on EOS, so stop tokens are handled here: allowed
exactly in final states, and accepting one terminates.  ``accept_bytes`` spells the bytes with vocabulary tokens
(the index is a DFA over bytes underneath, so any spelling reaches the same state).

An outlines-core 0.2.14 bug is worked around here: ``Index`` drops every transition out of a final state whose
token ends in a non-final state (``x|xyz`` after ``x`` allows only EOS; ``(ab)+`` after ``ab`` refuses ``a``),
because regex-automata reports matches one byte late.  The adapter compiles ``(?:R)\x01`` instead, with a
sentinel token for ``\x01`` (an id past the vocabulary; tokens containing ``\x01`` are left out), so no state
inside ``R`` is final; "may stop here" is "the sentinel has a transition here".  This is exact when ``R`` can never
produce ``\x01`` (checked with the reference DFA; always true of outlines-core's JSON-Schema regexes).  Otherwise
(``.``, negated classes) the plain regex is compiled and the bug remains: such masks may lack tokens that would
continue past a point where the regex could already stop (``OCGrammar.exact`` is False).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..constraint import CompiledConstraint, ConstraintSpec, Forced
from ..masks import mask_words
from ..errors import ConstraintError
from ..tokenizer import TokenizerInfo
from ._common import (
    GreedyBytes, PerTokenizerCache, ascii_shorthands, engine_words, forced_from_masks, no_start_error,
    refuse_empty_choices)

NAME = "outlines_core"
MASK_CACHE_ENTRIES = 1024


SENTINEL = b"\x01"


class _OCTok:
    """outlines-core vocabularies for one tokenizer: the plain one and the sentinel one (built when first used)."""

    def __init__(self, tok: TokenizerInfo):
        self.tok = tok
        self.greedy = GreedyBytes(tok)
        self.sentinel_id = max(tok.vocab_size, len(tok.token_bytes)) + 1
        self._plain = self._sent = None
        self._lock = threading.Lock()

    def _build(self, with_sentinel: bool):
        import outlines_core as oc

        table: dict[bytes, list[int]] = {}
        tok = self.tok
        for i, b in enumerate(tok.token_bytes):
            if b and i not in tok.special_ids and i not in tok.stop_token_ids:
                if with_sentinel and SENTINEL in b:
                    continue
                table.setdefault(b, []).append(i)
        if with_sentinel:
            table[SENTINEL] = [self.sentinel_id]
        return oc.Vocabulary(tok.eos_token_id, table)

    def vocabulary(self, with_sentinel: bool):
        with self._lock:
            if with_sentinel:
                if self._sent is None:
                    self._sent = self._build(True)
                return self._sent
            if self._plain is None:
                self._plain = self._build(False)
            return self._plain


def _can_produce_sentinel(pattern: str) -> bool:
    """Whether the regex may produce the sentinel character anywhere (True when we cannot tell)."""
    from .dfa import CharDFA

    try:
        dfa = CharDFA(pattern)
    except ConstraintError:
        return True
    ch = SENTINEL.decode()
    return any(dfa.step_char(s, ch) is not None for s in dfa.live)


_TOKENIZERS = PerTokenizerCache(_OCTok)


def regex_for(spec: ConstraintSpec, options: dict) -> str:
    if spec.kind in ("regex", "choice"):
        return ascii_shorthands(spec.as_regex())
    if spec.kind not in ("json_schema", "json"):
        raise ConstraintError("outlines_core compiles regex and JSON Schema only", engine=NAME, kind=spec.kind)
    if spec.kind == "json":
        raise ConstraintError("outlines_core has no any-JSON grammar: its schema-to-regex turns {} into a "
                              "~14k-character regex whose token index takes minutes to build on a real vocabulary "
                              "(about 5 min on Qwen2.5); use xgrammar or llguidance for json / json_object",
                              engine=NAME, kind=spec.kind)
    from outlines_core.json_schema import build_regex_from_schema

    refuse_empty_choices(spec, NAME)  # outlines-core 0.2.14 reads an empty enum / anyOf as the empty string
    opts = {**dict(spec.options), **options}
    kw = {}
    if "any_whitespace" in opts:
        kw["whitespace_pattern"] = r"[ \t\n\r]*" if opts["any_whitespace"] else ""
    if "max_recursion_depth" in opts:
        kw["max_recursion_depth"] = int(opts["max_recursion_depth"])
    try:
        return build_regex_from_schema(spec.value, **kw)
    except Exception as e:
        raise ConstraintError(engine_words(e), engine=NAME, kind=spec.kind) from None


class OCGrammar:
    """A compiled index plus the per-state mask cache shared by its matchers."""

    def __init__(self, index, tok: TokenizerInfo, greedy: GreedyBytes, regex: str, sentinel_id: int | None):
        self.index = index
        self.tok = tok
        self.greedy = greedy
        self.regex = regex
        self.sentinel_id = sentinel_id
        self.exact = sentinel_id is not None
        self.initial = index.get_initial_state()
        self.finals = frozenset(index.get_final_states())
        self._can_stop: dict[int, bool] = {}
        self.n_tokens = len(tok.token_bytes)
        self._stops = np.array([s for s in tok.stop_token_ids if s < tok.vocab_size], dtype=np.int64)
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def mask(self, state: int) -> np.ndarray:
        m = self._masks.get(state)
        if m is not None:
            return m
        allowed = np.zeros(mask_words(self.tok.vocab_size) * 32, dtype=bool)
        ids = np.fromiter(self.index.get_allowed_tokens(state) or (), dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.n_tokens)]
        allowed[ids] = True
        allowed[self._stops] = self.can_stop(state)
        m = np.packbits(allowed, bitorder="little").view(np.int32)
        with self._lock:
            self._masks[state] = m
            if len(self._masks) > MASK_CACHE_ENTRIES:
                self._masks.popitem(last=False)
        return m

    def step(self, state: int, token: int) -> int | None:
        return self.index.get_next_state(state, token)

    def can_stop(self, state: int) -> bool:
        """Whether the text so far is a complete match (stop tokens allowed)."""
        r = self._can_stop.get(state)
        if r is None:
            if self.sentinel_id is None:
                r = state in self.finals
            else:
                r = self.index.get_next_state(state, self.sentinel_id) is not None
            self._can_stop[state] = r
        return r


class OutlinesCoreEngine:
    name = NAME
    isolate = True  # index construction has no limit: a worker process probes it under compile_isolation

    def prepare(self, tokenizer: TokenizerInfo) -> None:
        """Import outlines-core and build its per-tokenizer vocabulary (outside the compile time limit)."""
        _TOKENIZERS.get(tokenizer)

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, options: dict) -> CompiledConstraint:
        import outlines_core as oc

        regex = regex_for(spec, options)
        ot = _TOKENIZERS.get(tokenizer)
        # JSON-Schema regexes never produce a raw control character; a user regex is checked
        sentinel = spec.kind in ("json_schema", "json") or not _can_produce_sentinel(regex)
        try:
            if sentinel:
                index = oc.Index(f"(?:{regex})\x01", ot.vocabulary(True))
            else:
                index = oc.Index(regex, ot.vocabulary(False))
        except Exception as e:  # ValueError with the regex parser's / index builder's words
            raise ConstraintError(engine_words(e), engine=NAME, kind=spec.kind) from None
        g = OCGrammar(index, tokenizer, ot.greedy, regex, ot.sentinel_id if sentinel else None)
        if not g.mask(g.initial).any():
            raise no_start_error(NAME, spec.kind)
        return CompiledConstraint(spec, tokenizer, NAME, g, OutlinesCoreMatcher.start)


class OutlinesCoreMatcher:
    """A walk through an outlines-core ``Index``: the list of visited state ids."""

    __slots__ = ("compiled", "g", "tok", "vocab_size", "states", "stop_at")

    def __init__(self, compiled: CompiledConstraint, states: list[int], stop_at: int | None = None):
        self.compiled = compiled
        self.g: OCGrammar = compiled.compiled
        self.tok = compiled.tokenizer
        self.vocab_size = self.tok.vocab_size
        self.states = states
        self.stop_at = stop_at  # index in ``states`` of the state after the stop token

    @classmethod
    def start(cls, compiled: CompiledConstraint) -> "OutlinesCoreMatcher":
        return cls(compiled, [compiled.compiled.initial])

    def fill_mask(self, out: np.ndarray) -> None:
        if self.stop_at is not None:
            out[:] = 0
            return
        out[:] = self.g.mask(self.states[-1])

    def accept(self, token: int) -> bool:
        if self.stop_at is not None or not (0 <= token < self.g.n_tokens):
            return False
        st = self.states[-1]
        if token in self.tok.stop_token_ids:
            if not self.g.can_stop(st):
                return False
            self.states.append(st)
            self.stop_at = len(self.states) - 1
            return True
        if token in self.tok.special_ids:
            return False
        nxt = self.g.step(st, token)
        if nxt is None:
            return False
        self.states.append(nxt)
        return True

    def accept_bytes(self, data: bytes) -> bool:
        if self.stop_at is not None:
            return False
        ids = self.g.greedy(bytes(data))
        if ids is None:
            return False
        st = self.states[-1]
        for t in ids:
            st = self.g.step(st, t)
            if st is None:
                return False
        self.states[-1] = st  # bytes are not a token: they merge into the current position
        return True

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n >= len(self.states):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self.states) - 1} accepted")
        del self.states[len(self.states) - n:]
        if self.stop_at is not None and self.stop_at >= len(self.states):
            self.stop_at = None

    def fork(self) -> "OutlinesCoreMatcher":
        return OutlinesCoreMatcher(self.compiled, list(self.states), self.stop_at)

    def is_terminated(self) -> bool:
        return self.stop_at is not None

    def forced(self) -> Forced:
        return forced_from_masks(self, self.tok)

    def jump_forward(self, limit: int | None = None) -> bytes:
        return b""  # outlines-core has no jump-forward; the forced drafter walks single-token masks

    @property
    def state(self) -> int:
        return self.states[-1]


__all__ = ["OutlinesCoreEngine", "OutlinesCoreMatcher", "OCGrammar"]
