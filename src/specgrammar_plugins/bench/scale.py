"""Benchmark ``scale``: what verifying k drafts costs against decoding one token, for a memory-bound model shape.

The tiny models of this project are dominated by Python overhead, so their wall-clock says nothing about real
sizes.  This benchmark measures, on the machine at hand, one forward pass of a model with the Qwen2.5-0.5B shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151,936; about 494M parameters, fp32
about 2 GB) over 1 token and over k+1 tokens (the pending token plus k drafts) at a context of ``--context`` tokens
held in a KV cache, for k in 1, 2, 4, 8.  The weights are random: a forward pass does the same arithmetic and
memory traffic whatever the weights' values (fp32: no data-dependent kernels), so its time is the real model's.

Backends: ``mlx`` (``mlx_lm.models.qwen2``, mlx-lm's own KV cache) and ``torch`` (transformers' ``Qwen2ForCausalLM``
with a ``DynamicCache``), each when installed; ``--device cuda`` runs the torch backend on a GPU when torch sees one
(never required).  Each size is timed ``--reps`` times, the sizes interleaved within each repetition; between
passes the cache is trimmed back to the context, so every pass sees the same context length.  The ratios use the
fastest pass of each size (the least disturbed one on a shared machine); the medians are printed beside them.

Then the PROJECTION: with the rounds (target passes), drafts and draft-model passes per token measured by ``bench
strategies`` (its JSON, ``--strategies``, default ``bench-out/strategies/strategies.json`` when present; otherwise
a short measurement on the tiny pair through mlx-lm), the speedup they imply at this shape, counting everything a
round costs:

    per token, speculative  =  rounds/token x (t(k+1) + host(k))  +  draft passes/token x t_draft(1)
    per token, plain        =  t(1) + host(0)
    projected speedup       =  plain / speculative

t(n): the target's forward over n tokens (measured here); t_draft(1): one token of a draft model at
``DRAFT_SHAPE`` (half the 0.5B shape's hidden size, a quarter of its layers, same vocabulary: measured here; zero for
forced tokens and recipe packs, which draft without a model); host(k): the loop's own work per round at the real
vocabulary with k drafts (``bench overhead``'s JSON, ``--overhead``, default ``bench-out/overhead/overhead.json``,
greedy, the fast numpy backend; host(0) is plain decoding's, one mask and one argmax; 0 when absent, and said so).
It is a projection, not a measurement of a real pair.

    specgrammar bench scale [--backends mlx torch] [--context 256] [--ks 1 2 4 8] [--reps 7] [--device cpu|cuda]
                            [--strategies PATH] [--out-dir bench-out/scale] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from . import _report as R

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  max_position_embeddings=32768, tie_word_embeddings=True)
# SmolLM2-135M-Instruct, the real model of this project (models.real; its GGUF's llama.* metadata): ~135M parameters
SMOLLM2_135M = dict(arch="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True)
# a draft for it: half the hidden size, a quarter of the layers, the same vocabulary (its lm_head dominates its cost)
DRAFT_SHAPE = dict(QWEN25_05B, hidden_size=448, num_hidden_layers=6, num_attention_heads=7, num_key_value_heads=1,
                   intermediate_size=1216)


def _time_sizes(step, sizes, reps: int) -> dict:
    """{n: {"median": s, "min": s}} for each size, the sizes interleaved within each repetition (a load change
    hits every size alike)."""
    ts: dict = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            t0 = time.perf_counter()
            step(n)()
            ts[n].append(time.perf_counter() - t0)
    return {n: {"median": statistics.median(v), "min": min(v)} for n, v in ts.items()}


def measure_mlx(shape: dict, context: int, ks, reps: int, seed: int = 0) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import qwen2
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(seed)
    args = qwen2.ModelArgs(model_type="qwen2", **shape)
    model = qwen2.Model(args)
    # random weights (the default init is already random; scale them like a trained model's, in fp32)
    model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    n_params = sum(p.size for _, p in tree_flatten(model.parameters()))
    cache = make_prompt_cache(model)
    ids = mx.random.randint(0, shape["vocab_size"], (1, context + max(ks) + 1))
    mx.eval(model(ids[:, :context], cache=cache))

    def step(n):
        def f():
            out = model(ids[:, context:context + n], cache=cache)
            mx.eval(out)
            for c in cache:
                c.trim(n)
        return f

    step(1)()  # warm-up (kernels, allocator)
    times = _time_sizes(step, [1, *[k + 1 for k in ks]], reps)
    del model, cache
    gc.collect()
    return {"backend": "mlx", "device": "cpu", "params": int(n_params), "times": times}


def measure_torch(shape: dict, context: int, ks, reps: int, device: str = "cpu", seed: int = 0,
                  dtype: str = "float32") -> dict:
    """t(n) of ``shape`` (a Qwen2 config's fields; ``arch="llama"`` for a Llama one such as ``SMOLLM2_135M``) on
    ``device`` in ``dtype``, random weights."""
    import torch
    import transformers
    from transformers import DynamicCache

    torch.manual_seed(seed)
    shape = dict(shape)
    arch = shape.pop("arch", "qwen2")
    config_cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "llama": ("LlamaConfig", "LlamaForCausalLM")}[arch]
    cfg = getattr(transformers, config_cls)(**shape, torch_dtype=dtype)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg)
    model = model.to_empty(device=device).to(getattr(torch, dtype)).eval()
    model.tie_weights()  # the 0.5B model ties its output layer to the embeddings (to_empty drops the tie)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():  # rotary inverse frequencies: recompute what to_empty left empty
            if "inv_freq" in name:
                d = b.numel() * 2
                b.copy_(1.0 / (shape["rope_theta"] ** (torch.arange(0, d, 2, device=device).float() / d)))
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, shape["vocab_size"], (1, context + max(ks) + 1), device=device)
    cache = DynamicCache()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        model(ids[:, :context], past_key_values=cache, use_cache=True)

        def step(n):
            def f():
                model(ids[:, context:context + n], past_key_values=cache, use_cache=True, logits_to_keep=n)
                sync()
                cache.crop(-n)
            return f

        step(1)()
        times = _time_sizes(step, [1, *[k + 1 for k in ks]], reps)
    del model, cache
    gc.collect()
    return {"backend": "torch", "device": device, "threads": torch.get_num_threads(), "params": int(n_params),
            "times": times}


def acceptance(path: Path | None, quick: bool, show_progress: bool) -> dict:
    """{k, source, rows: [{host, workload, strategy, tokens_per_pass}]} from a strategies JSON, or measured now."""
    if path is not None and path.exists():
        doc = json.loads(path.read_text())
        hosts = [r["host"] for r in doc["rows"]]
        host = "mlx" if "mlx" in hosts else hosts[0]  # the hosts count the same passes: one host's rows suffice
        rows = [r for r in doc["rows"] if r["strategy"] != "baseline" and r["host"] == host]
        return {"k": doc["k"], "temperature": doc["temperature"], "source": str(path),
                "rows": [_acc_row(r) for r in rows]}
    from ._hosts import STRATEGIES
    from .strategies import WORKLOADS, run

    k = 4
    ws = ["json_extraction"] if quick else list(WORKLOADS)
    strategies = [STRATEGIES[s] for s in ("baseline", "recipe", "full")]
    rows = run(["mlx"], ws, strategies, 1 if quick else 3, k, 32 if quick else 64, 0.0, show_progress, "acceptance")
    return {"k": k, "temperature": 0.0, "source": "measured now (mlx, tiny pair, T=0)",
            "rows": [_acc_row(r) for r in rows if r["strategy"] != "baseline"]}


def _acc_row(r: dict) -> dict:
    """Per token: target passes (= rounds of our loop), draft-model passes (its model drafts)."""
    tokens = max(1, r["tokens"])
    model = (r.get("drafted_by_source") or {}).get("model")
    if model is None:  # a strategies JSON from before drafted_by_source: every draft of a model strategy
        model = r.get("drafted", 0) if r["strategy"] in ("blind", "aware", "full") else 0
    return {"host": r["host"], "workload": r["workload"], "strategy": r["strategy"],
            "tokens_per_pass": r["tokens_per_pass"], "rounds_per_token": r["target_passes"] / tokens,
            "draft_passes_per_token": model / tokens}


def host_ms(path: Path | None, k: int) -> tuple[float, float, str]:
    """(host ms per round with k drafts, host ms per plain round, where from), greedy, fast numpy backend, from a
    ``bench overhead`` JSON; zeros when absent."""
    if path is None or not path.exists():
        return 0.0, 0.0, "no bench overhead JSON: host work left out (0 ms)"
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("rounds") and r["mode"] == "greedy"
            and r["backend"] == "numpy"]
    if not rows:
        return 0.0, 0.0, f"{path} has no greedy numpy rows: host work left out (0 ms)"
    by_k = {r["k"]: r["host_ms"] for r in rows}
    near = min(by_k, key=lambda x: abs(x - k))
    plain = by_k.get(0, min(by_k.values()) if 1 in by_k else 0.0)
    return by_k[near], plain, f"{path} (greedy, numpy backend, k={near})"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from specgrammar_mlx_lm.blas import preloaded, reexec_with_openblas

    reexec_with_openblas("specgrammar_plugins.bench.scale", argv)
    ap = argparse.ArgumentParser(prog="specgrammar bench scale", description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=None, choices=["mlx", "torch"],
                    help="default: every one installed (quick: the first)")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, or cuda when torch sees a GPU)")
    ap.add_argument("--context", type=int, default=None, help="tokens in the KV cache (default 256; quick 128)")
    ap.add_argument("--ks", type=int, nargs="+", default=None, help="draft lengths (default 1 2 4 8; quick 1 4)")
    ap.add_argument("--reps", type=int, default=None, help="timed passes per size (default 7; quick 2)")
    ap.add_argument("--strategies", type=Path, default=Path("bench-out/strategies/strategies.json"),
                    help="a bench strategies JSON with the measured acceptance (measured now when absent)")
    ap.add_argument("--overhead", type=Path, default=Path("bench-out/overhead/overhead.json"),
                    help="a bench overhead JSON: the loop's host work per round at the real vocabulary")
    ap.add_argument("--timings", type=Path, default=None,
                    help="reuse the forward timings of an earlier scale JSON (no model is run): only the projection "
                         "is recomputed, e.g. after a new strategies run")
    R.add_common_args(ap, "scale")
    a = ap.parse_args(argv)
    context = a.context or (128 if a.quick else 256)
    ks = a.ks or ([1, 4] if a.quick else [1, 2, 4, 8])
    reps = a.reps or (2 if a.quick else 7)
    backends = a.backends or [b for b in ("mlx", "torch") if _installed(b)]
    if a.device != "cpu":
        import torch

        if not (a.device.startswith("cuda") and torch.cuda.is_available()):
            print(f"bench scale: torch sees no {a.device} device; run with --device cpu", file=sys.stderr)
            return 2
        backends = ["torch"]
    if a.quick and not a.backends:
        backends = backends[:1]
    if not backends:
        print("bench scale: neither mlx-lm nor torch+transformers is installed", file=sys.stderr)
        return 2
    rep = R.Report("scale", a, argv)
    results = []
    if a.timings is not None:  # an earlier run's timings: {"1": {"median", "min"}, ...} per backend
        prev = json.loads(a.timings.read_text())
        context, ks, reps = prev["context"], prev["ks"], prev["reps"]
        backends = []
        for m in prev["results"]:
            m["times"] = {int(n): v for n, v in m["times"].items()}
            results.append(m)
    for b in R.progress(backends, "scale", disable=a.no_progress):
        m = measure_mlx(QWEN25_05B, context, ks, reps) if b == "mlx" else \
            measure_torch(QWEN25_05B, context, ks, reps, a.device)
        d = measure_mlx(DRAFT_SHAPE, context, [1], reps) if b == "mlx" else \
            measure_torch(DRAFT_SHAPE, context, [1], reps, a.device)
        m["draft"] = {"params": d["params"], "t1_ms": 1e3 * d["times"][1]["min"]}
        results.append(m)
    for m in results:
        t = {n: v["min"] for n, v in m["times"].items()}
        m["rows"] = [{"k": k, "t1_ms": 1e3 * t[1], "tk1_ms": 1e3 * t[k + 1], "cost_ratio": t[k + 1] / t[1],
                      "t1_median_ms": 1e3 * m["times"][1]["median"],
                      "tk1_median_ms": 1e3 * m["times"][k + 1]["median"]} for k in ks]
    acc = acceptance(a.strategies, a.quick, not a.no_progress)
    kk = acc["k"]
    h_k, h_0, h_src = host_ms(a.overhead, kk)
    proj = []
    for m in results:
        t = {n: v["min"] for n, v in m["times"].items()}
        t1 = t[1]
        tk = t.get(kk + 1)
        if tk is None:  # the measured k is not among --ks (timing it would cost another model load): interpolate
            tk = _interpolate(t, kk + 1)
        td = (m.get("draft") or {}).get("t1_ms", 0.0)
        for r in acc["rows"]:
            spec = r["rounds_per_token"] * (1e3 * tk + h_k) + r["draft_passes_per_token"] * td
            plain = 1e3 * t1 + h_0
            proj.append({"backend": m["backend"], "device": m["device"], **r, "k": kk,
                         "t1_ms": 1e3 * t1, "tk1_ms": 1e3 * tk, "draft_t1_ms": td, "host_ms": h_k, "host0_ms": h_0,
                         "ms_per_token": spec, "plain_ms_per_token": plain,
                         "projected_speedup": plain / spec,
                         "passes_only_speedup": r["tokens_per_pass"] * t1 / tk})
    print(f"\nbench scale: Qwen2.5-0.5B shape (hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 151,936), "
          f"fp32, random weights, context {context}, {reps} interleaved repetitions per size: fastest (median), "
          f"BLAS: {preloaded()}\n")
    print(R.md_table(["backend", "device", "params", "k", "t(1) ms", "t(k+1) ms", "t(k+1)/t(1)"],
                     [[m["backend"], m["device"], f"{m['params'] / 1e6:.0f}M", r["k"],
                       f"{r['t1_ms']:.0f} ({r['t1_median_ms']:.0f})", f"{r['tk1_ms']:.0f} ({r['tk1_median_ms']:.0f})",
                       f"{r['cost_ratio']:.2f}"] for m in results for r in m["rows"]], right=range(2, 7)))
    for m in results:
        if m.get("draft"):
            print(f"draft shape for the projection ({m['backend']}): {m['draft']['params'] / 1e6:.0f}M parameters, "
                  f"t_draft(1) = {m['draft']['t1_ms']:.1f} ms")
    print(f"\nPROJECTION (not a measurement): per token, rounds x (t(k+1) + host) + draft passes x t_draft(1) "
          f"against t(1) + host(0), with rounds and draft passes per token from {acc['source']} (k={kk}, "
          f"T={acc['temperature']:g}); host work per round from {h_src}: {h_k:.2f} ms (plain {h_0:.2f} ms).  "
          "'passes only' is the old figure, tokens per pass x t(1)/t(k+1), which counts none of that.\n")
    backs = [f"{m['backend']} ({m['device']})" for m in results]
    get = {(p["workload"], p["strategy"], f"{p['backend']} ({p['device']})"): p for p in proj}
    keys = list(dict.fromkeys((p["workload"], p["strategy"]) for p in proj))
    print(R.md_table(["workload", "strategy", "tokens / target pass", "draft passes / token",
                      *[f"PROJECTED speedup, {b} (passes only)" for b in backs]],
                     [[w, s, f"{get[w, s, backs[0]]['tokens_per_pass']:.2f}",
                       f"{get[w, s, backs[0]]['draft_passes_per_token']:.2f}",
                       *[f"{get[w, s, b]['projected_speedup']:.2f}x ({get[w, s, b]['passes_only_speedup']:.2f}x)"
                         for b in backs]] for w, s in keys],
                     right=range(2, 4 + len(backs))))
    print(f"\n{time.perf_counter() - rep.t0:.0f}s; command: specgrammar bench scale {' '.join(argv)}")
    for m in results:
        m["times"] = {str(n): v for n, v in m["times"].items()}
    rep.write({"shape": QWEN25_05B, "draft_shape": DRAFT_SHAPE, "host_from": h_src, "dtype": "float32", "weights": "random (forward cost does not depend on them)",
               "context": context, "ks": ks, "reps": reps, "blas": preloaded(), "results": results,
               "timings_from": str(a.timings) if a.timings else None,
               "acceptance": acc, "projection": proj,
               "versions": R.versions("mlx", "mlx-lm", "torch", "transformers")}, plot=_plot(results, proj))
    return 0


def _interpolate(times: dict, n: int) -> float:
    xs = sorted(times)
    lo = max([x for x in xs if x <= n], default=xs[0])
    hi = min([x for x in xs if x >= n], default=xs[-1])
    if hi == lo:
        return times[lo]
    return times[lo] + (times[hi] - times[lo]) * (n - lo) / (hi - lo)


def _installed(backend: str) -> bool:
    import importlib.util

    mods = ("mlx_lm",) if backend == "mlx" else ("torch", "transformers")
    return all(importlib.util.find_spec(m) is not None for m in mods)


def _plot(results, proj):
    def draw(fig):
        ax = fig.add_subplot(1, 2, 1)
        for m in results:
            ks = [r["k"] for r in m["rows"]]
            ax.plot(ks, [r["cost_ratio"] for r in m["rows"]], "o-", label=f"{m['backend']} ({m['device']})")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("k (draft tokens verified)")
        ax.set_ylabel("t(k+1) / t(1)")
        ax.set_title("cost of verifying k drafts vs decoding 1\nQwen2.5-0.5B shape, fp32", fontsize=10)
        ax.legend(fontsize=7)
        ax = fig.add_subplot(1, 2, 2)
        strat = list(dict.fromkeys(p["strategy"] for p in proj))
        ws = list(dict.fromkeys(p["workload"] for p in proj))
        first = results[0]["backend"] if results else None
        get = {(p["workload"], p["strategy"]): p["projected_speedup"] for p in proj
               if p["backend"] == first and p["host"] == proj[0]["host"]}
        R.bar_groups(ax, ws, {s: [get.get((w, s)) for w in ws] for s in strat}, "speedup (PROJECTION)",
                     f"PROJECTED speedup at this shape ({first})", hline=1.0)
    return draw


if __name__ == "__main__":
    sys.exit(main())
