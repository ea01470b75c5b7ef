"""Cost-to-go estimators J(h), the tilt lambda*Delta, and the adaptive lambda controller.

    Delta(a) = J(h.a) - J(h) + c(a)        (c = the token's own cost, 1 token by default)
    q_lambda(a | h) ∝ q(a | h) * exp(-lambda(h) * Delta(a))

Costs are counted in TOKENS (the unit of max_tokens), and J includes the stop token: J = 0 once terminated,
J = 1 in a state where the grammar may end.  Delta >= 0, and Delta(a) = 0 exactly for the tokens on a shortest
way to the end, so lambda -> infinity follows a shortest completion.

- ``RegularCost``: exact for regular languages: the fewest tokens from the current DFA state to termination, by a
  backward BFS over the token-level transition graph of the reference DFA engine, precomputed once per compiled
  constraint (cached).  Regular languages are more than regex and choice: ``regular_form`` also gives a regex for
  a JSON Schema without recursion (outlines-core's schema-to-regex: fixed key order, optional single spaces) and
  for a GBNF grammar in which no rule reaches itself (``gbnf.to_regex`` inlines the rules).  There the regex can
  be a sub-language of what the engine enforces (other whitespace, another key order): J is exact while the
  output stays inside it, and ``StructuralCost`` takes over for the request once it leaves.
- ``StructuralCost``: an ESTIMATE for context-free constraints (JSON Schema, any-JSON, GBNF): one token per open
  bracket/string still to close, plus ``prop_cost`` tokens per required JSON-Schema property still missing in each
  open object, plus 1 for the stop token.  Documented as an estimate: the tilt is still an exact law (q_lambda is
  what is sampled, whatever J is); only the budget guarantee is heuristic.
- Users add cost models with the ``register_cost_models`` hook (e.g. a per-token price vector).

The adaptive controller sets lambda per position as a deterministic function of the generated prefix:
    lambda_{t+1} = [lambda_t + eta * (C_hat(h_t) - tau)]_+ ,   C_hat(h) = |h| + J(h) * (1 + w(h))
with tau the budget (remaining max_tokens or a user ``budget``) and w(h) the expected overshoot: the larger of the
overshoot so far, (|h| + J(h) - J(empty)) / max(1, |h|), and ``margin`` (default 0.5: until it shows otherwise, a
model is taken to write half again the shortest completion).  Without the margin the controller only reacts once
the output has overshot, which is too late where an early choice sets the length (which tool to call: a longer
branch chosen at lambda = 0 cannot finish within the budget).  Because lambda depends only on the prefix (not
on round boundaries), the speculative loop's output law equals non-speculative sampling from the same q_lambda,
token for token in law.
Caveat: with lambda > 0 the output law is q_lambda, not the untilted target law.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, Sequence

import numpy as np

from .compiler import compile_constraint
from .constraint import CompiledConstraint, ConstraintSpec
from .prefix import common_prefix_len
from .tokenizer import TokenizerInfo

INF = float("inf")


class CostModel(Protocol):
    """J over generated prefixes. ``delta(generated)`` -> Delta vector [vocab_size] for the next token."""

    def delta(self, generated: Sequence[int]) -> np.ndarray: ...

    def cost_to_go(self, generated: Sequence[int]) -> float: ...


# ------------------------------------------------------------------------------------------- regular: exact
_GRAPHS: dict[tuple, tuple] = {}  # (regex, tokenizer fingerprint) -> (succ, J, Delta rows), oldest dropped first


class RegularCost:
    """Exact fewest-tokens-to-termination for a regular constraint, from the reference DFA engine."""

    def __init__(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, token_cost: np.ndarray | None = None,
                 fallback: "CostModel | None" = None, pattern: str | None = None, deadline=None):
        """``deadline`` (a ``bounds.Deadline``): the DFA's compile and the exploration stop there, with a
        ``ConstraintError`` naming it (default: the request's, else a fresh ``prepare_timeout_s``)."""
        from .bounds import deadline as current_deadline
        from .engines.dfa import DFAGrammar

        self.deadline = deadline if deadline is not None else current_deadline()

        pattern = pattern or regular_form(spec)
        if pattern is None:
            raise ValueError("RegularCost needs a regular constraint (regex, choice, a JSON Schema without "
                             "recursion or a GBNF grammar without recursion)")
        self.tok = tokenizer
        self.width = tokenizer.vocab_size
        self.fallback = fallback  # for outputs that leave a regular sub-language of the constraint
        left = self.deadline.remaining()
        if left <= 0:
            self.deadline.check("the exact budget's DFA")
        self.compiled = compile_constraint(ConstraintSpec.regex(pattern), tokenizer, engine="dfa", _timeout=left)
        g: DFAGrammar = self.compiled.compiled
        self.g = g
        self.token_cost = token_cost
        # Token-level graph over the states reachable at character boundaries.  A token ending inside a
        # multi-byte character leads to a "partial" state (DFA state + pending bytes); those are not expanded
        # here (a free string admits ~10^5 of them: 100+ s on a 1k vocabulary) but on demand when an output
        # reaches one (``_j``).  J is thus the fewest tokens over ways that pass through whole characters,
        # which is every way for ASCII targets; if no such way ends, everything is expanded (capped).
        self.ids = [i for i, b in enumerate(tokenizer.token_bytes) if b and i not in tokenizer.special_ids]
        self._valid = np.zeros(len(tokenizer.token_bytes), dtype=bool)
        self._valid[self.ids] = True
        start = (g.dfa.initial, b"")
        key = (pattern, tokenizer.fingerprint)
        shared = _GRAPHS.get(key)
        if shared is None:  # the graph, J and the Delta rows are per constraint, shared by its requests
            self.succ, self.J, self._delta_cache = {}, {}, {}
            self._explore(start, partial=False)
            if self.J.get(start, INF) == INF:
                self._explore(start, partial=True)
            while len(_GRAPHS) >= 32:
                _GRAPHS.pop(next(iter(_GRAPHS)))
            _GRAPHS[key] = (self.succ, self.J, self._delta_cache)
        else:
            self.succ, self.J, self._delta_cache = shared
        self._hist: list[tuple] = [start]
        self._fed: list[int] = []

    MAX_STATES = 50000

    def _edges(self, st: tuple) -> dict[int, tuple]:
        e = self.succ.get(st)
        if e is None:
            # only the tokens the DFA allows, with their next states, from one trie pass over the sorted vocabulary
            # that prunes dead prefixes (``DFAGrammar.edges``): walking every token from every state costs |V|
            # walks per state (seconds on a 151k vocabulary)
            valid = self._valid
            e = {t: n for t, n in self.g.edges(st).items() if t < len(valid) and valid[t]}
            self.succ[st] = e
        return e

    def _explore(self, start: tuple, partial: bool) -> None:
        seen = {start}
        todo = deque([start])
        while todo:
            st = todo.popleft()
            # the exploration is pure Python: it answers to the request's deadline at every state (one state's
            # edges cost up to ~0.1 s at 151,936 tokens; a check every 64 states let a slow run go on for seconds
            # past it: 12 min under a profiler for the SQL workload's grammar)
            self.deadline.check("the exact budget's token-level graph (cost.RegularCost)")
            for n in self._edges(st).values():
                if n not in seen and (partial or not n[1]):
                    seen.add(n)
                    todo.append(n)
                    if len(seen) > self.MAX_STATES:
                        raise ValueError(f"more than {self.MAX_STATES} token-level states")
        # J by backward BFS (unit token costs): J(s) = 1 if s accepts (the stop token), else 1 + min J(next)
        rev: dict[tuple, set] = {}
        for s in seen:
            for n in self.succ[s].values():
                if n in seen:
                    rev.setdefault(n, set()).add(s)
        J = {s: INF for s in seen}
        q = deque()
        for s in seen:
            if self.g.accepts(s):
                J[s] = 1.0
                q.append(s)
        while q:
            s = q.popleft()
            for p in rev.get(s, ()):
                if J[p] > J[s] + 1:
                    J[p] = J[s] + 1
                    q.append(p)
        self.J.update(J)

    def _j(self, st: tuple, depth: int = 0) -> float:
        """J of a state, expanding a partial one on demand (a few tokens finish its character)."""
        j = self.J.get(st)
        if j is None:
            j = INF
            if depth < 4:
                for n in self._edges(st).values():
                    j = min(j, 1.0 + self._j(n, depth + 1))
            self.J[st] = j
        return j

    def _state(self, generated: Sequence[int]) -> tuple | None:
        fed = self._fed
        lcp = common_prefix_len(fed, generated)
        del fed[lcp:]
        del self._hist[lcp + 1:]
        for t in generated[lcp:]:
            st = self._hist[-1]
            if st is None:
                nxt = None
            elif t in self.tok.stop_token_ids:
                nxt = ("<end>",) if self.g.accepts(st) else None
            else:
                nxt = self._edges(st).get(int(t)) if st != ("<end>",) else None
            fed.append(int(t))
            self._hist.append(nxt)
        return self._hist[-1]

    def cost_to_go(self, generated: Sequence[int]) -> float:
        st = self._state(generated)
        if st == ("<end>",):
            return 0.0
        if st is None and self.fallback is not None:
            return self.fallback.cost_to_go(generated)
        return INF if st is None else self._j(st)

    def delta(self, generated: Sequence[int]) -> np.ndarray:
        st = self._state(generated)
        if st is None and self.fallback is not None:
            return self.fallback.delta(generated)
        if st is None or st == ("<end>",):
            return np.zeros(self.width)
        if self.fallback is not None:
            # tokens the sub-language lacks but the engine may allow (other whitespace, another key order): they
            # are off every shortest way, so Delta >= 1; the estimate's Delta above that.  Not forbidden outright
            # as masked tokens are (1e9), which a small lambda would do.  Not cached: the estimate is per prefix.
            d = self._fill(st, np.maximum(self.fallback.delta(generated), 1.0))
        else:
            d = self._delta_cache.get(st)
            if d is None:
                d = self._delta_cache[st] = self._fill(st, np.full(self.width, 1e9))  # forbidden: masked anyway
        if self.token_cost is not None:
            return d + self.token_cost - 1.0
        return d

    def _fill(self, st: tuple, d: np.ndarray) -> np.ndarray:
        """``d`` with the exact Delta of every token the DFA allows in ``st`` (and of the stop tokens)."""
        j = self._j(st)
        for t, n in self._edges(st).items():
            d[t] = self._j(n) - j + 1.0
        if self.g.accepts(st):
            for s in self.tok.stop_token_ids:
                if s < self.width:
                    d[s] = 0.0 - j + 1.0
        return d


def regular_form(spec: ConstraintSpec) -> str | None:
    """A regex for the constraint's language (or a regular sub-language of it) when there is one: regex and choice
    as given, a JSON Schema through outlines-core's schema-to-regex (exact without recursion; recursion unrolled to
    its depth limit is a sub-language), a GBNF grammar whose rules never reach themselves through
    ``gbnf.to_regex``.  None otherwise (recursive GBNF, Lark/EBNF, any-JSON)."""
    pattern = spec.as_regex()
    if pattern is not None:
        return pattern
    if spec.kind == "json_schema":
        try:  # the outlines-core engine's own schema-to-regex (recursion unrolled to its depth limit)
            from .engines.outlines_core_engine import regex_for

            pattern = regex_for(spec, {})
        except Exception:  # a keyword it lacks, or outlines-core not installed
            return None
        return pattern if len(pattern) <= 20000 else None
    if spec.kind == "grammar" and spec.syntax == "gbnf":
        from .gbnf import to_regex

        try:
            return to_regex(spec.value)
        except RecursionError:  # rules chained deeper than Python's stack: not read as regular (certified instead)
            return None
    return None


# ------------------------------------------------------------------------------------------- CFG: an estimate
class _Scan:
    """Incremental scanner of JSON-ish text: open containers/strings, what is owed next (a value after ':' or an
    array ',', a key after an object ',', the ':' after a key), per open object the keys seen, the last byte and
    the open string's bytes so far (``str_buf``)."""

    __slots__ = ("stack", "in_str", "esc", "key_buf", "expect_key", "owed_value", "need_colon", "last", "str_buf")

    def __init__(self):
        self.stack: list[list] = []  # [kind, keys_seen(set) or None]
        self.in_str = False
        self.esc = False
        self.key_buf: bytearray | None = None
        self.expect_key = False
        self.owed_value = False
        self.need_colon = False
        self.last = 0
        self.str_buf = bytearray()

    def copy(self) -> "_Scan":
        c = _Scan.__new__(_Scan)
        c.stack = [[k, set(s) if s is not None else None] for k, s in self.stack]
        c.in_str, c.esc, c.expect_key = self.in_str, self.esc, self.expect_key
        c.owed_value, c.need_colon, c.last = self.owed_value, self.need_colon, self.last
        c.key_buf = bytearray(self.key_buf) if self.key_buf is not None else None
        c.str_buf = bytearray(self.str_buf)
        return c

    def feed(self, data: bytes) -> None:
        if data:
            self.last = data[-1]
        for b in data:
            if self.in_str:
                if b != 0x22 or self.esc:
                    self.str_buf.append(b)
                if self.esc:
                    self.esc = False
                elif b == 0x5C:
                    self.esc = True
                elif b == 0x22:
                    self.in_str = False
                    if self.key_buf is not None:
                        if self.stack and self.stack[-1][0] == "{":
                            self.stack[-1][1].add(self.key_buf.decode("utf-8", "replace"))
                        self.need_colon = True
                    self.key_buf = None
                elif self.key_buf is not None:
                    self.key_buf.append(b)
                continue
            if b in (0x20, 0x0A, 0x0D, 0x09):
                continue
            if b == 0x22:
                self.in_str = True
                self.str_buf = bytearray()
                self.key_buf = bytearray() if self.expect_key else None
                self.expect_key = False
                self.owed_value = False
            elif b in (0x7B, 0x5B, 0x28):  # { [ (
                self.stack.append([chr(b), set() if b == 0x7B else None])
                self.expect_key = b == 0x7B
                self.owed_value = False
            elif b in (0x7D, 0x5D, 0x29):
                if self.stack:
                    self.stack.pop()
                self.expect_key = self.owed_value = False
            elif b == 0x2C:  # ,
                in_obj = bool(self.stack) and self.stack[-1][0] == "{"
                self.expect_key = in_obj
                self.owed_value = not in_obj
            elif b == 0x3A:  # :
                self.need_colon = False
                self.expect_key = False
                self.owed_value = True
            else:  # a number/literal byte: the owed value is being given
                self.owed_value = False


class StructuralCost:
    """Estimated tokens to termination for JSON / CFG output: closers + missing required properties + stop."""

    def __init__(self, tokenizer: TokenizerInfo, spec: ConstraintSpec | None = None, prop_cost: float = 5.0,
                 token_cost: np.ndarray | None = None):
        self.tok = tokenizer
        self.width = tokenizer.vocab_size
        self.prop_cost = prop_cost
        self.token_cost = token_cost
        self.required: list[str] = []
        if spec is not None and spec.kind == "json_schema":
            schema = spec.schema
            if isinstance(schema, dict):
                self.required = list(schema.get("required", []))
                branches = schema.get("anyOf") or schema.get("oneOf")
                if not self.required and isinstance(branches, list) and branches:
                    # a choice of object shapes: the properties every branch requires (a lower bound)
                    reqs = [set(b.get("required", [])) if isinstance(b, dict) else set() for b in branches]
                    common = set.intersection(*reqs)
                    first = branches[0].get("required", []) if isinstance(branches[0], dict) else []
                    self.required = [k for k in first if k in common]
        # a missing property costs at least what its cheapest spelling takes in this tokenizer: , "key": ""
        enc = tokenizer.encode
        self._enc_cache: dict[str, int] = {}
        self.key_cost = {k: max(prop_cost, float(self._ntok(f', "{k}": ""'))) if enc else prop_cost
                         for k in self.required}
        structural = set(b'{}[]()",:\\')
        self.struct_ids = np.array([i for i, b in enumerate(tokenizer.token_bytes) if any(c in structural for c in b)],
                                   dtype=np.int64)
        self._fed: list[int] = []
        self._scans: list[_Scan] = [_Scan()]
        self._started = False
        self._ended: list[bool] = [False]

    def _sync(self, generated: Sequence[int]) -> _Scan:
        fed = self._fed
        lcp = common_prefix_len(fed, generated)
        del fed[lcp:]
        del self._scans[lcp + 1:]
        del self._ended[lcp + 1:]
        for t in generated[lcp:]:
            sc = self._scans[-1].copy()
            ended = self._ended[-1] or int(t) in self.tok.stop_token_ids
            if not ended and 0 <= t < len(self.tok.token_bytes):
                sc.feed(self.tok.token_bytes[int(t)])
            fed.append(int(t))
            self._scans.append(sc)
            self._ended.append(ended)
        return self._scans[-1]

    def _j(self, sc: _Scan, ended: bool, started: bool) -> float:
        """1 (stop) + one closer per open container/string + the ':' and the value owed after a key + 2 per owed
        value (the cheapest value may take two tokens, '""') + ``prop_cost`` (quote, quote, ':', value) per
        property still owed: one after an object ',', and each required top-level property not begun.  Whitespace
        changes nothing, so it is never on a shortest way."""
        if ended:
            return 0.0
        key_in_progress = sc.in_str and sc.key_buf is not None
        j = 1.0 + len(sc.stack) + (1.0 if sc.in_str else 0.0)
        if sc.need_colon or key_in_progress:
            j += 3.0  # ':' then a value
        elif sc.owed_value:
            j += 2.0
        owed_key = sc.expect_key and bool(sc.stack) and len(sc.stack[-1][1] or ()) > 0
        if owed_key:
            j += self.prop_cost
        if not started:  # nothing yet: the top-level value still to open and fill
            return j + 2.0 + sum(self.key_cost.values())
        if sc.stack and sc.stack[0][0] == "{" and self.required:
            missing = [k for k in self.required if k not in sc.stack[0][1]]
            if len(sc.stack) == 1 and key_in_progress:
                prefix = bytes(sc.key_buf).decode("utf-8", "replace")
                cand = [k for k in missing if k.startswith(prefix)]
                if cand:  # the key being written is one of them: what is left of its name
                    missing.remove(cand[0])
                    rest = cand[0][len(prefix):]
                    j += self._ntok(rest) if rest else 0.0
            elif len(sc.stack) == 1 and owed_key and missing:
                j += self.key_cost[missing.pop(0)] - self.prop_cost  # the owed key is one of them
            j += sum(self.key_cost[k] for k in missing)
        return j

    def _ntok(self, text: str) -> float:
        n = self._enc_cache.get(text)
        if n is None:
            n = len(self.tok.encode(text)) if self.tok.encode is not None else max(1, len(text) // 3)
            self._enc_cache[text] = n
        return float(n)

    def cost_to_go(self, generated: Sequence[int]) -> float:
        sc = self._sync(generated)
        return self._j(sc, self._ended[-1], bool(generated))

    def delta(self, generated: Sequence[int]) -> np.ndarray:
        sc = self._sync(generated)
        ended = self._ended[-1]
        j0 = self._j(sc, ended, bool(generated))
        d = np.ones(self.width)  # tokens with no structural byte leave J as it is (an estimate)
        if not generated:
            d[:] = 1.0
        for t in self.struct_ids:
            s2 = sc.copy()
            s2.feed(self.tok.token_bytes[t])
            d[t] = self._j(s2, False, True) - j0 + 1.0
        for s in self.tok.stop_token_ids:
            if s < self.width:
                d[s] = 0.0 - j0 + 1.0
        if self.token_cost is not None:
            d = d + self.token_cost - 1.0
        return d


def cost_model_for(compiled: CompiledConstraint, token_cost: np.ndarray | None = None) -> CostModel:
    """The built-in cost model for a compiled constraint: exact for regular ones, an estimate otherwise."""
    spec = compiled.spec
    pattern = regular_form(spec)
    if pattern is not None:
        # a regex of a regular sub-language (JSON Schema, GBNF) needs the estimate for outputs that leave it
        fallback = None if spec.as_regex() is not None else StructuralCost(compiled.tokenizer, spec,
                                                                            token_cost=token_cost)
        try:
            return RegularCost(spec, compiled.tokenizer, token_cost, fallback=fallback, pattern=pattern)
        except Exception:  # e.g. a regex interegular cannot read: fall back to the estimate
            pass
    return StructuralCost(compiled.tokenizer, spec, token_cost=token_cost)


# ------------------------------------------------------------------------------------------- the tilt
class Tilt:
    """``tilt_fn`` for the loop: lambda(h) * Delta(h, .), with lambda fixed or set by the adaptive controller.

    lambda is a deterministic function of the generated prefix (history-keyed, cached per prefix), so the law at
    every position does not depend on how drafting split the output into rounds.
    """

    def __init__(self, cost: CostModel, *, lam: float = 0.0, adaptive: bool = False, budget: int | None = None,
                 eta: float = 8.0, lam_max: float = 50.0, margin: float = 0.5):
        if lam < 0:
            raise ValueError("lambda must be >= 0")
        if adaptive and budget is None:
            raise ValueError("the adaptive controller needs a budget (max_tokens or specgrammar.budget)")
        self.cost = cost
        self.lam0 = float(lam)
        self.adaptive = adaptive
        self.budget = budget
        self.eta = eta
        self.lam_max = lam_max
        if margin < 0:
            raise ValueError("margin must be >= 0")
        self.margin = float(margin)
        self._lams: list[float] = [self.lam0]  # lambda at position t (before token t)
        self._fed: list[int] = []
        self._j0: float | None = None
        self.max_lam = self.lam0

    def lam_at(self, generated: Sequence[int]) -> float:
        if not self.adaptive:
            return self.lam0
        fed = self._fed
        lcp = common_prefix_len(fed, generated)
        del fed[lcp:]
        del self._lams[lcp + 1:]
        if self._j0 is None:
            self._j0 = self.cost.cost_to_go([])
        for i in range(lcp, len(generated)):
            fed.append(int(generated[i]))
            h = generated[: i + 1]
            j = self.cost.cost_to_go(h)
            if not np.isfinite(j):
                j = self._j0
            w = max(self.margin, (len(h) + j - self._j0) / max(1, len(h)))
            c_hat = len(h) + j * (1.0 + w)
            # the budget counts the stop token too: aim one under it
            lam = min(self.lam_max, max(0.0, self._lams[-1] + self.eta * (c_hat - (self.budget - 1))))
            self._lams.append(lam)
            self.max_lam = max(self.max_lam, lam)
        return self._lams[len(generated)]

    def __call__(self, generated: Sequence[int], matcher=None) -> np.ndarray | None:
        lam = self.lam_at(generated)
        if lam == 0.0:
            return None
        d = self.cost.delta(generated)
        return lam * np.minimum(d, 1e6)

    def report(self, generated: Sequence[int]) -> dict:
        return {"lambda": self.lam_at(generated), "lambda_max": self.max_lam, "adaptive": self.adaptive,
                "budget": self.budget}


def make_tilt(compiled: CompiledConstraint | None, *, lam: float | None = None, adaptive: bool = False,
              budget: int | None = None, max_tokens: int | None = None, cost: str = "auto",
              **cost_options) -> Tilt | None:
    """What adapters call with a request's ``specgrammar`` options: None unless cost-awareness is asked for.
    ``cost`` names a cost model registered through the ``register_cost_models`` hook."""
    if compiled is None or (not adaptive and not lam):
        return None
    from .errors import RequestError
    from .plugins import cost_models

    reg = cost_models()
    if cost not in reg:
        raise RequestError(f"unknown cost model {cost!r}; available: {', '.join(sorted(reg))}")
    return Tilt(reg[cost](compiled, **cost_options), lam=lam or 0.0, adaptive=adaptive,
                budget=budget if budget is not None else max_tokens)


__all__ = ["CostModel", "RegularCost", "StructuralCost", "Tilt", "cost_model_for", "make_tilt", "regular_form"]
