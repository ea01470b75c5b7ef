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
    left out of conftest.VLLM_IN_PROCESS would put a second vLLM on another worker (two did not fit in 24 GB)."""
    import re

    builds = {p.name for p in TESTS.glob("test_*.py") if re.search(r"\b(make_llm|LLM)\(", p.read_text())}
    assert builds <= conftest.VLLM_IN_PROCESS, f"build vLLM engines in process, not in VLLM_IN_PROCESS: " \
                                                f"{sorted(builds - conftest.VLLM_IN_PROCESS)}"
    missing = [f for f in conftest.VLLM_IN_PROCESS if not (TESTS / f).exists()]
    assert not missing, f"conftest.VLLM_IN_PROCESS lists files that are not in tests/: {missing}"
