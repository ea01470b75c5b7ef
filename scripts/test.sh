#!/usr/bin/env bash
# Runs the layers check (import-linter, contracts in pyproject.toml) and the test suite in .venv;
# pytest's exit code 5 (no tests collected) counts as success.
#
# The suite runs on pytest-xdist workers, a file's tests on one worker (tests/conftest.py groups them, so a
# module's server or engine starts once): one worker per core, at most one per 16 GB of memory, at most 4. A worker
# keeps what the files it ran allocated (vLLM's in-process engines, the models): two workers on a 24 GB machine
# reached 13.5 + 11.4 GB and the kernel killed one, so a 24 GB machine runs the suite in one process.  SPECGRAMMAR_TEST_WORKERS=N sets the count (0: no workers, one
# process); `-n N` or `-p no:xdist` on the command line wins.  `make test-fast` passes `-m "not slow"`.
set -uo pipefail
cd "$(dirname "$0")/.."
export TOKENIZERS_PARALLELISM=false VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
.venv/bin/lint-imports --no-cache || { echo "lint-imports: a layers contract is broken (see docs/ARCHITECTURE.md)"; exit 1; }
xdist=()
case " $* " in
  *" -n "*|*" -n="*|*" --numprocesses"*|*"no:xdist"*) ;;
  *)
    workers=${SPECGRAMMAR_TEST_WORKERS:-}
    if [ -z "$workers" ]; then
      cores=$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)
      mem_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 16)
      workers=$cores
      [ $((mem_gb / 16)) -lt "$workers" ] && workers=$((mem_gb / 16))
      [ "$workers" -gt 4 ] && workers=4
      [ "$workers" -lt 1 ] && workers=1
    fi
    [ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadgroup)
    ;;
esac
.venv/bin/python -m pytest "${xdist[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests (exit 5): treated as success"; exit 0; fi
exit "$rc"
