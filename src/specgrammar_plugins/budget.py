"""Budget feasibility: with a budget B (``max_tokens``, or ``specgrammar.budget`` when smaller), a token is allowed
at a position only if some completion of the constraint still fits in the tokens left after it.

    r = B - |h|                  tokens left at the position after the generated prefix h (the stop token counts)
    a allowed  <=>  the grammar allows a  and  U(h.a) <= r - 1
    U(x) = tokens still needed after x to end (stop token included; 0 once ended)

Then an output ends complete (and valid) within B whenever U(empty) <= B, and a request with U(empty) > B is
refused up front (``BudgetError``, naming the length).  ``make_budget`` picks one of two bounds per request:

- **exact** (``ExactBudget``): where the constraint's language is the regular language the project has the DFA of
  (regex and choice on every engine; a GBNF grammar without recursion, rules inlined; a JSON Schema without
  recursion on the outlines-core engine, whose language is that same regex), U = J, the fewest tokens to the end
  from ``cost.RegularCost`` (exact over ways through whole characters: every way for ASCII; partial UTF-8 states
  are expanded on demand, else counted as unreachable, which only ever forbids more).  The restriction is part of
  the position's mask row (``DraftBlock.mask``: filled once, then cut): the forced drafter, the draft laws and the
  target law all read the same combined row, so speculation stays exact, and the output law is the target's
  per-step law under the grammar-and-budget mask for every sampling option.  It binds only where the budget is
  tight: per DFA state the largest one-token step is known, and the row is cut only when r falls below it.
- **certified** (``CertifiedBudget``): every other constraint (JSON Schema on xgrammar / llguidance, recursive
  grammars, any-JSON).  U(x) is the length of a *certificate*: a completion that a fork of the request's own
  matcher accepts through the stop token (on xgrammar, token by token from its own masks too: a host samples from
  those), so it never claims room that is not there.  Certificates come from (in
  this order) the parent's certificate when x follows it (free), the parent's certificate text when the token
  spells a prefix of it, the parent's whole certificate after the token (tokens that leave the structure as it
  was: string content, digits), and a greedy walk on the engine's own masks (jump-forward bytes, closers first,
  the schema's property names at a key, single bytes otherwise: for a byte-level vocabulary a completion of n
  bytes is at most n tokens; the walk's text is then re-spelled with longer tokens and certified again).  Checking
  every token this way at every position would cost a certificate per vocabulary entry, so the check runs on
  candidates in the model's order of preference instead (``draw``): the law picks a token from the grammar row; if
  it does not fit it is struck from the row and the law picks again, with a fresh uniform (the loop does this
  after verification, ``SpeculativeLoop._settle``).  Greedy: the first feasible token in argmax order.  Without
  top-k / top-p / min-p this is exactly the law under the mask row AND {feasible}: striking a token and drawing
  again from the renormalized law is sampling without replacement, and the first feasible token so drawn has
  probability w(a) / sum of w over the feasible tokens (Luce's choice axiom).  With those filters the filters are
  re-applied to the struck row, which may differ from filtering the feasible row.  Consistency: the certificate's
  own next token always fits, so a request that starts feasible stays feasible.

Both bounds are deterministic functions of the prefix (and B), so speculative and plain decoding see the same
combined law: greedy outputs are identical token for token.  A deferred trigger (free text before the grammar) is
not budgeted (``make_budget`` returns None).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from .bounds import deadline as current_deadline
from .bounds import run_stoppable
from .constraint import CompiledConstraint
from .cost import RegularCost, _Scan, regular_form
from .engines._common import GreedyBytes, PerTokenizerCache
from .errors import BudgetError
from .history import HistoryMatcher
from .masks import allowed_among, clear_bit, mask_allows, mask_words, pack_mask, set_bit
from .schema_rewrite import FORMAT_PATTERNS
from .tokenizer import TokenizerInfo

INF = float("inf")


class Budget:
    """What the block and the loop ask of a budget (both bounds implement it).

    ``restrict(row, generated)`` cuts the packed grammar row of the position after ``generated`` in place and
    says whether it removed a token; ``settles``: whether committed tokens must be checked with ``feasible`` /
    ``draw`` (the certified bound); ``shortest``: U(empty).  The tokens left at a position are
    ``r = budget - len(generated)``."""

    mode = "off"
    settles = False

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.shortest: float = INF
        self.cut_rows = 0  # rows the budget cut (exact) or positions whose first choice did not fit (certified)
        self.struck = 0  # candidates struck from a row by ``draw`` (certified)
        self.shaped = 0  # committed positions whose choice the budget restricted
        self.ns = 0

    def restrict(self, row: np.ndarray, generated: Sequence[int]) -> bool:
        return False

    def feasible(self, generated: Sequence[int], token: int) -> bool:
        raise NotImplementedError

    def draw(self, generated: Sequence[int], row: np.ndarray, sample: Callable[[np.ndarray], int],
             first: int | None = None) -> int:
        """A token from the law restricted to the feasible tokens: ``sample(row)`` draws from the law under a
        packed row (a fresh uniform per call); a token that does not fit is cleared from (a copy of) the row and
        the law draws again.  ``first``: a token already drawn from ``row`` (the verifier's)."""
        t = sample(row) if first is None else int(first)
        if self.feasible(generated, t):
            return t
        row = np.array(row, copy=True)
        self.cut_rows += 1
        while True:
            clear_bit(row, t)
            self.struck += 1
            if not row.any():  # cannot happen while the request is feasible (the certificate's token fits)
                raise RuntimeError("internal error: the budget struck every token the grammar allows")
            t = sample(row)
            if self.feasible(generated, t):
                return t

    def mask_row(self, row: np.ndarray, generated: Sequence[int], margin: int = 0, whole: bool = True,
                 far: str = "open") -> bool:
        """For hosts that can only mask the target's row (vLLM's structured-output bitmask), never re-draw: cut
        ``row`` in place to tokens that keep a completion within the budget; whether it removed one.  Exact: the
        same cut as ``restrict``.  Certified: see ``CertifiedBudget.mask_row``.  ``whole``: ``row`` is the
        grammar's whole row (False: some tokens to check, e.g. a draft alone)."""
        return self.restrict(row, generated)

    def report(self) -> dict:
        return {"mode": self.mode, "budget": self.budget,
                "shortest": None if self.shortest == INF else int(self.shortest),
                "cut_rows": self.cut_rows, "struck": self.struck, "shaped_positions": self.shaped,
                "shaped": self.shaped > 0, "us": round(self.ns / 1e3, 1)}


# ------------------------------------------------------------------------------------------- exact
def exact_pattern(compiled: CompiledConstraint) -> str | None:
    """The regex whose language *is* the compiled constraint's (so J from its DFA is exact), or None: regex and
    choice; GBNF without recursion (``gbnf.to_regex`` inlines its rules); a JSON Schema on the outlines-core
    engine, which compiles exactly ``regular_form``'s regex."""
    spec = compiled.spec
    pattern = spec.as_regex()
    if pattern is not None:
        return pattern
    if spec.kind == "grammar" and spec.syntax == "gbnf":
        return regular_form(spec)
    if spec.kind == "json_schema" and compiled.engine == "outlines_core":
        pattern = regular_form(spec)
        if pattern is not None and pattern == getattr(compiled.compiled, "regex", None):
            return pattern
    return None


_EXACT_ROWS: dict = {}  # (pattern, tokenizer, width) -> (ExactBudget rows, largest Delta per state)


class ExactBudget(Budget):
    """U = J from the constraint's DFA (``cost.RegularCost``): the cut is part of the mask row."""

    mode = "exact"

    def __init__(self, compiled: CompiledConstraint, budget: int, pattern: str, deadline=None):
        super().__init__(budget)
        self.cost = RegularCost(compiled.spec, compiled.tokenizer, pattern=pattern, deadline=deadline)
        self.width = compiled.tokenizer.vocab_size
        self.shortest = self.cost.cost_to_go([])
        # both depend on the constraint alone (not the request's budget or prefix): shared by its requests, as
        # the cost's graph is (a served constraint's rows are built once, not per request)
        shared = _EXACT_ROWS.get((pattern, compiled.tokenizer.fingerprint, self.width))
        if shared is None:
            while len(_EXACT_ROWS) >= 32:
                _EXACT_ROWS.pop(next(iter(_EXACT_ROWS)))
            shared = _EXACT_ROWS[(pattern, compiled.tokenizer.fingerprint, self.width)] = ({}, {})
        self._rows: dict[tuple, np.ndarray] = shared[0]  # (state, k) -> packed row of the tokens with Delta <= k
        self._dmax: dict[tuple, float] = shared[1]  # state -> the largest finite Delta of a token the DFA allows

    def _k(self, generated: Sequence[int]):
        """(state, k): a token fits iff Delta <= k = r - J (Delta = J(next) - J + 1: J(next) <= r - 1)."""
        st = self.cost._state(generated)
        if st is None or st == ("<end>",):
            return None, 0
        return st, self.budget - len(generated) - self.cost._j(st)

    def restrict(self, row: np.ndarray, generated: Sequence[int]) -> bool:
        t0 = time.perf_counter_ns()
        try:
            st, k = self._k(generated)
            if st is None:
                return False
            dmax = self._dmax.get(st)
            if dmax is None:
                d = self.cost.delta(generated)
                allowed = d[d != 1e9]  # 1e9: the DFA forbids it; inf: allowed, no end found (never fits)
                dmax = self._dmax[st] = float(allowed.max()) if len(allowed) else 0.0
            if dmax <= k:  # every token the DFA allows here still fits: the budget does not bind
                return False
            key = (st, int(k))
            fits = self._rows.get(key)
            if fits is None:
                d = self.cost.delta(generated)
                fits = pack_mask(np.asarray(d <= k)[: self.width])
                if len(self._rows) > 4096:
                    self._rows.clear()
                self._rows[key] = fits
            n = min(len(row), len(fits))
            cut = bool(np.any(row[:n] & ~fits[:n]))
            if cut:
                np.bitwise_and(row[:n], fits[:n], out=row[:n])
                self.cut_rows += 1
            return cut
        finally:
            self.ns += time.perf_counter_ns() - t0

    def feasible(self, generated: Sequence[int], token: int) -> bool:
        st, k = self._k(generated)
        if st is None:
            return True
        return bool(self.cost.delta(generated)[token] <= k)


# ------------------------------------------------------------------------------------------- certified
_PRIORITY = b'}]0",:[{ntf-123456789abcdefghijklmopqrsuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ._+eE/@#$%&*=!?;<>()|~^`\'\\'
_WHITESPACE = b" \t\n\r"


def _closing_quote(data: bytes, esc: bool = False) -> int:
    """The index of the quote that closes the string ``data`` is in (``esc``: after a backslash), or -1."""
    for i, b in enumerate(data):
        if esc:
            esc = False
        elif b == 0x5C:
            esc = True
        elif b == 0x22:
            return i
    return -1


def _squeezed(data: bytes, in_str: bool = False, esc: bool = False) -> bytes:
    """``data`` without the JSON whitespace it has outside strings (``in_str`` / ``esc``: the string state before
    it)."""
    if not in_str and not any(b in _WHITESPACE for b in data):
        return data
    out, i = bytearray(), 0
    while i < len(data):
        if in_str:  # (to the string's closing quote, kept whole)
            q = _closing_quote(data[i:], esc)
            if q < 0:
                out += data[i:]
                break
            out += data[i:i + q + 1]
            i, in_str, esc = i + q + 1, False, False
            continue
        b = data[i]
        i += 1
        if b not in _WHITESPACE:
            out.append(b)
            in_str = b == 0x22
    return bytes(out)


_PLAIN_FIRST = b";)]}'\">.!?,"


def _objects(schema, depth: int = 0):
    """Every JSON object (dict) inside a schema, depth-first (64 levels at most)."""
    if depth > 64:
        return
    if isinstance(schema, dict):
        yield schema
        children = schema.values()
    elif isinstance(schema, list):
        children = schema
    else:
        return
    for v in children:
        yield from _objects(v, depth + 1)


def schema_names(schema) -> list[str]:
    """Property names a JSON Schema mentions: those some ``required`` list names first, then the others (a walk
    at an object key tries them before an empty key, so that an object with a required key and additional
    properties allowed is closed by naming the key, not by adding empty ones forever)."""
    required: dict[str, None] = {}
    other: dict[str, None] = {}
    for node in _objects(schema):
        if isinstance(node.get("required"), list):
            required.update((k, None) for k in node["required"] if isinstance(k, str))
        if isinstance(node.get("properties"), dict):
            other.update((k, None) for k in node["properties"] if isinstance(k, str))
    return list(required) + [k for k in other if k not in required]


# a short value of each string format the engines check (JSON Schema's ``format``)
FORMAT_EXAMPLES = {"date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z",
                   "email": "a@b.co", "uri": "a:b", "uri-reference": "a", "uuid": "00000000-0000-0000-0000-000000000000",
                   "ipv4": "0.0.0.0", "ipv6": "::", "hostname": "a", "duration": "P1D"}


SHORTEST_MATCH_S = 0.5  # CPU seconds for one pattern's DFA (a date-time format's pattern: 0.03 s)
_SHORTEST: "OrderedDict[str, str | None]" = OrderedDict()  # pattern -> its shortest match (LRU, 1,024)
_SHORTEST_LOCK = threading.Lock()


def shortest_match(pattern: str, limit: int = 64) -> str | None:
    """The shortest string a regex (a JSON Schema ``pattern``) matches, by breadth-first search over its DFA
    (interegular), preferring letters and digits per step; None when it cannot be read, or when its DFA takes more
    than ``SHORTEST_MATCH_S`` of the request's CPU (``(a|b)*a(a|b){25}``: 2^26 states; the construction is stopped,
    issue 33: before, it ran on without end in the preparing thread, past the request's deadline)."""
    with _SHORTEST_LOCK:
        if pattern in _SHORTEST:
            _SHORTEST.move_to_end(pattern)
            return _SHORTEST[pattern]
    d = current_deadline()
    share = min(SHORTEST_MATCH_S, d.cpu_left())
    out = _shortest_match(pattern, limit, d.part(share))
    if out is not None or share >= SHORTEST_MATCH_S:  # (not an overrun of a share cut short by this request)
        with _SHORTEST_LOCK:
            _SHORTEST[pattern] = out
            while len(_SHORTEST) > 1024:
                _SHORTEST.popitem(last=False)
    return out


def _shortest_match(pattern: str, limit: int, deadline) -> str | None:
    import interegular
    from interegular.fsm import anything_else

    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    try:
        done, fsm = run_stoppable(lambda: interegular.parse_pattern(body).to_fsm(), deadline)
    except Exception:
        return None
    if not done:
        return None
    chars: dict[int, str] = {}
    for c, sym in sorted(fsm.alphabet._symbol_mapping.items(), key=lambda kv: (str(kv[0]) if kv[0] is not anything_else
                                                                            else "\uffff")):
        if c is anything_else:
            explicit = set(fsm.alphabet._symbol_mapping)
            c = next((x for x in "a0xA_" if x not in explicit), None)
            if c is None:
                continue
        if sym not in chars or (c.isalnum() and not chars[sym].isalnum()):
            chars[sym] = c
    seen = {fsm.initial: ""}
    frontier = [fsm.initial]
    while frontier:
        nxt = []
        for st in frontier:
            if st in fsm.finals:
                return seen[st]
            if len(seen[st]) >= limit:
                continue
            for sym, to in sorted(fsm.map.get(st, {}).items(), key=lambda kv: chars.get(kv[0], "\uffff")):
                if to not in seen and sym in chars:
                    seen[to] = seen[st] + chars[sym]
                    nxt.append(to)
        frontier = nxt
    return None


_REWRITTEN = {p: f for f, p in FORMAT_PATTERNS.items()}  # pattern -> the format the schema rewrite replaced


def string_examples(schema) -> list[bytes]:
    """Short strings a JSON Schema's string keywords accept: the shortest match of each ``pattern`` and a value
    of each ``format`` (a walk inside a string whose quote is not allowed yet tries them before single bytes:
    an unanchored pattern such as ``wifi`` is found no other way)."""
    out: dict[bytes, None] = {}
    for node in _objects(schema):
        if len(out) >= 32:
            break
        pat, fmt = node.get("pattern"), node.get("format")
        if fmt is None and isinstance(pat, str):  # a format the schema rewrite turned into a pattern
            fmt = _REWRITTEN.get(pat)
        if isinstance(pat, str) and len(pat) <= 2000:  # (issue 20 rewrites formats into patterns of ~500 chars)
            m = shortest_match(pat)
            if m is not None:
                out[m.encode("utf-8")] = None
        if isinstance(fmt, str) and fmt in FORMAT_EXAMPLES:
            out[FORMAT_EXAMPLES[fmt].encode()] = None
    return sorted(out, key=len)


class _WalkVocab:
    """What the certified walk reads of a tokenizer: the longest-match speller and the single-byte tokens in the
    walk's orders of preference."""

    def __init__(self, tok: TokenizerInfo):
        stops = frozenset(tok.stop_token_ids)
        self.spell = GreedyBytes(tok)
        self.max_bytes = max([1, *map(len, tok.token_bytes)])  # the most bytes one token spells
        single = {b[0]: i for i, b in enumerate(tok.token_bytes)
                  if len(b) == 1 and i not in tok.special_ids and i not in stops}
        order = list(_PRIORITY) + [b for b in range(256) if b not in _PRIORITY and b not in _WHITESPACE]
        # (int64 arrays: the walk tests each order against a row at once, masks.allowed_among)
        self.prefer = _ids([single[b] for b in order if b in single])
        self.prefer_in_string = _ids([single[b] for b in [0x22, *[b for b in order if b != 0x22]] if b in single])
        # inside a number: its end first, then a non-zero digit (0.000... is longer than 0.1 or 1)
        ends = b'}],"123456789'
        self.prefer_after_digit = _ids([single[b] for b in [*ends, *[b for b in order if b not in ends]]
                                        if b in single])
        self.digits = frozenset(single[b] for b in b"0123456789" if b in single)
        # a grammar that is not JSON (GBNF, Lark, a regex): what usually closes something first (an SQL
        # statement's ``;``, a quoted value's quote), then the JSON order; the walk first tries those that let
        # the stop token come next (``CertifiedBudget._choose``).  With the JSON order an identifier
        # ``[a-z_][a-z0-9_]*`` went on with digits for ever and every token into one was refused (greedy SQL
        # under a certified budget wrote ``SELECT * FROM urn_users_by_age_filter_by_age...``, issue 32)
        plain = [b for b in _PLAIN_FIRST if b in single]
        self.prefer_plain = _ids([single[b] for b in [*plain, 0x20, *[b for b in order if b not in plain]]
                                  if b in single])  # (then a space: it ends a word, `WHERE n > 0` after `n`)
        self.plain_first = frozenset(single[b] for b in plain)
        self.enders = [single[b] for b in b'}],' if b in single] + [t for t in stops if t < tok.vocab_size]
        self.closers = frozenset(single[b] for b in b"}]" if b in single)
        self.comma = single.get(0x2C)
        self.blanks = [single[b] for b in _WHITESPACE if b in single]
        # per lexical context, the tokens that can jump (``CertifiedBudget.mask_row``'s far zone: ``_opens``)
        self.token_bytes = tok.token_bytes
        self._lexed: tuple | None = None

    def lexed(self) -> tuple:
        """(per context: which tokens can jump, each token's structure group; token lengths), built on first use
        (~0.8 s at 151,665 tokens: only hosts that apply the budget as a mask row need it)."""
        if self._lexed is None:
            jumps, groups = {}, {}
            for ctx in _CONTEXTS:
                seen: dict[bytes, int] = {}
                lexed = [_opens(b, *ctx) for b in self.token_bytes]
                jumps[(*ctx, "all")] = np.array([j for j, _, _ in lexed], dtype=bool)
                jumps[(*ctx, "open")] = np.array([o for _, _, o in lexed], dtype=bool)
                groups[ctx] = np.array([seen.setdefault(g, len(seen)) for _, g, _ in lexed], dtype=np.int64)
            packed = {k: pack_mask(v) for k, v in jumps.items() if k[3] == "open"}
            self._lexed = (jumps, groups, np.array([len(b) for b in self.token_bytes], dtype=np.int64), packed)
        return self._lexed


# lexical contexts of a position: (in a string, in a key, the innermost container)
_CONTEXTS = [(True, False, "{"), (True, False, "["), (True, True, "{"), (False, False, "{"), (False, False, "["),
             (False, True, "{")]


def _opens(tb: bytes, in_str: bool, key: bool, kind: str) -> tuple[bool, bytes, bool]:
    """(whether a token spelling ``tb`` in that context can raise the shortest completion by more than the token it
    costs, its structure, whether it opens an object or an array or starts a container's next item or member: a
    ``{`` or ``[`` outside a string, not one in a key's or a value's content, or a ``,``): it opens something
    (``{``, ``[``, a value after ``:``, an array's next item after ``,``), commits a key (its content or its
    closing quote), or is an empty / control token.  Whitespace between values, a value string's quotes and
    content, numbers and literals, and closers (``}``, ``]``: they only end what is open) keep the parent's
    certificate's remainder, or end it sooner (a value string's ``pattern`` aside).
    The structure: the token's bytes less whitespace and value-string content, and whether it ends in a string
    (tokens of one structure make the same jump).  ``key`` outside a string: an object key is expected."""
    if not tb:
        return True, b"\x00empty", False
    stack, esc, expect_key = [kind], False, key and not in_str
    jump, shape, opens = False, bytearray(), False
    for b in tb:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
                shape.append(b)
                jump |= key  # a key closed: its value is now owed
            elif b < 0x20:
                jump = True
                shape.append(b)
            elif key:
                jump = True  # key content: it may commit to one property
                shape.append(b)
            continue
        if b in _WHITESPACE:
            continue
        shape.append(b)
        if b == 0x22:
            in_str, key, expect_key = True, expect_key, False
        elif b in b"{[:":
            jump = True
            if b != 0x3A:
                opens = True
                stack.append(chr(b))
                expect_key = b == 0x7B
        elif b == 0x2C:
            opens = True  # the next item or member (an object's: its key, ``:`` and value)
            if stack[-1] != "{":
                jump = True  # an array's next item (or a container not known: after a closer)
            expect_key = stack[-1] == "{"
        elif b in b"}]":
            stack = stack[:-1] or ["?"]
    return jump, bytes(shape) + (b"\x00in" if in_str else b""), opens


def _after_value(text: bytes, depth: int, at: _Scan) -> bytes | None:
    """What is left of a completion ``text`` (from a position whose scan is ``at``, ``depth`` containers open) after
    the value it writes there: from its first ``,``, ``}`` or ``]`` at that depth outside a string (the whole text
    when it closes at once; empty when it ends the document there); None when it leaves that depth otherwise."""
    d, in_s, esc = depth, at.in_str, at.esc
    for i, b in enumerate(text):
        if in_s:  # (a string's byte: escaped, a backslash, its closing quote, or content)
            in_s, esc = esc or b != 0x22, not esc and b == 0x5C
        elif b == 0x22:
            in_s = True
        elif b in b"{[":
            d += 1
        elif b in b"}]":
            if d == depth:
                return text[i:]
            d -= 1
        elif b == 0x2C and d == depth:
            return text[i:]
    return b"" if d == depth and not in_s and depth == 0 else None


def _place(scan: _Scan) -> tuple:
    """Where a scan is, lexically: its open containers with the keys seen in each, and its string and key state."""
    return (tuple((k, frozenset(seen) if seen is not None else None) for k, seen in scan.stack), scan.in_str,
            scan.esc, scan.key_buf is not None, scan.expect_key, scan.need_colon, scan.owed_value)


def _rejoins(text: bytes, tb: bytes, at: _Scan, scan: _Scan, depth: int):
    """Candidate completions after a JSON token ``tb`` from a certificate's ``text`` (both from the scan ``at``;
    ``scan``: after the token; ``depth``: containers open at ``at``), JSON whitespace outside strings aside, the
    likeliest first: the token writes the start of the text (a key's ``  "``); it closes the string the text closes
    next and writes what follows its quote (``",\n``, a key's ``":``); it ends the value the text goes on with
    and writes the separator or closer that follows it (``,\n`` after a number); it opens a string value where the
    text writes another value (the string closed at once, then the text after its value)."""
    core = _squeezed(tb, at.in_str, at.esc)
    if core and text.startswith(core):
        yield text[len(core):]
        return
    if at.in_str:
        q = _closing_quote(tb, at.esc)
        if q >= 0:
            tail = b'"' + _squeezed(tb[q + 1:])
            i = _closing_quote(text, at.esc)
            if i >= 0 and text[i:].startswith(tail):
                yield text[i + len(tail):]
        return
    after = _after_value(text, depth, at)
    if after is None:
        return
    for j, b in enumerate(core):
        if b in b",}]":
            if after.startswith(core[j:]):
                yield after[len(core) - j:]
            break
    if scan.in_str and scan.key_buf is None and len(scan.stack) == depth and core[:1] == b'"' and \
            _closing_quote(core[1:]) < 0:
        yield b'"' + after


def _ids(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


_VOCABS = PerTokenizerCache(_WalkVocab)


class CertifiedBudget(Budget):
    """U = the length of a completion certified by the request's own engine (see the module docstring)."""

    mode = "certified"
    settles = True
    MAX_NAMES = 64
    MAX_WALK = 4096  # steps of the start's walk
    # certificates rejoined before a walk (``_next_of``: the parent's own text after a pretty-printed token, what
    # a walk wrote before in the same lexical place); off: a walk after every token that leaves the certificate
    rejoin = True

    def __init__(self, compiled: CompiledConstraint, budget: int, deadline=None):
        super().__init__(budget)
        tok = compiled.tokenizer
        self.tok = tok
        self.stop = tok.eos_token_id
        self.stops = frozenset(tok.stop_token_ids)
        self.hm = HistoryMatcher(compiled)
        v = _VOCABS.get(tok)  # built once per tokenizer (~30 ms at 151,936 tokens)
        self.max_bytes = v.max_bytes
        self.spell, self.prefer, self.prefer_in_string = v.spell, v.prefer, v.prefer_in_string
        self.prefer_after_digit, self.digits, self.enders, self.blanks = (v.prefer_after_digit, v.digits, v.enders,
                                                                          v.blanks)
        self.closers, self.comma = v.closers, v.comma
        self._vocab = v
        self.lost_midway = False  # a committed prefix with no certificate within the budget (mask_row: counted)
        self._far: dict = {}  # prefix -> the far zone's row of the tokens that fit (None: all), the last 64
        self._reps: dict = {}  # (prefix, token) -> its certificate's length (``_rep_len``)
        self._ahead: tuple = ([], _Scan())  # the last row's prefix beyond the path, and its scan (``_opener_in``)
        self._nexts: dict = {}  # (h, t, r, parent) -> the certificate of h.t (``_next``), the last ones
        self._nexts_held = 0  # (the tokens of their prefixes)
        self._spells: dict = {}  # text -> its spellings (``_spellings``), the last 512
        self._texts: dict = {}  # certificate -> its text (``_text``), the last 256
        self._wrote: dict = {}  # a lexical place -> what a walk wrote there, before the parent's rest where it
        # rejoined it (``_next_of``: JSON only), the last 256
        # xgrammar 0.2.8 accepts tokens its own mask leaves out (after `"Cla` in an enum's "Classical", `ssi`:
        # accept_token says yes, fill_next_token_bitmask has only `s`): a host samples from the mask, so a
        # certificate must be a way the masks allow (``_MaskChecked``), or the certificate's own next token is not
        # in the row, the tight zone's cut empties it, and vLLM samples token 0 and fails the request
        self.mask_checked = compiled.engine == "xgrammar"
        self.json = compiled.spec.kind in ("json_schema", "json")  # (its text is read as JSON: ``_Scan``)
        self._row = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)
        self._probe = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)
        self._cert_row = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)  # (``_certify``'s scratch row)
        self._and = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)  # (``_opener_in``'s)
        schema = compiled.spec.schema if compiled.spec.kind == "json_schema" else None
        names = schema_names(schema) if schema is not None else []
        self.names = [n.encode("utf-8") + b'"' for n in names[: self.MAX_NAMES]]
        self.strings = sorted((x + b'"' for x in string_examples(schema)), key=lambda x: len(self.spell(x))) \
            if schema is not None else []  # the fewest tokens first
        self.walks = 0
        # the committed path's certificates: _certs[i] certifies _path[:i]; _scans[i] scans its text
        self._path: list[int] = []
        self.hm.sync([])
        # (the history matcher, as certificates are worked out on it: ``_next`` only forks it)
        self._hm_checked = self._checked(self.hm.matcher)
        # the start's certificate, however long (so that a refusal can name its length): computed once per
        # (constraint, tokenizer, engine, budget) and kept (the handler, the generation thread and the loop of one
        # request, and later requests, all ask for it; it is a function of those alone)
        key = (compiled.spec.without_trigger().key(), compiled.engine, tok.fingerprint, tok.vocab_size, self.budget)
        with _STARTS_LOCK:
            hit = _STARTS.get(key, _MISSING)
            if hit is not _MISSING:
                _STARTS.move_to_end(key)
        if hit is _MISSING:
            start = self._start(compiled, deadline if deadline is not None else current_deadline())
            with _STARTS_LOCK:
                _STARTS[key] = start
                while len(_STARTS) > 256:
                    _STARTS.popitem(last=False)
        else:
            start = hit
        self._certs: list[tuple | None] = [start]
        self._scans: list[_Scan] = [_Scan()]
        self.shortest = len(start) if start is not None else INF
        self.lost = start is None  # nothing certified: no guarantee (the loop runs as without a budget)

    def _start(self, compiled: CompiledConstraint, deadline) -> tuple | None:
        """The start's certificate: a GBNF grammar's own shortest string (``bounds.gbnf_shortest``: fewest bytes,
        found from the rules, so a recursive grammar such as ``root ::= "a" root | "b"`` gets its exact ``b``)
        when the engine certifies it, else the greedy walk, under the request's deadline."""
        m = self._checked(self.hm.matcher)
        spec = compiled.spec
        if spec.kind == "grammar" and spec.syntax == "gbnf":
            from .bounds import gbnf_shortest

            w = gbnf_shortest(spec.value, cap=min(self.budget * self.max_bytes, 1 << 16))
            if w is not None:
                c = self._spelled(w.encode("utf-8"), 1 << 30, m)
                if c is not None:
                    return c
        return self._walk(m, _Scan(), min(8 * self.budget + 64, self.MAX_WALK), 1 << 30, deadline=deadline)

    # ---------------------------------------------------------------- certificates
    def _checked(self, m):
        """The matcher certificates are worked out on: ``m``, or ``m`` accepting only what its mask allows."""
        return _MaskChecked(m, len(self._row)) if self.mask_checked else m

    def _certify(self, m, ids: Sequence[int]) -> bool:
        if type(m) is _MaskChecked:  # (``_MaskChecked.accept`` on the engine matcher's fork: the mask asked, then
            f = m.m.fork()            # the matcher; one scratch row, no wrapper and no row per fork)
            row, fill, accept = self._cert_row, f.fill_mask, f.accept
            for t in ids:
                t = int(t)
                fill(row)
                if not mask_allows(row, t) or not accept(t):
                    return False
            return f.is_terminated()
        f = m.fork()
        for t in ids:
            if not f.accept(int(t)):
                return False
        return f.is_terminated()

    def _spelled(self, text: bytes, limit: int, m) -> tuple | None:
        """``text`` + the stop token, spelled with the vocabulary's longest tokens, if that fits in ``limit``
        and ``m`` accepts it to the end."""
        for ids in self._spellings(text):
            if len(ids) + 1 > limit:
                continue
            ids = (*ids, self.stop)
            if self._certify(m, ids):
                return ids
        return None

    def _spellings(self, text: bytes) -> list:
        """The spellings ``_spelled`` tries for ``text``: the tokenizer's own and the longest-match one, once each,
        the fewest tokens first (the tokenizer's first among equals); a function of ``text`` alone, kept per text
        (the same rest of a certificate is spelled again at many positions)."""
        got = self._spells.get(text)
        if got is None:
            got = []
            for ids in (self._encode(text), self.spell(text) if text else []):
                if ids is not None and ids not in got:
                    got.append(ids)
            got.sort(key=len)
            if len(self._spells) >= 512:
                self._spells.pop(next(iter(self._spells)))
            self._spells[text] = got
        return got

    def _encode(self, text: bytes) -> list[int] | None:
        """The tokenizer's own spelling of ``text`` (None when it has none, or it does not give ``text`` back)."""
        if not text or self.tok.encode is None:
            return [] if not text else None
        try:
            ids = list(self.tok.encode(text.decode("utf-8")))
        except Exception:
            return None
        return ids if self.tok.decode(ids) == text else None

    def _text(self, cert: Sequence[int]) -> bytes:
        """The text of a certificate (its stop tokens left out), kept for the last ones asked (a certificate is
        kept from position to position while the tokens leave it whole: its text is asked for at each)."""
        key = tuple(cert)
        text = self._texts.get(key)
        if text is None:
            text = self.tok.decode([t for t in cert if t not in self.stops])
            if len(self._texts) >= 256:
                self._texts.pop(next(iter(self._texts)))
            self._texts[key] = text
        return text

    def _walk(self, m, scan: _Scan, steps: int, limit: int, deadline=None, rejoin=None) -> tuple | None:
        """A completion from ``m``'s state by a greedy walk on the engine's masks (at most ``steps`` tokens),
        re-spelled with longer tokens; returned if it fits in ``limit`` tokens (certified), else None.  A forced
        string is asked for at most the bytes the steps left can spell (never an uncapped jump-forward); the walk
        answers to ``deadline`` (the request's, for the start's certificate).  ``rejoin``: (a depth, the parent
        certificate's text after its value there, computed on demand): where the walk, having written something, is
        first at that depth again outside a string (what the token opened is closed, or the item it started is
        written), the walk so far followed by that text is certified and returned if it fits (``_next``: the
        parent's rest is not walked again), else the walk goes on."""
        self.walks += 1
        f = m.fork()
        scan = scan.copy()
        row = self._row
        out: list[int] = []
        used: dict[int, int] = {}
        tb = self.tok.token_bytes
        while len(out) < steps:
            if deadline is not None:
                deadline.check("certifying the budget (the start's completion walk)", engine=self.hm.compiled.engine
                               if hasattr(self.hm, "compiled") else None)
            f.fill_mask(row)
            if any(mask_allows(row, s) for s in self.stops if s < self.tok.vocab_size):
                text = self.tok.decode(out)
                best = self._spelled(text, limit, m)  # the same text in fewer tokens
                if best is None and len(out) + 1 <= limit:
                    best = tuple(out) + (self.stop,)
                return best
            if rejoin is not None and out and len(scan.stack) <= rejoin[0] and not (
                    scan.in_str or scan.need_colon or scan.owed_value or scan.expect_key):  # (a value written)
                if len(scan.stack) == rejoin[0]:
                    rest = rejoin[1]()
                    if rest is not None:
                        c = self._spelled(self.tok.decode(out) + rest, limit, m)
                        if c is not None:
                            return c
                rejoin = None  # (tried once)
            jf = _jump(f, (steps - len(out)) * self.max_bytes)
            took = 0
            if jf:
                for t in self.spell(jf) or ():
                    if not f.accept(t):
                        break
                    out.append(t)
                    scan.feed(tb[t])
                    took += 1
                if took:
                    continue
            ids = self._choose(f, row, scan, used)
            if not ids:
                return None
            for t in ids:
                if not f.accept(t):
                    return None
                out.append(t)
                used[t] = used.get(t, 0) + 1
                scan.feed(tb[t])
        return None

    def _choose(self, f, row: np.ndarray, scan: _Scan, used: dict) -> list[int] | None:
        """The walk's next token(s): a property name the schema mentions at an object key (not yet in this
        object; spelled with its closing quote), else the first allowed single-byte token in the order of
        preference (outside a string the closers, then the shortest values; inside one the closing quote, else
        the allowed byte the walk used least, so that a pattern's ``[a-z]+/`` gets its ``/``), else any allowed
        token (lowest id, whitespace last).  ``used``: how often the walk took each token."""
        if self.names and scan.in_str and scan.key_buf is not None and not scan.key_buf:
            seen = scan.stack[-1][1] if scan.stack and scan.stack[-1][1] is not None else set()
            for name in self.names:
                if name[:-1].decode("utf-8", "replace") in seen:
                    continue
                ids = self.spell(name)
                if ids and mask_allows(row, ids[0]):
                    g = f.fork()
                    if all(g.accept(t) for t in ids):
                        return ids
        if scan.in_str:  # the closing quote, else the least used allowed byte so far (a pattern's next part)
            allowed = allowed_among(row, self.prefer_in_string)
            if allowed and allowed[0] == self.prefer_in_string[0]:
                return [allowed[0]]
            cur = bytes(scan.str_buf)
            for text in self.strings:  # a value the schema's patterns and formats accept (what is left of it
                if not text.startswith(cur):  # after the string so far), and its closing quote
                    continue
                ids = self.spell(text[len(cur):])
                if ids and mask_allows(row, ids[0]):
                    g = f.fork()
                    if all(g.accept(t) for t in ids):
                        return ids
            if allowed:
                return [min(allowed, key=lambda t: used.get(t, 0))]
        elif not self.json:  # a grammar that is not JSON: a byte after which it may end, else the closers first
            allowed = allowed_among(row, self._vocab.prefer_plain)
            firsts = [t for t in allowed[:len(self._vocab.plain_first)] if t in self._vocab.plain_first]
            # (and whitespace: a line ends a list item, ``item ::= "- " [^\n]+ "\n"``)
            for t in [*firsts, *(b for b in self.blanks if mask_allows(row, b))]:
                g = f.fork()
                if g.accept(t):
                    g.fill_mask(self._probe)
                    if any(mask_allows(self._probe, e) for e in self.stops if e < self.tok.vocab_size):
                        return [t]
            if allowed:
                if used.get(allowed[0], 0) >= 8 and len(allowed) > 1:  # the first choice again and again: the
                    return [min(allowed, key=lambda t: used.get(t, 0))]  # least used
                return [allowed[0]]
        else:  # the closers, then the shortest values; after a digit the number's end before more digits
            order = self.prefer_after_digit if chr(scan.last).isdigit() or scan.last == 0x2E else self.prefer
            allowed = allowed_among(row, order)
            if allowed:
                # each closer ends an open container; a comma where neither closer is allowed yet is the next of
                # the items or required keys it still needs (refused as "again and again" at the 9th, the walk
                # wrote "p8":123456789e1234... and an object of 10 required numbers was certified at 133 tokens)
                closes = (allowed[0] in self.closers or allowed[0] == self.comma) and bool(scan.stack)
                if allowed[0] not in self.digits and used.get(allowed[0], 0) >= 8 and len(allowed) > 1 \
                        and not closes:
                    # the first choice again and again (``root ::= "a" root | "b"``, ``/a*b/``): the least used.
                    # Not a closer while a container is open: a value nested 9 deep needs 9 ``}`` (the rule sent
                    # the walk into an endless exponent, ``0e0123...``, and the budget lost its certificate)
                    return [min(allowed, key=lambda t: used.get(t, 0))]
                digits = [t for t in allowed if t in self.digits]
                if allowed[0] in self.digits and used.get(allowed[0], 0) >= 8:  # 0.000... going nowhere
                    return [min(digits, key=lambda t: used.get(t, 0))]
                if allowed[0] in self.digits and len(digits) > 1:  # a digit after which the number may end
                    for t in digits:
                        g = f.fork()
                        g.accept(t)
                        g.fill_mask(self._probe)
                        if any(mask_allows(self._probe, e) for e in self.enders):
                            return [t]
                return [allowed[0]]
        for w in np.flatnonzero(row).tolist():
            word = int(row.view(np.uint32)[w])
            for b in range(32):
                i = w * 32 + b
                if word >> b & 1 and i not in self.stops and i not in self.blanks:
                    return [i]
        for t in self.blanks:
            if mask_allows(row, t):
                return [t]
        return None

    def _next(self, parent: tuple | None, h: Sequence[int], t: int, r: int) -> tuple | None:
        """The certificate of h.t (at most r - 1 tokens) from the parent's ``parent``, or None when none fits: a
        function of its arguments (``h`` is on the committed path, ``parent`` its certificate), kept per (h, t, r,
        parent) for the last ones worked out.  The same certificate is asked for again and again: a draft's by the
        draft check (the far zone's opener, ``_rep_len``; the tight zone's candidate) and again when the path takes
        it (``_sync``), a rejected draft's branch again after the path left it, the verification rows'."""
        key = (tuple(h), t, r, parent)
        hit = self._nexts.get(key, _MISSING)
        if hit is not _MISSING:
            return hit
        c = self._next_of(parent, h, t, r)
        self._nexts[key] = c
        self._nexts_held += len(key[0])
        # (the last 4096, and prefixes of at most 2^17 tokens in all: 1 MB of a long output's prefixes)
        while len(self._nexts) > 4096 or self._nexts_held > 1 << 17:
            old = next(iter(self._nexts))
            self._nexts_held -= len(old[0])
            del self._nexts[old]
        return c

    def _next_of(self, parent: tuple | None, h: Sequence[int], t: int, r: int) -> tuple | None:
        limit = r - 1
        if t in self.stops:
            return () if limit >= 0 else None
        if parent and parent[0] == t:  # the token follows the certificate
            return parent[1:] if len(parent) - 1 <= limit else None
        if limit < 1 or not self.hm.sync([*h, t]):
            return None
        m = self._hm_checked
        at = self._scan_at(h)
        scan = at.copy()
        scan.feed(self.tok.token_bytes[t])
        d = len(at.stack)
        if parent:
            text, tb = self._text(parent), self.tok.token_bytes[t]
            if tb and text.startswith(tb):  # the token spells a prefix of the certificate's text
                c = self._spelled(text[len(tb):], limit, m)
                if c is not None:
                    return c
            elif self.json and tb and self.rejoin:
                # the parent's own text, rejoined after what the token writes (a pretty-printed model writes
                # ``  "`` and ``",\n`` where the certificate is compact, or ends a value the certificate goes on
                # with): the engine certifies each candidate (a wrong one fails within a token or two); a walk
                # was ~0.8 ms a token at 151,936
                for rest in _rejoins(text, tb, at, scan, d):
                    c = self._spelled(rest, limit, m)
                    if c is not None:
                        return c
            # the same completion still ends it (not after a JSON token that opened something and left the string
            # state as it was: the parent's text closes one container too few then)
            if len(parent) <= limit and not (self.json and len(scan.stack) > d and scan.in_str == at.in_str
                                             and scan.esc == at.esc) and self._certify(m, parent):
                return parent
            if len(parent) > limit:  # no slack: only the certificate's own way fits (never a longer walk)
                return None
        rejoin, rest = None, b""
        if parent and (len(scan.stack) > d or (len(scan.stack) == d and d and not scan.in_str
                                               and self.tok.token_bytes[t].rstrip(_WHITESPACE).endswith(b","))):
            # the token opened something (the walk closes it), or started a container's next item or member (the
            # walk writes it), then the parent's rest
            rest = _after_value(self._text(parent), d, at)
            rejoin = (d, lambda: rest)
        if rest is None or not self.rejoin or not self.json:  # (a JSON scan's places: JSON's alone)
            return self._walk(m, scan, 2 * limit + 8, limit, rejoin=rejoin)
        # what a walk wrote before in the same lexical place (the same containers, the same keys seen, the same
        # token), then the parent's rest where the walk rejoins it: certified by the engine.  The far zone asks
        # for each opener group's certificate at every position, so the same new member after a value, or the
        # same key after a string's ``","``, was walked again and again
        place = (_place(scan), _squeezed(self.tok.token_bytes[t], at.in_str, at.esc), rejoin is not None)
        wrote = self._wrote.get(place)
        if wrote is not None:
            c = self._spelled(wrote + rest, limit, m)
            if c is not None:
                return c
        c = self._walk(m, scan, 2 * limit + 8, limit, rejoin=rejoin)
        if c is not None:
            text = self._text(c)
            if text.endswith(rest) and len(text) > len(rest):
                if len(self._wrote) >= 256:
                    self._wrote.pop(next(iter(self._wrote)))
                self._wrote[place] = text[:len(text) - len(rest)]
        return c

    def _scan_of(self, ids: Sequence[int]) -> _Scan:
        s = _Scan()
        s.feed(self.tok.decode(ids))
        return s

    def _scan_at(self, ids: Sequence[int]) -> _Scan:
        """The lexical scan after ``ids``, a prefix of the committed path: kept along the path, else worked out."""
        return self._scans[len(ids)] if len(ids) < len(self._scans) else self._scan_of(ids)

    def _sync(self, generated: Sequence[int]) -> tuple | None:
        """The certificate of ``generated`` (computed along it, from the longest prefix known)."""
        path = self._path
        n = 0
        lim = min(len(path), len(generated))
        if path[:lim] == list(generated[:lim]):  # (the usual case, one comparison in C: a row per position)
            n = lim
        while n < lim and path[n] == generated[n]:
            n += 1
        del path[n:]
        del self._certs[n + 1:]
        del self._scans[n + 1:]
        for t in generated[n:]:
            parent = self._certs[-1]
            self._push(int(t), None if parent is None else self._next(parent, path, int(t), self.budget - len(path)))
        return self._certs[-1]

    def _push(self, t: int, cert: tuple | None) -> None:
        """Extend the committed path by ``t``, whose certificate is ``cert``."""
        s = self._scans[-1].copy()
        s.feed(self.tok.token_bytes[t] if 0 <= t < len(self.tok.token_bytes) else b"")
        self._path.append(t)
        self._certs.append(cert)
        self._scans.append(s)

    def feasible(self, generated: Sequence[int], token: int) -> bool:
        if self.lost:
            return True
        t0 = time.perf_counter_ns()
        try:
            parent = self._sync(generated)
            if parent is None:  # a prefix that did not fit (committed without the budget): no guarantee left
                return True
            c = self._next(parent, generated, int(token), self.budget - len(generated))
            if c is None:
                return False
            self._push(int(token), c)  # the next position starts from here (the caller commits it)
            return True
        finally:
            self.ns += time.perf_counter_ns() - t0

    SMALL = 64  # a string row of at most this many tokens (an enum's, a strict pattern's) is checked whole

    def mask_row(self, row: np.ndarray, generated: Sequence[int], margin: int = 16, whole: bool = True,
                 far: str = "open") -> bool:
        """The certified bound as a mask row (a deterministic function of the prefix, so plain and speculative
        decoding see the same row), for hosts that cannot re-draw (vLLM).  A token stays if its certificate fits
        in the tokens left.  Which tokens are checked:

        - **tight zone** (slack ``r - |certificate|`` below ``margin``): only a bounded set of candidates stay if
          they fit: the certificate's next token (always fits), the tokens spelling a prefix of its text, and the
          stop tokens (cheap: at most ``max_bytes`` + a few certificates per position);
        - **far zone**: the tokens that can jump.  A token that leaves the structure as it was (JSON whitespace
          between values, string content: no quote, backslash or control byte) keeps the parent's certificate
          (U(h.t) <= U(h) <= r - 1), so it fits; every other token the row allows (structure: an opening brace,
          a comma, a quote closing a string; and, in a string whose row holds at most ``SMALL`` tokens, an
          enum's or a strict pattern's, its content too, where ``row`` is ``whole``) is certified (``_next``) and cut when nothing fits.  An
          array item whose schema needs 720 tokens is cut when ~200 are left (issue 35's dev split at T = 0.7:
          the former shortcut left the far zone's rows whole, assuming no token jumps ``margin`` or more).
          Not covered: string content that a loose pattern (more than ``SMALL`` tokens allowed) sends much
          further; a prefix left without a certificate is counted (``lost_midway``).

        ``far`` (what the far zone checks): ``"all"`` every such token, as above (sound but up to ~0.5 ms a row
        at 151,665 tokens: a certificate walk per structure group); ``"open"`` (default) only the groups that
        open an object or an array or start a container's next item or member (a ``{`` or ``[`` outside a string,
        a ``,``: issue 35's two cut-offs, and an item or member too long for the room after a comma), skipped on
        rows that
        allow none; the certificate of a token that opens something is the walk that closes it followed by the
        rest of the parent's (``_walk``'s ``rejoin``), else the whole walk.  ``"off"`` none: the margin's
        premise, no token jumps ``margin`` or more (the far zone's prefixes are then not even certified; a lost
        one is counted later, nearer the limit).  ``open`` costs 7-14% of vLLM's target step on SmolLM2-135M, 7-9%
        of the whole step (issue 35's target <= 10%; 16-38% of the target step, without commas, while a ``{`` in a
        key's content counted as an opener and an opener's certificate walked the whole rest of the document).
        """
        if self.lost:
            return False
        t0 = time.perf_counter_ns()
        try:
            r = self.budget - len(generated)
            if far != "all":
                path = self._path
                lim = min(len(path), len(generated))
                known = self._certs[lim] if path[:lim] == list(generated[:lim]) else None
                if known is not None and r - (len(known) + (len(generated) - lim) * max(margin - 1, 0)) >= margin \
                        and (far == "off" or not self._opener_in(row, generated, lim)):
                    # far from the budget and nothing in the row that opens an object or an array or starts a
                    # next item or member: with no other token raising the certificate by ``margin`` or more (the
                    # premise) the slack is still at least ``margin`` here; the certificates of the tokens since
                    # (drafts, mostly) are not worked out
                    return False
            parent = self._sync(generated)
            if parent is None:
                self.lost_midway = True
                return False
            if not parent:
                return False
            if r - len(parent) < margin:
                text = self._text(parent)
                table = self.spell.table
                cands = dict.fromkeys([parent[0], *(t for t in self.stops if t < self.tok.vocab_size),
                                       *(table[text[:i]] for i in range(1, min(len(text), self.max_bytes) + 1)
                                         if text[:i] in table)])
                fits = np.zeros_like(row)
                for t in cands:
                    if mask_allows(row, t) and (t == parent[0] or self._next(parent, generated, int(t), r) is not None):
                        set_bit(fits, int(t))
            elif far == "off":
                return False
            else:
                fits = self._far_fits(row, generated, parent, r, whole, far)
                if fits is None:
                    return False
            n = min(len(row), len(fits))
            cut = bool(np.any(row[:n] & ~fits[:n]))
            if cut:
                np.bitwise_and(row[:n], fits[:n], out=row[:n])
                self.cut_rows += 1
            return cut
        finally:
            self.ns += time.perf_counter_ns() - t0

    def _blank(self, t: int) -> bool:
        tb = self.tok.token_bytes[t] if 0 <= t < len(self.tok.token_bytes) else b""
        return bool(tb) and not tb.strip(_WHITESPACE)

    def _rep_len(self, generated: Sequence[int], base: int, rep: int) -> int | None:
        """The length of the certificate of ``generated[:base]`` + ``rep`` (within the tokens left there), kept
        per (that prefix, token): None when none fits."""
        key = (tuple(generated[:base]), rep)
        if key in self._reps:
            return self._reps[key]
        parent = self._certs[base]
        c = None if parent is None else self._next(parent, list(generated[:base]), rep, self.budget - base)
        if len(self._reps) >= 4096:
            self._reps.pop(next(iter(self._reps)))
        self._reps[key] = n = None if c is None else len(c)
        return n

    def _opener_in(self, row: np.ndarray, generated: Sequence[int], lim: int) -> bool:
        """Whether ``row`` allows a token that opens an object or an array or starts a next item or member after
        ``generated`` (whose first ``lim`` tokens are on the committed path): the lexical state from the path's, or
        the last row's, the tokens since fed."""
        if lim < len(generated):
            # the tokens since the path's end (drafts, and far from the limit the committed tokens the path is not
            # synced to): fed from the last row's scan where this row extends it (one token a row, not all since)
            ids, last = self._ahead  # (the scan of ``ids``' text)
            if lim <= len(ids) <= len(generated) and list(generated[:len(ids)]) == ids:
                scan, start = last.copy(), len(ids)
            else:
                scan, start = self._scan_at(generated[:lim]).copy(), lim
            tb = self.tok.token_bytes  # (as ``_push`` feeds the path's scans; decode costs ~15 us a call)
            scan.feed(b"".join(tb[t] if 0 <= t < len(tb) else b"" for t in generated[start:]))
            self._ahead = (list(generated), scan)
        else:
            scan = self._scan_at(generated[:lim])
        packed = self._vocab.lexed()[3]
        kind = scan.stack[-1][0] if scan.stack else "["
        if scan.esc or kind not in "{[":
            jumps = packed[(False, False, "[", "open")]
        elif scan.in_str:
            jumps = packed[(True, scan.key_buf is not None, kind, "open")]
        else:
            jumps = packed[(False, scan.expect_key and kind == "{", kind, "open")]
        n = min(len(row), len(jumps), len(self._and))
        return bool(np.bitwise_and(row[:n], jumps[:n], out=self._and[:n]).any())  # (no [V / 32] array made)

    def _far_fits(self, row: np.ndarray, generated: Sequence[int], parent: tuple, r: int, whole: bool,
                  far: str) -> np.ndarray | None:
        """The far zone's packed row of the tokens that fit (None: every token the row allows fits), kept for the
        last prefixes asked (vLLM fills a position's row again as the target's after it was a draft's)."""
        key = (tuple(generated), row.tobytes(), whole, far)
        if key in self._far:
            return self._far[key]
        jumps_by, groups_by, lens, _ = self._vocab.lexed()
        scan = self._scans[len(generated)]
        kind = scan.stack[-1][0] if scan.stack else "["
        if (scan.esc or kind not in "{[") and far == "all":
            jumps = None  # (a token after a backslash, or in parentheses: every token is checked)
        elif scan.esc or kind not in "{[":
            jumps = jumps_by[(False, False, "[", far)]  # (the openers as between values)
        elif scan.in_str:
            jumps = jumps_by[(True, scan.key_buf is not None, kind, far)]
        else:
            jumps = jumps_by[(False, scan.expect_key and kind == "{", kind, far)]
        # (the tokens the tokenizer spells: a model's vocabulary may be wider, Qwen2.5's 151,936 ids for 151,665
        # tokens, and the ids past them are never allowed; the tables are as long as the tokenizer's list)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: min(self.tok.vocab_size, len(lens))]
        if jumps is not None and not (far == "all" and whole and scan.in_str and scan.key_buf is None
                                      and int(bits.sum()) <= self.SMALL):
            bits &= jumps[: len(bits)]
        jumpers = np.flatnonzero(bits)
        drop: list[int] = []
        if jumps is None:
            drop = [int(t) for t in jumpers if int(t) != parent[0] and int(t) not in self.stops
                    and self._next(parent, generated, int(t), r) is None]
        elif len(jumpers):
            # one certificate per structure: its shortest token's, one token shorter than the room, keeps the
            # whole group (the others differ by string content and whitespace); else that token alone if it fits
            # (one walk per group: a token that opens too much is walked to the walk's end once per position)
            ctx = ((True, scan.key_buf is not None, kind) if scan.in_str
                   else (False, scan.expect_key and kind == "{", kind)) if kind in "{[" else (False, False, "[")
            groups = groups_by[ctx][jumpers]
            order = np.lexsort((lens[jumpers], groups))
            jumpers, groups = jumpers[order], groups[order]
            firsts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
            ends = np.r_[firsts[1:], len(jumpers)]
            # (between values, whitespace since the last other token changes nothing: the certificate is worked
            # out once from before it, and kept; whitespace before a token does not change what ends it)
            base = len(generated)
            if not scan.in_str:
                while base > 0 and self._blank(int(generated[base - 1])):
                    base -= 1
            for a, z in zip(firsts.tolist(), ends.tolist()):
                rep = int(jumpers[a])
                n = self._rep_len(generated, base, rep)
                if n is not None and n <= r - 2:
                    continue
                keep_rep = (n is not None and n <= r - 1) or rep == parent[0] or rep in self.stops
                drop.extend(int(t) for t in jumpers[a + keep_rep:z]
                            if int(t) != parent[0] and int(t) not in self.stops)
        fits = None
        if drop:
            fits = np.full_like(row, -1)
            for t in drop:
                clear_bit(fits, t)
        if len(self._far) >= 64:
            self._far.pop(next(iter(self._far)))
        self._far[key] = fits
        return fits

    def report(self) -> dict:
        return {**super().report(), "walks": self.walks, "certified": not self.lost}


class _MaskChecked:
    """A matcher whose ``accept`` also asks its mask (``CertifiedBudget.mask_checked``); its forks too.  The mask
    the caller filled for the current state is reused (the walk fills one per step)."""

    def __init__(self, m, words: int):
        self.m = m
        self.row = np.zeros(words, dtype=np.int32)
        self.fresh = False

    def __getattr__(self, name):
        return getattr(self.m, name)

    def fork(self) -> "_MaskChecked":
        return _MaskChecked(self.m.fork(), len(self.row))

    def fill_mask(self, out: np.ndarray) -> None:
        self.m.fill_mask(out)
        self.row[:] = out
        self.fresh = True

    def accept(self, token: int) -> bool:
        if not self.fresh:
            self.m.fill_mask(self.row)
        self.fresh = False
        return mask_allows(self.row, int(token)) and self.m.accept(int(token))

    def rollback(self, n: int) -> None:
        self.fresh = False
        self.m.rollback(n)


_STARTS: "OrderedDict[tuple, tuple | None]" = OrderedDict()  # CertifiedBudget's start certificates (LRU)
_STARTS_LOCK = threading.Lock()
_MISSING = object()
_NOT_EXACT: "OrderedDict[tuple, int]" = OrderedDict()  # (pattern, tokenizer) -> 2: its exact budget failed (or overran
# twice), not tried again; 1: it overran once


def _jump(m, limit: int) -> bytes:
    """``m.jump_forward`` capped at ``limit`` bytes (a matcher written before the cap existed takes no limit)."""
    try:
        return m.jump_forward(limit)[:limit]
    except TypeError:
        return m.jump_forward()[:limit]


# ------------------------------------------------------------------------------------------- the road
def make_budget(compiled: CompiledConstraint | None, budget: int | None, *, exact_only: bool = False
                ) -> Budget | None:
    """The budget of one request, or None (no constraint, no budget, or a deferred trigger).  Raises
    ``BudgetError`` when the constraint's shortest completion does not fit in ``budget`` (exact), or no completion
    of at most ``budget`` tokens can be certified (certified).  ``exact_only``: None unless the bound is exact
    (for hosts that can only apply a mask row, not re-draw)."""
    if compiled is None or budget is None or compiled.spec.trigger is not None:
        return None
    spec = compiled.spec
    guard: Budget | None = None
    d = current_deadline()  # the request's (bounds.prepare_deadline), else one of this call's own
    pattern = exact_pattern(compiled)
    nkey = (pattern, compiled.tokenizer.fingerprint, compiled.tokenizer.vocab_size)
    if pattern is not None and _NOT_EXACT.get(nkey, 0) < 2:
        part = d.part(d.cpu_left() / 2)
        try:  # the exact bound gets half the time left: the certified one must still fit after it
            guard = ExactBudget(compiled, budget, pattern, deadline=part)
            _NOT_EXACT.pop(nkey, None)
        except Exception:  # interegular cannot read it, too many token-level states, or out of its time: certify
            guard = None   # instead, and do not try this pattern again (bounded); out of its time, only the
            # second time: one request that overran under load (the SQL workload's graph at 49,152 tokens takes
            # 1.6 s of the 2.5 s share) sent every later request of the process to the certified bound
            _NOT_EXACT[nkey] = 2 if part.expired() is None else _NOT_EXACT.get(nkey, 0) + 1
            while len(_NOT_EXACT) > 1024:
                _NOT_EXACT.popitem(last=False)
    if guard is None and exact_only:
        return None
    if guard is None:
        guard = CertifiedBudget(compiled, budget, deadline=d)
    if guard.shortest > guard.budget:
        if guard.shortest == INF:
            if guard.mode == "certified":
                raise BudgetError(f"no completion of at most {budget} tokens could be certified for this constraint "
                                  "(raise max_tokens, or send \"specgrammar\": {\"budget_mask\": false})",
                                  shortest=None, budget=budget, engine=compiled.engine, kind=spec.kind)
            raise BudgetError("the constraint has no completion", shortest=None, budget=budget,
                              engine=compiled.engine, kind=spec.kind)
        n = int(guard.shortest)
        how = "exact" if guard.mode == "exact" else "the shortest completion the engine certified"
        raise BudgetError(f"the shortest completion of this constraint takes {n} tokens (stop token included; {how}) "
                          f"but the budget is {budget} (max_tokens or specgrammar.budget): raise it to at least {n}, or "
                          "send \"specgrammar\": {\"budget_mask\": false} to allow an output cut off at the limit",
                          shortest=n, budget=budget, engine=compiled.engine, kind=spec.kind)
    return guard


__all__ = ["Budget", "CertifiedBudget", "ExactBudget", "exact_pattern", "make_budget", "schema_names",
           "shortest_match", "string_examples"]
