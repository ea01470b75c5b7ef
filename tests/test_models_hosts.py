"""The committed tiny target loads in every host and decodes greedily like transformers.

For 10 eval prompts (from every workload) each host greedy-decodes 32 tokens from the same prompt ids (EOS
ignored).  The tokens up to and including the first EOS must equal transformers' reference; the 32-token tails
past EOS (where the model is off its training distribution and logits are flatter) are compared too and any
divergence is reported with the reference's top-2 logit gap at that position (a near-tie means fp32 rounding
between kernels, not a loading bug).  Each host part skips when its package is absent.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from specgrammar_plugins import workloads as W
from specgrammar_plugins.models import TINY_DIR, tiny_gguf, tiny_path

pytestmark = pytest.mark.skipif(not (TINY_DIR / "metrics.json").exists(), reason="tiny models not built")

N_TOKENS = 32


def _prompts() -> list[str]:
    out = []
    for i in range(10):
        w = W.WORKLOADS[i % len(W.WORKLOADS)]
        out.append(W.examples(w, "eval")[i // len(W.WORKLOADS)].prompt)
    return out


@pytest.fixture(scope="module")
def reference():
    """(prompt ids, greedy 32 tokens, top-2 logit gap per generated position) from transformers."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(tiny_path("target")))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_path("target")), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in _prompts():
            ids = tok.encode(W.chat_prompt(p), add_special_tokens=False)
            res = model(input_ids=torch.tensor([ids]), use_cache=True)
            gen, gaps = [], []
            for _ in range(N_TOKENS):
                logits = res.logits[0, -1].numpy()
                top = np.sort(logits)[-2:]
                gaps.append(float(top[1] - top[0]))
                gen.append(int(np.argmax(logits)))
                res = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=res.past_key_values, use_cache=True)
            out.append((ids, gen, gaps))
    return out


def _until_eos(toks: list[int], eos: int = 2) -> list[int]:
    return toks[: toks.index(eos) + 1] if eos in toks else toks


def _compare(host: str, reference, got: list[list[int]]) -> None:
    report, hard = [], []
    for (ids, ref, gaps), g in zip(reference, got):
        g = list(g)[:N_TOKENS]
        if g == ref:
            continue
        k = next((i for i, (a, b) in enumerate(zip(ref, g)) if a != b), min(len(ref), len(g)))
        gap = gaps[k] if k < len(gaps) else float("nan")
        before_eos = k < len(_until_eos(ref))
        line = f"{host}: diverges at token {k} (ref {ref[k:k + 3]} vs {g[k:k + 3]}), top-2 gap {gap:.2e}, " \
               f"{'before' if before_eos else 'after'} the first EOS"
        report.append(line)
        if before_eos:
            hard.append(line)
    for line in report:
        print(line)
    assert not hard, "\n".join(hard)


def test_mlx_lm(reference):
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, tok = mlx_lm.load(str(tiny_path("target")))
    assert tok.eos_token_id == 2
    got = []
    for ids, _, _ in reference:
        assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
        toks = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=N_TOKENS,
                                                  sampler=lambda x: mx.argmax(x, axis=-1))]
        got.append(toks)
    _compare("mlx-lm", reference, got)


def test_llama_cpp(reference):
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_path("target")))
    llm = llama_cpp.Llama(model_path=str(tiny_gguf("target")), n_threads=1, n_ctx=512, verbose=False)
    assert llm.n_vocab() == 1024 and llm.token_eos() == 2
    got = []
    for (ids, _, _), p in zip(reference, _prompts()):
        # llama.cpp tokenizes exactly like the HF tokenizer (specials parsed, no BOS)
        text = W.chat_prompt(p)
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        ans = W.examples("json_extraction", "eval")[0].reference + " héllo ✓"
        assert llm.tokenize(ans.encode(), add_bos=False, special=True) == hf.encode(ans, add_special_tokens=False)
        toks = []
        for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(t))
            if len(toks) == N_TOKENS:
                break
        got.append(toks)
    _compare("llama.cpp", reference, got)


def test_vllm(reference):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(tiny_path("target")), dtype="float32", max_model_len=512, seed=0, enforce_eager=True)
    sp = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _, _ in reference], sp, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    _compare("vLLM", reference, got)
