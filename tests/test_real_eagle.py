"""The EAGLE head for SmolLM2 (``models.real_eagle``), without vLLM: built from the committed draft with no random
weight, in vLLM's EAGLE checkpoint names, and drafting what the draft drafts.  The head's forward as vLLM's
``EagleLlamaForCausalLM`` computes it (fc on [embedding, hidden], a first layer with no input norm, no final norm,
the target's tied lm_head) is run here with transformers' Llama layers: the null layer adds nothing and the folded
final norm keeps the draft's argmax nearly everywhere.  vLLM runs it in tests/test_real_model_vllm.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

@pytest.fixture(scope="module")
def head(hf_folder):
    from safetensors.torch import load_file

    from specgrammar_plugins.models.real_draft import smollm2_draft_folder
    from specgrammar_plugins.models.real_eagle import smollm2_eagle_folder

    folder = smollm2_eagle_folder()
    return folder, load_file(str(folder / "model.safetensors")), smollm2_draft_folder(progress=False)


def test_the_head_is_in_vllms_eagle_format_with_a_null_first_layer(head):
    import json

    folder, w, _ = head
    cfg = json.loads((folder / "config.json").read_text())
    hidden, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert w["fc.weight"].shape == (hidden, 2 * hidden)
    assert not w["fc.weight"][:, hidden:].any()  # the target's hidden state: unused
    assert sorted({k.split(".")[1] for k in w if k.startswith("layers.")}) == [str(i) for i in range(n)]
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in w)  # shared with the target
    assert "layers.0.input_layernorm.weight" not in w  # vLLM's EAGLE layer 0 has none
    for k, v in w.items():
        if k.startswith("layers.0.") and "layernorm" not in k:
            assert not v.any(), k


def test_the_head_drafts_what_the_draft_drafts(head, hf_folder):
    """Teacher-forced over chat prompts and their reference answers (the workloads' eval split): at the answer
    positions the head's argmax (vLLM's EAGLE forward) equals the draft's at >= 70% of them (measured 0.80 over
    430 answer tokens of four workloads; the fold is exact only where a token's residual has the spread of the norm
    weight, and the first tokens' residuals do not)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from specgrammar_plugins import workloads as W

    folder, w, draft_folder = head
    tok = AutoTokenizer.from_pretrained(str(hf_folder))
    draft = AutoModelForCausalLM.from_pretrained(str(draft_folder), dtype=torch.float32).eval()
    cfg = LlamaConfig.from_pretrained(str(folder))
    cfg._attn_implementation = "eager"
    layers = [LlamaDecoderLayer(cfg, i).eval() for i in range(cfg.num_hidden_layers)]
    for i, layer in enumerate(layers):
        own = {k.split(".", 2)[2]: v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        missing = layer.load_state_dict(own, strict=False).missing_keys
        assert missing == (["input_layernorm.weight"] if i == 0 else []), (i, missing)
    layers[0].input_layernorm = torch.nn.Identity()  # vLLM's EAGLE layer 0: no input norm
    rope = LlamaRotaryEmbedding(cfg)
    emb = draft.model.embed_tokens.weight
    agree = total = 0
    with torch.no_grad():
        for ex in W.examples("json_extraction", "eval", 3) + W.examples("tool_call", "eval", 3):
            prompt = tok(W.chat_prompt(ex.prompt), add_special_tokens=False).input_ids
            ids = torch.tensor([prompt + tok(ex.reference + W.EOS, add_special_tokens=False).input_ids])
            answer = slice(len(prompt) - 1, ids.shape[1] - 1)
            want = draft(ids).logits[0].argmax(-1)[answer]
            n = ids.shape[1]
            x = torch.cat([emb[ids[0]], torch.zeros_like(emb[ids[0]])], -1) @ w["fc.weight"].T
            x, pos = x.unsqueeze(0), torch.arange(n).unsqueeze(0)
            pe = rope(x, pos)
            mask = torch.full((n, n), float("-inf")).triu(1).view(1, 1, n, n)
            for layer in layers:
                out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
                x = out[0] if isinstance(out, tuple) else out
            got = (x[0] @ emb.T).argmax(-1)[answer]  # no final norm; the tied lm_head
            agree += int((got == want).sum())
            total += len(want)
    print(f"EAGLE head vs draft, answer positions: {agree}/{total} = {agree / total:.3f}")
    assert agree / total >= 0.7, (agree, total)
