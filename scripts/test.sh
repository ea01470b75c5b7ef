#!/usr/bin/env bash
# Runs the layers check (import-linter, contracts in pyproject.toml) and the test suite in .venv;
# pytest's exit code 5 (no tests collected) counts as success.
#
# The suite runs on pytest-xdist workers where memory allows, a file's tests on one worker (tests/conftest.py's
# scheduler, so a module's server or engine starts once).  Two groups of files are one work unit each: those that
# build vLLM engines in the test process (conftest.VLLM_IN_PROCESS), so one worker holds vLLM's memory, and those
# that start vLLM servers (conftest.VLLM_SERVERS), so two never run at once.  Measured on the 2-core, 24 GB machine
# (2026-11-26): the vLLM-engine worker reached 15 GB, another 5.5 GB, and the servers the tests start ~3-4 GB more,
# and the kernel killed the first.  So a machine with 28 GB or more runs everything on one worker per core (at most
# 4); a smaller one runs the rest of the suite on up to two workers (one per core, 8 GB each beyond the first
# 4 GB) and then the vLLM-engine files in one process of their own.  Either way the files that bound a server's
# wall-clock answers (conftest.ALONE) run in a process of their own.  SPECGRAMMAR_TEST_WORKERS=N sets the count
# for everything (1: no xdist at all); `-n N` or `-p no:xdist` on the command line wins.  `make test-fast` passes
# `-m "not slow"`.
set -uo pipefail
cd "$(dirname "$0")/.."
export TOKENIZERS_PARALLELISM=false VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
.venv/bin/lint-imports --no-cache || { echo "lint-imports: a layers contract is broken (see docs/ARCHITECTURE.md)"; exit 1; }
xdist=()
rest=()  # xdist options for the first of the three runs (below), on a machine that runs vLLM apart
case " $* " in
  *" -n "*|*" -n="*|*" --numprocesses"*|*"no:xdist"*) ;;
  *)
    cores=$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)
    mem_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 16)
    workers=${SPECGRAMMAR_TEST_WORKERS:-}
    if [ -z "$workers" ]; then
      workers=$cores
      fit=$((1 + (mem_gb - 20) / 8))
      [ "$mem_gb" -lt 20 ] && fit=1
      [ "$fit" -lt "$workers" ] && workers=$fit
      [ "$workers" -gt 4 ] && workers=4
      [ "$workers" -lt 1 ] && workers=1
      # without vLLM's engines two workers fit in ~18 GB (measured: 9.7 GB and ~3 GB, the servers ~5 GB more):
      # one per 8 GB beyond the first 4 GB (a 24 GB machine, which reports 23: two)
      r=$(( (mem_gb - 4) / 8 ))
      [ "$r" -gt "$cores" ] && r=$cores
      [ "$r" -gt 2 ] && r=2
      [ "$r" -gt 1 ] && rest=(-n "$r" --dist loadgroup --max-worker-restart 0)
    fi
    # a worker the kernel kills ends the run with its error (xdist's replacement worker once hung the run)
    [ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadgroup --max-worker-restart 0)
    ;;
esac
final=0
run() {  # one pytest run; exit code 5 (nothing collected, e.g. under -m) counts as success; the first failure wins
  "$@"
  local r=$?
  if [ "$r" -eq 5 ]; then echo "pytest collected no tests (exit 5): treated as success"; r=0; fi
  [ "$final" -eq 0 ] && final=$r
}
explicit=0  # test paths named on the command line: run just what was asked, in one run
for a in "$@"; do case "$a" in tests*|*.py|*::*) explicit=1 ;; esac; done
if [ "$explicit" -eq 1 ]; then
  run .venv/bin/python -m pytest "${xdist[@]}" "$@"
  exit "$final"
fi
# Three runs, one after the other:
# 1. the rest of the suite on the workers;
# 2. the files that bound a server's wall-clock answers (conftest.ALONE), in one process with nothing beside them:
#    on 2 cores a second worker delayed their client and server by seconds;
# 3. with one worker for vLLM's engines: the files that build them in the test process (conftest.VLLM_IN_PROCESS),
#    last, in a process of their own: vLLM does not give an engine's memory back, and one process running the whole
#    suite reached 20 GB on the 24 GB machine, so the servers test_vllm_serve starts after them could not
#    (2026-11-26, a fresh clone).
{ read -r alone_files; read -r vllm_files; } < <(.venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); \
import conftest; [print(' '.join('tests/' + f for f in sorted(s))) for s in (conftest.ALONE, conftest.VLLM_IN_PROCESS)]")
opts=("${rest[@]}")
if [ "${#xdist[@]}" -gt 0 ]; then  # vLLM's engines fit beside the other workers: only the ALONE files run apart
  vllm_files=""
  opts=("${xdist[@]}")
fi
ignore=()
for f in $alone_files $vllm_files; do ignore+=("--ignore=$f"); done
run .venv/bin/python -m pytest "${opts[@]}" "$@" "${ignore[@]}"
# shellcheck disable=SC2086
run .venv/bin/python -m pytest "$@" $alone_files
# shellcheck disable=SC2086
[ -n "$vllm_files" ] && run .venv/bin/python -m pytest "$@" $vllm_files
exit "$final"
