"""Every law backend against the reference (``distributions.log_law`` + ``verify.verify_block_u``, float64).

- small vocabularies, random masks, temperature, top-k / top-p / min-p, llama.cpp's order, tilts, one-hot and model
  drafts, k = 1..8: the same draft tokens and the same verdicts as the reference, draw for draw, from the same
  uniforms (so the same law: a backend is a deterministic function of the uniforms);
- the committed token's law by a chi-square test against the exact law (numpy backend, 100,000 rounds);
- full-size rows (V = 151,936, wide and narrow masks): identical greedy verdicts, and identical sampled verdicts
  from the same uniforms;
- mask once: in every round each position's mask is filled exactly once (forced drafter, draft laws and target law
  share it), on every engine.
The mlx and torch backends are tested twice: as the adapters use them on this CPU (numpy on zero-copy views) and
with their device algorithm forced (``force_device``), which is what runs on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from conftest import available_engines
from specgrammar_plugins import laws
from specgrammar_plugins.block import DraftBlock
from specgrammar_plugins.distributions import SamplingParams, log_law
from specgrammar_plugins.masks import pack_mask
from specgrammar_plugins.testing import TableMatcher

PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "T=0.7": SamplingParams(temperature=0.7),
    "T=1 top-k 3": SamplingParams(temperature=1.0, top_k=3),
    "T=0.9 top-p 0.8": SamplingParams(temperature=0.9, top_p=0.8),
    "T=1.2 min-p 0.1": SamplingParams(temperature=1.2, min_p=0.1),
    "T=0.8 all filters": SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
    "llama.cpp order": SamplingParams(temperature=0.6, top_k=5, top_p=0.85, min_p=0.02, temperature_last=True),
}


def _variants() -> dict:
    out = {"numpy": laws.get("numpy")}
    for name in ("mlx", "torch"):
        try:
            out[name] = laws.get(name)
        except ValueError:
            continue
        forced = type(out[name])()
        forced.force_device = True  # the device algorithm, as on a GPU (here on the CPU device)
        out[f"{name} (device)"] = forced
    return out


VARIANTS = _variants()
REF = laws.get("reference")


def _as(backend_name: str, a: np.ndarray):
    """Logits in the backend's own tensor type."""
    if backend_name.startswith("mlx"):
        import mlx.core as mx

        return mx.array(a)
    if backend_name.startswith("torch"):
        import torch

        return torch.from_numpy(np.ascontiguousarray(a))
    return a


def _round(backend, name: str, case: dict, params: SamplingParams):
    """Draft a block with ``backend`` (model drafts from the draft logits, one-hot drafts as given) and verify it:
    (draft tokens, verdict)."""
    masks, tilts = case["masks"], case["tilts"]
    tilt_fn = None if tilts is None else (lambda gen, _m: tilts[len(gen)])
    block = DraftBlock([0], TableMatcher(masks, case["V"]), case["V"], len(case["kinds"]), tilt_fn=tilt_fn,
                       prompt_len=1, law=backend)
    for i, kind in enumerate(case["kinds"]):
        if kind == "model":
            token, law = backend.draft(_as(name, case["draft"][i]), block, params, case["u_draft"][i],
                                       width=case["V"])
            assert block.push(token, law, "model"), (i, token)
        else:
            assert block.push(case["one_hot"][i], None, "forced")
    v = backend.verify(_as(name, case["target"]), block, params, case["u"], case["u_final"])
    return list(block.tokens), (v.accepted, v.token, v.residual)


def _case(rng, V: int, k: int, tilt: bool) -> dict:
    allowed = rng.random((k + 1, V)) < rng.uniform(0.2, 1.0)
    allowed[np.arange(k + 1), rng.integers(0, V, k + 1)] = True
    target = (rng.standard_normal((k + 1, V)) * 2).astype(np.float32)
    draft = (target[:k] + rng.standard_normal((k, V)) * rng.uniform(0.2, 2)).astype(np.float32)
    if rng.random() < 0.1:  # an equal-logit tie, a non-finite logit (another token stays allowed)
        target[0, :2] = target[0, 0]
        j = int(rng.integers(0, V))
        target[-1, j] = np.nan
        allowed[-1, (j + 1) % V] = True
    return {"V": V, "masks": [pack_mask(a) for a in allowed], "target": target, "draft": draft,
            "kinds": ["model" if rng.random() < 0.6 else "one-hot" for _ in range(k)],
            "one_hot": [int(rng.choice(np.flatnonzero(a))) for a in allowed[:k]],
            "tilts": [rng.random(V) * 2 for _ in range(k + 1)] if tilt else None,
            "u_draft": rng.random(k), "u": rng.random(k), "u_final": float(rng.random())}


@pytest.mark.parametrize("pname", list(PARAMS))
@pytest.mark.parametrize("vname", list(VARIANTS))
def test_same_draws_and_verdicts_as_the_reference(vname, pname):
    backend, params = VARIANTS[vname], PARAMS[pname]
    rng = np.random.default_rng(abs(hash((vname, pname))) % 2**32)
    for trial in range(120):
        k = int(rng.integers(1, 9))
        case = _case(rng, int(rng.integers(2, 40)), k, tilt=trial % 4 == 3)
        ref = _round(REF, "reference", case, params)
        got = _round(backend, vname, case, params)
        assert got == ref, (trial, k, case["kinds"])


def test_the_committed_token_follows_the_target_law():
    """numpy backend: the first committed token of a round is distributed as the target law at that position,
    whatever the drafts (model drafts sampled from r, one-hot drafts), by chi-square over 100,000 rounds."""
    backend = laws.get("numpy")
    params = SamplingParams(temperature=0.9, top_k=7, top_p=0.95)
    rng = np.random.default_rng(7)
    V, k, n = 9, 3, 100_000
    case = _case(rng, V, k, tilt=False)
    case["kinds"] = ["model", "one-hot", "model"]
    q0 = np.exp(log_law(case["target"][0], case["masks"][0], params))
    counts = np.zeros(V)
    for _ in range(n):
        case["u_draft"], case["u"], case["u_final"] = rng.random(k), rng.random(k), float(rng.random())
        tokens, (a, token, _) = _round(backend, "numpy", case, params)
        counts[tokens[0] if a >= 1 else token] += 1
    keep = q0 > 0
    assert counts[~keep].sum() == 0
    _, p = stats.chisquare(counts[keep], q0[keep] / q0[keep].sum() * n)
    assert p > 0.001, (p, counts, q0 * n)


@pytest.fixture(scope="module")
def full_rows():
    rng = np.random.default_rng(151936)
    V, k = 151936, 4
    wide = rng.random((k + 1, V)) < 0.97
    narrow = np.zeros((k + 1, V), bool)
    for row in narrow:
        row[rng.choice(V, 50, replace=False)] = True
    return rng, V, k, wide, narrow


FULL = {"greedy": SamplingParams(temperature=0.0), "T=0.7": SamplingParams(temperature=0.7),
        "T=0.7 top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
        "T=1 top-k 50 min-p 0.05": SamplingParams(temperature=1.0, top_k=50, min_p=0.05)}


@pytest.mark.parametrize("pname", list(FULL))
@pytest.mark.parametrize("vname", list(VARIANTS))
def test_full_size_rows_give_identical_verdicts(full_rows, vname, pname):
    rng0, V, k, wide, narrow = full_rows
    rng = np.random.default_rng(abs(hash((vname, pname))) % 2**32)
    params = FULL[pname]
    for trial in range(4):
        allowed = narrow if trial % 2 else wide
        target = (rng.standard_normal((k + 1, V)) * 3).astype(np.float32)
        case = {"V": V, "masks": [pack_mask(a) for a in allowed], "target": target,
                "draft": (target[:k] + rng.standard_normal((k, V)).astype(np.float32)).astype(np.float32),
                "kinds": ["model", "model", "one-hot", "model"],
                "one_hot": [int(rng.choice(np.flatnonzero(a))) for a in allowed[:k]],
                "tilts": [rng.random(V) for _ in range(k + 1)] if trial == 3 else None,
                "u_draft": rng.random(k), "u": rng.random(k), "u_final": float(rng.random())}
        assert _round(VARIANTS[vname], vname, case, params) == _round(REF, "reference", case, params), trial


# ---------------------------------------------------------------------------------------------- mask once
ENGINES = available_engines()


@pytest.mark.parametrize("engine", ENGINES)
def test_each_position_is_masked_once_per_round(engine, toy_tok):
    from specgrammar_plugins import ConstraintSpec, compile_constraint
    from specgrammar_plugins.drafters import ChainDrafter, ForcedDrafter, ModelDrafter
    from specgrammar_plugins.loop import SpeculativeLoop
    from specgrammar_plugins.testing import CountingMatcher, MarkovRunner

    spec = ConstraintSpec.regex(r'\{"id": [0-9]{2,4}, "tag": "(ab|ba)[a-z]{0,3}"\}')
    c = compile_constraint(spec, toy_tok, engine=engine)
    for temperature in (0.0, 0.8):
        target = MarkovRunner(toy_tok.vocab_size, seed=3)
        draft = MarkovRunner(toy_tok.vocab_size, seed=3, noise_of=target, noise=0.5)
        rng = np.random.default_rng(0)
        params = SamplingParams(temperature=temperature)
        counting = CountingMatcher(c.matcher())
        drafter = ChainDrafter([ForcedDrafter(toy_tok.encode), ModelDrafter(draft, params, rng)])
        loop = SpeculativeLoop(target, toy_tok.encode("ab"), constraint=c, matcher=counting, drafter=drafter, k=4,
                               params=params, max_tokens=60, rng=rng)
        loop.generate()
        st = loop.stats
        assert st.rounds > 1 and st.forced_tokens > 0
        assert st.mask_rows == st.drafted + st.rounds  # every round visits its drafts and the bonus position
        assert counting.counter[0] == st.mask_fills == st.mask_rows - st.mask_placeholders, (
            counting.counter[0], st.mask_fills, st.mask_rows, st.mask_placeholders)
