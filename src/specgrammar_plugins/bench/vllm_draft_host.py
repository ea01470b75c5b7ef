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

    specgrammar bench vllm_draft_host [--batch 1 13 32] [--k 4] [--steps 60] [--agree 0.9]
                                      [--constraints schemas string] [--early-ending on|off]
                                      [--masking both|lazy|every] [--clock thread|wall] [--profile N]
                                      [--out-dir ...] [--quick]

Reported per draft step (k positions): ms of host work by phase (begin, plan, sample, advance: our grammar work,
and divided by the batch, our grammar work in us per request per draft step), our draft argmax (the proposer's
``_argmax``: numpy's on a CPU), and beside it vLLM's own sampling on the same logits (torch's ``argmax`` of the
unmasked rows: what ``draft_model`` does at each position), so that "ours minus vLLM's" is what the grammar-aware
draft step's host work costs beyond vLLM's own on a CPU.  ``--clock thread`` (the default) times with the CPU time of the benchmark's thread
(``time.thread_time_ns``), steadier than wall-clock on a loaded machine; torch runs on that one thread
(``torch.set_num_threads(1)``), so its work is in it.  ``--early-ending off``: the early-ending rules
(``refused_drafts``, ``draft_confidence``) off, every row drafts to k.  ``--profile N``: a cProfile of the lazy
cells, its N costliest functions by own time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

from . import _report as R

PHASES = ("begin", "plan", "sample", "advance")


def _table_class():
    from ..api import RequestTable

    class Table(RequestTable):
        """The core's request table as vLLM's ``GrammarStates`` is one: a request is its own ``RequestState``
        (built by the benchmark), and a fault is raised (a benchmark or a test must not hide one)."""

        def __init__(self, vocab: int, k: int = 8):
            self.init_table(k, vocab, 1 << 30)

        def new_state(self, req, req_id=None):
            return req

        def fault(self, where, e, req_id=None):
            raise e

    return Table


def _Table(vocab: int):
    return _table_class()(vocab)


def _proposer(vocab: int, batch: int, early_ending: bool = True):
    """A ``GrammarDraftProposer`` without vLLM's engine: the attributes its per-position methods read
    (``early_ending`` False: ``refused_drafts`` and ``draft_confidence`` off)."""
    import torch

    from ..api import BatchDrafter, mask_words
    from specgrammar_vllm.draft_proposer import GrammarDraftProposer

    p = object.__new__(GrammarDraftProposer)
    p._vocab = vocab
    p._may_skip = True
    p._bitmask = torch.empty((batch, mask_words(vocab)), dtype=torch.int32)
    p._bitmask_np = p._bitmask.numpy()
    p._ids_cache = {}

    p.grammar = _Table(vocab)
    p.batch = BatchDrafter(p.grammar, vocab) if early_ending else BatchDrafter(p.grammar, vocab, None, None)
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


def run_one(tok, compiled, batch: int, k: int, steps: int, lazy: bool, agree: float, seed: int = 0,
            early_ending: bool = True, clock=time.thread_time_ns, prof=None) -> dict:
    """One cell; ``prof``: a ``cProfile.Profile`` enabled over the timed parts of ours only."""
    import torch

    from ..api import HistoryMatcher, RequestState, SpecOptions, make_drafter, mask_words
    from specgrammar_vllm.draft_proposer import _argmax, _Step

    v = tok.vocab_size
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn((64, v), generator=gen) * 3.0
    prop = _proposer(v, batch, early_ending)
    prompt = tok.encode("Return a JSON object:")
    ids: list[int] = []

    def fresh(i):
        c = compiled[i % len(compiled)]
        st = RequestState(HistoryMatcher(c), make_drafter(SpecOptions(k=k, drafters=("forced",)), tok), len(prompt),
                          tuple(tok.stop_token_ids))
        ids.append(i)
        return SimpleNamespace(id=f"r{len(ids)}", st=st, tokens=np.asarray(prompt, dtype=np.int64), accepted=0)

    reqs = [fresh(i) for i in range(batch)]
    ns = {p: 0 for p in (*PHASES, "argmax", "vllm_argmax")}
    positions = model_positions = 0
    scratch = np.empty(mask_words(v), dtype=np.int32)
    on, off = (prof.enable, prof.disable) if prof is not None else (lambda: None, lambda: None)
    # as vLLM's EngineCore after start-up (vllm/v1/engine/core.py: freeze_gc_heap, vLLM 0.32): the heap so far is
    # left out of the collector's oldest generation, else a full collection over torch's, vLLM's and transformers'
    # objects (~0.25 s here) lands in whichever phase is timed when it comes
    gc.collect()
    gc.freeze()
    for _ in range(steps):
        on()
        t0 = clock()
        # as GrammarDraftProposer._begin: per request its state, the outcome of its last drafts, its committed
        # tokens synced onto its history's own matcher and a lazy block (the core's BatchDrafter.row)
        prop.grammar.prune({q.id for q in reqs})
        rows = [prop.batch.row(q.id, q.st, q.accepted, lambda q=q: q.tokens, k) for q in reqs]
        step = _Step(rows, k)
        ns["begin"] += clock() - t0
        while step.pos < k:
            on()
            t0 = clock()
            plan = prop._plan(step, batch, fill=not lazy)
            ns["plan"] += clock() - t0
            off()
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
                on()
                t0 = clock()
                if lazy:  # our draft argmax (the proposer's: numpy's on a CPU), the lazy path's first step
                    am = _argmax(logits)
                t1 = clock()
                off()
                ns["argmax"] += t1 - t0
                t0 = clock()
                logits.argmax(dim=-1).tolist()  # vLLM's own draft sampling on the same logits (torch's argmax)
                ns["vllm_argmax"] += clock() - t0
                on()
                t1 = clock()
                if lazy:
                    _, toks = prop._lazy(logits, plan, rows, am)
                    t2 = clock()
                else:
                    if plan.host or plan.model:
                        prop._apply(logits, prop._eager_rows(plan, batch))
                    t2 = clock()
                    toks = _argmax(logits).tolist()  # (the masked rows' argmax: ours, not the grammar's)
                    ns["argmax"] += clock() - t2
                ns["sample"] += t2 - t1
                off()
            on()
            t0 = clock()
            prop._advance(step, toks)
            step.pos += 1
            more = step.pos < k and prop._needs_model(step)
            ns["advance"] += clock() - t0
            off()
            if not more:
                break
        for i, (q, r) in enumerate(zip(reqs, rows)):
            q.tokens = np.concatenate([q.tokens, np.asarray(r.block.tokens, dtype=np.int64)])  # every draft
            q.accepted = len(r.block.tokens) + 1  # committed
            if r.block.matcher.is_terminated() or not r.block.tokens or len(q.tokens) > 400 + len(prompt):
                reqs[i] = fresh(i + batch)
    gc.unfreeze()
    c = prop.grammar.counters
    masked = c["draft_rows_masked"] + c["draft_rows_unmasked"]
    per = {p: ns[p] / steps / 1e6 for p in ns}
    # the draft step's host work: our grammar work (the phases) and our draft argmax (the unmasked one the lazy path
    # starts from, or the masked rows'), against vLLM's own: its argmax of the same logits
    host = sum(per[p] for p in PHASES) + per["argmax"]
    return {"batch": batch, "k": k, "lazy": lazy, "early_ending": early_ending, "steps": steps,
            "positions_per_step": positions / steps,
            "us_per_request": sum(per[p] for p in PHASES) * 1e3 / batch,
            "model_positions_per_step": model_positions / steps, "ms": per,
            "host_ms": host, "rows_masked": (c["draft_rows_masked"] / masked if lazy and masked
                                             else (1.0 if masked or not lazy else 0.0))}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="specgrammar bench vllm_draft_host", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 13, 32], help="requests per draft step")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="draft steps per cell (default 60; quick 10)")
    ap.add_argument("--agree", type=float, default=0.9,
                    help="chance the stand-in draft's argmax is a token the grammar allows (default 0.9)")
    ap.add_argument("--constraints", nargs="+", default=["schemas", "string"], choices=["schemas", "string"],
                    help="schemas: real JSON Schemas (every 7th MaskBench dev file xgrammar compiles); string: a "
                         "free JSON string (the widest masks)")
    ap.add_argument("--early-ending", choices=["on", "off"], default="on",
                    help="the early-ending rules refused_drafts and draft_confidence at their defaults (on) or off "
                         "(every row drafts to k)")
    ap.add_argument("--masking", choices=["both", "lazy", "every"], default="both",
                    help="argmax drafts masked lazily, every row masked (as sampled drafts), or both side by side")
    ap.add_argument("--clock", choices=["thread", "wall"], default="thread",
                    help="thread: CPU time of this thread (default; torch on one thread); wall: wall-clock")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the lazy cells and print their N costliest functions by own time")
    R.add_common_args(ap, "vllm_draft_host")
    a = ap.parse_args(argv)
    from .overhead import qwen_tokenizer

    tok = qwen_tokenizer()
    if tok is None:
        print("bench vllm_draft_host: ../shared/data/tokenizers/qwen2.5 is absent; skipped", file=sys.stderr)
        return 0
    import torch

    torch.set_num_threads(1)  # torch's work on this thread (the thread clock counts it), as vLLM's CPU worker
    clock = time.thread_time_ns if a.clock == "thread" else time.perf_counter_ns
    early = a.early_ending == "on"
    steps = a.steps or (10 if a.quick else 60)
    rep = R.Report("vllm_draft_host", a, argv)
    rows = []
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
    for which in a.constraints:
        compiled = _constraints(which, max(a.batch), tok)
        for b in a.batch:
            for lazy in {"both": (False, True), "lazy": (True,), "every": (False,)}[a.masking]:
                # side by side, same seed: the same requests and stand-in logits
                r = run_one(tok, compiled, b, a.k, steps, lazy, a.agree, early_ending=early, clock=clock,
                            prof=prof if lazy else None)
                r["constraints"] = which
                rows.append(r)
    print(f"\nbench vllm_draft_host: GrammarDraftProposer's host work per draft step (ms, {a.clock} clock) at "
          f"V = {tok.vocab_size:,}, k = {a.k}, xgrammar, forced drafter, stand-in draft agreeing with the grammar "
          f"{a.agree:.0%}, early-ending rules {a.early_ending}, {steps} steps per cell; beside it vLLM's own argmax "
          "on the same logits\n")
    heads = ["constraints", "batch", "masking", "host ms/step", *[f"{p} ms" for p in PHASES], "our argmax ms",
             "rows masked", "positions/step", "vLLM argmax ms/step", "ours - vLLM's ms/step",
             "grammar us/request/step"]
    body = [[r["constraints"], r["batch"], "lazy" if r["lazy"] else "every row", f"{r['host_ms']:.2f}",
             *[f"{r['ms'][p]:.2f}" for p in PHASES], f"{r['ms']['argmax']:.2f}", f"{r['rows_masked']:.0%}",
             f"{r['positions_per_step']:.2f}", f"{r['ms']['vllm_argmax']:.2f}",
             f"{r['host_ms'] - r['ms']['vllm_argmax']:.2f}", f"{r['us_per_request']:.0f}"] for r in rows]
    print(R.md_table(heads, body, right=list(range(1, len(heads)))))
    if prof is not None:
        import pstats

        print("\ncProfile of the lazy cells' timed parts (ours; vLLM's argmax outside), by own time:")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(a.profile)
    print(f"\n{time.perf_counter() - rep.t0:.0f}s; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"command: specgrammar bench vllm_draft_host {' '.join(argv)}")
    rep.write({"vocab_size": tok.vocab_size, "k": a.k, "agree": a.agree, "steps": steps, "clock": a.clock,
               "early_ending": a.early_ending, "rows": rows, "versions": R.versions("torch", "xgrammar")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
