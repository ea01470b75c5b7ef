"""The reference engine: a pure-Python byte-level DFA walk built on interegular, for regular constraints
(``regex`` and ``choice``).

Slow but simple enough to trust: every other engine is checked against it on regexes.  The character DFA from
interegular is walked byte by byte; an incomplete UTF-8 sequence is allowed when some character that starts with
it leads to a live state.  A token is allowed when its bytes lead from the current state to a live state (one
from which an accepting state is reachable); a stop token is allowed when the state accepts.  Masks are computed
by a walk over the sorted vocabulary that prunes every token sharing a dead prefix, and cached per state.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np

from ..constraint import CompiledConstraint, ConstraintSpec, Forced
from ..masks import mask_allows, mask_words
from ..prefix import common_prefix_len
from ..errors import ConstraintError
from ..tokenizer import TokenizerInfo

_UTF8_RANGES = {2: (0x80, 0x7FF), 3: (0x800, 0xFFFF), 4: (0x10000, 0x10FFFF)}


def _utf8_len(lead: int) -> int:
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0  # continuation byte or invalid lead


def _prefix_range(prefix: bytes) -> tuple[int, int] | None:
    """Code points whose UTF-8 encoding starts with ``prefix`` (an incomplete sequence), or None if invalid."""
    n = _utf8_len(prefix[0])
    if n < 2 or len(prefix) >= n:
        return None
    if any(b & 0xC0 != 0x80 for b in prefix[1:]):
        return None
    lo_b = prefix + b"\x80" * (n - len(prefix))
    hi_b = prefix + b"\xbf" * (n - len(prefix))
    lo_r, hi_r = _UTF8_RANGES[n]

    def cp(bs: bytes) -> int:
        v = bs[0] & (0x7F >> n)
        for b in bs[1:]:
            v = (v << 6) | (b & 0x3F)
        return v

    lo, hi = max(cp(lo_b), lo_r), min(cp(hi_b), hi_r)
    # surrogates (U+D800..U+DFFF) have no UTF-8 encoding: ED A0..BF starts none, ED alone only U+D000..U+D7FF
    if lo < 0xD800 <= hi:
        hi = min(hi, 0xD7FF)
    elif lo <= 0xDFFF < hi:
        lo = max(lo, 0xE000)
    elif 0xD800 <= lo <= hi <= 0xDFFF:
        return None
    if lo > hi:
        return None
    return lo, hi


class CharDFA:
    """interegular's FSM with dead states removed and a byte-level step function."""

    def __init__(self, pattern: str):
        import interegular

        try:
            fsm = interegular.parse_pattern(pattern).to_fsm()
        except Exception as e:  # interegular raises its own parse errors and NotImplementedError
            raise ConstraintError(f"{type(e).__name__}: {e}", engine="dfa", kind="regex") from None
        from interegular.fsm import anything_else

        self.initial = fsm.initial
        self.finals = frozenset(fsm.finals)
        self.explicit: dict[str, int] = {c: i for c, i in fsm.alphabet._symbol_mapping.items() if c is not anything_else}
        self.other: int | None = fsm.alphabet._symbol_mapping.get(anything_else)
        self.map = {s: dict(t) for s, t in fsm.map.items()}
        # live states: those that can reach a final state
        rev: dict[int, set[int]] = {}
        for s, trans in self.map.items():
            for nxt in trans.values():
                rev.setdefault(nxt, set()).add(s)
        live = set(self.finals)
        todo = list(self.finals)
        while todo:
            s = todo.pop()
            for p in rev.get(s, ()):
                if p not in live:
                    live.add(p)
                    todo.append(p)
        self.live = frozenset(live)
        if self.initial not in self.live:
            raise ConstraintError("the regex matches no string", engine="dfa", kind="regex")
        self._explicit_sorted = sorted(ord(c) for c in self.explicit)

    def step_char(self, state: int, ch: str) -> int | None:
        sym = self.explicit.get(ch, self.other)
        if sym is None:
            return None
        nxt = self.map.get(state, {}).get(sym)
        return nxt if nxt is not None and nxt in self.live else None

    def can_continue(self, state: int, lo: int, hi: int) -> bool:
        """Some code point in [lo, hi] leads from ``state`` to a live state."""
        trans = self.map.get(state, {})
        i = bisect.bisect_left(self._explicit_sorted, lo)
        j = bisect.bisect_right(self._explicit_sorted, hi)
        for cp in self._explicit_sorted[i:j]:
            nxt = trans.get(self.explicit[chr(cp)])
            if nxt is not None and nxt in self.live:
                return True
        if (hi - lo + 1) > (j - i) and self.other is not None:
            nxt = trans.get(self.other)
            return nxt is not None and nxt in self.live
        return False


State = tuple  # (dfa_state, pending_utf8_bytes)


@dataclass(eq=False)
class _Vocab:
    keys: list[bytes]
    ids: list[int]
    lcp: list[int] = None  # lcp[i]: the common prefix length of keys[i - 1] and keys[i] (0 for the first)

    def __post_init__(self):
        if self.lcp is None:
            self.lcp = [0] + [common_prefix_len(a, b) for a, b in zip(self.keys, self.keys[1:])]


_vocab_cache: dict[str, _Vocab] = {}
_vocab_lock = threading.Lock()


def _sorted_vocab(tok: TokenizerInfo) -> _Vocab:
    with _vocab_lock:
        v = _vocab_cache.get(tok.fingerprint)
        if v is None:
            pairs = sorted((b, i) for i, b in enumerate(tok.token_bytes) if b and i not in tok.special_ids)
            v = _Vocab([p[0] for p in pairs], [p[1] for p in pairs])
            _vocab_cache[tok.fingerprint] = v
        return v


class DFAGrammar:
    """A compiled regex: the DFA plus caches of byte steps and masks, shared by all its matchers."""

    def __init__(self, pattern: str, tokenizer: TokenizerInfo):
        self.dfa = CharDFA(pattern)
        self.tok = tokenizer
        self.vocab = _sorted_vocab(tokenizer)
        self._steps: dict[tuple[State, int], State | None] = {}
        self._masks: dict[State, np.ndarray] = {}
        self._lock = threading.Lock()

    def step(self, st: State, byte: int) -> State | None:
        key = (st, byte)
        if key in self._steps:
            return self._steps[key]
        q, pend = st
        res: State | None
        if not pend:
            n = _utf8_len(byte)
            if n == 1:
                nxt = self.dfa.step_char(q, chr(byte))
                res = None if nxt is None else (nxt, b"")
            elif n == 0:
                res = None
            else:
                r = _prefix_range(bytes([byte]))
                res = (q, bytes([byte])) if r and self.dfa.can_continue(q, *r) else None
        else:
            buf = pend + bytes([byte])
            n = _utf8_len(buf[0])
            if byte & 0xC0 != 0x80:
                res = None
            elif len(buf) == n:
                try:
                    ch = buf.decode("utf-8")
                except UnicodeDecodeError:
                    res = None
                else:
                    nxt = self.dfa.step_char(q, ch)
                    res = None if nxt is None else (nxt, b"")
            else:
                r = _prefix_range(buf)
                res = (q, buf) if r and self.dfa.can_continue(q, *r) else None
        self._steps[key] = res
        return res

    def walk(self, st: State, data: bytes) -> State | None:
        for b in data:
            st = self.step(st, b)
            if st is None:
                return None
        return st

    def accepts(self, st: State) -> bool:
        return not st[1] and st[0] in self.dfa.finals

    def mask(self, st: State) -> np.ndarray:
        m = self._masks.get(st)
        if m is not None:
            return m
        return self._scan(st, None)

    def edges(self, st: State) -> dict[int, State]:
        """{token: the state after it} for every token the DFA allows from ``st`` (stop tokens left out): the same
        pass over the sorted vocabulary as ``mask`` (which it fills too), so a token's walk shares its prefix's
        steps.  ``cost.RegularCost`` builds its token-level graph from it (a walk per allowed token after the mask
        cost it twice as much: 2.9 s for the SQL workload's grammar at SmolLM2's 49,152 tokens)."""
        out: dict[int, State] = {}
        self._scan(st, out)
        return out

    def _scan(self, st: State, edges: dict | None) -> np.ndarray:
        """The mask row of ``st`` (kept), and each allowed token's next state into ``edges`` when given."""
        allowed = np.zeros(mask_words(self.tok.vocab_size) * 32, dtype=bool)
        keys, ids, lcps = self.vocab.keys, self.vocab.ids, self.vocab.lcp
        steps, step = self._steps, self.step
        stack: list[State] = [st]
        i, n = 0, len(keys)
        while i < n:
            tb = keys[i]
            # the prefix shared with the last token walked: lcps[i] with keys[i - 1]; after a skip past a dead
            # head, keys[i - 1] starts with it and the stack holds the states of head[:-1] (so the min is right)
            lcp = min(lcps[i], len(stack) - 1)
            del stack[lcp + 1:]
            cur = stack[lcp]
            dead_at = -1
            for j in range(lcp, len(tb)):
                nxt = steps.get((cur, tb[j]), _MISSING)
                cur = step(cur, tb[j]) if nxt is _MISSING else nxt
                if cur is None:
                    dead_at = j
                    break
                stack.append(cur)
            if dead_at < 0:
                allowed[ids[i]] = True
                if edges is not None:
                    edges[ids[i]] = cur
                i += 1
                continue
            # every token starting with tb[:dead_at+1] is dead too: skip them
            head = tb[: dead_at + 1]
            i = bisect.bisect_left(keys, _successor(head), lo=i + 1) if head[-1] != 0xFF else _skip_ff(keys, head, i)
            del stack[len(head):]
        if self.accepts(st):
            for s in self.tok.stop_token_ids:
                if s < self.tok.vocab_size:
                    allowed[s] = True
        m = np.packbits(allowed, bitorder="little").view(np.int32)
        with self._lock:
            if len(self._masks) > 65536:
                self._masks.clear()
            self._masks[st] = m
        return m


_MISSING = object()


def _successor(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _skip_ff(keys: list[bytes], head: bytes, i: int) -> int:
    i += 1
    while i < len(keys) and keys[i].startswith(head):
        i += 1
    return i


class DFAMatcher:
    def __init__(self, grammar: DFAGrammar, states: list[State] | None = None, terminated: bool = False):
        self.g = grammar
        self.vocab_size = grammar.tok.vocab_size
        self.states: list[State] = states if states is not None else [(grammar.dfa.initial, b"")]
        self.terminated = terminated
        self._stop_at: int | None = None if not terminated else len(self.states) - 1

    def fill_mask(self, out: np.ndarray) -> None:
        if self.terminated:
            out[:] = 0
            return
        out[:] = self.g.mask(self.states[-1])

    def accept(self, token: int) -> bool:
        if self.terminated:
            return False
        st = self.states[-1]
        if token in self.g.tok.stop_token_ids:
            if not self.g.accepts(st):
                return False
            self.states.append(st)
            self.terminated = True
            self._stop_at = len(self.states) - 1
            return True
        if not (0 <= token < len(self.g.tok.token_bytes)) or token in self.g.tok.special_ids:
            return False
        nxt = self.g.walk(st, self.g.tok.token_bytes[token])
        if nxt is None:
            return False
        self.states.append(nxt)
        return True

    def accept_bytes(self, data: bytes) -> bool:
        if self.terminated:
            return False
        nxt = self.g.walk(self.states[-1], data)
        if nxt is None:
            return False
        self.states[-1] = nxt  # bytes are not a token: they merge into the current position
        return True

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n >= len(self.states):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self.states) - 1} accepted")
        del self.states[len(self.states) - n:]
        if self._stop_at is not None and self._stop_at >= len(self.states):
            self.terminated = False
            self._stop_at = None

    def fork(self) -> "DFAMatcher":
        m = DFAMatcher(self.g, list(self.states), self.terminated)
        m._stop_at = self._stop_at
        return m

    def is_terminated(self) -> bool:
        return self.terminated

    def jump_forward(self, limit: int | None = None) -> bytes:
        return b""  # the reference engine walks single-token masks only

    def forced(self) -> Forced:
        """Forced tokens: while exactly one token is allowed and the state cannot stop (at most 32)."""
        from ..masks import allowed_ids

        tokens: list[int] = []
        st = self.states[-1]
        while len(tokens) < 32 and not self.g.accepts(st):
            ids = allowed_ids(self.g.mask(st), self.vocab_size)
            if len(ids) != 1:
                break
            tokens.append(int(ids[0]))
            st = self.g.walk(st, self.g.tok.token_bytes[int(ids[0])])
        return Forced(tuple(tokens), self.g.tok.decode(tokens))

    @property
    def state(self) -> State:
        return self.states[-1]


class DFAEngine:
    name = "dfa"
    isolate = True  # interegular builds the whole DFA: a worker process probes it under compile_isolation
    interruptible = True  # pure Python: under "thread", a compile past its limit is stopped (compiler._StoppableCompile)

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, options: dict) -> CompiledConstraint:
        pattern = spec.as_regex()
        if pattern is None:
            raise ConstraintError(f"the dfa engine compiles regular constraints only (regex, choice), not {spec.kind}",
                                  engine=self.name, kind=spec.kind)
        g = DFAGrammar(pattern, tokenizer)
        return CompiledConstraint(spec, tokenizer, self.name, g, lambda c: DFAMatcher(c.compiled),
                                  memory_bytes=64 * len(g.dfa.map) + 1024)


__all__ = ["DFAEngine", "DFAGrammar", "DFAMatcher", "CharDFA", "mask_allows"]
