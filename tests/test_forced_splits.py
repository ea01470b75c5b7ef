"""The forced drafter's memory of how the model split jump-forward strings (``drafters.ForcedSplits``): what it
learns from the committed tokens, and that a learnt split is replayed (source ``forced-jump``) without changing the
output."""

from __future__ import annotations

import numpy as np
import pytest

from specgrammar_plugins import ConstraintSpec, compile_constraint
from specgrammar_plugins.distributions import GREEDY
from specgrammar_plugins.drafters import FORCED_JUMP, ChainDrafter, ForcedDrafter, ForcedSplits
from specgrammar_plugins.loop import generate
from specgrammar_plugins.testing import MarkovRunner, plain_decode


def _ids(tok, *pieces: bytes) -> list[int]:
    return [tok.token_bytes.index(p) for p in pieces]


def test_learn_keeps_the_models_tokens_inside_the_string_and_its_tails(toy_tok):
    s = ForcedSplits(toy_tok.token_bytes)
    prev = _ids(toy_tok, b"x")[0]
    lb, q, ab, qc = _ids(toy_tok, b"{", b'"', b"ab", b'":')
    assert not s.learn(prev, b'{"ab":', [lb, q])  # not yet written past the string: nothing learnt
    assert len(s) == 0 and s.get(prev, '{"ab":') is None
    assert s.learn(prev, b'{"ab":', [lb, q, ab, qc, prev])
    assert s.get(prev, '{"ab":') == [lb, q, ab, qc]
    assert s.get(lb, '"ab":') == [q, ab, qc] and s.get(q, 'ab":') == [ab, qc] and s.get(ab, '":') == [qc]
    assert s.get(lb, '{"ab":') is None  # another token before it: another key
    # a token that runs past the string's end is not kept (it merges with what follows)
    s2 = ForcedSplits(toy_tok.token_bytes)
    assert s2.learn(prev, b'{"a', [lb, q, ab])
    assert s2.get(prev, '{"a') == [lb, q]


def test_bounded(toy_tok):
    s = ForcedSplits(toy_tok.token_bytes, limit=3)
    a, b = _ids(toy_tok, b"a", b"b")
    for prev in range(6):
        s.learn(prev, b"a", [a, b])
    assert len(s) == 3 and s.get(0, "a") is None and s.get(5, "a") == [a]


def test_learnt_split_is_replayed_and_the_output_is_unchanged(toy_tok):
    """A forced literal the toy model writes in its own pieces: the second request, with the memory the first
    left, drafts the model's split and every forced-jump draft is accepted; both outputs equal plain greedy
    decoding."""
    pytest.importorskip("xgrammar")  # (the dfa engine has no jump-forward string)
    tok = toy_tok
    spec = ConstraintSpec.regex(r'(x|y)\{"abba-example":[0-9]\}')
    c = compile_constraint(spec, tok, engine="xgrammar")
    prompt = tok.encode("ab")
    runner = MarkovRunner(tok.vocab_size, seed=3, valid=len(tok.token_bytes), scale=4.0)
    ref = plain_decode(runner, prompt, c.matcher(), GREEDY, 40, np.random.default_rng(0),
                       stop_token_ids=tok.stop_token_ids)
    splits = ForcedSplits(tok.token_bytes)
    runs = []
    for _ in range(2):
        out, st = generate(runner, prompt, constraint=c, drafter=ChainDrafter([ForcedDrafter(tok.encode,
                           splits=splits)]), k=4, params=GREEDY, max_tokens=40, seed=0)
        assert out == ref
        runs.append(st)
    assert len(splits) > 0
    second = runs[1]
    assert second.drafted_by_source.get(FORCED_JUMP, 0) > 0
    assert second.accepted_by_source.get(FORCED_JUMP, 0) == second.drafted_by_source[FORCED_JUMP]
    assert second.target_passes <= runs[0].target_passes
