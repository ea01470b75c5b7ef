"""Grammar-aware drafting for vLLM's V1 engine: the per-request grammar state (``GrammarStates``) and the
``method="custom_class"`` proposer without a draft model (``GrammarProposer``).

    vllm serve MODEL --speculative-config '{"method": "custom_class",
        "model": "specgrammar_vllm.proposer.GrammarProposer", "num_speculative_tokens": 4}'

For each request with structured outputs ``GrammarStates`` keeps one matcher, compiled by the core
(``compile_constraint``) from the request's own ``StructuredOutputsParams`` with the engine and options vLLM's
structured-output backend uses (``structured.py``), synced to the committed tokens by history (``HistoryMatcher``:
preemption and recomputation only move it back), and the request's host drafter chain (``make_drafter``: forced
tokens and jump-forward strings, then recipe packs when configured).  Every step it drafts on a fork of that
matcher in a ``DraftBlock``, so every draft is grammar-valid and vLLM's ``validate_tokens`` never truncates one.

Two proposers use it:

- ``GrammarProposer`` (here; forced + recipe drafts, no model): vLLM calls ``propose(sampled_token_ids,
  num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`` once per step (gpu_model_runner.py:4778, the CPU runner
  inherits it) with the batch in the runner's ``input_batch`` order.  Drafts are one-hot: vLLM's rejection sampler
  accepts one iff the target samples it (greedy: the argmax), which is exact at any temperature.
- ``draft_proposer.GrammarDraftProposer`` (method ``draft_model``): vLLM's own draft-model proposer with these
  host drafts first and the draft model, masked by each request's grammar, for the rest of the k positions.

Request identity: the state is keyed by vLLM's request id, read from the model runner (``runner.input_batch.req_ids``
in batch order, ``runner.requests[req_id].sampling_params``).  vLLM 0.32 builds its own proposers with
``runner=self`` but a ``custom_class`` with ``vllm_config`` only; ``patches/vllm-custom-proposer-runner.diff`` is
the upstream-ready change that passes the runner to custom proposers too, and the general plugin applies the same
change in memory on the supported versions (``wiring.py``).  Without a runner the proposer drafts nothing (logged).

Options (``--additional-config '{"specgrammar": {...}}'``): ``drafters`` (default forced, recipe), ``recipe`` (a
pack file or shipped pack name), ``recipes_dir`` (a folder of packs requests may name), ``engine``,
``engine_options``, and for the draft-model path ``refused_drafts`` (``draft_proposer.REFUSED_DRAFTS``) and
``draft_confidence`` (``draft_proposer.DRAFT_CONFIDENCE``).  Per request, ``SamplingParams(extra_args={"specgrammar":
{"recipe": ..., "drafters": [...]}})`` (or the same object as a JSON string: the launcher passes a request's
``specgrammar`` as ``vllm_xargs``) overrides ``recipe`` (a pack *name*: ``recipes_dir``, then the shipped packs;
never a path) and ``drafters``.  Requests without
structured outputs get no host drafts.  A fault in our code while drafting for a request (``fault``) is logged and
counted, and that request gets no more grammar drafts; it never reaches vLLM's EngineCore.  Request state follows the runner's own: it is dropped as soon as a request
leaves ``runner.requests`` (finished or aborted), checked at every step.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Sequence

import numpy as np

from specgrammar_plugins.api import BATCH_COUNTERS as COUNTERS
from specgrammar_plugins.api import (BudgetError, ConstraintError, HistoryMatcher, RequestState, RequestTable,
                                     SamplingParams, SpecOptions, check_budget, fill,
                                     make_drafter, resolve_pack_name, with_stops)

from .budget_mask import grammar_tokenizer, request_options
from .draws import RequestDraws
from .startup import check_recipe_pack
from .structured import ENGINES, compile_as_enforced, engine_options, params_key, spec_from_params

log = logging.getLogger("vllm.specgrammar")

_INSTANCES: "weakref.WeakSet[GrammarStates]" = weakref.WeakSet()
DEFAULT_DRAFTERS = ("forced", "recipe")
MOVED_DRAFT_MODEL = (
    "the specgrammar option 'draft_model' is gone: give the draft model to vLLM instead, "
    "--speculative-config '{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": K}' "
    "(the specgrammar general plugin makes vLLM's draft-model proposer grammar-aware; see the README)")


def core_params(sp):
    """The core's ``SamplingParams`` for a vLLM request (vLLM: temperature, then top-k / top-p / min-p)."""
    if sp is None:
        return SamplingParams(temperature=0.0)
    t = float(getattr(sp, "temperature", 1.0) or 0.0)
    top_k = int(getattr(sp, "top_k", 0) or 0)
    top_p = float(getattr(sp, "top_p", 1.0) or 1.0)
    min_p = float(getattr(sp, "min_p", 0.0) or 0.0)
    return SamplingParams(temperature=t if t >= 1e-5 else 0.0, top_k=max(top_k, 0), top_p=top_p, min_p=min_p)


def instances() -> list["GrammarStates"]:
    """The grammar states alive in this process (tests and benchmarks read their counters)."""
    return list(_INSTANCES)


class GrammarStates(RequestTable):
    """Per-request grammar state keyed by vLLM request id, and the counters (one per proposer): the core's
    ``RequestTable`` (the batch layer), with vLLM's request -> constraint and drafters (``new_state``)."""

    def __init__(self, vllm_config):
        from .compat import check_supported

        check_supported()  # refuse unknown vLLM versions with a clear message
        self.vllm_config = vllm_config
        spec_cfg = vllm_config.speculative_config
        self.k = int(spec_cfg.num_speculative_tokens)
        extra = getattr(vllm_config, "additional_config", None) or {}
        self.options: dict[str, Any] = dict(extra.get("specgrammar", {}) or {})
        if self.options.get("draft_model"):
            raise ValueError(MOVED_DRAFT_MODEL)
        self.drafter_names = tuple(self.options.get("drafters", DEFAULT_DRAFTERS))
        self.seed = getattr(vllm_config.model_config, "seed", None)  # the engine's: draws.py keys draws by it
        engine, eng_opts = engine_options(vllm_config)
        self.engine = self.options.get("engine", engine)
        self.engine_options = {**eng_opts, **dict(self.options.get("engine_options", {}) or {})}
        so_cfg = getattr(vllm_config, "structured_outputs_config", None)
        # with a reasoning parser vLLM's grammar starts after the reasoning ends, which the proposer cannot see
        self.reasoning = bool(getattr(so_cfg, "reasoning_parser", "") or "")
        if self.reasoning:
            log.warning("specgrammar: a reasoning parser is configured; no grammar drafts "
                        "(vLLM's grammar starts after the reasoning, which the proposer does not track)")
        self.model_config = vllm_config.model_config
        self.init_table(self.k, int(self.model_config.get_vocab_size()), int(self.model_config.max_model_len), log)
        self._tokinfo = None  # the model's tokenizer (drafters, recipe packs)
        self._grammar_tok = None  # the same as vLLM's grammar backend reads it (matchers)
        self._tokinfos: dict[tuple, Any] = {}
        # compiled constraint -> {max_tokens: why it cannot end within it, or None}: _check_budget's verdicts
        self._budget_verdicts: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        self._logged_at = time.monotonic()
        check_recipe_pack(self)  # every rank loads the engine-wide pack now: one it cannot load stops start-up
        _INSTANCES.add(self)

    # ------------------------------------------------------------------ per request
    def new_state(self, req, req_id: str | None = None) -> RequestState:
        sp = getattr(req, "sampling_params", None)
        prompt_len = int(getattr(req, "num_prompt_tokens", 0) or 0)
        so = getattr(sp, "structured_outputs", None) if sp is not None else None
        key = params_key(so)
        spec = self.memo(("spec", key) if key else None, lambda: spec_from_params(so))
        if spec is None or self.reasoning:
            self.counters["requests_without_grammar"] += 1
            return RequestState(None, None, prompt_len, (), grammar=spec is not None)
        stop_ids = tuple(sorted(int(t) for t in (getattr(sp, "all_stop_token_ids", None) or ())))
        eos = getattr(sp, "eos_token_id", None)
        tok = self._tokenizer_info(stop_ids, eos)
        engine = self._engine_for(so)
        try:
            compiled = self._compiled(spec, key, tok, engine, stop_ids, eos)
        except ConstraintError as e:  # vLLM's own backend refuses it too (or will): no drafts, no failure here
            self.counters["compile_errors"] += 1
            log.warning("specgrammar: no grammar drafts for a request: %s", e)
            return RequestState(None, None, prompt_len, stop_ids)
        # the drafters see the model's tokenizer (recipe packs are fingerprinted against it), the matcher the
        # request's stop tokens
        # per request: SamplingParams.extra_args["specgrammar"] = {"recipe": ..., "drafters": [...]} (the OpenAI
        # server passes ``vllm_xargs`` there) over the engine-wide --additional-config options
        # (the core's one reader, as the budget mask reads them: the launcher answers a malformed value with a 400
        # first; offline callers get it logged and ignored)
        req_opts = request_options(sp) or {}
        options = {**self.options, **{k_: v for k_, v in req_opts.items() if k_ == "drafters"}}
        if any(k_ in req_opts for k_ in ("lambda", "adaptive", "budget")):
            # the target's law is vLLM's sampler's, which a proposer cannot tilt: say so rather than pretend
            log.warning("specgrammar: cost-aware options (lambda/adaptive/budget) are not applied by the vLLM "
                        "adapter (use the mlx-lm or llama-cpp-python adapter); request decoded untilted")
        # the host chain only: the draft model, when there is one, is vLLM's (draft_proposer.GrammarDraftProposer
        # fills the positions the host chain leaves), so "model" here has no runner and drops out of the chain
        names = tuple(options.get("drafters", self.drafter_names))
        params = core_params(sp)
        draws = self._request_draws(sp, req_id)
        self._check_budget(compiled, getattr(sp, "max_tokens", None), req_id)

        def chain(names):
            recipe = options.get("recipe")
            if req_opts.get("recipe") and "recipe" in names:  # a request names a pack, never a path: the
                # recipes_dir option's folder, then the shipped packs (RecipePackError: served without it below)
                recipe = str(resolve_pack_name(req_opts["recipe"], self.options.get("recipes_dir")))
            return make_drafter(SpecOptions(k=self.k, drafters=names, recipe=recipe, extra=options),
                                self._tokinfo, params=params, rng=draws.rng, target_vocab_size=self.vocab_size)

        try:
            drafter = chain(names)
        except Exception as e:  # a missing/mismatched recipe pack, an unknown drafter: serve without them
            names = tuple(n for n in names if n in ("forced", "model"))
            log.warning("specgrammar: drafters unavailable for a request (%s: %s); using %s", type(e).__name__, e,
                        list(names))
            drafter = chain(names)
        return RequestState(HistoryMatcher(compiled), drafter, prompt_len, tok.stop_token_ids, draws=draws)

    def _compiled(self, spec, key, tok, engine: str, stop_ids: tuple[int, ...], eos):
        """The request's constraint as vLLM's backend enforces it (``structured.compile_as_enforced``: a JSON Schema
        keyword our strict mode refuses and vLLM's xgrammar ignores is ignored here too), kept by its params
        (``memo``).  (Before, such a request got no drafts at all: 3 of the 7 dev-split schemas vLLM answered in
        ``bench real``, issue 32.)"""
        def compile_():
            compiled, lenient = compile_as_enforced(spec, tok, engine, self.engine_options)
            if lenient:
                self.counters["lenient_compiles"] = self.counters.get("lenient_compiles", 0) + 1
                log.info("specgrammar: drafting under the schema as vLLM's backend enforces it")
            return compiled

        return self.memo(("compiled", key, engine, stop_ids, eos) if key else None, compile_)

    def _request_draws(self, sp, req_id: str | None) -> RequestDraws:
        """A request's random draws, keyed by its own seed, else the engine's and its id (draws.py): never by this
        process's state, so every rank (tensor, pipeline, data parallel) draws the same drafts for it."""
        return RequestDraws(getattr(sp, "seed", None), self.seed, req_id)

    def _check_budget(self, compiled, max_tokens, req_id: str | None = None) -> None:
        """The drafting side of budget feasibility: vLLM's own sampler draws the target's tokens, so a request whose
        constraint cannot end within its ``max_tokens`` will be cut off mid-structure; count it and say so.  The
        verdict is a function of the compiled constraint (the compile cache hands every request of one constraint
        the same object) and ``max_tokens``, so it is worked out once per pair: the certified walk costs up to tens
        of ms, which would otherwise land in the engine step of every new request."""
        from .budget_mask import budget_of

        if req_id is not None and budget_of(req_id) is not None:
            return  # vLLM's bitmask carries this request's budget mask (budget_mask.py): it ends within max_tokens
        budget = max_tokens if isinstance(max_tokens, int) else None
        seen = self._budget_verdicts.get(compiled)
        if seen is None or len(seen) >= 64:  # (a client cycling through max_tokens values: start over)
            seen = self._budget_verdicts[compiled] = {}
        first = budget not in seen
        if first:
            try:
                check_budget(compiled, SpecOptions(), budget)
                seen[budget] = None
            except BudgetError as e:
                seen[budget] = e.reason
        reason = seen[budget]
        if reason is not None:  # said once per verdict (a log line costs ~0.1-0.7 ms in the engine step), counted always
            self.counters["budget_cut_off"] += 1
            log.log(logging.WARNING if first else logging.DEBUG, "specgrammar: this request will end cut off at "
                    "max_tokens (its budget mask is off): %s", reason)

    def maybe_log(self) -> None:
        """One INFO line with the draft counts by source, at most every ``VLLM_LOG_STATS_INTERVAL`` seconds
        (like vLLM's own stats lines), so a server's log shows which drafters ran."""
        now = time.monotonic()
        try:
            import vllm.envs as envs

            every = float(envs.VLLM_LOG_STATS_INTERVAL)
        except Exception:
            every = 10.0
        if now - self._logged_at < every:
            return
        self._logged_at = now
        c = self.counters
        log.info("specgrammar drafts: %s; accepted %d of %d verified; live requests %d",
                 ", ".join(f"{s} {n}" for s, n in sorted(self.sources.items())) or "none",
                 c["accepted_tokens"], c["verified_draft_tokens"], len(self._states))

    # ------------------------------------------------------------------ plumbing
    def _engine_for(self, so) -> str:
        """The engine vLLM picked for this request (``_backend``, set by its front end; "auto" resolves per
        request), unless the ``engine`` option says otherwise."""
        if "engine" in self.options:
            return self.engine
        return ENGINES.get(getattr(so, "_backend", None) or "", self.engine)

    def _tokenizer_info(self, stop_ids: tuple[int, ...], eos: int | None):
        if self._tokinfo is None:
            from transformers import AutoTokenizer

            from specgrammar_plugins.api import TokenizerInfo

            mc = self.model_config
            hf = AutoTokenizer.from_pretrained(mc.tokenizer, revision=getattr(mc, "tokenizer_revision", None),
                                               trust_remote_code=bool(getattr(mc, "trust_remote_code", False)))
            self._tokinfo = TokenizerInfo.from_hf(hf, vocab_size=self.vocab_size)
            # the tokenizer as vLLM's grammar backend reads it (xgrammar's own view: see api.engine_tokenizer), so
            # that draft and target are on one language
            self._grammar_tok = grammar_tokenizer(hf, self.vocab_size, self.engine)
        if not stop_ids:
            return self._grammar_tok
        key = (stop_ids, eos)
        tok = self._tokinfos.get(key)
        if tok is None:  # vLLM's grammar stops on the request's stop tokens (override_stop_tokens): so does ours
            tok = self._tokinfos[key] = with_stops(self._grammar_tok, stop_ids, eos)
        return tok


class GrammarProposer(GrammarStates):
    """The ``custom_class`` proposer (forced + recipe drafts, no model): one per model runner, built by vLLM from
    ``speculative_config.model``.  ``runner``: vLLM's model runner, passed by vLLM where the proposer-runner change
    is in (``patches/vllm-custom-proposer-runner.diff``, applied in memory by the general plugin)."""

    def __init__(self, vllm_config, device=None, runner=None):
        super().__init__(vllm_config)
        self.runner = runner
        self._no_runner_logged = False

    # ------------------------------------------------------------------ vLLM's proposer interface
    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (the tokenizer is read lazily on the first request)."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **kwargs) -> list[list[int]]:
        runner = self.runner
        if runner is None:
            if not self._no_runner_logged:
                self._no_runner_logged = True
                log.error("specgrammar: vLLM did not hand its model runner to GrammarProposer (is the specgrammar "
                          "general plugin loaded, and the vLLM version supported?); no drafts")
            return [[] for _ in sampled_token_ids]
        t0 = time.perf_counter_ns()
        req_ids = runner.input_batch.req_ids
        requests = runner.requests
        self.prune(requests)
        out: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            req_id = req_ids[i] if i < len(req_ids) else None
            if req_id is None or not sampled:  # a prefill chunk, or nothing sampled: no drafts
                out.append([])
                continue
            try:
                st = self.state(req_id, requests.get(req_id))
                self.observe(st, len(sampled))
            except Exception as e:  # a fault in our part: no drafts for this request, the engine goes on
                self.fault("reading its request", e, req_id)
                out.append([])
                continue
            n = int(num_tokens_no_spec[i])
            if st.history is None or n >= self.max_model_len:
                out.append([])
                continue
            out.append(self._draft(st, req_id, token_ids_cpu[i], n))
        self.timing_ns["grammar"] += time.perf_counter_ns() - t0
        self.maybe_log()
        return out

    def _draft(self, st: RequestState, req_id: str, row: np.ndarray, n: int) -> list[int]:
        try:
            block = self.begin(st, row, n)
            if block is not None:
                fill(block, st.drafter)
        except Exception as e:  # a fault in our drafting: no drafts for this request, the engine goes on
            self.fault("drafting", e, req_id)
            block = None
        if block is None:
            self.record(st, req_id, [], [])
            return []
        from .budget_mask import fitting_drafts

        keep = fitting_drafts(req_id, row[st.prompt_len:n], block.tokens)  # the budget's rows: drafts end there
        self.record(st, req_id, block.tokens[:keep], block.sources[:keep])
        return list(block.tokens[:keep])
