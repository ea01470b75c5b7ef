"""The one law (distributions.log_law) and the block verifier's output law, against exact targets."""

import zlib

import numpy as np
import pytest
from scipy import stats

from specgrammar_plugins import EmptyMaskError, SamplingParams, log_law, verify_block
from specgrammar_plugins.masks import pack_mask, unpack_mask
from specgrammar_plugins.distributions import sample

V = 7


def _mask(*allowed):
    a = np.zeros(V, bool)
    a[list(allowed)] = True
    return pack_mask(a)


def test_pack_roundtrip():
    rng = np.random.default_rng(0)
    a = rng.random((3, 77)) < 0.4
    assert (unpack_mask(pack_mask(a), 77) == a).all()
    # bit 31 of a word (sign bit of int32) round-trips too
    b = np.zeros(64, bool)
    b[31] = b[63] = True
    assert (unpack_mask(pack_mask(b), 64) == b).all()


def test_mask_temperature_and_tilt():
    logits = np.array([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 0.2])
    lp = log_law(logits, _mask(0, 1, 4), SamplingParams(temperature=0.5))
    p = np.exp(lp)
    z = logits[[0, 1, 4]] / 0.5
    want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    assert np.allclose(p[[0, 1, 4]], want)
    assert p[[2, 3, 5, 6]].sum() == 0.0
    # the tilt subtracts lambda*Delta before the temperature
    tilt = np.array([0.0, 1.0, 0, 0, 2.0, 0, 0])
    p2 = np.exp(log_law(logits, _mask(0, 1, 4), SamplingParams(temperature=0.5), tilt))
    z2 = (logits - tilt)[[0, 1, 4]] / 0.5
    assert np.allclose(p2[[0, 1, 4]], np.exp(z2 - z2.max()) / np.exp(z2 - z2.max()).sum())


def test_top_k_top_p_min_p():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05, 0.0 + 1e-300, 1e-300]))
    p = np.exp(log_law(logits, None, SamplingParams(top_k=2)))
    assert np.allclose(p[:2], [0.4 / 0.7, 0.3 / 0.7]) and p[2:].sum() == 0
    p = np.exp(log_law(logits, None, SamplingParams(top_p=0.8)))  # keeps 0.4, 0.3, 0.15 (mass before 0.15 is 0.7)
    assert np.allclose(p[:3], np.array([0.4, 0.3, 0.15]) / 0.85) and p[3:].sum() == 0
    p = np.exp(log_law(logits, None, SamplingParams(min_p=0.3)))  # >= 0.12
    assert np.allclose(p[:3], np.array([0.4, 0.3, 0.15]) / 0.85)


def test_greedy_is_first_argmax_of_masked_logits():
    logits = np.array([5.0, 1.0, 3.0, 3.0, 9.0, 0, 0])
    lp = log_law(logits, _mask(1, 2, 3), SamplingParams(temperature=0))
    assert np.exp(lp).tolist() == [0, 0, 1, 0, 0, 0, 0]


def test_fully_masked_row_is_a_clear_error():
    with pytest.raises(EmptyMaskError, match="no token is allowed"):
        log_law(np.zeros((2, V)), np.stack([_mask(1), _mask()]), SamplingParams())


def test_sample_never_lands_on_excluded():
    rng = np.random.default_rng(1)
    lp = log_law(np.zeros(V), _mask(2, 5), SamplingParams())
    draws = {sample(lp, rng) for _ in range(2000)}
    assert draws == {2, 5}


# --------------------------------------------------------------------------- the verifier's output law
PARAM_SETS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7-top_p": SamplingParams(temperature=0.7, top_p=0.9),
    "T1.3-top_k-min_p": SamplingParams(temperature=1.3, top_k=5, min_p=0.05),
}


def _laws(rng, n, params, tilt_scale):
    """n positions of (target law, draft law) with masks and a tilt; both laws use the same mask and tilt."""
    q, r = [], []
    for _ in range(n):
        allowed = rng.random(V) < 0.7
        allowed[rng.integers(V)] = True
        m = pack_mask(allowed)
        tilt = tilt_scale * rng.random(V)
        tl = rng.normal(0, 1.5, V)
        dl = tl + rng.normal(0, 1.0, V)  # the draft agrees often but not always
        q.append(log_law(tl, m, params, tilt))
        r.append(log_law(dl, m, params, tilt))
    return np.array(q), np.array(r)


@pytest.mark.parametrize("kind", ["model", "onehot", "mixed"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("pname", list(PARAM_SETS))
def test_block_verifier_samples_the_target_law(kind, k, pname):
    """Commit tokens round after round with drafts from r (or one-hot drafts from a fixed guess) and verify: the
    token at each output position is distributed as q at that position (laws here do not depend on the prefix, so
    position marginals are the whole story), and no mass lands on a masked token.
    Noise floor: chi-square goodness of fit at p > 0.001 per position with a fixed seed (deterministic)."""
    params = PARAM_SETS[pname]
    rng = np.random.default_rng(zlib.crc32(f"{kind}-{k}-{pname}".encode()))
    L = 2  # output positions checked
    q, r = _laws(rng, L + k + 1, params, tilt_scale=0.8)
    guesses = rng.integers(0, V, size=L + k + 1)
    N = 6000
    counts = np.zeros((L, V), dtype=np.int64)
    for _ in range(N):
        pos = 0
        out = []
        while pos < L:
            drafts, dlaws = [], []
            for i in range(k):
                j = pos + i
                onehot = kind == "onehot" or (kind == "mixed" and (i % 2 == 1))
                if onehot:
                    allowed = np.isfinite(q[j])
                    d = int(guesses[j]) if allowed[guesses[j]] else int(np.flatnonzero(allowed)[0])
                    drafts.append(d)
                    dlaws.append(None)
                else:
                    drafts.append(sample(r[j], rng))
                    dlaws.append(r[j])
            v = verify_block(drafts, q[pos: pos + k + 1], dlaws, rng)
            new = drafts[: v.accepted] + [v.token]
            out.extend(new)
            pos += len(new)
        for j in range(L):
            counts[j, out[j]] += 1
    for j in range(L):
        p = np.exp(q[j])
        assert counts[j][p == 0].sum() == 0, "mass landed on a masked/filtered token"
        keep = p > 0
        expected = p[keep] * N
        if keep.sum() > 1:
            chi2 = stats.chisquare(counts[j][keep], expected)
            assert chi2.pvalue > 0.001, (j, counts[j], expected)


def test_greedy_verification_is_deterministic_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V))
    q = log_law(logits, None, SamplingParams(temperature=0))
    best = np.argmax(logits, axis=-1)
    drafts = [int(best[0]), int(best[1]), int((best[2] + 1) % V)]
    for _ in range(50):
        v = verify_block(drafts, q, None, rng)
        assert (v.accepted, v.token) == (2, int(best[2]))
    v = verify_block(list(best[:3]), q, None, rng)
    assert (v.accepted, v.token, v.residual) == (3, int(best[3]), False)


def test_temperature_last_is_llama_cpp_order():
    """``temperature_last``: top-k -> top-p -> min-p on the untempered logits, then temperature (llama.cpp)."""
    rng = np.random.default_rng(5)
    z = rng.normal(size=(6, 40)) * 2.0
    p = SamplingParams(temperature=0.5, top_k=20, top_p=0.8, min_p=0.05, temperature_last=True)
    got = np.exp(log_law(z, None, p))
    for row, g in zip(z, got):
        keep = np.zeros(40, dtype=bool)
        keep[np.argsort(-row)[:20]] = True  # top-k
        pr = np.where(keep, np.exp(row - row.max()), 0.0)
        pr /= pr.sum()
        order = np.argsort(-pr)
        before = np.cumsum(pr[order]) - pr[order]
        keep[order[before >= 0.8]] = False  # top-p: keep tokens until the mass reaches p
        keep &= row >= row[keep].max() + np.log(0.05)  # min-p relative to the best logit
        want = np.where(keep, np.exp((row - row.max()) / 0.5), 0.0)
        np.testing.assert_allclose(g, want / want.sum(), atol=1e-12)
    # no filters: the order does not matter
    plain = SamplingParams(temperature=0.7)
    np.testing.assert_allclose(log_law(z, None, plain),
                               log_law(z, None, SamplingParams(temperature=0.7, temperature_last=True)))
