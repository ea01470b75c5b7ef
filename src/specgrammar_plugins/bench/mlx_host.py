"""Benchmark: our loop on mlx-lm against mlx-lm's own decoding (one run, not a test).

On the bundled tiny pair (fp32; OpenBLAS preloaded when installed), for each workload, the same eval prompts
decoded by

    ours        the stream_generate twin: grammar-aware drafter chain (forced -> recipe -> draft model; the shipped
                ``recipes/<workload>.json`` pack unless --no-recipes), k drafts, one target pass, exact
                accept/residual verification
    plain       (a) mlx-lm ``generate_step`` with our history-keyed grammar processor, no speculation
    mlx-blind   (b) mlx-lm ``speculative_generate_step`` with the draft model grammar-blind (the processor masks
                only the target's rows: mlx-lm's loop with a stock draft model under a grammar)
    mlx-aware   (c) the same loop with the processor on the draft's rows too (history-keyed, so rollback-safe)

Reported: tokens per target pass (target forward calls after prefill) and wall-clock seconds per configuration,
and the wall-clock ratio plain/ours and mlx-blind/ours (> 1: ours is faster).  Every configuration's output is
checked against the workload's validator.  Tiny models on CPU are dominated by Python overhead, so wall-clock
ratios understate what memory-bound shapes see (see hosts.md); tokens per target pass is the portable number.

    specgrammar bench mlx_host [--n 4] [--k 4] [--max-tokens 64] [--temperatures 0 0.7] [--workloads ...]
                               [--models T D] [--out-dir bench-out/mlx_host] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

CONFIGS = ("ours", "plain", "mlx-blind", "mlx-aware")


class _Counting:
    """Counts a model's forward calls and tells a processor whose rows it is looking at."""

    def __init__(self, model, role: str, state: dict):
        self._model, self._role, self._state = model, role, state
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self._state["role"] = self._role
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


class _TargetOnly:
    """Applies a processor only to the target's rows (a grammar-blind draft inside mlx-lm's speculative loop)."""

    def __init__(self, processor, state: dict):
        self.processor, self.state = processor, state

    def __call__(self, tokens, logits):
        if self.state.get("role") == "draft":
            return logits
        return self.processor(tokens, logits)


def run_one(config: str, model, draft, tok, ids: list[int], spec, k: int, max_tokens: int, temperature: float,
            seed: int, recipe=None, budget_mask: bool | None = None) -> tuple[list[int], int, float]:
    """(tokens up to the first EOS, target passes, seconds) for one prompt.  ``budget_mask``: ours only."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    from specgrammar_mlx_lm.generate import generate_tokens
    from specgrammar_mlx_lm.processor import grammar_logits_processor

    eos = set(tok.eos_token_ids)
    t0 = time.perf_counter()
    if config == "ours":
        out, st = generate_tokens(model, tok, ids, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=k,
                                  constraint=spec, temperature=temperature, seed=seed, recipe=recipe,
                                  budget_mask=budget_mask)
        return out, st.target_passes, time.perf_counter() - t0
    state: dict = {}
    target = _Counting(model, "target", state)
    proc = grammar_logits_processor(spec, tok, model) if spec is not None else None
    mx.random.seed(seed)
    sampler = make_sampler(temperature)
    if config == "plain":
        gen = ((t, lp, False) for t, lp in generate_step(mx.array(ids), target, max_tokens=max_tokens,
                                                         sampler=sampler,
                                                         logits_processors=[proc] if proc else None))
    else:
        dm = _Counting(draft, "draft", state)
        if proc is not None and config == "mlx-blind":
            proc = _TargetOnly(proc, state)
        gen = speculative_generate_step(mx.array(ids), target, dm, num_draft_tokens=k, max_tokens=max_tokens,
                                        sampler=sampler, logits_processors=[proc] if proc else None)
    out = []
    for t, _, _ in gen:
        out.append(int(t))
        if t in eos:
            break
    wall = time.perf_counter() - t0
    if hasattr(gen, "close"):
        gen.close()
    passes = target.calls - (1 if len(ids) > 1 else 0)  # the prefill call is not a decoding pass
    if config == "plain":
        passes -= 1  # generate_step computes one step ahead of what it yields: that pass decodes nothing we keep
    return out, passes, wall


def run(n: int, k: int, max_tokens: int, temperatures: Sequence[float], workloads: Sequence[str],
        configs: Sequence[str] = CONFIGS, models: Sequence[str] | None = None, recipes: bool = True) -> list[dict]:
    from mlx_lm import load

    from .. import workloads as W
    from ..models import tiny_path
    from ..recipes import shipped_pack

    t_dir, d_dir = models if models else (tiny_path("target"), tiny_path("draft"))
    model, tok = load(str(t_dir))
    draft, _ = load(str(d_dir))
    rows = []
    for temperature in temperatures:
        for w in workloads:
            exs = W.examples(w, "eval", n)
            pack = shipped_pack(w) if recipes else None
            # warm-up: compile the grammar, touch every code path once
            ids0 = list(tok.encode(W.chat_prompt(exs[0].prompt), add_special_tokens=False))
            for c in configs:
                run_one(c, model, draft, tok, ids0, exs[0].constraint, k, 8, temperature, 0, pack,
                        budget_mask=False)  # (8 tokens end no JSON: no budget refusal in the warm-up)
            agg = {c: {"tokens": 0, "passes": 0, "seconds": 0.0, "valid": 0} for c in configs}
            for i, ex in enumerate(exs):
                ids = list(tok.encode(W.chat_prompt(ex.prompt), add_special_tokens=False))
                for c in configs:
                    out, passes, wall = run_one(c, model, draft, tok, ids, ex.constraint, k, max_tokens, temperature,
                                                1000 + i, pack)
                    text = tok.decode([t for t in out if t not in tok.eos_token_ids])
                    a = agg[c]
                    a["tokens"] += len(out)
                    a["passes"] += passes
                    a["seconds"] += wall
                    a["valid"] += bool(out and out[-1] in tok.eos_token_ids and W.is_valid(w, text))
            row = {"workload": w, "temperature": temperature, "n": n, "k": k, "recipe": bool(pack)}
            for c in configs:
                a = agg[c]
                row[c] = {"tokens_per_pass": a["tokens"] / max(a["passes"], 1), "seconds": a["seconds"],
                          "tokens": a["tokens"], "passes": a["passes"], "valid": a["valid"]}
            if "ours" in configs:
                for c in configs:
                    if c != "ours":
                        row[f"wall_{c}_over_ours"] = row[c]["seconds"] / max(row["ours"]["seconds"], 1e-9)
            rows.append(row)
            print(_line(row, configs), flush=True)
    return rows


def _line(row: dict, configs) -> str:
    parts = [f"{row['workload']:<16} T={row['temperature']:<4}"]
    for c in configs:
        parts.append(f"{c} {row[c]['tokens_per_pass']:.2f} tok/pass {row[c]['seconds']:.2f}s")
    return " | ".join(parts)


def table(rows: list[dict]) -> str:
    head = ("| workload | T | tokens/pass ours | plain (a) | mlx spec, blind draft (b) | mlx spec, our processor (c) "
            "| wall (a)/ours | wall (b)/ours | valid ours/(a)/(b) |")
    out = [head, "|" + "---|" * 9]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['temperature']:g} | {r['ours']['tokens_per_pass']:.2f} | "
            f"{r['plain']['tokens_per_pass']:.2f} | {r['mlx-blind']['tokens_per_pass']:.2f} | "
            f"{r['mlx-aware']['tokens_per_pass']:.2f} | {r['wall_plain_over_ours']:.2f}x | "
            f"{r['wall_mlx-blind_over_ours']:.2f}x | {r['ours']['valid']}/{r['plain']['valid']}/"
            f"{r['mlx-blind']['valid']} of {r['n']} |")
    return "\n".join(out)


def plot(rows: list[dict]):
    from . import _report as R

    def draw(fig):
        temps = list(dict.fromkeys(r["temperature"] for r in rows))
        for i, t in enumerate(temps):
            rs = [r for r in rows if r["temperature"] == t]
            ax = fig.add_subplot(1, len(temps), i + 1)
            R.bar_groups(ax, [r["workload"] for r in rs],
                         {c: [r[c]["tokens_per_pass"] for r in rs] for c in CONFIGS if c in rs[0]},
                         "tokens / target pass", f"mlx-lm, T={t:g}: tokens per target pass", hline=1.0)
    return draw


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from specgrammar_mlx_lm.blas import preloaded, reexec_with_openblas

    reexec_with_openblas("specgrammar_plugins.bench.mlx_host", argv)
    from ..workloads import WORKLOADS
    from . import _report as R

    ap = argparse.ArgumentParser(prog="python -m specgrammar_plugins.bench.mlx_host",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="eval prompts per workload (default 4; quick 1)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round (all speculative configurations)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64; quick 32")
    ap.add_argument("--temperatures", type=float, nargs="+", default=None, help="default 0 0.7; quick 0")
    ap.add_argument("--workloads", nargs="+", default=None, choices=list(WORKLOADS),
                    help="default: all; quick: json_extraction")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--no-recipes", action="store_true", help="ours without the shipped recipe packs")
    ap.add_argument("--models", nargs=2, metavar=("TARGET", "DRAFT"), default=None,
                    help="model folders (default: the bundled tiny pair)")
    R.add_common_args(ap, "mlx_host")
    args = ap.parse_args(argv)
    n = args.n or (1 if args.quick else 4)
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    temperatures = args.temperatures or ([0.0] if args.quick else [0.0, 0.7])
    workloads = args.workloads or (["json_extraction"] if args.quick else list(WORKLOADS))
    print(f"BLAS: {preloaded() or 'reference (mlx wheel default; apt-get install -y libopenblas0-pthread)'}")
    rep = R.Report("mlx_host", args, argv)
    rows = run(n, args.k, max_tokens, temperatures, workloads, models=args.models, recipes=not args.no_recipes)
    print()
    print(table(rows))
    print(f"\n{time.perf_counter() - rep.t0:.0f}s; command: python -m specgrammar_plugins.bench.mlx_host "
          + " ".join(argv))
    rep.write({"rows": rows, "blas": preloaded(), "n": n, "k": args.k, "max_tokens": max_tokens}, plot=plot(rows),
              figsize=(6 * len(temperatures), 4.5))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "blas": preloaded(), "argv": argv}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
