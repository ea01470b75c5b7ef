"""A history-keyed, rollback-safe grammar mask for hosts that keep their own decoding loop.

Host logits processors are called with a token history, not told which tokens were accepted: under speculation
the history may move backwards (a rejected draft), jump forwards (several accepted tokens), or contain a draft
the grammar rejects (a grammar-blind draft model).  ``HistoryMatcher.mask_for(generated)`` derives the matcher
state from the history alone: it rolls back to the longest common prefix with what it has fed, feeds the rest,
and never feeds a token the grammar rejects.  Adapters (mlx-lm, llama-cpp-python) wrap it in their host's
processor signature.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .constraint import CompiledConstraint, full_mask, new_mask, set_bit


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (how far a history-keyed state is still valid)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class HistoryMatcher:
    def __init__(self, compiled: CompiledConstraint):
        self.compiled = compiled
        self.matcher = compiled.matcher()
        self.vocab_size = compiled.tokenizer.vocab_size
        self.fed: list[int] = []  # tokens the matcher has accepted, in order
        self._row = new_mask(self.vocab_size)
        self._free = None

    def sync(self, generated: Sequence[int]) -> bool:
        """Bring the matcher to ``generated``; False if the history holds a token the grammar rejects (the matcher
        then stands at the longest valid prefix)."""
        fed = self.fed
        lcp = common_prefix_len(fed, generated)
        if len(fed) > lcp:
            self.matcher.rollback(len(fed) - lcp)
            del fed[lcp:]
        for t in generated[lcp:]:
            t = int(t)
            if self.matcher.is_terminated() or not self.matcher.accept(t):
                return False
            fed.append(t)
        return True

    def mask_for(self, generated: Sequence[int]) -> tuple[np.ndarray, bool]:
        """(packed mask for the position after ``generated``, history valid?).  For an invalid history (a
        grammar-rejected draft in it) the mask allows every token: the host discards that position anyway, since
        its verifier rejects the invalid draft before it."""
        ok = self.sync(generated)
        if not ok or self.matcher.is_terminated():
            if self._free is None:
                self._free = full_mask(self.vocab_size)
            if ok:  # grammar complete and stop token already taken: only stop tokens make sense
                row = new_mask(self.vocab_size)
                for s in self.compiled.tokenizer.stop_token_ids:
                    set_bit(row, s)
                return row, True
            return self._free, False
        self.matcher.fill_mask(self._row)
        return self._row, True
