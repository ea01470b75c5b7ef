"""Benchmark ``overhead``: the speculative loop's own host work per round at a real vocabulary, per law backend.

What a round costs besides the model passes: the grammar masks, the draft laws (the proposal law r of each model
draft), the target law q, the verification, the copies of logits, and the rest of the loop's bookkeeping.  Measured
with the Qwen2.5 tokenizer from ``../shared/data`` (mask width 151,936; skipped cleanly without it), k in
{1, 4, 8} x {greedy, T = 0.7, T = 0.7 + top-p 0.9} x every law backend installed, inside a free JSON string (the
widest masks: about 147k tokens allowed; the regex of a JSON string), with the forced + model drafter chain, xgrammar
masks.  Each cell runs requests until ``--rounds`` rounds inside the string are measured.

Both models are stood in for by fixed random logits tables (the target's ``N(0, sigma^2)``, the draft's the target's
plus ``N(0, noise^2)``, so drafts are accepted part of the time), looked up by position, in the backend's own tensor
type (numpy, mlx, torch on ``--device``): the lookups are the "forward passes" and their time is taken out, so
what remains is the loop's own work per round.  Beside it, the forward time t(k+1) of the Qwen2.5-0.5B shape on
this machine (``bench scale``'s measurement: mlx and torch, fp32, random weights) and the fraction of it the host
work is.

    specgrammar bench overhead [--ks 1 4 8] [--backends reference numpy mlx torch] [--rounds 40]
                               [--sigma 3.0] [--noise 1.0] [--device cpu|cuda] [--forward mlx torch none]
                               [--out-dir bench-out/overhead] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from . import _report as R

# the body of a JSON string, as a regex: after the opening quote almost every token is allowed (the widest masks)
STRING = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'
MODES = {
    "greedy": dict(temperature=0.0),
    "T=0.7": dict(temperature=0.7),
    "T=0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
}
PHASES = ("mask", "draft_law", "target_law", "verify", "copy", "other")


def qwen_tokenizer():
    """The Qwen2.5 ``TokenizerInfo`` (width 151,936) from ``../shared/data``, or None when it is absent."""
    from ..tokenizer import TokenizerInfo

    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        p = root.parent / "shared" / "data" / "tokenizers" / "qwen2.5" / "generated"
        if (p / "tokenizer.json").exists():
            return TokenizerInfo.from_file(p, vocab_size=151936)
    return None


class TableRunner:
    """A ``ModelRunner`` whose logits are rows of a fixed table, picked by position (a stand-in model)."""

    def __init__(self, table, tensors: str):
        self.table = table
        self.tensors = tensors
        self.vocab_size = int(table.shape[-1])
        self._tokens: list[int] = []

    @property
    def tokens(self):
        return self._tokens

    offset = 0

    def forward(self, tokens, logits_for=None):
        n0 = len(self._tokens) + self.offset
        self._tokens.extend(int(t) for t in tokens)
        m = len(tokens) if logits_for is None else logits_for
        if not m:
            return self.table[:0]
        rows = [(n0 + len(tokens) - m + j) % self.table.shape[0] for j in range(m)]
        out = self.table[rows[0]: rows[0] + m] if rows[-1] >= rows[0] else self._take(rows)
        if self.tensors == "mlx":  # a real mlx runner hands over evaluated rows
            import mlx.core as mx

            mx.eval(out)
        return out

    def _take(self, rows):
        if self.tensors == "numpy":
            return self.table[rows]
        if self.tensors == "mlx":
            import mlx.core as mx

            return self.table[mx.array(rows)]
        return self.table[rows]

    def trim(self, n: int) -> None:
        if n:
            del self._tokens[-n:]


def _tables(backend: str, v: int, rows: int, sigma: float, noise: float, device: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    t = (rng.standard_normal((rows, v)) * sigma).astype(np.float32)
    d = (t + rng.standard_normal((rows, v)).astype(np.float32) * noise).astype(np.float32)
    kind = backend if backend in ("mlx", "torch") else "numpy"
    if kind == "mlx":
        import mlx.core as mx

        return mx.array(t), mx.array(d), kind
    if kind == "torch":
        import torch

        return torch.from_numpy(t).to(device), torch.from_numpy(d).to(device), kind
    return t, d, kind


def run_one(tok, compiled, backend: str, mode: str, k: int, rounds: int, sigma: float, noise: float,
            device: str, seed: int = 0, budget_mask: bool = True) -> dict:
    """Per-round host work of ``rounds`` rounds inside the string (each request's first round, which drafts the
    opening quote, is left out).  ``budget_mask``: the request's budget feasibility (on by default for a
    constrained request; the budget is the rounds still to measure, so it binds only near the end)."""
    from ..distributions import SamplingParams
    from ..requests import SpecOptions
    from ..speculation import make_loop

    target_t, draft_t, kind = _tables(backend, tok.vocab_size, 128, sigma, noise, device, seed)
    prompt = tok.encode("Write a sentence as a JSON string:")
    params = SamplingParams(**MODES[mode])
    rng = np.random.default_rng(seed)
    tot = {p: 0 for p in (*PHASES, "round")}
    n = fills = emitted = drafted = accepted = 0
    per_round: list[float] = []
    while n < rounds:
        target, draft = TableRunner(target_t, kind), TableRunner(draft_t, kind)
        target.offset = draft.offset = n * 7  # another stretch of the tables for each request
        loop = make_loop(target, prompt, SpecOptions(k=k, drafters=("forced", "model"), budget_mask=budget_mask),
                         constraint=compiled,
                         tokenizer=tok, params=params, rng=rng, draft_runner=draft, max_tokens=(rounds - n) * (k + 1) + 8,
                         law=backend)
        st = loop.stats
        prev = None
        for _ in loop.run():
            snap = (dict(st.host_ns), st.mask_us, st.mask_fills, len(loop.emitted), st.drafted, st.accepted)
            if prev is not None:
                h0, h1 = prev[0], snap[0]
                d = {p: h1.get(p, 0) - h0.get(p, 0) for p in ("draft_law", "target_law", "verify", "copy", "round",
                                                               "draft_forward")}
                d["mask"] = int((snap[1] - prev[1]) * 1e3)
                host = d["round"] - d["draft_forward"]
                for p in ("mask", "draft_law", "target_law", "verify", "copy"):
                    tot[p] += d[p]
                tot["round"] += host
                per_round.append(host / 1e6)
                fills += snap[2] - prev[2]
                emitted += snap[3] - prev[3]
                drafted += snap[4] - prev[4]
                accepted += snap[5] - prev[5]
                n += 1
                if n >= rounds:
                    break
            prev = snap
    split = {p: tot[p] / n / 1e6 for p in PHASES[:-1]}
    host_ms = tot["round"] / n / 1e6
    split["other"] = max(0.0, host_ms - sum(split.values()))
    return {"backend": backend, "mode": mode, "k": k, "budget_mask": budget_mask, "rounds": n, "host_ms": host_ms, "split_ms": split,
            "median_round_ms": statistics.median(per_round), "fills_per_round": fills / n,
            "tokens_per_round": emitted / n, "acceptance": accepted / max(1, drafted)}


def _host(st) -> dict:
    h = dict(st.host_ns)
    return {"round": h.get("round", 0) - h.get("draft_forward", 0)}


def forward_times(which, ks, reps: int, device: str) -> dict:
    """t(k+1) of the Qwen2.5-0.5B shape (fp32, random weights, context 256) per forward backend, ms."""
    from .scale import QWEN25_05B, measure_mlx, measure_torch

    out = {}
    sizes = sorted({k for k in ks if k > 0})
    for b in which:
        try:
            m = measure_mlx(QWEN25_05B, 256, sizes, reps) if b == "mlx" else \
                measure_torch(QWEN25_05B, 256, sizes, reps, device)
        except ImportError as e:
            print(f"bench overhead: no {b} forward timing ({e})", file=sys.stderr)
            continue
        out[b] = {k: 1e3 * m["times"][k + 1]["min"] for k in ks if k + 1 in m["times"]}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from specgrammar_mlx_lm.blas import preloaded, reexec_with_openblas

    reexec_with_openblas("specgrammar_plugins.bench.overhead", argv)
    from .. import laws

    ap = argparse.ArgumentParser(prog="specgrammar bench overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=None,
                    help="drafts per round (default 0 1 4 8, 0 = plain decoding; quick 4)")
    ap.add_argument("--backends", nargs="+", default=None, choices=list(laws.BACKENDS),
                    help="law backends (default: every one installed)")
    ap.add_argument("--modes", nargs="+", default=None, choices=list(MODES), help="default: all three")
    ap.add_argument("--rounds", type=int, default=None, help="rounds measured per cell (default 40; quick 10)")
    ap.add_argument("--sigma", type=float, default=3.0, help="std of the target's random logits (default 3)")
    ap.add_argument("--noise", type=float, default=1.0, help="std of the draft's difference from it (default 1)")
    ap.add_argument("--device", default="cpu", help="torch device for the torch backend and forward (cpu, cuda)")
    ap.add_argument("--forward", nargs="*", default=None, choices=["mlx", "torch"],
                    help="forward-pass timings to print beside (default: mlx and torch when installed; quick: none)")
    ap.add_argument("--reps", type=int, default=5, help="timed forward passes per size")
    ap.add_argument("--budget-mask", nargs="+", default=["on"], choices=["on", "off"],
                    help="the request's budget feasibility mask (default on, as for any constrained request)")
    R.add_common_args(ap, "overhead")
    a = ap.parse_args(argv)
    tok = qwen_tokenizer()
    if tok is None:
        print("bench overhead: ../shared/data/tokenizers/qwen2.5 is absent (the real vocabulary is the point of "
              "this benchmark); skipped", file=sys.stderr)
        return 0
    if a.device != "cpu":
        import torch

        if not (a.device.startswith("cuda") and torch.cuda.is_available()):
            print(f"bench overhead: torch sees no {a.device} device; run with --device cpu", file=sys.stderr)
            return 2
    ks = a.ks or ([4] if a.quick else [0, 1, 4, 8])
    modes = a.modes or list(MODES)
    rounds = a.rounds or (10 if a.quick else 40)
    backends = a.backends or laws.available()
    from ..compiler import compile_constraint
    from ..constraint import ConstraintSpec

    compiled = compile_constraint(ConstraintSpec.regex(STRING), tok, engine="xgrammar")
    rep = R.Report("overhead", a, argv)
    rows = []
    cells = [(b, m, k, bm) for b in backends for m in modes for k in ks for bm in a.budget_mask]
    for b, m, k, bm in R.progress(cells, "overhead", disable=a.no_progress):
        rows.append(run_one(tok, compiled, b, m, k, rounds, a.sigma, a.noise, a.device, budget_mask=bm == "on"))
    which = a.forward if a.forward is not None else ([] if a.quick else
                                                     [x for x in ("mlx", "torch") if _installed(x)])
    fwd = forward_times(which, ks, a.reps, a.device)
    print(f"\nbench overhead: the loop's host work per round (ms) at V = {tok.vocab_size:,}, inside a JSON "
          f"string (xgrammar masks), forced + model drafters, random logits tables (sigma {a.sigma:g}, draft noise "
          f"{a.noise:g}), {rounds} rounds per cell; device {a.device}; BLAS: {preloaded()}\n")
    heads = ["backend", "mode", "k", "budget mask", "host ms/round", *[f"{p} ms" for p in PHASES], "mask fills/round",
             "acceptance", *[f"t(k+1) {b} ms" for b in fwd], *[f"host / t(k+1) {b}" for b in fwd]]
    body = []
    for r in rows:
        body.append([r["backend"], r["mode"], r["k"], "on" if r["budget_mask"] else "off", f"{r['host_ms']:.2f}",
                     *[f"{r['split_ms'][p]:.2f}" for p in PHASES], f"{r['fills_per_round']:.2f}",
                     f"{r['acceptance']:.0%}" if r["k"] else "-",
                     *[f"{fwd[b][r['k']]:.1f}" for b in fwd],
                     *[f"{r['host_ms'] / fwd[b][r['k']]:.1%}" for b in fwd]])
    print(R.md_table(heads, body, right=[2, *range(4, len(heads))]))
    print(f"\n{time.perf_counter() - rep.t0:.0f}s; command: specgrammar bench overhead {' '.join(argv)}")
    rep.write({"vocab_size": tok.vocab_size, "regex": STRING, "engine": "xgrammar", "sigma": a.sigma,
               "noise": a.noise, "rounds": rounds, "device": a.device, "rows": rows, "forward_ms": fwd,
               "blas": preloaded(), "versions": R.versions("numpy", "mlx", "torch", "xgrammar")},
              plot=_plot(rows))
    return 0


def _installed(backend: str) -> bool:
    from .scale import _installed as inst

    return inst(backend)


def _plot(rows):
    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        ok = [r for r in rows if r.get("rounds")]
        groups = list(dict.fromkeys(f"{r['mode']}, k={r['k']}" for r in ok))
        backs = list(dict.fromkeys(r["backend"] for r in ok))
        get = {(f"{r['mode']}, k={r['k']}", r["backend"]): r["host_ms"] for r in ok}
        R.bar_groups(ax, groups, {b: [get.get((g, b)) for g in groups] for b in backs}, "host ms per round",
                     "the loop's host work per round, V = 151,936")
    return draw


if __name__ == "__main__":
    sys.exit(main())
