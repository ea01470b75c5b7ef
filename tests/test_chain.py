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
