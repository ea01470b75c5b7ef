"""Exactness in law of the mlx-lm adapter at T = 0.7 and 1.0, and tokens per target pass vs mlx-lm's own loop.

Law test: on a small regex grammar (``[a-d]{1,3}`` after an email prompt: ~120 token sequences, entropy 2.1-2.7
nats) the exact law of plain constrained sampling is enumerated (a prefix tree of single-token target passes,
each row through the core's ``log_law`` with the grammar mask).  N = 300 samples from our speculative loop
(grammar-aware draft model, k = 4, exact accept/residual) and N = 300 from mlx-lm's own plain constrained
sampling (``generate_step`` + ``make_sampler`` + our history-keyed processor) are each tested against it with a
chi-square goodness-of-fit test: outcomes with expected count >= 5 are bins of their own, the rest are pooled.
Seeds are fixed, so the test is deterministic; it fails below p = 1e-3 (noise floor: a correct sampler fails
with probability 1e-3 per seed set).  Power check: the same test rejects our T = 1.0 samples against the T = 0.7
law.

Speed: tokens per target pass of our loop vs mlx-lm's ``speculative_generate_step`` with the history-keyed
processor and the same draft model, at T = 0.7 and 1.0, k = 4, on json_extraction prompts (printed).  Per draft
position our accept/residual verification accepts with probability sum(min(p, q)), mlx-lm's token matching with
sum(p * q) <= sum(min(p, q)), so ours must not be lower.  How much higher depends on the pair: 1.8x / 2.5x on an
interim tiny pair; on the committed one (10 prompts) 3.60 vs 3.01 = 1.19x at T = 0.7 and 3.29 vs 2.82 = 1.17x at
T = 1.0 (its draft agrees with the target closely enough that sum(p * q) is near sum(min(p, q)); the issue's 1.5x
is not reached with this pair; see the benchmark for every workload).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from test_mlx_common import mlx_speculative, prompt_ids, tiny_model_dirs

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from scipy import stats  # noqa: E402

from specgrammar_plugins import ConstraintSpec  # noqa: E402
from specgrammar_plugins.constraint import new_mask  # noqa: E402
from specgrammar_plugins.distributions import SamplingParams, log_law  # noqa: E402
from specgrammar_plugins.workloads import examples  # noqa: E402

REGEX = r"[a-d]{1,3}"
N = 300
P_FLOOR = 1e-3


@pytest.fixture(scope="module")
def tiny():
    from mlx_lm import load

    t, d = tiny_model_dirs()
    model, tok = load(str(t))
    draft, _ = load(str(d))
    return model, draft, tok


@pytest.fixture(scope="module")
def setup(tiny):
    from specgrammar_plugins.adapters.mlx_lm.processor import compile_for
    from specgrammar_plugins.adapters.mlx_lm.runner import output_width

    model, draft, tok = tiny
    ids = prompt_ids(tok, examples("email", "eval", 1)[0].prompt)
    compiled = compile_for(ConstraintSpec.regex(REGEX), tok, output_width(model))
    return ids, compiled


def exact_law(model, ids, compiled, params) -> dict[tuple, float]:
    """P(token sequence) under plain constrained sampling, by enumeration (every sequence ends with a stop)."""
    from specgrammar_plugins.adapters.mlx_lm.runner import MLXRunner

    runner = MLXRunner(model)
    stops = set(compiled.tokenizer.stop_token_ids)
    law: dict[tuple, float] = {}
    stack = [((), 0.0)]
    row = new_mask(compiled.tokenizer.vocab_size)
    while stack:
        prefix, lp = stack.pop()
        matcher = compiled.matcher()
        for t in prefix:
            assert matcher.accept(t)
        seq = ids + list(prefix)
        runner.sync(seq[:-1])
        logits = runner.forward([seq[-1]], logits_for=1)[-1]
        matcher.fill_mask(row)
        q = log_law(logits, row, params)
        for t in np.flatnonzero(np.isfinite(q)):
            nxt, p = prefix + (int(t),), lp + float(q[t])
            if int(t) in stops:
                law[nxt] = law.get(nxt, 0.0) + float(np.exp(p))
            else:
                stack.append((nxt, p))
    return law


def chi_square_p(samples: list[tuple], law: dict[tuple, float]) -> float:
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= set(law), f"outcomes outside the law: {set(counts) - set(law)}"
    big = [o for o, p in law.items() if p * n >= 5]
    obs = [counts.get(o, 0) for o in big]
    exp = [law[o] * n for o in big]
    rest_exp = n - sum(exp)
    if rest_exp > 1e-9:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    return float(stats.chisquare(obs, exp).pvalue)


def ours_samples(model, draft, tok, ids, compiled, temperature) -> tuple[list[tuple], float]:
    from mlx_lm.models.cache import make_prompt_cache

    from specgrammar_plugins.adapters.mlx_lm.generate import generate_tokens

    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    out, emitted, passes = [], 0, 0
    for seed in range(N):
        # reuse the prefilled prompt: the caches hold the prompt + the previous output, the twin trims the output
        first = seed == 0
        toks, st = generate_tokens(model, tok, ids if first else [], max_tokens=8, draft_model=draft,
                                   num_draft_tokens=4, constraint=compiled, temperature=temperature, seed=seed,
                                   prompt_cache=cache, cached_tokens=None if first else ids)
        assert all(c.offset == len(ids) + len(toks) for c in cache), "both caches must hold prompt + emitted"
        out.append(tuple(toks))
        emitted += st.emitted
        passes += st.target_passes
    return out, emitted / passes


def mlx_plain_samples(model, tok, ids, compiled, temperature) -> list[tuple]:
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from specgrammar_plugins.adapters.mlx_lm.processor import GrammarLogitsProcessor

    cache = make_prompt_cache(model)
    model(mx.array([ids[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    eos = set(tok.eos_token_ids)
    out = []
    for seed in range(N):
        mx.random.seed(seed)
        toks = []
        gen = generate_step(mx.array(ids[-1:]), model, max_tokens=8, sampler=make_sampler(temperature),
                            logits_processors=[GrammarLogitsProcessor(compiled)], prompt_cache=cache)
        for t, _ in gen:
            toks.append(int(t))
            if t in eos:
                break
        gen.close()
        trim_prompt_cache(cache, cache[0].offset - (len(ids) - 1))
        out.append(tuple(toks))
    return out


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_output_law_matches_plain_constrained_sampling(tiny, setup, temperature):
    model, draft, tok = tiny
    ids, compiled = setup
    law = exact_law(model, ids, compiled, SamplingParams(temperature=temperature))
    assert abs(sum(law.values()) - 1.0) < 1e-6
    ours, _ = ours_samples(model, draft, tok, ids, compiled, temperature)
    p_ours = chi_square_p(ours, law)
    plain = mlx_plain_samples(model, tok, ids, compiled, temperature)
    p_plain = chi_square_p(plain, law)
    print(f"T={temperature}: chi-square p ours {p_ours:.3g}, mlx-lm plain {p_plain:.3g} ({len(law)} outcomes)")
    assert p_plain > P_FLOOR, "mlx-lm's own constrained sampling should follow the enumerated law"
    assert p_ours > P_FLOOR
    if temperature == 1.0:  # power: the test tells T=1.0 samples from the T=0.7 law
        law07 = exact_law(model, ids, compiled, SamplingParams(temperature=0.7))
        assert chi_square_p(ours, law07) < P_FLOOR


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_tokens_per_target_pass_vs_mlx_speculative(tiny, temperature):
    from mlx_lm.sample_utils import make_sampler

    from specgrammar_plugins.adapters.mlx_lm.generate import generate_tokens
    from specgrammar_plugins.adapters.mlx_lm.processor import grammar_logits_processor

    model, draft, tok = tiny
    eos = set(tok.eos_token_ids)
    ours_tok = ours_pass = mlx_tok = mlx_pass = 0
    for i, ex in enumerate(examples("json_extraction", "eval", 10)):
        ids = prompt_ids(tok, ex.prompt)
        toks, st = generate_tokens(model, tok, ids, max_tokens=64, draft_model=draft, num_draft_tokens=4,
                                   constraint=ex.constraint, temperature=temperature, seed=i)
        ours_tok += st.emitted
        ours_pass += st.target_passes
        mx.random.seed(i)
        out, passes = mlx_speculative(model, draft, ids, processor=grammar_logits_processor(ex.constraint, tok, model),
                                      k=4, max_tokens=64, sampler=make_sampler(temperature), eos_ids=eos)
        mlx_tok += len(out)
        mlx_pass += passes
    ours, theirs = ours_tok / ours_pass, mlx_tok / mlx_pass
    print(f"T={temperature}: tokens per target pass: ours {ours:.2f}, mlx-lm speculative {theirs:.2f}, "
          f"ratio {ours / theirs:.2f}")
    assert ours >= theirs
