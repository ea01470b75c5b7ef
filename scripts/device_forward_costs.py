"""Forward costs t(n) of the real model's shape on an accelerator (or this CPU): the figures that turn tokens per
target pass into a speed-up where a forward pass is memory- or launch-bound.

    python scripts/device_forward_costs.py --device cuda --out forward.json [--dtypes bfloat16 float32]

For SmolLM2-135M (``bench.scale.SMOLLM2_135M``, random weights: a forward pass does the same arithmetic and memory
traffic whatever the weights, so its time is the real model's; never used for outputs) it times t(n), n = 1..17,
at a context of 256 tokens held in transformers' KV cache (eager PyTorch, no CUDA graphs), and t(1) of
layer-truncated drafts of the same shape (2, 4 and 6 of its 30 layers, the same embeddings and lm_head), and prints
the cost ratios t(n) / t(1).  ``--qwen`` adds the Qwen2.5-0.5B shape.  A projection of a speed-up from these
figures is labelled as one wherever it is quoted (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specgrammar_plugins.bench.scale import QWEN25_05B, SMOLLM2_135M, measure_torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-n", type=int, default=17)
    ap.add_argument("--draft-layers", type=int, nargs="*", default=[2, 4, 6])
    ap.add_argument("--qwen", action="store_true", help="also the Qwen2.5-0.5B shape")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch

    info = {"device": a.device, "torch": torch.__version__, "context": a.context, "reps": a.reps,
            "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None, "runs": []}
    ks = list(range(1, a.max_n))  # sizes 1 .. max_n
    shapes = [("smollm2-135m", SMOLLM2_135M)] + ([("qwen2.5-0.5b", QWEN25_05B)] if a.qwen else [])
    for dtype in a.dtypes:
        for name, shape in shapes:
            t0 = time.perf_counter()
            m = measure_torch(shape, a.context, ks, a.reps, a.device, dtype=dtype)
            t = {n: 1e3 * v["min"] for n, v in m["times"].items()}
            med = {n: 1e3 * v["median"] for n, v in m["times"].items()}
            info["runs"].append({"shape": name, "dtype": dtype, "params": m["params"], "t_min_ms": t,
                                 "t_median_ms": med})
            print(f"{name} {dtype} ({m['params'] / 1e6:.1f}M params, {time.perf_counter() - t0:.0f} s): "
                  + ", ".join(f"t({n}) {t[n]:.2f} ms ({t[n] / t[1]:.2f}x)" for n in sorted(t)), flush=True)
        for layers in a.draft_layers:
            m = measure_torch(dict(SMOLLM2_135M, num_hidden_layers=layers), a.context, [1], a.reps, a.device,
                              dtype=dtype)
            t = {n: 1e3 * v["min"] for n, v in m["times"].items()}
            info["runs"].append({"shape": f"smollm2-135m-{layers}-layers", "dtype": dtype, "params": m["params"],
                                 "t_min_ms": t, "t_median_ms": {n: 1e3 * v["median"] for n, v in m["times"].items()}})
            print(f"smollm2-135m, {layers} layers {dtype}: t(1) {t[1]:.2f} ms, t(2) {t[2]:.2f} ms", flush=True)
    if a.out:
        a.out.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
