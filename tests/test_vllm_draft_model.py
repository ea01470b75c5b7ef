"""vLLM's ``draft_model`` method made grammar-aware (``GrammarDraftProposer``) against vLLM's own grammar-blind
proposer, on real JSON Schemas the tiny pair never saw (``../shared/data/jsonschemabench/dev``), in-process on
vllm-cpu with the bundled pair, T = 0:

- both produce the plain greedy output token for token (vLLM verifies every draft);
- vLLM's ``validate_tokens`` truncates the blind drafts where they leave the grammar and never ours;
- ours commits more tokens per target pass (hardware-independent: vLLM's own counters);
- a fault in our drafting for one request leaves that request without grammar drafts, the step and the engine
  going on, and the outputs unchanged.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("vllm")

from conftest import fault_in_one_request, needs_shared_data  # noqa: E402
from specgrammar_plugins.models import tiny_path  # noqa: E402

if not (tiny_path("target") / "model.safetensors").exists():
    pytest.skip("the tiny target model is not in the tree (issue 3)", allow_module_level=True)

from specgrammar_vllm.offline import (  # noqa: E402
    count_truncations, make_llm, metrics_delta, proposer_of, runner_of, spec_metrics)

K = 4
N_SCHEMAS = 8
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def schemas():
    needs_shared_data("jsonschemabench", "dev")
    from specgrammar_plugins import workloads as W
    from specgrammar_plugins.bench.vllm_host import jsb_examples
    from specgrammar_vllm.offline import sampling_params

    exs = jsb_examples(N_SCHEMAS)
    assert len(exs) == N_SCHEMAS
    prompts = [W.chat_prompt(p) for p, _, _ in exs]
    params = [sampling_params(spec, temperature=0.0, max_tokens=MAX_TOKENS) for _, spec, _ in exs]
    return prompts, params


def _run(llm, prompts, params):
    before = spec_metrics(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    d = metrics_delta(before, spec_metrics(llm))
    toks = [list(o.outputs[0].token_ids) for o in outs]
    gen = sum(map(len, toks))
    return SimpleNamespace(tokens=toks, metrics=d, per_pass=gen / (gen - d["accepted_tokens"]))


@pytest.fixture(scope="module")
def runs(schemas):
    from specgrammar_vllm.draft_proposer import GrammarDraftProposer

    prompts, params = schemas
    draft = str(tiny_path("draft"))
    out = SimpleNamespace()
    for name, method in (("ours", "grammar"), ("blind", "draft_model")):
        llm = make_llm(tiny_path("target"), method=method, k=K, draft_model=draft)
        drafter = runner_of(llm).drafter
        assert isinstance(drafter, GrammarDraftProposer)
        assert (drafter.grammar is not None) == (name == "ours")  # blind: vLLM's own drafting, untouched
        seen = count_truncations(llm)
        r = _run(llm, prompts, params)
        r.truncations, r.llm = seen, llm
        r.counters = dict(proposer_of(llm).counters) if name == "ours" else None  # (before other tests add to them)
        setattr(out, name, r)  # (every engine stays referenced: a freed one tears down vLLM's process groups)
    plain = make_llm(tiny_path("target"), method=None)
    out.plain = _run(plain, prompts, params)
    out.plain.llm = plain
    return out


def test_greedy_outputs_equal_plain(runs):
    assert runs.ours.tokens == runs.plain.tokens
    assert runs.blind.tokens == runs.plain.tokens


def test_blind_drafts_are_truncated_and_ours_never(runs):
    assert runs.blind.truncations.truncated > 0, "the blind draft never left the grammar: no contrast here"
    assert runs.ours.truncations.tokens > 0 and runs.ours.truncations.truncated == 0


def test_more_tokens_per_target_pass_than_vllms_own_draft_model(runs):
    print(f"tokens per target pass: ours {runs.ours.per_pass:.2f}, vLLM's draft_model {runs.blind.per_pass:.2f}")
    assert runs.ours.per_pass > runs.blind.per_pass
    assert runs.ours.metrics["accepted_tokens"] > runs.blind.metrics["accepted_tokens"]


@pytest.mark.parametrize("where", ["begin", "model_draft"])
def test_a_fault_in_our_drafting_drafts_nothing_for_that_request_and_the_engine_goes_on(runs, schemas, where):
    """One request's drafting raises at every step (a stand-in for a bug in our code): when its step starts, or
    from its matcher inside a draft position (an engine's matcher failing on ``accept`` or a mask, where a model
    draft is offered to it).  That request gets no grammar drafts, the others keep theirs, every output stays the
    plain greedy one, and the engine serves the next batch."""
    prompts, params = schemas
    llm = runs.ours.llm
    g = proposer_of(llm)
    # (our counters: vLLM 0.32's get_metrics() follows the engine built last, the plain one here)
    c0 = dict(g.counters)
    with fault_in_one_request(g, where=where):
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert g.counters["proposer_errors"] > c0["proposer_errors"]
    assert [list(o.outputs[0].token_ids) for o in outs] == runs.plain.tokens
    assert g.counters["accepted_tokens"] > c0["accepted_tokens"]  # the other requests kept their drafts
    c1 = dict(g.counters)
    again = llm.generate(prompts[:2], params[:2], use_tqdm=False)  # the engine is alive and drafting
    assert [list(o.outputs[0].token_ids) for o in again] == runs.plain.tokens[:2]
    assert g.counters["draft_tokens"] > c1["draft_tokens"] and g.counters["proposer_errors"] == c1["proposer_errors"]


def test_argmax_drafts_mask_only_the_rows_whose_argmax_the_grammar_rejects(runs):
    """With argmax drafts (vLLM's default ``draft_sample_method``) a row is masked only where the grammar rejects
    the draft's unmasked argmax (``GrammarDraftProposer._lazy``): on schemas the draft never saw both kinds of
    rows occur, and the rows that were masked still drafted inside the grammar (vLLM never truncated a draft of
    ours: ``test_blind_drafts_are_truncated_and_ours_never``) with the output the plain greedy one."""
    c = runs.ours.counters
    assert c["draft_rows_unmasked"] > 0 and c["draft_rows_masked"] > 0, c
    assert c["draft_rows_ended"] > 0, c  # (refused_drafts = 2: a second refused position is a request's last draft)
    assert c["draft_rows_unlikely"] == 0, c  # (draft_confidence: a greedy request's drafts are never unlikely)


_KEPT = []  # engines built by single tests (a freed engine tears down vLLM's process groups)


@pytest.mark.parametrize("limit", [0, None])
def test_refused_drafts_option_reaches_the_proposer_through_vllms_config(runs, schemas, limit):
    """``--additional-config '{"specgrammar": {"refused_drafts": ...}}'`` in a real engine: 0 ends a request's drafts
    at the first refusal (no row masked), null never ends them (no row ended); the output stays the plain greedy
    one either way, and the default (``runs.ours``: 1) ends some."""
    prompts, params = schemas
    llm = make_llm(tiny_path("target"), method="grammar", k=K, draft_model=str(tiny_path("draft")),
                   specgrammar={"refused_drafts": limit})
    _KEPT.append(llm)
    r = _run(llm, prompts, params)
    assert r.tokens == runs.plain.tokens
    c = proposer_of(llm).counters
    if limit == 0:
        assert c["draft_rows_ended"] > 0 and c["draft_rows_masked"] == 0, c
    else:
        assert c["draft_rows_ended"] == 0 and c["draft_rows_masked"] > 0, c


def test_draft_confidence_option_reaches_the_proposer_through_vllms_config(runs, schemas):
    """At T = 1 the default ``draft_confidence`` ends some requests' drafts where the draft model's probability of
    reaching the next position falls below it; ``--additional-config '{"specgrammar": {"draft_confidence": null}}'``
    ends none.  (Exactness with it on: the draft-model cases of ``test_output_law_at_positive_temperature_matches_plain``
    in test_vllm_proposer.py.)"""
    from specgrammar_plugins.bench.vllm_host import jsb_examples
    from specgrammar_vllm.offline import sampling_params

    prompts, _ = schemas
    hot = [sampling_params(spec, temperature=1.0, max_tokens=MAX_TOKENS) for _, spec, _ in jsb_examples(N_SCHEMAS)]
    off = make_llm(tiny_path("target"), method="grammar", k=K, draft_model=str(tiny_path("draft")),
                   specgrammar={"draft_confidence": None})
    _KEPT.append(off)
    for llm, ends in ((runs.ours.llm, True), (off, False)):
        c = proposer_of(llm).counters
        before = dict(c)
        llm.generate(prompts, hot, use_tqdm=False)
        assert c["accepted_tokens"] > before["accepted_tokens"]
        assert (c["draft_rows_unlikely"] > before["draft_rows_unlikely"]) == ends, (ends, c)


@pytest.mark.parametrize("vocab,ties", [(1000, 6), (1000, None), (9000, 6), (9000, None)])
def test_lazy_masking_equals_the_masked_argmax_row_for_row(vocab, ties):
    """``_lazy`` against masking every row and taking the argmax (what the probabilistic path does): random
    logits (small integers, ties everywhere, or continuous), a vocabulary that ends inside a mask word, host
    drafts, grammar rows on lazy blocks that allow or reject the unmasked argmax (some with every allowed logit
    -inf, or a NaN among them), rows without a grammar; a vocabulary the kernel masks and one wide enough for the
    CPU's allowed-ids argmax (``CPU_KERNEL_MAX_VOCAB``).  Token for token equal, each grammar row's block holds its
    token, only the rejected rows are masked, and a block whose argmax the grammar allows never fills a mask."""
    import numpy as np
    import torch

    from specgrammar_plugins.api import DraftBlock, mask_words
    from specgrammar_plugins.testing import TableMatcher
    from specgrammar_vllm.draft_proposer import GrammarDraftProposer, _Plan

    rows = 9
    prop, counters = _bare_proposer(vocab, rows)
    prop._refused_drafts = None  # (every refused row drafts its masked argmax, none ends: refused_drafts below)
    full = np.full(mask_words(vocab), -1, dtype=np.int32)
    rng = np.random.default_rng(7)
    rejected = 0
    for _ in range(300):
        if ties:
            logits = torch.from_numpy(rng.integers(0, ties, size=(rows, vocab)).astype(np.float32))
        else:
            logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32))
        plain_argmax = logits.argmax(dim=-1).tolist()
        plan, want = _Plan(), np.full((rows, mask_words(vocab)), -1, dtype=np.int32)
        grammar_rows, blocks = {}, [None] * rows
        for i in range(rows):
            kind = rng.integers(0, 3)
            if kind == 0:  # a host draft: the argmax of its one-hot row
                t = int(rng.integers(0, vocab))
                plan.host.append((i, t))
                want[i] = 0
                want[i, t >> 5] = np.array([1 << (t & 31)], dtype=np.uint32).view(np.int32)[0]
            elif kind == 1:  # the grammar's row, allowing the unmasked argmax or not
                allowed = rng.random(vocab) < rng.choice([0.02, 0.3, 0.9])
                allowed[int(rng.integers(0, vocab))] = True
                if rng.random() < 0.5:
                    allowed[plain_argmax[i]] = False
                if rng.random() < 0.1:  # every allowed logit -inf (the kernel's path decides), or a NaN among them
                    logits[i, torch.from_numpy(np.flatnonzero(allowed))] = float("-inf")
                    if rng.random() < 0.5:
                        logits[i, int(rng.choice(np.flatnonzero(allowed)))] = float("nan")
                grammar_rows[i] = allowed
                bits = np.concatenate([allowed, np.zeros(mask_words(vocab) * 32 - vocab, dtype=bool)])
                row = np.packbits(bits, bitorder="little").view(np.int32)
                blocks[i] = DraftBlock([1], TableMatcher([row, full], vocab), vocab, 4, lazy=True)
                plan.model.append(i)
                want[i] = row
        final_argmax = logits.argmax(dim=-1).tolist()
        rejected += sum(not allowed[final_argmax[i]] for i, allowed in grammar_rows.items())
        masked = logits.clone()
        prop._bitmask_np[:rows] = want
        GrammarDraftProposer._apply(prop, masked, rows)
        expected = masked.argmax(dim=-1).tolist()
        before = logits.clone()
        step_rows = [SimpleNamespace(block=b, refused=0) for b in blocks]
        tokens, toks = prop._lazy(logits, plan, step_rows)
        assert toks == expected and tokens.tolist() == expected
        for i, b in enumerate(blocks):
            if b is not None:
                allowed = grammar_rows[i]
                assert b.tokens == [expected[i]] or (not allowed[expected[i]] and b.closed)
                assert b.mask_fills == (0 if allowed[final_argmax[i]] else 1)
        assert torch.equal(logits.nan_to_num(), before.nan_to_num())  # the draft's logits are left as they were
    assert counters["draft_rows_masked"] == rejected > 0 and counters["draft_rows_unmasked"] > 0
    assert counters["draft_rows_ended"] == 0


@pytest.mark.parametrize("pad", [0, 64])
def test_a_refused_rows_allowed_argmax_is_the_masked_rows_argmax(pad):
    """``_allowed_argmax`` (a refused row's masked argmax on a CPU, at a vocabulary wider than the kernel's share)
    against the masked row's torch argmax (ids below the vocabulary refused at -inf, ids past it left as the kernel
    leaves them): rows allowing a few ids (listed) or most (masked in place), the row's own maximum refused, a NaN
    among the allowed or the refused, every allowed logit -inf (None: the kernel decides)."""
    import numpy as np
    import torch

    from specgrammar_vllm.draft_proposer import _numpy_view

    vocab, rows = 9000, 4
    prop, _ = _bare_proposer(vocab, rows)
    rng = np.random.default_rng(13)
    for trial in range(60):
        logits = torch.from_numpy((rng.standard_normal((rows, vocab + pad)) * 3).astype(np.float32))
        if trial % 3 == 0:
            logits[:, vocab:] += 20.0  # (a padded id above every allowed one: the kernel's argmax there)
        host = _numpy_view(logits)
        for i in range(rows):
            allowed = rng.random(vocab) < rng.choice([0.01, 0.5, 0.97])
            allowed[int(rng.integers(0, vocab))] = True
            allowed[int(logits[i, :vocab].argmax())] = False  # (a refused row)
            if trial % 5 == 1:
                logits[i, int(rng.integers(0, vocab))] = float("nan")
            if trial % 7 == 2:
                logits[i, torch.from_numpy(np.flatnonzero(allowed))] = float("-inf")
            row = np.packbits(np.concatenate([allowed, np.zeros((-vocab) % 32, dtype=bool)]),
                              bitorder="little").view(np.int32)
            masked = logits[i].clone()
            masked[:vocab][torch.from_numpy(~allowed)] = float("-inf")
            want = int(masked.argmax())
            got = prop._allowed_argmax(logits, i, row, host)
            if got is None:  # every allowed logit -inf, and none past the vocabulary above it
                assert float(masked[want]) == float("-inf"), (trial, i)
            else:
                assert got == want, (trial, i, got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_arbiters_masked_top_is_the_masked_laws_argmax_and_probability(dtype):
    """``_masked_top`` (the draft arbiter's judge of a host draft) against the masked law in float64: the first
    allowed maximum, and its probability in softmax(mask(logits)) to 1e-6, for rows allowing a few tokens, most
    (the row's own maximum allowed or not) or all of a 49,152-token vocabulary (float32 exponentials), logits padded
    past the vocabulary, from numpy's view of the logits and from torch's; nothing finite allowed, or a NaN, answers
    (-1, 0.0)."""
    import numpy as np
    import torch

    from specgrammar_vllm.draft_proposer import _numpy_view

    vocab, rows = 49152, 3
    prop, _ = _bare_proposer(vocab, rows)
    rng = np.random.default_rng(11)
    padded = torch.from_numpy((rng.standard_normal((rows, vocab + 64)) * 4).astype(np.float32))
    padded[:, vocab:] = 50.0  # (ids past the vocabulary, as a padded lm head has them: never the masked top)
    logits = padded.to(getattr(torch, dtype))
    wide = logits[:, :vocab].double().numpy()
    for share in (0.0005, 0.3, 0.97, 1.0):
        for i in range(rows):
            allowed = rng.random(vocab) < share
            allowed[int(rng.integers(0, vocab))] = True
            if share > 0.9 and i == 1:  # the row's own maximum refused (a wide row's other way)
                allowed[int(wide[i].argmax())] = False
            bits = np.concatenate([allowed, np.zeros((-vocab) % 32, dtype=bool)])
            row = np.packbits(bits, bitorder="little").view(np.int32)
            z = np.where(allowed, wide[i], -np.inf)
            want = int(z.argmax())
            q = float(np.exp(z[want] - np.logaddexp.reduce(z[allowed])))
            for host in (_numpy_view(logits), None):
                t, p = prop._masked_top(logits, i, row, host)
                assert t == want and abs(p - q) <= 1e-6 * max(q, 1e-3), (share, i, t, want, p, q)
    logits[0, :] = float("-inf")
    row = np.full((vocab + 31) // 32, -1, dtype=np.int32)
    assert prop._masked_top(logits, 0, row, _numpy_view(logits)) == (-1, 0.0)
    logits[1, 7] = float("nan")  # a NaN: the first allowed NaN is the masked argmax, which has no probability
    assert prop._masked_top(logits, 1, row, _numpy_view(logits)) == (-1, 0.0)


def test_the_draft_argmax_is_torchs_argmax():
    """``_argmax`` (numpy's argmax where the logits are a CPU float32 matrix; torch 2.13's CPU argmax is 5-11x slower)
    against torch's ``argmax(dim=-1)``: ties (the first maximum), NaN (the first NaN), rows all -inf, a strided view,
    float16 and bfloat16 (torch's own), no rows; the indices and their dtype the same."""
    import numpy as np
    import torch

    from specgrammar_vllm.draft_proposer import _argmax

    rng = np.random.default_rng(5)
    for trial in range(40):
        rows, vocab = int(rng.integers(1, 14)), int(rng.choice([7, 1000, 49152]))
        x = torch.from_numpy(rng.integers(0, 4, size=(rows, vocab)).astype(np.float32)) if trial % 2 else \
            torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32))
        x[0, :] = float("-inf")
        if rows > 1:
            x[1, rng.choice(vocab, size=min(3, vocab), replace=False)] = float("nan")
        if rows > 2:
            x[2, :] = x[2, 0]
        for view in (x, x[:, : max(1, vocab - 3)], x.t().contiguous().t()):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                v = view.to(dtype)
                got, want = _argmax(v), v.argmax(dim=-1)
                assert got.dtype == want.dtype and torch.equal(got, want), (trial, dtype)
    empty = torch.empty((0, 9))
    assert torch.equal(_argmax(empty), empty.argmax(dim=-1))


def _bare_proposer(vocab: int, rows: int):
    """A ``GrammarDraftProposer`` without vLLM's engine (the benchmark's: the attributes ``_lazy`` reads, every
    counter at 0, a fault raised) and its counters."""
    from specgrammar_plugins.bench.vllm_draft_host import _proposer

    prop = _proposer(vocab, rows)
    return prop, prop.grammar.counters


@pytest.mark.parametrize("limit", [None, 0, 1, 2])
def test_refused_drafts_ends_a_requests_drafts_after_that_many_refused_positions(limit):
    """``refused_drafts``: a request whose draft-model argmax the grammar refuses drafts the masked argmax there, and
    its drafts end (its block closes) after ``limit`` such positions in a step; 0 ends them at the first, with no
    mask filled and nothing drafted there (vLLM's own draft stays in the row, cut by ``_finish``); None never ends
    them.  A position whose argmax the grammar takes counts nothing.  Each row here walks four positions; the
    grammar refuses the argmax at positions 0, 2 and 3 and takes it at 1."""
    import numpy as np
    import torch

    from specgrammar_plugins.api import DraftBlock, mask_words
    from specgrammar_plugins.testing import TableMatcher
    from specgrammar_vllm.draft_proposer import _Plan

    vocab, k = 64, 4
    prop, counters = _bare_proposer(vocab, 1)
    prop._refused_drafts = limit

    def row_of(ids):
        bits = np.zeros(mask_words(vocab) * 32, dtype=bool)
        bits[list(ids)] = True
        return np.packbits(bits, bitorder="little").view(np.int32)

    # position p: the argmax is token 10 + p; allowed at position 1 only, else the allowed ids are 40 + p and 50
    tables = [row_of([40, 50]), row_of([11, 41]), row_of([42, 50]), row_of([43, 50]), row_of(range(vocab))]
    block = DraftBlock([1], TableMatcher(tables, vocab), vocab, k, lazy=True)
    r = SimpleNamespace(block=block, refused=0)
    drafted = []
    for p in range(k):
        if block.done:
            break
        logits = torch.zeros((1, vocab))
        logits[0, 10 + p] = 5.0
        logits[0, 40 + p] = 3.0
        plan = _Plan()
        plan.model.append(0)
        _, toks = prop._lazy(logits, plan, [r])
        drafted.append(toks[0])
    refused_at = [0, 2, 3]
    if limit is None:
        assert block.tokens == [40, 11, 42, 43] and not block.closed
        assert counters["draft_rows_ended"] == 0
    elif limit == 0:  # ended at position 0, nothing drafted there and no mask filled; the row keeps vLLM's token
        assert block.tokens == [] and block.closed and block.mask_fills == 0
        assert drafted == [10]
        assert counters["draft_rows_ended"] == 1 and counters["draft_rows_masked"] == 0
    else:  # the masked argmax at each refused position, then the end after the limit-th
        last = refused_at[limit - 1]
        assert block.tokens == [40, 11, 42, 43][: last + 1] and block.closed
        assert block.mask_fills == limit
        assert counters["draft_rows_ended"] == 1 and counters["draft_rows_masked"] == limit
    assert r.refused == (1 if limit == 0 else len(refused_at) if limit is None else limit)


def test_refused_drafts_option_is_checked():
    from specgrammar_vllm.draft_proposer import REFUSED_DRAFTS, refused_drafts_option

    assert refused_drafts_option({}) == REFUSED_DRAFTS == 2
    assert refused_drafts_option({"refused_drafts": None}) is None
    assert refused_drafts_option({"refused_drafts": 3}) == 3
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="refused_drafts"):
            refused_drafts_option({"refused_drafts": bad})


def test_draft_confidence_ends_a_requests_drafts_where_the_next_position_is_unlikely_reached():
    """``draft_confidence``: a request's drafts end (its block closes) after the model draft where the product of the
    draft model's probabilities of its drafts at this step falls below the threshold; that draft is still its last.
    Host drafts (forced tokens) count nothing; without probabilities (``conf`` None) or with the option off nothing
    ends.  ``_unsure`` asks for the probabilities of sampled requests' open model rows only, before the last
    position."""
    import numpy as np

    from specgrammar_plugins.api import DraftBlock, mask_words
    from specgrammar_plugins.testing import TableMatcher
    from specgrammar_vllm.draft_proposer import _Row, _Step

    vocab, k = 64, 4
    full = np.full(mask_words(vocab), -1, dtype=np.int32)

    def walk(threshold, confs, sources):
        prop, counters = _bare_proposer(vocab, 1)
        prop._confidence = threshold
        block = DraftBlock([1], TableMatcher([full] * (k + 1), vocab), vocab, k, lazy=True)
        step = _Step([_Row("r", SimpleNamespace(grammar=True), block)], k)
        for p in range(k):
            if block.done:
                break
            t = 10 + p
            if sources[p] != "model":  # a host draft already on the block at this position
                block.push(t, None, sources[p])
            prop._advance(step, [t], None if confs is None else {0: confs[p]})
            step.pos += 1
        return block, step.rows[0], counters["draft_rows_unlikely"]

    model = ["model"] * k
    block, row, ended = walk(0.2, [0.9, 0.5, 0.4, 0.9], model)  # reach 0.9, 0.45, 0.18 < 0.2: ends after the 3rd
    assert block.tokens == [10, 11, 12] and block.closed and ended == 1 and row.real == 3
    assert abs(row.reach - 0.9 * 0.5 * 0.4) < 1e-12
    block, _, ended = walk(0.2, [0.1, 0.9, 0.9, 0.9], model)  # the first draft is its last
    assert block.tokens == [10] and block.closed and ended == 1
    block, _, ended = walk(0.2, [0.1, 0.1, 0.5, 0.5], ["forced", "forced", "model", "model"])  # host drafts: 1
    assert block.tokens == [10, 11, 12, 13] and ended == 0
    for threshold, confs in ((0.2, None), (0.2, [1.0] * k), (None, [0.01] * k)):
        block, _, ended = walk(threshold, confs, model)
        assert block.tokens == [10, 11, 12, 13] and not block.closed and ended == 0

    from specgrammar_vllm.draft_proposer import _Plan

    prop, _ = _bare_proposer(vocab, 5)
    prop._confidence = 0.2
    blocks = [DraftBlock([1], TableMatcher([full] * (k + 1), vocab), vocab, k, lazy=True) for _ in range(5)]
    blocks[3].closed = True
    temps = [1.0, 0.0, 0.7, 1.0, 1.0]
    rows = [_Row(f"r{i}", SimpleNamespace(grammar=True), b, t) for i, (b, t) in enumerate(zip(blocks, temps))]
    rows[4].block = None
    plan = _Plan()
    plan.model[:] = [0, 1, 2, 3, 4]
    step = _Step(rows, k)
    assert prop._unsure(step, plan) == [0, 2]  # not greedy 1, closed 3, no grammar drafts 4
    step.pos = k - 1
    assert prop._unsure(step, plan) == []
    step.pos = 0
    prop._confidence = None
    assert prop._unsure(step, plan) == []


@pytest.mark.parametrize("vocab,dtype", [(50, "float32"), (49152, "float32"), (49152, "bfloat16")])
def test_draft_probability_is_the_tempered_law_of_the_drawn_token(vocab, dtype):
    """``_probability_of``: the rows asked for, each one's probability of its token under softmax(logits / T), T its
    request's temperature; held against the law computed in float64 with numpy, to 1e-5 of the probability (CPU
    float32 logits by numpy, bfloat16 by torch's log-softmax).  The logits are left as they were."""
    import numpy as np
    import torch

    from specgrammar_vllm.draft_proposer import _probability_of

    rng = np.random.default_rng(3)
    x = torch.tensor(rng.standard_normal((6, vocab)) * 4, dtype=torch.float32).to(getattr(torch, dtype))
    logits = x.double().numpy()
    before = x.clone()
    rows, temps = [0, 2, 3, 5], [1.0, 0.5, 2.0, 0.7]
    tokens = [int(t) for t in rng.integers(0, vocab, size=len(rows))]
    tokens[1] = int(logits[2].argmax())  # (a likely token too)
    got = _probability_of(x, rows, tokens, temps)
    assert sorted(got) == rows and torch.equal(x, before)
    tol = 1e-5 if dtype == "float32" else 2e-2  # (bfloat16's own log-softmax)
    for i, d, t in zip(rows, tokens, temps):
        z = logits[i] / t
        want = np.exp(z[d] - z.max()) / np.exp(z - z.max()).sum()
        assert abs(got[i] - want) <= tol * max(want, 1e-3), (i, got[i], want)


def test_draft_confidence_option_is_checked():
    from specgrammar_vllm.draft_proposer import DRAFT_CONFIDENCE, draft_confidence_option

    assert draft_confidence_option({}) == DRAFT_CONFIDENCE
    assert draft_confidence_option({"draft_confidence": None}) is None
    assert draft_confidence_option({"draft_confidence": 0}) is None
    assert draft_confidence_option({"draft_confidence": 0.35}) == 0.35
    for bad in (-0.1, 1, 1.5, "0.2", True):
        with pytest.raises(ValueError, match="draft_confidence"):
            draft_confidence_option({"draft_confidence": bad})


def test_the_host_chain_runs_once_per_block_length():
    """``_needs_model`` (after a position) and ``_plan`` (at the next) both ask for the host chain at the same block
    length: it runs once there (it is a function of the block's sequence), and again once the block grew."""
    from specgrammar_plugins.api import DraftBlock
    from specgrammar_vllm.draft_proposer import _Row

    class Once:
        calls = 0

        def extend(self, block, budget):
            self.calls += 1
            return 0

    drafter = Once()
    row = _Row("r", SimpleNamespace(drafter=drafter), DraftBlock([1, 2], None, 1024, 4))
    row.chain(0)
    row.chain(0)
    assert drafter.calls == 1
    row.block.push(5, None, "model")
    row.chain(1)
    row.chain(1)
    assert drafter.calls == 2
    row.chain(0)  # a host draft is already there: nothing to run
    assert drafter.calls == 2
