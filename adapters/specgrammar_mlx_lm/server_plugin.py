"""The specgrammar plugin for ``mlx_lm.server --plugin specgrammar`` (entry point group ``mlx_lm.server_plugins``).

Needs mlx-lm patched with ``specgrammar patch mlx-lm`` (the hooks it implements are declared by the patch's
``mlx_lm/server_plugins.py``).  What it does:

- request fields (``request_fields``): every constraint spelling the core's ``parse_request`` reads
  (``response_format`` json_schema / json_object / regex / grammar, top-level ``regex`` / ``grammar`` /
  ``json_schema`` / ``choice``, vLLM-style ``structured_outputs``) and the ``specgrammar`` options object
  (``k``, ``drafters``, ``recipe``, ``engine``; ``trigger``, and the opt-in cost-aware ``lambda`` / ``adaptive`` /
  ``budget``, which our loop applies, and ``budget_mask``).  The constraint is compiled right away, so an invalid
  schema / regex / grammar is answered with HTTP 400 and the engine's reason; the server keeps serving.  So is a
  request whose constraint cannot end within its ``max_tokens`` (budget feasibility, on by default: HTTP 400
  naming the shortest length).  Where the bound is exact (regex, choice, ...) it is part of the batching path's
  processor row; a certified bound (JSON Schema on xgrammar / llguidance) re-draws, so such a request is served
  by our loop (``is_batchable`` False), as one with a ``specgrammar`` object is.
- without a draft model, a constrained request stays on mlx-lm's batching path with the history-keyed grammar
  logits processor (``logits_processors``); a request that sends a ``specgrammar`` object is served by our loop
  instead (forced-token drafting).
- with ``--draft-model`` every sequential request runs the core ``SpeculativeLoop`` (``stream_generate``):
  grammar-aware drafts, exact accept/residual verification, both caches left holding exactly prompt + yielded
  tokens.  This also routes around mlx-lm 0.32.2's prompt-cache off-by-one with a draft model (the stock loop
  leaves the target cache one token short of the key it is stored under; the patch fixes the stock path too).
- compiles past ``SPECGRAMMAR_COMPILE_TIMEOUT_S`` are killed, not left running: the server sets
  ``compile_isolation="process"`` (``compile_worker``) unless ``SPECGRAMMAR_COMPILE_ISOLATION`` says otherwise.
- options: ``--specgrammar-engine NAME`` (default: the core's), ``--specgrammar-k N`` (default
  ``--num-draft-tokens``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import pluggy

from specgrammar_plugins.api import (COMPILE_POOL, LIMITS, ConstraintError, RequestError, SpecOptions, check_budget,
                                     parse_request, registered_drafters, resolve_pack)

hookimpl = pluggy.HookimplMarker("mlx_lm.server")
log = logging.getLogger("specgrammar.mlx_lm")

_config = {"engine": None, "k": None}


@dataclass
class RequestPlan:
    """What the plugin read from one request."""

    spec: object  # ConstraintSpec | None
    options: SpecOptions
    explicit: bool  # the request sent a ``specgrammar`` object
    certified: bool = False  # its budget bound is certified (checked at commit): our loop serves it


# ---------------------------------------------------------------------------------------------- start-up
@hookimpl
def add_arguments(parser):
    parser.add_argument("--specgrammar-engine", default=None,
                        help="grammar engine for constrained requests (xgrammar, llguidance, outlines_core, dfa)")
    parser.add_argument("--specgrammar-k", type=int, default=None,
                        help="draft tokens per round for our loop (default: --num-draft-tokens)")


@hookimpl
def configure(cli_args, model_provider):
    _config["engine"] = getattr(cli_args, "specgrammar_engine", None)
    _config["k"] = getattr(cli_args, "specgrammar_k", None)
    # a server abandons a compile past the time limit for real: the compiling process is killed (see
    # compile_worker); SPECGRAMMAR_COMPILE_ISOLATION=thread keeps compiles in-process
    LIMITS.compile_isolation = os.environ.get("SPECGRAMMAR_COMPILE_ISOLATION", "process")
    if LIMITS.compile_isolation == "process":
        COMPILE_POOL.prestart()
    _widen_listen_backlog()


LISTEN_BACKLOG = 128


def _widen_listen_backlog() -> None:
    """mlx-lm 0.32.2's server is an ``http.server.ThreadingHTTPServer`` with socketserver's default listen backlog
    of 5: a burst of more simultaneous connections (32 in tests/test_concurrency.py) got connection resets before
    any handler ran.  The server class is built after ``configure``, so widening the class's backlog here
    applies to it (``SPECGRAMMAR_LISTEN_BACKLOG``, default 128)."""
    from http.server import ThreadingHTTPServer

    backlog = int(os.environ.get("SPECGRAMMAR_LISTEN_BACKLOG", LISTEN_BACKLOG))
    if ThreadingHTTPServer.request_queue_size < backlog:
        ThreadingHTTPServer.request_queue_size = backlog


# ---------------------------------------------------------------------------------------------- requests
def _engine(options: SpecOptions) -> str | None:
    return options.engine or _config["engine"]


def _wait_for_model(model_provider, timeout: float = 120.0):
    """The default model loads on the generation thread at start-up; requests may arrive before it is ready."""
    t0 = time.monotonic()
    while model_provider.model is None and getattr(model_provider.cli_args, "model", None):
        if time.monotonic() - t0 > timeout:
            break
        time.sleep(0.05)
    return model_provider.model, model_provider.tokenizer


def _compile(spec, options: SpecOptions, model, tokenizer):
    from .processor import compile_for
    from .runner import output_width

    return compile_for(spec, tokenizer, output_width(model), _engine(options))


@hookimpl
def request_fields(body, model_provider):
    spec, options = parse_request(body)  # ConstraintError is a ValueError: the server answers 400
    explicit = body.get("specgrammar") is not None
    if spec is None and not explicit:
        return None
    known = registered_drafters()
    bad = [d for d in options.drafters if d not in known]
    if bad:
        raise RequestError(f"unknown drafter(s) {', '.join(map(repr, bad))}; available: {', '.join(sorted(known))}")
    if options.recipe:
        resolve_pack(options.recipe)  # RecipePackError (a ValueError): 400 naming the shipped packs
    certified = False
    if spec is not None:
        model, tokenizer = _wait_for_model(model_provider)
        if model is not None:
            compiled = _compile(spec, options, model, tokenizer)  # validates now; the compile cache keeps it
            max_tokens = body.get("max_completion_tokens")
            if max_tokens is None:
                max_tokens = body.get("max_tokens", getattr(model_provider.cli_args, "max_tokens", None))
            fit = check_budget(compiled, options, max_tokens if isinstance(max_tokens, int) else None)
            certified = fit is not None and fit.settles  # BudgetError above: 400 naming the shortest length
    return {"specgrammar": RequestPlan(spec, options, explicit, certified)}


def _plan(args) -> RequestPlan | None:
    return (getattr(args, "plugin_fields", None) or {}).get("specgrammar")


@hookimpl
def is_batchable(args, model_provider):
    plan = _plan(args)
    if plan is not None and (plan.explicit or plan.certified):
        return False  # the request asked for our loop, or its budget bound re-draws (our loop)
    return None


@hookimpl
def logits_processors(args, tokenizer, model):
    plan = _plan(args)
    if plan is None or plan.spec is None:
        return None
    from .processor import GrammarLogitsProcessor, stop_only_processor

    try:
        compiled = _compile(plan.spec, plan.options, model, tokenizer)
        fit = check_budget(compiled, plan.options, getattr(args, "max_tokens", None), exact_only=True)
    except (ConstraintError, ValueError) as e:  # never let a bad request kill the generation thread
        log.error("specgrammar: constraint failed at generation time: %s", e)
        return [stop_only_processor(tokenizer.eos_token_ids, str(e))]
    return [GrammarLogitsProcessor(compiled, fit=fit)]


# ---------------------------------------------------------------------------------------------- our loop
@hookimpl
def stream_generate(model, tokenizer, draft_model, prompt, prompt_cache, context, args, sampler,
                    logits_processors, generation_kwargs):
    from specgrammar_plugins.api import StopOnlyMask

    from .processor import GrammarLogitsProcessor

    plan = _plan(args)
    if draft_model is None and (plan is None or not (plan.explicit or plan.certified)):
        return None  # no draft model and no request for our loop: mlx-lm's own path (processor applies the mask)
    others = [p for p in (logits_processors or []) if not isinstance(p, GrammarLogitsProcessor)]
    if (others or getattr(args.sampling, "xtc_probability", 0.0) > 0.0 or generation_kwargs.get("kv_bits") is not None
            or generation_kwargs.get("input_embeddings") is not None):
        log.info("specgrammar: request options our loop does not cover (logits processors, xtc, kv_bits, images): "
                 "left to mlx-lm")
        return None
    if any(isinstance(p, GrammarLogitsProcessor) and isinstance(p.mask, StopOnlyMask) for p in logits_processors or []):
        return None  # the constraint failed at generation time: mlx-lm's own loop ends it on the stop tokens
    from .generate import stream_generate as ours

    options = plan.options if plan is not None else SpecOptions()
    k = options.k if options.k is not None else (_config["k"] if _config["k"] is not None else args.num_draft_tokens)
    s = args.sampling
    gen = ours(model, tokenizer, prompt, max_tokens=args.max_tokens, draft_model=draft_model, num_draft_tokens=k,
               constraint=plan.spec if plan is not None else None, engine=_engine(options), recipe=options.recipe,
               drafters=options.drafters, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
               seed=args.seed, prompt_cache=prompt_cache, lam=options.lam, adaptive=options.adaptive,
               budget=options.budget, budget_mask=options.budget_mask,
               cached_tokens=list(context.prompt[: context.prompt_cache_count]),
               prefill_step_size=generation_kwargs.get("prefill_step_size") or 2048)
    return _logged(gen)


def _logged(gen):
    try:
        for r in gen:
            if r.stats is not None:
                st = r.stats
                log.info("specgrammar: %d tokens, %d target passes (%.2f tokens/pass), acceptance %.2f, forced %d%s",
                         st.emitted, st.target_passes, st.tokens_per_pass, st.acceptance, st.forced_tokens,
                         f", budget {st.budget['budget']} shaped {st.budget['shaped_positions']} positions"
                         if st.budget.get("shaped") else "")
            yield r
    finally:
        gen.close()
