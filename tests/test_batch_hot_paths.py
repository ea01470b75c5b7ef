"""The batch layer's per-position hot paths (issue 34): the cheaper forms give exactly what they replace.

- ``masks.allowed_ids``: a sparse row's ids read off its nonzero words only, against unpacking every bit; with its
  cache, the same.
- ``GrammarDrafting._masked_argmax`` on a CPU past ``CPU_KERNEL_MAX_VOCAB``: the allowed-ids argmax read through a
  numpy view of the logits (a bfloat16 tensor as its raw bits), against xgrammar's kernel then ``argmax``, for
  float32, float16 and bfloat16 logits with ties, NaN and all -inf rows.
- ``HistoryMatcher.draft``: one view per history, still in step with ``fed`` across rounds.
"""

from __future__ import annotations

import numpy as np
import pytest

from specgrammar_plugins.masks import allowed_ids, mask_words, pack_mask, unpack_mask


@pytest.mark.parametrize("vocab", [1, 31, 64, 100, 9000, 151936])
def test_allowed_ids_equals_unpacking_every_bit(vocab):
    rng = np.random.default_rng(vocab)
    for p in (0.0, 0.0005, 0.003, 0.03, 0.5, 1.0):  # sparse (the nonzero words) and dense (every bit) rows
        row = pack_mask(rng.random(vocab) < p)
        for junk in (False, True):  # bits past the vocabulary in the last word (xgrammar sets them)
            if junk and vocab % 32:
                row[-1] |= np.int32(-1) << np.int32(vocab % 32)
            got = allowed_ids(row, vocab)
            assert got.dtype == np.int64
            assert got.tolist() == np.flatnonzero(unpack_mask(row, vocab)).tolist()


def test_allowed_ids_cache_gives_each_rows_own_ids_and_stays_bounded():
    """The cache (vLLM's refused rows) returns what unpacking gives, for rows of the same count of nonzero words and
    the same bits in another order (never another row's ids), keeps only sparse rows, at most ALLOWED_IDS_CACHE."""
    from specgrammar_plugins.masks import ALLOWED_IDS_CACHE

    vocab = 151936
    rng = np.random.default_rng(34)
    cache: dict = {}
    base = rng.choice(vocab, 425, replace=False)
    rows = [pack_mask(np.isin(np.arange(vocab), base))]
    swapped = rows[0].copy()
    nz = np.flatnonzero(swapped)
    swapped[nz[0]], swapped[nz[1]] = swapped[nz[1]], swapped[nz[0]]  # same words, two swapped: another row
    rows += [swapped, pack_mask(rng.random(vocab) < 0.5)]  # and a dense row
    for _ in range(3):  # misses, then hits
        for row in rows:
            got = allowed_ids(row, vocab, cache)
            assert got.tolist() == np.flatnonzero(unpack_mask(row, vocab)).tolist()
    assert len(cache) == 2 and all(not v.flags.writeable for v in cache.values())  # the two sparse rows
    for n in range(ALLOWED_IDS_CACHE + 5):
        allowed_ids(pack_mask(np.isin(np.arange(vocab), [n, n + 1000])), vocab, cache)
    assert len(cache) == ALLOWED_IDS_CACHE


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_masked_argmax_equals_the_kernel_in_every_logits_dtype(dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    pytest.importorskip("xgrammar")
    from specgrammar_plugins.bench.vllm_draft_host import _proposer
    from specgrammar_vllm.draft_proposer import CPU_KERNEL_MAX_VOCAB, GrammarDraftProposer, _numpy_view

    vocab, rows = 9000, 6
    assert vocab > CPU_KERNEL_MAX_VOCAB  # (the allowed-ids path)
    prop = _proposer(vocab, rows)
    dt = getattr(torch, dtype)
    rng = np.random.default_rng(3)
    for trial in range(40):
        logits = torch.from_numpy(rng.integers(0, 5, size=(rows, vocab)).astype(np.float32)).to(dt)  # ties
        masks = []
        for i in range(rows):
            allowed = rng.random(vocab) < rng.choice([0.001, 0.01, 0.5])
            allowed[int(rng.integers(0, vocab))] = True
            ids = torch.from_numpy(np.flatnonzero(allowed))
            if i == 0 and trial % 3 == 0:  # every allowed logit -inf: the kernel decides
                logits[i, ids] = float("-inf")
            elif i == 1 and trial % 2 == 0:  # a NaN among the allowed
                logits[i, int(ids[len(ids) // 2])] = float("nan")
            masks.append(pack_mask(allowed))
        assert _numpy_view(logits) is not None
        items = [(i, masks[i]) for i in range(rows)]
        got = prop._masked_argmax(logits, items)
        want = logits.clone()
        prop._bitmask_np[:rows] = np.stack(masks)
        GrammarDraftProposer._apply(prop, want, rows)
        assert got == want.argmax(dim=-1).tolist()
    assert mask_words(vocab) == masks[0].shape[0]


def test_a_historys_draft_view_is_made_once_and_follows_its_history():
    """The view holds no state of a round: the same object every round, its drafts appended to ``fed`` and the
    next sync rolling back those the host did not commit."""
    from specgrammar_plugins.compiler import compile_constraint
    from specgrammar_plugins.constraint import ConstraintSpec
    from specgrammar_plugins.history import HistoryMatcher
    from specgrammar_plugins.testing import toy_tokenizer

    tok = toy_tokenizer()
    h = HistoryMatcher(compile_constraint(ConstraintSpec.regex("[ab]{6}"), tok))
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    view = h.draft()
    assert view.accept(a) and view.accept(b) and h.fed == [a, b]
    assert h.sync([a, a]) and h.fed == [a, a]  # the host kept one draft, then its own token
    assert h.draft() is view
    assert view.accept(b) and h.fed == [a, a, b]
    view.rollback(1)
    assert h.fed == [a, a] and h.draft() is view


def test_a_history_and_its_draft_view_are_freed_without_the_cyclic_collector():
    """Issue 33: the view held its history and the history its view, so each request's matcher, and with it its
    compiled grammar, waited for the cyclic collector, which vLLM's EngineCore runs rarely (it freezes its start-up
    heap): a 20,000-option choice's grammar stayed +66 MB after the request until a full collection."""
    import gc
    import weakref

    from specgrammar_plugins.compiler import compile_constraint
    from specgrammar_plugins.constraint import ConstraintSpec
    from specgrammar_plugins.history import HistoryMatcher
    from specgrammar_plugins.testing import toy_tokenizer

    tok = toy_tokenizer()
    compiled = compile_constraint(ConstraintSpec.regex("[ab]{6}"), tok, cache=None)
    h = HistoryMatcher(compiled)
    view = h.draft()
    a = tok.encode("a")[0]
    assert view.accept(a) and view.accept(a)
    view.rollback(1)
    assert h.synced <= 1 and h.fed == [a]
    refs = weakref.ref(h), weakref.ref(compiled)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del h, view, compiled
        assert refs[0]() is None and refs[1]() is None
    finally:
        if enabled:
            gc.enable()
