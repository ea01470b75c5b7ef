"""The model's own layout: which structure tokens (whitespace, brackets, quotes, separators) it writes where the
grammar leaves the choice open, learnt from its verified outputs.

A grammar that allows any whitespace forces almost nothing, yet a model lays its JSON out the same way every time
(SmolLM2 pretty-prints: ``{`` ``\\n `` `` "`` ... ``,`` ``\\n `` `` "``).  ``LayoutIndex`` learns that: every output
position is keyed by

- the *structural state* before it: JSON nesting depth and whether the position is outside strings, inside an
  object key or inside a value string (the state a JSON grammar is in, read off the text, so it means the same
  thing for every schema), and
- the last few *layout symbols*: a token made only of whitespace and JSON punctuation (``{}[],:"``) is itself,
  any other token is ``<content>`` (consecutive content tokens collapse into one symbol, so ``"Oscar Silva"`` and
  ``"Li"`` look alike),

and proposes the token run that followed the key's latest occurrences where ``min_support`` of them agree
and structure follows at least ``min_share`` of them
(a majority path, as ``SuffixIndex`` does), cut before the first content token: layout proposes structure only
(values are the prompt-copy and recipe drafters' business).  Keys hold the depth, so indentation at depth 2 is not confused with
depth 1.  Runs may reach into content (a key name the grammar would accept); every draft goes through the block's
grammar mask and is verified by the target, so a wrong proposal costs verification width, never the output.

``LayoutDrafter`` (``drafters.py``) asks three of these, in order: one that learns the request's own output as it
is committed (support 1: the layout this very answer used so far), the server's (``server_layout_index``, taught
by every finished request), and the one a recipe pack carries (``RecipePack.layout``: built offline from the
model's verified outputs, ``LayoutIndex.table``/``from_table``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

CONTENT = -3
START = -4  # the start of an output
_STATE_BASE = -1000  # state symbol: _STATE_BASE - (2 * depth + in_string)
MAX_DEPTH = 31
_STRUCT = frozenset(b' \t\n\r{}[],:"')


def state_symbol(depth: int, mode: int) -> int:
    """mode: 0 outside strings, 1 inside an object key, 2 inside a value string."""
    return _STATE_BASE - (3 * min(max(depth, 0), MAX_DEPTH) + mode)


def is_structural(data: bytes) -> bool:
    """A token made only of whitespace and JSON punctuation (kept literal in layout keys)."""
    return bool(data) and all(b in _STRUCT for b in data)


class LayoutScanner:
    """Reads token bytes and keeps the JSON structural state (depth, inside a string, escape) and the collapsed
    layout symbols.  ``copy()`` is cheap (a block's drafts are scanned on a copy of the committed state)."""

    __slots__ = ("token_bytes", "depth", "in_string", "escape", "syms", "states", "ptrs", "stack", "expect_key",
                 "key_string")

    def __init__(self, token_bytes: Sequence[bytes]):
        self.token_bytes = token_bytes
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.stack = b""  # the open containers ({ or [), innermost last
        self.expect_key = False  # a string opened now is an object key
        self.key_string = False
        self.syms: list[int] = [START]  # collapsed layout symbols of the tokens read
        self.states: list[int] = []  # per token read: the state symbol before it
        self.ptrs: list[int] = []  # per token read: len(syms) before it

    def copy(self) -> "LayoutScanner":
        c = LayoutScanner.__new__(LayoutScanner)
        c.token_bytes = self.token_bytes
        c.depth, c.in_string, c.escape = self.depth, self.in_string, self.escape
        c.stack, c.expect_key, c.key_string = self.stack, self.expect_key, self.key_string
        c.syms, c.states, c.ptrs = list(self.syms[-16:]), [], []
        return c

    @property
    def state(self) -> int:
        return state_symbol(self.depth, (1 if self.key_string else 2) if self.in_string else 0)

    def feed(self, token: int) -> None:
        tb = self.token_bytes
        data = tb[token] if 0 <= token < len(tb) else b""
        self.states.append(self.state)
        self.ptrs.append(len(self.syms))
        sym = token if is_structural(data) else CONTENT
        if not (sym == CONTENT and self.syms and self.syms[-1] == CONTENT):
            self.syms.append(sym)
        for b in data:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif b == 0x5C:  # backslash
                    self.escape = True
                elif b == 0x22:
                    self.in_string = False
            elif b == 0x22:
                self.in_string = True
                self.key_string = self.expect_key
                self.expect_key = False
            elif b in (0x7B, 0x5B):
                self.depth += 1
                self.stack = (self.stack + bytes((b,)))[-MAX_DEPTH:]
                self.expect_key = b == 0x7B
            elif b in (0x7D, 0x5D):
                self.depth = max(0, self.depth - 1)
                self.stack = self.stack[:-1]
                self.expect_key = False
            elif b == 0x2C:  # ,
                self.expect_key = self.stack[-1:] == b"{"
            elif b == 0x3A:  # :
                self.expect_key = False

    def key(self, n: int) -> tuple[int, ...]:
        """The key of the next position: (state, last n layout symbols)."""
        return (self.state, *self.syms[len(self.syms) - n:]) if n <= len(self.syms) else ()


class LayoutIndex:
    """Layout keys -> the runs that followed them in observed outputs (bounded: the oldest sequences go first).

    ``observe(output)`` adds one finished output; ``grow(sid, tokens)`` extends a sequence being committed (the
    request-local index).  ``lookup(scanner, budget)`` gives the majority run after the longest key (``max_key``
    layout symbols down to 1) that has one with ``min_support`` agreeing occurrences."""

    def __init__(self, token_bytes: Sequence[bytes], *, max_key: int = 4, max_run: int = 8, per_key: int = 8,
                 min_support: int = 2, max_tokens: int = 100_000, max_keys: int = 200_000, min_share: float = 0.5,
                 min_share_in_value: float = 0.9):
        self.token_bytes = token_bytes
        self.min_share = min_share  # the share of a key's occurrences that structure must follow
        # inside a value string the end is the value's, not the layout's: only where it (nearly) always ends here
        self.min_share_in_value = min_share_in_value
        self.max_key, self.max_run, self.per_key, self.min_support = max_key, max_run, per_key, min_support
        self.max_tokens, self.max_keys = max_tokens, max_keys
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()
        self._scan: dict[int, LayoutScanner] = {}
        self._keys: OrderedDict[tuple[int, ...], deque] = OrderedDict()
        self._table: dict[tuple[int, ...], tuple[int, ...]] = {}  # frozen runs (from a pack)
        self._held = 0
        self._next = 0
        self.observed = 0

    def __len__(self) -> int:
        return len(self._keys) + len(self._table)

    # ------------------------------------------------------------------ learning
    def observe(self, output: Sequence[int]) -> int:
        """Add one finished output (the generated tokens only); returns its id."""
        sid = self.new()
        self.grow(sid, output)
        self._scan.pop(sid, None)
        self.observed += 1
        return sid

    def new(self) -> int:
        sid = self._next
        self._next += 1
        self._seqs[sid] = []
        self._scan[sid] = LayoutScanner(self.token_bytes)
        return sid

    def grow(self, sid: int, tokens: Sequence[int]) -> None:
        seq = self._seqs[sid]
        sc = self._scan[sid]
        for t in tokens:
            i = len(seq)
            t = int(t)
            sc.feed(t)
            seq.append(t)
            st, p = sc.states[-1], sc.ptrs[-1]
            for n in range(1, min(self.max_key, p) + 1):
                key = (st, *sc.syms[p - n:p])
                q = self._keys.get(key)
                if q is None:
                    q = self._keys[key] = deque(maxlen=self.per_key)
                else:
                    self._keys.move_to_end(key)
                q.append((sid, i))
        sc.states.clear()
        sc.ptrs.clear()
        self._held += len(tokens)
        while self._held > self.max_tokens and len(self._seqs) > 1:
            old_id, old = self._seqs.popitem(last=False)
            self._scan.pop(old_id, None)
            self._held -= len(old)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    # ------------------------------------------------------------------ proposing
    def lookup(self, scanner: LayoutScanner, budget: int) -> tuple[int, ...] | None:
        """The best run for the scanner's position (the first of ``candidates``), or None."""
        for run in self.candidates(scanner, budget):
            return run
        return None

    def candidates(self, scanner: LayoutScanner, budget: int, limit: int = 4):
        """Runs for the scanner's position, best first: for the longest key that has any, the frozen run, then
        the majority path of each group of occurrences that start alike (most frequent first, each with
        ``min_support`` occurrences), so a drafter can try the next when the grammar refuses one (a ``",`` the
        schema does not allow after the last property: then ``"``)."""
        budget = min(budget, self.max_run)
        if budget <= 0:
            return
        for n in range(min(self.max_key, len(scanner.syms)), 0, -1):
            key = scanner.key(n)
            found = 0
            run = self._structural(self._table.get(key), budget)
            if run:
                found += 1
                yield run
            q = self._keys.get(key)
            if q:
                groups: dict[int, list] = {}
                for sid, i in reversed(q):
                    s = self._seqs.get(sid)
                    if s is not None and i < len(s):
                        groups.setdefault(s[i], []).append(s[i:i + budget])
                total = sum(len(g) for g in groups.values())
                structural = sum(len(g) for t, g in groups.items() if self._structural((t,), 1))
                share = self.min_share_in_value if key[0] % 3 == 0 else self.min_share  # (mode 2: (-1000-3d-2) % 3 == 0)
                if structural < share * total:
                    return  # mostly content follows this key (inside a value): not layout's to guess
                for conts in sorted(groups.values(), key=len, reverse=True):
                    if len(conts) < self.min_support:
                        break
                    run = self._structural(_majority(conts, budget, self.min_support), budget)
                    if run:
                        found += 1
                        yield run
                        if found >= limit:
                            return
            if found:
                return

    def _structural(self, run, budget: int) -> tuple[int, ...] | None:
        """The run up to its first content token (layout proposes structure only)."""
        if not run:
            return None
        tb = self.token_bytes
        n = 0
        while n < min(len(run), budget) and 0 <= run[n] < len(tb) and (not tb[run[n]] or is_structural(tb[run[n]])):
            n += 1  # (a token with no bytes: a stop token; the grammar's mask says whether it may come)
        return tuple(run[:n]) if n else None

    # ------------------------------------------------------------------ freezing (recipe packs)
    def table(self, *, min_support: int = 3, agree: float = 0.8) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Every key's run where ``agree`` of its (latest ``per_key``) occurrences and at least ``min_support``
        agree on each token; a key whose one-shorter key gives the same run is left out."""
        out: dict[tuple[int, ...], tuple[int, ...]] = {}
        for key in sorted(self._keys, key=len):
            conts = [self._seqs[sid][i:i + self.max_run] for sid, i in self._keys[key]
                     if sid in self._seqs and i < len(self._seqs[sid])]
            need = max(min_support, int(agree * len(conts) + 0.999))
            run = _majority(conts, self.max_run, need)
            if not run:
                continue
            shorter = out.get((key[0], *key[2:])) if len(key) > 2 else None
            if shorter == run:
                continue
            out[key] = run
        return out

    def load_table(self, table: dict[tuple[int, ...], tuple[int, ...]]) -> "LayoutIndex":
        self._table.update(table)
        return self


def _majority(conts: list, budget: int, min_support: int) -> tuple[int, ...] | None:
    run: list[int] = []
    while len(run) < budget and conts:
        counts: dict[int, int] = {}
        for c in conts:
            if len(run) < len(c):
                counts[c[len(run)]] = counts.get(c[len(run)], 0) + 1
        if not counts:
            break
        tok, c = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
        if c < min_support:
            break
        run.append(tok)
        conts = [x for x in conts if len(run) <= len(x) and x[len(run) - 1] == tok]
    return tuple(run) if run else None


def table_to_json(table: dict) -> list:
    return [[list(k), list(v)] for k, v in sorted(table.items())]


def table_from_json(rows, where: str = "layout table") -> dict[tuple[int, ...], tuple[int, ...]]:
    out = {}
    for i, row in enumerate(rows or ()):
        if (not isinstance(row, list) or len(row) != 2 or not all(isinstance(x, int) for x in row[0])
                or not all(isinstance(x, int) and x >= 0 for x in row[1]) or not row[0] or not row[1]):
            raise ValueError(f"{where}: row {i} is malformed")
        out[tuple(row[0])] = tuple(row[1])
    return out


_SERVER: dict = {}


def server_layout_index(key: str, token_bytes: Sequence[bytes], **kw) -> LayoutIndex:
    """The process-wide layout index for one model (``key``: the tokenizer fingerprint)."""
    idx = _SERVER.get(key)
    if idx is None:
        idx = _SERVER[key] = LayoutIndex(token_bytes, **kw)
    return idx
