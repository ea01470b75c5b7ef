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
  naming the shortest length).  Preparation (gate check, compile, budget check) runs under the request's one
  deadline (``prepare_deadline``).
- without a draft model, a constrained request stays on mlx-lm's batching path (``BatchGenerator``): each row
  gets its own history-keyed grammar logits processor (``logits_processors``) with its budget in the row, the exact
  bound (regex, choice, ...) as it is, a certified bound (JSON Schema on xgrammar / llguidance) as a mask row
  (``api.RowCut``: ``Budget.mask_row``, as on vLLM; mlx-lm's sampler cannot draw again), and the request's
  ``api.RowPlan``.  The batching path decodes with ``batch_server.SpecGenerationBatch``
  (``generation_batch_class``; ``--specgrammar-batch-drafts on``, the default): after its first token each
  constrained row drafts under its own grammar with its own options (``drafters``: forced, recipe, layout, prompt
  copy, suffix; ``recipe``; ``k``: the request's, ``--specgrammar-k``, else ``--num-draft-tokens``) and one batched
  forward verifies every row's drafts, each row by our loop's exact law, its cache rolled back alone (``off``: one
  token per row per forward).  The patch runs each batched request's processors guarded: a fault in one, or in a
  row's drafting or verdict, fails that request (HTTP 500), the batch goes on.  A request whose ``specgrammar``
  object asks for the cost-aware options (``lambda``, ``adaptive``, ``budget``, ``trigger``), or for drafting
  without a constraint, is served by our loop instead (``is_batchable`` False; ``RequestPlan.loop``), one at a
  time.
- with ``--draft-model`` a request served by our loop runs the core ``SpeculativeLoop`` (``stream_generate``):
  grammar-aware drafts, exact accept/residual verification, both caches left holding exactly prompt + yielded
  tokens.  This also routes around mlx-lm 0.32.2's prompt-cache off-by-one with a draft model (the stock loop
  leaves the target cache one token short of the key it is stored under; the patch fixes the stock path too).
  mlx-lm turns batching off when a draft model is loaded (``is_batchable = draft_model is None``, mlx-lm 0.32.2);
  the patch lets a plugin batch a request anyway (the target alone decodes it; its prompt caches are kept apart
  from the draft path's), and this plugin does so (``--specgrammar-batch auto``, the default) for a constrained
  request that arrives alone when its row drafts there as our loop would (``_speculative_row``: a batch of one
  that later requests join) and for any request that arrives while others wait or decode: they are batched as
  speculative rows that draft with the draft model as our loop does (forced, recipe, then the model under the
  row's grammar), the rows' draft models in ONE batched draft forward per draft position
  (``batch.MLXDraftBatch``).  Alone, a request without a constraint, with mlx-lm logits processors or xtc, or on
  caches that do not roll back per row gets the speculative loop.
- compiles past ``SPECGRAMMAR_COMPILE_TIMEOUT_S`` are killed, not left running: the server sets
  ``compile_isolation="process"`` (``compile_worker``) unless ``SPECGRAMMAR_COMPILE_ISOLATION`` says otherwise.
- every request goes through the core's gate first (``check_request``): numbers finite and in range, unknown
  ``specgrammar`` keys, ``n > 1``, a ``model`` this server does not serve (404 at once), ``adapters`` /
  ``draft_model`` (files mlx-lm would load on a client's say: fixed at start-up), prompt + ``max_tokens`` against
  the context length (a request without ``max_tokens`` gets ``--max-tokens`` cut to what the context leaves).
- options: ``--specgrammar-engine NAME`` (default: the core's), ``--specgrammar-k N`` (default
  ``--num-draft-tokens``), ``--specgrammar-recipes DIR`` (the packs requests may name, besides the shipped ones),
  ``--specgrammar-context-length N`` (default: the model config's ``max_position_embeddings``).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pluggy

from specgrammar_plugins.api import (Host, RequestPlan, SpecOptions, compile_for, draft_k, logged, plan_request,
                                     prepare_deadline, row_mask, sampling_params, served_names, server_compiles,
                                     tokenizer_facts, wait_for, widen_listen_backlog)

hookimpl = pluggy.HookimplMarker("mlx_lm.server")
log = logging.getLogger("specgrammar.mlx_lm")

_config = {"engine": None, "k": None, "recipes": None, "context_length": None, "batch": "auto", "batch_drafts": "on"}


# ---------------------------------------------------------------------------------------------- start-up
@hookimpl
def add_arguments(parser):
    parser.add_argument("--specgrammar-engine", default=None,
                        help="grammar engine for constrained requests (xgrammar, llguidance, outlines_core, dfa)")
    parser.add_argument("--specgrammar-k", type=int, default=None,
                        help="draft tokens per round for our loop (default: --num-draft-tokens)")
    parser.add_argument("--specgrammar-recipes", default=None, metavar="DIR",
                        help="folder of recipe packs (NAME.json) a request may name with specgrammar.recipe, "
                             "besides the shipped packs; requests name packs, never paths")
    parser.add_argument("--specgrammar-context-length", type=int, default=None, metavar="N",
                        help="the model's context length in tokens (default: its config's max_position_embeddings)")
    parser.add_argument("--specgrammar-batch", choices=("auto", "never"), default="auto",
                        help="with --draft-model: auto (default) batches a constrained request even alone, and any "
                             "request that arrives while others wait or decode (a speculative row drafting with the "
                             "draft model, one batched draft forward per position for all rows); other requests "
                             "alone run our speculative loop; never: every request runs our loop, one at a time")
    parser.add_argument("--specgrammar-batch-drafts", choices=("on", "off"), default="on",
                        help="on (default): constrained requests on the batching path draft (forced tokens, "
                             "recipes, the draft model if loaded, else prompt copy, suffix, layout) and one batched "
                             "forward verifies every row's "
                             "drafts (batch_server.SpecGenerationBatch); off: one token per row per forward, "
                             "mlx-lm's own batching with the grammar processor")


@hookimpl
def configure(cli_args, model_provider):
    _config["engine"] = getattr(cli_args, "specgrammar_engine", None)
    _config["k"] = getattr(cli_args, "specgrammar_k", None)
    recipes = getattr(cli_args, "specgrammar_recipes", None)
    if recipes is not None and not Path(recipes).is_dir():
        raise SystemExit(f"--specgrammar-recipes {recipes!r} is not a folder")
    _config["recipes"] = str(Path(recipes).resolve()) if recipes is not None else None
    _config["context_length"] = getattr(cli_args, "specgrammar_context_length", None)
    _config["batch"] = getattr(cli_args, "specgrammar_batch", None) or "auto"
    _config["batch_drafts"] = getattr(cli_args, "specgrammar_batch_drafts", None) or "on"
    server_compiles(prestart=True)  # compiles past the time limit killed (SPECGRAMMAR_COMPILE_ISOLATION=thread: not)
    widen_listen_backlog()  # mlx-lm 0.32.2's server is a ThreadingHTTPServer, built after configure


# ---------------------------------------------------------------------------------------------- requests
def _engine(options: SpecOptions) -> str | None:
    return options.engine or _config["engine"]


_started = threading.Event()  # set once the default model was seen loaded


def _wait_for_model(model_provider):
    """The default model loads on the generation thread at start-up; requests may arrive before it is ready."""
    wait_for(lambda: model_provider.model, lambda: bool(getattr(model_provider.cli_args, "model", None)), _started)
    return model_provider.model, model_provider.tokenizer


def _compile(spec, options: SpecOptions, model, tokenizer):
    from .runner import output_width

    return compile_for(spec, tokenizer, output_width(model), _engine(options))


_host_cache: dict = {}


def _host(model_provider) -> Host:
    """What the gate checks requests against: the served model's names, context length, vocabulary, and the
    fields mlx-lm would otherwise take from a request to load files (``adapters``, ``draft_model``)."""
    model, tokenizer = _wait_for_model(model_provider)
    cli = model_provider.cli_args
    hit = _host_cache.get("host")
    if hit is not None and hit[0] is model and hit[1] is tokenizer:
        return hit[2]
    names = served_names(getattr(cli, "model", None))
    fixed = (("adapters", (getattr(cli, "adapter_path", None),)),
             ("draft_model", ("default_model", getattr(cli, "draft_model", None))))
    kw = {}
    if model is not None and tokenizer is not None:
        from .runner import output_width

        kw = tokenizer_facts(tokenizer, output_width(model), _config["context_length"] or getattr(
            getattr(model, "args", None), "max_position_embeddings", None), getattr(cli, "chat_template_args", None))
    host = Host("the mlx-lm server", models=tuple(dict.fromkeys(names)), fixed=fixed,
                default_max_tokens=getattr(cli, "max_tokens", None), **kw)
    _host_cache["host"] = (model, tokenizer, host)
    return host


@hookimpl
def request_fields(body, model_provider):
    host = _host(model_provider)  # (waits for the model at start-up: not part of this request's preparation)
    # the request's preparation (gate check, compile, budget check) runs under one deadline
    # (SPECGRAMMAR_PREPARE_TIMEOUT_S): an overrun is a ConstraintError, answered 400
    with prepare_deadline():
        return _prepare(body, host, model_provider)


def _prepare(body, host, model_provider):
    # the core's reading of a request (RequestError / ConstraintError are ValueErrors: the server answers their
    # status, 400 or 404); a constraint compiled now (the compile cache keeps it), its budget checked
    def compile_now(spec, options):
        model, tokenizer = _wait_for_model(model_provider)
        return None if model is None else _compile(spec, options, model, tokenizer)

    plan = plan_request(body, host, _config["recipes"], compile_now)  # recipe: a name in --specgrammar-recipes
    return None if plan is None else {"specgrammar": plan}


@hookimpl
def list_models(models, model_provider):
    """``GET /v1/models`` lists only the models a request may name here: the gate answers 404 for any other (the
    host also lists the mlx models in the Hugging Face cache, which it would load on a request's say)."""
    names = set(served_names(getattr(model_provider.cli_args, "model", None)))
    return [m for m in models if m.get("id") in names]


def _plan(args) -> RequestPlan | None:
    return (getattr(args, "plugin_fields", None) or {}).get("specgrammar")


@hookimpl
def is_batchable(args, model_provider, waiting):
    plan = _plan(args)
    if plan is not None and plan.loop:
        return False  # the request asked for our loop (drafting, cost-aware options)
    if getattr(model_provider, "draft_model", None) is not None:
        # mlx-lm turns batching off with a draft model.  A request that arrives while others wait or decode joins
        # the batching path (a speculative row drafting with the draft model, batched draft and target forwards:
        # docs/BENCHMARKS.md); so does a constrained request that arrives alone when its row is served there as our
        # serial loop would serve it (a batch of one that later requests join, instead of a serial request they
        # wait behind); any other request alone gets our serial loop
        if _config["batch"] != "auto":
            return False
        return waiting > 0 or _speculative_row(plan, args, model_provider)
    return None  # mlx-lm's batching path (without --draft-model), each row with its own processor


def _speculative_row(plan: RequestPlan | None, args, model_provider) -> bool:
    """Whether the request, batched, is a speculative row that drafts as our serial loop does: constrained, batch
    drafts on (``_batch_row``), no sampling our verifier does not rebuild (xtc), no logits processor of mlx-lm's
    besides ours (``api.ServedRow.of``), target and draft caches that roll back per row
    (``batch_server._draft_rollable``)."""
    if plan is None or plan.spec is None or _config["batch_drafts"] != "on":
        return False
    s = getattr(args, "sampling", None)
    if s is None or getattr(s, "xtc_probability", 0.0) > 0.0:
        return False
    lg = getattr(args, "logits", None)
    if lg is not None:
        from mlx_lm.sample_utils import make_logits_processors

        if make_logits_processors(lg.logit_bias, lg.repetition_penalty, lg.repetition_context_size,
                                  lg.presence_penalty, lg.presence_context_size, lg.frequency_penalty,
                                  lg.frequency_context_size):
            return False
    from .batch_server import _draft_rollable

    return _draft_rollable(model_provider.model) and _draft_rollable(model_provider.draft_model)


@hookimpl
def logits_processors(args, tokenizer, model):
    plan = _plan(args)
    if plan is None or plan.spec is None:
        return None
    from .processor import GrammarLogitsProcessor

    # the grammar with the request's budget in the row (exact, or certified: api.RowCut); a constraint that fails
    # here gets the stop tokens only (never let a bad request kill the generation thread)
    mask, compiled = row_mask(plan, lambda: _compile(plan.spec, plan.options, model, tokenizer),
                              getattr(args, "max_tokens", None), tokenizer.eos_token_ids, log)
    proc = GrammarLogitsProcessor(mask)
    if compiled is not None:  # on the batching path: a speculative row (batch_server), None: one token per pass
        proc.batch_row = _batch_row(plan, compiled, args)
    return [proc]


def _batch_row(plan: RequestPlan, compiled, args):
    """What makes the request a speculative row on the batching path (``api.RowPlan``), or None: batch
    drafts off, or sampling our verifier does not rebuild (xtc)."""
    s = getattr(args, "sampling", None)
    if _config["batch_drafts"] != "on" or s is None or getattr(s, "xtc_probability", 0.0) > 0.0:
        return None
    return plan.row(compiled, _config["k"], args.num_draft_tokens,
                    sampling_params(s.temperature, s.top_p, s.top_k, s.min_p), args.max_tokens)


@hookimpl
def generation_batch_class(model_provider):
    """The batching path decodes with ``SpecGenerationBatch``: speculative rows for the constrained requests."""
    if _config["batch_drafts"] != "on":
        return None
    from .batch_server import generation_batch_class as cls

    return cls(getattr(model_provider, "draft_model", None))  # rows draft with the server's draft model


# ---------------------------------------------------------------------------------------------- our loop
@hookimpl
def stream_generate(model, tokenizer, draft_model, prompt, prompt_cache, context, args, sampler,
                    logits_processors, generation_kwargs):
    from specgrammar_plugins.api import StopOnlyMask

    from .processor import GrammarLogitsProcessor

    plan = _plan(args)
    if draft_model is None and (plan is None or not plan.loop):
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
    k = draft_k(options, _config["k"], args.num_draft_tokens)
    s = args.sampling
    gen = ours(model, tokenizer, prompt, max_tokens=args.max_tokens, draft_model=draft_model, num_draft_tokens=k,
               constraint=plan.spec if plan is not None else None, engine=_engine(options), recipe=options.recipe,
               drafters=options.drafters, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
               seed=args.seed, prompt_cache=prompt_cache, lam=options.lam, adaptive=options.adaptive,
               budget=options.budget, budget_mask=options.budget_mask,
               cached_tokens=list(context.prompt[: context.prompt_cache_count]),
               prefill_step_size=generation_kwargs.get("prefill_step_size") or 2048)
    return logged(gen, log)

