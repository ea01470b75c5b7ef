"""Exactness in law of the mlx-lm adapter at T = 0.7 and 1.0, and tokens per target pass vs mlx-lm's own loop.

Law test, on two small regex grammars:

- ``email``: ``[a-d]{1,3}`` after an email prompt (~120 token sequences, entropy 2.1-2.7 nats), a spot where the
  draft and the target disagree: a loop that leaked the draft's law would fail here.
- ``code``: ``[0-2]{3}`` after "Make up a code of 3 digits" (the models learnt uniform random digits there from
  the build's "Make up" documents): draft and target agree in law, the drafts are accepted, and the output must
  still be the target's law.

The exact law of plain constrained sampling is enumerated (a prefix tree of single-token target passes, each row
through the core's ``log_law`` with the grammar mask).  N = 300 samples from our speculative loop (grammar-aware
draft model, k = 4, exact accept/residual) and N = 300 from mlx-lm's own plain constrained sampling
(``generate_step`` + ``make_sampler`` + our history-keyed processor) are each tested against it with a chi-square
goodness-of-fit test: outcomes with expected count >= 5 are bins of their own, the rest are pooled.  Seeds are
fixed, so the test is deterministic; it fails below p = 1e-3 (noise floor: a correct sampler fails with
probability 1e-3 per seed set).  Power check (email): the same test rejects our T = 1.0 samples against the
T = 0.7 law.

Speed: tokens per target pass of our loop vs mlx-lm's ``speculative_generate_step`` with the history-keyed
processor and the same draft model, k = 4, T = 0.7 and 1.0, 100 seeds each.  Per draft position our
accept/residual verification accepts with probability sum(min(p, q)), mlx-lm's token matching with
sum(p * q) <= sum(min(p, q)).  On the code grammars, where the answer is a genuine random draw, the gap is the
issue's measure: at least 1.5x is asserted for the law grammar.  On json_extraction (10 prompts) the answer is
copied from the prompt, the target is nearly certain, sum(p * q) is close to sum(min(p, q)), and only ours >=
theirs is asserted (the figures are printed; docs/BENCHMARKS.md records them).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from test_mlx_common import load_tiny_pair, mlx_speculative, prompt_ids

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from scipy import stats  # noqa: E402

from specgrammar_plugins import ConstraintSpec  # noqa: E402
from specgrammar_plugins.masks import new_mask  # noqa: E402
from specgrammar_plugins.distributions import SamplingParams, log_law  # noqa: E402
from specgrammar_plugins.workloads import examples  # noqa: E402

# name -> (user prompt, regex); the first two are the law grammars
CASES = {
    "email": (None, r"[a-d]{1,3}"),  # None: the first email eval prompt
    "code": ("Make up a code of 3 digits", r"[0-2]{3}"),
    "code8": ("Make up a code of 8 digits", r"[0-9]{8}"),
}
N = 300
SPEED_SEEDS = 100
RATIO_BAR = 1.5
P_FLOOR = 1e-3


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_pair()


def law_case(tiny, case: str):
    from specgrammar_mlx_lm.processor import compile_for
    from specgrammar_mlx_lm.runner import output_width

    model, draft, tok = tiny
    user, regex = CASES[case]
    ids = prompt_ids(tok, user if user is not None else examples("email", "eval", 1)[0].prompt)
    compiled = compile_for(ConstraintSpec.regex(regex), tok, output_width(model))
    return ids, compiled


def exact_law(model, ids, compiled, params) -> dict[tuple, float]:
    """P(token sequence) under plain constrained sampling, by enumeration (every sequence ends with a stop)."""
    from specgrammar_mlx_lm.runner import MLXRunner

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

    from specgrammar_mlx_lm.generate import generate_tokens

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

    from specgrammar_mlx_lm.processor import GrammarLogitsProcessor

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


@pytest.mark.parametrize("case", ["email", "code"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_output_law_matches_plain_constrained_sampling(tiny, temperature, case):
    model, draft, tok = tiny
    ids, compiled = law_case(tiny, case)
    law = exact_law(model, ids, compiled, SamplingParams(temperature=temperature))
    assert abs(sum(law.values()) - 1.0) < 1e-6
    ours, _ = ours_samples(model, draft, tok, ids, compiled, temperature)
    p_ours = chi_square_p(ours, law)
    plain = mlx_plain_samples(model, tok, ids, compiled, temperature)
    p_plain = chi_square_p(plain, law)
    print(f"{case} T={temperature}: chi-square p ours {p_ours:.3g}, mlx-lm plain {p_plain:.3g} ({len(law)} outcomes)")
    assert p_plain > P_FLOOR, "mlx-lm's own constrained sampling should follow the enumerated law"
    assert p_ours > P_FLOOR
    if temperature == 1.0 and case == "email":  # power: the test tells T=1.0 samples from the T=0.7 law
        law07 = exact_law(model, ids, compiled, SamplingParams(temperature=0.7))
        assert chi_square_p(ours, law07) < P_FLOOR


def _ratio(model, draft, tok, runs, temperature) -> tuple[float, float]:
    """Tokens per target pass, ours and mlx-lm's speculative loop, over ``runs`` = [(prompt ids, constraint, seed)]."""
    from mlx_lm.sample_utils import make_sampler

    from specgrammar_mlx_lm.generate import generate_tokens
    from specgrammar_mlx_lm.processor import GrammarLogitsProcessor

    eos = set(tok.eos_token_ids)
    ours_tok = ours_pass = mlx_tok = mlx_pass = 0
    for ids, compiled, seed in runs:
        toks, st = generate_tokens(model, tok, ids, max_tokens=64, draft_model=draft, num_draft_tokens=4,
                                   constraint=compiled, temperature=temperature, seed=seed)
        ours_tok += st.emitted
        ours_pass += st.target_passes
        mx.random.seed(seed)
        out, passes = mlx_speculative(model, draft, ids, processor=GrammarLogitsProcessor(compiled), k=4,
                                      max_tokens=64, sampler=make_sampler(temperature), eos_ids=eos)
        mlx_tok += len(out)
        mlx_pass += passes
    return ours_tok / ours_pass, mlx_tok / mlx_pass


@pytest.mark.parametrize("case", ["code", "code8", "json_extraction"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_tokens_per_target_pass_vs_mlx_speculative(tiny, temperature, case):
    from specgrammar_mlx_lm.processor import compile_for
    from specgrammar_mlx_lm.runner import output_width

    model, draft, tok = tiny
    if case == "json_extraction":
        exs = examples("json_extraction", "eval", 10)
        compiled = compile_for(exs[0].constraint, tok, output_width(model))  # one schema for the whole workload
        runs = [(prompt_ids(tok, ex.prompt), compiled, i) for i, ex in enumerate(exs)]
    else:
        ids, compiled = law_case(tiny, case)
        runs = [(ids, compiled, seed) for seed in range(SPEED_SEEDS)]
    ours, theirs = _ratio(model, draft, tok, runs, temperature)
    print(f"{case} T={temperature}: tokens per target pass: ours {ours:.2f}, mlx-lm speculative {theirs:.2f}, "
          f"ratio {ours / theirs:.2f}")
    assert ours >= theirs
    if case == "code":
        assert ours >= RATIO_BAR * theirs
