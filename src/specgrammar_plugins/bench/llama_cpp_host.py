"""Benchmark: SpecLlama against llama-cpp-python's stock paths on the tiny GGUF models (one run, not a test).

Every configuration decodes the same prompts with the same grammar text (llama.cpp GBNF: the workloads' regexes
written as GBNF, JSON schemas through llama-cpp-python's own converter, the SQL grammar as is):

    stock            Llama(target) + grammar=LlamaGrammar, no drafting                 (the baseline)
    stock+blind      Llama(target, draft_model=<draft Llama, greedy, grammar-blind>, logits_all=True) + grammar
    stock+grammar    Llama(target, draft_model=GrammarDraftModel(draft), logits_all=True) + grammar
    ours             SpecLlama(target, draft=draft): forced tokens + draft model, exact residual verification
    ours-forced      SpecLlama(target): forced tokens only, no draft model

Reported per configuration: tokens (the end-of-generation token included), target passes (stock: llama_decode
calls on the target context, the prompt's included as it yields the first token; ours: ``Stats.target_passes``,
the prefill of prompt[:-1] excluded likewise), tokens per target pass, wall-clock seconds, ms per token and its
ratio to ``stock``, and whether every output equals ``stock``'s (greedy).  Grammars are compiled (and each
configuration warmed) before timing.

    specgrammar bench llama_cpp_host [--n 3] [--k 4] [--max-tokens 64] [--temperature 0] [--threads 1]
                                     [--workloads ...] [--out-dir bench-out/llama_cpp_host] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence



def gbnf_for(workload: str) -> str | None:
    from llama_cpp import llama_grammar

    from ..workloads import constraint

    regex_gbnf = {
        "order_id": 'root ::= [A-Z]{3} "-" [0-9]{4}',
        "year": "root ::= [0-9]{4}",
        "email": 'root ::= [a-z]+ "@" [a-z]+ ".com"',
    }
    spec = constraint(workload)
    if spec is None:
        return None
    if workload in regex_gbnf:
        return regex_gbnf[workload]
    if spec.kind == "json_schema":
        return llama_grammar.json_schema_to_gbnf(spec.value)
    return spec.value


def blind_draft_model(draft, k: int):
    """The usual stock drafter: a draft Llama's greedy continuation, blind to the grammar (our
    ``GrammarDraftModel`` with no constraint and only the draft model in its chain)."""
    from specgrammar_llama_cpp import GrammarDraftModel

    return GrammarDraftModel(draft, None, k=k, drafters=("model",))


class DecodeCounter:
    """Counts llama_decode calls on a stock Llama's context (instrumentation of the instance only)."""

    def __init__(self, llm):
        self.calls = 0
        inner = llm._ctx.decode

        def decode(batch):
            self.calls += 1
            return inner(batch)

        llm._ctx.decode = decode


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specgrammar_plugins.bench.llama_cpp_host",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="prompts per workload (default 3; quick 1)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64; quick 32")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--workloads", nargs="*", default=None)
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    from . import _report as R

    R.add_common_args(ap, "llama_cpp_host")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.n = args.n or (1 if args.quick else 3)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    if args.quick and not args.workloads:
        args.workloads = ["json_extraction"]
    rep = R.Report("llama_cpp_host", args, argv)

    import llama_cpp
    from llama_cpp import Llama, LlamaGrammar

    from specgrammar_llama_cpp import GrammarDraftModel, SpecLlama
    from ..models import tiny_gguf
    from ..workloads import STRUCTURED, chat_prompt, constraint, examples

    target_path, draft_path = str(tiny_gguf("target")), str(tiny_gguf("draft"))
    for path in (target_path, draft_path):
        if not os.path.exists(path):
            print(f"{path} is absent: build the tiny models first (scripts/build_models.py)", file=sys.stderr)
            return 2
    kw = dict(n_threads=args.threads, n_threads_batch=args.threads, n_ctx=args.n_ctx, verbose=False, seed=0)
    workloads = args.workloads or list(STRUCTURED)
    requests = [(w, chat_prompt(e.prompt)) for w in workloads for e in examples(w, "eval", args.n)]

    def stock_factory(draft_model=None):
        if draft_model is None:
            return Llama(target_path, **kw)
        return Llama(target_path, draft_model=draft_model, logits_all=True, **kw)

    draft_llm = Llama(draft_path, **kw)
    all_configs = ("stock", "stock+blind", "stock+grammar", "ours", "ours-forced")
    names = args.configs or list(all_configs)
    results: dict[str, dict] = {}
    outputs: dict[str, list[str]] = {}
    for name in names:
        per_workload_dm: dict[str, GrammarDraftModel] = {}
        if name == "stock":
            llm = stock_factory()
        elif name == "stock+blind":
            llm = stock_factory(blind_draft_model(draft_llm, args.k))
        elif name == "stock+grammar":  # one GrammarDraftModel per workload (its grammar), swapped in per request
            llm = stock_factory(blind_draft_model(draft_llm, args.k))
            for w in workloads:
                if constraint(w) is not None:
                    per_workload_dm[w] = GrammarDraftModel(
                        draft_llm, LlamaGrammar.from_string(gbnf_for(w), verbose=False), target=llm, k=args.k)
        elif name == "ours":
            llm = SpecLlama(target_path, draft=draft_llm, k=args.k, **kw)
        elif name == "ours-forced":
            llm = SpecLlama(target_path, k=args.k, drafters=("forced",), **kw)
        else:
            ap.error(f"unknown configuration {name!r}; choose from {', '.join(all_configs)}")
        ours = isinstance(llm, SpecLlama)
        counter = None if ours else DecodeCounter(llm)
        blind = llm.draft_model if not ours else None

        def run(w, prompt, timed):
            g = gbnf_for(w)
            if per_workload_dm:
                dm = per_workload_dm.get(w)
                if dm is not None:
                    dm.reset()
                llm.draft_model = dm if dm is not None else blind
            before = counter.calls if counter is not None else 0
            t0 = time.perf_counter()
            out = llm.create_completion(prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=0,
                                        grammar=None if g is None else LlamaGrammar.from_string(g, verbose=False))
            dt = time.perf_counter() - t0
            emitted = out["usage"]["completion_tokens"]
            if ours:
                st = llm.last_stats
                passes, emitted_tokens = st.target_passes, st.emitted
            else:
                passes = counter.calls - before  # the prompt decode is the pass that yields the first token
                emitted_tokens = emitted + (1 if out["choices"][0]["finish_reason"] == "stop" else 0)  # + EOS
            return out["choices"][0]["text"], emitted_tokens, passes, dt

        for w in workloads:  # warm-up: compile grammars, touch caches
            run(w, requests[[r[0] for r in requests].index(w)][1], False)
        tot_tok = tot_pass = 0
        tot_s = 0.0
        texts = []
        for w, prompt in requests:
            text, toks, passes, dt = run(w, prompt, True)
            texts.append(text)
            tot_tok += toks
            tot_pass += passes
            tot_s += dt
        results[name] = {"tokens": tot_tok, "target_passes": tot_pass, "seconds": tot_s,
                         "tokens_per_pass": tot_tok / max(tot_pass, 1)}
        outputs[name] = texts
        print(f"{name}: {tot_tok} tokens, {tot_pass} target passes, {tot_s:.2f} s", flush=True)
        del llm
    base = results.get("stock")
    print()
    print(f"llama-cpp-python {llama_cpp.__version__}, tiny GGUF target/draft, {len(requests)} requests "
          f"({', '.join(workloads)}), k={args.k}, max_tokens={args.max_tokens}, T={args.temperature}, "
          f"threads={args.threads}")
    print()
    print("| configuration | tokens | target passes | tokens / target pass | wall-clock s | ms / token "
          "| wall-clock per token vs stock | same output as stock |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        r = results[name]
        r["ms_per_token"] = 1e3 * r["seconds"] / max(r["tokens"], 1)
        ratio = f"{r['ms_per_token'] / (1e3 * base['seconds'] / max(base['tokens'], 1)):.2f}x" if base else "-"
        same = "-" if not base or name == "stock" or args.temperature > 0 else (
            f"{sum(a == b for a, b in zip(outputs[name], outputs['stock']))}/{len(requests)}")
        print(f"| {name} | {r['tokens']} | {r['target_passes']} | {r['tokens_per_pass']:.2f} | {r['seconds']:.2f} "
              f"| {r['ms_per_token']:.2f} | {ratio} | {same} |")
    rep.write({"args": vars(args), "results": results, "outputs": outputs, "requests": len(requests),
               "versions": R.versions("llama-cpp-python")}, plot=_plot(names, results), figsize=(10, 4))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, "outputs": outputs}, f, indent=1, default=str)
    return 0


def _plot(names, results):
    from . import _report as R

    def draw(fig):
        ax = fig.add_subplot(1, 2, 1)
        R.bar_groups(ax, ["all requests"], {n: [results[n]["tokens_per_pass"]] for n in names},
                     "tokens / target pass", "llama-cpp-python: tokens per target pass", hline=1.0)
        ax = fig.add_subplot(1, 2, 2)
        R.bar_groups(ax, ["all requests"], {n: [results[n]["ms_per_token"]] for n in names},
                     "ms / token", "wall-clock per token (tiny models: overhead-bound)")
    return draw


if __name__ == "__main__":
    raise SystemExit(main())
