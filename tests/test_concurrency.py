"""32 concurrent mixed requests against real servers on 127.0.0.1: ``mlx_lm.server --plugin specgrammar`` (with the
draft model: our loop; without: mlx-lm's batching path with our processor) and our vLLM launcher (with the draft
model: vLLM's draft_model made grammar-aware, forced tokens first; without: GrammarProposer through custom_class).

The mix (``specgrammar_plugins.soak.mixed_jobs``, seeded): constrained requests over every structured workload in
the spellings the host reads, streaming and not, at T = 0 / 0.7 / 1; unconstrained prose; invalid constraints;
streaming requests whose client disconnects after 1-3 chunks.  Every burst is bounded in time, and:

- every finished constrained answer is in its language (``re.fullmatch`` / ``jsonschema`` / the SQL grammar's
  regex), every answer cut by max_tokens is a prefix of it; every invalid request gets HTTP 400 naming the
  reason; nothing else (no 500, no connection error, no empty answer);
- the server's memory returns to its baseline: a warm-up burst first (compile cache, prompt cache, allocator
  pools fill up), then the baseline RSS (``/proc/PID/status`` VmRSS of the server process, which holds every
  request's state; its compile workers, at most ``SPECGRAMMAR_COMPILE_WORKERS`` processes with no cache of their
  own, are started on demand and would only add noise), then two more bursts of
  the same mix with other seeds; the RSS after them must be within ``RSS_TOLERANCE_MIB`` of the baseline.  Leaking
  per-request state (matchers, masks, draft caches, the token history of cancelled requests) grows it with every
  burst;
- the server still answers a plain request afterwards.
"""

from __future__ import annotations

import time

import pytest

from servers import launch_mlx, launch_vllm
from specgrammar_plugins import soak

pytest.importorskip("jsonschema")

N = 32
BURST_S = 300  # a hang bound, not a speed assertion
RSS_TOLERANCE_MIB = 48


def _check_burst(srv, seed: int, host: str) -> list[soak.Result]:
    jobs = soak.mixed_jobs(N, host, seed=seed, max_tokens=40)
    t0 = time.monotonic()
    results = soak.burst(srv.host, srv.port, jobs, concurrency=N, timeout=BURST_S)
    assert time.monotonic() - t0 < BURST_S
    bad = soak.failed(results)
    assert not bad, [(r.job.kind, r.job.workload, r.outcome, r.text[:120], r.detail[:200], r.job.body)
                     for r in bad[:4]]
    kinds = {k: sum(r.job.kind == k for r in results) for k in soak.KINDS}
    assert all(kinds.values()), kinds  # the mix has every kind
    assert sum(r.outcome == "rejected_400" for r in results) == kinds["invalid"]
    assert sum(r.outcome in ("valid", "valid_prefix") for r in results) == kinds["constrained"]
    return results


def _memory_returns_to_baseline(srv, host: str) -> None:
    _check_burst(srv, seed=100, host=host)  # warm-up
    time.sleep(1.0)
    base = soak.rss_kib(srv.pid, children=False)
    for seed in (101, 102):
        _check_burst(srv, seed=seed, host=host)
    time.sleep(1.0)
    end = soak.rss_kib(srv.pid, children=False)
    grew = (end - base) / 1024
    assert grew < RSS_TOLERANCE_MIB, f"RSS {base / 1024:.0f} MiB -> {end / 1024:.0f} MiB after two bursts"
    r = soak.run_job(srv.host, srv.port, soak.Job("unconstrained", {
        "model": "default_model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "prose"))
    assert r.outcome == "ok", r


def _served(launch, folder, **kw):
    """A server from ``servers.launch_*`` for a module's tests, stopped after them."""
    from specgrammar_plugins.models import tiny_path

    if not (tiny_path("target") / "model.safetensors").exists():
        pytest.skip("the tiny target model is not in the tree")
    srv = launch(folder, **kw)
    yield srv
    srv.stop()


def _burst_and_check(srv, kind: str) -> None:
    try:
        _memory_returns_to_baseline(srv, kind)
    except AssertionError:
        print(srv.log.read_text()[-3000:])
        raise
    assert srv.proc.poll() is None


# ---------------------------------------------------------------------------------------------- mlx-lm
@pytest.fixture(scope="module", params=["draft", "batch"])
def mlx_server(request, tmp_path_factory):
    pytest.importorskip("mlx_lm")
    yield from _served(launch_mlx, tmp_path_factory.mktemp(f"mlx-{request.param}"),
                       draft=request.param == "draft")


def test_mlx_server_under_32_concurrent_mixed_requests(mlx_server):
    _burst_and_check(mlx_server, "mlx")


# ---------------------------------------------------------------------------------------------- vLLM
@pytest.fixture(scope="module", params=["draft", "custom_class"])
def vllm_server(request, tmp_path_factory):
    pytest.importorskip("vllm")
    yield from _served(launch_vllm, tmp_path_factory.mktemp(f"vllm-{request.param}"), draft=request.param == "draft")


def test_vllm_server_under_32_concurrent_mixed_requests(vllm_server):
    _burst_and_check(vllm_server, "vllm")
