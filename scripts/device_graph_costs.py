"""Forward costs t(B, n) with CUDA graphs: what a serving engine (vLLM, SGLang) pays per target pass, where eager
PyTorch pays kernel launches.

    python scripts/device_graph_costs.py --device cuda --out graphs.json
    python scripts/device_graph_costs.py --check        # on this CPU: the forward below == transformers' Llama

A Llama decoder written out in PyTorch (RMSNorm, rotary, grouped-query attention over a preallocated KV cache, SwiGLU,
tied lm_head), the shape of SmolLM2-135M-Instruct (``bench.scale.SMOLLM2_135M``) and of a 4-layer draft of it, with
**random weights** (a forward pass does the same arithmetic and memory traffic whatever the weights: timing only,
never outputs).  ``--check`` holds it against transformers' ``LlamaForCausalLM`` with the same weights (the logits of
n new tokens after a prefix), so the timed function is the model's.  For each batch B and n new tokens per row (a
target pass verifying k = n - 1 drafts) the whole forward, logits of every row included, is captured once as a CUDA
graph at a context of ``--context`` tokens and replayed; times are CUDA-event times, the fastest and the median of
``--reps`` replays.  ``--eager`` times the same forward without graphs beside it.  A speed-up worked out from these
figures is a projection and is labelled as one wherever it is quoted (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specgrammar_plugins.bench.scale import QWEN25_05B, SMOLLM2_135M  # noqa: E402

# Qwen2.5-7B's shape (its config.json): where a forward pass is bound by reading the weights, the regime of the
# field's speculative-decoding figures (../shared/notes/anchors.md)
QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 tie_word_embeddings=False, qkv_bias=True)


def build(shape: dict, dtype, device: str, seed: int = 0) -> dict:
    """Random weights of ``shape`` (N(0, 0.02)), norms at 1, as a dict of tensors."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, L = shape["hidden_size"], shape["num_hidden_layers"]
    nh, nkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // nh

    def rnd(*s):
        return (torch.randn(*s, generator=g, device=device, dtype=dtype) * 0.02)

    w = {"embed": rnd(shape["vocab_size"], h), "norm": torch.ones(h, device=device, dtype=dtype), "layers": []}
    w["lm_head"] = w["embed"] if shape.get("tie_word_embeddings", True) else rnd(shape["vocab_size"], h)
    for _ in range(L):
        lw = {"ln1": torch.ones(h, device=device, dtype=dtype), "ln2": torch.ones(h, device=device, dtype=dtype),
              "q": rnd(nh * d, h), "k": rnd(nkv * d, h), "v": rnd(nkv * d, h), "o": rnd(h, nh * d),
              "gate": rnd(shape["intermediate_size"], h), "up": rnd(shape["intermediate_size"], h),
              "down": rnd(h, shape["intermediate_size"])}
        if shape.get("qkv_bias"):
            lw.update(qb=rnd(nh * d), kb=rnd(nkv * d), vb=rnd(nkv * d))
        w["layers"].append(lw)
    return w


def rotary(shape: dict, positions, device: str, dtype):
    """cos, sin [n, d] of the positions (the Llama rotary embedding, halves rotated)."""
    import torch

    d = shape["hidden_size"] // shape["num_attention_heads"]
    inv = 1.0 / (shape["rope_theta"] ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    f = positions.to(torch.float32)[:, None] * inv[None, :]
    e = torch.cat([f, f], dim=-1)
    return e.cos().to(dtype), e.sin().to(dtype)


def forward(shape: dict, w: dict, ids, kc, vc, pos0: int, cos, sin, mask):
    """Logits [B, n, V] of ids [B, n] at positions pos0..pos0+n-1, writing their keys and values into the caches
    kc, vc [L, B, Hkv, T, d]; ``mask`` [n, T] says which cache positions each new token sees."""
    import torch
    import torch.nn.functional as F

    B, n = ids.shape
    h, nh, nkv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    d, eps = h // nh, shape["rms_norm_eps"]

    def rms(x, g):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * g

    def rot(x):  # x [B, H, n, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    x = w["embed"][ids]
    for li, lw in enumerate(w["layers"]):
        a = rms(x, lw["ln1"])
        q = F.linear(a, lw["q"], lw.get("qb")).view(B, n, nh, d).transpose(1, 2)
        k = F.linear(a, lw["k"], lw.get("kb")).view(B, n, nkv, d).transpose(1, 2)
        v = F.linear(a, lw["v"], lw.get("vb")).view(B, n, nkv, d).transpose(1, 2)
        q, k = rot(q), rot(k)
        kc[li, :, :, pos0:pos0 + n] = k
        vc[li, :, :, pos0:pos0 + n] = v
        o = F.scaled_dot_product_attention(q, kc[li], vc[li], attn_mask=mask, scale=1.0 / math.sqrt(d),
                                           enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(B, n, nh * d), lw["o"])
        m = rms(x, lw["ln2"])
        x = x + F.linear(F.silu(F.linear(m, lw["gate"])) * F.linear(m, lw["up"]), lw["down"])
    return F.linear(rms(x, w["norm"]), w["lm_head"])


class Pass:
    """One (shape, B, n) forward with its static inputs, caches and mask, at context ``context``."""

    def __init__(self, shape, w, B, n, context, device, dtype):
        import torch

        L, nkv = shape["num_hidden_layers"], shape["num_key_value_heads"]
        d = shape["hidden_size"] // shape["num_attention_heads"]
        T = context + n
        self.shape, self.w, self.context = shape, w, context
        self.ids = torch.randint(0, shape["vocab_size"], (B, n), device=device)
        # the cache of the context (random keys and values: the attention reads them whatever they hold)
        self.kc = torch.randn(L, B, nkv, T, d, device=device, dtype=dtype)
        self.vc = torch.randn(L, B, nkv, T, d, device=device, dtype=dtype)
        pos = torch.arange(context, context + n, device=device)
        self.cos, self.sin = rotary(shape, pos, device, dtype)
        self.mask = torch.arange(T, device=device)[None, :] <= pos[:, None]

    def __call__(self):
        return forward(self.shape, self.w, self.ids, self.kc, self.vc, self.context, self.cos, self.sin, self.mask)


def time_pass(p: Pass, reps: int, graphs: bool) -> dict:
    """{"min": ms, "median": ms} of ``reps`` runs of the pass (a CUDA graph replay, or eager), CUDA-event timed."""
    import torch

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                p()
        torch.cuda.current_stream().wait_stream(s)
        run = p
        if graphs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                p()
            run = g.replay
        for _ in range(3):
            run()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
    ts.sort()
    return {"min": ts[0], "median": ts[len(ts) // 2]}


def check(n: int = 5, context: int = 12) -> float:
    """The largest difference between this forward's logits and transformers' LlamaForCausalLM's with the same
    weights (float32, CPU, a smaller SmolLM2-shaped model), for n new tokens after a prefix of ``context``."""
    import torch
    import transformers

    shape = dict(SMOLLM2_135M, num_hidden_layers=2, vocab_size=512)
    shape.pop("arch")
    w = build(shape, torch.float32, "cpu", seed=1)
    cfg = transformers.LlamaConfig(**shape)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    sd = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"], "lm_head.weight": w["lm_head"]}
    for i, lw in enumerate(w["layers"]):
        pre = f"model.layers.{i}."
        sd.update({pre + "input_layernorm.weight": lw["ln1"], pre + "post_attention_layernorm.weight": lw["ln2"],
                   pre + "self_attn.q_proj.weight": lw["q"], pre + "self_attn.k_proj.weight": lw["k"],
                   pre + "self_attn.v_proj.weight": lw["v"], pre + "self_attn.o_proj.weight": lw["o"],
                   pre + "mlp.gate_proj.weight": lw["gate"], pre + "mlp.up_proj.weight": lw["up"],
                   pre + "mlp.down_proj.weight": lw["down"]})
    hf.load_state_dict(sd, strict=False)
    ids = torch.randint(0, shape["vocab_size"], (2, context + n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids).logits[:, context:]
        L, nkv = shape["num_hidden_layers"], shape["num_key_value_heads"]
        d = shape["hidden_size"] // shape["num_attention_heads"]
        kc = torch.zeros(L, 2, nkv, context + n, d)
        vc = torch.zeros(L, 2, nkv, context + n, d)
        T = context + n
        pre = torch.arange(context)
        c0, s0 = rotary(shape, pre, "cpu", torch.float32)
        forward(shape, w, ids[:, :context], kc, vc, 0, c0, s0,
                torch.arange(T)[None, :] <= pre[:, None])
        pos = torch.arange(context, T)
        c1, s1 = rotary(shape, pos, "cpu", torch.float32)
        got = forward(shape, w, ids[:, context:], kc, vc, context, c1, s1, torch.arange(T)[None, :] <= pos[:, None])
    return float((got - want).abs().max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 13, 32])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17])
    ap.add_argument("--eager", action="store_true", help="also time the same forward without CUDA graphs")
    ap.add_argument("--big", action="store_true", help="also the Qwen2.5-0.5B and Qwen2.5-7B shapes (B <= 8)")
    ap.add_argument("--check", action="store_true", help="hold the forward against transformers on this CPU, exit")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.check:
        diff = check()
        print(f"max |logits - transformers LlamaForCausalLM| = {diff:.2e}")
        return 0 if diff < 1e-4 else 1
    import torch

    dtype = getattr(torch, a.dtype)
    small = {k: v for k, v in SMOLLM2_135M.items() if k != "arch"}
    shapes = [("smollm2-135m", small, a.batches), ("smollm2-135m-4-layers", dict(small, num_hidden_layers=4),
                                                     a.batches)]
    if a.big:
        shapes += [("qwen2.5-0.5b", dict(QWEN25_05B, qkv_bias=True), [b for b in a.batches if b <= 8]),
                   ("qwen2.5-7b", QWEN25_7B, [b for b in a.batches if b <= 8])]
    info = {"device": a.device, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "dtype": a.dtype, "context": a.context, "reps": a.reps, "runs": []}
    for name, shape, batches in shapes:
        t0 = time.perf_counter()
        w = build(shape, dtype, a.device)
        for B in batches:
            row = {"shape": name, "B": B, "graph_ms": {}, "eager_ms": {}}
            for n in a.ns:
                p = Pass(shape, w, B, n, a.context, a.device, dtype)
                row["graph_ms"][n] = time_pass(p, a.reps, graphs=True)
                if a.eager:
                    row["eager_ms"][n] = time_pass(p, max(10, a.reps // 5), graphs=False)
                del p
            info["runs"].append(row)
            t1 = row["graph_ms"][a.ns[0]]["min"]
            print(f"{name} B={B}: " + ", ".join(
                f"t({n}) {row['graph_ms'][n]['min']:.3f} ms ({row['graph_ms'][n]['min'] / t1:.2f}x)"
                + (f" eager {row['eager_ms'][n]['min']:.2f}" if a.eager else "") for n in a.ns)
                + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        del w
        torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
