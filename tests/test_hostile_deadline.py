"""The preparation deadline charges a request its own CPU time, with a wall-clock backstop (issue 33).

The deadline was wall-clock: on a loaded machine it refused ordinary requests (16 of 40 dev-split schemas at load
~28), which had only waited for a core.  ``bounds.Deadline`` now charges a request the CPU of its own work (the
preparing thread, a compile thread or compile worker process while it compiles for it) against
``SPECGRAMMAR_PREPARE_TIMEOUT_S``, and bounds its wall-clock time by ``SPECGRAMMAR_PREPARE_WALL_S``.  Here, through
the gate, the compile and the budget check a host runs (``test_hostile_cost.py``'s path, the request's engine):

- a request that burns CPU in a compile (the preparing thread itself idle) is refused by the CPU limit, in a
  compile thread and in a compile worker (killed);
- an ordinary request is not refused on a machine loaded for real (busy child processes, 4 per core, a few
  seconds), where its wall-clock time is past the CPU limit (the old deadline would have refused it);
- a request that waits without burning CPU (for the only compile worker, held by another compile) is refused by
  the wall-clock backstop, in time.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from specgrammar_plugins import ConstraintError, ConstraintSpec, compile_constraint
from specgrammar_plugins import compile_worker
from specgrammar_plugins.bounds import BOUNDS, prepare_deadline
from specgrammar_plugins.compiler import LIMITS
from specgrammar_plugins.gate import check_request
from specgrammar_plugins.speculation import check_budget

from test_hostile_cost import HOST, M, TOK

SLACK_S = 1.0


def prepare(body: dict):
    """What a host does with a request before its first token, with the request's engine."""
    with prepare_deadline() as d:
        checked = check_request(body, HOST)
        compiled = compile_constraint(checked.spec, TOK, engine=checked.options.engine)
        check_budget(compiled, checked.options, checked.max_tokens)
        return d.cpu_used()


def exponential(letters: str, n: int) -> dict:
    """``(x|y)*x(x|y){n}``: its DFA has 2^n states, which the dfa engine (interegular) builds in pure Python, and the
    exact budget explores (about 0.3 s of CPU at n = 9 on the 2-core machine, 3-4 s at n = 12).  Two spellings with
    the same letters' token structure cost the same and share no cache."""
    x, y = letters
    return {"messages": M, "max_tokens": 64, "regex": f"({x}|{y})*{x}({x}|{y}){{{n}}}",
            "specgrammar": {"engine": "dfa"}}


@pytest.fixture(params=["thread", "process"])
def isolation(request, monkeypatch):
    monkeypatch.setattr(LIMITS, "compile_isolation", request.param)
    for engine in ("dfa", "xgrammar"):  # the engines' imports and the worker's start: a server's start-up
        compile_constraint(ConstraintSpec.regex("[c-f]"), TOK, engine=engine, cache=None)
    return request.param


def test_a_request_that_burns_cpu_is_refused_by_its_cpu_limit(isolation, monkeypatch):
    monkeypatch.setattr(BOUNDS, "prepare_timeout_s", 0.3)
    monkeypatch.setattr(BOUNDS, "prepare_wall_s", 20.0)
    killed = compile_worker.POOL.killed
    t, c = time.monotonic(), time.thread_time()
    with pytest.raises(ConstraintError) as e:  # 2^11 states: ~1.5 s of CPU, all of it in the compile
        prepare(exponential("kl" if isolation == "thread" else "mn", 11))
    wall, own = time.monotonic() - t, time.thread_time() - c
    assert "used more than 0.3 s of CPU time" in e.value.reason and "SPECGRAMMAR_PREPARE_TIMEOUT_S" in e.value.reason
    assert "the part that overran: compiling the constraint" in e.value.reason, e.value.reason
    # the CPU came from the compile thread / worker process charged to the request: the preparing thread waited
    assert own < 0.3, own
    assert wall < 20.0, wall  # (refused by the CPU limit, not the backstop)
    if isolation == "process":
        assert compile_worker.POOL.killed == killed + 1


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]


def test_an_ordinary_request_is_not_refused_on_a_loaded_machine(isolation, monkeypatch):
    alone, loaded = ("cd", "ef") if isolation == "thread" else ("gh", "ij")  # (no cache shared between the runs)
    cpu_alone = prepare(exponential(alone, 9))  # its cost alone, as charged
    limit = max(0.5, 2.5 * cpu_alone)
    monkeypatch.setattr(BOUNDS, "prepare_timeout_s", limit)
    monkeypatch.setattr(BOUNDS, "prepare_wall_s", 60.0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    children = _busy(4 * cores)
    try:
        time.sleep(0.2)
        t = time.monotonic()
        charged = prepare(exponential(loaded, 9))  # the same work, not cached: not refused
        wall = time.monotonic() - t
    finally:
        for p in children:
            p.kill()
        for p in children:
            p.wait()
    # the load was real: the wall-clock time is past the CPU limit, so the wall-clock deadline would have refused it
    assert wall > limit, (f"the load did not slow the request (wall {wall:.2f} s, limit {limit:.2f} s): "
                          "this test shows nothing")
    print(f"[{isolation}] alone {cpu_alone:.3f} s CPU; loaded: {charged:.3f} s CPU, {wall:.2f} s wall, limit {limit:.2f} s")
    assert charged < limit, (charged, cpu_alone)


def test_the_wall_clock_backstop_bounds_a_request_that_waits(monkeypatch):
    """The only compile worker is held (another request compiling): a new constraint waits for it without
    burning CPU, and is refused at the backstop, naming it."""
    monkeypatch.setattr(LIMITS, "compile_isolation", "process")
    monkeypatch.setattr(BOUNDS, "prepare_timeout_s", 5.0)
    monkeypatch.setattr(BOUNDS, "prepare_wall_s", 1.0)
    pool = compile_worker.WorkerPool(max_workers=1)
    monkeypatch.setattr(compile_worker, "POOL", pool)
    held = pool._acquire()
    try:
        t, c = time.monotonic(), time.thread_time()
        with pytest.raises(ConstraintError) as e:
            prepare({"messages": M, "max_tokens": 64, "regex": "[c-f]{3}wait", "specgrammar": {"engine": "xgrammar"}})
        wall, own = time.monotonic() - t, time.thread_time() - c
    finally:
        pool._release(held)
        pool.shutdown()
    assert "took longer than 1 s of wall-clock time" in e.value.reason, e.value.reason
    assert "SPECGRAMMAR_PREPARE_WALL_S" in e.value.reason and "compiling the constraint" in e.value.reason
    assert 1.0 <= wall < 1.0 + SLACK_S, wall
    assert own < 0.5, own  # it waited: the CPU limit was not what refused it
