"""The fast numpy law backend: for logits that arrive on the CPU as float32 rows (llama-cpp-python, tests).

The same law and verifier as the reference, computed with as little work as the round needs:

- rows are read in place (no float64 copy of a whole [k+1, V] block);
- greedy is an argmax: over the raw row first, kept when the mask allows that token (a bit test on the packed
  row), else over the allowed tokens; greedy drafts carry no law (one-hot) and are never sampled;
- at T > 0 a law is held as float64 log-weights with their log-normalizer (``_Law``), either over the whole row
  (wide masks: excluded tokens at -inf) or over the allowed token ids only (narrow masks); each position's mask is
  unpacked once per round and shared by the draft law and the target law;
- top-k by ``np.partition``; top-p by a partial sort of the kept set (the top m tokens, m growing until they hold
  the mass); min-p by a threshold;
- verification computes target laws only up to the first rejection; the residual is computed over the target
  law's support only; draws are the reference's inverse CDF in token-id order (``distributions.sample_u``), with a
  two-level cumulative sum for wide laws.

Probabilities are float64, so draws from the same uniforms match the reference's.
"""

from __future__ import annotations

import time

import numpy as np

from ..distributions import SamplingParams
from ..errors import EmptyMaskError
from ..masks import mask_allows
from ..verify import Verdict

NEG_INF = -np.inf
_BLOCK = 2048  # two-level inverse CDF above this many positions
_SPARSE = 0.25  # masks allowing less than this share of the row: laws over the allowed ids only


class _Pool:
    """Reused float64 work rows, by length.  A fresh 1.2 MB array per step costs its page faults (measured: a chain
    of six fresh [151,936] float64 temporaries took 2.4 ms, the same steps in reused rows 0.44 ms); laws hand their
    rows back when they are freed (CPython frees them when their round's block goes), from any thread."""

    def __init__(self, keep: int = 64):
        self.keep = keep
        self.free: dict[tuple, list[np.ndarray]] = {}

    def take(self, n: int, dtype=np.float64) -> np.ndarray:
        rows = self.free.get((n, np.dtype(dtype).char))
        if rows:
            try:
                return rows.pop()
            except IndexError:  # another thread took the last one
                pass
        return np.empty(n, dtype=dtype)

    def give(self, *arrays: np.ndarray) -> None:
        for a in arrays:
            rows = self.free.setdefault((len(a), a.dtype.char), [])
            if len(rows) < self.keep:
                rows.append(a)


_POOL = _Pool()


def _empty(where: str) -> EmptyMaskError:
    return EmptyMaskError(f"no token is allowed at {where}: the grammar mask (and filters) excluded every token; the "
                          "constraint cannot be continued from this state")


def _draw(p: np.ndarray, u: float) -> int:
    """The position the reference's inverse CDF picks in the nonnegative weights ``p`` for the uniform ``u``."""
    n = len(p)
    if n <= _BLOCK:
        c = np.cumsum(p)
        j = min(int(np.searchsorted(c, u * c[-1], side="right")), n - 1)
    else:  # block sums first, then one block's cumulative sum
        starts = np.arange(0, n, _BLOCK)
        cb = np.cumsum(np.add.reduceat(p, starts))
        target = u * cb[-1]
        b = min(int(np.searchsorted(cb, target, side="right")), len(starts) - 1)
        lo = int(starts[b])
        c = (cb[b - 1] if b else 0.0) + np.cumsum(p[lo: lo + _BLOCK])
        j = lo + min(int(np.searchsorted(c, target, side="right")), len(c) - 1)
    while p[j] == 0.0 and j > 0:  # never an excluded (or underflowed) token
        j -= 1
    return j


class _Law:
    """A law as float64 log-weights ``s`` (max 0, -inf where excluded) and their log-normalizer ``lse``, over the
    whole row (``idx`` None: position = token id) or over the token ids ``idx`` (ascending).  Owns its rows
    (``_POOL``): ``of`` takes ``z`` over, shifting it in place."""

    __slots__ = ("idx", "s", "lse", "_p", "_own")

    def __init__(self, idx: np.ndarray | None, s: np.ndarray, lse: float):
        self.idx, self.s, self.lse = idx, s, lse
        self._p = None
        self._own: list[np.ndarray] = []

    def __del__(self):
        if self._own and _POOL is not None:  # (None while the interpreter tears the module down)
            _POOL.give(*self._own)

    @classmethod
    def of(cls, idx, z: np.ndarray, owned: np.ndarray | None = None) -> "_Law":
        """The law of logits ``z`` (consumed: shifted in place); ``owned``: the pool row ``z`` lives in."""
        np.subtract(z, np.max(z), out=z)
        if owned is None:  # (a subset's own array: not worth pooling)
            p = np.exp(z)
        else:
            buf = _POOL.take(len(owned))
            p = np.exp(z, out=buf[: len(z)])
        law = cls(idx, z, float(np.log(np.sum(p))))
        law._p = p
        if owned is not None:
            law._own = [owned, buf]
        return law

    @property
    def weights(self) -> np.ndarray:
        if self._p is None:
            self._p = np.exp(self.s)
        return self._p

    def logp(self) -> np.ndarray:
        return self.s - self.lse

    def tokens(self) -> np.ndarray:
        return np.arange(len(self.s)) if self.idx is None else self.idx

    def prob(self, token: int) -> float:
        if self.idx is None:
            return float(np.exp(self.s[token] - self.lse)) if token < len(self.s) else 0.0
        j = int(np.searchsorted(self.idx, token))
        if j < len(self.idx) and self.idx[j] == token:
            return float(np.exp(self.s[j] - self.lse))
        return 0.0

    def probs_at(self, tokens: np.ndarray | None, width: int) -> np.ndarray:
        """Probabilities of ``tokens`` (None: every id < width) under this law."""
        p = self.weights / np.exp(self.lse)
        if tokens is self.idx:  # (also both None: the whole row)
            return p[:width] if tokens is None else p
        if self.idx is None and tokens is None:
            return p[:width]
        if self.idx is None:
            return p[tokens]
        dense = np.zeros(max(width, int(self.idx[-1]) + 1 if len(self.idx) else width))
        dense[self.idx] = p
        return dense[:width] if tokens is None else dense[tokens]

    def dense(self, width: int) -> np.ndarray:
        return self.probs_at(None, width)

    def sample(self, u: float) -> int:
        j = _draw(self.weights, u)
        return j if self.idx is None else int(self.idx[j])


_BINS = 4096
_SPAN = 60.0  # log-weights below -60 hold under 1e-26 of the mass each: the last bin


def _top_p(law: "_Law", top_p: float) -> np.ndarray:
    """Positions (ascending) of the tokens top-p keeps: in descending order of probability (ties: lower position
    first, the reference's stable sort), each token whose mass before it is < top_p.

    Without sorting the row: the log-weights are binned (``_BINS`` bins over [-60, 0]) and the mass of each bin
    summed; every token of a bin whose cumulative mass stays below top_p is kept, every token of a bin after the
    one where it reaches top_p is dropped, and only the tokens of that boundary bin are sorted."""
    s, p = law.s, law.weights
    n = len(s)
    z = float(np.sum(p))
    f, b, flag = _POOL.take(n), _POOL.take(n, np.int32), _POOL.take(n, np.bool_)
    try:
        np.maximum(s, -_SPAN, out=f)
        np.multiply(f, -(_BINS - 1) / _SPAN, out=f)
        np.copyto(b, f, casting="unsafe")  # truncation: bin 0 holds the largest weights
        mass = np.bincount(b, weights=p, minlength=_BINS) / z
        cum = np.cumsum(mass)
        edge = min(int(np.searchsorted(cum, top_p, side="left")), _BINS - 1)  # its cumulative mass reaches top_p
        before_edge = cum[edge - 1] if edge else 0.0
        inside = np.flatnonzero(np.equal(b, edge, out=flag))
        order = inside[np.argsort(-s[inside], kind="stable")]
        sp = p[order] / z
        keep_edge = order[before_edge + np.cumsum(sp) - sp < top_p]
        return np.sort(np.concatenate([np.flatnonzero(np.less(b, edge, out=flag)), keep_edge]))
    finally:
        _POOL.give(f, b, flag)


def _subset(law: _Law, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, log-probs) of the law at positions ``pos``."""
    ids = pos if law.idx is None else law.idx[pos]
    return ids, law.s[pos] - law.lse


def _filtered(idx, z: np.ndarray, params: SamplingParams, owned: np.ndarray | None) -> _Law:
    """``distributions._filter``: top-k -> top-p -> min-p on logits ``z`` (over ``idx``, or the whole row;
    consumed; ``owned``: the pool row it lives in)."""
    n = len(z)
    if params.top_k and params.top_k < n:
        kth = np.partition(z, n - params.top_k)[n - params.top_k]
        if kth > NEG_INF:  # (fewer finite logits than top_k: the reference keeps them all)
            pos = np.flatnonzero(z >= kth)
            idx, z = (pos if idx is None else idx[pos]), z[pos]
            if owned is not None:
                _POOL.give(owned)
                owned = None
    law = _Law.of(idx, z, owned)
    if params.top_p < 1.0:
        law = _Law.of(*_subset(law, _top_p(law, params.top_p)))
    if params.min_p > 0.0:  # logp >= max(logp) + log(min_p): the log-weights' max is 0
        law = _Law.of(*_subset(law, np.flatnonzero(law.s >= np.log(params.min_p))))
    return law


class NumpyLaw:
    name = "numpy"

    # ------------------------------------------------------------------ one position
    def _allowed(self, block, i: int, mask: np.ndarray | None, width: int):
        """(ids, None) for a narrow mask, (None, the excluded tokens as a bool row) for a wide one, (None, None)
        without a mask: unpacked once per position and round (``block.cache``)."""
        if mask is None:
            return None, None
        key = ("np", i, width)
        hit = block.cache.get(key)
        if hit is None:
            bits = np.unpackbits(mask.view(np.uint8), count=min(width, mask.size * 32), bitorder="little")
            allowed = bits.view(bool)
            if len(allowed) < width:
                allowed = np.concatenate([allowed, np.zeros(width - len(allowed), dtype=bool)])
            n = int(np.count_nonzero(allowed))
            hit = block.cache[key] = (np.flatnonzero(allowed), None) if n < _SPARSE * width else (None, ~allowed)
        return hit

    def _logits(self, row: np.ndarray, allowed, tilt, where: str
                ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
        """(ids or None, float64 logits under the mask and the tilt, the pool row holding them or None);
        non-finite logits excluded."""
        ids, excluded = allowed
        if ids is not None:
            z = row[ids].astype(np.float64)
            if tilt is not None:
                z -= np.asarray(tilt, dtype=np.float64)[ids]
            fin = np.isfinite(z)
            if not fin.all():
                ids, z = ids[fin], z[fin]
            if not len(z):
                raise _empty(where)
            return ids, z, None
        buf = _POOL.take(len(row))
        z = buf
        np.copyto(z, row)
        if tilt is not None:
            z -= np.asarray(tilt, dtype=np.float64)[: len(z)]
        bad = None if (tilt is None and np.isfinite(row).all()) else ~np.isfinite(z)
        if bad is not None:
            z[bad] = NEG_INF  # (+inf and NaN excluded, as the reference does)
        if excluded is not None:
            np.copyto(z, NEG_INF, where=excluded)
        if bad is not None and not np.isfinite(z).any():
            _POOL.give(buf)
            raise _empty(where)
        return None, z, buf

    def _greedy(self, row: np.ndarray, block, i: int, mask, tilt, where: str) -> int:
        if tilt is None:  # the raw argmax, when the grammar allows it, is the masked argmax: no unpacking
            t = int(np.argmax(row))
            if np.isfinite(row[t]) and (mask is None or mask_allows(mask, t)):
                return t
        ids, z, buf = self._logits(row, self._allowed(block, i, mask, len(row)), tilt, where)
        j = int(np.argmax(z))
        if buf is not None:
            _POOL.give(buf)
        return j if ids is None else int(ids[j])

    def _law(self, row: np.ndarray, allowed, tilt, params: SamplingParams, where: str) -> _Law:
        ids, z, buf = self._logits(row, allowed, tilt, where)
        if params.temperature_last:  # llama.cpp's order: the filters on the untempered logits, then temperature
            kept = _filtered(ids, z.copy(), params, None)
            if kept.idx is None:  # nothing filtered: the whole masked row
                return _Law.of(None, np.divide(z, params.temperature, out=z), buf)
            pos = kept.idx if ids is None else np.searchsorted(ids, kept.idx)
            law = _Law.of(kept.idx, z[pos] / params.temperature)
            if buf is not None:
                _POOL.give(buf)
            return law
        return _filtered(ids, np.divide(z, params.temperature, out=z), params, buf)

    # ------------------------------------------------------------------ the backend interface
    def draft(self, logits, block, params: SamplingParams, u: float, *, blind: bool = False,
              width: int | None = None):
        row = np.asarray(logits).reshape(-1)
        width = width or len(row)
        if len(row) < width:  # a narrower draft head: the extra ids are never drafted
            row = np.concatenate([row, np.full(width - len(row), NEG_INF, dtype=row.dtype)])
        row = row[:width]
        mask = None if blind else block.mask()
        tilt = None if blind else block.tilt()
        t0 = time.perf_counter_ns()
        i = -1 if blind else block.position
        if params.greedy:
            token, law = self._greedy(row, block, i, mask, tilt, "the draft position"), None
        else:
            law = self._law(row, self._allowed(block, i, mask, width), tilt, params, "the draft position")
            token = law.sample(u)
        block.tick("draft_law", t0)
        return token, law

    def verify(self, logits, block, params: SamplingParams, u: np.ndarray, u_final: float) -> Verdict:
        masks, tilts = block.finish()
        rows = np.asarray(logits)
        width = rows.shape[-1]
        drafts, laws = block.tokens, block.laws
        k = len(drafts)
        law_ns = 0
        t0 = time.perf_counter_ns()

        def law_at(i: int):
            mask = None if masks is None else masks[i]
            tilt = None if tilts is None else tilts[i]
            if params.greedy:
                return self._greedy(rows[i], block, i, mask, tilt, f"row(s) [{i}]")
            return self._law(rows[i], self._allowed(block, i, mask, width), tilt, params, f"row(s) [{i}]")

        for i in range(k):
            t1 = time.perf_counter_ns()
            q = law_at(i)
            law_ns += time.perf_counter_ns() - t1
            d = drafts[i]
            if params.greedy:
                if q != d:
                    return self._done(block, t0, law_ns, Verdict(i, q, True))
                continue
            q_d = q.prob(d)
            r = laws[i]
            r_d = 1.0 if r is None else r.prob(d)
            ratio = q_d / r_d if r_d > 0 else (np.inf if q_d > 0 else 0.0)
            if u[i] >= min(1.0, ratio):
                return self._done(block, t0, law_ns, Verdict(i, self._residual(q, r, d, width, u_final), True))
        t1 = time.perf_counter_ns()
        q = law_at(k)
        law_ns += time.perf_counter_ns() - t1
        return self._done(block, t0, law_ns, Verdict(k, q if params.greedy else q.sample(u_final), False))

    @staticmethod
    def _done(block, t0: int, law_ns: int, v: Verdict) -> Verdict:
        total = time.perf_counter_ns() - t0
        block.timing["target_law"] = block.timing.get("target_law", 0) + law_ns
        block.timing["verify"] = block.timing.get("verify", 0) + total - law_ns
        return v

    @staticmethod
    def _residual(q: _Law, r: _Law | None, d: int, width: int, u_final: float) -> int:
        """The reference's residual draw, norm(max(0, q - r)) (r one-hot at ``d`` when None), over q's support
        (the only place q - r can be positive)."""
        pq = q.probs_at(q.idx, width)
        if r is None:
            resid = pq.copy()
            pos = d if q.idx is None else int(np.searchsorted(q.idx, d))
            if pos < len(resid) and (q.idx is None or q.idx[pos] == d):
                resid[pos] = 0.0
        else:
            resid = np.maximum(0.0, pq - r.probs_at(q.idx, width))
        total = resid.sum()
        if not total > 0.0:  # q == r up to rounding: the rejection had probability ~0; q is then the right law
            resid, total = pq, pq.sum()
        j = _draw(resid / total, u_final)
        return j if q.idx is None else int(q.idx[j])

    def dense(self, law, width: int) -> np.ndarray:
        return law.dense(width)
