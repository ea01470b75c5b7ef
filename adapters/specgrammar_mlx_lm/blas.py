"""OpenBLAS for mlx[cpu] on Linux: the wheel links the reference BLAS (sgemm ~4 GFLOP/s); Debian's
``libopenblas0-pthread`` preloaded through ``LD_PRELOAD`` gives ~72 GFLOP/s (hosts.md).  Benchmarks and the demo
re-execute themselves with it preloaded when it is installed (``apt-get install -y libopenblas0-pthread``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
_FLAG = "SPECGRAMMAR_BLAS_REEXEC"


def openblas_path() -> str | None:
    for p in CANDIDATES:
        if Path(p).exists():
            return p
    return None


def preloaded() -> str | None:
    """The OpenBLAS library preloaded into this process, if any."""
    pre = os.environ.get("LD_PRELOAD", "")
    return next((p for p in pre.split(":") if "openblas" in p), None)


def reexec_with_openblas(module: str, argv: list[str]) -> None:
    """Re-execute ``python -m module argv`` with OpenBLAS preloaded (Linux, once); returns when not possible."""
    if not sys.platform.startswith("linux") or preloaded() or os.environ.get(_FLAG):
        return
    lib = openblas_path()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    env[_FLAG] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
