"""Benchmark ``mlx_server``: concurrent JSON Schema requests over HTTP against ``mlx_lm.server --plugin specgrammar``.

One run starts the patched mlx-lm server four times on the same target (OpenBLAS preloaded when installed; the four
at once, each warmed up, then the runs interleaved: run 1 of every configuration, then run 2, ..., so a shared
machine's load falls on every configuration alike; ``ratios_paired``: each run against loop-serial's run of the
same round) and
sends the same ``--n`` JSON Schema requests (``json_extraction`` eval prompts, ``response_format`` json_schema,
greedy, the budget on as by default) in seven ways:

    loop-serial            --draft-model --specgrammar-batch never: our serial speculative loop (grammar-aware
                           drafts, exact verification), the requests one after another (before issue 34 the server
                           served concurrent requests this way too: mlx-lm turns batching off with a draft model)
    draft-serial           --draft-model (``--specgrammar-batch auto``, the default), one after another: each
                           constrained request, arriving alone, is a batch of one on the batching path (a speculative
                           row drafting with the draft model as our loop does)
    draft-concurrent       the same server, all requests at once: every one a speculative row of one batch (the first
                           a batch of one that the others join; one batched draft forward per draft position, one
                           batched verification forward per round)
    spec-batch-concurrent  no draft model: the batching path with speculative rows (``SpecGenerationBatch``,
                           ``--specgrammar-batch-drafts on``, the default): every row drafts under its own grammar
                           (forced, recipe, layout, prompt copy, suffix), one batched forward verifies all rows
    spec-batch-serial      the same server, one after another (each request a speculative row alone)
    batch-concurrent       no draft model, ``--specgrammar-batch-drafts off``: mlx-lm's own BatchGenerator, every row
                           with our grammar logits processor, no drafts: one token per row per batched forward
    batch-serial           the same server, one after another (plain constrained decoding, no drafts)

Each run (``--reps`` of them per configuration) sends the set ``--bursts`` times back to back (default 4 on the
tiny pair, whose set takes a quarter of a second, 1 on SmolLM2): a run's wall is the sum, its tokens the sum, so
every configuration measures the same amount of work and a short set is not timed alone.  Reported per
configuration: the median run by tokens/s (``--pick fastest``: the fastest, as before issue 34's bursts; every
run's wall, in order, in the JSON, ``walls_s``, and the fastest run's ratio too, ``ratio_fastest_vs_loop_serial``):
wall seconds for the whole set (the run's wall over its bursts), completion tokens (the server's ``usage``), aggregate
tokens/s and its ratio to ``loop-serial``, tokens per target pass per request (our loop and each speculative row:
from the server's log line per request, a row's first token's pass, the prefill's, counted; mlx-lm's own rows
decode one token per target forward: 1.00), how many requests our loop served, how many outputs are valid,
and whether each request's output equals its ``batch-serial`` output (the batched rows against plain constrained
decoding of the same request alone) and its ``loop-serial`` output.  The load average is recorded before and after
each configuration (the machine may be shared: compare ratios within one run).

    specgrammar bench mlx_server [--model tiny|smollm2-135m] [--n 8] [--max-tokens 64] [--k 4] [--reps 1]
                                 [--bursts 4|1] [--pick median|fastest] [--out-dir bench-out/mlx_server] [--quick]
                                 [--in-process]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIGS = ("loop-serial", "draft-serial", "draft-concurrent", "spec-batch-concurrent", "spec-batch-serial",
           "batch-concurrent", "batch-serial")
# (server, concurrent) -> configuration; servers: draft model, serial loop only | draft model | speculative rows, no
# draft | no drafts at all
_NAMES = {("loop", False): "loop-serial", ("draft", False): "draft-serial", ("draft", True): "draft-concurrent",
          ("spec", False): "spec-batch-serial", ("spec", True): "spec-batch-concurrent",
          ("plain", False): "batch-serial", ("plain", True): "batch-concurrent"}
_LOOP_LINE = re.compile(r"specgrammar( batch)?: (\d+) tokens, (\d+) target passes")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _models(name: str) -> tuple[str, str, str]:
    """(target folder, draft folder, what) for ``tiny`` or the real model."""
    if name == "tiny":
        from ..models import tiny_path

        return str(tiny_path("target")), str(tiny_path("draft")), "the bundled tiny pair"
    from ..models.real import SMOLLM2, smollm2_draft, smollm2_hf_folder

    target = str(smollm2_hf_folder())
    draft = smollm2_draft("mlx_lm")
    if draft is None:
        raise SystemExit(f"{SMOLLM2}: no draft model is built for mlx-lm (specgrammar models list)")
    return target, str(draft), f"{SMOLLM2} with its draft model"


class _Server:
    """The patched ``mlx_lm.server --plugin specgrammar`` in a process of its own (stopped by ``stop``)."""

    def __init__(self, root: Path, target: str, draft: str | None, k: int, max_tokens: int, log: Path,
                 batch_drafts: bool = True, batch: str = "auto"):
        from specgrammar_mlx_lm.blas import openblas_path

        self.port = _free_port()
        self.log = log
        cmd = [sys.executable, "-m", "mlx_lm.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--model", target, "--max-tokens", str(max_tokens), "--plugin", "specgrammar", "--log-level", "INFO"]
        if draft:
            cmd += ["--draft-model", draft]
        cmd += ["--num-draft-tokens", str(k), "--specgrammar-batch-drafts", "on" if batch_drafts else "off",
                "--specgrammar-batch", batch]
        # the preparation deadline (5 s by default) is not what this measures: on a shared machine a new schema's
        # budget walk can overrun it, and the warm-up request would get a 400
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
                   SPECGRAMMAR_PREPARE_TIMEOUT_S=os.environ.get("SPECGRAMMAR_PREPARE_TIMEOUT_S", "120"),
                   PYTHONPATH=os.pathsep.join(x for x in (str(root), os.environ.get("PYTHONPATH")) if x))
        lib = openblas_path()
        if lib and sys.platform.startswith("linux"):
            env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
        self._fh = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._wait()

    def _wait(self, timeout: float = 300.0) -> None:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()[-3000:]}")
            try:
                self.ask({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                return
            except OSError:
                if time.monotonic() - t0 > timeout:
                    self.stop()
                    raise RuntimeError("the server did not start in time")
                time.sleep(0.5)

    def ask(self, body: dict, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def loop_lines(self) -> list[tuple[int, int, bool]]:
        """(tokens, target passes, batched) of each request our loop or a speculative row served, from the server's
        log, in order."""
        return [(int(a), int(b), bool(c)) for c, a, b in _LOOP_LINE.findall(self.log.read_text())]

    def stop(self) -> None:
        from ..testing import stop_server

        stop_server(self.proc)
        self._fh.close()


def _bodies(n: int, max_tokens: int) -> list[dict]:
    from ..workloads import examples

    exs = examples("json_extraction", "eval", n)
    if len(exs) < n:
        exs = [exs[i % len(exs)] for i in range(n)]
    return [{"messages": [{"role": "user", "content": ex.prompt}], "max_tokens": max_tokens, "temperature": 0.0,
             "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": ex.constraint.schema}}} for ex in exs]


def _send(server: _Server, bodies: list[dict], concurrent: bool, bursts: int = 1) -> dict:
    """The set ``bursts`` times back to back (all at once each time when ``concurrent``, else one request after
    another): wall and tokens summed over the bursts; ``texts``: the first burst's answers (``bursts_equal``: whether
    every burst answered the same)."""
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    sets = []
    for _ in range(bursts):
        if concurrent:
            with ThreadPoolExecutor(len(bodies)) as pool:
                sets.append(list(pool.map(server.ask, bodies)))
        else:
            sets.append([server.ask(b) for b in bodies])
    wall = time.perf_counter() - t0
    texts = [[a["choices"][0]["message"]["content"] for a in answers] for answers in sets]
    tokens = sum(int(a["usage"]["completion_tokens"]) for answers in sets for a in answers)
    return {"wall_s": round(wall / bursts, 4), "tokens": tokens // bursts, "tokens_per_s": round(tokens / wall, 2),
            "texts": texts[0], "bursts_equal": all(t == texts[0] for t in texts),
            "load_before": load0, "load_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def default_bursts(model: str) -> int:
    """Bursts per run: the tiny pair's set takes ~0.25 s, too little work to time alone on a shared machine."""
    return 4 if model == "tiny" else 1


def run(model: str, n: int, max_tokens: int, k: int, workdir: Path, reps: int = 1, bursts: int = 1,
        pick: str = "median") -> dict:
    from specgrammar_mlx_lm.patch import patched_root

    from ..workloads import is_valid

    target, draft, what = _models(model)
    root = patched_root(workdir / "mlx")[0]
    bodies = _bodies(n, max_tokens)
    servers: dict[str, _Server] = {}
    tries: dict[str, list] = {name: [] for name in CONFIGS}
    before: dict[str, int] = {}
    try:
        for kind in ("loop", "draft", "spec", "plain"):
            log = workdir / f"server-{kind}.log"
            server = servers[kind] = _Server(root, target, draft if kind in ("loop", "draft") else None, k,
                                             max_tokens, log, batch_drafts=kind != "plain",
                                             batch="never" if kind == "loop" else "auto")
            # warm-up, not timed: the compile cache, the first forward, and the batching path's first batch (the
            # serial-loop server: the same requests one after another)
            server.ask(bodies[0])
            _send(server, bodies, kind != "loop")
            before[kind] = len(server.loop_lines())
        # the runs interleaved: run r of every configuration, then run r + 1 (the servers idle while another is
        # timed), so each configuration's runs see the shared machine's load of the same minutes
        for rep in range(reps):
            for kind, server in servers.items():
                for concurrent in ((False,) if kind == "loop" else (False, True)):
                    name = _NAMES[kind, concurrent]
                    if rep == 0:
                        print(f"  {name} ...", flush=True)
                    row = _send(server, bodies, concurrent, bursts)
                    lines = server.loop_lines()[before[kind]:]
                    before[kind] += len(lines)
                    tries[name].append((row, lines))
    finally:
        for server in servers.values():
            server.stop()
    rows: dict[str, dict] = {}
    for name in CONFIGS:
        runs = tries[name]
        walls = [t[0]["wall_s"] for t in runs]  # in order
        ranked = sorted(runs, key=lambda t: t[0]["wall_s"])
        fastest = ranked[0][0]
        # the median run (--pick median, the default; of an even count the faster middle one), else the fastest (the
        # least disturbed on a shared machine)
        row, lines = ranked[(len(ranked) - 1) // 2] if pick == "median" else ranked[0]
        row = dict(row)
        row["walls_s"] = walls
        row["fastest_wall_s"] = fastest["wall_s"]
        row["fastest_tokens_per_s"] = fastest["tokens_per_s"]
        row["bursts_equal"] = all(t[0]["bursts_equal"] for t in runs)
        row["tokens_per_s_runs"] = [t[0]["tokens_per_s"] for t in runs]
        # our loop's requests and the speculative rows (a log line each, every burst's); mlx-lm's own rows: one
        # token per row per forward
        row["tokens_per_pass"] = ([round(t / p, 3) if p else None for t, p, _ in lines]
                                  + [1.0] * (bursts * len(bodies) - len(lines)))
        row["served_by_loop"] = sum(not b for _, _, b in lines) // bursts
        row["speculative_rows"] = sum(b for _, _, b in lines) // bursts
        rows[name] = row
    base = rows["loop-serial"]
    plain = rows["batch-serial"]["texts"]
    for name, row in rows.items():
        row["ratio_vs_loop_serial"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        row["ratio_fastest_vs_loop_serial"] = round(row["fastest_tokens_per_s"] / base["fastest_tokens_per_s"], 3)
        # per run against loop-serial's run of the same round (interleaved: the same minutes' load), and their median
        paired = sorted(a / b for a, b in zip(row["tokens_per_s_runs"], base["tokens_per_s_runs"]))
        row["ratios_paired"] = [round(x, 3) for x in paired]
        row["ratio_paired_median"] = round(paired[(len(paired) - 1) // 2], 3)
        row["valid"] = sum(is_valid("json_extraction", t) for t in row["texts"])
        row["equal_to_batch_serial"] = sum(a == b for a, b in zip(row["texts"], plain))
        row["equal_to_loop_serial"] = sum(a == b for a, b in zip(row["texts"], base["texts"]))
        tpp = [x for x in row["tokens_per_pass"] if x]
        row["tokens_per_pass_mean"] = round(sum(tpp) / len(tpp), 3) if tpp else None
    return {"model": model, "what": what, "n": n, "max_tokens": max_tokens, "k": k, "reps": reps,
            "bursts": bursts, "pick": pick, "rows": rows}


def in_process(model: str, n: int, max_tokens: int, k: int) -> dict:
    """``--in-process``: the same requests without HTTP, in this process: a speculative batch
    (``specgrammar_mlx_lm.batch.batch_generate``) and our serial loop (``stream_generate``) with the same model-free
    chain, k.  Order: one serial pass (warm-up: compiles; the learning drafters see each answer once), a batch, the
    timed serial pass, the timed batch; each row's tokens per target pass in both (at the same drafter state they
    are the same drafts and verdicts), the batch's target passes, its padding share and the time of its forwards
    and of its per-row rollback.  Then the same with the draft model (``draft``: the batch's rows drafting with it
    in one batched draft pass per position, ``MLXDraftBatch``, against our serial loop with it; the fastest of three
    timed runs of each, alternated, after one of each untimed)."""
    from mlx_lm import load

    from specgrammar_mlx_lm.batch import BatchRequest, batch_generate
    from specgrammar_mlx_lm.generate import generate_tokens

    from ..workloads import chat_prompt

    target, draft_dir, what = _models(model)
    lm, tok = load(target)
    reqs = [BatchRequest(list(tok.encode(chat_prompt(b["messages"][0]["content"]), add_special_tokens=False)),
                         constraint=_spec(b), max_tokens=max_tokens) for b in _bodies(n, max_tokens)]

    def serial():
        return [generate_tokens(lm, tok, list(r.prompt), max_tokens=max_tokens, constraint=r.constraint,
                                num_draft_tokens=k, temperature=0.0) for r in reqs]

    serial()
    first, _ = batch_generate(lm, tok, reqs, k=k)
    t0 = time.perf_counter()
    ser = serial()
    t_serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs, tgt = batch_generate(lm, tok, reqs, k=k)
    t_batch = time.perf_counter() - t0
    return {"model": model, "what": what, "n": n, "max_tokens": max_tokens, "k": k,
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "serial_s": round(t_serial, 2), "batch_s": round(t_batch, 2),
            "tokens": [sum(s.emitted for _, s in ser), sum(s.emitted for _, s in outs)],
            "equal": sum(a[0] == b[0] for a, b in zip(ser, outs)),
            "tokens_per_pass_first_batch": [round(s.tokens_per_pass, 2) for _, s in first],
            "tokens_per_pass_serial": [round(s.tokens_per_pass, 2) for _, s in ser],
            "tokens_per_pass_batch": [round(s.tokens_per_pass, 2) for _, s in outs],
            "serial_passes": sum(s.target_passes for _, s in ser), "batch_passes": tgt.passes,
            "padding_share": round(tgt.padding / max(tgt.fed, 1), 3), "forward_s": round(tgt.forward_s, 2),
            "rollback_s": round(tgt.rollback_s, 3), "draft": _in_process_draft(lm, tok, load(draft_dir)[0], reqs, k)}


def _in_process_draft(lm, tok, draft, reqs, k: int, reps: int = 3) -> dict:
    """``in_process`` with the draft model: our serial loop with it against ``batch_generate`` with it."""
    from specgrammar_mlx_lm.batch import batch_generate
    from specgrammar_mlx_lm.generate import generate_tokens

    def serial():
        return [generate_tokens(lm, tok, list(r.prompt), max_tokens=r.max_tokens, constraint=r.constraint,
                                num_draft_tokens=k, temperature=0.0, draft_model=draft) for r in reqs]

    walls: dict[str, list[float]] = {"serial": [], "batch": []}
    for i in range(reps + 1):
        t0 = time.perf_counter()
        ser = serial()
        t1 = time.perf_counter()
        outs, tgt = batch_generate(lm, tok, reqs, k=k, draft_model=draft)
        t2 = time.perf_counter()
        if i:  # the first of each: warm-up
            walls["serial"].append(round(t1 - t0, 3))
            walls["batch"].append(round(t2 - t1, 3))
    return {"serial_s": min(walls["serial"]), "batch_s": min(walls["batch"]),
            "ratio": round(min(walls["serial"]) / min(walls["batch"]), 2), "walls_s": walls,
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "equal": sum(a[0] == b[0] for a, b in zip(ser, outs)),
            "tokens_per_pass_serial": [round(s.tokens_per_pass, 2) for _, s in ser],
            "tokens_per_pass_batch": [round(s.tokens_per_pass, 2) for _, s in outs],
            "batch_passes": tgt.passes, "draft_passes": tgt.draft_passes,
            "model_drafts": sum(s.drafted_by_source.get("model", 0) for _, s in outs)}


def _spec(body: dict):
    from ..constraint import ConstraintSpec

    return ConstraintSpec.json_schema(body["response_format"]["json_schema"]["schema"])


def table(result: dict) -> str:
    from . import _report as R

    rows = result["rows"]
    n = result["n"]
    body = [[name, f"{r['wall_s']:.2f}", r["tokens"], f"{r['tokens_per_s']:.1f}", f"{r['ratio_vs_loop_serial']:.2f}",
             R.fmt(r.get("ratio_paired_median")),
             R.fmt(r["tokens_per_pass_mean"]), f"{r.get('served_by_loop', 0)}/{n}",
             f"{r.get('speculative_rows', 0)}/{n}", f"{r['valid']}/{n}",
             f"{r['equal_to_batch_serial']}/{n}", f"{r['equal_to_loop_serial']}/{n}",
             f"{r['load_before']:.2f} / {r['load_after']:.2f}"]
            for name, r in rows.items()]
    return R.md_table(["configuration", "wall s", "tokens", "tokens/s", "vs loop-serial", "paired (median)", "tokens/target pass",
                       "by our loop", "speculative rows", "valid", "= batch-serial", "= loop-serial",
                       "load avg before / after"], body, right=range(1, 13))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from specgrammar_mlx_lm.blas import preloaded, reexec_with_openblas

    reexec_with_openblas("specgrammar_plugins.bench.mlx_server", argv)
    from . import _report as R

    ap = argparse.ArgumentParser(prog="specgrammar bench mlx_server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"),
                    help="tiny (the bundled pair, default) or smollm2-135m (the real model with its draft)")
    ap.add_argument("--n", type=int, default=None, help="requests (default 8; quick 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64; quick 32")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round of our loop (--num-draft-tokens)")
    ap.add_argument("--reps", type=int, default=1, help="runs of each configuration; the median is reported "
                                                        "(--pick; every run's wall in the JSON)")
    ap.add_argument("--bursts", type=int, default=None,
                    help="sets sent back to back per run, timed together (default 4 on tiny, 1 on smollm2-135m; "
                         "quick 1)")
    ap.add_argument("--pick", default="median", choices=("median", "fastest"),
                    help="which run is reported: the median by wall (default) or the fastest")
    ap.add_argument("--in-process", action="store_true",
                    help="no server: the speculative batch against our serial loop in this process (see in_process)")
    R.add_common_args(ap, "mlx_server")
    args = ap.parse_args(argv)
    n = args.n or (4 if args.quick else 8)
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    print(f"BLAS: {preloaded() or 'reference (mlx wheel default; apt-get install -y libopenblas0-pthread)'}")
    rep = R.Report("mlx_server", args, argv)
    if args.in_process:
        result = in_process(args.model, n, max_tokens, args.k)
        print(json.dumps(result, indent=1))
        rep.write({**result, "blas": preloaded()})
        return 0
    with tempfile.TemporaryDirectory(prefix="specgrammar-bench-mlx-server-") as tmp:
        bursts = args.bursts or (1 if args.quick else default_bursts(args.model))
        result = run(args.model, n, max_tokens, args.k, Path(tmp), reps=max(1, args.reps), bursts=max(1, bursts),
                     pick=args.pick)
    print()
    print(table(result))
    print(f"\n{result['pick']} of {result['reps']} runs of {result['bursts']} bursts each; "
          f"{time.perf_counter() - rep.t0:.0f}s; command: specgrammar bench mlx_server " + " ".join(argv))
    rep.write({**result, "blas": preloaded()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
