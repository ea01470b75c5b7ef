"""A ``stream_generate`` twin that runs the core ``SpeculativeLoop`` on mlx-lm models.

    from specgrammar_mlx_lm import stream_generate
    for r in stream_generate(model, tokenizer, prompt, max_tokens=64, draft_model=draft, num_draft_tokens=4,
                             constraint=ConstraintSpec.json_schema(schema), temperature=0.7, seed=0):
        print(r.text, end="")          # r is mlx-lm's own GenerationResponse (a subclass carrying .stats)

Differences from ``mlx_lm.stream_generate``: sampling is given as options (``temperature``/``temp``, ``top_p``,
``top_k``, ``min_p``) rather than a ``sampler`` callable, because the exact verifier must rebuild the target and
draft laws itself (core ``distributions.log_law``); mlx-lm ``logits_processors`` are not supported here (the
grammar mask is applied by the loop, on draft and target alike).  Drafting is grammar-aware: the drafter chain
(forced tokens -> recipe pack -> draft model, ``build_chain``) proposes up to ``num_draft_tokens`` tokens, one
target pass verifies them with accept/residual sampling, so the output law is the target's constrained law.

A ``prompt_cache`` follows mlx-lm's convention (target layers, then draft layers).  On exit (finished, closed
early by the caller, or failed) both caches hold exactly the prompt plus the tokens yielded so far, so a
server can store the cache under ``prompt + yielded tokens`` and reuse it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from specgrammar_plugins.api import (DEFAULT_DRAFTERS, SamplingParams, SpecOptions, Stats, compile_for,
                                     encode_prompt, make_loop, sampling_params, stop_ids, tokenizer_info)

from .runner import OPAQUE, MLXRunner, cache_offset

try:  # mlx-lm's own response type, so existing callers work unchanged
    from mlx_lm.generate import GenerationResponse as _Base
except Exception:  # pragma: no cover - mlx-lm missing: keep the module importable
    @dataclass
    class _Base:  # type: ignore[no-redef]
        text: str
        token: int
        logprobs: Any
        from_draft: bool
        prompt_tokens: int
        prompt_tps: float
        generation_tokens: int
        generation_tps: float
        peak_memory: float
        finish_reason: str | None = None


@dataclass
class GenerationResponse(_Base):
    """mlx-lm's ``GenerationResponse`` plus the request's loop statistics (set on the final response)."""

    stats: Stats | None = None


def _wrap_tokenizer(tokenizer):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def _log_softmax_row(row):
    import mlx.core as mx

    return row - mx.logsumexp(row, keepdims=True)


def stream_generate(model, tokenizer, prompt, max_tokens: int = 256, draft_model=None, *,
                    num_draft_tokens: int = 4, constraint=None, engine: str | None = None, recipe=None,
                    drafters: Sequence[str] | None = None, temperature: float | None = None, temp: float | None = None,
                    top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, params: SamplingParams | None = None,
                    seed: int | None = None, rng: np.random.Generator | None = None, prompt_cache: list | None = None,
                    cached_tokens: Sequence[int] | None = None, blind: bool = False, stream=None,
                    prefill_step_size: int = 2048, stop_token_ids: Sequence[int] | None = None,
                    lam: float | None = None, adaptive: bool = False, budget: int | None = None,
                    budget_mask: bool | None = None, logits_processors=None, sampler=None,
                    **kwargs) -> Iterator[GenerationResponse]:
    """Yield one ``GenerationResponse`` per generated token (the last one with ``finish_reason`` and ``stats``).

    prompt: text, token ids or an mx.array.  With ``prompt_cache`` holding tokens already, ``prompt`` is what
    follows them (as in mlx-lm); pass ``cached_tokens`` (the tokens the cache holds) when known.
    constraint: ``ConstraintSpec`` or ``CompiledConstraint`` (None = unconstrained).  recipe: passed to the
    drafter chain.  drafters: names in chain order (default forced, recipe, model).
    blind: draft without the grammar mask (benchmarks only: reproduces the grammar-blind draft).
    lam / adaptive / budget: the opt-in cost-aware law (core ``cost.make_tilt``): the output law is then the tilted
    q_lambda, still sampled exactly.
    budget_mask: budget feasibility (core ``budget.py``; on by default with a constraint): a token is allowed only
    if the constraint can still end within ``budget`` (or ``max_tokens``) after it; ``BudgetError`` up front when
    it cannot; the final response's ``stats.budget`` says whether it shaped the output.  False turns it off.
    """
    if sampler is not None:
        raise ValueError("pass temperature/top_p/top_k/min_p instead of a sampler: the exact verifier rebuilds the "
                         "target and draft sampling laws itself")
    if logits_processors:
        raise ValueError("logits_processors are not supported by the speculative loop; give the grammar as "
                         "constraint= (it is applied to draft and target alike)")
    for ignored in ("max_kv_size", "prompt_progress_callback", "kv_bits", "kv_group_size", "quantized_kv_start",
                    "input_embeddings"):
        val = kwargs.pop(ignored, None)
        if ignored == "kv_bits" and val is not None:
            raise ValueError("a quantized KV cache (kv_bits) is not supported by the speculative loop")
        if ignored == "input_embeddings" and val is not None:
            raise ValueError("input_embeddings are not supported by the speculative loop")
    if kwargs:
        raise TypeError(f"unexpected arguments: {', '.join(sorted(kwargs))}")
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    if max_tokens < 0:
        max_tokens = 1 << 30
    import mlx.core as mx

    tokenizer = _wrap_tokenizer(tokenizer)
    rest = encode_prompt(tokenizer, prompt)
    params = params or sampling_params(temperature, top_p, top_k, min_p, temp)

    # caches: mlx-lm's layout is [target layers..., draft layers...]
    n_layers = len(model.layers)
    if prompt_cache is not None:
        tcache = prompt_cache[:n_layers]
        dcache = prompt_cache[n_layers:] if draft_model is not None else None
        if draft_model is not None and not dcache:
            from mlx_lm.models.cache import make_prompt_cache

            dcache = make_prompt_cache(draft_model)
            prompt_cache.extend(dcache)
    else:
        tcache, dcache = None, None
    held = cache_offset(tcache) if tcache is not None else 0
    if cached_tokens is not None:
        known = [int(t) for t in cached_tokens]
    else:
        known = [OPAQUE] * held  # ids unknown: the loop never needs them (it only feeds what follows)
    full = known + rest
    if not rest and (not known or known[-1] == OPAQUE):
        raise ValueError("the prompt is empty (or entirely cached with unknown ids): nothing to condition on")

    if draft_model is not None and dcache is not None and OPAQUE in known and cache_offset(dcache) < held:
        raise ValueError("the draft cache holds fewer tokens than the target cache and their ids are unknown: "
                         "pass cached_tokens=")
    target = MLXRunner(model, tcache, known, stream=stream, prefill_step_size=prefill_step_size, what="target")
    draft = None
    if draft_model is not None:
        draft = MLXRunner(draft_model, dcache, known, stream=stream, prefill_step_size=prefill_step_size,
                          what="draft model")
    width = target.vocab_size
    compiled = compile_for(constraint, tokenizer, width, engine) if constraint is not None else None
    tokinfo = compiled.tokenizer if compiled is not None else tokenizer_info(tokenizer, width)
    stops = tuple(stop_token_ids) if stop_token_ids is not None else stop_ids(tokenizer, tokinfo)
    rng = rng if rng is not None else np.random.default_rng(seed)
    names = tuple(drafters) if drafters is not None else DEFAULT_DRAFTERS
    options = SpecOptions(k=max(0, num_draft_tokens), drafters=names, recipe=recipe, budget=budget, lam=lam,
                          adaptive=adaptive, budget_mask=budget_mask)
    loop = make_loop(target, full, options, constraint=compiled, tokenizer=tokinfo, params=params, rng=rng,
                     draft_runner=draft, max_tokens=max_tokens, stop_token_ids=stops, blind=blind)
    detok = tokenizer.detokenizer
    stopset = frozenset(stops)
    yielded = 0
    tic = time.perf_counter()
    prompt_tps = 0.0
    first = True
    accepted_before = 0
    try:
        for commit in loop.run():
            if first:
                prompt_time = max(time.perf_counter() - tic, 1e-9)
                prompt_tps = len(rest) / prompt_time
                tic = time.perf_counter()
                first = False
            n_acc = loop.stats.accepted - accepted_before
            accepted_before = loop.stats.accepted
            rows = target.last_logits
            for j, tok in enumerate(commit.tokens):
                last = j == len(commit.tokens) - 1
                finish = commit.finish_reason if last else None
                if tok in stopset:
                    finish = "stop"
                    detok.finalize()
                else:
                    detok.add_token(tok)
                    if finish is not None:
                        detok.finalize()
                lp = _log_softmax_row(rows[j]) if rows is not None and j < len(rows) else mx.zeros((width,))
                yielded += 1
                resp = GenerationResponse(
                    text=detok.last_segment, token=int(tok), logprobs=lp, from_draft=j < n_acc,
                    prompt_tokens=len(rest), prompt_tps=prompt_tps, generation_tokens=yielded,
                    generation_tps=yielded / max(time.perf_counter() - tic, 1e-9),
                    peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish,
                    stats=loop.stats if finish is not None else None)
                if finish is not None:
                    loop.stats.emitted = yielded
                    loop.stats.finish_reason = finish
                    yield resp
                    return
                yield resp
    finally:
        # both caches end holding exactly prompt + the tokens the caller has seen
        want = full + loop.emitted[:yielded]
        for r in (target, draft):
            if r is not None:
                try:
                    r.sync(want)
                except Exception:  # leave the cache consistent: trim to what we know it holds
                    pass


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """The whole response text (like ``mlx_lm.generate``); see ``stream_generate`` for the options."""
    text = ""
    for r in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(r.text, end="", flush=True)
        text += r.text
    if verbose:
        print()
    return text


def generate_tokens(model, tokenizer, prompt, **kwargs) -> tuple[list[int], Stats]:
    """(generated token ids, loop stats) for one request."""
    out: list[int] = []
    stats = None
    for r in stream_generate(model, tokenizer, prompt, **kwargs):
        out.append(r.token)
        if r.stats is not None:
            stats = r.stats
    return out, stats
