"""Benchmark ``vllm_draft_host``: the host work of vLLM's grammar-aware draft step (``GrammarDraftProposer``) at a
real vocabulary, with argmax drafts masked lazily (only rows whose argmax the grammar rejects) or every row masked.

No vLLM engine and no model: the proposer's own per-position methods (``_plan``: the host chain and the grammar
rows; ``_lazy``, or ``_eager_rows`` + ``_apply`` + argmax; ``_advance`` and ``_needs_model``) run on a batch of
requests over the Qwen2.5 tokenizer from ``../shared/data`` (width 151,936; skipped cleanly without it), xgrammar
masks, the forced drafter as the host chain.  The draft model is stood in for by rows of a fixed random logits table
(torch, CPU); where a row needs the model, with probability ``--agree`` the stand-in's argmax is put on a token the
grammar allows (a draft that follows the grammar, as a trained draft mostly does), else it stays where the random row
has it (inside a JSON string almost every token is allowed, elsewhere almost none).  Building the stand-in logits is
not timed.  Every draft is committed (the requests walk through their grammars; a finished one starts again).

    specgrammar bench vllm_draft_host [--batch 1 13] [--k 4] [--steps 60] [--agree 0.9]
                                      [--constraints schemas string] [--out-dir ...] [--quick]

Reported per draft step (k positions): ms of host work by phase, and beside it vLLM's own sampling on the same
logits (``argmax`` of the unmasked rows: what ``draft_model`` does at each position), so that "ours minus vLLM's"
is the grammar's host cost per draft step on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

import numpy as np

from . import _report as R

PHASES = ("begin", "plan", "sample", "advance")


def _proposer(vocab: int, batch: int):
    """A ``GrammarDraftProposer`` without vLLM's engine: the attributes its per-position methods read."""
    import torch

    from ..api import BATCH_COUNTERS, BatchDrafter, mask_words
    from specgrammar_vllm.draft_proposer import GrammarDraftProposer

    p = object.__new__(GrammarDraftProposer)
    p._vocab = vocab
    p._may_skip = True
    p._bitmask = torch.empty((batch, mask_words(vocab)), dtype=torch.int32)
    p._bitmask_np = p._bitmask.numpy()

    def fault(where, e, req_id=None):
        raise e

    p.grammar = SimpleNamespace(counters=dict.fromkeys(BATCH_COUNTERS, 0), fault=fault)
    p.batch = BatchDrafter(p.grammar, vocab)
    return p


def _constraints(which: str, n: int, tok):
    from ..compiler import compile_constraint
    from ..constraint import ConstraintSpec
    from ..errors import ConstraintError
    from .overhead import STRING

    if which == "string":
        return [compile_constraint(ConstraintSpec.regex(STRING), tok, engine="xgrammar")] * n
    from .coverage import schema_files

    out = []
    for f in schema_files(seed_stride=7):
        schema = json.loads(f.read_text()).get("schema")
        if not isinstance(schema, dict):
            continue
        try:
            out.append(compile_constraint(ConstraintSpec.json_schema(schema), tok, engine="xgrammar"))
        except (ConstraintError, RuntimeError, ValueError, TypeError):
            continue
        if len(out) >= n:
            break
    return out


def run_one(tok, compiled, batch: int, k: int, steps: int, lazy: bool, agree: float, seed: int = 0) -> dict:
    import torch

    from ..api import DraftBlock, HistoryMatcher, SpecOptions, make_drafter, mask_words
    from specgrammar_vllm.draft_proposer import _Row, _Step

    v = tok.vocab_size
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn((64, v), generator=gen) * 3.0
    prop = _proposer(v, batch)
    prompt = tok.encode("Return a JSON object:")
    reqs = []

    def fresh(i):
        c = compiled[i % len(compiled)]
        st = SimpleNamespace(drafter=make_drafter(SpecOptions(k=k, drafters=("forced",)), tok), grammar=True)
        return SimpleNamespace(history=HistoryMatcher(c), st=st, generated=[])

    reqs = [fresh(i) for i in range(batch)]
    ns = {p: 0 for p in (*PHASES, "vllm_argmax")}
    positions = model_positions = 0
    scratch = np.empty(mask_words(v), dtype=np.int32)
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        rows = []
        for i, q in enumerate(reqs):  # as GrammarStates.begin: the history's own matcher, a lazy block
            q.history.sync(q.generated)
            block = DraftBlock([*prompt, *q.generated], q.history.draft(), v, k, tok.stop_token_ids, lazy=True)
            rows.append(_Row(f"r{i}", q.st, block))
        step = _Step(rows, k)
        ns["begin"] += time.perf_counter_ns() - t0
        while step.pos < k:
            t0 = time.perf_counter_ns()
            plan = prop._plan(step, batch, fill=not lazy)
            ns["plan"] += time.perf_counter_ns() - t0
            positions += 1
            if plan.known is not None:
                toks = plan.known
            else:
                model_positions += 1
                logits = table[torch.from_numpy(rng.integers(0, len(table), size=batch))].clone()  # (not timed)
                for i in plan.model:
                    if rng.random() < agree:  # the stand-in follows the grammar here (its mask read off the
                        rows[i].block.matcher.fill_mask(scratch)  # matcher, outside the block: not timed)
                        allowed = np.flatnonzero(np.unpackbits(scratch.view(np.uint8), bitorder="little")[:v])
                        logits[i, int(rng.choice(allowed))] = float(logits[i].max()) + 1.0
                t0 = time.perf_counter_ns()
                am = logits.argmax(dim=-1)  # vLLM's own draft sampling on the same logits
                am.tolist()
                t1 = time.perf_counter_ns()
                if lazy:  # (the unmasked argmax is the lazy path's first step: ours starts after it)
                    _, toks = prop._lazy(logits, plan, rows, am)
                else:
                    if plan.host or plan.model:
                        prop._apply(logits, prop._eager_rows(plan, batch))
                    toks = logits.argmax(dim=-1).tolist()
                t2 = time.perf_counter_ns()
                ns["vllm_argmax"] += t1 - t0
                ns["sample"] += t2 - t1
            t0 = time.perf_counter_ns()
            prop._advance(step, toks)
            step.pos += 1
            more = step.pos < k and prop._needs_model(step)
            ns["advance"] += time.perf_counter_ns() - t0
            if not more:
                break
        for i, (q, r) in enumerate(zip(reqs, rows)):
            q.generated += r.block.tokens  # every draft committed
            if r.block.matcher.is_terminated() or not r.block.tokens or len(q.generated) > 400:
                reqs[i] = fresh(i + batch)
    c = prop.grammar.counters
    masked = c["draft_rows_masked"] + c["draft_rows_unmasked"]
    per = {p: ns[p] / steps / 1e6 for p in ns}
    # the draft step's host work: ours, plus vLLM's unmasked argmax where the lazy path starts from it (masking
    # every row takes its own argmax of the masked rows instead)
    host = sum(per[p] for p in PHASES) + (per["vllm_argmax"] if lazy else 0.0)
    return {"batch": batch, "k": k, "lazy": lazy, "steps": steps, "positions_per_step": positions / steps,
            "model_positions_per_step": model_positions / steps, "ms": per,
            "host_ms": host, "rows_masked": (c["draft_rows_masked"] / masked if lazy and masked
                                             else (1.0 if masked or not lazy else 0.0))}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="specgrammar bench vllm_draft_host", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 13], help="requests per draft step")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="draft steps per cell (default 60; quick 10)")
    ap.add_argument("--agree", type=float, default=0.9,
                    help="chance the stand-in draft's argmax is a token the grammar allows (default 0.9)")
    ap.add_argument("--constraints", nargs="+", default=["schemas", "string"], choices=["schemas", "string"],
                    help="schemas: real JSON Schemas (every 7th MaskBench dev file xgrammar compiles); string: a "
                         "free JSON string (the widest masks)")
    R.add_common_args(ap, "vllm_draft_host")
    a = ap.parse_args(argv)
    from .overhead import qwen_tokenizer

    tok = qwen_tokenizer()
    if tok is None:
        print("bench vllm_draft_host: ../shared/data/tokenizers/qwen2.5 is absent; skipped", file=sys.stderr)
        return 0
    steps = a.steps or (10 if a.quick else 60)
    rep = R.Report("vllm_draft_host", a, argv)
    rows = []
    for which in a.constraints:
        compiled = _constraints(which, max(a.batch), tok)
        for b in a.batch:
            for lazy in (False, True):  # side by side, same seed: the same requests and stand-in logits
                r = run_one(tok, compiled, b, a.k, steps, lazy, a.agree)
                r["constraints"] = which
                rows.append(r)
    print(f"\nbench vllm_draft_host: GrammarDraftProposer's host work per draft step (ms) at V = {tok.vocab_size:,}, "
          f"k = {a.k}, xgrammar, forced drafter, stand-in draft agreeing with the grammar {a.agree:.0%}, {steps} "
          "steps per cell; beside it vLLM's own argmax on the same logits\n")
    heads = ["constraints", "batch", "masking", "host ms/step", *[f"{p} ms" for p in PHASES], "rows masked",
             "positions/step", "vLLM argmax ms/step", "ours - vLLM's ms/step"]
    body = [[r["constraints"], r["batch"], "lazy" if r["lazy"] else "every row", f"{r['host_ms']:.2f}",
             *[f"{r['ms'][p]:.2f}" for p in PHASES], f"{r['rows_masked']:.0%}", f"{r['positions_per_step']:.2f}",
             f"{r['ms']['vllm_argmax']:.2f}", f"{r['host_ms'] - r['ms']['vllm_argmax']:.2f}"] for r in rows]
    print(R.md_table(heads, body, right=list(range(1, len(heads)))))
    print(f"\n{time.perf_counter() - rep.t0:.0f}s; command: specgrammar bench vllm_draft_host {' '.join(argv)}")
    rep.write({"vocab_size": tok.vocab_size, "k": a.k, "agree": a.agree, "steps": steps, "rows": rows,
               "versions": R.versions("torch", "xgrammar")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
