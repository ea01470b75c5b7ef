"""Issue 35's check over HTTP: dev-split JSON Schemas (none of them seen by the packs or the draft, which learnt from
synthetic schemas) through the README's vLLM launcher with the real model, at a max_tokens, and each answer counted:
complete and valid, cut off (finish "length"), invalid, refused up front (4xx naming why), or failed (5xx, a closed
connection).  Not a test: figures for docs/BENCHMARKS.md ("Budget feasibility on vLLM").

    python scripts/vllm_budget_http.py [--schemas 40] [--max-tokens 200] [--model smollm2-135m]
        [--draft smollm2-135m-draft] [--concurrency 8] [--seed 0]

The launcher is started here (``python -m specgrammar_vllm.serve MODEL --grammar-spec 4 --grammar-draft DRAFT``)
and stopped at the end; ``../shared/data/jsonschemabench/dev`` must be present.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor


def _post(url: str, body: dict, timeout: float = 600.0) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (OSError, ValueError) as e:  # a closed connection, a timeout, a body that is not JSON
        return 0, f"{type(e).__name__}: {e}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    from specgrammar_plugins.bench.real import requests
    from specgrammar_plugins.models.real import resolve_str

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemas", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    items, why = requests(0, a.schemas, a.seed)
    if why:
        print(why, file=sys.stderr)
        return 2
    model, draft = resolve_str(a.model, "vllm"), resolve_str(a.draft, "vllm")
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    cmd = [sys.executable, "-m", "specgrammar_vllm.serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "2048", "--grammar-spec", "4", "--grammar-draft", draft]
    log_path = Path("bench-out") / "vllm_budget_http.log"  # (bench-out/ is ignored by git, as every benchmark's)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if srv.poll() is not None:
                print(f"the launcher exited ({srv.returncode}); see {log_path}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 600:
                print("the launcher did not start within 600 s", file=sys.stderr)
                return 1
            time.sleep(2)

        def one(item):
            body = {"model": model, "max_tokens": a.max_tokens, "temperature": 0, "messages": item["messages"],
                    **item["fields"]}
            status, out = _post(base + "/v1/chat/completions", body)
            if status == 200:
                choice = out["choices"][0]
                text, finish = choice["message"]["content"] or "", choice["finish_reason"]
                if finish == "length":
                    return "cut off", item["name"], text[-80:]
                return ("complete and valid" if item["valid"](text) else "invalid"), item["name"], text[-80:]
            if 400 <= status < 500:
                try:
                    why = json.loads(out)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    why = str(out)
                return "refused up front", item["name"], f"{status}: {why[:300]}"
            return "failed", item["name"], f"{status} {str(out)[:200]}"

        t1 = time.monotonic()
        with ThreadPoolExecutor(a.concurrency) as pool:
            results = list(pool.map(one, items))
        took = time.monotonic() - t1
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
    counts = collections.Counter(r[0] for r in results)
    answered = sum(v for k, v in counts.items() if k != "refused up front")
    print(f"{len(items)} dev-split schemas, max_tokens {a.max_tokens}, {a.model} (+ {a.draft}), T = 0, "
          f"{a.concurrency} at a time, {took:.0f} s")
    for k in ("complete and valid", "cut off", "invalid", "refused up front", "failed"):
        print(f"  {k}: {counts.get(k, 0)}")
    if answered:
        print(f"  complete and valid of the answered: {counts.get('complete and valid', 0) / answered:.1%}")
    for r in results:
        if r[0] != "complete and valid":
            print(f"  {r[0]}: {r[1]}: {r[2]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
