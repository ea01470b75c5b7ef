"""An EAGLE head for the real model (SmolLM2-135M-Instruct), in the format vLLM 0.32 loads for ``method="eagle"``
on a Llama target (``vllm/model_executor/models/llama_eagle.py``: ``EagleLlamaForCausalLM``): ``smollm2-135m-eagle``.

vLLM's EAGLE-1 Llama head computes, at each position, from the next token's embedding e and the target's (final,
normed) hidden state h::

    x = fc([e, h])                      fc: [H, 2H], no bias
    x = layer_0(x), ..., layer_{n-1}    Llama decoder layers; layer 0 has no input norm
    logits = lm_head(x)                 the target's lm_head (no checkpoint lm_head: vLLM shares it); no final norm

The head here is the project's draft model (``models.real_draft``: the target's own layers 0-3, distilled on the
target's constrained outputs, committed as ``smollm2_draft/layers.safetensors``) written in that form, with no
training and no random weight:

- ``layers.0`` is a null layer (every projection zero, its post-attention norm ones): its attention and MLP add
  nothing, so the draft's first layer (``layers.1``) keeps its own input norm, exactly;
- vLLM's head has no final norm (``hidden + residual`` goes to the lm_head), so the draft's final norm weight w
  is folded in by a change of basis of the residual stream, x' = w * x: ``fc`` = [diag(w), 0] (the embedding,
  scaled; the target's hidden state unused), every ``o_proj`` and ``down_proj`` row scaled by w, and every layer
  norm weight g by c / w, c = rms(w).  Then lm_head(x') = lm_head(w * x), the draft's logits up to a positive
  factor per row (same argmax) wherever rms(w * x) = c * rms(x); elsewhere the layer norms see their input off
  by that scalar.  Measured on 430 answer tokens of four workloads (teacher forced, argmax agreement with the
  target): the draft 0.481, this head 0.472, the head without the fold (no final norm) 0.186; the head's argmax is
  the draft's at 0.802 of them (c = 0.8 rms(w): 0.719).

So the target's hidden states reach the head through vLLM's EAGLE path (and ``Step.hidden``) but this head does
not read them (the fc's second half is zero): it drafts as the draft model does, through vLLM's EAGLE proposer,
KV cache and attention metadata.  A head trained on the hidden states would read them.

``smollm2_eagle_folder()`` (or ``python -m specgrammar_plugins.models.real_eagle``) builds the folder once into
``models.real.cache_dir()`` (atomically; named with a hash of the committed draft weights and ``VERSION``) in a few
seconds, deterministically; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from .real import SMOLLM2, cache_dir
from .real_draft import _atomic_dir, _committed, _weights_hash

EAGLE = "smollm2-135m-eagle"
VERSION = 1  # bump when the folder this writes changes
PROJ_ROWS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # write into the residual stream: rows scaled by w
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
NULL_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def eagle_tensors(committed: dict, hidden: int) -> dict:
    """The head's tensors (vLLM's EAGLE checkpoint names: ``fc.weight``, ``layers.{i}.*``) from the draft's
    (``model.layers.{i}.*``, ``model.norm.weight``; float32 numpy)."""
    import numpy as np

    w = committed["model.norm.weight"].astype(np.float32)
    c = float(np.sqrt(np.mean(w * w)))
    out = {"fc.weight": np.concatenate([np.diag(w), np.zeros((hidden, hidden), np.float32)], axis=1)}
    shapes = {k.split(".", 3)[3]: v.shape for k, v in committed.items() if k.startswith("model.layers.0.")}
    for name in NULL_LAYER:
        out[f"layers.0.{name}"] = np.zeros(shapes[name], np.float32)
    out["layers.0.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    for k, v in committed.items():
        if not k.startswith("model.layers."):
            continue
        _, _, i, name = k.split(".", 3)
        if name in PROJ_ROWS:
            v = v * w[:, None]
        elif name in NORMS:
            v = v * (c / w)
        out[f"layers.{int(i) + 1}.{name}"] = np.ascontiguousarray(v, dtype=np.float32)
    return out


def smollm2_eagle_folder() -> Path:
    """The EAGLE head's folder (``config.json``, ``model.safetensors``), built once into ``cache_dir()``."""
    final = cache_dir() / f"{EAGLE}-{_weights_hash()}-v{VERSION}"
    if (final / "model.safetensors").is_file():
        return final

    def build(tmp: Path) -> None:
        from safetensors.numpy import save_file

        committed, cfg = _committed()
        tensors = eagle_tensors(committed, int(cfg["hidden_size"]))
        n = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("layers."))
        cfg = {**cfg, "num_hidden_layers": n, "specgrammar": {
            **cfg["specgrammar"], "name": EAGLE, "eagle_of": SMOLLM2, "version": VERSION,
            "layers": "0: null; 1..: the draft's, the final norm folded in (models/real_eagle.py)"}}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    return _atomic_dir(final, build)


__all__ = ["EAGLE", "VERSION", "eagle_tensors", "smollm2_eagle_folder"]


if __name__ == "__main__":  # python -m specgrammar_plugins.models.real_eagle: build (or find) it, print its folder
    print(smollm2_eagle_folder())
