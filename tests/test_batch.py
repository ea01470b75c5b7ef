"""The batch layer (``specgrammar_plugins.batch``) without any host: a ``RequestTable`` of a few requests over the toy
tokenizer, one ``BatchDrafter`` step position by position, the host's argmax stood in for by lists.

- the plan: host drafts (forced tokens) first; a row the host chain leaves open is a model row; a row without a
  grammar makes the model draft (``known`` None); when every row's token is known the host skips its pass;
- lazy masks: only a row whose argmax the grammar refuses reaches the host's ``masked_argmax``;
- ``cuts`` counts each request's drafts and cuts what follows its real ones;
- a fault in one request's drafting (its state, its host chain) ends that request's grammar drafts alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from specgrammar_plugins.api import (BatchDrafter, ConstraintSpec, HistoryMatcher, RequestState, RequestTable,
                                     SpecOptions, Step, compile_constraint, make_drafter, mask_allows)

K = 4


class Table(RequestTable):
    """A host's table: requests are dicts {"regex": ..., "prompt_len": ...} (no regex: no grammar)."""

    def __init__(self, tok, engine="dfa"):
        self.tok, self.engine = tok, engine
        self.init_table(K, tok.vocab_size, 1024)

    def new_state(self, req, req_id=None):
        if req.get("boom"):
            raise RuntimeError("a fault reading this request")
        if "regex" not in req:
            return RequestState(None, None, req["prompt_len"], (), grammar=False)
        compiled = self.memo(("c", req["regex"]), lambda: compile_constraint(ConstraintSpec.regex(req["regex"]),
                                                                             self.tok, engine=self.engine))
        drafter = make_drafter(SpecOptions(k=K, drafters=("forced",)), self.tok)
        return RequestState(HistoryMatcher(compiled), drafter, req["prompt_len"], self.tok.stop_token_ids)


def _step(table, batch, reqs, prompt):
    rows = []
    for i, req in enumerate(reqs):
        ctx = np.asarray(prompt, dtype=np.int64)
        rows.append(batch.row(f"r{i}", req, 1, lambda ctx=ctx: ctx, K))
    return Step(rows, K)


def test_a_step_plans_host_drafts_first_then_masked_model_rows(toy_tok):
    table = Table(toy_tok)
    batch = BatchDrafter(table, toy_tok.vocab_size, refused_drafts=None, confidence=None)
    prompt = [5, 6]
    reqs = [{"regex": "hello[a-z]+", "prompt_len": 2}, {"regex": "[a-z]+", "prompt_len": 2},
            {"prompt_len": 2}]
    step = _step(table, batch, reqs, prompt)
    assert [r.st.grammar for r in step.rows] == [True, True, False]
    plan = batch.plan(step, 3)
    hello = toy_tok.encode("hello")
    assert plan.host and plan.host[0] == (0, hello[0])  # the forced prefix, from the host chain
    assert plan.model == [1] and plan.known is None  # the open row drafts by the model; the row without a grammar too
    # lazy: the model row's argmax is refused (a digit) -> only that row is masked, by the host's masked argmax
    digit = toy_tok.encode("7")[0]
    toks = [0, digit, 9]
    asked = []

    def masked_argmax(items):
        asked.append([i for i, _ in items])
        return [int(np.flatnonzero([mask_allows(row, t) for t in range(toy_tok.vocab_size)])[0]) for _, row in items]

    assert batch.lazy(plan, step.rows, toks, masked_argmax)
    assert asked == [[1]] and toks[0] == hello[0] and toks[2] == 9
    assert table.counters["draft_rows_masked"] == 1 and step.rows[1].refused == 1
    batch.advance(step, toks)
    step.pos += 1
    assert [r.real for r in step.rows] == [1, 1, 0]
    # the row without a grammar keeps the model drafting: a later position needs it
    assert batch.needs_model(step)
    cut = batch.cuts(step, K)
    assert (0, 1) in cut and (1, 1) in cut and all(i != 2 for i, _ in cut)  # no grammar: the model's k drafts
    assert table.last_drafted == {"r0": 1, "r1": 1, "r2": K}


def test_every_row_known_means_no_model_pass(toy_tok):
    table = Table(toy_tok)
    batch = BatchDrafter(table, toy_tok.vocab_size)
    step = _step(table, batch, [{"regex": "hellohello", "prompt_len": 1}] * 2, [3])
    plan = batch.plan(step, 2)
    assert plan.known is not None and not plan.model and len(plan.host) == 2
    batch.advance(step, plan.known)
    step.pos += 1
    assert not batch.needs_model(step)  # the whole string is forced: the host chain drafts all k positions
    assert batch.tails(step) == [step.rows[0].block.tokens[1:K]] * 2 and step.rows[0].real == K


def test_a_fault_stays_with_its_request(toy_tok):
    table = Table(toy_tok)
    batch = BatchDrafter(table, toy_tok.vocab_size)
    reqs = [{"regex": "hello[a-z]+", "prompt_len": 1}, {"boom": True, "prompt_len": 1},
            {"regex": "hello[a-z]+", "prompt_len": 1}]
    step = _step(table, batch, reqs, [3])
    assert step.rows[1].st is None and step.rows[1].block is None  # its state: drafts as the host's own
    assert table.counters["proposer_errors"] == 1

    class Broken:
        def extend(self, block, budget):
            raise ValueError("a fault in this request's host chain")

    step.rows[2].st.drafter = Broken()
    plan = batch.plan(step, 3)
    assert [i for i, _ in plan.host] == [0] and step.rows[2].block is None
    assert table.counters["proposer_errors"] == 2 and table._states["r2"].history is None
    assert table._states["r0"].history is not None  # the others go on


def test_request_state_follows_the_live_requests(toy_tok):
    table = Table(toy_tok)
    batch = BatchDrafter(table, toy_tok.vocab_size)
    _step(table, batch, [{"regex": "[a-z]+", "prompt_len": 1}] * 3, [3])
    assert table.num_live_requests == 3 and table.counters["requests_seen"] == 3
    assert len(table._memos) == 1  # one constraint, compiled once
    table.prune({"r1"})
    assert list(table._states) == ["r1"]


@pytest.mark.parametrize("accepted, pending, want", [(3, 2, 2), (1, 2, 0), (2, 0, None)])
def test_observe_counts_the_outcome_of_the_last_drafts(toy_tok, accepted, pending, want):
    table = Table(toy_tok)
    st = table.state("r", {"regex": "[a-z]+", "prompt_len": 0})
    st.pending = pending
    table.observe(st, accepted)
    assert st.pending == 0
    assert table.counters["accepted_tokens"] == (want or 0)
    assert table.counters["verified_rounds"] == (0 if want is None else 1)


# ---------------------------------------------------------------------------------------------- the serial loop's chain
# A host on the batch layer (vLLM) must draft what the serial loop (mlx-lm, llama-cpp-python) drafts from the same
# committed tokens, and its learning drafters must see every finished request (issue 32: vLLM earned less than mlx-lm
# from the same model-free chain: its blocks had no prompt length and nothing taught its suffix/layout indexes).
NAME = r'\{"name": "[A-Za-z ]+"\}'


class ChainTable(Table):
    """A table whose requests carry a drafter chain: {"regex", "prompt_len", "drafters", "extra"}."""

    def new_state(self, req, req_id=None):
        compiled = self.memo(("c", req["regex"]), lambda: compile_constraint(ConstraintSpec.regex(req["regex"]),
                                                                             self.tok, engine=self.engine))
        drafter = make_drafter(SpecOptions(k=K, drafters=req["drafters"], extra=req.get("extra", {})), self.tok)
        return RequestState(HistoryMatcher(compiled), drafter, req["prompt_len"], self.tok.stop_token_ids)


@pytest.fixture(scope="module")
def tiny_tok():
    from specgrammar_plugins.models import tiny_tokenizer_info

    return tiny_tokenizer_info()


def _batch_drafts(table, req_id, req, context):
    batch = BatchDrafter(table, table.tok.vocab_size)
    ctx = np.asarray(context, dtype=np.int64)
    step = Step([batch.row(req_id, req, 1, lambda: ctx, K)], K)
    batch.plan(step, 1)
    b = step.rows[0].block
    return ([], []) if b is None else (list(b.tokens), list(b.sources))


def test_a_prompt_copy_on_the_batch_layer_is_the_serial_loops(tiny_tok):
    from specgrammar_plugins.api import DraftBlock, fill

    prompt = tiny_tok.encode("Extract the user as JSON: Oscar Silva is a photographer.")
    out = tiny_tok.encode('{"name": "Os')
    req = {"regex": NAME, "prompt_len": len(prompt), "drafters": ("layout", "prompt")}
    got = _batch_drafts(ChainTable(tiny_tok), "r", req, prompt + out)
    # the serial loop's block for the same committed tokens (SpeculativeLoop._draft: prompt_len = the prompt's)
    compiled = compile_constraint(ConstraintSpec.regex(NAME), tiny_tok, engine="dfa")
    m = compiled.matcher()
    assert all(m.accept(t) for t in out)
    block = DraftBlock(prompt + out, m, tiny_tok.vocab_size, K, tiny_tok.stop_token_ids, prompt_len=len(prompt))
    fill(block, make_drafter(SpecOptions(k=K, drafters=req["drafters"]), tiny_tok))
    assert block.tokens and set(block.sources) == {"prompt"}  # "car Silva" copied from the prompt's text
    assert got == (block.tokens, block.sources)


def test_a_finished_request_teaches_the_suffix_index(tiny_tok):
    from specgrammar_plugins.recipes.suffix import SuffixIndex

    index = SuffixIndex(min_support=1)
    table = ChainTable(tiny_tok)
    prompt = tiny_tok.encode("Who took the photo?")
    answer = tiny_tok.encode('{"name": "Oscar Silva"}')
    req = {"regex": NAME, "prompt_len": len(prompt), "drafters": ("suffix",), "extra": {"suffix_index": index}}
    assert _batch_drafts(table, "r0", req, prompt + answer[:4]) == ([], [])  # nothing learnt yet
    _batch_drafts(table, "r0", req, prompt + answer)  # its last step: the whole answer committed
    table.prune(set())  # it left the host: its drafters see it
    assert index.observed == 1
    tokens, sources = _batch_drafts(table, "r1", req, prompt + answer[:4])
    assert tokens == answer[4:4 + K] and set(sources) == {"suffix"}


def test_the_memo_keeps_a_compiled_constraint_only_while_something_else_does(toy_tok):
    """Issue 33: the memo kept compiled grammars the compile cache had dropped (a 20,000-option choice, ~66 MB, in
    vLLM's EngineCore after every cache was emptied).  Now a compiled constraint is held by weak reference: a hit
    while the cache or a request holds it, compiled again once nothing does; other values (specs) are kept."""
    import gc

    class Compiled:  # (a value with memory_bytes, as CompiledConstraint)
        memory_bytes = 40

    made = []

    def make():
        made.append(Compiled())
        return made[-1]

    table = Table(toy_tok)
    held = table.memo(("compiled", 0), make)
    assert table.memo(("compiled", 0), make) is held and len(made) == 1  # held elsewhere: a hit
    del held
    made.clear()
    gc.collect()
    again = table.memo(("compiled", 0), make)
    assert len(made) == 1 and again is made[0]  # nothing held it: made again
    assert table.memo(("spec", 0), lambda: "a spec") == "a spec"
    assert table.memo(("spec", 0), lambda: "made twice") == "a spec"  # (specs are kept)


class _Run:
    """A one-hot source that drafts a fixed run of tokens, position by position (a recipe, in short)."""

    name = "recipe"

    def __init__(self, run):
        self.run = run

    def extend(self, block, budget):
        from specgrammar_plugins.drafters import push_run

        return push_run(block, self.run[len(block.tokens):][:budget], "recipe")


@pytest.mark.parametrize("sure", [0.8, 0.95])
def test_the_host_draft_models_arbiter_judges_each_host_draft_at_its_own_position(toy_tok, sure):
    """vLLM's draft model is the host's (``BatchDrafter.plan``'s ``top``): the chain pushes its run at once, the
    draft at the plan's position judged there and those after it when the draft model's logits of their position
    come (``needs_model`` asks for those passes).  Where the draft model's masked argmax is another token, held with
    at least the arbiter's probability, the block is cut back there and the position is the draft model's."""
    from specgrammar_plugins.drafters import ChainDrafter, ForcedDrafter

    compiled = compile_constraint(ConstraintSpec.regex("[a-z]+"), toy_tok, engine="dfa")
    a, b, c, d = (toy_tok.encode(x)[0] for x in "abcd")
    chain = ChainDrafter([ForcedDrafter(), _Run([a, b, c, a])], sure=sure)
    table = Table(toy_tok)
    table.new_state = lambda req, req_id=None: RequestState(HistoryMatcher(compiled), chain, 2,
                                                            toy_tok.stop_token_ids)
    batch = BatchDrafter(table, toy_tok.vocab_size, refused_drafts=None, confidence=None)
    step = _step(table, batch, [{}], [5, 6])
    row = step.rows[0]
    asked = []

    def top(i, mask):  # the draft model: sure of d at position 2 (0.9), agreeing elsewhere
        j = step.pos
        asked.append(j)
        assert i == 0 and mask_allows(mask, d)
        return (d, 0.9) if j == 2 else (row.block.tokens[j] if len(row.block.tokens) > j else a, 0.99)

    for j in range(K):
        plan = batch.plan(step, 1, top=top)
        toks = list(plan.known) if plan.known is not None else [0]
        if plan.model:
            toks = [d]  # the draft model's own argmax
            batch.lazy(plan, step.rows, toks, lambda items: [d] * len(items))
        batch.advance(step, toks)
        step.pos += 1
        if step.pos < K:
            assert batch.needs_model(step)  # the pending drafts wait for their position's logits
    assert asked == ([0, 1, 2, 2, 3] if sure == 0.8 else [0, 1, 2, 3])  # each position at its own pass
    if sure == 0.8:  # overruled at 2: cut back there (the run's 2 and 3 gone), the draft model's d, then the run's a
        assert row.block.tokens == [a, b, d, a] and row.block.sources == ["recipe", "recipe", "model", "recipe"]
        assert chain.gated == 2  # the pending draft at 2, then the run's c again, judged at 2
    else:  # not sure enough: the run stands
        assert row.block.tokens == [a, b, c, a] and chain.gated == 0
    assert row.real == K
    m = row.block.matcher  # the history's matcher followed the cut: it holds the block's tokens
    assert m._fed[-K:] == row.block.tokens


def test_a_cut_block_is_the_block_before_its_cut_drafts(toy_tok):
    """``DraftBlock.cut(j)``: the drafts from ``j`` on dropped, the matcher rolled back, the free forced count and the
    masks as they were: the same tokens, sources, room and next mask as a block that only ever got the first ``j``
    drafts (forced ones among them), and it drafts on from there as that block does."""
    import numpy as np

    from specgrammar_plugins.block import DraftBlock

    compiled = compile_constraint(ConstraintSpec.regex("ab(cd|ce)[a-z]+"), toy_tok, engine="dfa")
    a, b, c, d, e = (toy_tok.encode(x)[0] for x in "abcde")
    run = [(a, "forced"), (b, "forced"), (c, "forced"), (d, "recipe"), (a, "recipe")]

    def block(n):
        blk = DraftBlock([5, 6], compiled.matcher(), toy_tok.vocab_size, 2, free=4)
        for t, s in run[:n]:
            blk.mask()
            assert blk.push(t, None, s)
        blk.mask()
        return blk

    for j in range(len(run)):
        cut, fresh = block(len(run)), block(j)
        cut.cut(j)
        assert (cut.tokens, cut.sources, cut.matched, cut.n_free, cut.room) == \
            (fresh.tokens, fresh.sources, fresh.matched, fresh.n_free, fresh.room), j
        assert np.array_equal(cut.mask(), fresh.mask()), j
        assert cut.push(e, None, "model") == fresh.push(e, None, "model"), j
        assert cut.tokens == fresh.tokens and np.array_equal(cut.mask(), fresh.mask()), j
