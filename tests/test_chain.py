"""The drafter chain learns, per request, which of its sources the target accepts (``drafters.ChainDrafter``):
a fixed sequence of blocks and commits -> the order it tries them in.  Pure data: unconstrained blocks and
drafters that propose fixed runs."""

from __future__ import annotations

import pytest

from specgrammar_plugins.block import DraftBlock, fill
from specgrammar_plugins.drafters import ChainDrafter, DraftContext, build_chain, push_run
from specgrammar_plugins.errors import RequestError
from specgrammar_plugins.recipes import SuffixIndex


class Run:
    """A drafter that proposes the same run everywhere (``run`` empty: nothing)."""

    def __init__(self, name: str, run: list[int]):
        self.name, self.run = name, run

    def extend(self, block: DraftBlock, budget: int) -> int:
        return push_run(block, self.run[:budget], self.name)


def _round(chain, context: list[int], budget: int = 2) -> DraftBlock:
    b = DraftBlock(context, None, 100, budget)
    fill(b, chain)
    return b


def test_chain_orders_its_sources_by_what_the_target_accepted():
    chain = ChainDrafter([Run("forced", []), Run("recipe", [10, 11]), Run("prompt", [20, 21]), Run("model", [30])],
                         learn=True)
    assert chain.order() == ["forced", "recipe", "prompt", "model"]  # the configured order first
    ctx = [1, 2, 3]
    b = _round(chain, ctx)
    assert b.sources == ["recipe", "recipe"]
    ctx += [10, 99]  # the target took the first draft, not the second
    b = _round(chain, ctx)
    assert (chain.accepted, chain.rejected) == ({"recipe": 1}, {"recipe": 1})
    assert chain.order() == ["forced", "recipe", "prompt", "model"]  # 2/4 = the prior's 1/2: ties keep the order
    ctx += [5]  # the first draft rejected (the one after it never judged)
    b = _round(chain, ctx)
    assert chain.rejected == {"recipe": 2} and chain.estimate("recipe") == pytest.approx(2 / 5)
    assert chain.order() == ["forced", "prompt", "model", "recipe"]  # below the model: skipped
    assert b.sources == ["prompt", "prompt"]
    ctx += [20, 7]
    b = _round(chain, ctx)
    assert chain.order() == ["forced", "prompt", "model", "recipe"]  # prompt 2/4, the model's untried 1/2
    ctx += [7]
    _round(chain, ctx)
    assert chain.order() == ["forced", "model", "recipe", "prompt"]  # prompt 2/5 = recipe's: the configured order
    # a context that does not extend the last block's: another request, learnt afresh
    _round(chain, [4, 2, 3])
    assert chain.order() == ["forced", "recipe", "prompt", "model"] and not chain.accepted and not chain.rejected


def test_chain_yields_to_a_host_model_it_has_seen_and_fixed_order_keeps_it():
    chain = ChainDrafter([Run("forced", []), Run("prompt", [20])], learn=True)
    ctx = [1, 2]
    b = DraftBlock(ctx, None, 100, 2)
    assert chain.extend(b, 1) == 1
    b.push(30, None, "model")  # the host's draft model drafts where the chain proposed nothing (batch.BatchDrafter)
    assert b.sources == ["prompt", "model"]
    ctx += [20, 30]  # both taken: 2/3 each, the host model after the chain's own
    b = _round(chain, ctx)
    assert chain.order() == ["forced", "prompt", "model"] and b.sources == ["prompt", "prompt"]
    ctx += [5]  # prompt rejected: 2/4 against the model's 2/3
    b = _round(chain, ctx)
    assert chain.order() == ["forced", "model", "prompt"] and b.tokens == []  # the host model drafts here
    opts = {"chain_order": "fixed", "suffix_index": SuffixIndex()}
    fixed = build_chain(["forced", "suffix"], DraftContext(options=opts))
    assert isinstance(fixed, ChainDrafter) and not fixed.learn
    learnt = build_chain(["forced", "suffix"], DraftContext(options={**opts, "chain_order": "learnt"}))
    assert learnt.learn
    with pytest.raises(RequestError, match="chain_order"):
        build_chain(["forced"], DraftContext(options={"chain_order": "best"}))


class Guess:
    """A one-hot source: the masked argmax of another table's logits after the last two tokens (likely or not)."""

    name = "recipe"

    def __init__(self, table):
        self.table = table

    def extend(self, block: DraftBlock, budget: int) -> int:
        import numpy as np

        from specgrammar_plugins.masks import unpack_mask

        seq = block.sequence()
        z = self.table.logits_after(seq[-2] if len(seq) > 1 else -1, seq[-1])
        allowed = unpack_mask(block.mask(), len(z))
        return push_run(block, [int(np.argmax(np.where(allowed, z, -np.inf)))], self.name)


def _gated_chain(tok, guess, draft, params, rng, gate, sure=None):
    from specgrammar_plugins.drafters import ForcedDrafter, ModelDrafter

    return ChainDrafter([ForcedDrafter(tok.encode), Guess(guess), ModelDrafter(draft, params, rng)], gate=gate,
                        sure=sure)


@pytest.mark.parametrize("gate,sure", [(0.3, None), (None, 0.3)], ids=["one_hot_gate", "draft_arbiter"])
def test_one_hot_gate_keeps_the_target_law(toy_tok, gate, sure):
    """At T > 0 the gate (``one_hot_gate``) hands positions whose one-hot draft the draft model finds unlikely to
    the model's own sampled draft, and the arbiter (``draft_arbiter``) those where the draft model is sure of another
    token: whole outputs still follow plain constrained sampling's exact law (chi-square, p > 0.001), and one-hot
    drafts were refused that the model then drafted."""
    import zlib
    from collections import Counter

    import numpy as np

    from conftest import outputs_chi2
    from specgrammar_plugins import ConstraintSpec, SamplingParams, compile_constraint
    from specgrammar_plugins.loop import generate
    from specgrammar_plugins.testing import MarkovRunner, exact_law

    c = compile_constraint(ConstraintSpec.regex(r"(a|b|ab)(a|ba)?-[0-9]"), toy_tok, engine="dfa")
    prompt = toy_tok.encode("ab")
    params = SamplingParams(temperature=0.8)
    law = exact_law(MarkovRunner(toy_tok.vocab_size, seed=5, valid=len(toy_tok.token_bytes)), prompt, c, params, 8)
    target = MarkovRunner(toy_tok.vocab_size, seed=5, valid=len(toy_tok.token_bytes))
    draft = MarkovRunner(toy_tok.vocab_size, seed=6, noise_of=target, noise=1.5)
    guess = MarkovRunner(toy_tok.vocab_size, seed=7, noise_of=target, noise=3.0)
    rng = np.random.default_rng(zlib.crc32(b"one_hot_gate"))
    N = 3000
    seen, gated, by_source = Counter(), 0, Counter()
    for _ in range(N):
        chain = _gated_chain(toy_tok, guess, draft, params, rng, gate, sure)
        out, st = generate(target, prompt, constraint=c, drafter=chain, k=4, params=params, max_tokens=8, rng=rng)
        seen[tuple(out)] += 1
        gated += chain.gated
        by_source.update(st.drafted_by_source)
    assert gated > 0 and by_source["model"] > 0 and by_source["recipe"] > 0, (gated, by_source)
    assert set(seen) <= set(law), "the loop produced an output plain sampling cannot"
    assert outputs_chi2(law, seen, N) > 0.001


def test_one_hot_gate_option(monkeypatch):
    from specgrammar_plugins.distributions import GREEDY, SamplingParams
    from specgrammar_plugins.drafters import one_hot_gate

    monkeypatch.delenv("SPECGRAMMAR_ONE_HOT_GATE", raising=False)
    hot = SamplingParams(temperature=0.7)
    assert one_hot_gate(DraftContext(params=hot, options={"one_hot_gate": 0.2})) == 0.2
    assert one_hot_gate(DraftContext(params=GREEDY, options={"one_hot_gate": 0.2})) is None  # T = 0: off
    assert one_hot_gate(DraftContext(params=hot)) is None  # off unless asked for
    monkeypatch.setenv("SPECGRAMMAR_ONE_HOT_GATE", "0.4")
    assert one_hot_gate(DraftContext(params=hot)) == 0.4
    opts = {"suffix_index": SuffixIndex()}
    chain = build_chain(["forced", "suffix"], DraftContext(params=hot, options=opts))
    assert isinstance(chain, ChainDrafter) and chain.gate is None  # no draft model in the chain: nothing to gate
    for bad in (0, 1.5, "most", True):
        with pytest.raises(RequestError, match="one_hot_gate"):
            build_chain(["forced", "suffix"], DraftContext(params=hot, options={**opts, "one_hot_gate": bad}))


def test_draft_arbiter_at_t0_keeps_greedy_output(toy_tok):
    """At T = 0 the arbiter changes only who drafts: every output equals plain constrained greedy decoding, token for
    token, and the arbiter did overrule one-hot drafts (fewer or as many target passes is not asserted here: that is
    a benchmark figure, docs/BENCHMARKS.md)."""
    import numpy as np

    from specgrammar_plugins import ConstraintSpec, compile_constraint
    from specgrammar_plugins.distributions import GREEDY
    from specgrammar_plugins.loop import generate
    from specgrammar_plugins.testing import MarkovRunner

    c = compile_constraint(ConstraintSpec.regex(r"(a|b|ab)(a|ba)?-[0-9]{1,3}"), toy_tok, engine="dfa")
    refused = 0
    for seed in range(6):
        target = MarkovRunner(toy_tok.vocab_size, seed=seed, valid=len(toy_tok.token_bytes))
        draft = MarkovRunner(toy_tok.vocab_size, seed=seed + 10, noise_of=target, noise=0.5)
        guess = MarkovRunner(toy_tok.vocab_size, seed=seed + 20, noise_of=target, noise=3.0)
        prompt = toy_tok.encode("ab")
        plain, _ = generate(target, prompt, constraint=c, drafter=None, k=4, params=GREEDY, max_tokens=10)
        rng = np.random.default_rng(seed)
        chain = _gated_chain(toy_tok, guess, draft, GREEDY, rng, None, 0.3)
        out, _ = generate(target, prompt, constraint=c, drafter=chain, k=4, params=GREEDY, max_tokens=10, rng=rng)
        assert list(out) == list(plain), seed
        refused += chain.gated
    assert refused > 0


def test_draft_arbiter_option(monkeypatch):
    from specgrammar_plugins.distributions import GREEDY
    from specgrammar_plugins.drafters import DRAFT_ARBITER, draft_arbiter

    monkeypatch.delenv("SPECGRAMMAR_DRAFT_ARBITER", raising=False)
    assert draft_arbiter(DraftContext(params=GREEDY)) == DRAFT_ARBITER  # on by default, at every temperature
    assert draft_arbiter(DraftContext(options={"draft_arbiter": 0.5})) == 0.5
    assert draft_arbiter(DraftContext(options={"draft_arbiter": "off"})) is None
    monkeypatch.setenv("SPECGRAMMAR_DRAFT_ARBITER", "off")
    assert draft_arbiter(DraftContext()) is None
    monkeypatch.setenv("SPECGRAMMAR_DRAFT_ARBITER", "0.9")
    assert draft_arbiter(DraftContext()) == 0.9
    opts = {"suffix_index": SuffixIndex()}
    chain = build_chain(["forced", "suffix"], DraftContext(options=opts))
    assert isinstance(chain, ChainDrafter) and chain.sure is None  # no draft model in the chain: no arbiter
    for bad in (0, 1.5, "sure", True, "1e9"):
        with pytest.raises(RequestError, match="draft_arbiter"):
            build_chain(["forced", "suffix"], DraftContext(options={**opts, "draft_arbiter": bad}))


def test_a_row_that_waits_for_the_batched_draft_pass_drafts_as_alone(toy_tok):
    """``batch.draft_rows``: a row whose draft model (over a ``DraftRow``) waits for the host's batched draft pass
    drafts the same tokens from the same sources as the same chain alone, with the arbiter on: the draft model may
    be asked to judge another source's one-hot draft, and after the pass that draft is judged, not replaced by the
    model's own (the chain runs again where it waited)."""
    import numpy as np

    from specgrammar_plugins import ConstraintSpec, compile_constraint
    from specgrammar_plugins.api import DraftRow, draft_rows
    from specgrammar_plugins.distributions import GREEDY
    from specgrammar_plugins.drafters import ForcedDrafter, ModelDrafter
    from specgrammar_plugins.loop import SpeculativeLoop
    from specgrammar_plugins.testing import MarkovRunner

    V = toy_tok.vocab_size
    c = compile_constraint(ConstraintSpec.regex(r"(a|b|ab)(a|ba)?-[0-9]{1,3}"), toy_tok, engine="dfa")
    prompt = toy_tok.encode("ab")
    gated = 0
    for seed in range(8):
        target = MarkovRunner(V, seed=seed, valid=len(toy_tok.token_bytes))
        draft = MarkovRunner(V, seed=seed + 10, noise_of=target, noise=0.5)
        guess = MarkovRunner(V, seed=seed + 20, noise_of=target, noise=3.0)

        def chain(runner):
            return ChainDrafter([ForcedDrafter(toy_tok.encode), Guess(guess), ModelDrafter(runner, GREEDY,
                                 np.random.default_rng(seed))], sure=0.3)

        def loop(runner):
            return SpeculativeLoop(target, prompt, constraint=c, drafter=chain(runner), k=4, params=GREEDY,
                                   max_tokens=10)

        alone = loop(draft)
        block = alone._open()
        fill(block, alone.drafter)
        row = DraftRow(prompt[:-1], V)
        host = [list(prompt[:-1])]

        def pass_(asks):  # the host's batched draft pass: drop, feed, the logits of the last token fed
            (drop, toks), = asks.values()
            host[0] = host[0][:len(host[0]) - drop] + toks
            seq = host[0]
            return {key: draft.logits_after(seq[-2] if len(seq) > 1 else -1, seq[-1])[None] for key in asks}

        got, = draft_rows([("r", loop(row))], pass_)
        assert not isinstance(got, BaseException), got
        assert (got.tokens, got.sources) == (block.tokens, block.sources), seed
        gated += alone.drafter.gated
    assert gated > 0  # the arbiter overruled one-hot drafts on the way
