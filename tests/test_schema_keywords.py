"""Nothing silently ignored: for every JSON Schema validation keyword and every engine, generated instances that
violate only that keyword (valid once the keyword is removed, invalid with it: jsonschema decides) must be rejected by
the compiled grammar, or strict mode must refuse the schema (naming a keyword and its JSON pointer when the refusal
is ours).  An instance counts as accepted if its compact or spaced serialization is accepted token by token and the
matcher can then end.  Engines run on the bundled tiny model's byte-level tokenizer (no shared data needed)."""

import copy

import pytest
from jsonschema import Draft202012Validator

from schema_instances import format_checker, instances, oracle
from specgrammar_plugins import ConstraintError, ConstraintSpec, compile_constraint
from specgrammar_plugins.bench.coverage import accepts, serializations
from specgrammar_plugins.schema import VALIDATION, walk

FORMAT_SAMPLES = {
    "date-time": ["2024-02-29T12:00:00Z", "2024-02-29T12:00:00+01:00", "2024-13-01T00:00:00Z", "2024-02-29 12:00",
                  "2024-02-29T25:00:00Z", "x", "2023-02-29T12:00:00Z", "2024-04-31T12:00:00Z",
                  "2024-01-01T12:00:60Z", "2024-01-01t12:00:00z", "2024-01-01T12:00:00.5-23:59"],
    "date": ["2024-02-29", "2023-02-29", "2024-1-01", "24-01-01", "2024-01-32", "1900-02-29", "2000-02-29",
             "2024-06-31", "0000-01-01"],
    "time": ["12:00:00Z", "23:59:59+02:00", "24:00:00Z", "12:00", "12:00:00", "12:00:60Z", "12:00:00.123z"],
    "email": ["a@b.co", "a.b@c.de", "a@", "@b.c", "a b@c.d", "ab"],
    "hostname": ["example.com", "a-b.c", "-a.com", "a..b", "a_b.com", "a" * 64 + ".com"],
    "ipv4": ["1.2.3.4", "255.255.255.255", "256.1.1.1", "1.2.3", "01.2.3.4"],
    "ipv6": ["::1", "2001:db8::1", "1::2::3", "12345::", "::g"],
    "uuid": ["123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456"],
    "uri": ["http://a.b/c?d#e", "urn:x:y", "a:b", "//a/b", "http://a b", "1a:b", "/rel/path"],
    "uri-reference": ["http://a.b/c", "/rel/path", "a b", "#frag"],
    "duration": ["P1Y2M", "PT1H", "P", "P1H", "1Y"],
}

DRAFT7 = "http://json-schema.org/draft-07/schema#"  # for the keywords 2020-12 no longer has
# (keyword, schema holding it exactly once, seed values for the instance generator)
PROBES = [
    ("type", {"type": "integer"}, []),
    ("type", {"type": ["string", "null"]}, []),
    ("enum", {"enum": ["a", 1, None, [1]]}, []),
    ("const", {"const": {"a": 1}}, [{"a": 1}, {"a": 2}]),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, []),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, [1.5, 1.25]),
    ("minimum", {"type": "integer", "minimum": 2}, []),
    ("minimum", {"minimum": 2}, []),
    ("maximum", {"type": "number", "maximum": 2.5}, []),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 2}, []),
    ("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 2}, []),
    ("minLength", {"type": "string", "minLength": 2}, []),
    ("maxLength", {"type": "string", "maxLength": 2}, []),
    ("minLength", {"type": "string", "pattern": "^[a-z]*$", "minLength": 3}, ["ab", "abc", "abcd"]),
    ("maxLength", {"type": "string", "pattern": "^[a-z]*$", "maxLength": 2}, ["ab", "abc"]),
    ("pattern", {"type": "string", "pattern": "^a+b?$"}, ["a", "aab", "ba", "abb"]),
    ("pattern", {"pattern": "^a+$"}, ["a", "b"]),
    ("pattern", {"type": "string", "pattern": "^[0-9](x[0-9]+)?Z$"}, ["0Z", "0x5Z", "01Z", "0xZ"]),
    ("type", {"type": "object", "enum": ["a", {"x": 1}]}, []),
    ("maxItems", {"type": "array", "maxItems": 2}, []),
    ("minItems", {"type": "array", "minItems": 2}, []),
    ("minItems", {"minItems": 2}, []),
    ("uniqueItems", {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}, [[1, 1], [1, 2]]),
    ("contains", {"type": "array", "contains": {"const": 1}}, [[1], [2], [2, 1]]),
    ("minContains", {"type": "array", "contains": {"const": 1}, "minContains": 2}, [[1, 1], [1, 2]]),
    ("maxContains", {"type": "array", "contains": {"const": 1}, "maxContains": 1}, [[1, 1], [1, 2]]),
    ("minProperties", {"type": "object", "minProperties": 2}, [{"a": 1}]),
    ("minProperties", {"type": "object", "minProperties": 1}, [{}]),
    ("minProperties", {"type": "object", "properties": {"a": {}, "b": {}, "x1": {}}, "additionalProperties": False,
                       "minProperties": 2}, []),
    ("maxProperties", {"type": "object", "maxProperties": 1}, [{"a": 1, "b": 2}]),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, []),
    # bounds past 2^53, where doubles skip integers (llguidance 1.7.6 took 2^62 for each of these)
    ("maximum", {"type": "integer", "maximum": 2 ** 62 - 1}, [2 ** 62 - 1, 2 ** 62, 2 ** 62 + 1]),
    ("minimum", {"type": "integer", "minimum": -(2 ** 62) + 1}, [-(2 ** 62) + 1, -(2 ** 62), -(2 ** 62) - 1]),
    ("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 2 ** 62}, [2 ** 62 - 1, 2 ** 62]),
    # a required key properties does not list (xgrammar 0.2.8 and outlines-core 0.2.14 took {})
    ("required", {"type": "object", "required": ["foo"]}, [{}, {"foo": 1}, {"bar": 2}]),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["foo"]},
     [{"a": 1}, {"a": 1, "foo": 2}]),
    ("dependentRequired", {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
     [{"a": 1}]),
    ("dependentSchemas", {"type": "object", "properties": {"a": {}, "b": {}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, [{"a": 1}]),
    ("dependencies", {"$schema": DRAFT7, "type": "object", "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}}, [{"a": 1}]),
    ("properties", {"type": "object", "properties": {"a": {"type": "string"}}}, [{"a": 1}]),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
     [{"x1": "s"}, {"x1": 1}]),
    ("additionalProperties", {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
     [{"b": "s"}]),
    ("additionalProperties", {"type": "object", "properties": {"a": {}}, "additionalProperties": False}, [{"b": 1}]),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 1}}, [{"ab": 1}]),
    ("items", {"type": "array", "items": {"type": "integer"}}, [[1, "a"]]),
    ("items", {"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}]}, [["a"], [1, "a"]]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, [[1, 2], ["a"]]),
    ("additionalItems", {"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}],
                         "additionalItems": {"type": "string"}},
     [[1, 2], [1, "a"]]),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
     [{"b": 1}]),
    ("unevaluatedItems", {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
     [[1, 2]]),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, []),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}, []),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"minimum": 2}]}, []),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, []),
    ("oneOf", {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, [{"a": 1, "b": 1}]),
    ("not", {"not": {"type": "string"}}, []),
    ("not", {"type": "integer", "not": {"const": 3}}, []),
    ("not", {"type": "object", "not": {"required": ["a"]}}, [{"a": 1}]),
    ("if", {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}}, []),
    ("$ref", {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
     [{"a": "s"}]),
    ("$dynamicRef", {"$dynamicAnchor": "n", "type": "array", "items": {"$dynamicRef": "#n"}}, [[[1]]]),
    ("contentMediaType", {"type": "string", "contentMediaType": "application/json"}, ["{}", "x"]),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, ["eA==", "!"]),
] + [("format", {"type": "string", "format": f}, v) for f, v in FORMAT_SAMPLES.items()] + [
    ("format", {"type": "integer", "format": "int32"}, [2 ** 31 - 1, 2 ** 31]),
    ("format", {"type": ["integer", "null"], "format": "uint8"}, [255, 256, -1]),
]

ENGINES = ["llguidance", "xgrammar", "outlines_core"]


def _without(schema: dict, keyword: str) -> dict:
    """The schema with its one ``keyword`` removed (then/else go with if)."""
    out = copy.deepcopy(schema)
    owners = [owner for kw, _, _, owner in walk(out) if kw == keyword]
    assert len(owners) == 1, (keyword, schema)
    owner = owners[0]
    for k in (keyword, "then", "else") if keyword == "if" else (keyword,):
        owner.pop(k, None)
    if keyword == "contains":
        owner.pop("minContains", None)
        owner.pop("maxContains", None)
    return out


@pytest.fixture(scope="module")
def tiny():
    from specgrammar_plugins.models import tiny_tokenizer_info

    return tiny_tokenizer_info()


def test_every_validation_keyword_has_a_probe():
    assert {k for k, *_ in PROBES} >= VALIDATION - {"$recursiveRef", "then", "else"}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("keyword,schema,seeds", PROBES,
                         ids=[f"{k}-{i}" for i, (k, *_) in enumerate(PROBES)])
def test_instances_violating_only_one_keyword_are_rejected(engine, keyword, schema, seeds, tiny, monkeypatch):
    from specgrammar_plugins.compiler import LIMITS

    # outlines-core turns some schemas into regexes whose index takes minutes: give up early, in a killable process
    monkeypatch.setattr(LIMITS, "compile_timeout_s", 8.0)
    monkeypatch.setattr(LIMITS, "compile_isolation", "process")
    relaxed = _without(schema, keyword)
    full_ok, relaxed_ok = oracle(schema), oracle(relaxed)
    pool = instances(schema, 250, seed=3, extra=seeds)
    violating = [x for x in pool if relaxed_ok(x) and not full_ok(x)]
    valid = [x for x in pool if full_ok(x)]
    # what jsonschema cannot judge must be refused: 2020-12's annotations, formats it has no checker for here
    annotation = keyword in ("contentMediaType", "contentEncoding") or (
        keyword == "format" and schema["format"] not in format_checker(Draft202012Validator).checkers)
    assert violating or annotation, f"no generated instance violates only {keyword}"
    try:
        c = compile_constraint(ConstraintSpec.json_schema(schema), tiny, engine=engine, cache=None)
    except ConstraintError as e:
        # refused: fine (nothing silently ignored); ours names the keyword's JSON pointer
        assert e.reason
        if "is not enforced by" in e.reason:
            assert " at /" in e.reason, e.reason
        return
    assert not annotation, f"{engine} compiled {schema}, which jsonschema cannot hold it to"

    def accepted(x) -> bool:
        return any(accepts(c, tiny, s) for s in serializations(x, schema))

    wrong = [x for x in violating if accepted(x)]
    assert not wrong, f"{engine} accepts instances violating only {keyword}: {wrong[:5]}"
    assert any(accepted(x) for x in valid[:40]), f"{engine} accepts no valid instance of {schema}"


def test_xgrammar_warnings_about_ignored_keywords_are_refusals(tiny, capfd):
    """What xgrammar logs it ignores (from C++, on stderr) is refused in strict mode even where schema.py's table
    would let it through: the engine is called directly here, past the table."""
    pytest.importorskip("xgrammar")
    from specgrammar_plugins.engines.xgrammar_engine import XGrammarEngine

    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^a+$", "maxLength": 3}}}
    with pytest.raises(ConstraintError) as e:
        XGrammarEngine().compile(ConstraintSpec.json_schema(schema), tiny, {})
    assert "'maxLength' at /properties/code/maxLength is not enforced by xgrammar" in e.value.reason
    assert "ignoring minLength/maxLength" in e.value.reason
    # strict off: compiled, and the warning is still shown (written back to stderr)
    c = XGrammarEngine().compile(ConstraintSpec.json_schema(schema, options=(("strict", False),)), tiny, {})
    assert c.engine == "xgrammar"
    assert "ignoring minLength/maxLength" in capfd.readouterr().err


def test_xgrammar_gets_no_property_that_must_be_absent(tiny):
    """xgrammar 0.2.8 fails to compile ``{"properties": {key: false}}`` ("Schema 'false' cannot accept any value"),
    the form our exact rewrites of ``dependentRequired``/``dependentSchemas`` and ``not required`` produce: for it
    they are not rewritten, so strict mode names the keyword it does not enforce and ``strict: false`` compiles
    the schema as vLLM's own xgrammar backend does (ignoring it); a user's own ``false`` property is refused by name.
    (Before, both raised the engine's error: 2 of 100 dev-split schemas in ``bench real`` ran on vLLM unbudgeted.)"""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
              "dependentRequired": {"a": ["b"]}}
    with pytest.raises(ConstraintError) as e:
        compile_constraint(ConstraintSpec.json_schema(schema), tiny, engine="xgrammar", cache=None)
    assert "'dependentRequired' at /dependentRequired is not enforced by xgrammar" in e.value.reason, e.value.reason
    lenient = ConstraintSpec.json_schema(schema, options=(("strict", False),))
    assert compile_constraint(lenient, tiny, engine="xgrammar", cache=None).engine == "xgrammar"
    # the rewrite still serves the engines that take it
    c = compile_constraint(ConstraintSpec.json_schema(schema), tiny, engine="llguidance", cache=None)
    assert accepts(c, tiny, '{"a":"x","b":"y"}') and not accepts(c, tiny, '{"a":"x"}')
    absent = {"type": "object", "properties": {"a": False}}
    with pytest.raises(ConstraintError) as e:
        compile_constraint(ConstraintSpec.json_schema(absent), tiny, engine="xgrammar", cache=None)
    assert "a property that must be absent" in e.value.reason, e.value.reason
