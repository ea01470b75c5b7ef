"""One round's draft block: the structure that computes each position's grammar mask once (mask once, use twice).

A ``DraftBlock`` owns the request's matcher for the round (advanced through the drafts, rolled back by the loop
after verification), computes each position's packed mask once (the drafters read it, verification reuses it),
and refuses any token its mask forbids, so a grammar-aware draft never proposes what the target must reject.
``fill(block, drafter)`` is the one routine that lets a drafter fill a block; every host's drafting goes through it.

``ModelRunner`` is the face of a model with a KV cache, as a host adapter exposes it to the core; ``Drafter`` is
the face of a drafter (``drafters.py``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .constraint import Matcher
from .masks import full_mask, mask_allows, mask_words


class ModelRunner(Protocol):
    """A model with a KV cache, as an adapter exposes it to the core.

    tokens: the token ids whose keys/values the cache holds, in order.
    vocab_size: the model's output width (logit row length).
    """

    vocab_size: int

    @property
    def tokens(self) -> Sequence[int]: ...

    def forward(self, tokens: Sequence[int], logits_for: int | None = None) -> np.ndarray:
        """Append ``tokens`` to the cache and return float logits [m, vocab_size] for the last ``m = logits_for``
        of them (all of them when None; an empty array for 0)."""

    def trim(self, n: int) -> None:
        """Drop the last ``n`` tokens from the cache (O(1) where the host allows)."""


class HiddenStatesRunner(ModelRunner, Protocol):
    """A ``ModelRunner`` that also hands over its hidden states, for a drafter that reads the target's (EAGLE,
    MTP: their draft heads run on the target's last hidden states).  In a batch (``batch.Step.hidden``) the host
    passes the step's hidden states beside the rows."""

    def forward_hidden(self, tokens: Sequence[int], logits_for: int | None = None) -> tuple[Any, Any]:
        """``forward``, and the hidden states [m, hidden_size] of the same ``m`` positions (the host's tensors)."""


# The forced drafter's sources (``drafters.ForcedDrafter``): its single-token walk (the grammar's own tokens) and its
# tokenized jump-forward string (forced bytes, which the model may split otherwise).  Both leave the block's budget
# to drafts that may be rejected, and both count as forced tokens (``loop.Stats.forced_tokens``).
FORCED_JUMP = "forced-jump"
FORCED_SOURCES = ("forced", FORCED_JUMP)


class DraftBlock:
    """One round's drafts: tokens, their proposal laws (None = one-hot) and sources, plus the masks (and tilts)
    of every position, computed once here and reused by verification.

    ``budget`` bounds the model's and recipes' drafts (k); ``free`` more positions are open to tokens the grammar
    forces (source "forced"): where the mask allows one token the masked target law puts all its mass on it, so
    it is always accepted and only widens the verification pass by a row.  ``room`` is what a drafter may still
    push.

    ``fit`` (``budget.Budget``): the request's budget feasibility; its cut is part of each row, made right after
    the grammar fills it (still one fill per position), so draft laws and target law read the same combined row.
    ``fit_cut[i]``: whether it removed a token at position i.

    ``lazy``: for a host that verifies with masks of its own (vLLM builds every verification row itself), a
    position's mask is filled only when something reads it (``mask()``, ``allows``).  A draft pushed where none was
    read is checked by the matcher's own ``accept`` (the same verdict: a token the mask forbids is one the grammar
    rejects) and leaves ``None`` as that position's row, so ``finish()`` is refused; the forced drafter first asks
    the matcher's jump-forward string (``forced_hint``), which costs no [V]-wide fill.  At a 151,936-token
    vocabulary a fill costs ~0.05-0.5 ms; most draft positions need none (a model draft the grammar accepts).
    Not with ``fit`` or ``tilt_fn`` (their cut and tilt are part of each row)."""

    def __init__(self, context: Sequence[int], matcher: Matcher | None, vocab_size: int, budget: int,
                 stop_token_ids: Sequence[int] = (),
                 tilt_fn: Callable[[Sequence[int], Matcher | None], np.ndarray | None] | None = None,
                 prompt_len: int = 0, free: int = 0, law=None, fit=None, lazy: bool = False):
        if lazy and (fit is not None or tilt_fn is not None):
            raise ValueError("a lazy DraftBlock has no budget cut or tilt (both are part of every row)")
        self.lazy = lazy and matcher is not None
        self.context = context  # committed tokens (prompt + emitted) before the block
        self.prompt_len = prompt_len  # tilt_fn sees the generated part: context[prompt_len:] + drafts
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.budget = budget
        self.capacity = budget + (free if matcher is not None and budget > 0 else 0)
        self.n_free = 0  # forced drafts pushed beyond the budget's count
        # (a host that builds a block per request per step passes its frozenset, kept as it is)
        self.stop_token_ids = stop_token_ids if isinstance(stop_token_ids, frozenset) else frozenset(stop_token_ids)
        self.tilt_fn = tilt_fn
        self.tokens: list[int] = []
        self.laws: list[np.ndarray | None] = []
        self.sources: list[str] = []
        self.matched = 0  # drafts the matcher accepted (a blind draft it rejects is verified but not matched)
        self.closed = False  # no more drafts (a stop token or the budget)
        # a blind draft the grammar rejects: the target will reject it, and like a stock blind drafter the draft
        # goes on to the budget (those drafts and draft passes are the waste blind drafting costs); the rows
        # after it are never reached in verification, so their masks are placeholders
        self.dead = False
        # one packed row per position visited, filled once by the matcher (None: unconstrained)
        self.masks: list[np.ndarray] | None = [] if matcher is not None else None
        self.tilts: list[np.ndarray | None] = []
        self.fit = fit
        self.fit_cut: list[bool] = []
        self.mask_ns = 0
        self.mask_fills = 0  # matcher.fill_mask calls: exactly one per position visited
        self.placeholders = 0  # rows past the grammar's end (or after a rejected blind draft): never filled
        self.law = law  # the round's law backend (laws.LawBackend); drafters sample through it
        self.cache: dict = {}  # the law backend's per-round scratch (each position's mask unpacked once)
        self.timing: dict[str, int] = {}  # ns per phase ("draft_law", "target_law", "verify", "copy")
        self.t_start = time.perf_counter_ns()

    # ---------------------------------------------------------------- the current position
    @property
    def position(self) -> int:
        return len(self.tokens)

    @property
    def room(self) -> int:
        """Drafts that may still be pushed (forced tokens within ``free`` do not use it up)."""
        n = len(self.tokens)
        return max(0, min(self.budget - n + self.n_free, self.capacity - n))

    @property
    def done(self) -> bool:
        # (``room <= 0`` spelled out: drafters and hosts ask at every position, several times)
        if self.closed:
            return True
        n = len(self.tokens)
        if n >= self.capacity or n - self.n_free >= self.budget:
            return True
        m = self.matcher
        return m is not None and m.is_terminated()

    def sequence(self) -> list[int]:
        return [*self.context, *self.tokens]

    def has_mask(self) -> bool:
        """Whether the current position's mask is filled (always, once asked for; a lazy block fills on demand)."""
        return self.masks is not None and len(self.masks) > len(self.tokens)

    def forced_hint(self) -> bytes | None:
        """For a lazy block whose current mask is not filled: the matcher's jump-forward string, which is empty
        where no byte is forced (then no token is: with a byte-complete vocabulary the only allowed token would be
        a single byte every continuation starts with; ``tests/test_block.py`` holds this against the masks on
        every engine that says ``jump_forward_complete``).  None where the mask is at hand, the block is not lazy or
        the engine cannot tell: read the mask."""
        if not self.lazy or len(self.masks) > len(self.tokens) or self.dead or self.closed:
            return None
        if not getattr(self.matcher, "jump_forward_complete", False):
            return None  # its b"" may mean "cannot tell"
        return self.matcher.jump_forward()

    def mask(self) -> np.ndarray | None:
        """The packed mask of the current position (None when unconstrained), computed once: the forced drafter,
        the draft laws and the target law all read this row."""
        if self.matcher is None:
            return None
        i = len(self.tokens)
        if len(self.masks) > i:  # (the common case: filled once, read by the drafters and the host)
            return self.masks[i]
        t0 = time.perf_counter_ns()
        if self.matcher.is_terminated() or self.closed or self.dead:
            row = _full_row(self.vocab_size)  # never sampled from: a placeholder for an unused row
            self.placeholders += 1
        else:
            row = np.empty(mask_words(self.vocab_size), dtype=np.int32)
            self.matcher.fill_mask(row)
            self.mask_fills += 1
            if self.fit is not None:
                self.fit_cut.append(self.fit.restrict(row, self.sequence()[self.prompt_len:]))
        if len(self.fit_cut) < len(self.masks) + 1:
            self.fit_cut.append(False)
        self.masks.append(row)
        if self.tilt_fn is not None:
            self.tilts.append(self.tilt_fn(self.sequence()[self.prompt_len:], self.matcher))
        self.mask_ns += time.perf_counter_ns() - t0
        return self.masks[i]

    def tick(self, phase: str, t0: int) -> int:
        """Add the time since ``t0`` (``perf_counter_ns``) to ``phase``; returns now."""
        t = time.perf_counter_ns()
        self.timing[phase] = self.timing.get(phase, 0) + t - t0
        return t

    def tilt(self) -> np.ndarray | None:
        if self.tilt_fn is None:
            return None
        if self.matcher is None:
            return self.tilt_fn(self.sequence()[self.prompt_len:], None)
        self.mask()
        return self.tilts[self.position]

    def allows(self, token: int) -> bool:
        m = self.mask()
        return m is None or mask_allows(m, token)

    # ---------------------------------------------------------------- adding drafts
    def push(self, token: int, law: np.ndarray | None = None, source: str = "model", *, check: bool = True) -> bool:
        """Append a draft. With ``check`` (grammar-aware), a token the mask forbids is refused (returns False).
        With ``check=False`` (blind drafting) it is appended anyway and closes the block if the grammar rejects it."""
        tokens = self.tokens
        n = len(tokens)
        m = self.matcher
        # (``done`` written out: a batch host pushes once per request per position)
        if self.closed or n >= self.capacity or n - self.n_free >= self.budget or (m is not None and m.is_terminated()):
            return False
        token = int(token)
        if self.lazy and check and not self.dead and len(self.masks) == n:
            # a lazy block's position whose mask nobody read: the matcher's own accept is the check
            if not m.accept(token):
                return False
            self.matched += 1
            self.masks.append(None)  # (not filled)
            self.fit_cut.append(False)
        else:
            ok = self.allows(token)
            if not ok and check:
                return False
            if self.matcher is not None and not self.dead:
                if ok and self.matcher.accept(token):
                    self.matched += 1
                else:
                    self.dead = True
        if source in FORCED_SOURCES and self.n_free < self.capacity - self.budget:
            self.n_free += 1  # the grammar's own token: it leaves the budget to drafts that may be rejected
        tokens.append(token)
        self.laws.append(law)
        self.sources.append(source)
        if token in self.stop_token_ids and not self.dead:  # (a blind drafter goes on past a stop it had no right to)
            self.closed = True
        return True

    def cut(self, j: int) -> None:
        """Drop the drafts from position ``j`` on (a grammar-checked block's: its matcher, which accepted each, is
        rolled back), keeping the masks of positions up to ``j``: the block is as it was when its ``j``-th draft was
        pushed (a host's draft arbiter overruled that draft: ``batch.Row.judge``)."""
        drop = len(self.tokens) - j
        if drop <= 0:
            return
        if self.dead:
            raise ValueError("a block whose blind draft the grammar rejected cannot be cut")
        if self.matcher is not None:
            self.matcher.rollback(drop)
        self.matched -= drop
        if self.closed and any(t in self.stop_token_ids for t in self.tokens[j:]):
            self.closed = False  # (closed by a stop token it drafted)
        del self.tokens[j:], self.laws[j:], self.sources[j:]
        self.n_free = 0  # (counted again as ``push`` counts it)
        for s in self.sources:
            if s in FORCED_SOURCES and self.n_free < self.capacity - self.budget:
                self.n_free += 1
        if self.masks is not None:
            del self.masks[j + 1:]
        del self.fit_cut[j + 1:], self.tilts[j + 1:]
        self.cache.clear()  # (the law backend's scratch is per position)

    def finish(self) -> tuple[list[np.ndarray] | None, list[np.ndarray | None] | None]:
        """Masks (and tilts) for all k+1 verification rows (the bonus position's mask is filled here)."""
        if self.lazy and any(m is None for m in self.masks):
            raise RuntimeError("a lazy DraftBlock has no mask for the positions it did not read (the host verifies "
                               "with masks of its own)")
        n = len(self.tokens) + 1
        if self.matcher is None:
            if self.tilt_fn is None:
                return None, None
            if len(self.tilts) < n:  # unconstrained: the tilt of every position, from the generated text alone
                gen = self.sequence()[self.prompt_len:]
                self.tilts = [self.tilt_fn(gen[: len(gen) - len(self.tokens) + i], None) for i in range(n)]
            return None, self.tilts[:n]
        self.mask()  # the bonus position
        return self.masks[:n], (self.tilts[:n] if self.tilt_fn is not None else None)


_FULL: dict[int, np.ndarray] = {}


def _full_row(vocab_size: int) -> np.ndarray:
    row = _FULL.get(vocab_size)
    if row is None:
        row = _FULL[vocab_size] = full_mask(vocab_size)
        row.flags.writeable = False
    return row


class Drafter(Protocol):
    """Proposes drafts for one request. ``extend`` pushes up to ``budget`` tokens onto the block and returns how
    many it pushed (0 = nothing to propose here)."""

    name: str

    def extend(self, block: DraftBlock, budget: int) -> int: ...




def fill(block: "DraftBlock", drafter: Drafter | None) -> int:
    """Let ``drafter`` push drafts onto ``block`` until the block is done or the drafter has nothing more to
    propose; returns the number of drafts pushed."""
    if drafter is None:
        return 0
    start = len(block.tokens)
    while not block.done:
        if drafter.extend(block, block.room) <= 0:
            break
    return len(block.tokens) - start
