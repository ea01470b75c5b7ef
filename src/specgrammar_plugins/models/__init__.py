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


__all__ = ["TINY_DIR", "tiny_gguf", "tiny_metrics", "tiny_path", "tiny_tokenizer_info"]
