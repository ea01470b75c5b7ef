"""Benchmark ``recipes`` (the kolm table): cold vs draft model vs recipe pack vs both, with coverage and accuracy.

Per structured workload, the same eval prompts decoded greedily (T=0) by

    greedy     the host's own constrained greedy decoding (mlx-lm ``generate_step`` + our grammar processor): the
               reference every other row is compared with
    none       our loop with no drafter at all (one target pass per token)
    forced     forced tokens only (the "cold" start: no model, no pack)
    model      forced -> draft model
    pack       forced -> the shipped recipe pack ``recipes/<workload>.json``
    both       forced -> pack -> draft model (the default chain)

Columns: coverage (share of emitted tokens drafted by the pack and accepted), forced share and draft-model share
(likewise; a pack run may span positions the grammar forces, which then count as the pack's), acceptance, target passes per token, tokens/s (median over interleaved repetitions) and its ratio to
``greedy`` on the same prompt, and accuracy against greedy (outputs equal to the reference token for token; exact
verification makes it 100% at T=0, and anything less is a bug, printed as such).  The packs are measured on the eval
split, which they never saw (they are built from the train split).

    specgrammar bench recipes [--workloads ...] [--n 20] [--k 4] [--max-tokens 64] [--hosts mlx]
                              [--out-dir bench-out/recipes] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time

from ..block import FORCED_SOURCES
from . import _report as R
from ._hosts import HOSTS, Strategy
from .strategies import run

ROWS = (
    Strategy("greedy", None, what="host's own constrained greedy decoding (reference)"),
    Strategy("none", (), what="our loop, no drafter"),
    Strategy("forced", ("forced",), what="forced tokens only (cold)"),
    Strategy("model", ("forced", "model"), what="forced -> draft model"),
    Strategy("pack", ("forced", "recipe"), what="forced -> recipe pack"),
    Strategy("both", ("forced", "recipe", "model"), what="forced -> recipe pack -> draft model"),
)


def add_shares(rows: list[dict]) -> list[dict]:
    drafters = {s.name: s.drafters or () for s in ROWS}
    for r in rows:
        src = r["accepted_by_source"]
        tok = r["tokens"] or 1
        have = drafters.get(r["strategy"], ())
        r["coverage"] = src.get("recipe", 0) / tok if "recipe" in have else None
        r["forced_share"] = sum(src.get(s, 0) for s in FORCED_SOURCES) / tok if "forced" in have else None
        r["model_share"] = src.get("model", 0) / tok if "model" in have else None
        r["accuracy_vs_greedy"] = r["same_as_baseline"] / r["n"]
    return rows


def table(rows: list[dict]) -> str:
    head = ["host", "workload", "drafters", "coverage (pack)", "forced share", "model share", "acceptance",
            "passes/token", "tokens/s", "vs greedy", "= greedy", "valid"]
    body = [[r["host"], r["workload"], r["strategy"], R.fmt(r["coverage"], ".1%"), R.fmt(r["forced_share"], ".1%"),
             R.fmt(r["model_share"], ".1%"), R.fmt(r["acceptance"], ".1%"), R.fmt(r["passes_per_token"], ".3f"),
             R.fmt(r["tokens_per_s"], ".0f"), R.fmt(r["speed_vs_baseline"], ".2f") + "x",
             f"{r['same_as_baseline']}/{r['n']}", f"{r['valid']}/{r['n']}"] for r in rows]
    return R.md_table(head, body, right=range(3, 12))


def plot(rows: list[dict]):
    names = [s.name for s in ROWS[1:]]

    def draw(fig):
        rs = [r for r in rows if r["host"] == rows[0]["host"]]
        ws = list(dict.fromkeys(r["workload"] for r in rs))
        get = {(r["workload"], r["strategy"]): r for r in rs}
        ax = fig.add_subplot(1, 2, 1)
        R.bar_groups(ax, ws, {s: [get[w, s]["passes_per_token"] for w in ws] for s in names},
                     "target passes / token", f"{rows[0]['host']}: target passes per token (T=0)", hline=1.0)
        ax = fig.add_subplot(1, 2, 2)
        R.bar_groups(ax, ws, {s: [get[w, s]["coverage"] for w in ws] for s in ("pack", "both")},
                     "share of emitted tokens", "recipe-pack coverage")
    return draw


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from specgrammar_mlx_lm.blas import preloaded, reexec_with_openblas

    reexec_with_openblas("specgrammar_plugins.bench.recipes", argv)
    from ..workloads import STRUCTURED

    ap = argparse.ArgumentParser(prog="specgrammar bench recipes", description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", nargs="+", default=["mlx"], choices=list(HOSTS))
    ap.add_argument("--workloads", nargs="+", default=None, choices=list(STRUCTURED),
                    help="default: every structured workload with a shipped pack")
    ap.add_argument("--n", type=int, default=None, help="eval prompts per workload (default 20; quick 1)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64")
    R.add_common_args(ap, "recipes")
    a = ap.parse_args(argv)
    workloads = a.workloads or (["json_extraction"] if a.quick else list(STRUCTURED))
    n = a.n or (1 if a.quick else 20)
    max_tokens = a.max_tokens or (32 if a.quick else 64)
    rep = R.Report("recipes", a, argv)
    rows = add_shares(run(a.hosts, workloads, list(ROWS), n, a.k, max_tokens, 0.0, not a.no_progress, "recipes"))
    print(f"\nbench recipes: tiny pair, T=0, k={a.k}, max_tokens={max_tokens}, {n} eval prompts per workload, "
          f"BLAS: {preloaded()}\n")
    print(table(rows))
    bad = [r for r in rows if r["same_as_baseline"] != r["n"]]
    print("\naccuracy against greedy: " + ("100% in every row" if not bad else "BUG: " + ", ".join(
        f"{r['host']}/{r['workload']}/{r['strategy']} {r['same_as_baseline']}/{r['n']}" for r in bad)))
    print(f"\n{time.perf_counter() - rep.t0:.0f}s; command: specgrammar bench recipes {' '.join(argv)}")
    rep.write({"k": a.k, "temperature": 0.0, "max_tokens": max_tokens, "n": n, "workloads": workloads,
               "hosts": a.hosts, "blas": preloaded(), "rows": rows, "all_equal_greedy": not bad,
               "packs": {w: _pack_meta(w) for w in workloads}}, plot=plot(rows), figsize=(12, 4.5))
    return 0


def _pack_meta(workload: str) -> dict | None:
    from ..recipes import RecipePack, shipped_pack

    p = shipped_pack(workload)
    if p is None:
        return None
    pack = RecipePack.load(p)
    return {"file": str(p.name), **pack.stats(), "model_sha256": pack.meta.get("model_sha256")}


if __name__ == "__main__":
    sys.exit(main())
