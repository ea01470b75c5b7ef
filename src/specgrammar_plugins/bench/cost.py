"""``specgrammar bench cost``: structured output within budget, untilted vs the adaptive lambda controller (and
the budget mask, alone and with the controller).

For each structured workload, eval prompts are answered on the bundled tiny pair through the mlx-lm adapter
(speculative: forced -> model drafts, k=4) with ``max_tokens`` set below the typical answer length (``--frac`` of
the median length of the reference answers), with the plain law and with ``adaptive=True``, both with the budget
mask off (the tilt alone), then with the budget mask on (``budget.py``, the default for constrained requests),
untilted and adaptive (same prompts, same seeds).  An output counts when it is complete (the grammar finished, EOS) and valid (regex full match / JSON
Schema validation / the grammar's own acceptance).

    specgrammar bench cost [--n 20] [--frac 0.5] [--temperature 0.7] [--out-dir bench-out/cost] [--quick]

Writes ``cost.json`` and ``cost.png`` (complete-and-valid counts per workload and mode).
"""

from __future__ import annotations

import argparse
import statistics
import time

# mode -> (adaptive lambda, budget mask): the tilt alone (the budget mask off), then with the budget mask
MODES = {"untilted": (False, False), "adaptive": (True, False), "budget mask": (False, True),
         "adaptive + mask": (True, True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar bench cost", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="eval prompts per workload (default 20; quick 2)")
    ap.add_argument("--frac", type=float, default=0.5,
                    help="max_tokens = J0 + frac * (median reference length - J0), J0 = the cost model's minimum")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--workloads", nargs="*", default=None, help="default: all structured (quick: json_extraction)")
    from . import _report as R

    R.add_common_args(ap, "cost")
    a = ap.parse_args(argv)
    a.n = a.n or (2 if a.quick else 20)
    from ..workloads import STRUCTURED, chat_prompt, examples, is_valid

    a.workloads = a.workloads or (["json_extraction"] if a.quick else list(STRUCTURED))
    report = R.Report("cost", a, argv)

    from mlx_lm import load

    from specgrammar_mlx_lm.generate import generate_tokens
    from ..compiler import compile_constraint
    from ..cost import cost_model_for
    from ..models import tiny_path, tiny_tokenizer_info

    model, tok = load(str(tiny_path("target")))
    draft, _ = load(str(tiny_path("draft")))
    rows = {}
    t0 = time.perf_counter()
    for w in R.progress(a.workloads, "cost", disable=a.no_progress):
        exs = examples(w, "eval", n=a.n)
        lens = [len(tok.encode(e.reference, add_special_tokens=False)) + 1 for e in exs]
        j0 = cost_model_for(compile_constraint(exs[0].constraint, tiny_tokenizer_info())).cost_to_go([])
        budget = int(round(j0 + a.frac * (statistics.median(lens) - j0)))
        res = {}
        for mode, (adaptive, mask) in MODES.items():
            ok = 0
            lam_max = []
            for i, e in enumerate(exs):
                out, st = generate_tokens(model, tok, chat_prompt(e.prompt), max_tokens=budget, draft_model=draft,
                                          num_draft_tokens=a.k, constraint=e.constraint, temperature=a.temperature,
                                          seed=1000 + i, adaptive=adaptive, budget_mask=mask)
                text = tok.decode([t for t in out if t not in tok.eos_token_ids]) if hasattr(tok, "eos_token_ids") \
                    else tok.decode(out)
                if st.finish_reason == "stop" and is_valid(w, text):
                    ok += 1
                if st.cost:
                    lam_max.append(st.cost.get("lambda_max", 0.0))
            res[mode] = {"complete_valid": ok, "n": len(exs),
                         "lambda_max_median": statistics.median(lam_max) if lam_max else 0.0}
        rows[w] = {"budget": budget, "j0": j0, "median_reference_tokens": statistics.median(lens), **res}
        print(f"{w:16} budget {budget:3d} (J0 {j0:.0f}, median answer {statistics.median(lens):.0f}): " +
              ", ".join(f"{m} {res[m]['complete_valid']}/{len(exs)}" for m in MODES) +
              f" (median lambda_max {res['adaptive']['lambda_max_median']:.1f})", flush=True)
    tot = {m: sum(r[m]["complete_valid"] for r in rows.values()) for m in MODES}
    n = sum(r["untilted"]["n"] for r in rows.values())
    print("all: " + ", ".join(f"{m} {tot[m]}/{n} ({100 * tot[m] / n:.1f}%)" for m in MODES) +
          f"  [{time.perf_counter() - t0:.0f} s, T={a.temperature}, k={a.k}]")
    ws = list(rows)

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        R.bar_groups(ax, ws, {m: [rows[w][m]["complete_valid"] / rows[w][m]["n"] for w in ws] for m in MODES},
                     "complete and valid within max_tokens", f"T={a.temperature}, k={a.k}", hline=0.99)

    report.write({"args": {k: v for k, v in vars(a).items() if k != "out_dir"}, "rows": rows, "total": tot, "n": n},
                 plot=plot)
    return 0
