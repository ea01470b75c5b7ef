"""The bundled tiny model family: a byte-level BPE tokenizer, a ~2.4M-parameter Llama target (2 layers) and a ~0.5M draft,
trained on the workload suite (``specgrammar_plugins.workloads``) by ``scripts/build_models.py``.

Layout of ``models/tiny/``::

    tokenizer.json, tokenizer_config.json, special_tokens_map.json   the shared tokenizer (ChatML, eos <|im_end|>)
    target/, draft/     transformers folders (config.json with rope_theta, model.safetensors fp32, tokenizer files)
    target.gguf, draft.gguf   the same weights for llama.cpp (llama arch, gpt2 BPE vocab)
    metrics.json        what the build measured (params, training time, validity, exact match, draft agreement)
"""

from __future__ import annotations

from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent / "tiny"
# a Llama decoder layer's tensors: transformers' name (after ``model.layers.{i}.``) -> llama.cpp's (after
# ``blk.{i}.``); scripts/build_models.py and models.real_draft write GGUFs with it
GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
WHICH = ("target", "draft")


def _check(which: str) -> str:
    if which not in WHICH:
        raise ValueError(f"which must be 'target' or 'draft', got {which!r}")
    return which


def tiny_path(which: str = "target") -> Path:
    """The transformers / mlx-lm / vLLM folder of the tiny target or draft."""
    return TINY_DIR / _check(which)


def tiny_gguf(which: str = "target") -> Path:
    """The GGUF file of the tiny target or draft (for llama.cpp)."""
    return TINY_DIR / f"{_check(which)}.gguf"


def tiny_tokenizer_info(vocab_size: int | None = None):
    """``TokenizerInfo`` of the tiny models' tokenizer (masks padded to ``vocab_size``, default: the models' width)."""
    from ..tokenizer import TokenizerInfo

    return TokenizerInfo.from_file(TINY_DIR, vocab_size=vocab_size, name="tiny")


def tiny_metrics() -> dict:
    """What ``scripts/build_models.py`` measured when it built the committed models."""
    import json

    return json.loads((TINY_DIR / "metrics.json").read_text())


__all__ = ["GGUF_LAYER", "TINY_DIR", "tiny_gguf", "tiny_metrics", "tiny_path", "tiny_tokenizer_info"]
