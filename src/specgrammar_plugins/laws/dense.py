"""The law and the verifier over dense rows on a device, for tensor libraries with numpy-like ops (mlx, torch).

The logits never leave the device: the packed masks go to it (each position's row unpacked there once per round,
``block.cache``), the masked, tilted, tempered and filtered laws are computed there for all verification rows at
once, and only what decides the round crosses to the host: the greedy argmaxes, or q(d_i) and r(d_i) of the drafts,
then the sampled token.  A backend supplies the ops (``Ops``); the algorithm is the reference's, step for step:

    logits -> mask (non-finite logits excluded) -> tilt -> temperature -> top-k -> top-p -> min-p -> log-probs

(llama.cpp's order with ``temperature_last``), greedy as the first argmax, accept with min(1, q/r), residual
norm(max(0, q - r)), inverse-CDF draws in token-id order from the caller's uniforms.  Top-p keeps, among tokens of
equal probability at the boundary, the lowest ids (the reference's stable sort) without needing a stable sort.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..distributions import SamplingParams
from ..errors import EmptyMaskError
from ..verify import Verdict


class Ops:
    """What the dense algorithm needs from a tensor library (see ``torch_law.TorchOps``, ``mlx_law.MLXOps``)."""

    dtype: Any  # the float dtype laws are computed in
    neg_inf: float = float("-inf")

    def rows(self, logits, n: int) -> Any: ...  # [n, V] float rows of the logits, on their device
    def unpack(self, words: np.ndarray, width: int) -> Any: ...  # a packed int32 mask row -> bool [width]
    def tilt(self, tilt: np.ndarray, width: int) -> Any: ...
    def stack(self, xs: list) -> Any: ...
    def where(self, c, a, b) -> Any: ...
    def isfinite(self, x) -> Any: ...
    def any(self, x, axis: int) -> Any: ...
    def argmax(self, x, axis: int) -> Any: ...
    def max(self, x, axis: int, keepdims: bool = True) -> Any: ...
    def exp(self, x) -> Any: ...
    def log(self, x) -> Any: ...
    def sum(self, x, axis: int, keepdims: bool = True) -> Any: ...
    def cumsum(self, x, axis: int) -> Any: ...
    def sort_desc(self, x, axis: int) -> Any: ...  # values only
    def kth_largest(self, x, k: int) -> Any: ...  # [rows, 1]
    def take_along(self, x, idx: np.ndarray) -> Any: ...  # x[rows, idx[rows]] -> [rows]
    def host(self, x) -> np.ndarray: ...  # to a numpy array (a sync)
    def maximum0(self, x) -> Any: ...
    def searchsorted_right(self, c, v: float) -> int: ...
    def scalar(self, v) -> Any: ...
    def pad_neg_inf(self, rows, width: int) -> Any: ...  # rows [n, v < width] -> [n, width], -inf past v
    def one_hot_zero(self, row, token: int) -> Any: ...  # a copy of ``row`` with ``row[token] = 0``
    def on_cpu(self, x) -> bool: ...  # the tensor lives in CPU memory (then the numpy backend runs on a view)
    def numpy_view(self, x) -> np.ndarray: ...  # a zero-copy numpy view of a CPU tensor
    def from_numpy(self, a: np.ndarray) -> Any: ...


def _log_softmax(o: Ops, z):
    s = z - o.max(z, -1)
    return s - o.log(o.sum(o.exp(s), -1))


def _keep_top_p(o: Ops, logp, top_p: float):
    """The reference's top-p keep rule on log-prob rows [rows, V]: in descending order, keep each token whose mass
    before it is < top_p; among tokens tied at the boundary value, the lowest ids."""
    sv = o.sort_desc(logp, -1)
    sp = o.exp(sv)
    cs = o.cumsum(sp, -1)
    keep_sorted = (cs - sp) < top_p
    n_keep = o.sum(o.where(keep_sorted, o.scalar(1.0), o.scalar(0.0)), -1)  # [rows, 1]
    kk = o.host(n_keep).astype(np.int64).reshape(-1)
    boundary = o.take_along(sv, np.maximum(kk - 1, 0))[:, None]  # the smallest kept value of each row
    above = logp > boundary
    n_above = o.sum(o.where(above, o.scalar(1.0), o.scalar(0.0)), -1)
    eq = logp == boundary
    rank = o.cumsum(o.where(eq, o.scalar(1.0), o.scalar(0.0)), -1)
    return above | (eq & (rank <= (n_keep - n_above)))


def _filtered(o: Ops, z, params: SamplingParams):
    """``distributions._filter`` on rows: top-k -> top-p -> min-p; normalized log-probs (-inf where filtered)."""
    v = z.shape[-1]
    if params.top_k and params.top_k < v:
        z = o.where(z >= o.kth_largest(z, params.top_k), z, o.scalar(o.neg_inf))
    logp = _log_softmax(o, z)
    if params.top_p < 1.0:
        logp = _log_softmax(o, o.where(_keep_top_p(o, logp, params.top_p), logp, o.scalar(o.neg_inf)))
    if params.min_p > 0.0:
        thresh = o.max(logp, -1) + float(np.log(params.min_p))
        logp = _log_softmax(o, o.where(logp >= thresh, logp, o.scalar(o.neg_inf)))
    return logp


class DenseLaw:
    """A law backend over an ``Ops``: laws are log-prob rows on the device (None: one-hot).

    Logits that live on the CPU are handed to the numpy backend instead, as zero-copy numpy views: on a CPU the
    tensor libraries' own elementwise ops are the slower path (measured on this project's 2-core x86 machine at
    V = 151,936: ``exp`` 1.5 ms in mlx[cpu] and 3.3 ms in float64 torch, against 0.1 ms in numpy; a full sort
    12 ms in mlx, 36 ms in torch), so the device algorithm runs where a GPU holds the logits."""

    name = "dense"
    ops: Ops
    _numpy = None

    def _cpu(self, logits) -> bool:
        return self.ops.on_cpu(logits) and not getattr(self, "force_device", False)

    @property
    def numpy(self):
        if self._numpy is None:
            from .numpy_law import NumpyLaw

            self._numpy = NumpyLaw()
        return self._numpy

    # ------------------------------------------------------------------ masks and laws on the device
    def _allowed(self, block, i: int, mask: np.ndarray | None, width: int):
        if mask is None:
            return None
        key = (self.name, "allowed", i, width)
        a = block.cache.get(key)
        if a is None:
            a = block.cache[key] = self.ops.unpack(mask, width)
        return a

    def _z(self, rows, allowed, tilt):
        o = self.ops
        z = o.where(o.isfinite(rows), rows, o.scalar(o.neg_inf))
        if allowed is not None:
            z = o.where(allowed, z, o.scalar(o.neg_inf))
        if tilt is not None:
            z = z - tilt
        return z

    def _check(self, z, where: str) -> None:
        ok = self.ops.host(self.ops.any(z > self.ops.neg_inf, -1)).reshape(-1)
        if not ok.all():
            rows = np.flatnonzero(~ok).tolist()
            raise EmptyMaskError(f"no token is allowed at {where} {rows}: the grammar mask (and filters) excluded "
                                 "every token; the constraint cannot be continued from this state")

    def _law(self, z, params: SamplingParams):
        o = self.ops
        if params.temperature_last:
            keep = o.isfinite(_filtered(o, z, params))
            return _log_softmax(o, o.where(keep, z / params.temperature, o.scalar(o.neg_inf)))
        return _filtered(o, z / params.temperature, params)

    def _sample(self, logp, u: float) -> int:
        """The reference's inverse-CDF draw on one log-prob row (token-id order)."""
        o = self.ops
        p = o.exp(logp - o.max(logp, -1))
        c = o.cumsum(p, -1)
        total = float(o.host(c[-1:])[0])
        i = min(o.searchsorted_right(c, u * total), p.shape[-1] - 1)
        ph = None
        if float(o.host(p[i:i + 1])[0]) == 0.0:  # never an excluded token (u at a flat spot of the CDF)
            ph = o.host(p[: i + 1])
            i = int(np.flatnonzero(ph > 0)[-1])
        return i

    def _greedy_rows(self, z) -> np.ndarray:
        return self.ops.host(self.ops.argmax(z, -1)).reshape(-1).astype(np.int64)

    # ------------------------------------------------------------------ the backend interface
    def draft(self, logits, block, params: SamplingParams, u: float, *, blind: bool = False,
              width: int | None = None):
        if self._cpu(logits):
            return self.numpy.draft(self.ops.numpy_view(logits), block, params, u, blind=blind, width=width)
        o = self.ops
        mask = None if blind else block.mask()
        tilt = None if blind else block.tilt()
        t0 = time.perf_counter_ns()
        row = o.rows(logits, 1)
        width = width or row.shape[-1]
        row = self._fit(row, width)
        allowed = self._allowed(block, block.position, mask, width)
        z = self._z(row, allowed, None if tilt is None else o.tilt(tilt, width))
        self._check(z, "the draft position, row")
        if params.greedy:
            token, law = int(self._greedy_rows(z)[0]), None
        else:
            law = self._law(z, params)[0]
            token = self._sample(law, u)
        block.tick("draft_law", t0)
        return token, law

    def _fit(self, rows, width: int):
        v = rows.shape[-1]
        if v > width:
            return rows[:, :width]
        if v < width:  # a narrower draft head: the extra ids are never drafted
            return self.ops.pad_neg_inf(rows, width)
        return rows

    def verify(self, logits, block, params: SamplingParams, u: np.ndarray, u_final: float) -> Verdict:
        if self._cpu(logits):
            return self.numpy.verify(self.ops.numpy_view(logits), block, params, u, u_final)
        o = self.ops
        masks, tilts = block.finish()
        drafts, laws = block.tokens, block.laws
        k = len(drafts)
        t0 = time.perf_counter_ns()
        rows = o.rows(logits, k + 1)
        width = rows.shape[-1]
        allowed = None if masks is None else o.stack([self._allowed(block, i, masks[i], width) for i in range(k + 1)])
        tilt = None
        if tilts is not None:
            tilt = o.stack([o.tilt(np.zeros(width) if t is None else t, width) for t in tilts[: k + 1]])
        z = self._z(rows, allowed, tilt)
        if params.greedy:
            g = self._greedy_rows(z)  # one sync: every row's argmax
            t1 = block.tick("target_law", t0)
            a = next((i for i in range(k) if drafts[i] != g[i]), k)
            block.tick("verify", t1)
            return Verdict(a, int(g[a]), a < k)
        self._check(z, "row(s)")
        q = self._law(z, params)
        t1 = block.tick("target_law", t0)
        a = k
        if k:
            q_d = np.exp(o.host(o.take_along(q[:k], np.asarray(drafts, dtype=np.int64))).reshape(-1)
                         .astype(np.float64))
            r_d = np.ones(k)
            model = [i for i in range(k) if laws[i] is not None]
            if model:
                r_rows = o.stack([laws[i] for i in model])
                r_d[model] = np.exp(o.host(o.take_along(r_rows, np.asarray([drafts[i] for i in model])))
                                    .reshape(-1).astype(np.float64))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(r_d > 0, q_d / r_d, np.where(q_d > 0, np.inf, 0.0))
            rejected = np.flatnonzero(np.asarray(u[:k]) >= np.minimum(1.0, ratio))
            a = int(rejected[0]) if rejected.size else k
        if a == k:
            token = self._sample(q[k], u_final)
        else:
            token = self._residual(q[a], laws[a], drafts[a], u_final)
        block.tick("verify", t1)
        return Verdict(a, token, a < k)

    def _residual(self, logq, logr, d: int, u_final: float) -> int:
        o = self.ops
        qa = o.exp(logq)
        if logr is None:
            resid = o.one_hot_zero(qa, d)
        else:
            resid = o.maximum0(qa - o.exp(logr))
        total = float(o.host(o.sum(resid, -1))[0])
        if not total > 0.0:  # q == r up to rounding: the rejection had probability ~0; q is then the right law
            resid = qa
            total = float(o.host(o.sum(resid, -1))[0])
        return self._sample(o.log(resid / total), u_final)

    def dense(self, law, width: int):
        if hasattr(law, "dense"):  # a numpy backend law (logits on the CPU)
            return self.ops.from_numpy(law.dense(width))
        return self.ops.exp(law)[:width]
