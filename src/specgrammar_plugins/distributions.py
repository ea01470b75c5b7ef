"""The ONE transform from logits to a sampling law, in log space.

    logits -> grammar mask -> cost tilt (subtract lambda*Delta) -> temperature -> top-k -> top-p -> min-p -> log-probs
    (or, with ``temperature_last``, llama.cpp's order: ... -> top-k -> top-p -> min-p -> temperature -> log-probs)

The target law q_lambda and the proposal law r_lambda are this function applied to two models' logits with the
same mask, tilt and options.  Greedy (temperature 0) is the limit: a one-hot law on the first argmax of the masked,
tilted logits.  Rows are float64 log-probabilities with ``-inf`` on every excluded token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .masks import unpack_mask
from .errors import EmptyMaskError

NEG_INF = -np.inf


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options shared by target and draft. ``temperature <= 0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    # False: temperature, then top-k/top-p/min-p on the tempered law (vLLM, mlx-lm).  True: top-k/top-p/min-p on
    # the untempered logits, temperature last (llama.cpp's sampler chain: top_k -> top_p -> min_p -> temp -> dist).
    temperature_last: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError("min_p must be in [0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams(temperature=0.0)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = np.max(z, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        s = z - m
        return s - np.log(np.sum(np.exp(s), axis=-1, keepdims=True))


def log_law(logits: np.ndarray, mask: np.ndarray | None = None, params: SamplingParams = SamplingParams(),
            tilt: np.ndarray | None = None) -> np.ndarray:
    """Log-probabilities of the sampling law for each row of ``logits`` ([..., V]).

    mask: packed int32 rows [..., ceil(V'/32)] with V' >= V (token ids past V are ignored) or None.
    tilt: lambda*Delta per token, [..., V] or broadcastable, subtracted from the logits (None = no tilt).
    Raises ``EmptyMaskError`` when a row has no allowed token.
    """
    z = np.array(logits, dtype=np.float64, copy=True)
    if z.ndim == 1:
        return log_law(z[None], None if mask is None else np.asarray(mask)[None], params,
                       None if tilt is None else np.asarray(tilt)[None] if np.ndim(tilt) == 1 else tilt)[0]
    v = z.shape[-1]
    z[~np.isfinite(z)] = NEG_INF
    if mask is not None:
        allowed = unpack_mask(mask, v)
        z[~allowed] = NEG_INF
    if tilt is not None:
        z = z - np.asarray(tilt, dtype=np.float64)
    ok = np.isfinite(z).any(axis=-1)
    if not ok.all():
        rows = np.flatnonzero(~ok).tolist()
        raise EmptyMaskError(f"no token is allowed at row(s) {rows}: the grammar mask (and filters) excluded "
                             "every token; the constraint cannot be continued from this state")
    if params.greedy:
        out = np.full_like(z, NEG_INF)
        out[np.arange(z.shape[0]), np.argmax(z, axis=-1)] = 0.0
        return out
    if params.temperature_last:
        keep = np.isfinite(_filter(z, params))
        return _log_softmax(np.where(keep, z / params.temperature, NEG_INF))
    return _filter(z / params.temperature, params)


def _filter(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    """top-k -> top-p -> min-p on logits rows ``z``; returns normalized log-probs (-inf where filtered)."""
    v = z.shape[-1]
    if params.top_k and params.top_k < v:
        kth = np.partition(z, v - params.top_k, axis=-1)[:, v - params.top_k][:, None]
        z = np.where(z >= kth, z, NEG_INF)
    logp = _log_softmax(z)
    if params.top_p < 1.0:
        order = np.argsort(-logp, axis=-1, kind="stable")
        sp = np.take_along_axis(np.exp(logp), order, axis=-1)
        before = np.cumsum(sp, axis=-1) - sp  # mass strictly before each token in sorted order
        keep_sorted = before < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        logp = _log_softmax(np.where(keep, logp, NEG_INF))
    if params.min_p > 0.0:
        thresh = np.max(logp, axis=-1, keepdims=True) + np.log(params.min_p)
        logp = _log_softmax(np.where(logp >= thresh, logp, NEG_INF))
    return logp


def probs(logp: np.ndarray) -> np.ndarray:
    return np.exp(logp)


def sample(logp: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a single log-law row (inverse CDF; deterministic for one-hot rows); one ``rng.random()``."""
    return sample_u(logp, rng.random())


def sample_u(logp: np.ndarray, u: float) -> int:
    """The inverse-CDF draw of ``sample`` for the uniform ``u`` in [0, 1): the first token id whose cumulative
    probability (in token-id order) exceeds ``u``.  Every law backend samples this way, from the same uniforms, so
    their draws can be compared one for one."""
    p = np.exp(logp - np.max(logp))
    c = np.cumsum(p)
    u = u * c[-1]
    i = int(np.searchsorted(c, u, side="right"))
    i = min(i, len(c) - 1)
    while p[i] == 0.0:  # never land on an excluded token (u at a flat spot of the CDF)
        i -= 1
    return i
