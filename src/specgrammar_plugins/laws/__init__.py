"""Law backends: the one law and the one verifier, computed where the logits live.

The definition is the float64 numpy reference (``distributions.log_law``, ``distributions.sample_u``,
``verify.verify_block_u``); a backend is a twin of it for one tensor library, held against it by the tests (exact
enumeration / chi-square on small vocabularies; identical greedy verdicts, and identical sampled verdicts from the
same uniforms, on full-size rows):

- ``reference``: the definition itself (float64 numpy, dense rows);
- ``numpy``: the fast path for logits that arrive on the CPU (llama-cpp-python, tests): float32 rows read in place,
  greedy as an argmax over the masked row, one-hot drafts never sampled, laws kept over the allowed tokens only,
  top-p by a partial sort of the kept set;
- ``mlx``: logits stay in mlx, the packed mask is applied on the device, only verdicts and tokens cross to the
  host (the mlx-lm adapter's default);
- ``torch``: the same in torch, CPU or CUDA (torch runners, the vLLM adapter's draft laws).

Every backend consumes randomness the same way: the caller draws the uniforms from one numpy generator (one per
sampled draft; ``k`` acceptance uniforms and one final uniform per verified block) and hands them in, so backends
can be compared draw for draw.  A backend is imported only when chosen: the core imports no mlx or torch.

The interface (``LawBackend``) works on one round's ``block.DraftBlock``, whose packed mask rows it reads and whose
per-round ``cache`` it fills (each position's mask unpacked once, shared by the draft law and the target law):

    token, law = backend.draft(logits_row, block, params, u, blind=False)   # the proposal law r at the block's
                                                                             # current position; law None = one-hot
    verdict = backend.verify(logits_rows, block, params, u, u_final)       # accept/residual over the block
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol

import numpy as np

from ..distributions import SamplingParams
from ..verify import Verdict

BACKENDS = {
    "reference": ("specgrammar_plugins.laws.reference", "ReferenceLaw"),
    "numpy": ("specgrammar_plugins.laws.numpy_law", "NumpyLaw"),
    "mlx": ("specgrammar_plugins.laws.mlx_law", "MLXLaw"),
    "torch": ("specgrammar_plugins.laws.torch_law", "TorchLaw"),
}
_LOADED: dict[str, Any] = {}


class LawBackend(Protocol):
    name: str

    def draft(self, logits: Any, block, params: SamplingParams, u: float, *, blind: bool = False
              ) -> tuple[int, Any]:
        """Draw a draft token at ``block``'s current position from the proposal law r (the law of ``logits``
        under the position's mask and tilt, or without them when ``blind``), with the uniform ``u``; returns
        (token, law), law None when r is one-hot (greedy)."""

    def verify(self, logits: Any, block, params: SamplingParams, u: np.ndarray, u_final: float) -> Verdict:
        """Accept/residual verification of ``block.tokens`` against the target law of ``logits`` ([k+1, V]
        rows) under the block's masks and tilts."""

    def dense(self, law: Any, width: int) -> Any:
        """A draft law as a dense probability row of ``width`` (the backend's own tensor type)."""


def get(name: str | None = None) -> LawBackend:
    """The backend called ``name`` (``reference``, ``numpy``, ``mlx``, ``torch``); None: ``numpy``."""
    name = name or "numpy"
    if name not in BACKENDS:
        raise ValueError(f"unknown law backend {name!r}; choose from {', '.join(BACKENDS)}")
    be = _LOADED.get(name)
    if be is None:
        module, cls = BACKENDS[name]
        try:
            be = getattr(importlib.import_module(module), cls)()
        except ImportError as e:
            raise ValueError(f"law backend {name!r} needs its tensor library: {e}") from None
        _LOADED[name] = be
    return be


def for_runner(runner) -> LawBackend:
    """The fast backend for the tensors a runner's ``forward`` returns (its ``tensors`` attribute: ``numpy``,
    ``mlx`` or ``torch``; ``numpy`` when it has none).  ``SPECGRAMMAR_LAW=reference`` (or another backend's name)
    overrides it everywhere, e.g. to cross-check a host against the reference."""
    forced = os.environ.get("SPECGRAMMAR_LAW")
    if forced:
        return get(forced)
    return get(getattr(runner, "tensors", None) or "numpy")


def available() -> list[str]:
    """The backends whose tensor library is installed."""
    out = []
    for name in BACKENDS:
        try:
            get(name)
        except ValueError:
            continue
        out.append(name)
    return out
