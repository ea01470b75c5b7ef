"""The test tiers of tests/conftest.py name what exists: a file or test listed as slow that was renamed or removed
would silently move its successor into `make test-fast`, or leave a stale entry nobody reads."""

from __future__ import annotations

import ast
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


def test_every_slow_test_listed_exists():
    missing = []
    for fname, names in conftest.SLOW_TESTS.items():
        path = TESTS / fname
        assert path.exists(), f"conftest.SLOW_TESTS lists {fname}, which is not in tests/"
        missing += [f"{fname}::{n}" for n in sorted(set(names) - _test_names(path))]
    assert not missing, f"conftest.SLOW_TESTS lists tests that do not exist: {missing}"


def test_slow_files_are_not_also_listed_by_test():
    both = set(conftest.SLOW_FILES) & set(conftest.SLOW_TESTS)
    assert not both, f"listed whole in SLOW_FILES and by test in SLOW_TESTS: {both}"


def test_every_file_that_builds_a_vllm_engine_in_process_shares_the_vllm_group():
    """scripts/test.sh sizes its xdist workers on one worker holding vLLM's engines: a file that builds one and is
    left out of conftest.VLLM_IN_PROCESS would put a second vLLM on another worker (two did not fit in 24 GB).
    Likewise a file that starts vLLM servers belongs to conftest.VLLM_SERVERS, so two never run at once."""
    import re

    builds = {p.name for p in TESTS.glob("test_*.py") if re.search(r"\b(make_llm|LLM)\(", p.read_text())}
    assert builds <= conftest.VLLM_IN_PROCESS, f"build vLLM engines in process, not in VLLM_IN_PROCESS: " \
                                                f"{sorted(builds - conftest.VLLM_IN_PROCESS)}"
    for name in ("VLLM_IN_PROCESS", "VLLM_SERVERS", "ALONE"):
        missing = [f for f in getattr(conftest, name) if not (TESTS / f).exists()]
        assert not missing, f"conftest.{name} lists files that are not in tests/: {missing}"

    starts = {p.name for p in TESTS.glob("test_*.py")
              if re.search(r"\b(launch_vllm|launch_command)\(|bench\(tmp_path, \"vllm_host\"", p.read_text())}
    apart = conftest.VLLM_SERVERS | conftest.ALONE  # scripts/test.sh runs the ALONE files on no worker
    assert starts <= apart, f"start vLLM servers, not in VLLM_SERVERS or ALONE: {sorted(starts - apart)}"
    assert not conftest.VLLM_SERVERS & conftest.VLLM_IN_PROCESS


def test_a_files_tests_run_on_one_xdist_worker():
    """scripts/test.sh's ``--dist loadgroup`` keeps a file on one worker (conftest.pytest_xdist_make_scheduler).
    pytest-xdist 3.8's own groups never reached its scheduler under pytest 9.2 (it writes ``item._nodeid``, which
    pytest 9 no longer reads): every test went to whichever worker was free, and two workers each built every vLLM
    engine (24 GB, one killed).  Run for real: two workers, this file's tests, each on the same worker."""
    import importlib.util
    import re
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed")
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                        "-v", str(TESTS / "test_tiers.py"), "-k", "not xdist_worker"],
                       capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    workers = set(re.findall(r"\[(gw\d+)\] \[\s*\d+%\] PASSED", p.stdout))
    assert len(re.findall(r"PASSED", p.stdout)) >= 3 and len(workers) == 1, p.stdout[-2000:]
    assert {conftest.work_unit("tests/test_vllm_adapter.py::t"),
            conftest.work_unit("tests/test_real_model_vllm.py::t[x]")} == {conftest.VLLM_IN_PROCESS_GROUP}
    assert {conftest.work_unit("tests/test_concurrency.py::t[draft]"),
            conftest.work_unit("tests/test_vllm_serve.py::t")} == {conftest.VLLM_SERVERS_GROUP}
