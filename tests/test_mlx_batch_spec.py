"""Batched grammar-aware speculative decoding on mlx-lm (``specgrammar_mlx_lm.batch``, ``api.BatchLoop``), real mlx
on the bundled tiny pair: each round drafts for every row under its own grammar, ONE batched target pass verifies
all rows (padded to one length over mlx-lm's ``BatchKVCache``), each row accepts by the serial loop's own law and
its cache row is rolled back alone.

- greedy: every row of a batch of mixed-length constrained requests (every structured workload, one request without
  drafts, one unconstrained) equals plain constrained decoding of that request alone, with fewer target passes;
- with the draft model: the rows' draft models in one batched draft pass per position, greedy rows equal to plain
  constrained decoding, tokens per target pass within 10% of the serial loop with the same draft model;
- the law at T = 1: the email grammar (``test_mlx_law``'s ``email`` case, where draft and target disagree), 300
  rows drafted by the draft model (one batched draft pass per position) and verified in batches of 60, against the enumerated law of plain
  constrained sampling (chi-square, fails below p = 1e-3); the same samples against the T = 0.7 law must fail;
- a row whose drafting fails and one whose verdict fails are answered with their errors; the others finish equal
  to plain decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_mlx_common import load_tiny_pair, prompt_ids

pytest.importorskip("mlx_lm")

from specgrammar_plugins.api import SpecOptions  # noqa: E402
from specgrammar_plugins.distributions import SamplingParams  # noqa: E402
from specgrammar_plugins.workloads import STRUCTURED, examples  # noqa: E402

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_pair()


def _plain(model, tok, req):
    """Plain constrained decoding of the request alone (our loop with no drafts: one target pass per token)."""
    from specgrammar_mlx_lm.generate import generate_tokens

    out, _ = generate_tokens(model, tok, list(req.prompt), max_tokens=req.max_tokens, constraint=req.constraint,
                             num_draft_tokens=0, temperature=0.0)
    return out


def _requests(tok):
    from specgrammar_mlx_lm.batch import BatchRequest

    reqs = [BatchRequest(prompt_ids(tok, ex.prompt), constraint=ex.constraint, max_tokens=MAX_TOKENS)
            for w in STRUCTURED for ex in examples(w, "eval", 1)]
    ex = examples("json_extraction", "eval", 2)[1]
    reqs.append(BatchRequest(prompt_ids(tok, ex.prompt), constraint=ex.constraint, max_tokens=MAX_TOKENS,
                             options=SpecOptions(k=0)))  # a row without drafts
    reqs.append(BatchRequest(prompt_ids(tok, "Say hello"), max_tokens=12))  # unconstrained
    return reqs


def test_greedy_rows_equal_plain_constrained_decoding(tiny):
    from specgrammar_mlx_lm.batch import batch_generate

    model, _, tok = tiny
    reqs = _requests(tok)
    assert len({len(r.prompt) for r in reqs}) > 3  # mixed prompt lengths: left padding in the batch cache
    outs, target = batch_generate(model, tok, reqs, k=4)
    serial_passes = 0
    for req, (toks, st) in zip(reqs, outs):
        assert not isinstance(st, BaseException), st
        assert toks == _plain(model, tok, req)
        serial_passes += st.emitted  # plain decoding: one target pass per token
    assert outs[-2][1].tokens_per_pass == 1.0 and outs[-2][1].drafted == 0  # k = 0: no drafts, one token a pass
    assert max(st.tokens_per_pass for _, st in outs) > 2.0  # rows that draft gain tokens per pass
    assert target.padding > 0 and target.passes == max(st.target_passes for _, st in outs)
    assert target.passes < serial_passes / 3  # one batched pass per round for all rows
    assert target.cache is None and target.rows == 0  # every finished row left the batch


def test_greedy_rows_with_the_draft_model(tiny):
    """The rows' draft models in ONE batched draft pass per position (``MLXDraftBatch``, each row's ``DraftRow``
    rolled back alone): every row equals plain constrained decoding, the draft model drafted, the batch took fewer
    draft passes than the rows' model drafts, and the rows' tokens per target pass are within 10% of the serial loop
    with the same draft model and chain (the same drafts but for near-ties in batched against single-row logits)."""
    from specgrammar_mlx_lm.batch import batch_generate
    from specgrammar_mlx_lm.generate import generate_tokens

    model, draft, tok = tiny
    reqs = _requests(tok)
    outs, target = batch_generate(model, tok, reqs, k=4, draft_model=draft)
    per_row, serial = [], []
    for req, (toks, st) in zip(reqs, outs):
        assert not isinstance(st, BaseException), st
        assert toks == _plain(model, tok, req)
        if req.constraint is not None and req.options.k != 0:
            _, alone = generate_tokens(model, tok, list(req.prompt), max_tokens=req.max_tokens,
                                       constraint=req.constraint, num_draft_tokens=4, temperature=0.0,
                                       draft_model=draft)
            per_row.append(st.tokens_per_pass)
            serial.append(alone.tokens_per_pass)
    model_drafts = sum(st.drafted_by_source.get("model", 0) for _, st in outs)
    assert model_drafts > 2 * len(reqs)
    assert 0 < target.draft_passes < model_drafts
    assert sum(per_row) >= 0.9 * sum(serial), (per_row, serial)


@pytest.mark.slow  # 15 s with OpenBLAS, 26 s without (300 rows, each drafting with its own draft-model runner)
def test_law_at_t1_matches_plain_constrained_sampling(tiny):
    from test_mlx_law import P_FLOOR, chi_square_p, exact_law, law_case

    from specgrammar_mlx_lm.batch import BatchRequest, batch_generate

    model, draft, tok = tiny
    ids, compiled = law_case(tiny, "email")
    n, per_batch = 300, 60
    samples, drafted = [], 0
    for b in range(n // per_batch):
        reqs = [BatchRequest(ids, constraint=compiled, max_tokens=8, temperature=1.0, seed=1000 * b + i,
                             options=SpecOptions(k=4, drafters=("forced", "model")))
                for i in range(per_batch)]
        outs, target = batch_generate(model, tok, reqs, draft_model=draft)
        for toks, st in outs:
            assert not isinstance(st, BaseException), st
            samples.append(tuple(toks))
            drafted += st.drafted
    assert drafted > n  # the draft model drafted: the accept/residual rule was exercised
    p = chi_square_p(samples, exact_law(model, ids, compiled, SamplingParams(temperature=1.0)))
    print(f"batched rows, email T=1: chi-square p {p:.3g}")
    assert p > P_FLOOR
    # power: the same test tells these samples from the T = 0.7 law
    assert chi_square_p(samples, exact_law(model, ids, compiled, SamplingParams(temperature=0.7))) < P_FLOOR


def test_a_faulting_row_fails_only_itself(tiny):
    from specgrammar_mlx_lm.batch import BatchRequest, MLXBatchTarget, make_row
    from specgrammar_plugins.api import BatchLoop

    model, _, tok = tiny
    exs = examples("json_extraction", "eval", 4)
    reqs = [BatchRequest(prompt_ids(tok, ex.prompt), constraint=ex.constraint, max_tokens=MAX_TOKENS) for ex in exs]
    target = MLXBatchTarget(model)
    batch = BatchLoop(target)
    loops = []
    for i, req in enumerate(reqs):
        loop = make_row(target, tok, req, k=4)
        target.add(loop.prompt[:-1])
        batch.add(i, loop)
        loops.append(loop)

    class Boom(RuntimeError):
        pass

    drafter = loops[1].drafter
    calls = {"n": 0}

    class Failing:  # row 1: its drafting fails at its third round
        name = "failing"

        def extend(self, block, budget):
            calls["n"] += 1
            if calls["n"] == 3:
                raise Boom("drafter")
            return drafter.extend(block, budget)

    loops[1].drafter = Failing()
    judge = loops[2]._judge

    def failing_judge(block, logits, t):  # row 2: its verdict fails at its second round
        if loops[2].stats.rounds == 1:
            raise Boom("verdict")
        return judge(block, logits, t)

    loops[2]._judge = failing_judge
    errors = {}
    for out in batch.run():
        for i, c in out:
            if isinstance(c, BaseException):
                errors[i] = c
    assert set(errors) == {1, 2} and all(isinstance(e, Boom) for e in errors.values())
    for i in (0, 3):
        assert loops[i].finish_reason is not None
        assert loops[i].emitted == _plain(model, tok, reqs[i])


@pytest.mark.parametrize("masked", [True, False], ids=["by-mask", "by-shift"])
def test_rollback_keeps_each_row_at_its_own_length(tiny, masked):
    """After rounds whose rows kept different numbers of positions, each cache row holds exactly its own tokens:
    the next pass's logits of each row equal those of the row alone (rows dropping by the mask,
    ``MaskedBatchKVCache``, and by shifting keys into the left padding, ``drop_rows`` on a ``BatchKVCache``)."""
    import mlx.core as mx

    from specgrammar_mlx_lm.batch import MLXBatchTarget
    from specgrammar_mlx_lm.runner import MLXRunner

    model, _, tok = tiny
    prompts = [prompt_ids(tok, p) for p in ("Say hello", "Name a colour", "Make up a code of 3 digits")]
    target = MLXBatchTarget(model, masked=masked)
    for p in prompts:
        target.add(p[:-1])
    held = [list(p[:-1]) for p in prompts]
    rng = np.random.default_rng(0)
    for _ in range(3):
        feeds = [[int(t) for t in rng.integers(3, 200, size=int(rng.integers(1, 5)))] for _ in prompts]
        target.forward(feeds)
        kept = [int(rng.integers(1, len(f) + 1)) for f in feeds]
        target.rollback(kept)
        for h, f, k in zip(held, feeds, kept):
            h.extend(f[:k])
    rows = target.forward([[5] for _ in prompts])
    for h, row in zip(held, rows):
        alone = MLXRunner(model).forward([*h, 5])[-1]
        assert mx.allclose(row[-1], alone, atol=1e-4).item()


def test_masked_rows_join_leave_and_extract_as_rows_alone(tiny):
    """``MaskedBatchKVCache`` (what the batched rows' target and draft caches are): rows prefilled together
    (``add_many``: padded on the right, the padding dropped by the mask), then through rounds of uneven feeds and
    drops, a row joining mid-way (``add``: ``extend``) and one leaving (``filter``), every pass's logits of every
    row equal the row alone's; a dropped tail that no row attends is cut (the cache does not grow by the padding);
    and a row's extracted cache (what the server keeps as the request's prompt cache) holds exactly its tokens."""
    import mlx.core as mx

    from specgrammar_mlx_lm.batch import MLXBatchTarget, _MaskedRows
    from specgrammar_mlx_lm.runner import MLXRunner

    model, draft, tok = tiny
    prompts = [prompt_ids(tok, p) for p in ("Say hello", "Name a colour", "Make up a code of 3 digits", "Count")]
    for m in (model, draft):
        target = MLXBatchTarget(m)
        target.add_many([p[:-1] for p in prompts[:3]])
        held = [list(p[:-1]) for p in prompts[:3]]
        assert all(isinstance(c, _MaskedRows) for c in target.cache)
        rng = np.random.default_rng(1)
        for rnd in range(6):
            if rnd == 2:  # a row joins
                target.add(prompts[3][:-1])
                held.append(list(prompts[3][:-1]))
            if rnd == 4:  # row 0 leaves
                target.remove(list(range(1, len(held))))
                held = held[1:]
            feeds = [[int(t) for t in rng.integers(3, 200, size=int(rng.integers(1, 5)))] for _ in held]
            rows = target.forward(feeds)
            for h, f, row in zip(held, feeds, rows):
                alone = MLXRunner(m).forward([*h, *f], logits_for=len(f))
                assert mx.allclose(row, alone, atol=1e-4).item()
            kept = [int(rng.integers(1, len(f) + 1)) for f in feeds]
            target.rollback(kept)
            for h, f, k in zip(held, feeds, kept):
                h.extend(f[:k])
        c = target.cache[0]
        assert c.live.shape == (len(held), c._idx) and c.live[:, -1].any()  # the dead tail was cut
        assert c.live.sum(axis=1).tolist() == [len(h) for h in held]
        for i, h in enumerate(held):
            runner = MLXRunner(m, [x.extract(i) for x in target.cache], list(h))
            assert mx.allclose(runner.forward([5])[-1], MLXRunner(m).forward([*h, 5])[-1], atol=1e-4).item()


def test_draft_batch_prefills_new_rows_at_its_next_pass(tiny):
    """``MLXDraftBatch``: rows added are prefilled together at the next draft pass; a row that leaves before it is
    never prefilled; each waiting row's logits equal the draft model's alone on the same tokens."""
    from specgrammar_mlx_lm.batch import MLXDraftBatch
    from specgrammar_mlx_lm.runner import MLXRunner

    _, draft, tok = tiny
    prompts = [prompt_ids(tok, p) for p in ("Say hello", "Name a colour", "Count")]
    batch = MLXDraftBatch(draft)
    for i, p in enumerate(prompts):
        batch.add(i, p[:-1])
    batch.keep([0, 2])
    assert batch.rows.cache is None and batch.keys == [0, 2]
    out = batch({0: (0, prompts[0][-1:]), 2: (0, prompts[2][-1:])})
    assert batch.rows.rows == 2 and batch.passes == 1
    for i in (0, 2):
        alone = MLXRunner(draft).forward(prompts[i], logits_for=1)
        assert np.allclose(np.asarray(out[i]), np.asarray(alone), atol=1e-4)
    batch.add(1, prompts[1][:-1])  # joins: prefilled at the next pass, which only row 1 waits in
    out = batch({1: (0, prompts[1][-1:])})
    assert batch.rows.rows == 3
    assert np.allclose(np.asarray(out[1]), np.asarray(MLXRunner(draft).forward(prompts[1], logits_for=1)), atol=1e-4)
