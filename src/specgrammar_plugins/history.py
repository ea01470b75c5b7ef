"""History-keyed grammar state, for hosts that keep their own decoding loop.

Host logits processors are called with a token history, not told which tokens were accepted: under speculation
the history may move backwards (a rejected draft), jump forwards (several accepted tokens), or contain a draft
the grammar rejects (a grammar-blind draft model).  ``HistoryMatcher.mask_for(generated)`` derives the matcher
state from the history alone: it rolls back to the longest common prefix with what it has fed, feeds the rest,
and never feeds a token the grammar rejects.

``MaskProcessor`` is the one history-keyed mask every host's processor is: it also finds where the prompt ends
in the histories a host passes.  Host shims (mlx-lm, llama-cpp-python) only convert its boolean row into their
tensors.  ``StopOnlyMask`` has the same face and allows only stop tokens (a request whose constraint could not
be compiled at generation time ends at once instead of running unconstrained).
"""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np

from .constraint import CompiledConstraint
from .masks import full_mask, new_mask, set_bit, unpack_mask
from .prefix import common_prefix_len


class HistoryMatcher:
    def __init__(self, compiled: CompiledConstraint):
        self.compiled = compiled
        self.matcher = compiled.matcher()
        self.vocab_size = compiled.tokenizer.vocab_size
        self.fed: list[int] = []  # tokens the matcher has accepted, in order
        # fed[:synced] is a prefix of the history the last successful sync brought it to (every cut of fed keeps
        # it so): what sync_tail may take as compared
        self.synced = 0
        self._row = new_mask(self.vocab_size)
        self._free = None
        self._view: DraftView | None = None

    def sync(self, generated: Sequence[int]) -> bool:
        """Bring the matcher to ``generated``; False if the history holds a token the grammar rejects (the matcher
        then stands at the longest valid prefix)."""
        fed = self.fed
        lcp = common_prefix_len(fed, generated)
        if len(fed) > lcp:
            self.matcher.rollback(len(fed) - lcp)
            del fed[lcp:]
            self.synced = min(self.synced, lcp)
        for t in generated[lcp:]:
            t = int(t)
            if self.matcher.is_terminated() or not self.matcher.accept(t):
                return False
            fed.append(t)
        self.synced = len(generated)
        return True

    def sync_tail(self, base: int, tail: Sequence[int]) -> bool:
        """``sync`` to the first ``base`` tokens of the last synced history plus ``tail``, without comparing that
        part again (O(len(tail)) instead of O(history)): for a host whose history only grows between calls (vLLM's
        committed tokens, step after step).  False as ``sync``: the tail holds a token the grammar rejects.
        ``base`` must not pass ``synced`` (ValueError: the caller syncs the whole history instead)."""
        fed = self.fed
        if base > self.synced:
            raise ValueError(f"sync_tail from {base} tokens, past the {self.synced} compared before")
        lcp = base + common_prefix_len(fed[base:base + len(tail)], tail)
        if len(fed) > lcp:
            self.matcher.rollback(len(fed) - lcp)
            del fed[lcp:]
            self.synced = min(self.synced, lcp)
        for t in tail[lcp - base:]:
            t = int(t)
            if self.matcher.is_terminated() or not self.matcher.accept(t):
                return False
            fed.append(t)
        self.synced = base + len(tail)
        return True

    def draft(self) -> "DraftView":
        """This history's own matcher for one round of drafts (a ``DraftBlock``'s), instead of a fork: every token
        it accepts is appended to ``fed``, so the next ``sync`` keeps the drafts the host committed and rolls back
        the rest.  A fork costs O(tokens so far) on xgrammar (it copies the matcher's whole token history: ~0.3 us
        a token), and the committed drafts are not fed a second time.  One view per history, made once (it holds
        no state of a round: a batch host asks for it per request at every step)."""
        if self._view is None:
            self._view = DraftView(self)
        return self._view

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


class DraftView:
    """``HistoryMatcher.draft()``: the history's matcher with ``accept`` and ``rollback`` kept in step with its
    ``fed`` list; every other method is the matcher's own (bound once: a block asks at every position).  Drafts are
    tokens, so ``accept_bytes`` is refused (bytes merged into a position would not be in ``fed``)."""

    __slots__ = ("_m", "_h", "_fed", "_accept", "vocab_size", "fill_mask", "is_terminated", "forced", "jump_forward",
                 "fork", "jump_forward_complete")

    def __init__(self, history: HistoryMatcher):
        m = self._m = history.matcher
        # (weakly: the history holds its view, and a cycle left each request's matcher, and through it its compiled
        # grammar, to the cyclic collector, which vLLM's EngineCore runs rarely: a 20,000-option choice's grammar
        # stayed +66 MB after the request, issue 33)
        self._h = weakref.ref(history)
        self._fed = history.fed
        self._accept = m.accept
        self.vocab_size = history.vocab_size
        self.fill_mask = m.fill_mask
        self.is_terminated = m.is_terminated
        self.forced = m.forced
        self.jump_forward = m.jump_forward
        self.fork = m.fork
        # the matcher's own (a class's constant: a lazy block's forced drafter reads it at every position)
        self.jump_forward_complete = getattr(m, "jump_forward_complete", False)

    def accept(self, token: int) -> bool:
        if not self._accept(token):
            return False
        self._fed.append(int(token))
        return True

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(n)
            del self._fed[-n:]
            h = self._h()
            if h is not None:
                h.synced = min(h.synced, len(self._fed))

    def accept_bytes(self, data: bytes) -> bool:
        raise NotImplementedError("a draft view takes tokens only (HistoryMatcher.draft)")


class RequestBoundary:
    """Where the prompt ends in the token histories a host passes.  ``prompt_len`` (or ``reset``) sets it per
    request; otherwise the first history seen is taken as the prompt, and a history that does not extend the
    remembered prompt starts a new request."""

    def __init__(self, prompt_len: int | None = None):
        self.prompt_len = prompt_len
        self._prompt: list[int] | None = None

    def reset(self, prompt_len: int | None = None) -> None:
        self.prompt_len = prompt_len
        self._prompt = None

    def generated(self, ids: Sequence[int], first_is_prompt: int = 0) -> list[int]:
        """The part of ``ids`` after the prompt.  ``first_is_prompt``: how many ids past the prompt a first call
        sees (0 for a logits processor, 1 for a host's draft model, first called after one sampled token)."""
        ids = [int(t) for t in ids]
        p = self._prompt
        if p is not None and len(ids) >= len(p) and ids[: len(p)] == p:
            return ids[len(p):]
        if p is None and self.prompt_len is not None:
            self._prompt = ids[: self.prompt_len]
        else:  # first call, or a history that does not extend the remembered prompt: a new request
            self._prompt = ids[: max(0, len(ids) - first_is_prompt)]
            self.prompt_len = len(self._prompt)
        return ids[len(self._prompt):]


def _widen(allowed: np.ndarray, width: int) -> np.ndarray:
    if allowed.shape[-1] < width:  # a model head wider than the tokenizer: the extra ids are never allowed
        allowed = np.concatenate([allowed, np.zeros(width - allowed.shape[-1], dtype=bool)])
    return allowed


class MaskProcessor(RequestBoundary):
    """The history-keyed grammar mask of one request: ``allowed(history, width)`` is the boolean row of tokens the
    grammar allows after ``history`` (prompt + generated, as the host passes it).  One per request (or ``reset``
    between requests).  ``fit``: a budget whose cut is part of the row (``budget.ExactBudget``, a function of the
    history: the host's own loop, draft and verification alike, sees the same row)."""

    def __init__(self, compiled: CompiledConstraint, prompt_len: int | None = None, fit=None):
        super().__init__(prompt_len)
        self.compiled = compiled
        self.fit = fit
        self.history = HistoryMatcher(compiled)
        self.calls = 0
        self.invalid_calls = 0  # histories holding a grammar-rejected token (a blind draft the host will reject)

    def mask(self, history: Sequence[int]) -> np.ndarray:
        """The packed row for the position after ``history``."""
        self.calls += 1
        generated = self.generated(history)
        row, ok = self.history.mask_for(generated)
        if not ok:
            self.invalid_calls += 1
        elif self.fit is not None and row is self.history._row:  # (the grammar's own row, refilled every call)
            self.fit.restrict(row, generated)
        return row

    def allowed(self, history: Sequence[int], width: int) -> np.ndarray:
        return _widen(unpack_mask(self.mask(history), width), width)


class StopOnlyMask:
    """A processor's mask that allows only the stop tokens: what a request gets whose constraint failed to compile
    at generation time (``reason``), so it ends at once rather than run unconstrained."""

    def __init__(self, stop_token_ids: Sequence[int], reason: str = ""):
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.reason = reason

    def allowed(self, history: Sequence[int], width: int) -> np.ndarray:
        keep = np.zeros(width, dtype=bool)
        keep[[t for t in self.stop_token_ids if 0 <= t < width]] = True
        return keep
