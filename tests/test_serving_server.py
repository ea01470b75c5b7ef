"""A server's process-wide pieces in the core (``serving``; issue 34, moved out of the vLLM launcher and the mlx-lm
plugin): ``server_compiles`` (compiles in a killable worker unless the environment says otherwise), ``Warmup``
(a one-time set-up a request waits for outside its deadline; a failure logged, never fatal), ``drop_costly``."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from specgrammar_plugins.api import (COMPILE_CACHE, LIMITS, TRIM_SLACK_BYTES, Warmup, drop_costly, prepare_deadline,
                                     rss_bytes, server_compiles)


@pytest.mark.parametrize("env, want", [(None, "process"), ("thread", "thread"), (" process ", "process")])
def test_a_servers_compiles_run_in_a_worker_unless_told(monkeypatch, env, want):
    monkeypatch.setattr(LIMITS, "compile_isolation", "thread")
    if env is None:
        monkeypatch.delenv("SPECGRAMMAR_COMPILE_ISOLATION", raising=False)
    else:
        monkeypatch.setenv("SPECGRAMMAR_COMPILE_ISOLATION", env)
    server_compiles()  # (no prestart: the worker starts at the first compile)
    assert LIMITS.compile_isolation == want


def test_a_request_waits_for_the_warm_up_outside_its_deadline():
    go = threading.Event()
    w = Warmup(timeout=5.0)
    w.wait()  # nothing started: no wait
    w.start(lambda: go.wait(5.0), logging.getLogger("specgrammar.test"))
    assert not w.done.is_set()
    threading.Timer(0.3, go.set).start()
    with prepare_deadline(0.2) as deadline:  # a deadline shorter than the set-up
        t0 = time.monotonic()
        w.wait(deadline)
        assert time.monotonic() - t0 >= 0.25 and w.done.is_set()
        assert deadline.expired() is None and deadline.wall_left() > 0.1  # the wait did not count


def test_a_failed_warm_up_is_logged_and_never_blocks(caplog):
    w = Warmup(timeout=5.0)

    def fail():
        raise RuntimeError("ñandú")

    with caplog.at_level(logging.WARNING, logger="specgrammar.test"):
        w.start(fail, logging.getLogger("specgrammar.test"))
        w.wait()
    assert w.done.is_set() and "gate warm-up failed (RuntimeError: ñandú)" in caplog.text


def test_costly_work_empties_our_compile_cache():
    from specgrammar_plugins.api import ConstraintSpec, compile_constraint
    from specgrammar_plugins.testing import toy_tokenizer

    compile_constraint(ConstraintSpec.regex("[0-9]{3}"), toy_tokenizer(), engine="dfa")
    assert drop_costly(None) is None and drop_costly(rss_bytes()) is None and len(COMPILE_CACHE)
    grew = drop_costly(rss_bytes() - 2 * TRIM_SLACK_BYTES)  # as if the work had grown the heap past the slack
    assert grew is not None and grew > TRIM_SLACK_BYTES and len(COMPILE_CACHE) == 0
