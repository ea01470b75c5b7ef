"""The workload suite: deterministic, disjoint splits, every reference answer in its constraint's language."""

from __future__ import annotations

import json
import re

import pytest

from specgrammar_plugins import ConstraintSpec
from specgrammar_plugins import workloads as W


def test_names_and_api():
    assert W.WORKLOADS == ("json_extraction", "order_id", "year", "email", "sql", "tool_call", "prose")
    assert W.chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(KeyError):
        W.examples("nope")
    with pytest.raises(ValueError):
        W.examples("year", "test")


@pytest.mark.parametrize("w", W.WORKLOADS)
def test_deterministic_and_prefix_stable(w):
    a = W.examples(w, "eval")
    W._examples.cache_clear()
    b = W.examples(w, "eval")
    assert a == b and len(a) == 50
    assert W.examples(w, "eval", 7) == a[:7]
    assert W.examples(w, "train", 10) == W.examples(w, "train")[:10]
    assert len(W.examples(w, "eval", 80)) == 80 and W.examples(w, "eval", 80)[:50] == a


@pytest.mark.parametrize("w", W.WORKLOADS)
def test_splits_disjoint(w):
    train = {e.prompt for e in W.examples(w, "train")}
    ev = {e.prompt for e in W.examples(w, "eval")}
    assert len(train) == 3000 and len(ev) == 50  # no duplicate prompts within a split
    assert not train & ev
    assert all(W.split_of(p) == "eval" for p in ev) and all(W.split_of(p) == "train" for p in train)


@pytest.mark.parametrize("w", W.WORKLOADS)
def test_one_constraint_per_workload(w):
    specs = {e.constraint for e in W.examples(w, "train")} | {e.constraint for e in W.examples(w, "eval")}
    assert specs == {W.constraint(w)}
    spec = W.constraint(w)
    assert (spec is None) == (w == "prose")
    if spec is not None:
        assert isinstance(spec, ConstraintSpec)
        assert spec.kind == {"json_extraction": "json_schema", "tool_call": "json_schema", "sql": "grammar"}.get(
            w, "regex")


def test_prompts_carry_the_values():
    for e in W.examples("json_extraction", "eval"):
        assert e.prompt.startswith("Extract the user info as JSON: ")
        obj = json.loads(e.reference)
        assert obj["name"] in e.prompt and str(obj["age"]) in e.prompt and obj["occupation"] in e.prompt
    for w in ("order_id", "year", "email"):
        assert all(e.reference in e.prompt for e in W.examples(w, "eval"))


@pytest.mark.parametrize("w", ["order_id", "year", "email"])
def test_regex_references(w):
    pattern = W.constraint(w).value
    for split in ("train", "eval"):
        for e in W.examples(w, split):
            assert re.fullmatch(pattern, e.reference), e
            assert W.is_valid(w, e.reference)


@pytest.mark.parametrize("w", ["json_extraction", "tool_call"])
def test_json_schema_references(w):
    jsonschema = pytest.importorskip("jsonschema")
    schema = W.constraint(w).schema
    validator = jsonschema.validators.validator_for(schema)(schema)
    for split in ("train", "eval"):
        for e in W.examples(w, split):
            validator.validate(json.loads(e.reference))
            assert W.is_valid(w, e.reference)
    jsonschema.validate(json.loads(W.examples(w, "eval")[0].reference), schema)
    assert not W.is_valid(w, "{}") and not W.is_valid(w, "not json")


def test_tool_call_covers_every_function():
    names = {json.loads(e.reference)["name"] for e in W.examples("tool_call", "eval")}
    assert names == {"get_weather", "search_web", "send_email", "set_timer"}


def test_sql_references_match_the_regex_twin():
    for split in ("train", "eval"):
        for e in W.examples("sql", split):
            assert W.is_valid("sql", e.reference), e
    for bad in ("SELECT name FROM users", "select * from users;", "SELECT name FROM users WHERE age > ;",
                "SELECT name, FROM users;"):
        assert not W.is_valid("sql", bad)


def _walk(matcher, tok, text: str) -> bool:
    for t in tok.encode(text):
        if not matcher.accept(t):
            return False
    return matcher.accept(tok.eos_token_id) and matcher.is_terminated()


@pytest.fixture(scope="module")
def tiny_tok():
    pytest.importorskip("tokenizers")
    from specgrammar_plugins.models import TINY_DIR, tiny_tokenizer_info

    if not (TINY_DIR / "tokenizer.json").exists():
        pytest.skip("tiny tokenizer not built")
    return tiny_tokenizer_info()


def _engine_or_skip(spec, tok, engine):
    from specgrammar_plugins import ConstraintError, compile_constraint

    try:
        return compile_constraint(spec, tok, engine=engine)
    except ConstraintError as e:
        pytest.skip(f"engine {engine} unavailable: {e}")


def test_sql_references_walk_the_gbnf_matcher(tiny_tok):
    pytest.importorskip("xgrammar")
    compiled = _engine_or_skip(W.constraint("sql"), tiny_tok, "xgrammar")
    for e in W.examples("sql", "eval") + W.examples("sql", "train", 300):
        assert _walk(compiled.matcher(), tiny_tok, e.reference), e.reference
    # the grammar and its regex twin agree on near misses
    for bad in ("SELECT name FROM users", "SELECT name FROM users WHERE age > ;", "SELECT * FROM users LIMIT x;",
                "SELECT  name FROM users;", "SELECT name FROM users ORDER BY;"):
        assert not W.is_valid("sql", bad)
        assert not _walk(compiled.matcher(), tiny_tok, bad), bad


@pytest.mark.parametrize("w", ["json_extraction", "tool_call", "order_id", "year", "email"])
def test_references_walk_the_engine_matcher(tiny_tok, w):
    spec = W.constraint(w)
    engine = "dfa" if spec.kind == "regex" else "xgrammar"
    if engine == "xgrammar":
        pytest.importorskip("xgrammar")
    compiled = _engine_or_skip(spec, tiny_tok, engine)
    for e in W.examples(w, "eval"):
        assert _walk(compiled.matcher(), tiny_tok, e.reference), e.reference


def test_training_text_ends_with_eos():
    e = W.examples("year", "train", 1)[0]
    assert W.training_text(e) == W.chat_prompt(e.prompt) + e.reference + "<|im_end|>"
