"""Drafters: where draft tokens come from.

A drafter extends a ``DraftBlock``: the block owns the request's matcher (advanced through the drafts and rolled
back after verification), computes each position's grammar mask once (the verifier reuses it: mask once, use
twice), and refuses any token its mask forbids, so a grammar-aware draft never proposes what the target must
reject.  Every drafted token is verified by the target; nothing is injected past the verifier.

- ``ForcedDrafter``: the tokens the grammar forces, and the tokenized jump-forward string (one-hot drafts).
- ``ModelDrafter``: a small draft model through a ``ModelRunner``, sampling from the proposal law r (the same
  transform as the target law, on the draft's logits).  ``blind=True`` drafts without the mask: only so that
  benchmarks can reproduce the blind-draft problem (a grammar-invalid draft ends the block and is rejected).
- ``ChainDrafter``: tries its drafters in order at every position (forced, then recipe, then model).
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

import numpy as np

from .constraint import Matcher, full_mask, mask_allows, new_mask
from .distributions import SamplingParams, log_law, sample
from .processor import common_prefix_len


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


class DraftBlock:
    """One round's drafts: tokens, their proposal laws (None = one-hot) and sources, plus the masks (and tilts)
    of every position, computed once here and reused by verification.

    ``budget`` bounds the model's and recipes' drafts (k); ``free`` more positions are open to tokens the grammar
    forces (source "forced"): where the mask allows one token the masked target law puts all its mass on it, so
    it is always accepted and only widens the verification pass by a row.  ``room`` is what a drafter may still
    push."""

    def __init__(self, context: Sequence[int], matcher: Matcher | None, vocab_size: int, budget: int,
                 stop_token_ids: Sequence[int] = (),
                 tilt_fn: Callable[[Sequence[int], Matcher | None], np.ndarray | None] | None = None,
                 prompt_len: int = 0, free: int = 0):
        self.context = context  # committed tokens (prompt + emitted) before the block
        self.prompt_len = prompt_len  # tilt_fn sees the generated part: context[prompt_len:] + drafts
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.budget = budget
        self.capacity = budget + (free if matcher is not None and budget > 0 else 0)
        self.n_free = 0  # forced drafts pushed beyond the budget's count
        self.stop_token_ids = frozenset(stop_token_ids)
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
        self.masks = new_mask(vocab_size, rows=self.capacity + 1) if matcher is not None else None
        self.tilts: list[np.ndarray | None] = []
        self._have_mask = -1
        self.mask_ns = 0

    # ---------------------------------------------------------------- the current position
    @property
    def position(self) -> int:
        return len(self.tokens)

    @property
    def room(self) -> int:
        """Drafts that may still be pushed (forced tokens within ``free`` do not use it up)."""
        return max(0, min(self.budget - (len(self.tokens) - self.n_free), self.capacity - len(self.tokens)))

    @property
    def done(self) -> bool:
        return self.closed or self.room <= 0 or (self.matcher is not None and self.matcher.is_terminated())

    def sequence(self) -> list[int]:
        return [*self.context, *self.tokens]

    def mask(self) -> np.ndarray | None:
        """The packed mask of the current position (None when unconstrained), computed once."""
        if self.matcher is None:
            return None
        i = self.position
        if self._have_mask < i:
            t0 = time.perf_counter_ns()
            if self.matcher.is_terminated() or self.closed or self.dead:
                self.masks[i] = full_mask(self.vocab_size)  # never sampled from: placeholder for an unused row
            else:
                self.matcher.fill_mask(self.masks[i])
            if self.tilt_fn is not None:
                self.tilts.append(self.tilt_fn(self.sequence()[self.prompt_len:], self.matcher))
            self.mask_ns += time.perf_counter_ns() - t0
            self._have_mask = i
        return self.masks[i]

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
        if self.done:
            return False
        token = int(token)
        ok = self.allows(token)
        if not ok and check:
            return False
        if self.matcher is not None and not self.dead:
            if ok and self.matcher.accept(token):
                self.matched += 1
            else:
                self.dead = True
        if source == "forced" and self.n_free < self.capacity - self.budget:
            self.n_free += 1  # the grammar's own token: it leaves the budget to drafts that may be rejected
        self.tokens.append(token)
        self.laws.append(law)
        self.sources.append(source)
        if token in self.stop_token_ids and not self.dead:  # (a blind drafter goes on past a stop it had no right to)
            self.closed = True
        return True

    def finish(self) -> tuple[np.ndarray | None, list[np.ndarray | None] | None]:
        """Masks (and tilts) for all k+1 verification rows."""
        if self.matcher is None:
            if self.tilt_fn is None:
                return None, None
            gen = self.sequence()[self.prompt_len:]
            return None, [self.tilt_fn(gen[: len(gen) - len(self.tokens) + i], None) for i in range(len(self.tokens) + 1)]
        self.mask()  # the bonus position
        n = len(self.tokens) + 1
        return self.masks[:n], (self.tilts[:n] if self.tilt_fn is not None else None)


class Drafter(Protocol):
    """Proposes drafts for one request. ``extend`` pushes up to ``budget`` tokens onto the block and returns how
    many it pushed (0 = nothing to propose here)."""

    name: str

    def extend(self, block: DraftBlock, budget: int) -> int: ...


class ForcedDrafter:
    """Tokens the grammar forces next, then the tokenized jump-forward string (each one a one-hot draft)."""

    name = "forced"

    def __init__(self, encode: Callable[[str], list[int]] | None = None):
        self.encode = encode

    def extend(self, block: DraftBlock, budget: int) -> int:
        if block.matcher is None or budget <= 0 or block.dead:
            return 0
        forced = block.matcher.forced()
        toks = list(forced.tokens)
        if not toks and forced.text and self.encode is not None:
            try:
                # the string's last token may merge with the text that follows it (forced 'age"' then ':' is
                # tokenized 'age' '":' by the model), so a draft of it would be rejected: propose the others
                toks = self.encode(forced.text.decode("utf-8"))[:-1]
            except UnicodeDecodeError:
                toks = []
        n = 0
        for t in toks[:budget]:
            if not block.push(t, None, "forced"):
                break
            n += 1
        return n


class ModelDrafter:
    """A draft model behind a ``ModelRunner``: one token per call, from the proposal law r = law(draft logits,
    the block's mask, the same sampling options).  Its cache follows the block's sequence by longest common prefix."""

    name = "model"

    def __init__(self, runner: ModelRunner, params: SamplingParams, rng: np.random.Generator, *, blind: bool = False,
                 target_vocab_size: int | None = None):
        self.runner = runner
        self.params = params
        self.rng = rng
        self.blind = blind
        self.width = target_vocab_size or runner.vocab_size
        self.passes = 0
        self._last: np.ndarray | None = None  # logits after runner.tokens[-1]

    def _logits(self, seq: Sequence[int]) -> np.ndarray:
        fed = self.runner.tokens
        lcp = common_prefix_len(fed, seq)
        if lcp == len(seq) == len(fed) and self._last is not None:
            return self._last
        if lcp == len(seq):
            lcp -= 1
        if len(fed) > lcp:
            self.runner.trim(len(fed) - lcp)
        logits = self.runner.forward(list(seq[lcp:]), logits_for=1)[-1]
        self.passes += 1
        self._last = logits
        return logits

    def extend(self, block: DraftBlock, budget: int) -> int:
        if budget <= 0:
            return 0
        logits = np.asarray(self._logits(block.sequence()), dtype=np.float64)
        if logits.shape[-1] < self.width:  # pad a narrower draft head to the target width
            logits = np.concatenate([logits, np.full(self.width - logits.shape[-1], -np.inf)])
        logits = logits[: self.width]
        mask = None if self.blind else block.mask()
        law = log_law(logits, mask, self.params, None if self.blind else block.tilt())
        token = sample(law, self.rng)
        pushed = block.push(token, law, "model", check=not self.blind)
        return 1 if pushed else 0


class ChainDrafter:
    """Tries its drafters in order at each position: forced tokens, then recipes, then the model."""

    name = "chain"

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)

    def extend(self, block: DraftBlock, budget: int) -> int:
        for d in self.drafters:
            n = d.extend(block, budget)
            if n:
                return n
        return 0


class DraftContext:
    """What drafter factories get to build one request's drafter (see ``hookspecs.register_drafters``)."""

    def __init__(self, *, tokenizer=None, params: SamplingParams = SamplingParams(), rng: np.random.Generator | None = None,
                 draft_runner: ModelRunner | None = None, target_vocab_size: int | None = None, recipe=None,
                 blind: bool = False, options: dict | None = None):
        self.tokenizer = tokenizer
        self.params = params
        self.rng = rng if rng is not None else np.random.default_rng()
        self.draft_runner = draft_runner
        self.target_vocab_size = target_vocab_size
        self.recipe = recipe
        self.blind = blind
        self.options = options or {}


def build_chain(names: Sequence[str], ctx: DraftContext) -> Drafter | None:
    """The drafter chain for one request, from registered factories, in the order named. Factories that have
    nothing to work with (no draft model, no recipe pack) return None and are left out."""
    from .errors import RequestError
    from .plugins import drafters as registered

    reg = registered()
    out: list[Drafter] = []
    for name in names:
        if name not in reg:
            raise RequestError(f"unknown drafter {name!r}; available: {', '.join(sorted(reg))}")
        d = reg[name](ctx)
        if d is not None:
            out.append(d)
    if not out:
        return None
    return out[0] if len(out) == 1 else ChainDrafter(out)


class RecipeDrafter:
    """Recipe-pack lookup (``recipes.RecipePack``): the run the pack holds for the current context, as one-hot
    drafts, cut at the first token the grammar refuses (``push`` checks the block's mask, which verification
    reuses).  Proposes nothing without a grammar unless ``unconstrained`` (a structured-output pack has nothing
    to say about free prose, and a wrong draft there only costs verification width).

    ``observe(tokens, start)`` after a finished request logs it to ``misslog`` (``recipes.MissLog``) when the
    pack missed often, for a later build to fold in."""

    name = "recipe"

    def __init__(self, pack, *, unconstrained: bool = False, misslog=None):
        self.pack = pack
        self.unconstrained = unconstrained
        self.misslog = misslog
        self.lookups = 0
        self.hits = 0
        self._prompt: tuple[int, ...] = ()
        self._positions: dict | None = None

    def _copy(self, block: DraftBlock, n: int) -> tuple[int, ...]:
        """A copy recipe: up to ``n`` tokens from the request's prompt (its first context), after the spot that
        matches the end of the sequence."""
        from .recipes import copy_source, prompt_positions

        ctx = block.context
        if self._positions is None or len(ctx) < len(self._prompt) or ctx[0] != self._prompt[0]:
            self._prompt = tuple(ctx)
            self._positions = prompt_positions(self._prompt)
        seq = [*ctx[len(ctx) - 8:], *block.tokens]
        src = copy_source(self._prompt, self._positions, seq)
        return () if src is None else self._prompt[src:src + n]

    def extend(self, block: DraftBlock, budget: int) -> int:
        if budget <= 0 or block.dead or (block.matcher is None and not self.unconstrained):
            return 0
        self.lookups += 1
        ctx = block.context
        run = self.pack.lookup([*ctx[len(ctx) - 64:], *block.tokens] if len(ctx) > 64 else block.sequence())
        if not run:
            return 0
        if run[0] < 0:  # (COPY, n)
            run = self._copy(block, run[1])
        n = 0
        for t in run[:budget]:
            if not block.push(t, None, self.name):
                break
            n += 1
        if n:
            self.hits += 1
        return n

    def observe(self, tokens: Sequence[int], start: int = 0) -> None:
        if self.misslog is not None:
            self.misslog.observe(tokens[:start], tokens[start:], self.lookups - self.hits)


class SuffixDrafter:
    """Online recipes: proposes from a per-server ``recipes.SuffixIndex`` over recently verified outputs
    (SuffixDecoding-style) and teaches it each finished request through ``observe(tokens, start)``."""

    name = "suffix"

    def __init__(self, index, *, unconstrained: bool = True):
        self.index = index
        self.unconstrained = unconstrained

    def extend(self, block: DraftBlock, budget: int) -> int:
        if budget <= 0 or block.dead or (block.matcher is None and not self.unconstrained):
            return 0
        ctx = block.context
        run = self.index.lookup([*ctx[len(ctx) - 64:], *block.tokens] if len(ctx) > 64 else block.sequence(), budget)
        if not run:
            return 0
        n = 0
        for t in run:
            if not block.push(t, None, self.name):
                break
            n += 1
        return n

    def observe(self, tokens: Sequence[int], start: int = 0) -> None:
        self.index.observe(tokens, start)


def observe(drafter: Drafter | None, tokens: Sequence[int], start: int = 0) -> None:
    """Tell a request's drafter (or every drafter of a chain) the finished sequence: ``tokens`` = prompt + output,
    ``start`` = the prompt's length.  Hosts call this once per finished request; learning drafters (suffix, recipe
    miss logs) use it, the others ignore it."""
    if drafter is None:
        return
    for d in getattr(drafter, "drafters", [drafter]):
        fn = getattr(d, "observe", None)
        if fn is not None:
            fn(tokens, start)
