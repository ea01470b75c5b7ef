import numpy as np
import pytest

from specgrammar_plugins import ConstraintSpec, compile_constraint
from specgrammar_plugins.masks import new_mask, unpack_mask
from specgrammar_plugins.history import HistoryMatcher


def test_history_keyed_rollback_and_rejected_tokens(toy_tok):
    c = compile_constraint(ConstraintSpec.regex(r"[0-9]{3}"), toy_tok, engine="dfa")
    hm = HistoryMatcher(c)
    ref = c.matcher()
    row = new_mask(toy_tok.vocab_size)
    one, two, a = (toy_tok.token_bytes.index(x) for x in (b"1", b"2", b"a"))
    histories = [[], [one], [one, two], [one], [two, two], [two, two, one], [two], [two, a], [two, a, one], [two, two]]
    for h in histories:
        mask, ok = hm.mask_for(h)
        fresh = c.matcher()
        valid = all(fresh.accept(t) for t in h)
        assert ok == valid
        if valid:
            fresh.fill_mask(row)
            assert (mask == row).all()
            assert hm.fed == h
        else:
            assert unpack_mask(mask, toy_tok.vocab_size)[: len(toy_tok.token_bytes)].all()
            assert a not in hm.fed  # a rejected token never reaches the matcher
    mask, ok = hm.mask_for([one, two, one, 0])  # complete and stopped: only stop tokens
    assert ok and np.flatnonzero(unpack_mask(mask, toy_tok.vocab_size)).tolist() == [0]


def test_drafting_on_the_history_matcher_then_syncing_equals_a_fresh_sync():
    """``HistoryMatcher.draft()`` (the vLLM proposers' draft blocks: the history's own matcher, no fork): after
    drafts accepted on the view and a commit of some of them plus a token of the host's, ``sync`` leaves the
    matcher where a fresh matcher fed the committed tokens stands (same mask, same ``fed``), on xgrammar (vLLM's
    default backend) and llguidance, stop tokens drafted and not committed included; ``sync_tail`` (only what
    follows the last synced history compared and fed: what vLLM's proposers call) in every other round, and
    refused (nothing changed) for a base past the last synced history; drafts rolled back on the view below it
    lower it."""
    from specgrammar_plugins import workloads as W
    from specgrammar_plugins.masks import allowed_ids
    from specgrammar_plugins.models import tiny_tokenizer_info

    tok = tiny_tokenizer_info()
    spec = W.examples("json_extraction", "eval", 1)[0].constraint
    rng = np.random.default_rng(3)
    row = new_mask(tok.vocab_size)
    ran = []
    for engine in ("xgrammar", "llguidance"):
        try:
            c = compile_constraint(spec, tok, engine=engine)
        except Exception:  # an engine not installed here (xgrammar is a dependency)
            continue
        ran.append(engine)
        for _ in range(4):
            hm = HistoryMatcher(c)
            committed: list[int] = []
            for _round in range(60):
                assert hm.sync(committed) and hm.fed == committed
                if hm.matcher.is_terminated():
                    break
                view = hm.draft()
                drafts: list[int] = []
                for _ in range(int(rng.integers(0, 5))):
                    if view.is_terminated():
                        break
                    view.fill_mask(row)
                    t = int(rng.choice(allowed_ids(row, tok.vocab_size)))
                    assert view.accept(t)
                    drafts.append(t)
                assert hm.fed == committed + drafts
                if drafts and rng.random() < 0.2:  # some drafts taken back on the view (below synced, too)
                    back = int(rng.integers(1, len(drafts) + 1))
                    view.rollback(back)
                    drafts = drafts[: len(drafts) - back]
                    assert hm.synced <= len(hm.fed) == len(committed) + len(drafts)
                keep = drafts[: int(rng.integers(0, len(drafts) + 1))]
                probe = c.matcher()  # the host's own next token after the kept drafts
                assert all(probe.accept(t) for t in committed + keep)
                if not probe.is_terminated():
                    probe.fill_mask(row)
                    ids = [int(i) for i in allowed_ids(row, tok.vocab_size) if i not in tok.stop_token_ids] or \
                        [int(i) for i in allowed_ids(row, tok.vocab_size)]
                    keep = keep + [int(rng.choice(ids))]
                prev, committed = len(committed), committed + keep
                if rng.random() < 0.5:
                    fed = list(hm.fed)
                    with pytest.raises(ValueError):
                        hm.sync_tail(prev + 1, keep[1:])
                    assert hm.fed == fed
                    assert hm.sync_tail(prev, keep) and hm.fed == committed
                else:
                    assert hm.sync(committed) and hm.fed == committed
                assert hm.synced == len(committed)
                fresh = c.matcher()
                assert all(fresh.accept(t) for t in committed)
                assert hm.matcher.is_terminated() == fresh.is_terminated()
                if not fresh.is_terminated():
                    want = new_mask(tok.vocab_size)
                    fresh.fill_mask(want)
                    hm.matcher.fill_mask(row)
                    assert (row == want).all()
    assert "xgrammar" in ran
