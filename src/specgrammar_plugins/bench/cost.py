"""``specgrammar bench cost``: structured output within budget, untilted vs the adaptive lambda controller.

For each structured workload, eval prompts are answered on the bundled tiny pair through the mlx-lm adapter
(speculative: forced -> model drafts, k=4) with ``max_tokens`` set below the typical answer length (``--frac`` of
the median length of the reference answers), once with the plain law and once with ``adaptive=True`` (same prompts,
same seeds).  An output counts when it is complete (the grammar finished, EOS) and valid (regex full match / JSON
Schema validation / the grammar's own acceptance).

    specgrammar bench cost [--n 20] [--frac 0.7] [--temperature 0.7] [--out bench-out/cost.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

STRUCTURED = ("json_extraction", "tool_call", "sql", "email", "order_id", "year")


def _valid(spec, text: str) -> bool:
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if spec.kind == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text, strict=False), spec.schema)
            return True
        except Exception:
            return False
    return True  # GBNF: a finished matcher is the grammar's acceptance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar bench cost", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="eval prompts per workload")
    ap.add_argument("--frac", type=float, default=0.5,
                    help="max_tokens = J0 + frac * (median reference length - J0), J0 = the cost model's minimum")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--workloads", nargs="*", default=list(STRUCTURED))
    ap.add_argument("--out", default="bench-out/cost.json")
    a = ap.parse_args(argv)

    from mlx_lm import load

    from ..adapters.mlx_lm.generate import generate_tokens
    from ..models import tiny_path
    from ..workloads import chat_prompt, examples

    model, tok = load(str(tiny_path("target")))
    draft, _ = load(str(tiny_path("draft")))
    rows = {}
    t0 = time.perf_counter()
    for w in a.workloads:
        exs = examples(w, "eval", n=a.n)
        lens = [len(tok.encode(e.reference, add_special_tokens=False)) + 1 for e in exs]
        from ..constraint import compile_constraint
        from ..cost import cost_model_for
        from ..models import tiny_tokenizer_info

        j0 = cost_model_for(compile_constraint(exs[0].constraint, tiny_tokenizer_info())).cost_to_go([])
        budget = int(round(j0 + a.frac * (statistics.median(lens) - j0)))
        res = {}
        for mode in ("untilted", "adaptive"):
            ok = 0
            lam_max = []
            for i, e in enumerate(exs):
                out, st = generate_tokens(model, tok, chat_prompt(e.prompt), max_tokens=budget, draft_model=draft,
                                          num_draft_tokens=a.k, constraint=e.constraint, temperature=a.temperature,
                                          seed=1000 + i, adaptive=(mode == "adaptive"))
                text = tok.decode([t for t in out if t not in tok.eos_token_ids]) if hasattr(tok, "eos_token_ids") \
                    else tok.decode(out)
                if st.finish_reason == "stop" and _valid(e.constraint, text):
                    ok += 1
                if st.cost:
                    lam_max.append(st.cost.get("lambda_max", 0.0))
            res[mode] = {"complete_valid": ok, "n": len(exs),
                         "lambda_max_median": statistics.median(lam_max) if lam_max else 0.0}
        rows[w] = {"budget": budget, "j0": j0, "median_reference_tokens": statistics.median(lens), **res}
        print(f"{w:16} budget {budget:3d} (J0 {j0:.0f}, median answer {statistics.median(lens):.0f}): untilted "
              f"{res['untilted']['complete_valid']}/{len(exs)}, adaptive {res['adaptive']['complete_valid']}/{len(exs)}"
              f" (median lambda_max {res['adaptive']['lambda_max_median']:.1f})", flush=True)
    tot = {m: sum(r[m]["complete_valid"] for r in rows.values()) for m in ("untilted", "adaptive")}
    n = sum(r["untilted"]["n"] for r in rows.values())
    print(f"all: untilted {tot['untilted']}/{n} ({100 * tot['untilted'] / n:.1f}%), adaptive {tot['adaptive']}/{n} "
          f"({100 * tot['adaptive'] / n:.1f}%)  [{time.perf_counter() - t0:.0f} s, T={a.temperature}, k={a.k}]")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows, "total": tot, "n": n}, indent=1))
    return 0
