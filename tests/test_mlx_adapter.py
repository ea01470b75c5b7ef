"""The mlx-lm adapter on the bundled tiny models: runner, stream_generate twin, history-keyed processor (under
mlx-lm's generate_step, speculative_generate_step and BatchGenerator).  Greedy equality per workload and k is in
test_mlx_greedy.py."""

from __future__ import annotations

import numpy as np
import pytest

from test_mlx_common import load_tiny_pair, mlx_speculative, plain_generate_step, prompt_ids

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from specgrammar_plugins import ConstraintSpec  # noqa: E402
from specgrammar_plugins.workloads import examples  # noqa: E402

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_pair()


def _processor(spec, tok, model):
    from specgrammar_mlx_lm.processor import grammar_logits_processor

    return grammar_logits_processor(spec, tok, model) if spec is not None else None


# ------------------------------------------------------------------------------------------------ runner
def test_runner_forward_trim_and_logits_match_a_fresh_pass(tiny):
    from specgrammar_mlx_lm.runner import MLXRunner

    model, _, tok = tiny
    ids = prompt_ids(tok, "Find the year: The bridge opened in 1999.")
    r = MLXRunner(model)
    import mlx.core as mx

    full = r.forward(ids)  # the logits stay in mlx
    assert isinstance(full, mx.array) and full.shape == (len(ids), r.vocab_size) and full.dtype == mx.float32
    full = np.asarray(full)
    assert r.tokens == ids
    r.trim(5)
    assert r.tokens == ids[:-5] and r.cache[0].offset == len(ids) - 5
    again = np.asarray(r.forward(ids[-5:], logits_for=2))
    assert again.shape == (2, r.vocab_size)
    np.testing.assert_allclose(again, full[-2:], rtol=1e-4, atol=1e-4)
    r.sync(ids[:3])
    assert r.tokens == ids[:3] and r.cache[0].offset == 3
    assert r.forward([], logits_for=0).shape == (0, r.vocab_size)


def test_runner_refuses_a_cache_it_cannot_trim(tiny):
    from mlx_lm.models.cache import ArraysCache

    from specgrammar_mlx_lm.runner import MLXRunner, NotTrimmableCacheError

    model, _, _ = tiny
    with pytest.raises(NotTrimmableCacheError, match="trimmable"):
        MLXRunner(model, [ArraysCache(2) for _ in model.layers])


# ------------------------------------------------------------------------------------------------ greedy (see test_mlx_greedy.py)
def test_processor_under_mlx_speculative_loop_equals_plain(tiny):
    """mlx-lm's own speculative loop + our history-keyed processor: same greedy output as generate_step (the
    processor's history starts at the last prompt token there, and moves backwards on rejected drafts)."""
    model, draft, tok = tiny
    eos = set(tok.eos_token_ids)
    for w in ("json_extraction", "sql", "email"):
        ex = examples(w, "eval", 1)[0]
        ids = prompt_ids(tok, ex.prompt)
        ref = plain_generate_step(model, ids, processor=_processor(ex.constraint, tok, model), max_tokens=MAX_TOKENS,
                                  eos_ids=eos)
        for k in (1, 3, 5):
            out, _ = mlx_speculative(model, draft, ids, processor=_processor(ex.constraint, tok, model), k=k,
                                     max_tokens=MAX_TOKENS, eos_ids=eos)
            assert out == ref, (w, k)


def test_processor_with_batch_generator(tiny):
    """The server's batching path: BatchGenerator with one processor per request, two constrained requests."""
    from mlx_lm.generate import BatchGenerator

    model, _, tok = tiny
    eos = set(tok.eos_token_ids)
    exs = [examples("order_id", "eval", 1)[0], examples("json_extraction", "eval", 1)[0]]
    prompts = [prompt_ids(tok, e.prompt) for e in exs]
    refs = [plain_generate_step(model, p, processor=_processor(e.constraint, tok, model), max_tokens=MAX_TOKENS,
                                eos_ids=eos) for p, e in zip(prompts, exs)]
    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos])
    uids = gen.insert(prompts, max_tokens=[MAX_TOKENS] * 2,
                      logits_processors=[[_processor(e.constraint, tok, model)] for e in exs])
    outs = {u: [] for u in uids}
    for _ in range(4 * MAX_TOKENS):
        responses = gen.next_generated()
        if not responses and all(o and (o[-1] in eos or len(o) >= MAX_TOKENS) for o in outs.values()):
            break
        for r in responses:
            outs[r.uid].append(int(r.token))
    gen.close()
    assert [outs[u] for u in uids] == refs


# ------------------------------------------------------------------------------------------------ twin details
def test_stream_generate_responses_and_cache_state(tiny):
    from mlx_lm.generate import GenerationResponse
    from mlx_lm.models.cache import make_prompt_cache

    from specgrammar_mlx_lm.generate import stream_generate

    model, draft, tok = tiny
    ex = examples("json_extraction", "eval", 1)[0]
    ids = prompt_ids(tok, ex.prompt)
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    rs = list(stream_generate(model, tok, ids, max_tokens=MAX_TOKENS, draft_model=draft, num_draft_tokens=4,
                              constraint=ex.constraint, temperature=0.0, prompt_cache=cache))
    assert all(isinstance(r, GenerationResponse) for r in rs)
    assert [r.finish_reason for r in rs[:-1]] == [None] * (len(rs) - 1) and rs[-1].finish_reason in ("stop", "length")
    assert rs[-1].stats is not None and rs[-1].stats.emitted == len(rs)
    text = "".join(r.text for r in rs)
    assert text == tok.decode([r.token for r in rs if r.token not in tok.eos_token_ids])
    n = len(ids) + len(rs)
    n_layers = len(model.layers)
    assert all(c.offset == n for c in cache[:n_layers]), "target cache must hold prompt + emitted"
    assert all(c.offset == n for c in cache[n_layers:]), "draft cache must hold prompt + emitted"
    assert any(r.from_draft for r in rs)
    lp = rs[0].logprobs
    assert lp.shape[-1] >= len(tok.vocab) - 8 and float(mx.logsumexp(lp).item()) == pytest.approx(0.0, abs=1e-3)

    # continue from the cache: the twin reuses it and the caches stay consistent
    more = prompt_ids(tok, examples("year", "eval", 1)[0].prompt)
    held = ids + [r.token for r in rs]
    rs2 = list(stream_generate(model, tok, more, max_tokens=8, draft_model=draft, num_draft_tokens=3,
                               constraint=ConstraintSpec.regex(r"[0-9]{4}"), temperature=0.0, prompt_cache=cache,
                               cached_tokens=held))
    n2 = len(held) + len(more) + len(rs2)
    assert all(c.offset == n2 for c in cache)


def test_early_close_leaves_caches_at_yielded_tokens(tiny):
    from mlx_lm.models.cache import make_prompt_cache

    from specgrammar_mlx_lm.generate import stream_generate

    model, draft, tok = tiny
    ex = examples("tool_call", "eval", 1)[0]
    ids = prompt_ids(tok, ex.prompt)
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    gen = stream_generate(model, tok, ids, max_tokens=MAX_TOKENS, draft_model=draft, num_draft_tokens=6,
                          constraint=ex.constraint, temperature=0.0, prompt_cache=cache)
    seen = [next(gen) for _ in range(5)]
    gen.close()
    assert all(c.offset == len(ids) + len(seen) for c in cache)


def test_twin_refuses_host_samplers_and_processors(tiny):
    from mlx_lm.sample_utils import make_sampler

    from specgrammar_mlx_lm.generate import stream_generate

    model, _, tok = tiny
    with pytest.raises(ValueError, match="sampler"):
        next(stream_generate(model, tok, [1, 2, 3], sampler=make_sampler(0.5)))
    with pytest.raises(ValueError, match="logits_processors"):
        next(stream_generate(model, tok, [1, 2, 3], logits_processors=[lambda t, l: l]))


def test_recipe_argument_reaches_the_drafter_chain(tiny):
    """``recipe=`` is handed to the chain's recipe drafter: a pack name that does not exist is refused by name, and
    a shipped pack drafts."""
    from specgrammar_plugins.recipes import RecipePackError
    from specgrammar_mlx_lm.generate import generate_tokens

    model, draft, tok = tiny
    with pytest.raises(RecipePackError, match="no-such-pack"):
        generate_tokens(model, tok, prompt_ids(tok, "Find the year: 1999"), max_tokens=6, draft_model=draft,
                        constraint=ConstraintSpec.regex(r"[0-9]{4}"), recipe="no-such-pack", temperature=0.0)
    ex = examples("json_extraction", "eval", 1)[0]
    _, st = generate_tokens(model, tok, prompt_ids(tok, ex.prompt), max_tokens=48, constraint=ex.constraint,
                            recipe="json_extraction", drafters=["recipe"], temperature=0.0)
    assert st.drafted_by_source.get("recipe", 0) > 0, st.drafted_by_source


def test_blind_draft_is_still_exact_at_greedy(tiny):
    from specgrammar_mlx_lm.generate import generate_tokens

    model, draft, tok = tiny
    ex = examples("sql", "eval", 1)[0]
    ids = prompt_ids(tok, ex.prompt)
    ref = plain_generate_step(model, ids, processor=_processor(ex.constraint, tok, model), max_tokens=MAX_TOKENS,
                              eos_ids=set(tok.eos_token_ids))
    out, st = generate_tokens(model, tok, ids, max_tokens=MAX_TOKENS, draft_model=draft, num_draft_tokens=4,
                              constraint=ex.constraint, drafters=["model"], blind=True, temperature=0.0)
    assert out == ref


# ------------------------------------------------------------------------------------------------ budget feasibility
def test_budget_mask_ends_within_max_tokens_and_says_so(tiny):
    """On by default in the twin: with max_tokens below the model's own answer the output ends complete and valid
    within it (exact bound for the regex, certified for the JSON Schema on llguidance), greedy and sampled, and
    the final response's stats say the budget shaped it; ``budget_mask=False`` gives the cut-off output back;
    a max_tokens below the shortest completion is refused before decoding."""
    import json

    import jsonschema

    from specgrammar_mlx_lm.generate import generate_tokens, stream_generate
    from specgrammar_plugins.errors import BudgetError
    from specgrammar_plugins.workloads import is_valid

    model, draft, tok = tiny
    for w, engine in (("email", None), ("json_extraction", "llguidance")):
        ex = examples(w, "eval", 1)[0]
        ids = prompt_ids(tok, ex.prompt)
        kw = dict(draft_model=draft, num_draft_tokens=3, constraint=ex.constraint, engine=engine)
        own, _ = generate_tokens(model, tok, ids, max_tokens=MAX_TOKENS, temperature=0.0, budget_mask=False, **kw)
        budget = len(own) - 2  # below the model's own (greedy) answer
        for temperature in (0.0, 0.7):
            out, st = generate_tokens(model, tok, ids, max_tokens=budget, temperature=temperature, seed=3, **kw)
            text = tok.decode([t for t in out if t not in tok.eos_token_ids])
            ok = is_valid(w, text) if w == "email" else jsonschema.Draft202012Validator(
                ex.constraint.schema).is_valid(json.loads(text))
            assert st.finish_reason == "stop" and len(out) <= budget and ok, (w, temperature, text, st.budget)
            assert st.budget["shaped"] and st.budget["mode"] == ("exact" if w == "email" else "certified")
        last = None
        for r in stream_generate(model, tok, ids, max_tokens=budget, temperature=0.0, **kw):
            last = r  # the final response says it when it is yielded (a server reads it then)
            if r.finish_reason is not None:
                assert r.stats.budget["shaped"] and r.stats.budget["budget"] == budget
        assert last.finish_reason == "stop"
        _, st = generate_tokens(model, tok, ids, max_tokens=budget, temperature=0.0, budget_mask=False, **kw)
        assert st.finish_reason == "length" and not st.budget
        with pytest.raises(BudgetError) as e:
            list(stream_generate(model, tok, ids, max_tokens=2, **kw))
        shortest = e.value.shortest
        assert shortest and shortest > 2
        st_shortest = generate_tokens(model, tok, ids, max_tokens=shortest, temperature=0.0, **kw)[1]
        assert st_shortest.finish_reason == "stop" and st_shortest.emitted <= shortest


def test_processor_budget_is_the_exact_row_under_mlx_loops(tiny):
    """mlx-lm's own loops with our processor and max_tokens: the exact budget bound is part of the processor's row
    (a function of the history), so generate_step and mlx-lm's speculative loop agree and both end in time."""
    from specgrammar_mlx_lm.processor import grammar_logits_processor
    from specgrammar_plugins.workloads import is_valid

    model, draft, tok = tiny
    eos = set(tok.eos_token_ids)
    ex = examples("email", "eval", 1)[0]
    ids = prompt_ids(tok, ex.prompt)
    own = plain_generate_step(model, ids, processor=_processor(ex.constraint, tok, model), max_tokens=MAX_TOKENS,
                              eos_ids=eos)
    budget = len(own) - 2

    def proc():
        return grammar_logits_processor(ex.constraint, tok, model, max_tokens=budget)

    assert proc().mask.fit is not None and proc().mask.fit.mode == "exact"
    ref = plain_generate_step(model, ids, processor=proc(), max_tokens=budget, eos_ids=eos)
    assert ref[-1] in eos and len(ref) <= budget and is_valid("email", tok.decode(ref[:-1])), tok.decode(ref)
    for k in (1, 3):
        out, _ = mlx_speculative(model, draft, ids, processor=proc(), k=k, max_tokens=budget, eos_ids=eos)
        assert out == ref, k
