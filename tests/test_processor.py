import numpy as np

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
