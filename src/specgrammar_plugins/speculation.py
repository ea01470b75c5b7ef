"""The one road from a request to decoding, which every host adapter and benchmark takes.

    request options (``requests.SpecOptions``), compiled constraint, tokenizer, the host's target/draft runners
      -> ``make_drafter``: the request's drafter chain (for hosts that verify drafts themselves: vLLM's rejection
         sampler, llama-cpp-python's stock ``draft_model`` loop)
      -> ``make_loop``: a ``SpeculativeLoop`` with that chain and the request's cost tilt (for hosts that let us own
         decoding: mlx-lm, llama-cpp-python's ``SpecLlama``)

Host defaults (a server's ``--num-draft-tokens``, a ``SpecLlama``'s ``k=``/``drafters=``/``recipe=``) are merged into
the request's options with ``with_defaults`` before they come here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from .block import Drafter, ModelRunner
from .budget import Budget, make_budget
from .constraint import CompiledConstraint
from .cost import make_tilt
from .distributions import SamplingParams
from .drafters import DraftContext, build_chain
from .loop import SpeculativeLoop
from .recipes.served import served_log
from .requests import DEFAULT_DRAFTERS, SpecOptions

DEFAULT_K = 4
UNLIMITED = 1 << 20  # a max_tokens this large is "no limit" (mlx-lm's -1): nothing to fit the output into


def budget_of(options: SpecOptions, max_tokens: int | None) -> int | None:
    """The budget an output must end within: ``specgrammar.budget`` when smaller than ``max_tokens``, else
    ``max_tokens``; None when the request turned the budget mask off (``budget_mask: false``) or has no limit."""
    if options.budget_mask is False:
        return None
    b = max_tokens if max_tokens is not None and max_tokens < UNLIMITED else None
    if options.budget is not None:
        b = options.budget if b is None else min(b, options.budget)
    return b


def check_budget(constraint: CompiledConstraint | None, options: SpecOptions, max_tokens: int | None,
                 **kw) -> Budget | None:
    """The request's budget feasibility (``budget.make_budget``: on by default for constrained requests): raises
    ``BudgetError`` (a ``ConstraintError``: HTTP 400) when the constraint's shortest completion does not fit.
    Hosts call it where they validate a request, so that the refusal comes before any decoding."""
    return make_budget(constraint, budget_of(options, max_tokens), **kw)


def with_defaults(options: SpecOptions | None, *, k: int | None = None, drafters: Sequence[str] | None = None,
                  recipe=None) -> SpecOptions:
    """``options`` with the host's defaults filled in where the request left them unset (``k`` None, the default
    drafter chain, no recipe)."""
    options = options if options is not None else SpecOptions()
    return replace(options,
                   k=options.k if options.k is not None else k,
                   drafters=tuple(drafters) if drafters is not None and options.drafters == DEFAULT_DRAFTERS
                   else options.drafters,
                   recipe=options.recipe if options.recipe not in (None, "") else recipe)


def make_drafter(options: SpecOptions, tokenizer, *, params: SamplingParams = SamplingParams(),
                 rng: np.random.Generator | None = None, draft_runner: ModelRunner | None = None,
                 target_vocab_size: int | None = None, blind: bool = False) -> Drafter | None:
    """The drafter chain ``options.drafters`` names (factories with nothing to work with, e.g. no draft model or no
    recipe pack, drop out), or None when ``options.k == 0`` or nothing is left."""
    if options.k == 0:
        return None
    ctx = DraftContext(tokenizer=tokenizer, params=params, rng=rng, draft_runner=draft_runner,
                       target_vocab_size=target_vocab_size, recipe=options.recipe, blind=blind,
                       options=dict(options.extra))
    return build_chain(options.drafters, ctx)


def make_loop(target: ModelRunner, prompt: Sequence[int], options: SpecOptions, *,
              constraint: CompiledConstraint | None, tokenizer=None, params: SamplingParams = SamplingParams(),
              rng: np.random.Generator | None = None, draft_runner: ModelRunner | None = None,
              max_tokens: int = 256, stop_token_ids: Sequence[int] | None = None, blind: bool = False,
              law=None) -> SpeculativeLoop:
    """One request's ``SpeculativeLoop``: the drafter chain of ``make_drafter`` (``options.k`` drafts per round,
    default ``DEFAULT_K``), and the opt-in cost-aware law (``options.lam`` / ``adaptive`` / ``budget``: the output
    law is then the tilted q_lambda, still sampled exactly), and the budget feasibility of ``check_budget`` (on by
    default for constrained requests: a token is allowed only if the constraint can still end within the budget
    after it; ``options.budget_mask = False`` turns it off).  ``tokenizer`` defaults to the constraint's.  ``law``:
    the law backend (a name or a ``laws.LawBackend``; default: the fast one for the target's tensors)."""
    rng = rng if rng is not None else np.random.default_rng()
    k = options.k if options.k is not None else DEFAULT_K
    options = replace(options, k=k)
    if tokenizer is None and constraint is not None:
        tokenizer = constraint.tokenizer
    drafter = make_drafter(options, tokenizer, params=params, rng=rng, draft_runner=draft_runner,
                           target_vocab_size=target.vocab_size, blind=blind)
    tilt = make_tilt(constraint, lam=options.lam, adaptive=options.adaptive, budget=options.budget,
                     max_tokens=max_tokens)
    loop = SpeculativeLoop(target, prompt, constraint=constraint, drafter=drafter, k=k if drafter is not None else 0,
                           params=params, max_tokens=max_tokens, rng=rng, stop_token_ids=stop_token_ids,
                           tilt_fn=tilt, law=law, fit=check_budget(constraint, options, max_tokens))
    log = served_log(options.extra) if constraint is not None else None  # opt-in: the operator names a folder
    if log is not None:
        loop.on_finish = log.record
    return loop
