"""The reference law backend: the definition itself (``distributions.log_law``, ``sample_u``,
``verify.verify_block_u``), float64 numpy over dense rows.  Slow at a real vocabulary (every row copied to float64
and unpacked); the fast backends are held against it."""

from __future__ import annotations

import time

import numpy as np

from ..distributions import SamplingParams, log_law, sample_u
from ..verify import Verdict, verify_block_u


def _rows(block, n: int, width: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    masks, tilts = block.finish()
    m = None if masks is None else np.stack(masks[:n])
    t = None
    if tilts is not None:
        t = np.stack([np.zeros(width) if x is None else np.asarray(x, dtype=np.float64)[:width] for x in tilts[:n]])
    return m, t


class ReferenceLaw:
    name = "reference"

    def draft(self, logits, block, params: SamplingParams, u: float, *, blind: bool = False,
              width: int | None = None):
        mask = None if blind else block.mask()
        tilt = None if blind else block.tilt()
        t0 = time.perf_counter_ns()
        z = np.asarray(logits, dtype=np.float64).reshape(-1)
        width = width or len(z)
        if len(z) < width:  # a narrower draft head: the extra ids are never drafted
            z = np.concatenate([z, np.full(width - len(z), -np.inf)])
        z = z[:width]
        t0 = block.tick("copy", t0)
        law = log_law(z, mask, params, tilt)
        token = sample_u(law, u)
        block.tick("draft_law", t0)
        return token, law

    def verify(self, logits, block, params: SamplingParams, u: np.ndarray, u_final: float) -> Verdict:
        t0 = time.perf_counter_ns()
        n = len(block.tokens) + 1
        q = np.asarray(logits, dtype=np.float64)[:n]
        t0 = block.tick("copy", t0)
        width = q.shape[-1]
        masks, tilts = _rows(block, n, width)
        law = log_law(q, masks, params, tilts)
        t0 = block.tick("target_law", t0)
        v = verify_block_u(block.tokens, law, block.laws, u, u_final)
        block.tick("verify", t0)
        return v

    def dense(self, law, width: int) -> np.ndarray:
        p = np.exp(np.asarray(law, dtype=np.float64))
        out = np.zeros(width)
        out[: min(width, len(p))] = p[:width]
        return out
