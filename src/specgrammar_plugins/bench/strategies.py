"""Benchmark ``strategies`` (the Onyx tables): one host, one workload, six ways to decode under the grammar.

    baseline   the host's own constrained decoding, no speculation (mlx-lm ``generate_step`` with our grammar
               processor; llama-cpp-python ``Llama`` with ``grammar=LlamaGrammar``)
    blind      draft model without the grammar mask (mlx ``stream_generate(blind=True, drafters=["model"])``,
               ``SpecLlama(blind_draft=True)``)
    aware      draft model under the grammar mask (``drafters=["model"]``)
    forced     tokens the grammar forces, no model (``drafters=["forced"]``)
    recipe     the shipped pack ``recipes/<workload>.json`` only (``drafters=["recipe"]``)
    full       the default chain forced -> recipe -> draft model, with the pack

on the bundled tiny pair, k draft tokens per round.  Repetitions are interleaved: repetition r decodes eval prompt
r with every strategy (in a rotated order) before moving on, so load drifts hit all strategies alike.  Reported per
(host, workload, strategy): acceptance rate (accepted / drafted), accepted tokens per round, target passes per
token, tokens/s (median over repetitions), the ratio of tokens/s to the baseline's on the same prompt (median), and
grammar time per token (µs; the loop's ``Stats.mask_us``; for mlx-lm's own loop the grammar processor's time;
llama.cpp's own grammar sampler cannot be timed from outside: "-").  Also: outputs that validate and, at T=0, that
equal the baseline's.  The line "aware >= blind" per workload is the seed's central claim (PASS/FAIL, reported, never
an error).  vLLM is not in this table (one engine per strategy does not fit the time bound on a 2-core CPU; its
strategies are in ``bench vllm_host``).

    specgrammar bench strategies [--hosts mlx llama_cpp] [--workloads ...] [--n 20] [--k 4] [--max-tokens 64]
                                 [--temperature 0] [--out-dir bench-out/strategies] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time

from . import _report as R
from ._hosts import HOSTS, STRATEGIES, load_host

WORKLOADS = ("year", "email", "order_id", "json_extraction", "sql")


def run(hosts, workloads, strategies, n: int, k: int, max_tokens: int, temperature: float,
        show_progress: bool = True, desc: str = "strategies") -> list[dict]:
    """Rows of ``summarize`` per (host, workload, strategy); ``strategies``: ``Strategy`` objects or names, the
    first being the baseline that speeds (and, at T=0, outputs) are compared with."""
    from .. import workloads as W

    strategies = [STRATEGIES[s] if isinstance(s, str) else s for s in strategies]
    rows = []
    total = len(hosts) * len(workloads) * n * len(strategies)
    bar = R.progress(range(total), desc, total=total, disable=not show_progress)
    it = iter(bar)
    for hname in hosts:
        host = load_host(hname)
        for w in workloads:
            exs = W.examples(w, "eval", n)
            spec = W.constraint(w)
            prompts = [host.encode(W.chat_prompt(e.prompt)) for e in exs]
            for s in strategies:  # warm-up: compile the grammar, load the pack, touch every code path
                host.run(s, w, prompts[0], spec, k=k, max_tokens=8, temperature=temperature, seed=0,
                         options={"budget_mask": False})  # (8 tokens end no JSON Schema: no refusal here)
            runs: dict = {s: [] for s in strategies}
            for r, prompt in enumerate(prompts):
                order = strategies[r % len(strategies):] + strategies[: r % len(strategies)]
                for s in order:
                    runs[s].append(host.run(s, w, prompt, spec, k=k, max_tokens=max_tokens,
                                            temperature=temperature, seed=1000 + r))
                    next(it, None)
            rows += summarize(hname, w, runs, temperature)
        del host
    bar.close()
    return rows


def summarize(host: str, workload: str, runs: dict, temperature: float) -> list[dict]:
    from .. import workloads as W

    base = next(iter(runs.values()))
    out = []
    for s, rs in runs.items():
        tokens = sum(len(r.tokens) for r in rs)
        drafted = sum(r.drafted for r in rs)
        accepted = sum(r.accepted for r in rs)
        rounds = sum(r.rounds for r in rs)
        passes = sum(r.passes for r in rs)
        tps = [len(r.tokens) / r.seconds for r in rs if r.seconds > 0]
        row = {
            "host": host, "workload": workload, "strategy": s.name, "what": s.what, "n": len(rs),
            "tokens": tokens, "target_passes": passes, "drafted": drafted, "accepted": accepted, "rounds": rounds,
            "acceptance": R.ratio(accepted, drafted) if drafted else None,
            "accepted_per_round": R.ratio(accepted, rounds) if rounds else None,
            "passes_per_token": R.ratio(passes, tokens),
            "tokens_per_pass": R.ratio(tokens, passes),
            "tokens_per_s": R.median(tps),
            "seconds": sum(r.seconds for r in rs),
            "grammar_us_per_token": (R.ratio(sum(r.mask_us for r in rs), tokens)
                                     if all(r.mask_us is not None for r in rs) else None),
            "accepted_by_source": _sum_dicts(r.by_source for r in rs),
            "drafted_by_source": _sum_dicts(r.drafted_by_source for r in rs),
            "valid": sum(bool(r.stop and W.is_valid(workload, r.text)) for r in rs),
        }
        row["speed_vs_baseline"] = R.median([R.ratio(len(r.tokens) / r.seconds, len(b.tokens) / b.seconds)
                                             for r, b in zip(rs, base) if r.seconds > 0 and b.seconds > 0])
        if temperature == 0:
            row["same_as_baseline"] = sum(_same(r, b) for r, b in zip(rs, base))
        out.append(row)
    return out


def _same(r, b) -> bool:
    """Same output: token for token where both runs know their ids, else the same text."""
    if -1 in r.tokens or -1 in b.tokens:
        return r.text == b.text
    return r.tokens == b.tokens


def _sum_dicts(ds) -> dict:
    tot: dict = {}
    for d in ds:
        for key, v in d.items():
            tot[key] = tot.get(key, 0) + v
    return tot


def claims(rows: list[dict]) -> list[dict]:
    """Per (host, workload): aware acceptance >= blind acceptance (the seed's claim), and the same for accepted
    tokens per round.  A blind draft that leaves the grammar closes its block (``DraftBlock.push(check=False)``), so
    the drafts a stock blind drafter would still make after it are not counted: blind's acceptance rate is, if
    anything, flattered."""
    out = []
    for host in dict.fromkeys(r["host"] for r in rows):
        for w in dict.fromkeys(r["workload"] for r in rows if r["host"] == host):
            by = {r["strategy"]: r for r in rows if r["host"] == host and r["workload"] == w}
            if "aware" in by and "blind" in by:
                a, b = by["aware"], by["blind"]
                acc = (a["acceptance"] or 0.0, b["acceptance"] or 0.0)
                per = (a["accepted_per_round"] or 0.0, b["accepted_per_round"] or 0.0)
                out.append({"host": host, "workload": w, "aware": acc[0], "blind": acc[1], "pass": acc[0] >= acc[1],
                            "aware_drafted": a["drafted"], "aware_accepted": a["accepted"],
                            "blind_drafted": b["drafted"], "blind_accepted": b["accepted"],
                            "aware_per_round": per[0], "blind_per_round": per[1], "pass_per_round": per[0] >= per[1]})
    return out


def table(rows: list[dict]) -> str:
    head = ["host", "workload", "strategy", "acceptance", "accepted/round", "passes/token", "tokens/s",
            "vs baseline", "grammar µs/token", "valid", "= baseline"]
    body = []
    for r in rows:
        body.append([r["host"], r["workload"], r["strategy"], R.fmt(r["acceptance"], ".1%"),
                     R.fmt(r["accepted_per_round"]), R.fmt(r["passes_per_token"], ".3f"), R.fmt(r["tokens_per_s"], ".0f"),
                     R.fmt(r.get("speed_vs_baseline"), ".2f") + "x", R.fmt(r["grammar_us_per_token"], ".0f"),
                     f"{r['valid']}/{r['n']}", f"{r['same_as_baseline']}/{r['n']}" if "same_as_baseline" in r else "-"])
    return R.md_table(head, body, right=range(3, 11))


def plot(rows: list[dict], strategies):
    def draw(fig):
        hosts = list(dict.fromkeys(r["host"] for r in rows))
        for i, h in enumerate(hosts):
            hr = [r for r in rows if r["host"] == h]
            ws = list(dict.fromkeys(r["workload"] for r in hr))
            get = {(r["workload"], r["strategy"]): r for r in hr}
            ax = fig.add_subplot(len(hosts), 2, 2 * i + 1)
            R.bar_groups(ax, ws, {s: [get[w, s]["passes_per_token"] for w in ws] for s in strategies},
                         "target passes / token", f"{h}: target passes per token (lower is better)", hline=1.0)
            ax = fig.add_subplot(len(hosts), 2, 2 * i + 2)
            R.bar_groups(ax, ws, {s: [get[w, s].get("speed_vs_baseline") for w in ws] for s in strategies},
                         "tokens/s vs baseline", f"{h}: wall-clock speed vs baseline (median)", hline=1.0)
    return draw


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from specgrammar_mlx_lm.blas import preloaded, reexec_with_openblas

    reexec_with_openblas("specgrammar_plugins.bench.strategies", argv)
    ap = argparse.ArgumentParser(prog="specgrammar bench strategies", description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", nargs="+", default=list(HOSTS), choices=list(HOSTS))
    from ..workloads import STRUCTURED

    ap.add_argument("--workloads", nargs="+", default=None, choices=list(STRUCTURED),
                    help=f"default: {' '.join(WORKLOADS)}")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--n", type=int, default=None, help="eval prompts = interleaved repetitions (default 20; quick 1)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64")
    ap.add_argument("--temperature", type=float, default=0.0)
    R.add_common_args(ap, "strategies")
    a = ap.parse_args(argv)
    workloads = a.workloads or (["json_extraction"] if a.quick else list(WORKLOADS))
    n = a.n or (1 if a.quick else 20)
    max_tokens = a.max_tokens or (32 if a.quick else 64)
    strategies = list(dict.fromkeys(["baseline", *a.strategies]))
    rep = R.Report("strategies", a, argv)
    rows = run(a.hosts, workloads, strategies, n, a.k, max_tokens, a.temperature, not a.no_progress)
    cl = claims(rows)
    print(f"\nbench strategies: tiny pair, k={a.k}, T={a.temperature:g}, max_tokens={max_tokens}, {n} eval prompts "
          f"per workload (interleaved repetitions; tokens/s and 'vs baseline' are medians), BLAS: {preloaded()}\n")
    print(table(rows))
    print("\nvLLM is not in this table: one engine per strategy does not fit the 15-minute bound on a 2-core CPU; "
          "its strategies (plain, forced, recipe, draft model, ngram, blind draft_model) are in `bench vllm_host`.")
    print()
    for c in cl:
        print(f"aware >= blind  {c['host']:9} {c['workload']:15}  acceptance: aware {c['aware']:.1%} "
              f"({c['aware_accepted']}/{c['aware_drafted']}) blind {c['blind']:.1%} ({c['blind_accepted']}/"
              f"{c['blind_drafted']}) {'PASS' if c['pass'] else 'FAIL'}  |  accepted/round: aware "
              f"{c['aware_per_round']:.2f} blind {c['blind_per_round']:.2f} {'PASS' if c['pass_per_round'] else 'FAIL'}")
    print(f"\n{time.perf_counter() - rep.t0:.0f}s; command: specgrammar bench strategies {' '.join(argv)}")
    rep.write({"k": a.k, "temperature": a.temperature, "max_tokens": max_tokens, "n": n, "workloads": workloads,
               "hosts": a.hosts, "strategies": strategies, "blas": preloaded(), "rows": rows, "claims": cl,
               "versions": R.versions("mlx", "mlx-lm", "llama-cpp-python", "xgrammar")},
              plot=plot(rows, strategies), figsize=(12, 4.5 * len(a.hosts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
