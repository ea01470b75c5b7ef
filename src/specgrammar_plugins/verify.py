"""Block accept-residual verification (Leviathan et al. / Chen et al.), the only verifier in the project.

Given drafts d_1..d_k with proposal laws r_i (``None`` = one-hot draft: a forced token, a recipe, a greedy
draft) and target laws q_1..q_{k+1} (all from ``distributions.log_law`` with the same masks), accept d_i with
probability min(1, q_i(d_i)/r_i(d_i)) in order; at the first rejection sample from norm(max(0, q_i - r_i));
if all k pass, sample a bonus token from q_{k+1}.  The committed tokens are distributed exactly as sequential
sampling from q.  Greedy is the T=0 case (q one-hot): accept iff the draft equals the argmax, and the extra
token is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .distributions import sample_u


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of drafts accepted (0..k)
    token: int  # the residual (on rejection) or bonus (all accepted) token
    residual: bool  # True when ``token`` came from a rejection


def verify_block(drafts: Sequence[int], target_logp: np.ndarray, draft_logp: Sequence[np.ndarray | None] | None,
                 rng: np.random.Generator) -> Verdict:
    """Verify one block.

    drafts: k token ids.  target_logp: [k+1, V] log-laws (row i judges draft i; row k is the bonus law).
    draft_logp: k rows (or ``None`` for all one-hot); a row may be ``None`` (one-hot at the draft token).
    Draws ``rng.random(k)`` (the acceptance uniforms) and then one ``rng.random()`` (the final token).
    """
    k = len(drafts)
    return verify_block_u(drafts, target_logp, draft_logp, rng.random(k) if k else np.zeros(0), rng.random())


def verify_block_u(drafts: Sequence[int], target_logp: np.ndarray, draft_logp: Sequence[np.ndarray | None] | None,
                   u: np.ndarray, u_final: float) -> Verdict:
    """``verify_block`` with its uniforms given: ``u[i]`` decides draft i (accepted iff ``u[i] < min(1, q/r)``),
    ``u_final`` draws the residual or bonus token (``distributions.sample_u``).  Every law backend verifies this way
    from the same uniforms."""
    k = len(drafts)
    q = np.asarray(target_logp, dtype=np.float64)
    if q.shape[0] != k + 1:
        raise ValueError(f"need k+1 = {k + 1} target rows, got {q.shape[0]}")
    if draft_logp is None:
        draft_logp = [None] * k
    if k:
        d = np.asarray(drafts, dtype=np.int64)
        q_d = np.exp(q[np.arange(k), d])
        r_d = np.array([1.0 if r is None else float(np.exp(r[t])) for r, t in zip(draft_logp, drafts)])
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(r_d > 0, q_d / r_d, np.where(q_d > 0, np.inf, 0.0))
        accept_p = np.minimum(1.0, ratio)
        rejected = np.flatnonzero(np.asarray(u[:k]) >= accept_p)
        a = int(rejected[0]) if rejected.size else k
    else:
        a = 0
    if a == k:
        return Verdict(k, sample_u(q[k], u_final), False)
    qa = np.exp(q[a])
    r = draft_logp[a]
    if r is None:
        resid = qa.copy()
        resid[drafts[a]] = 0.0
    else:
        resid = np.maximum(0.0, qa - np.exp(np.asarray(r, dtype=np.float64)))
    total = resid.sum()
    if not total > 0.0:  # q == r up to rounding: the rejection had probability ~0; q is then the right law
        resid = qa
        total = resid.sum()
    with np.errstate(divide="ignore"):
        return Verdict(a, sample_u(np.log(resid / total), u_final), True)
