"""Hostile inputs: each gets the specific error or the correct output, within a time bound."""

import time

import numpy as np
import pytest

from specgrammar_plugins import ConstraintError, ConstraintSpec, compile_constraint
from specgrammar_plugins import constraint as C
from specgrammar_plugins.constraint import allowed_ids, new_mask
from specgrammar_plugins.distributions import GREEDY
from specgrammar_plugins.drafters import ModelDrafter
from specgrammar_plugins.loop import generate
from specgrammar_plugins.testing import MarkovRunner


@pytest.fixture
def limits():
    saved = (C.LIMITS.max_constraint_bytes, C.LIMITS.compile_timeout_s, C.LIMITS.auto_try_s)
    yield C.LIMITS
    C.LIMITS.max_constraint_bytes, C.LIMITS.compile_timeout_s, C.LIMITS.auto_try_s = saved


def test_exponential_regex_compiles_under_auto_within_bound(toy_tok, limits):
    """(a|b)*a(a|b){25}: a DFA has 2^25 states. 'auto' time-boxes xgrammar and falls back to llguidance (lazy)."""
    limits.auto_try_s = 1.0
    spec = ConstraintSpec.regex("(a|b)*a(a|b){25}")
    t0 = time.perf_counter()
    c = compile_constraint(spec, toy_tok, engine="auto", cache=None)
    assert time.perf_counter() - t0 < 15
    m = c.matcher()
    a, b = toy_tok.encode("a")[0], toy_tok.encode("b")[0]
    for t in [b, a] + [a] * 25:
        assert m.accept(t)
    assert m.accept(toy_tok.eos_token_id)


def test_compile_time_limit_is_a_clear_error(toy_tok, limits):
    limits.compile_timeout_s = 0.3
    t0 = time.perf_counter()
    with pytest.raises(ConstraintError, match="compile time limit"):
        compile_constraint(ConstraintSpec.json_schema({"enum": [f"value-{i}" for i in range(30000)]}), toy_tok,
                           engine="xgrammar", cache=None)
    assert time.perf_counter() - t0 < 3


def test_size_limit(toy_tok, limits):
    limits.max_constraint_bytes = 1000
    with pytest.raises(ConstraintError, match="the limit is 1000"):
        compile_constraint(ConstraintSpec.regex("a" * 2000), toy_tok, engine="dfa", cache=None)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_schema_shapes(toy_tok, engine):
    t0 = time.perf_counter()
    with pytest.raises(ConstraintError, match="matches no string"):  # $ref cycle with nothing to produce
        compile_constraint(ConstraintSpec.json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                       "$ref": "#/$defs/a"}), toy_tok, engine=engine, cache=None)
    compile_constraint(ConstraintSpec.json_schema({"type": "object", "properties": {"child": {"$ref": "#"}}}), toy_tok,
                       engine=engine, cache=None)  # recursive: fine
    deep = {"type": "integer"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    c = compile_constraint(ConstraintSpec.json_schema(deep), toy_tok, engine=engine, cache=None)
    m = c.matcher()
    text = '{"a":' * 60 + "1" + "}" * 60
    assert all(m.accept(t) for t in toy_tok.encode(text)) and m.accept(toy_tok.eos_token_id)
    assert time.perf_counter() - t0 < 30


def test_huge_enum_with_the_policy(toy_tok):
    t0 = time.perf_counter()
    c = compile_constraint(ConstraintSpec.json_schema({"enum": [f"v{i}" for i in range(20000)]}), toy_tok,
                           engine="auto", cache=None)
    assert c.engine == "llguidance" and time.perf_counter() - t0 < 10


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_grammar_of_only_the_empty_string(toy_tok, engine):
    c = compile_constraint(ConstraintSpec.grammar('root ::= ""'), toy_tok, engine=engine, cache=None)
    out, st = generate(MarkovRunner(toy_tok.vocab_size, valid=len(toy_tok.token_bytes)), [1], constraint=c,
                       params=GREEDY, max_tokens=5, seed=0)
    assert out == [toy_tok.eos_token_id] and st.finish_reason == "stop"


@pytest.mark.parametrize("engine", ["dfa", "xgrammar", "llguidance"])
def test_partial_utf8_tokens(toy_tok, engine):
    """Byte-level tokens that split a character: a lead byte may start 'é', a lone continuation byte never."""
    c = compile_constraint(ConstraintSpec.regex("é+"), toy_tok, engine=engine, cache=None)
    m = c.matcher()
    row = new_mask(toy_tok.vocab_size)
    m.fill_mask(row)
    ids = set(allowed_ids(row, toy_tok.vocab_size).tolist())
    lead, cont, full = (toy_tok.token_bytes.index(b) for b in (b"\xc3", b"\xa9", b"\xc3\xa9"))
    assert lead in ids and full in ids and cont not in ids
    assert m.accept(lead)
    m.fill_mask(row)
    assert set(allowed_ids(row, toy_tok.vocab_size).tolist()) == {cont}


def test_draft_eos_where_grammar_is_incomplete(toy_tok):
    """A draft model that loves EOS: grammar-aware drafting never proposes it before the grammar can end, and the
    output is complete and valid."""

    class EOSLover(MarkovRunner):
        def logits_after(self, a, b):
            z = super().logits_after(a, b)
            z[0] = 50.0
            return z

    c = compile_constraint(ConstraintSpec.regex("[0-9]{5}"), toy_tok, engine="xgrammar")
    target = MarkovRunner(toy_tok.vocab_size, seed=1, valid=len(toy_tok.token_bytes))
    rng = np.random.default_rng(0)
    out, st = generate(target, [1], constraint=c, drafter=ModelDrafter(EOSLover(toy_tok.vocab_size, seed=2), GREEDY, rng),
                       k=4, params=GREEDY, max_tokens=10, rng=rng)
    text = toy_tok.decode(out[:-1])
    assert out[-1] == 0 and len(text) == 5 and text.isdigit()
    assert 0 not in out[:-1]
