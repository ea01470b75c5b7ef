"""``GrammarProposer``: a grammar-aware speculative proposer for vLLM's V1 engine (``method="custom_class"``).

    vllm serve MODEL --speculative-config '{"method": "custom_class",
        "model": "specgrammar_vllm.proposer.GrammarProposer", "num_speculative_tokens": 4}' \
        --additional-config '{"specgrammar": {"drafters": ["forced", "recipe"]}}'

vLLM calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`` once per step
(gpu_model_runner.py:4778, the CPU runner inherits it) with the batch in the runner's ``input_batch`` order.  For
each request with structured outputs the proposer keeps one matcher, compiled by the core (``compile_constraint``)
from the request's own ``StructuredOutputsParams`` with the engine and options vLLM's structured-output backend
uses (``structured.py``), synced to the committed tokens by history (``HistoryMatcher``: preemption and
recomputation only move it back).  It drafts on a fork of that matcher through the core's drafter chain
(``build_chain``: forced tokens and jump-forward strings, recipe packs when they are configured, then a draft model
when ``draft_model`` is given), so every draft is grammar-valid and vLLM's ``validate_tokens`` never truncates one.

Verification is vLLM's rejection sampler.  Forced and recipe drafts are one-hot (accept iff the target samples the
same token; greedy: the argmax).  Draft-model tokens are sampled from the proposal law r (the core's ``log_law``
on the draft's logits with the request's mask and sampling options); the proposer hands r to the sampler
(``runner._draft_probs``, the rows vLLM's own draft-model path fills through ``take_last_draft_probs``), which then
accepts with min(1, q/r) and samples rejections from norm(max(0, q - r)): exact at any temperature, with acceptance
sum(min(q, r)).  (Verifying a sampled draft as one-hot would be exact too, since the draft is independent of the
target's randomness, but accepts only sum(r*q); the law must be the one the token was drawn from.)  Requests
without structured outputs get no drafts.

Options (``--additional-config '{"specgrammar": {...}}'``): ``drafters`` (default forced, recipe[, model]),
``draft_model`` (a transformers folder sharing the target's tokenizer), ``recipe`` (a pack file or shipped pack
name), ``recipes_dir`` (a folder of packs requests may name), ``engine``, ``engine_options``.  Per request,
``SamplingParams(extra_args={"specgrammar": {"recipe": ..., "drafters": [...]}})`` (or the same object as a JSON
string: the launcher passes a request's ``specgrammar`` as ``vllm_xargs``) overrides ``recipe`` (a pack *name*:
``recipes_dir``, then the shipped packs; never a path) and ``drafters``.

A fault in our code while drafting for a request (``_fault``) is logged and counted, and that request gets no
more drafts; it never reaches vLLM's EngineCore.

Request state follows the runner's own: it is dropped as soon as a request leaves ``runner.requests`` (finished
or aborted), checked at every ``propose`` call.

The runner is not passed to ``propose``; it is the caller's ``self`` (found once by walking up the stack).
"""

from __future__ import annotations

import json
import logging
import sys
import weakref
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from specgrammar_plugins.api import (ConstraintError, DraftBlock, HistoryMatcher, SamplingParams, SpecOptions,
                                     compile_constraint, fill, law_backend, make_drafter, resolve_pack_name)

from .structured import ENGINES, engine_options, spec_from_params

log = logging.getLogger("vllm.specgrammar")

_INSTANCES: "weakref.WeakSet[GrammarProposer]" = weakref.WeakSet()
DEFAULT_DRAFTERS = ("forced", "recipe")
DEFAULT_DRAFTERS_WITH_MODEL = ("forced", "recipe", "model")
COUNTERS = ("rounds", "draft_tokens", "verified_rounds", "verified_draft_tokens", "accepted_tokens",
            "requests_seen", "requests_without_grammar", "compile_errors", "invalid_history", "law_rounds", "faults")


def core_params(sp):
    """The core's ``SamplingParams`` for a vLLM request (vLLM: temperature, then top-k / top-p / min-p)."""
    if sp is None:
        return SamplingParams(temperature=0.0)
    t = float(getattr(sp, "temperature", 1.0) or 0.0)
    top_k = int(getattr(sp, "top_k", 0) or 0)
    top_p = float(getattr(sp, "top_p", 1.0) or 1.0)
    min_p = float(getattr(sp, "min_p", 0.0) or 0.0)
    return SamplingParams(temperature=t if t >= 1e-5 else 0.0, top_k=max(top_k, 0), top_p=top_p, min_p=min_p)


def instances() -> list["GrammarProposer"]:
    """The proposers alive in this process (tests and benchmarks read their counters)."""
    return list(_INSTANCES)


class _RequestState:
    __slots__ = ("history", "drafter", "prompt_len", "stop_ids", "pending", "laws", "greedy")

    def __init__(self, history: HistoryMatcher | None, drafter, prompt_len: int, stop_ids: tuple[int, ...]):
        self.history = history  # None: no grammar (no drafts)
        self.drafter = drafter
        self.prompt_len = prompt_len
        self.stop_ids = stop_ids
        self.pending = 0  # drafts proposed at the last step, outcome not yet seen
        self.laws: list = []  # proposal laws of the last drafts (None = one-hot)
        self.greedy = True  # greedy requests are verified by argmax: vLLM needs no laws for them


class GrammarProposer:
    """One per model runner (built by vLLM from ``speculative_config.model``)."""

    def __init__(self, vllm_config):
        from .compat import check_supported

        check_supported()  # refuse unknown vLLM versions with a clear message
        self.vllm_config = vllm_config
        spec_cfg = vllm_config.speculative_config
        self.k = int(spec_cfg.num_speculative_tokens)
        extra = getattr(vllm_config, "additional_config", None) or {}
        self.options: dict[str, Any] = dict(extra.get("specgrammar", {}) or {})
        self.draft_model_path = self.options.get("draft_model")
        self.drafter_names = tuple(self.options.get(
            "drafters", DEFAULT_DRAFTERS_WITH_MODEL if self.draft_model_path else DEFAULT_DRAFTERS))
        self.draft_model = None
        self.seed = getattr(vllm_config.model_config, "seed", None)
        self._rng = np.random.default_rng(self.seed)
        engine, eng_opts = engine_options(vllm_config)
        self.engine = self.options.get("engine", engine)
        self.engine_options = {**eng_opts, **dict(self.options.get("engine_options", {}) or {})}
        so_cfg = getattr(vllm_config, "structured_outputs_config", None)
        # with a reasoning parser vLLM's grammar starts after the reasoning ends, which the proposer cannot see
        self.reasoning = bool(getattr(so_cfg, "reasoning_parser", "") or "")
        if self.reasoning:
            log.warning("specgrammar: a reasoning parser is configured; GrammarProposer drafts nothing "
                        "(vLLM's grammar starts after the reasoning, which the proposer does not track)")
        self.model_config = vllm_config.model_config
        self.vocab_size = int(self.model_config.get_vocab_size())
        self.max_model_len = int(self.model_config.max_model_len)
        self._tokinfo = None  # the model's tokenizer (drafters, recipe packs)
        self._grammar_tok = None  # the same as vLLM's grammar backend reads it (matchers)
        self._tokinfos: dict[tuple, Any] = {}
        self._states: dict[str, _RequestState] = {}
        self._runner_ref = None
        self.law = law_backend("torch")  # draft laws where the draft's logits are (torch), handed to vLLM as is
        self.counters = {name: 0 for name in COUNTERS}
        self.sources: dict[str, int] = {}
        self.accepted_by_position = [0] * self.k
        _INSTANCES.add(self)

    # ------------------------------------------------------------------ vLLM's proposer interface
    def load_model(self, *args, **kwargs) -> None:
        """Loads the draft model when one is configured (the tokenizer is read lazily on the first request)."""
        if self.draft_model_path and self.draft_model is None:
            from .draft_runner import load_draft_model

            self.draft_model = load_draft_model(str(self.draft_model_path))

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **kwargs) -> list[list[int]]:
        runner = self._runner(sys._getframe(1))
        req_ids = runner.input_batch.req_ids
        requests = runner.requests
        self._prune(requests)
        out: list[list[int]] = []
        laws: dict[int, list] = {}
        for i, sampled in enumerate(sampled_token_ids):
            req_id = req_ids[i] if i < len(req_ids) else None
            if req_id is None or not sampled:  # a prefill chunk, or nothing sampled: no drafts
                out.append([])
                continue
            try:
                st = self._states.get(req_id)
                if st is None:
                    st = self._states[req_id] = self._new_state(requests.get(req_id))
                if st.pending:
                    self._observe(st, len(sampled))
                n = int(num_tokens_no_spec[i])
                if st.history is None or n >= self.max_model_len:
                    out.append([])
                    continue
                drafts = self._draft(st, token_ids_cpu[i], n)
            except Exception as e:  # a fault of ours fails this request's drafting only, never the EngineCore
                self._fault(req_id, e)
                out.append([])
                continue
            out.append(drafts)
            if any(law is not None for law in st.laws):
                laws[i] = st.laws
        try:
            self._hand_over_laws(runner, out, laws)
        except Exception as e:  # the drafts are then verified one-hot: still exact (see the module docstring)
            self._fault(None, e)
        return out

    def _fault(self, req_id, e: Exception) -> None:
        """An exception in our code while drafting for ``req_id``: logged, counted, and that request gets no more
        drafts (vLLM decodes it without speculation).  Before this, one such exception (a UnicodeDecodeError from
        an emoji choice, issue 22) killed vLLM's EngineCore and every later request got a 500."""
        self.counters["faults"] += 1
        log.exception("specgrammar: drafting failed for request %s (%s); it gets no more drafts", req_id,
                      type(e).__name__)
        if req_id is not None:
            self._states[req_id] = _RequestState(None, None, 0, ())

    # ------------------------------------------------------------------ per request
    def _new_state(self, req) -> _RequestState:
        self.counters["requests_seen"] += 1
        sp = getattr(req, "sampling_params", None)
        prompt_len = int(getattr(req, "num_prompt_tokens", 0) or 0)
        spec = spec_from_params(getattr(sp, "structured_outputs", None)) if sp is not None else None
        if spec is None or self.reasoning:
            self.counters["requests_without_grammar"] += 1
            return _RequestState(None, None, prompt_len, ())
        stop_ids = tuple(sorted(int(t) for t in (getattr(sp, "all_stop_token_ids", None) or ())))
        tok = self._tokenizer_info(stop_ids, getattr(sp, "eos_token_id", None))
        try:
            compiled = compile_constraint(spec, tok, engine=self._engine_for(sp.structured_outputs),
                                          **self.engine_options)
        except ConstraintError as e:  # vLLM's own backend refuses it too (or will): no drafts, no failure here
            self.counters["compile_errors"] += 1
            log.warning("specgrammar: no grammar drafts for a request: %s", e)
            return _RequestState(None, None, prompt_len, stop_ids)
        runner = None
        if self.draft_model is None and self.draft_model_path:
            self.load_model()
        if self.draft_model is not None:
            from .draft_runner import TorchRunner

            runner = TorchRunner(self.draft_model, self.vocab_size)
        # the drafters see the model's tokenizer (recipe packs are fingerprinted against it), the matcher the
        # request's stop tokens
        # per request: SamplingParams.extra_args["specgrammar"] = {"recipe": ..., "drafters": [...]} (the OpenAI
        # server passes ``vllm_xargs`` there) over the engine-wide --additional-config options
        req_opts = ((getattr(sp, "extra_args", None) or {}).get("specgrammar") or {})
        if isinstance(req_opts, str):  # the launcher passes a request's options as vllm_xargs, a JSON string
            try:
                req_opts = json.loads(req_opts)
            except ValueError:
                pass
        if not isinstance(req_opts, dict):  # (the launcher answers 400 first; offline callers get it ignored)
            log.warning("specgrammar: per-request options must be an object, got %s; ignored", type(req_opts).__name__)
            req_opts = {}
        options = {**self.options, **{k_: v for k_, v in req_opts.items() if k_ == "drafters"}}
        if any(k_ in req_opts for k_ in ("lambda", "adaptive", "budget")):
            # the target's law is vLLM's sampler's, which a proposer cannot tilt: say so rather than pretend
            log.warning("specgrammar: cost-aware options (lambda/adaptive/budget) are not applied by the vLLM "
                        "adapter (use the mlx-lm or llama-cpp-python adapter); request decoded untilted")
        names = tuple(options.get("drafters", self.drafter_names))
        params = core_params(sp)

        def chain(names):
            recipe = options.get("recipe")
            if req_opts.get("recipe") and "recipe" in names:  # a request names a pack, never a path: the
                # recipes_dir option's folder, then the shipped packs (RecipePackError: served without it below)
                recipe = str(resolve_pack_name(req_opts["recipe"], self.options.get("recipes_dir")))
            return make_drafter(SpecOptions(k=self.k, drafters=names, recipe=recipe, extra=options),
                                self._tokinfo, params=params, rng=self._rng, draft_runner=runner,
                                target_vocab_size=self.vocab_size)

        try:
            drafter = chain(names)
        except Exception as e:  # a missing/mismatched recipe pack, an unknown drafter: serve without them
            names = tuple(n for n in names if n in ("forced", "model"))
            log.warning("specgrammar: drafters unavailable for a request (%s: %s); using %s", type(e).__name__, e,
                        list(names))
            drafter = chain(names)
        if drafter is None:
            return _RequestState(None, None, prompt_len, stop_ids)
        st = _RequestState(HistoryMatcher(compiled), drafter, prompt_len, tok.stop_token_ids)
        st.greedy = params.greedy
        return st

    def _draft(self, st: _RequestState, row: np.ndarray, n: int) -> list[int]:
        st.laws = []
        generated = row[st.prompt_len:n].tolist()
        if not st.history.sync(generated):
            # The history holds a token our matcher rejects.  After the grammar's stop token this is vLLM's bonus
            # token past the end of a finishing request (the scheduler cuts it at the stop token): benign.
            # Anything else means our grammar and vLLM's disagree: never draft for this request again.
            if not st.history.matcher.is_terminated():
                self.counters["invalid_history"] += 1
                log.warning("specgrammar: committed tokens outside the grammar (fed ...%s, history ...%s); "
                            "no more drafts for this request", st.history.fed[-8:], generated[-8:])
                st.history = None
            return []
        m = st.history.matcher
        if m.is_terminated():
            return []
        budget = min(self.k, self.max_model_len - n)
        if budget <= 0:
            return []
        block = DraftBlock(row[:n], m.fork(), self.vocab_size, budget, st.stop_ids, law=self.law)
        fill(block, st.drafter)
        drafts = block.tokens
        if not st.greedy:
            st.laws = block.laws
        if drafts:
            st.pending = len(drafts)
            self.counters["rounds"] += 1
            self.counters["draft_tokens"] += len(drafts)
            for s in block.sources:
                self.sources[s] = self.sources.get(s, 0) + 1
        return drafts

    def _engine_for(self, so) -> str:
        """The engine vLLM picked for this request (``_backend``, set by its front end; "auto" resolves per
        request), unless the ``engine`` option says otherwise."""
        if "engine" in self.options:
            return self.engine
        return ENGINES.get(getattr(so, "_backend", None) or "", self.engine)

    def _hand_over_laws(self, runner, drafts: list[list[int]], laws: dict[int, list]) -> None:
        """Give vLLM's rejection sampler the proposal law of every draft of this step, [num_reqs, k, V] (one-hot
        rows for one-hot drafts), when any draft is not one-hot; otherwise leave vLLM's one-hot path alone."""
        if not laws:
            return
        import torch

        probs = torch.zeros((len(drafts), self.k, self.vocab_size), dtype=torch.float32)
        for i, toks in enumerate(drafts):
            rows = laws.get(i)
            for j, t in enumerate(toks):
                law = rows[j] if rows is not None else None
                if law is None:
                    probs[i, j, t] = 1.0
                else:  # the torch law backend's row: already on the draft's device, normalized
                    p = self.law.dense(law, self.vocab_size)
                    probs[i, j, : p.shape[-1]] = p.to(probs.dtype)
        runner._draft_probs = probs
        runner._draft_prob_req_ids = list(runner.input_batch.req_ids[: len(drafts)])
        self.counters["law_rounds"] += 1

    def _observe(self, st: _RequestState, num_sampled: int) -> None:
        """The outcome of the last round: ``num_sampled - 1`` drafts were accepted (plus one target token)."""
        accepted = max(0, min(st.pending, num_sampled - 1))
        self.counters["verified_rounds"] += 1
        self.counters["verified_draft_tokens"] += st.pending
        self.counters["accepted_tokens"] += accepted
        for j in range(accepted):
            self.accepted_by_position[j] += 1
        st.pending = 0

    def _prune(self, live) -> None:
        if len(self._states) > len(live) or any(r not in live for r in self._states):
            for r in [r for r in self._states if r not in live]:
                del self._states[r]

    # ------------------------------------------------------------------ plumbing
    def _runner(self, frame):
        runner = self._runner_ref() if self._runner_ref is not None else None
        if runner is None:
            f = frame
            for _ in range(8):
                if f is None:
                    break
                obj = f.f_locals.get("self")
                if obj is not None and hasattr(obj, "input_batch") and hasattr(obj, "requests"):
                    runner = obj
                    break
                f = f.f_back
            if runner is None:
                raise RuntimeError("GrammarProposer.propose must be called by vLLM's model runner")
            self._runner_ref = weakref.ref(runner)
        return runner

    def _tokenizer_info(self, stop_ids: tuple[int, ...], eos: int | None):
        if self._tokinfo is None:
            from transformers import AutoTokenizer

            from specgrammar_plugins.api import TokenizerInfo

            mc = self.model_config
            hf = AutoTokenizer.from_pretrained(mc.tokenizer, revision=getattr(mc, "tokenizer_revision", None),
                                               trust_remote_code=bool(getattr(mc, "trust_remote_code", False)))
            self._tokinfo = TokenizerInfo.from_hf(hf, vocab_size=self.vocab_size)
            self._grammar_tok = self._as_vllm_sees_it(hf, self._tokinfo)
        if not stop_ids:
            return self._grammar_tok
        key = (stop_ids, eos)
        tok = self._tokinfos.get(key)
        if tok is None:  # vLLM's grammar stops on the request's stop tokens (override_stop_tokens): so does ours
            first = eos if eos in stop_ids else stop_ids[0]
            tok = self._tokinfos[key] = replace(self._grammar_tok, eos_token_id=first,
                                                stop_token_ids=tuple(dict.fromkeys([first, *stop_ids])))
        return tok

    def _as_vllm_sees_it(self, hf, tok):
        """The tokenizer as vLLM's xgrammar backend reads it (``xgr.TokenizerInfo.from_huggingface``,
        backend_xgrammar.py:70): token bytes and special tokens from xgrammar's own view.  They can differ from
        ours: xgrammar 0.2.8 finds no special tokens in a transformers-5 tokenizer whose specials are
        ``added_tokens``, so vLLM lets ``<|im_start|>`` through as the text "<|im_start|>" inside JSON strings,
        where our reading (specials never allowed) would refuse it.  Matching vLLM keeps draft and target on one
        language.  Only for the xgrammar engine; others keep our reading."""
        if self.engine != "xgrammar":
            return tok
        try:
            import xgrammar as xgr

            xi = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size)
            decoded = xi.decoded_vocab
            specials = frozenset(int(i) for i in xi.special_token_ids)
            n = min(len(decoded), self.vocab_size)
            token_bytes = tuple(b"" if i in specials else bytes(decoded[i]) for i in range(n))
            return replace(tok, token_bytes=token_bytes, special_ids=specials)
        except Exception as e:  # keep ours: at worst vLLM truncates a draft
            log.warning("specgrammar: could not read the tokenizer as xgrammar does (%s); using ours", e)
            return tok

    # ------------------------------------------------------------------ reading
    @property
    def num_live_requests(self) -> int:
        return len(self._states)

    def stats(self) -> dict:
        return {**self.counters, "sources": dict(self.sources), "accepted_by_position": list(self.accepted_by_position),
                "live_requests": len(self._states)}
