"""The online recipe index: ``SuffixIndex``, a per-server, bounded (LRU by tokens) index over recently verified
outputs (SuffixDecoding-style) that learns while serving; ``drafters.SuffixDrafter`` proposes from it."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

# ---------------------------------------------------------------------------------------------- online suffix index
class SuffixIndex:
    """Recently verified outputs of one server, indexed by their n-grams (SuffixDecoding-style), bounded.

    ``observe(tokens, start)`` adds one finished sequence (``tokens[start:]`` is the output; the ``context``
    tokens before it are kept so keys can reach into the prompt's tail).  Lookup takes the longest key (up to
    ``max_key`` tokens, at least ``min_key``) that matches the context's suffix and has a continuation, and returns
    the majority path through its ``per_key`` latest occurrences, as long as ``min_support`` of them agree.  The oldest sequences are forgotten once more than ``max_tokens``
    are held; the key table is an LRU of ``max_keys`` entries."""

    def __init__(self, *, max_key: int = 8, min_key: int = 2, max_tokens: int = 200_000, max_keys: int = 500_000,
                 max_run: int = 16, per_key: int = 4, context: int = 8, min_support: int = 2):
        self.max_key, self.min_key, self.max_run, self.per_key, self.context = max_key, min_key, max_run, per_key, context
        self.min_support = min_support  # occurrences that must agree on each proposed token
        self.max_tokens, self.max_keys = max_tokens, max_keys
        self._seqs: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._held = 0
        self._next = 0
        self._keys: OrderedDict[tuple[int, ...], deque] = OrderedDict()
        self.observed = 0

    def __len__(self) -> int:
        return len(self._keys)

    def observe(self, tokens: Sequence[int], start: int = 0) -> None:
        start = max(0, min(start, len(tokens)))
        lo = max(0, start - self.context)
        seq = tuple(int(t) for t in tokens[lo:])
        start -= lo
        if len(seq) - start < 1:
            return
        sid = self._next
        self._next += 1
        self._seqs[sid] = seq
        self._held += len(seq)
        self.observed += 1
        for i in range(max(start, self.min_key), len(seq)):
            for n in range(self.min_key, min(self.max_key, i) + 1):
                key = seq[i - n:i]
                q = self._keys.get(key)
                if q is None:
                    q = self._keys[key] = deque(maxlen=self.per_key)
                else:
                    self._keys.move_to_end(key)
                q.append((sid, i))
        while self._held > self.max_tokens and len(self._seqs) > 1:
            _, old = self._seqs.popitem(last=False)
            self._held -= len(old)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def lookup(self, seq: Sequence[int], budget: int | None = None) -> tuple[int, ...] | None:
        budget = self.max_run if budget is None else min(budget, self.max_run)
        tail = tuple(seq[-self.max_key:])
        for n in range(min(self.max_key, len(tail)), self.min_key - 1, -1):
            q = self._keys.get(tail[len(tail) - n:])
            if not q:
                continue
            conts = []
            for sid, i in q:
                s = self._seqs.get(sid)
                if s is not None and i < len(s):
                    conts.append(s[i:i + budget])
            if not conts:
                continue
            run: list[int] = []
            while len(run) < budget:  # the majority path through the latest occurrences
                counts: dict[int, int] = {}
                for c in conts:
                    if len(run) < len(c):
                        counts[c[len(run)]] = counts.get(c[len(run)], 0) + 1
                if not counts:
                    break
                tok, c = max(counts.items(), key=lambda kv: kv[1])
                if c < self.min_support:
                    break
                run.append(tok)
                conts = [c for c in conts if len(run) <= len(c) and c[len(run) - 1] == tok]
            if run:
                return tuple(run)
        return None


_SERVER_INDEXES: dict = {}


def server_suffix_index(key: str = "default", **kw) -> SuffixIndex:
    """The process-wide suffix index for one model (``key``: e.g. the tokenizer fingerprint)."""
    idx = _SERVER_INDEXES.get(key)
    if idx is None:
        idx = _SERVER_INDEXES[key] = SuffixIndex(**kw)
    return idx
