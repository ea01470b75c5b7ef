"""The speculative loop over a pure-numpy Markov "model": greedy equality, exact law end to end, bookkeeping,
deferred triggers and bad input."""

import zlib
from collections import Counter

import numpy as np
import pytest

from conftest import available_engines, outputs_chi2
from specgrammar_plugins import ConstraintError, ConstraintSpec, SamplingParams, TokenizerMismatchError, compile_constraint
from specgrammar_plugins.masks import new_mask, unpack_mask
from specgrammar_plugins.distributions import GREEDY
from specgrammar_plugins.drafters import ChainDrafter, ForcedDrafter, ModelDrafter
from specgrammar_plugins.loop import SpeculativeLoop, generate
from specgrammar_plugins.testing import MarkovRunner, exact_law, plain_decode

ENGINES = [e for e in available_engines()]
REGEXES = [r"[a-z]+@[a-z]+\.com", r"[0-9]{4}", r"[A-Z]{3}-[0-9]{4}", r"(ab|ba)+(\.com)?"]


def _pair(tok, seed=0, noise=1.0):
    target = MarkovRunner(tok.vocab_size, seed=seed, valid=len(tok.token_bytes))
    draft = MarkovRunner(tok.vocab_size, seed=seed + 1, noise_of=target, noise=noise)
    return target, draft


def _chain(tok, draft, params, rng):
    return ChainDrafter([ForcedDrafter(tok.encode), ModelDrafter(draft, params, rng)])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("pattern", REGEXES)
def test_greedy_speculative_equals_plain(toy_tok, engine, pattern):
    c = compile_constraint(ConstraintSpec.regex(pattern), toy_tok, engine=engine)
    prompt = toy_tok.encode("ex")
    for seed in range(3):
        target, draft = _pair(toy_tok, seed)
        ref = plain_decode(MarkovRunner(toy_tok.vocab_size, seed=seed, valid=len(toy_tok.token_bytes)), prompt,
                           c.matcher(), GREEDY, 24, np.random.default_rng(0), toy_tok.stop_token_ids)
        for k in range(1, 9):
            rng = np.random.default_rng(k)
            loop = SpeculativeLoop(target, prompt, constraint=c, drafter=_chain(toy_tok, draft, GREEDY, rng), k=k,
                                   params=GREEDY, max_tokens=24, rng=rng)
            for commit in loop.run():
                # bookkeeping after every round: cache = prompt + emitted[:-1] (or all of it once finished)
                n_cache = len(target.tokens)
                want = len(prompt) + len(loop.emitted) - (0 if commit.finish_reason and
                                                          n_cache == len(prompt) + len(loop.emitted) else 1)
                assert n_cache == want
                assert target.tokens == (prompt + loop.emitted)[:n_cache]
            assert loop.emitted == ref, (engine, pattern, seed, k)
            assert loop.stats.target_passes <= len(ref)


def test_matcher_follows_committed_prefix(toy_tok):
    c = compile_constraint(ConstraintSpec.regex(r"[a-z]+@[a-z]+\.com"), toy_tok, engine="dfa")
    target, draft = _pair(toy_tok, 3, noise=2.0)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.9)
    loop = SpeculativeLoop(target, toy_tok.encode("ab"), constraint=c, drafter=_chain(toy_tok, draft, params, rng),
                           k=4, params=params, max_tokens=40, rng=rng)
    for _ in loop.run():
        # replaying the emitted tokens on a fresh matcher reaches the same state as the loop's matcher
        fresh = c.matcher()
        for t in loop.emitted:
            assert fresh.accept(t)
        assert fresh.state == loop.matcher.state
    assert loop.stats.drafted >= loop.stats.accepted > 0
    assert sum(loop.stats.drafted_by_pos) == loop.stats.drafted


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("k", [2, 5])
def test_loop_law_matches_plain_constrained_sampling(toy_tok, temperature, k):
    """End to end: the distribution of whole outputs of the speculative loop (model + forced drafts) equals the
    enumerated law of plain constrained sampling.  Chi-square on outputs with expected count >= 5, p > 0.001."""
    c = compile_constraint(ConstraintSpec.regex(r"(a|b|ab)(a|ba)?-[0-9]"), toy_tok, engine="dfa")
    prompt = toy_tok.encode("ab")
    params = SamplingParams(temperature=temperature)
    law = exact_law(MarkovRunner(toy_tok.vocab_size, seed=5, valid=len(toy_tok.token_bytes)), prompt, c, params, 8)
    assert abs(sum(law.values()) - 1) < 1e-9
    N = 4000
    rng = np.random.default_rng(zlib.crc32(f"{temperature}-{k}".encode()))
    target, draft = _pair(toy_tok, 5, noise=1.5)
    seen = Counter()
    for _ in range(N):
        out, _st = generate(target, prompt, constraint=c, drafter=_chain(toy_tok, draft, params, rng), k=k,
                            params=params, max_tokens=8, rng=rng)
        seen[tuple(out)] += 1
    assert set(seen) <= set(law), "the loop produced an output plain sampling cannot"
    assert outputs_chi2(law, seen, N) > 0.001


def test_unconstrained_loop_and_max_tokens(toy_tok):
    target, draft = _pair(toy_tok, 1)
    prompt = [5, 6]
    ref = plain_decode(MarkovRunner(toy_tok.vocab_size, seed=1, valid=len(toy_tok.token_bytes)), prompt, None,
                       GREEDY, 10, np.random.default_rng(0), toy_tok.stop_token_ids)
    rng = np.random.default_rng(0)
    out, st = generate(target, prompt, drafter=ModelDrafter(draft, GREEDY, rng), k=3, params=GREEDY, max_tokens=10,
                       rng=rng, stop_token_ids=toy_tok.stop_token_ids)
    assert out == ref
    assert len(out) <= 10
    if len(out) == 10:
        assert st.finish_reason == "length"


def test_blind_drafts_are_rejected_not_committed(toy_tok):
    c = compile_constraint(ConstraintSpec.regex(r"[0-9]{6}"), toy_tok, engine="dfa")
    target, draft = _pair(toy_tok, 2)
    prompt = toy_tok.encode("ab")
    ref = plain_decode(MarkovRunner(toy_tok.vocab_size, seed=2, valid=len(toy_tok.token_bytes)), prompt, c.matcher(),
                       GREEDY, 12, np.random.default_rng(0), toy_tok.stop_token_ids)
    rng = np.random.default_rng(0)
    out, st = generate(target, prompt, constraint=c, drafter=ModelDrafter(draft, GREEDY, rng, blind=True), k=4,
                       params=GREEDY, max_tokens=12, rng=rng)
    assert out == ref
    aware, st2 = generate(MarkovRunner(toy_tok.vocab_size, seed=2, valid=len(toy_tok.token_bytes)), prompt,
                          constraint=c, drafter=ModelDrafter(_pair(toy_tok, 2)[1], GREEDY, rng), k=4, params=GREEDY,
                          max_tokens=12, rng=rng)
    assert aware == ref
    assert st2.acceptance >= st.acceptance


def test_forced_tokens_are_drafts(toy_tok):
    c = compile_constraint(ConstraintSpec.choice(["example.com"]), toy_tok, engine="dfa")
    target = MarkovRunner(toy_tok.vocab_size, seed=4, valid=len(toy_tok.token_bytes))
    out, st = generate(target, [1], constraint=c, drafter=ForcedDrafter(toy_tok.encode), k=8, params=GREEDY,
                       max_tokens=20, seed=0)
    assert toy_tok.decode(out[:-1]) == b"example.com" and out[-1] == toy_tok.eos_token_id
    assert st.forced_tokens >= 1 and st.target_passes < len(out)


def test_forced_tokens_do_not_use_up_k(toy_tok):
    """k bounds the drafts that can be rejected; the grammar's own tokens ride along (up to ``free_forced``): with
    k = 1 a forced literal is still verified in one pass, the output is the same, and ``free_forced=0`` gives
    the old one-draft rounds."""
    c = compile_constraint(ConstraintSpec.regex(r"[0-9]q{6}[0-9]"), toy_tok, engine="dfa")  # 'q': one token
    target = MarkovRunner(toy_tok.vocab_size, seed=4, valid=len(toy_tok.token_bytes))
    runs = {}
    for free in (0, 16):
        runs[free] = generate(target, [1], constraint=c, drafter=ForcedDrafter(toy_tok.encode), k=1,
                              params=GREEDY, max_tokens=30, seed=0, free_forced=free)
    (out0, st0), (out16, st16) = runs[0], runs[16]
    assert out0 == out16 and toy_tok.decode(out0[1:7]) == b"q" * 6
    assert st16.drafted == st16.accepted == 6 > st0.drafted  # all six forced in one round
    assert st16.target_passes < st0.target_passes


# ------------------------------------------------------------------------------------------- deferred trigger
@pytest.mark.parametrize("k", [0, 3, 8])
def test_deferred_trigger(toy_tok, k):
    spec = ConstraintSpec.regex(r"[0-9]{4}", trigger="</think>")
    c = compile_constraint(spec, toy_tok, engine="dfa")
    for seed in range(12):
        rng = np.random.default_rng(seed)
        params = SamplingParams(temperature=1.0)
        target = MarkovRunner(toy_tok.vocab_size, seed=seed, valid=len(toy_tok.token_bytes), scale=1.0)
        # a draft that strongly likes the trigger pieces, so triggers complete inside draft blocks
        draft = MarkovRunner(toy_tok.vocab_size, seed=seed + 100, noise_of=target, noise=0.5)
        drafter = ChainDrafter([ForcedDrafter(toy_tok.encode), ModelDrafter(draft, params, rng)]) if k else None
        prompt = toy_tok.encode("</think>ab")  # the prompt's own trigger does not count
        loop = SpeculativeLoop(target, prompt, constraint=c, drafter=drafter, k=k, params=params, max_tokens=60,
                               rng=rng)
        out = loop.generate()
        text = toy_tok.decode([t for t in out if t not in toy_tok.stop_token_ids])
        if b"</think>" in text:
            after = text.split(b"</think>", 1)[1]
            assert len(after) <= 4 and after.isdigit() or after == b"" or (b"0" <= after[:1] <= b"9"), text
            if loop.finish_reason == "stop" and out[-1] == toy_tok.eos_token_id:
                assert len(after) == 4 and after.isdigit(), text
        else:
            assert loop.matcher.active is False


def test_trigger_completing_mid_token(toy_tok):
    """A token that completes the trigger and carries bytes past it is allowed only if the grammar takes them."""
    think = toy_tok.token_bytes.index(b"think")
    full = toy_tok.token_bytes.index(b"</think>")
    row = new_mask(toy_tok.vocab_size)
    for pattern, ok in ((r"k>?[0-9]*", True), (r"[0-9]+", False)):
        c = compile_constraint(ConstraintSpec.regex(pattern, trigger="</thin"), toy_tok, engine="dfa")
        m = c.matcher()
        for t in toy_tok.encode("zz</"):
            assert m.accept(t)
        m.fill_mask(row)
        allowed = unpack_mask(row, toy_tok.vocab_size)
        # "think" completes the trigger with tail "k"; "</think>" completes it with tail "k>"
        assert bool(allowed[think]) is ok and bool(allowed[full]) is ok
        assert allowed[toy_tok.token_bytes.index(b"a")]  # before the trigger: free text
        if ok:
            f = m.fork()
            assert f.accept(full) and f.active
            assert f.accept(toy_tok.token_bytes.index(b"1"))
            f.fill_mask(row)
            assert set(np.flatnonzero(unpack_mask(row, toy_tok.vocab_size))) == {
                toy_tok.token_bytes.index(bytes([c])) for c in b"0123456789"} | {toy_tok.token_bytes.index(b"12"),
                toy_tok.token_bytes.index(b"20"), toy_tok.token_bytes.index(b"19"), 0}
            f.rollback(2)
            assert not f.active and f.accept(think) and f.active


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("engine", ENGINES)
def test_invalid_regex_is_a_constraint_error(toy_tok, engine):
    with pytest.raises(ConstraintError) as e:
        compile_constraint(ConstraintSpec.regex("[a-z"), toy_tok, engine=engine)
    assert e.value.engine == engine and e.value.reason


def test_bad_specs(toy_tok):
    with pytest.raises(ConstraintError, match="JSON schema is not valid JSON"):
        ConstraintSpec.json_schema("{not json")
    with pytest.raises(ConstraintError):
        ConstraintSpec("nope", "x")
    with pytest.raises(ConstraintError):
        ConstraintSpec.choice([])
    with pytest.raises(ConstraintError, match="unknown engine"):
        compile_constraint(ConstraintSpec.regex("a"), toy_tok, engine="no-such-engine")
    with pytest.raises(ConstraintError, match="matches no string"):
        compile_constraint(ConstraintSpec.regex("a[^\\s\\S]"), toy_tok, engine="dfa")


def test_tokenizer_mismatch(toy_tok):
    from specgrammar_plugins.testing import toy_tokenizer

    other = toy_tokenizer(vocab_size=160)
    toy_tok.check_same_vocab(other)  # same vocabulary, other width: fine
    from dataclasses import replace

    different = replace(toy_tok, token_bytes=toy_tok.token_bytes[:-1] + (b"zz",))
    with pytest.raises(TokenizerMismatchError, match="tokenizers differ"):
        toy_tok.check_same_vocab(different)


def test_width_mismatch_is_refused(toy_tok):
    c = compile_constraint(ConstraintSpec.regex("[0-9]+"), toy_tok, engine="dfa")
    with pytest.raises(ConstraintError, match="with_vocab_size"):
        SpeculativeLoop(MarkovRunner(toy_tok.vocab_size + 64), [1], constraint=c)


def test_online_suffix_drafter_learns_from_finished_requests(toy_tok):
    """The loop tells its drafter each finished request: a repeated request is then drafted from the online
    suffix index, and the output is unchanged."""
    from specgrammar_plugins.drafters import DraftContext, build_chain
    from specgrammar_plugins.recipes import SuffixIndex

    c = compile_constraint(ConstraintSpec.regex(r"[a-z]{3,12}@[a-z]{3,12}\.com"), toy_tok, engine="dfa")
    index = SuffixIndex()
    outs, stats = [], []
    for _ in range(2):
        drafter = build_chain(["suffix"], DraftContext(tokenizer=toy_tok, options={"suffix_index": index}))
        target = MarkovRunner(toy_tok.vocab_size, seed=8, valid=len(toy_tok.token_bytes))
        out, st = generate(target, toy_tok.encode("ex"), constraint=c, drafter=drafter, k=6, params=GREEDY,
                           max_tokens=30, seed=0)
        outs.append(out)
        stats.append(st)
    assert outs[0] == outs[1]
    assert stats[0].accepted_by_source.get("suffix", 0) == 0
    assert stats[1].accepted_by_source.get("suffix", 0) > 0 and stats[1].target_passes < stats[0].target_passes


def test_common_prefix_len_on_every_sequence_kind():
    """The list fast path (one history extending the other, compared in C) and the general walk agree."""
    import random

    from specgrammar_plugins.prefix import common_prefix_len

    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(4) for _ in range(rng.randrange(12))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(6))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for x, y in ((a, b), (b, a), (tuple(a), b), (np.asarray(a, dtype=np.int64), b), (a, np.asarray(b))):
            assert common_prefix_len(x, y) == want, (x, y)
