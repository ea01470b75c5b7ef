"""The torch law backend: the dense algorithm (``dense.py``) in torch ops on the logits' device (CUDA), in float64
(inverse-CDF draws from the same uniforms then match the reference's).  Logits on the CPU go to the numpy backend
as zero-copy views (``DenseLaw``)."""

from __future__ import annotations

import numpy as np
import torch

from .dense import DenseLaw


class TorchOps:
    dtype = torch.float64
    neg_inf = float("-inf")

    def __init__(self):
        self.device = None
        self._shifts: dict = {}

    def rows(self, logits, n: int):
        x = logits if isinstance(logits, torch.Tensor) else torch.as_tensor(np.asarray(logits))
        if x.dim() == 1:
            x = x.unsqueeze(0)
        self.device = x.device
        return x[:n].to(self.dtype)

    def unpack(self, words: np.ndarray, width: int):
        dev = self.device or torch.device("cpu")
        shifts = self._shifts.get(dev)
        if shifts is None:
            shifts = self._shifts[dev] = torch.arange(32, dtype=torch.int32, device=dev)
        w = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int32)).to(dev)
        bits = (w.unsqueeze(-1) >> shifts) & 1
        return bits.reshape(-1)[:width].bool()

    def tilt(self, tilt, width: int):
        t = torch.as_tensor(np.asarray(tilt, dtype=np.float64)[:width], device=self.device or "cpu")
        return t

    def stack(self, xs):
        return torch.stack(list(xs))

    def where(self, c, a, b):
        return torch.where(c, a, b)

    def isfinite(self, x):
        return torch.isfinite(x)

    def any(self, x, axis):
        return x.any(dim=axis)

    def argmax(self, x, axis):
        return torch.argmax(x, dim=axis)

    def max(self, x, axis, keepdims=True):
        return x.amax(dim=axis, keepdim=keepdims)

    def exp(self, x):
        return torch.exp(x)

    def log(self, x):
        return torch.log(x)

    def sum(self, x, axis, keepdims=True):
        return x.sum(dim=axis, keepdim=keepdims)

    def cumsum(self, x, axis):
        return torch.cumsum(x, dim=axis)

    def sort_desc(self, x, axis):
        return torch.sort(x, dim=axis, descending=True).values

    def kth_largest(self, x, k: int):
        return torch.topk(x, k, dim=-1).values[..., -1:]

    def take_along(self, x, idx):
        i = torch.as_tensor(np.asarray(idx, dtype=np.int64), device=x.device)
        return x[torch.arange(x.shape[0], device=x.device), i]

    def host(self, x) -> np.ndarray:
        return x.detach().cpu().numpy()

    def maximum0(self, x):
        return torch.clamp_min(x, 0.0)

    def searchsorted_right(self, c, v: float) -> int:
        return int(torch.searchsorted(c, torch.tensor([v], dtype=c.dtype, device=c.device), right=True)[0])

    def scalar(self, v):
        return torch.tensor(v, dtype=self.dtype, device=self.device or "cpu")

    def pad_neg_inf(self, rows, width: int):
        pad = torch.full((rows.shape[0], width - rows.shape[-1]), self.neg_inf, dtype=rows.dtype, device=rows.device)
        return torch.cat([rows, pad], dim=-1)

    def one_hot_zero(self, row, token: int):
        out = row.clone()
        out[token] = 0.0
        return out

    def on_cpu(self, x) -> bool:
        return not isinstance(x, torch.Tensor) or x.device.type == "cpu"

    def numpy_view(self, x) -> np.ndarray:
        return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

    def from_numpy(self, a: np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a))


class TorchLaw(DenseLaw):
    name = "torch"

    def __init__(self):
        self.ops = TorchOps()
