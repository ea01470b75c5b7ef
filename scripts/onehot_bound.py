"""How far could drafting go at T > 0 on the real model?  (issue 32: the T = 0.7 gap)

Reads a ``specgrammar bench real --host mlx_lm`` result (its ``outputs``), teacher-forces SmolLM2-135M and its draft
model over each answer (the bench's own requests, the model's chat template) under the request's grammar mask, and
at each answer position takes the target law q at the run's temperature:

- ``q_max`` = max_x q(x): the acceptance of the best one-hot draft there (the target's own most likely token), an
  upper bound for every one-hot source (recipe, layout, prompt copy, suffix, forced jump-forward);
- ``overlap`` = sum_x min(r(x), q(x)): the acceptance of the draft model's own sampled draft r;
- ``q(argmax r)``: the acceptance of the draft model's most likely token drafted one-hot (exact too: a one-hot
  draft is accepted with q(x), and a rejection draws from q without x);
- ``max(q_max, overlap)``: an oracle that picks, at every position, the better of the two (the target's own most
  likely token one-hot, or the draft model's sampled draft): a bound for every chain of these sources with this
  draft model.

Tokens per target pass along each realised answer with k drafts per pass (Monte Carlo: each position accepted with
that probability, in order; a pass ends at the first rejection or after k, and commits one more token), averaged per
workload.  An approximation (the realised path stands for every path), not a bench figure.

    specgrammar bench real --host mlx_lm --n 3 --schemas 0 --temperatures 0.7 --configs full --out-dir bench-out/t07
    python scripts/onehot_bound.py bench-out/t07/real-mlx_lm.json --config full
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def tokens_per_pass(acc: list[float], k: int, rng: np.random.Generator, reps: int = 400) -> float:
    tokens = passes = 0
    for _ in range(reps):
        i = 0
        while i < len(acc):
            j = 0
            while j < k and i + j < len(acc) - 1 and rng.random() < acc[i + j]:
                j += 1
            i += j + 1
            tokens += j + 1
            passes += 1
    return tokens / passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="real-mlx_lm.json of specgrammar bench real --host mlx_lm")
    ap.add_argument("--config", default="full")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=4)
    a = ap.parse_args()

    import mlx.core as mx

    from specgrammar_mlx_lm.processor import compile_for
    from specgrammar_plugins.bench.real import MODEL_FREE, requests
    from specgrammar_plugins.bench.real_hosts import MLXReal
    from specgrammar_plugins.distributions import SamplingParams, log_law
    from specgrammar_plugins.masks import mask_allows, new_mask

    doc = json.load(open(a.result))
    outs = doc["outputs"][a.config][str(a.temperature)]
    reqs, _ = requests(doc["args"]["n"], doc["args"]["schemas"], doc["args"]["seed"])
    host = MLXReal(MODEL_FREE)
    eos = min(host.stops)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=a.temperature)  # the target's and the draft's law under the request's mask
    by: dict[str, tuple[list[float], list[float], list[float], list[float]]] = {}
    all_q: list[float] = []
    all_ov: list[float] = []
    all_top: list[float] = []
    for req, text in zip(reqs, outs):
        if text is None:
            continue
        ids = host.ids(req["messages"])
        out = list(host.tok.encode(text, add_special_tokens=False)) + [eos]
        seq = mx.array(ids + out)[None]
        zt = np.array(host.model(seq)[0, len(ids) - 1:-1].astype(mx.float32))
        zd = np.array(host.draft(seq)[0, len(ids) - 1:-1].astype(mx.float32))
        m = compile_for(req["spec"], host.tok, zt.shape[-1]).matcher()
        row = new_mask(zt.shape[-1])
        q_max: list[float] = []
        overlap: list[float] = []
        top: list[float] = []
        for i, t in enumerate(out):
            if m.is_terminated():
                break
            m.fill_mask(row)
            if not mask_allows(row, t):  # the text tokenizes otherwise than the answer was generated: leave it out
                q_max = []
                break
            q, r = np.exp(log_law(zt[i], row, params)), np.exp(log_law(zd[i], row, params))
            q_max.append(float(q.max()))
            overlap.append(float(np.minimum(q, r).sum()))
            top.append(float(q[int(np.argmax(r))]))
            m.accept(int(t))
        if not q_max:
            print(f"left out: {req['group']} {text[:40]!r}")
            continue
        best = [max(x, y) for x, y in zip(q_max, overlap)]
        g = by.setdefault(req["group"], ([], [], [], []))
        g[0].append(tokens_per_pass(q_max, a.k, rng))
        g[1].append(tokens_per_pass(overlap, a.k, rng))
        g[2].append(tokens_per_pass(top, a.k, rng))
        g[3].append(tokens_per_pass(best, a.k, rng))
        all_q += q_max
        all_ov += overlap
        all_top += top
    for g, (one_hot, model, model_top, both) in by.items():
        print(f"{g:16s} best one-hot {np.mean(one_hot):.2f}   draft model's sampled draft {np.mean(model):.2f}"
              f"   its argmax one-hot {np.mean(model_top):.2f}   the better of the two at each position "
              f"{np.mean(both):.2f}   ({len(one_hot)} answers)")
    means = [np.mean([np.mean(g[j]) for g in by.values()]) for j in range(4)]
    print(f"mean of the groups: best one-hot {means[0]:.2f}, draft model {means[1]:.2f}, its argmax one-hot "
          f"{means[2]:.2f}, the better of the two {means[3]:.2f}; per position: mean q_max {np.mean(all_q):.2f}, "
          f"mean sum min(r, q) {np.mean(all_ov):.2f}, mean q(argmax r) {np.mean(all_top):.2f}, mean of the better "
          f"{np.mean(np.maximum(all_q, all_ov)):.2f} over {len(all_q)} positions")


if __name__ == "__main__":
    main()
