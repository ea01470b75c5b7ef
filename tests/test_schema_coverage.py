"""JSON Schema coverage: strict mode names unsupported keywords with their JSON pointer; on the official
JSON-Schema-Test-Suite and a MaskBench sample, no schema we compile accepts an invalid instance."""

import json

import pytest

from conftest import SHARED_DATA, needs_shared_data
from specgrammar_plugins import ConstraintError, ConstraintSpec, compile_constraint
from specgrammar_plugins.schema import check_schema


def test_strict_mode_names_keyword_and_pointer(toy_tok):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True,
                                                        "description": "ignored annotation", "x-ui": 1}}}
    for engine in ("xgrammar", "llguidance"):
        with pytest.raises(ConstraintError) as e:
            compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine=engine)
        assert "'uniqueItems' at /properties/tags/uniqueItems" in str(e.value)
    # not strict: the engine decides (xgrammar ignores uniqueItems; llguidance refuses it itself)
    compile_constraint(ConstraintSpec.json_schema(schema, options=(("strict", False),)), toy_tok, engine="xgrammar")
    with pytest.raises(ConstraintError, match="uniqueItems"):
        compile_constraint(ConstraintSpec.json_schema(schema, options=(("strict", False),)), toy_tok,
                           engine="llguidance")
    with pytest.raises(ConstraintError, match="format: ipv7"):
        compile_constraint(ConstraintSpec.json_schema({"type": "string", "format": "ipv7"}), toy_tok,
                           engine="llguidance")
    rep = check_schema({"title": "t", "type": "integer", "minimum": 0, "x-foo": 1, "examples": [1]}, "xgrammar")
    assert rep.ok and rep.enforced == {"type", "minimum"} and {"title", "examples"} <= rep.ignored
    with pytest.raises(ConstraintError, match="allOf"):
        compile_constraint(ConstraintSpec.json_schema({"allOf": [{"type": "integer"}, {"minimum": 3}]}), toy_tok,
                           engine="xgrammar")


def test_policy_picks_a_fast_engine_and_falls_back(toy_tok):
    c = compile_constraint(ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
                           toy_tok, engine="auto")
    assert c.engine == "llguidance"
    assert compile_constraint(ConstraintSpec.regex("[0-9]{4}"), toy_tok, engine="auto").engine == "xgrammar"
    assert compile_constraint(ConstraintSpec.grammar('root ::= "a" | "b"'), toy_tok, engine="auto").engine == "llguidance"
    with pytest.raises(ConstraintError) as e:
        compile_constraint(ConstraintSpec.json_schema({"type": "string", "not": {"const": "x"}}), toy_tok, engine="auto")
    assert "'not'" in str(e.value)


SUITE_FILES = ["type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
               "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "ref", "defs", "pattern", "minLength",
               "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "format", "uniqueItems",
               "not", "if-then-else", "multipleOf", "boolean_schema"]


@pytest.fixture(scope="module")
def qwen():
    from conftest import QWEN_TOKENIZER
    from specgrammar_plugins import TokenizerInfo

    if not QWEN_TOKENIZER.exists():
        pytest.skip("../shared/data Qwen2.5 tokenizer absent")
    return TokenizerInfo.from_file(QWEN_TOKENIZER, vocab_size=151936, eos_token="<|im_end|>")


@pytest.mark.parametrize("engine", ["auto", "xgrammar"])
def test_json_schema_test_suite(qwen, engine):
    """Draft 2020-12 official tests for the generation keywords: every schema we compile rejects every invalid
    instance (zero false accepts); what we refuse names a keyword.  Counts are printed for the report."""
    from specgrammar_plugins.bench.coverage import accepts, serializations

    base = needs_shared_data("json-schema-test-suite", "tests", "draft2020-12")
    compiled = refused = valid = valid_ok = invalid = 0
    false_accepts = []
    for name in SUITE_FILES:
        for group in json.loads((base / f"{name}.json").read_text()):
            schema = group["schema"]
            if not isinstance(schema, dict) or any(isinstance(v, str) and "http" in v and k == "$ref"
                                                   for k, v in schema.items()):
                continue
            try:
                c = compile_constraint(ConstraintSpec.json_schema(schema), qwen, engine=engine, cache=None)
            except ConstraintError as e:
                refused += 1
                continue
            compiled += 1
            for t in group["tests"]:
                verdicts = [accepts(c, qwen, s) for s in serializations(t["data"], schema)]
                if all(v is None for v in verdicts):
                    continue  # the tokenizer cannot spell this instance exactly (NFC normalization)
                ok = any(verdicts)
                if t["valid"]:
                    valid += 1
                    valid_ok += ok
                else:
                    invalid += 1
                    if ok:
                        false_accepts.append((name, group["description"], t["description"]))
    print(f"\n[{engine}] JSON-Schema-Test-Suite: compiled {compiled}, refused {refused}; valid accepted "
          f"{valid_ok}/{valid}; invalid accepted {len(false_accepts)}/{invalid}")
    assert compiled > 50
    assert not false_accepts, false_accepts[:40]


def test_maskbench_sample_no_invalid_accepted(qwen):
    """A fixed 1-in-60 sample of the MaskBench dev schemas: the policy covers at least what the best single engine
    covers, and no compiled schema accepts an invalid instance.  (Full corpus: `specgrammar bench coverage`.)"""
    from specgrammar_plugins.bench.coverage import evaluate, schema_files

    needs_shared_data("jsonschemabench", "dev")
    files = schema_files(limit=None, seed_stride=60)
    res = evaluate(files, ["llguidance", "auto"], qwen)
    print({e: {k: v for k, v in r.items() if k != "violations"} for e, r in res.items()})
    for e, r in res.items():
        assert r["violations"] == [], (e, r["violations"][:5])
    assert res["auto"]["compiled"] >= res["llguidance"]["compiled"]
    assert res["auto"]["compiled"] >= 0.6 * res["auto"]["schemas"]
