"""``specgrammar soak``: a long burst of mixed requests against a running server, with a report.

    specgrammar demo --serve --port 8080 &              # mlx_lm.server --plugin specgrammar on the tiny pair
    specgrammar soak --url http://127.0.0.1:8080 --pid $! -n 2000 -c 8
    specgrammar soak --url http://127.0.0.1:8000 --host-kind vllm -n 500   # our vLLM launcher (specgrammar_vllm.serve)

The mix (seeded, ``mixed_jobs``): constrained requests over the structured workloads in every request spelling
the host reads (streaming and not), unconstrained prose, invalid constraints (each must be answered with HTTP 400)
and streaming requests whose client disconnects after a few chunks.  Each answer is checked: a finished
(``stop``) constrained answer must be in its language (``workloads.is_valid``: ``re.fullmatch``, ``jsonschema``, the
SQL grammar's regex), one cut by ``max_tokens`` (``length``) must be a prefix of the language (walked through a
matcher).  The report counts each outcome and gives latency p50/p99 and the server's RSS (``/proc/PID/status``
VmRSS) at the start, at its peak and at the end.

The request mix is what ``tests/test_concurrency.py`` sends too (its servers come from ``tests/servers.py``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import workloads as W

KINDS = ("constrained", "unconstrained", "invalid", "cancelled")
DEFAULT_MIX = {"constrained": 0.5, "unconstrained": 0.15, "invalid": 0.2, "cancelled": 0.15}

# (request fields, what the 400 body must mention): each is refused by both hosts
INVALID = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"structured_outputs": {"regex": "[0-9"}}, ""),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}, ""),
]
INVALID_VLLM_ONLY = [  # killed vLLM 0.32's engine core before our launcher's gate (serve.SpecgrammarGate)
    ({"vllm_xargs": {"specgrammar": "recipe"}}, "vllm_xargs.specgrammar must be an object"),
]
INVALID_MLX_ONLY = [  # fields only our mlx plugin reads (vLLM ignores unknown fields)
    ({"grammar": "root ::= missing_rule"}, "invalid constraint"),
    ({"regex": "[0-9]+", "json_schema": {"type": "object"}}, "only one constraint"),
    ({"regex": "[0-9]+", "specgrammar": {"k": -1}}, "specgrammar.k"),
    ({"regex": "[0-9]+", "specgrammar": {"drafters": ["nope"]}}, "unknown drafter"),
    ({"regex": "a{0}b[^\\x00-\\U0010FFFF]"}, "matches no string"),  # an empty language
]


def spellings(workload: str, host: str) -> list[dict]:
    """Request fields asking for ``workload``'s constraint in the spellings ``host`` (mlx / vllm) reads."""
    spec = W.constraint(workload)
    if spec.kind == "json_schema":
        out = [{"response_format": {"type": "json_schema", "json_schema": {"name": workload, "schema": spec.schema}}},
               {"structured_outputs": {"json": spec.schema}}]
        if host == "mlx":
            out += [{"json_schema": spec.schema, "specgrammar": {"k": 3}}]
    elif spec.kind == "regex":
        out = [{"structured_outputs": {"regex": spec.value}}]
        if host == "mlx":
            out += [{"response_format": {"type": "regex", "regex": spec.value}}, {"regex": spec.value}]
    else:
        out = [{"structured_outputs": {"grammar": spec.value}}]
        if host == "mlx":
            out += [{"response_format": {"type": "grammar", "grammar": spec.value, "syntax": "gbnf"}},
                    {"grammar": spec.value, "specgrammar": {"drafters": ["forced", "model"]}}]
    return out


@dataclass
class Job:
    kind: str
    body: dict
    workload: str | None = None
    expect: str = ""  # for invalid jobs: text the 400 body must contain
    cancel_after: int | None = None  # chunks read before the client disconnects


def mixed_jobs(n: int, host: str = "mlx", seed: int = 0, max_tokens: int = 48, mix: dict | None = None,
               model: str = "default_model") -> list[Job]:
    """``n`` seeded jobs in the proportions of ``mix`` (default ``DEFAULT_MIX``), shuffled."""
    mix = mix or DEFAULT_MIX
    r = random.Random(seed)
    counts = {k: int(n * mix.get(k, 0)) for k in KINDS}
    counts["constrained"] += n - sum(counts.values())
    bad = INVALID + (INVALID_MLX_ONLY if host == "mlx" else INVALID_VLLM_ONLY)
    prompts = {w: [e.prompt for e in W.examples(w, "eval", 10)] for w in W.WORKLOADS}
    jobs: list[Job] = []

    def body(user: str, fields: dict, stream: bool, temperature: float) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": user}], "max_tokens": max_tokens,
                "temperature": temperature, "stream": stream, "seed": r.randrange(1 << 30), **fields}

    for i in range(counts["constrained"]):
        w = W.STRUCTURED[i % len(W.STRUCTURED)]
        sp = spellings(w, host)
        jobs.append(Job("constrained", body(r.choice(prompts[w]), sp[r.randrange(len(sp))], r.random() < 0.5,
                                            r.choice([0.0, 0.7, 1.0])), w))
    for _ in range(counts["unconstrained"]):
        jobs.append(Job("unconstrained", body(r.choice(prompts["prose"]), {}, r.random() < 0.5, 0.7), "prose"))
    for i in range(counts["invalid"]):
        fields, expect = bad[i % len(bad)]
        jobs.append(Job("invalid", body("Find the year: 1999", fields, i % 2 == 1, 0.0), expect=expect))
    for i in range(counts["cancelled"]):
        w = W.STRUCTURED[i % len(W.STRUCTURED)]
        fields = spellings(w, host)[0]
        b = body(r.choice(prompts[w]), fields, True, 0.7)
        b["max_tokens"] = max(max_tokens, 64)
        jobs.append(Job("cancelled", b, w, cancel_after=r.randint(1, 3)))
    r.shuffle(jobs)
    return jobs


# ---------------------------------------------------------------------------------------------- checking
_PREFIX: dict = {}


def in_language_prefix(workload: str, text: str) -> bool:
    """``text`` can be continued to a string of ``workload``'s language (walked through an llguidance matcher
    on the bundled tiny tokenizer: the check is on bytes, any byte-level vocabulary spells them)."""
    from .compiler import compile_constraint
    from .models import tiny_tokenizer_info

    if "tok" not in _PREFIX:
        _PREFIX["tok"] = tiny_tokenizer_info()
    c = compile_constraint(W.constraint(workload), _PREFIX["tok"], engine="llguidance")
    return c.matcher().accept_bytes(text.encode("utf-8"))


def outcome(job: Job, status: int, text: str, finish: str | None, body: str = "") -> str:
    """One of: valid, valid_prefix (cut by max_tokens), ok (unconstrained), rejected_400, cancelled, and the
    failures INVALID_OUTPUT, ACCEPTED_INVALID, WRONG_400, HTTP_<code>, EMPTY."""
    if job.kind == "invalid":
        if status == 400:
            return "rejected_400" if job.expect.lower() in body.lower() else "WRONG_400"
        return "ACCEPTED_INVALID" if status == 200 else f"HTTP_{status}"
    if status != 200:
        return f"HTTP_{status}"
    if job.kind == "cancelled":
        return "cancelled"
    if job.kind == "unconstrained":
        return "ok" if finish in ("stop", "length") else "EMPTY"
    if finish == "stop":
        return "valid" if W.is_valid(job.workload, text) else "INVALID_OUTPUT"
    if finish == "length":
        return "valid_prefix" if in_language_prefix(job.workload, text) else "INVALID_OUTPUT"
    return "EMPTY"


# ---------------------------------------------------------------------------------------------- the client
@dataclass
class Result:
    job: Job
    outcome: str
    seconds: float
    text: str = ""
    detail: str = ""


def run_job(host: str, port: int, job: Job, timeout: float = 300.0) -> Result:
    """One request over a fresh HTTP/1.1 connection (streaming read as server-sent events); a cancelled job closes
    the socket after ``cancel_after`` content chunks."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    text, finish, chunks = [], None, 0
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(job.body),
                     headers={"Content-Type": "application/json"})
        sock = conn.sock  # http.client forgets it once the response owns the stream
        resp = conn.getresponse()
        if resp.status != 200 or not job.body.get("stream"):
            raw = resp.read().decode("utf-8", "replace")
            if resp.status == 200:
                choice = json.loads(raw)["choices"][0]
                text, finish = [choice["message"].get("content") or ""], choice.get("finish_reason")
            return Result(job, outcome(job, resp.status, "".join(text), finish, raw), time.perf_counter() - t0,
                          "".join(text), raw[:300] if resp.status != 200 else "")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    chunks += 1
                finish = ch.get("finish_reason") or finish
            if job.cancel_after is not None and chunks >= job.cancel_after:
                sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
                break
        return Result(job, outcome(job, 200, "".join(text), finish), time.perf_counter() - t0, "".join(text))
    except Exception as e:  # a broken answer is an outcome to count, never the end of the burst
        return Result(job, f"ERROR_{type(e).__name__}", time.perf_counter() - t0, "".join(text), str(e)[:300])
    finally:
        conn.close()


def rss_kib(pid: int, children: bool = True) -> int:
    """Resident set size of ``pid`` (and, by default, its children: the compile workers) in KiB, from /proc."""
    total = 0
    for p in [pid] + (_children(pid) if children else []):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


class RssSampler:
    """Samples the RSS of ``pid`` every ``period`` seconds in a thread; ``peak`` is the largest seen."""

    def __init__(self, pid: int | None, period: float = 0.25):
        self.pid, self.period, self.peak = pid, period, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_kib(self.pid))
            self._stop.wait(self.period)

    def __enter__(self):
        if self.pid:
            self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._t.is_alive():
            self._t.join()


def burst(host: str, port: int, jobs: list[Job], concurrency: int, timeout: float = 300.0) -> list[Result]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda j: run_job(host, port, j, timeout), jobs))


FAILURES = ("INVALID_OUTPUT", "ACCEPTED_INVALID", "WRONG_400", "HTTP_", "EMPTY", "ERROR_")


def failed(results: list[Result]) -> list[Result]:
    return [r for r in results if r.outcome.startswith(FAILURES)]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def report(results: list[Result], wall: float, rss: tuple[int, int, int] | None) -> dict:
    done = [r.seconds for r in results if r.job.kind != "cancelled" and not r.outcome.startswith("ERROR_")]
    out = {"requests": len(results), "wall_s": round(wall, 1),
           "by_kind": dict(Counter(r.job.kind for r in results)),
           "outcomes": dict(sorted(Counter(r.outcome for r in results).items())),
           "failures": len(failed(results)),
           "latency_p50_s": round(percentile(done, 50), 3), "latency_p99_s": round(percentile(done, 99), 3)}
    if rss:
        out["rss_mib"] = {"start": round(rss[0] / 1024, 1), "peak": round(rss[1] / 1024, 1),
                          "end": round(rss[2] / 1024, 1)}
    out["first_failures"] = [{"kind": r.job.kind, "workload": r.job.workload, "outcome": r.outcome,
                              "text": r.text[:200], "detail": r.detail[:200]} for r in failed(results)[:5]]
    return out


def soak(host: str, port: int, pid: int | None, jobs: list[Job], concurrency: int) -> dict:
    start = rss_kib(pid) if pid else 0
    t0 = time.perf_counter()
    with RssSampler(pid) as sampler:
        results = burst(host, port, jobs, concurrency)
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # let the server finish the requests whose clients went away
    end = rss_kib(pid) if pid else 0
    return report(results, wall, (start, max(sampler.peak, start, end), end) if pid else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar soak", description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the running server, e.g. http://127.0.0.1:8080")
    ap.add_argument("--pid", type=int, default=None, help="its process id, for RSS")
    ap.add_argument("--host-kind", choices=("mlx", "vllm"), default="mlx",
                    help="which request spellings to send (default mlx)")
    ap.add_argument("-n", "--requests", type=int, default=2000)
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=16, help="requests sent before the RSS baseline is read")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the report as JSON only")
    a = ap.parse_args(argv)
    from urllib.parse import urlparse

    u = urlparse(a.url)
    if not u.hostname:
        ap.error(f"--url {a.url!r} has no host (e.g. http://127.0.0.1:8080)")
    host, port, kind = u.hostname, u.port or 80, a.host_kind
    if a.warmup:
        burst(host, port, mixed_jobs(a.warmup, kind, seed=a.seed + 1, max_tokens=a.max_tokens), a.concurrency)
    jobs = mixed_jobs(a.requests, kind, seed=a.seed, max_tokens=a.max_tokens)
    rep = {"host": kind, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
           **soak(host, port, a.pid, jobs, a.concurrency)}
    if a.json:
        print(json.dumps(rep, indent=1))
    else:
        for k, v in rep.items():
            print(f"{k:>16}: {v}")
    return 1 if rep["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
