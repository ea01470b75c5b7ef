"""Drafters: where draft tokens come from.

A drafter extends a ``block.DraftBlock`` (which computes each position's grammar mask once and refuses any token
its mask forbids, so a grammar-aware draft never proposes what the target must reject).  Every drafted token is
verified by the target; nothing is injected past the verifier.

- ``ForcedDrafter``: the tokens the grammar forces, and the tokenized jump-forward string (one-hot drafts).
- ``ModelDrafter``: a small draft model through a ``ModelRunner``, sampling from the proposal law r (the same
  transform as the target law, on the draft's logits).  ``blind=True`` drafts without the mask: only so that
  benchmarks can reproduce the blind-draft problem (a grammar-invalid draft ends the block and is rejected).
- ``RecipeDrafter``: the run a recipe pack (``recipes``) holds for the context; ``SuffixDrafter``: the online
  suffix index over recently verified outputs.
- ``ChainDrafter``: tries its drafters in order at every position (forced, then recipe, then model).

``build_chain(names, DraftContext)`` builds one request's chain from the registered drafter factories.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from . import laws
from .block import DraftBlock, Drafter, ModelRunner
from .distributions import SamplingParams
from .masks import single_allowed
from .prefix import common_prefix_len


def whole_utf8(data: bytes) -> str:
    """The longest prefix of ``data`` made of whole UTF-8 characters, decoded (invalid bytes end it too)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[: e.start].decode("utf-8")


class ForcedDrafter:
    """Tokens the grammar forces next, read off the block's own masks (a position whose mask allows one token, never
    a stop token), then, where that walk ends, the tokenized jump-forward string (one-hot drafts).  Fills no mask
    of its own: every mask it reads is the block's, which the draft laws and the target law reuse.

    ``byte_complete`` (the tokenizer's ``TokenizerInfo.byte_complete``): on a lazy block (``DraftBlock.lazy``) whose
    mask nobody has read yet the matcher's jump-forward string is asked first, and where it is empty nothing is
    forced and no mask is filled (with a vocabulary that has every byte as a token, one allowed token means a forced
    byte).  Without it the mask is read as on any block."""

    name = "forced"

    def __init__(self, encode: Callable[[str], list[int]] | None = None, *, byte_complete: bool = False):
        self.encode = encode
        self.byte_complete = byte_complete

    def extend(self, block: DraftBlock, budget: int) -> int:
        if block.matcher is None or budget <= 0 or block.dead:
            return 0
        hint = block.forced_hint() if self.byte_complete else None
        if hint is not None and not hint:
            return 0  # no byte forced here, so no token (lazy block: no mask filled)
        n = 0
        while n < budget and not block.done:
            t = single_allowed(block.mask())
            if t is None or t in block.stop_token_ids or not block.push(t, None, "forced"):
                break
            n += 1
        if n or self.encode is None or block.done:
            return n
        # the single-token walk ends here: the bytes every continuation starts with, tokenized as the model would;
        # the string's last token may merge with the text that follows it (forced 'age"' then ':' is tokenized
        # 'age' '":' by the model), so a draft of it would be rejected: propose the others.  Forced bytes may end
        # inside a UTF-8 sequence (the branch point of "👍"/"👎"): only whole characters are tokenized, never a
        # partial sequence decoded
        text = whole_utf8(hint if hint is not None else block.matcher.jump_forward())
        for t in (self.encode(text)[:-1] if text else [])[:budget]:
            if not block.push(t, None, "forced"):
                break
            n += 1
        return n


class ModelDrafter:
    """A draft model behind a ``ModelRunner``: one token per call, from the proposal law r = law(draft logits,
    the block's mask, the same sampling options), computed by the round's law backend (``block.law``) where the
    draft's logits live.  Its cache follows the block's sequence by longest common prefix."""

    name = "model"

    def __init__(self, runner: ModelRunner, params: SamplingParams, rng: np.random.Generator, *, blind: bool = False,
                 target_vocab_size: int | None = None):
        self.runner = runner
        self.params = params
        self.rng = rng
        self.blind = blind
        self.width = target_vocab_size or runner.vocab_size
        self.passes = 0
        self._last = None  # logits after runner.tokens[-1]

    def _logits(self, seq: Sequence[int]):
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
        t0 = time.perf_counter_ns()
        logits = self._logits(block.sequence())
        block.tick("draft_forward", t0)
        law_backend = block.law if block.law is not None else laws.get(None)
        # one uniform per draft, greedy or not: the random stream is the same for every law backend
        token, law = law_backend.draft(logits, block, self.params, self.rng.random(), blind=self.blind,
                                       width=self.width)
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
        from .recipes.pack import copy_source, prompt_positions

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
