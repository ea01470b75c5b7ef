"""The mlx law backend: the dense algorithm (``dense.py``) in mlx ops on the GPU (Metal): the logits stay in mlx,
the packed mask is applied on the device, and only verdicts and sampled tokens cross to the host; float32 there
(mlx has no float64 on the GPU: draws from the same uniforms can then differ from the reference's where a uniform
falls within float32 rounding of a boundary).  On the CPU device (``mlx[cpu]``) the evaluated logits are read as
zero-copy numpy views by the numpy backend (``DenseLaw``), in float64."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .dense import DenseLaw


class MLXOps:
    neg_inf = float("-inf")

    def __init__(self):
        self.dtype = mx.float64 if mx.default_device() == mx.cpu else mx.float32  # (the device path runs on a GPU)
        self._shifts = mx.arange(32, dtype=mx.int32)

    def rows(self, logits, n: int):
        x = logits if isinstance(logits, mx.array) else mx.array(np.asarray(logits))
        if x.ndim == 1:
            x = x[None]
        return x[:n].astype(self.dtype)

    def unpack(self, words: np.ndarray, width: int):
        w = mx.array(np.ascontiguousarray(words, dtype=np.int32))
        bits = (w[:, None] >> self._shifts) & 1
        return bits.reshape(-1)[:width].astype(mx.bool_)

    def tilt(self, tilt, width: int):
        return mx.array(np.asarray(tilt, dtype=np.float64)[:width]).astype(self.dtype)

    def stack(self, xs):
        return mx.stack(list(xs))

    def where(self, c, a, b):
        return mx.where(c, a, b)

    def isfinite(self, x):
        return mx.isfinite(x)

    def any(self, x, axis):
        return mx.any(x, axis=axis)

    def argmax(self, x, axis):
        return mx.argmax(x, axis=axis)

    def max(self, x, axis, keepdims=True):
        return mx.max(x, axis=axis, keepdims=keepdims)

    def exp(self, x):
        return mx.exp(x)

    def log(self, x):
        return mx.log(x)

    def sum(self, x, axis, keepdims=True):
        return mx.sum(x, axis=axis, keepdims=keepdims)

    def cumsum(self, x, axis):
        return mx.cumsum(x, axis=axis)

    def sort_desc(self, x, axis):
        return -mx.sort(-x, axis=axis)

    def kth_largest(self, x, k: int):
        return mx.min(mx.topk(x, k, axis=-1), axis=-1, keepdims=True)

    def take_along(self, x, idx):
        i = mx.array(np.asarray(idx, dtype=np.int64).reshape(-1, 1))
        return mx.take_along_axis(x, i, axis=-1)[:, 0]

    def host(self, x) -> np.ndarray:
        return np.array(x)

    def maximum0(self, x):
        return mx.maximum(x, 0.0)

    def searchsorted_right(self, c, v: float) -> int:
        # the number of cumulative values <= v (c is nondecreasing): the first index whose value exceeds v
        return int(mx.sum(c <= v).item())

    def scalar(self, v):
        return mx.array(v, dtype=self.dtype)

    def pad_neg_inf(self, rows, width: int):
        pad = mx.full((rows.shape[0], width - rows.shape[-1]), self.neg_inf, dtype=rows.dtype)
        return mx.concatenate([rows, pad], axis=-1)

    def one_hot_zero(self, row, token: int):
        keep = mx.arange(row.shape[-1]) != token
        return mx.where(keep, row, 0.0)

    def on_cpu(self, x) -> bool:
        return not isinstance(x, mx.array) or mx.default_device() == mx.cpu

    def numpy_view(self, x) -> np.ndarray:
        return np.asarray(x)  # zero-copy: an evaluated mlx array's buffer

    def from_numpy(self, a: np.ndarray):
        return mx.array(a)


class MLXLaw(DenseLaw):
    name = "mlx"

    def __init__(self):
        self.ops = MLXOps()
