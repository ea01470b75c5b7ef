"""``serving.ServedRow`` (issue 34: the mlx-lm server's batched-row bookkeeping and stop rules, moved into the core):
a host serving rows through it (its own cache and batched pass: here ``testing.MarkovRunner``s) answers what our
serial loop answers; the stop rules (the host's max_tokens and stop sequences, a grammar that ends without a stop
token), the row found among a host's processors, a row's failure.  Pure core, toy tokenizer, DFA engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specgrammar_plugins.api import (GREEDY, ConstraintSpec, RowCut, RowPlan, ServedRow, SpecOptions, compile_constraint,
                                     draft_rows, make_loop)
from specgrammar_plugins.testing import MarkovRunner, toy_tokenizer

V = 128


@pytest.fixture(scope="module")
def compiled():
    return compile_constraint(ConstraintSpec.regex("é?[0-9]{2}@example[.]com/[0-9]{1,3}"), toy_tokenizer(V), engine="dfa")


def _plan(compiled, k=3):
    return RowPlan(compiled, SpecOptions(k=k, drafters=("forced", "prompt")), GREEDY, 24, seed=0)


def _serve(rows, prompts, max_tokens):
    """A host's batching path over ServedRows: each row's cache a MarkovRunner holding what the host fed it."""
    caches = [MarkovRunner(V, seed=3) for _ in rows]
    for row, cache, prompt in zip(rows, caches, prompts):
        cache.forward(prompt[:-1])
        assert row.start(prompt[:-1], prompt[-1], V, None, max_tokens) is None  # own_first: pending, not answered
    answers = [[] for _ in rows]
    while not all(r.done for r in rows):
        live = [i for i, r in enumerate(rows) if r.live]
        blocks = dict(zip(live, draft_rows([(rows[i], rows[i].loop) for i in live])))
        for i in live:
            row, cache = rows[i], caches[i]
            feed = row.feed(0, blocks[i])
            logits = cache.forward(feed)
            c, kept = row.judge(blocks[i], feed, logits, 0)
            cache.trim(len(feed) - kept)
            for j, t in enumerate(c.tokens):
                n = len(answers[i]) + 1
                said = row.answer(t, c.finish_reason if j == len(c.tokens) - 1 else None, n >= max_tokens, False)
                answers[i] += said
                if row.done:
                    break
            assert row.next_token(-1) == row.pending
    return answers


def test_rows_served_through_it_answer_what_the_serial_loop_does(compiled):
    prompts = [[1, 2, 3], [54, 55, 99], [5]]
    rows = [ServedRow(_plan(compiled, k), own_first=True) for k in (3, 1, 4)]
    answers = _serve(rows, prompts, 24)
    assert any(r.loop.stats.target_passes < r.loop.stats.emitted for r in rows)  # drafts were accepted
    for prompt, k, said in zip(prompts, (3, 1, 4), answers):
        loop = make_loop(MarkovRunner(V, seed=3), prompt, SpecOptions(k=k, drafters=("forced", "prompt")),
                         constraint=compiled, params=GREEDY, max_tokens=24)
        list(loop.run())
        assert [t for t, _ in said] == loop.emitted
        assert [f for _, f in said][-1] == "stop" and all(f is None for _, f in said[:-1])
        text = b"".join(compiled.tokenizer.token_bytes[t] for t in loop.emitted).decode()
        assert "@example.com/" in text


def test_the_hosts_stop_rules(compiled):
    row = ServedRow(_plan(compiled), own_first=True)
    row.start([1, 2], 3, V, None, 12)
    stop = min(row.loop.stop_token_ids)
    assert row.answer(54, None, False, False) == [(54, None)] and not row.done
    # the grammar ended on a token that is not a stop token: that token, then a stop token (the host's "stop" drops
    # the last token's text)
    assert row.answer(55, "stop", False, False) == [(55, None), (stop, "stop")] and row.done
    row = ServedRow(_plan(compiled), own_first=True)
    row.start([1, 2], 3, V, None, 12)
    assert row.answer(stop, "stop", False, False) == [(stop, "stop")]
    for length, stopped, want in ((True, False, "length"), (False, True, "stop"), (True, True, "stop")):
        row = ServedRow(_plan(compiled), own_first=True)
        row.start([1, 2], 3, V, None, 12)
        assert row.answer(54, None, length, stopped) == [(54, want)] and row.done
    plain = ServedRow()  # a row the host decodes itself: its own finish reasons only
    assert plain.feed(7, None) == [7] and plain.next_token(7) == 7 and not plain.live
    assert plain.answer(7, None, False, False) == [(7, None)]
    assert plain.answer(8, "stop", False, False) == [(8, "stop")] and plain.done


def test_a_sampled_first_token_is_answered_and_checked(compiled):
    row = ServedRow(_plan(compiled))  # the host sampled the first token under the grammar processor
    assert row.start([1, 2, 3], 54, V, None, 12) is None and row.loop.emitted == [54] and row.pending == 54
    with pytest.raises(RuntimeError, match="outside the grammar"):
        ServedRow(_plan(compiled)).start([1, 2, 3], 1, V, None, 12)


def test_the_row_among_a_hosts_processors_and_its_failure(compiled):
    ours = SimpleNamespace(batch_row=_plan(compiled))
    guarded = SimpleNamespace(processors=[ours], error=None)
    assert ServedRow.of([ours]).plan is ours.batch_row and ServedRow.of([ours]).procs is None
    row = ServedRow.of([guarded], own_first=True)
    assert row.plan is ours.batch_row and row.procs is guarded and row.own_first and row.fresh
    other = SimpleNamespace(batch_row=None)
    assert ServedRow.of([ours, other]).plan is None and ServedRow.of(None).plan is None
    assert ServedRow.of([SimpleNamespace(processors=[ours, other], error=None)]).plan is None
    e = ValueError("ñandú")
    assert row.fail(e) is None and guarded.error is e and row.done  # the host answers the request with it
    assert ServedRow.of([guarded]).fail(ValueError("again")) == "stop" and guarded.error is e
    assert ServedRow.of([ours]).fail(e) == "stop"


def test_a_row_cut_checks_each_draft_once_as_the_whole_row_would():
    """``RowCut`` (the budget as mask rows, vLLM's bitmask): the drafts its rows allow, each draft checked alone,
    are those the budget's whole row at each prefix allows; a kept check answers ``known`` for the same drafts
    after the same prefix, and nothing for another prefix."""
    import numpy as np

    from specgrammar_plugins.api import check_budget, mask_allows, new_mask

    tok = toy_tokenizer(V)
    spec = ConstraintSpec.regex("é?[0-9]{2,8}@example[.]com")
    compiled = compile_constraint(spec, tok, engine="dfa")
    budget = check_budget(compiled, SpecOptions(), 9)
    cut = RowCut(budget, width=V, deterministic_drafts=True)
    digits = tok.encode("1234567")

    def whole(prefix, drafts):  # the reference: the grammar's row, cut at each prefix
        m = compiled.matcher()
        for t in prefix:
            assert m.accept(t)
        for i, t in enumerate(drafts):
            row = new_mask(V)
            m.fill_mask(row)
            budget.mask_row(row, [*prefix, *drafts[:i]])
            if not mask_allows(row, t):
                return i
            assert m.accept(t)
        return len(drafts)

    prefix = tok.encode("é")
    want = whole(prefix, digits)
    assert 0 < want < len(digits)  # "@example.com" must still fit: the budget ends the digits early
    assert cut.fitting(np.array(prefix), digits, remember=True) == want
    assert cut.known(prefix, digits) == (want, True)
    assert cut.known(prefix, digits[:want]) == (want, False)
    assert cut.known(prefix[:0], digits) == (0, False) and cut.known(prefix, [9, 9]) == (0, False)
    assert cut.fitting(prefix, digits, start=want) == want  # (the known ones skipped)
    sampled = RowCut(budget, width=V)  # sampled drafts stay whole: the host's row rejects a forbidden one
    assert sampled.fitting(prefix, digits) == len(digits)
