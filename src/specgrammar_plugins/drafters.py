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
- ``LayoutDrafter``: the model's own layout (whitespace, brackets, separators where the grammar allows any),
  learnt from its verified outputs (``recipes.layout``): this request's output so far, the server's, a pack's.
- ``PromptLookupDrafter``: spans copied from the prompt (token n-gram match of the recent output against the
  prompt, as llama-cpp-python's ``LlamaPromptLookupDecoding``; then a text match, which survives the output
  tokenizing a copied value differently), each candidate tried through the block's grammar mask.
- ``ChainDrafter``: tries its drafters in order at every position (forced, then recipe, then model), or, with
  ``chain_order: learnt``, ``forced`` first and the others by their acceptance so far in the request (learnt from
  what the target committed after each block); at T > 0, with ``one_hot_gate`` (off by default: on SmolLM2-135M
  it lowered tokens per target pass, docs/BENCHMARKS.md), a one-hot draft the draft model finds unlikely is left
  to the draft model's own sampled draft.

``build_chain(names, DraftContext)`` builds one request's chain from the registered drafter factories.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import numpy as np

from . import laws
from .block import FORCED_JUMP, FORCED_SOURCES, DraftBlock, Drafter, ModelRunner
from .distributions import SamplingParams
from .masks import single_allowed
from .prefix import common_prefix_len
from .recipes.pack import COPY_NUMBER


def whole_utf8(data: bytes) -> str:
    """The longest prefix of ``data`` made of whole UTF-8 characters, decoded (invalid bytes end it too)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[: e.start].decode("utf-8")


def push_run(block: DraftBlock, run: Sequence[int], source: str) -> int:
    """Push the one-hot drafts ``run`` onto ``block`` (its mask checks each) until one is refused; how many went on."""
    n = 0
    for t in run:
        if not block.push(t, None, source):
            break
        n += 1
    return n


class ForcedDrafter:
    """Tokens the grammar forces next, read off the block's own masks (a position whose mask allows one token, never
    a stop token), then, where that walk ends, the tokenized jump-forward string (one-hot drafts).  Fills no mask
    of its own: every mask it reads is the block's, which the draft laws and the target law reuse.

    ``byte_complete`` (the tokenizer's ``TokenizerInfo.byte_complete``): on a lazy block (``DraftBlock.lazy``) whose
    mask nobody has read yet the matcher's jump-forward string is asked first, and where it is empty nothing is
    forced and no mask is filled (with a vocabulary that has every byte as a token, one allowed token means a forced
    byte).  Without it the mask is read as on any block.

    ``splits`` (``ForcedSplits``, the process-wide one for the tokenizer by default): a jump-forward string the
    model was forced through before, after the same token, is drafted as the model split it then (its own tokens,
    learnt from what the target committed after the block), else as the tokenizer encodes it.  These drafts are
    source ``forced-jump`` (forced bytes, not forced tokens: the model may split them otherwise)."""

    name = "forced"

    def __init__(self, encode: Callable[[str], list[int]] | None = None, *, byte_complete: bool = False,
                 splits: "ForcedSplits | None" = None):
        self.encode = encode
        self.byte_complete = byte_complete
        self.splits = splits
        self._block = None  # the block of the jump-forward strings watched (``_watch``): learnt from the next block
        self._watch: list[tuple] = []  # (the sequence's length, its last tokens, the string's bytes) per string

    def extend(self, block: DraftBlock, budget: int) -> int:
        if self._watch and block is not self._block:
            self._learn(block.context)
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
        if not text:
            return 0
        run = None
        if self.splits is not None:  # how the model split this string after this token before, if it did
            seq = block.sequence()
            run = self.splits.get(seq[-1] if seq else -1, text)
            if block is not self._block:
                self._block, self._watch = block, self._watch[-4:]
            self._watch.append((len(seq), tuple(seq[-4:]), text.encode("utf-8")))
        if run is None:
            run = self.encode(text)[:-1]
        return push_run(block, run[:budget], FORCED_JUMP)

    def _learn(self, ctx: Sequence[int]) -> None:
        """The target committed ``ctx``: where it has written past a watched jump-forward string, keep the model's
        own tokens inside that string (``ForcedSplits``); until then keep watching it."""
        keep = []
        for n, tail, text in self._watch:
            if len(ctx) < n or tuple(ctx[n - len(tail):n]) != tail:
                continue  # the drafts before the string were rejected, or another request
            if not self.splits.learn(tail[-1] if tail else -1, text, ctx[n:]):
                keep.append((n, tail, text))
        self._watch = keep[-8:]
        self._block = None


class ForcedSplits:
    """How the model tokenized the jump-forward strings it was forced through: (the token before, the string) ->
    its tokens whose bytes lie inside the string, the last kept (the canonical tokenization is not the model's: a
    forced key it did not choose is often written in pieces, 'n' 'am' 'e').  One per tokenizer per process
    (``server_splits``), learnt from every request, as the layout index is; bounded (oldest first out)."""

    def __init__(self, token_bytes: Sequence[bytes], limit: int = 4096):
        self.token_bytes = token_bytes
        self.limit = limit
        self._split: dict[tuple[int, str], tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._split)

    def get(self, prev: int, text: str) -> list[int] | None:
        run = self._split.get((int(prev), text))
        return list(run) if run is not None else None

    def learn(self, prev: int, text: bytes, committed: Sequence[int]) -> bool:
        """Read the model's tokens inside ``text`` off ``committed`` (what it wrote from the string on); False while
        it has not yet written past the string's end."""
        got, run = 0, []
        for t in committed:
            b = self.token_bytes[t] if 0 <= t < len(self.token_bytes) else b""
            if not b or not text.startswith(b, got):
                break  # the token ends past the string (or is not its bytes): the split is known
            run.append(int(t))
            got += len(b)
            if got == len(text):
                break
        else:
            if got < len(text):
                return False
        # the string and each of its tails after one of the model's tokens (the walk restarts there when a later
        # draft of it is rejected): 'name"' after '"' -> n am e, 'ame"' after 'n' -> am e, ...
        at = 0
        for i in range(len(run)):
            tail = text[at:]
            try:
                key = (int(prev), tail.decode("utf-8"))
            except UnicodeDecodeError:  # (a tail that starts inside a character is never a jump-forward string)
                key = None
            if key is not None:
                self._split.pop(key, None)
                if len(self._split) >= self.limit:
                    self._split.pop(next(iter(self._split)))
                self._split[key] = tuple(run[i:])
            prev, at = run[i], at + len(self.token_bytes[run[i]])
        return True


_SPLITS: dict = {}


def server_splits(key, token_bytes: Sequence[bytes]) -> ForcedSplits:
    """The process-wide ``ForcedSplits`` for one tokenizer (``key``: its fingerprint)."""
    splits = _SPLITS.get(key)
    if splits is None:
        splits = _SPLITS[key] = ForcedSplits(token_bytes)
    return splits


_UNTEMPERED = SamplingParams(temperature=1.0)


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

    def top(self, block: DraftBlock) -> tuple[int, float]:
        """The draft model's most likely token at the block's current position under its mask, and that token's
        probability in the untempered (T = 1) masked law: how sure the draft model is, whatever the sampling options
        (no random draw is used; the logits are kept for ``extend``)."""
        logits = self._logits(block.sequence())
        law_backend = block.law if block.law is not None else laws.get(None)
        _, law = law_backend.draft(logits, block, _UNTEMPERED, 0.5, blind=self.blind, width=self.width)
        dense = np.asarray(law_backend.dense(law, self.width))
        best = int(dense.argmax())
        return best, float(dense[best])

    def prob(self, block: DraftBlock, token: int) -> float:
        """The proposal law's probability of ``token`` at the block's current position (the law ``extend`` would
        draw from there; no random draw is used, and the draft model's logits are kept for that draw)."""
        logits = self._logits(block.sequence())
        law_backend = block.law if block.law is not None else laws.get(None)
        best, law = law_backend.draft(logits, block, self.params, 0.5, blind=self.blind, width=self.width)
        if law is None:  # greedy: one-hot at the argmax
            return 1.0 if best == token else 0.0
        p = law_backend.dense(law, self.width)[int(token)]
        return float(p.item() if hasattr(p, "item") else p)


class _Gated:
    """A view of a ``DraftBlock`` through which the draft model judges the one-hot drafts of the chain's other
    sources; everything else is the block's.  Two rules (``ChainDrafter``), each off when None:

    - ``floor`` (``one_hot_gate``, T > 0): a one-hot draft (not ``forced`` nor ``forced-jump``) to which the draft
      model gives less than ``floor`` is refused (``ModelDrafter.prob``);
    - ``sure`` (``draft_arbiter``): a one-hot draft (anything but a ``forced`` single-token position, so the
      forced drafter's jump-forward tokenization too) is refused where the draft model's own most likely token under
      the mask is another one and the draft model gives that token at least ``sure`` in its untempered law
      (``ModelDrafter.top``).

    The position is then the draft model's.  Both read the context alone (no random draw), and each draft is verified
    with the law it was drawn from, so neither changes the output law.  ``model``: the chain's ``ModelDrafter``, or a
    host's draft model as a judge (``ChainDrafter.judge``: ``top``, and ``ready(block)``, whether its logits are at
    hand at the block's position; where they are not, a draft it would judge goes on, its mask filled, and
    ``defer(position)`` tells the judge to judge it where they come: ``batch.Row.judge``)."""

    def __init__(self, block: DraftBlock, model, floor: float | None, sure: float | None = None):
        self._block, self._model, self._floor, self._sure = block, model, floor, sure
        self._ready = getattr(model, "ready", None)
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._block, name)

    def _refuses(self, b: DraftBlock, token: int, source: str) -> bool:
        m = self._model
        if self._floor is not None and source not in FORCED_SOURCES and m.prob(b, token) < self._floor:
            return True
        if self._sure is not None:
            best, p = m.top(b)
            return best != token and p >= self._sure
        return False

    def push(self, token: int, law=None, source: str = "model", *, check: bool = True) -> bool:
        b = self._block
        if law is None and source != "forced" and not b.done:
            if self._ready is not None and not self._ready(b):
                # the judge has no logits here yet: the draft goes on, judged where they come (its mask kept)
                n = len(b.tokens)
                if not b.allows(token) or not b.push(token, law, source, check=check):
                    return False
                self._model.defer(n)
                return True
            if b.allows(token) and self._refuses(b, token, source):
                self.refused += 1
                return False
        return b.push(token, law, source, check=check)


class ChainDrafter:
    """Tries its drafters in order at each position: the first that proposes anything drafts there.

    With ``learn=True`` the order is learnt per request (``build_chain``: the option ``"chain_order": "learnt"``, or
    the environment's ``SPECGRAMMAR_CHAIN_ORDER=learnt``; the default ``"fixed"`` keeps the configured order, because
    on SmolLM2-135M the learnt order did not raise the mean tokens per target pass of the six workloads: see
    docs/BENCHMARKS.md, issue 32).  When it is asked to extend a new block, the chain compares the drafts of its previous block
    (their tokens and sources, and the context length then) with what the target committed since (the new block's
    ``context``): the common prefix was accepted, the next draft rejected, the drafts after it were never judged.
    Each source's accepted/rejected counts give a smoothed acceptance estimate (a Beta(1, 1) prior: (a + 1) /
    (a + r + 2)); ``forced`` stays first (its drafts are certain) and the others are tried by that estimate, highest
    first (ties in the configured order, so the first block drafts as the fixed chain does).  The draft model
    proposes at every position, so a source ranked below it is skipped until the model's estimate falls below its
    own.  A host whose draft model is not in the chain (vLLM's ``draft_model`` through ``batch.BatchDrafter``: the
    model drafts where the chain proposes nothing) pushes its drafts as source ``model``: once one is seen, the
    chain yields to the host's model where the model ranks (``extend`` returns 0 there).  The estimates are only
    this request's (a context that does not extend the last block's starts them afresh), and drafting order never
    changes the output law: verification is exact.

    ``gate`` (``one_hot_gate``, T > 0 only, with a draft model in the chain): the one-hot sources (all but
    ``forced``) draft through a view of the block (``_Gated``) that refuses a token the draft model gives less
    than ``gate``; the position is then the draft model's.  ``gated`` counts the refusals.

    ``sure`` (``draft_arbiter``): the same view refuses a one-hot draft the draft model overrules (``_Gated``).  A
    chain without a ``ModelDrafter`` whose host drafts with its own draft model (vLLM: ``batch.BatchDrafter``) has
    that model judge through ``judge``, which the host sets while it runs the chain (``batch.Arbiter``: a draft
    at the position whose logits the host has is judged there, one past it when its position's logits come), at
    ``host_sure``."""

    name = "chain"
    FORCED = "forced"
    PRIOR = (1.0, 1.0)  # Beta(alpha, beta): pseudo-counts of accepted and rejected drafts per source

    def __init__(self, drafters: Sequence[Drafter], *, learn: bool = False, gate: float | None = None,
                 sure: float | None = None):
        self.drafters = list(drafters)
        self.learn = learn
        # at T > 0 (``build_chain``: the option "one_hot_gate"): the draft model's floor for a one-hot draft
        self.model = next((d for d in self.drafters if isinstance(d, ModelDrafter)), None)
        self.gate = gate if self.model is not None else None
        self.sure = sure if self.model is not None else None
        self.host_sure = sure if self.model is None else None  # the arbiter's threshold for a host's draft model
        self.judge = None  # the host's draft model as a judge (``top``, ``ready``), while the host sets it
        self.gated = 0  # one-hot drafts refused by the gate (the draft model drafted there, or nothing did)
        self.accepted: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self._block: DraftBlock | None = None  # the block being extended (its drafts are judged at the next one)
        self._start = 0  # len(its context)
        self._ends: tuple[int, int] | None = None  # its context's first and last tokens
        self._order: list[Drafter | None] = list(self.drafters)  # None: the host's draft model

    def estimate(self, source: str) -> float:
        """The smoothed acceptance estimate of ``source`` in this request."""
        a, r = self.accepted.get(source, 0), self.rejected.get(source, 0)
        alpha, beta = self.PRIOR
        return (a + alpha) / (a + r + alpha + beta)

    def order(self) -> list[str]:
        """The sources in the order the chain tries them now (``model`` where a host's draft model drafts)."""
        return [d.name if d is not None else "model" for d in self._order]

    def _rank(self) -> list[Drafter | None]:
        forced = [d for d in self.drafters if d.name == self.FORCED]
        rest: list[Drafter | None] = [d for d in self.drafters if d.name != self.FORCED]
        if "model" not in {d.name for d in self.drafters} and ("model" in self.accepted or "model" in self.rejected):
            rest.append(None)  # the host's draft model, seen in the blocks' sources
        rest.sort(key=lambda d: -self.estimate(d.name if d is not None else "model"))  # (stable: ties keep order)
        return [*forced, *rest]

    def _judge(self, block: DraftBlock) -> None:
        """A new block: count the previous block's drafts against what the target committed since."""
        prev, ctx = self._block, block.context
        n = len(ctx)
        if prev is not None and n > self._start and self._ends == (int(ctx[0]), int(ctx[self._start - 1])):
            committed = ctx[self._start:]
            for i, (t, s) in enumerate(zip(prev.tokens, prev.sources)):
                if i >= len(committed):
                    break  # (the request ended before it: never judged)
                if int(committed[i]) == t:
                    self.accepted[s] = self.accepted.get(s, 0) + 1
                else:
                    self.rejected[s] = self.rejected.get(s, 0) + 1
                    break
        elif prev is not None and n != self._start:  # not this request's next block: a new request
            self.accepted.clear()
            self.rejected.clear()
        self._block, self._start = block, n
        self._ends = (int(ctx[0]), int(ctx[n - 1])) if n else None
        self._order = self._rank()

    def extend(self, block: DraftBlock, budget: int) -> int:
        if self.learn and block is not self._block:
            self._judge(block)
        model, sure = self.model, self.sure
        if model is None and self.judge is not None:
            model, sure = self.judge, self.host_sure
        view = block if self.gate is None and sure is None else _Gated(block, model, self.gate, sure)
        try:
            for d in self._order:
                if d is None:
                    return 0  # the host's draft model drafts here
                n = d.extend(block if d is self.model else view, budget)
                if n:
                    return n
            return 0
        finally:
            if view is not block:
                self.gated += view.refused


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
    order = ctx.options.get("chain_order", os.environ.get("SPECGRAMMAR_CHAIN_ORDER", "fixed"))
    if order not in ("learnt", "fixed"):
        raise RequestError(f'the option "chain_order" (or SPECGRAMMAR_CHAIN_ORDER) must be "learnt" or "fixed", '
                           f'got {order!r}')
    if not out:
        return None
    return out[0] if len(out) == 1 else ChainDrafter(out, learn=order == "learnt", gate=one_hot_gate(ctx),
                                                     sure=draft_arbiter(ctx))


def _probability_option(ctx: DraftContext, key: str, env: str, default: float | None) -> float | None:
    """The option ``key`` (else the environment's ``env``) as a probability in (0, 1]; ``default`` when unset,
    None when set to "off" (or false)."""
    from .errors import RequestError

    raw = ctx.options.get(key, os.environ.get(env))
    if raw is None or raw == "":
        return default
    if raw is False or raw == "off":
        return None
    try:
        p = float(raw)
    except (TypeError, ValueError):
        p = float("nan")
    if not 0.0 < p <= 1.0 or isinstance(raw, bool):
        raise RequestError(f'the option "{key}" (or {env}) must be a probability in (0, 1] or "off", got {raw!r}')
    return p


DRAFT_ARBITER = 0.8  # the default ``draft_arbiter`` (docs/BENCHMARKS.md, issue 32: 0.6-0.9 measured on SmolLM2)


def draft_arbiter(ctx: DraftContext) -> float | None:
    """How sure the draft model must be to overrule a one-hot draft: the option ``"draft_arbiter"`` (or the
    environment's ``SPECGRAMMAR_DRAFT_ARBITER``), a probability in (0, 1], ``DRAFT_ARBITER`` when unset, "off" to
    turn it off.  Only a chain that holds a draft model (``ModelDrafter``), or whose host drafts with its own
    (``ChainDrafter.judge``: vLLM's, through ``batch.BatchDrafter``), has an arbiter.

    The recipe, layout, prompt-copy and suffix sources and the forced drafter's jump-forward tokenization propose
    one token where the draft model may know better: where the draft model's most likely token under the grammar
    mask is another one, held with at least this probability (its untempered law), the position is the draft
    model's.  On SmolLM2-135M at T = 0 this took the six workloads from 120 to 105 target passes (mlx-lm)."""
    return _probability_option(ctx, "draft_arbiter", "SPECGRAMMAR_DRAFT_ARBITER", DRAFT_ARBITER)


def one_hot_gate(ctx: DraftContext) -> float | None:
    """The draft model's floor for one-hot drafts at T > 0: the option ``"one_hot_gate"`` (or the environment's
    ``SPECGRAMMAR_ONE_HOT_GATE``), a probability in (0, 1]; None (off, the default) at T = 0 or when unset.

    A one-hot draft x (recipe, layout, prompt copy, suffix) is accepted with the target's probability q(x); the
    draft model's sampled draft with sum min(p, q).  With a floor, a chain that holds a draft model drafts a one-hot
    token only where the draft model gives it at least that probability, and lets the model draw its own draft
    elsewhere (inside sampled strings and numbers).  The choice depends on the context alone (no random draw), and
    each draft is verified with the law it was drawn from, so the output law stays the target's."""
    gate = _probability_option(ctx, "one_hot_gate", "SPECGRAMMAR_ONE_HOT_GATE", None)
    return None if ctx.params.greedy else gate


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
        self._number_at: tuple | None = None  # (the prompt's length and ends, its number's tokens)

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

    def _number(self, block: DraftBlock, n: int) -> tuple[int, ...]:
        """A number copy: up to ``n`` tokens of the prompt's number (``recipes.number_span``; the prompt is
        ``context[:prompt_len]``, the whole context when the host gives no prompt length)."""
        from .recipes.pack import number_span

        classes = self.pack._classes
        ctx = block.context
        np_ = block.prompt_len or len(ctx)
        if classes is None or not np_:
            return ()
        key = (np_, int(ctx[0]), int(ctx[np_ - 1]))
        if self._number_at is None or self._number_at[0] != key:
            prompt = tuple(int(t) for t in ctx[:np_])
            span = number_span(prompt, classes)
            self._number_at = (key, prompt[span[0]:span[1]] if span is not None else ())
        return self._number_at[1][:n]

    def extend(self, block: DraftBlock, budget: int) -> int:
        if budget <= 0 or block.dead or (block.matcher is None and not self.unconstrained):
            return 0
        self.lookups += 1
        ctx = block.context
        run = self.pack.lookup([*ctx[len(ctx) - 64:], *block.tokens] if len(ctx) > 64 else block.sequence())
        if not run:
            return 0
        if run[0] < 0:  # (COPY, n) or (COPY_NUMBER, n)
            run = self._number(block, run[1]) if run[0] == COPY_NUMBER else self._copy(block, run[1])
        n = push_run(block, run[:budget], self.name)
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
        return push_run(block, run, self.name)

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


class LayoutDrafter:
    """The model's layout (``recipes.layout.LayoutIndex``): structure tokens the grammar leaves open (whitespace,
    separators, quotes), proposed from what followed the same structural state and layout symbols before.  Asks,
    in order: the request's own committed output (learnt as it grows, support 1), the server's index (taught by
    every finished request through ``observe``) and a recipe pack's layout table.  Drafts go through the block's
    mask (``push``); proposes nothing without a grammar unless ``unconstrained``."""

    name = "layout"

    def __init__(self, token_bytes, server=None, pack_index=None, *, local: bool = True, unconstrained: bool = False):
        from .recipes.layout import LayoutIndex

        self.token_bytes = token_bytes
        self.server = server
        self.pack_index = pack_index
        self.local = LayoutIndex(token_bytes, min_support=1) if local else None
        self.unconstrained = unconstrained
        self._sid = None
        self._scan = None
        self._seen = 0
        self._first = -1
        self.hits = 0

    def _sync(self, block: DraftBlock):
        from .recipes.layout import LayoutScanner

        ctx = block.context
        start = block.prompt_len
        n_out = len(ctx) - start
        first = ctx[start] if n_out > 0 else -1
        if self._scan is None or n_out < self._seen or (self._seen and first != self._first):
            self._scan = LayoutScanner(self.token_bytes)
            self._seen = 0
            if self.local is not None:
                self._sid = self.local.new()
        if n_out > self._seen:
            new = [int(t) for t in ctx[start + self._seen:]]
            for t in new:
                self._scan.feed(t)
            self._scan.states.clear()
            self._scan.ptrs.clear()
            if self.local is not None:
                self.local.grow(self._sid, new)
            self._seen = n_out
            self._first = first
        sc = self._scan.copy()
        for t in block.tokens:
            sc.feed(t)
        return sc

    def extend(self, block: DraftBlock, budget: int) -> int:
        if budget <= 0 or block.dead or (block.matcher is None and not self.unconstrained):
            return 0
        sc = self._sync(block)
        for idx in (self.local, self.server, self.pack_index):
            if idx is None:
                continue
            for run in idx.candidates(sc, budget):
                if block.allows(run[0]):
                    break
            else:
                continue
            n = push_run(block, run, self.name)
            if n:
                self.hits += 1
                return n
        return 0

    def observe(self, tokens: Sequence[int], start: int = 0) -> None:
        if self.server is not None:
            self.server.observe(tokens[start:])


class PromptLookupDrafter:
    """Prompt lookup under the grammar: copies the prompt's continuation of the recent output.

    First the token n-gram match ``LlamaPromptLookupDecoding`` makes (the last ``max_ngram`` .. 1 tokens of the
    sequence against the prompt's tokens, latest occurrence first); then, where that finds nothing the grammar
    takes, a text match (the longest suffix of the output's text, up to ``max_chars`` bytes, found in the prompt's
    text; the text after it is tokenized), because a value copied into JSON is often tokenized differently from
    the prompt (`` "Oscar`` is `` "``, ``O``, ``scar``).  Each candidate is tried against the block's mask
    (``max_candidates`` per n-gram length / suffix length): a span whose first token the grammar forbids is never
    proposed, and the span is cut at the first token it refuses.  The prompt is ``context[:prompt_len]`` (the whole
    committed context when the host gives no prompt length).

    With ``output`` (the default) the token n-gram match searches the request's committed output too, as
    ``LlamaPromptLookupDecoding`` and vLLM's ``ngram`` search prompt and output: a small model sampled at T > 0
    falls into loops (SmolLM2-135M on the email workload at T = 0.7: ``p aul ass istant riptor ad`` over and over
    to 128 tokens), which only its own output predicts.  Longest n-gram first, latest occurrence first, so an equally
    long match in the output wins over the prompt's; in the output only an n-gram of at least ``output_ngram`` tokens
    matches (3: with 2, JSON's repeated structure was copied at T = 0 and vLLM's json_extraction took 2 passes more
    on SmolLM2).  The text match stays on the prompt (a value copied from it)."""

    name = "prompt"

    def __init__(self, token_bytes, encode=None, *, max_ngram: int = 3, max_chars: int = 24, max_candidates: int = 4,
                 max_copy: int = 16, unconstrained: bool = True, output: bool = True, output_ngram: int = 3):
        self.token_bytes = token_bytes
        self.encode = encode
        self.max_ngram, self.max_chars, self.max_candidates, self.max_copy = max_ngram, max_chars, max_candidates, max_copy
        self.unconstrained = unconstrained
        self.output = output
        self.output_ngram = output_ngram  # the shortest n-gram matched in the output (the prompt's: 1)
        self._key = None
        self._seq: list[int] = []  # the request's prompt, then its committed output
        self._np = 0  # the prompt's length in ``_seq``
        self._pos: dict[int, list[int]] = {}  # token -> its positions in ``_seq`` the n-gram match searches, ascending
        self._text = b""  # the prompt's text
        self._out_text = b""  # the committed output's text

    def _tb(self, t: int) -> bytes:
        tb = self.token_bytes
        return tb[t] if 0 <= t < len(tb) else b""

    def _load(self, block: DraftBlock) -> None:
        """``_seq`` and what is derived from it brought up to the block's committed context: a new request (or one
        with the same prompt) starts again from its prompt; the output committed since the last block is appended,
        indexed for the n-gram match with ``output``, and its text kept for the text match."""
        ctx = block.context
        n = block.prompt_len or len(ctx)
        key = (n, tuple(ctx[:2]), ctx[n - 1] if n else None)
        seq = self._seq
        if key != self._key or len(ctx) < len(seq) or (len(seq) > n and int(ctx[len(seq) - 1]) != seq[-1]):
            self._key, self._np = key, n
            self._seq = seq = [int(t) for t in ctx[:n]]
            self._pos = {}
            for j, t in enumerate(seq):
                self._pos.setdefault(t, []).append(j)
            self._text = b"".join(self._tb(t) for t in seq)
            self._out_text = b""
        if len(ctx) > len(seq):
            new = [int(t) for t in ctx[len(seq):]]
            if self.output:
                pos = self._pos
                for j, t in enumerate(new, len(seq)):
                    pos.setdefault(t, []).append(j)
            seq.extend(new)
            self._out_text += b"".join(self._tb(t) for t in new)

    def _push(self, block: DraftBlock, run: Sequence[int]) -> int:
        return push_run(block, run, self.name)

    def extend(self, block: DraftBlock, budget: int) -> int:
        if budget <= 0 or block.dead or (block.matcher is None and not self.unconstrained):
            return 0
        self._load(block)
        hay, pos, npr = self._seq, self._pos, self._np
        nh = len(hay) if self.output else npr
        seq = block.sequence()
        # token n-grams, longest first, latest occurrence first (LlamaPromptLookupDecoding's search); the longest
        # n that matches decides (its candidates the grammar refuses are not retried with a shorter n-gram)
        for n in range(min(self.max_ngram, len(seq)), 0, -1):
            tail = seq[len(seq) - n:]
            tried = 0
            for p in reversed(pos.get(tail[-1], ())):
                if p + 1 >= nh or p - n + 1 < 0 or (n < self.output_ngram and p >= npr):
                    continue
                if n > 1 and list(hay[p - n + 1:p + 1]) != tail:
                    continue
                tried += 1
                if block.allows(hay[p + 1]):
                    return self._push(block, hay[p + 1:p + 1 + min(budget, self.max_copy)])
                if tried >= self.max_candidates:
                    break
            if tried:
                return 0
        if self.encode is None:
            return 0
        # the text match: the output's text (committed + this block's drafts) against the prompt's text
        out = self._out_text + b"".join(self._tb(t) for t in block.tokens)
        text = self._text
        for L in range(min(self.max_chars, len(out)), 0, -1):
            suffix = out[len(out) - L:]
            end = len(text)
            tried = 0
            while tried < self.max_candidates:
                p = text.rfind(suffix, 0, end)
                if p < 0:
                    break
                end = p + L - 1
                after = whole_utf8(text[p + L:p + L + 8 * self.max_copy])
                if not after:
                    continue
                tried += 1
                run = self.encode(after)[:min(budget, self.max_copy)]
                if run and block.allows(run[0]):
                    return self._push(block, run)
        return 0
