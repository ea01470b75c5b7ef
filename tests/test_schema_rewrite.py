"""Exact JSON Schema rewrites (schema_rewrite.py): each held against jsonschema on generated instances (the
original read with its own draft, the rewrite with 2020-12: same verdict on every instance, valid and invalid ones
both seen), reported with the pointer where the keyword was written, and refused by strict mode where no exact
rewrite exists."""

import json

import pytest

from conftest import needs_shared_data
from schema_instances import instances, oracle
from specgrammar_plugins import ConstraintError, ConstraintSpec, compile_constraint
from specgrammar_plugins.schema import ENFORCED, walk
from specgrammar_plugins.schema_rewrite import rewrite

# (name, schema, the keyword whose rewrite is expected, the original's draft or None for its own/2020-12, seeds)
CASES = [
    ("oneOf by type", {"oneOf": [{"type": "string"}, {"type": "integer", "minimum": 3}, {"type": "null"}]},
     "oneOf", None, []),
    ("oneOf overlapping, every branch negates", {"oneOf": [{"type": "number"}, {"type": "string"}, {"minimum": 2}]},
     "oneOf", None, []),
    ("oneOf by enum", {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["c", 1]}, {"const": None}]}, "oneOf", None, []),
    ("oneOf discriminator", {"type": "object", "oneOf": [
        {"properties": {"kind": {"const": "circle"}, "r": {"type": "number"}}, "required": ["kind", "r"]},
        {"properties": {"kind": {"const": "square"}, "side": {"type": "number"}}, "required": ["kind"]}]},
     "oneOf", None, [{"kind": "circle", "r": 1}, {"kind": "square", "side": 2}, {"kind": "circle"}]),
    ("oneOf discriminator through $ref, typeless branches", {
        "$defs": {"c": {"properties": {"kind": {"enum": ["c"]}}, "required": ["kind"]},
                  "s": {"properties": {"kind": {"enum": ["s"]}, "n": {"type": "integer"}}, "required": ["kind", "n"]}},
        "oneOf": [{"$ref": "#/$defs/c"}, {"$ref": "#/$defs/s"}]},
     "oneOf", None, [{"kind": "c"}, {"kind": "s", "n": 1}, {"kind": "s"}, "c"]),
    ("oneOf of required sets (overlapping: each branch excludes the others)",
     {"oneOf": [{"required": ["a"]}, {"required": ["b", "c"]}, {"required": ["x1"]}]},
     "oneOf", None, [{"a": 1}, {"a": 1, "b": 2}, {"b": 1, "c": 2}, {"a": 1, "b": 1, "c": 1}, 3]),
    ("oneOf key forbidden by the other branch", {"type": "object", "oneOf": [
        {"properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
        {"properties": {"b": {}}, "additionalProperties": False}]}, "oneOf", None, [{"a": 1}, {}, {"b": 1}]),
    ("format int32", {"type": ["integer", "null"], "format": "int32", "minimum": -5}, "format", None,
     [2 ** 31 - 1, 2 ** 31, -5, -6, 7.0, 7.5]),
    ("format uint8 on number", {"type": "number", "format": "uint8"}, "format", None, [255, 256, 0, -1, 1.5]),
    ("format int64", {"type": "integer", "format": "int64"}, "format", None, [2 ** 63 - 1, 2 ** 63, -2 ** 63]),
    ("items array + additionalItems", {"type": "array", "items": [{"type": "integer"}, {"type": "string"}],
                                       "additionalItems": {"type": "boolean"}}, "items", "draft7",
     [[1, "a", True], [1, "a", 2], [1], ["a"]]),
    ("items array, no more items", {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
     "items", "draft7", [[1], [1, 2], []]),
    ("additionalItems without an items array", {"type": "array", "items": {"type": "integer"},
                                                "additionalItems": False}, "additionalItems", "draft7", [[1, 2]]),
    ("dependencies", {"type": "object", "dependencies": {"a": ["b"], "x1": {"required": ["zz"]}}}, "dependencies",
     "draft7", [{"a": 1}, {"a": 1, "b": 2}, {"x1": 1}, {"x1": 1, "zz": 0}]),
    ("dependentRequired, dependentSchemas", {"dependentRequired": {"a": ["b"]},
                                             "dependentSchemas": {"b": {"properties": {"a": {"type": "integer"}}}}},
     "dependentRequired", None, [{"a": 1, "b": 2}, {"a": "s", "b": 1}, {"b": 1}]),
    ("definitions", {"definitions": {"n": {"type": "integer", "maximum": 3}},
                     "properties": {"a": {"$ref": "#/definitions/n"}}}, "definitions", None, [{"a": 3}, {"a": 4}]),
    ("draft-04 exclusiveMinimum", {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number",
                                   "minimum": 2, "exclusiveMinimum": True, "maximum": 5, "exclusiveMaximum": False},
     "exclusiveMinimum", "draft4", [2, 2.001, 5, 5.5]),
    ("draft-07 $ref siblings", {"$schema": "http://json-schema.org/draft-07/schema#",
                                "definitions": {"s": {"type": "string"}},
                                "properties": {"a": {"$ref": "#/definitions/s", "maxLength": 1}}},
     "$ref", "draft7", [{"a": "abc"}, {"a": 1}]),
    ("not type", {"not": {"type": ["string", "number"]}}, "not", None, []),
    ("not type with siblings", {"type": ["integer", "string", "null"], "not": {"type": "integer"}}, "not", None, []),
    ("not const in a finite domain", {"type": "boolean", "not": {"const": True}}, "not", None, []),
    ("not enum in a sibling enum", {"enum": ["a", "b", 3, None], "not": {"enum": ["b", None]}}, "not", None, []),
    ("not enum of booleans and null (infinite rest allowed)", {"not": {"enum": [True, None]}}, "not", None, []),
    ("not required", {"not": {"required": ["a", "b"]}}, "not", None, [{"a": 1}, {"a": 1, "b": 2}, {}, "s"]),
    ("not minimum", {"not": {"minimum": 2}}, "not", None, [1.99, 2, "s"]),
    ("not maxLength / minItems", {"not": {"allOf": [{"maxLength": 2}, {"minItems": 1}]}}, "not", None,
     ["abc", "ab", [], [1]]),
    ("not allOf of required (De Morgan)", {"type": "object", "not": {"allOf": [{"required": ["a"]},
                                                                              {"required": ["b"]}]}},
     "not", None, [{"a": 1, "b": 1}, {"a": 1}]),
    ("not properties", {"not": {"properties": {"a": {"type": "string"}, "b": False}}}, "not", None,
     [{"a": "s"}, {"a": 1}, {"b": 1}, {}]),
    ("not not", {"type": "integer", "not": {"not": {"minimum": 3}}}, "not", None, []),
    ("if/then/else", {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}}, "if", None,
     []),
    ("if without else", {"if": {"properties": {"a": {"const": True}}, "required": ["a"]},
                         "then": {"required": ["b"]}}, "if", None, [{"a": True}, {"a": True, "b": 0}, {"a": 2}]),
    ("if without then", {"if": {"type": "integer"}, "else": {"type": "string"}}, "if", None, []),
    ("minProperties on a finite set", {"type": "object", "properties": {"a": {}, "b": {}, "x1": {}},
                                       "required": ["a"], "additionalProperties": False, "minProperties": 2},
     "minProperties", None, [{"a": 1}, {"a": 1, "b": 2}]),
    ("maxProperties on a finite set", {"properties": {"a": {}, "b": {}, "x1": {}},
                                       "additionalProperties": False, "maxProperties": 1},
     "maxProperties", None, [{"a": 1}, {"a": 1, "b": 2}, {}]),
    ("finite domain from an allOf member", {"allOf": [{"enum": [1, 2, 3.5, "a", "bb", {"x": 1}, [1, 1]]},
                                                      {"not": {"type": "integer", "multipleOf": 2}},
                                                      {"oneOf": [{"type": "string"}, {"maxLength": 1}]}]},
     "not", None, []),
    ("enum beside a type some values lack", {"type": ["object", "null"], "enum": ["A", None, {"a": 1}, 2]}, "type",
     None, []),
    ("uniqueItems with at most one item", {"type": "array", "maxItems": 1, "uniqueItems": True}, "uniqueItems",
     None, [[1], [1, 1]]),
]


@pytest.mark.parametrize("name,schema,keyword,draft,seeds", CASES, ids=[c[0] for c in CASES])
def test_rewrite_is_exact_against_jsonschema(name, schema, keyword, draft, seeds):
    before = json.dumps(schema, sort_keys=True)
    rw = rewrite(schema)
    assert json.dumps(schema, sort_keys=True) == before  # the caller's schema is not changed
    assert keyword in {r.keyword for r in rw.rewrites}, (rw.rewrites, rw.schema)
    if keyword not in ("$ref", "items", "exclusiveMinimum"):  # these stay, in their 2020-12 meaning
        assert f'"{keyword}"' not in json.dumps(rw.schema), rw.schema
    original, rewritten = oracle(schema, draft), oracle(rw.schema, "2020-12")
    seen = {True: 0, False: 0}
    for inst in instances(schema, 400, seed=1, extra=seeds):
        v = original(inst)
        assert rewritten(inst) == v, (inst, v, rw.schema)
        seen[v] += 1
    assert seen[True] and seen[False], seen  # the check could have failed both ways
    assert rewrite(rw.schema).rewrites == ()  # rewriting twice changes nothing more


@pytest.mark.parametrize("schema", [
    {"not": {"type": "integer"}},  # non-integer numbers have no positive spelling
    {"type": "string", "not": {"const": "x"}},  # infinitely many other strings
    {"not": {"pattern": "^a"}},
    {"oneOf": [{"type": "integer"}, {"minimum": 2}]},  # overlapping, and "not an integer" has no spelling
    {"if": {"pattern": "^a"}, "then": {"minLength": 2}, "else": {"maxLength": 1}},
    {"type": "object", "minProperties": 2},  # the property set is not finite
    {"type": "string", "format": "int64"},  # a string holding an integer: not the integer widths
])
def test_no_exact_rewrite_stays_refused_with_its_pointer(schema, toy_tok):
    spec = ConstraintSpec.json_schema({"type": "object", "properties": {"p": schema}})
    for engine in ("llguidance", "xgrammar"):
        with pytest.raises(ConstraintError) as e:
            compile_constraint(spec, toy_tok, engine=engine, cache=None)
        assert "at /properties/p/" in str(e.value), str(e.value)


def test_what_a_ref_points_into_stays_where_it_is():
    schema = {"properties": {"a": {"not": {"not": {"type": "string"}}}, "b": {"$ref": "#/properties/a/not/not"},
                             "c": {"not": {"not": {"type": "string"}}}}}
    rw = rewrite(schema)
    assert [str(r) for r in rw.rewrites] == ["not at /properties/c/not/not -> its positive form",
                                             "not at /properties/c/not -> its positive form"]
    assert rw.schema["properties"]["a"] == schema["properties"]["a"]
    assert rw.schema["properties"]["c"] == {"type": "string"}


def test_pointers_are_those_of_the_schema_as_given(toy_tok):
    schema = {"$schema": "http://json-schema.org/draft-04/schema#",
              "definitions": {"tags": {"type": "array", "items": [{"type": "string"}], "additionalItems": False,
                                       "uniqueItems": True}},
              "type": "object", "properties": {"t": {"$ref": "#/definitions/tags"}},
              "dependencies": {"t": {"properties": {"u": {"type": "array", "uniqueItems": True}}}}}
    rw = rewrite(schema)
    assert "$defs" in rw.schema and "prefixItems" in rw.schema["$defs"]["tags"]
    for engine in ("llguidance", "xgrammar"):
        with pytest.raises(ConstraintError) as e:
            compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine=engine, cache=None)
        assert "'uniqueItems' at /definitions/tags/uniqueItems is not enforced" in str(e.value)
        assert " more)" in str(e.value)  # /dependencies/t/properties/u/uniqueItems (xgrammar: and more)


def test_compiled_constraint_lists_its_rewrites(toy_tok):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "format": "int32"},
                                               "k": {"oneOf": [{"type": "string"}, {"type": "null"}]}}}
    c = compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine="llguidance", cache=None)
    assert [str(r) for r in c.rewrites] == [
        "format at /properties/n/format -> type integer, minimum -2147483648, maximum 2147483647 (int32)",
        "oneOf at /properties/k/oneOf -> anyOf (branches pairwise disjoint)"]
    assert "oneOf" not in c.spec.value and "anyOf" in c.spec.value
    with pytest.raises(ConstraintError, match="format: int32"):  # rewrite=False: strict mode refuses it
        compile_constraint(ConstraintSpec.json_schema(schema, options=(("rewrite", False),)), toy_tok,
                           engine="llguidance", cache=None)


def _integral_float(x) -> bool:
    if isinstance(x, float):
        return x.is_integer()
    if isinstance(x, dict):
        return any(_integral_float(v) for v in x.values())
    return isinstance(x, list) and any(_integral_float(v) for v in x)


def test_maskbench_sample_rewrites_agree_with_jsonschema():
    """A 1-in-2 sample of the MaskBench dev schemas: each rewritten schema gives every test instance of the corpus
    and 60 generated ones the verdict the original gives (original under its declared draft, format names with
    their 2020-12 meaning).  Schemas declaring an older draft while using keywords it does not know (if/then/else
    in draft-04...) are read with those keywords' 2020-12 meaning, as engines read them, and left out."""
    from specgrammar_plugins.bench.coverage import schema_files

    needs_shared_data("jsonschemabench", "dev")
    later = {"draft-04": ("const", "contains", "propertyNames", "if", "$defs", "prefixItems", "dependentRequired",
                          "dependentSchemas"),
             "draft-06": ("if", "$defs", "prefixItems", "dependentRequired", "dependentSchemas"),
             "draft-07": ("$defs", "prefixItems", "dependentRequired", "dependentSchemas")}
    checked = instances_checked = 0
    for f in schema_files(seed_stride=2):
        doc = json.loads(f.read_text())
        schema = doc["schema"]
        rw = rewrite(schema)
        if not rw.rewrites:
            continue
        declared = schema.get("$schema", "") if isinstance(schema, dict) else ""
        text = json.dumps(schema)
        if any(d in declared and any(f'"{k}"' in text for k in ks) for d, ks in later.items()):
            continue
        if any(kw == "$ref" and isinstance(v, str) and not v.startswith("#") for kw, _, v, _ in walk(schema)):
            continue  # a remote $ref: engines refuse those, and tests read no network
        original, rewritten = oracle(schema, formats="2020-12"), oracle(rw.schema, "2020-12")
        tests = [t["data"] for t in doc["tests"]] + instances(schema, 60, seed=2)
        if "draft-04" in declared:  # draft-04 reads 1.0 as no integer, later drafts as one (engines take neither)
            tests = [t for t in tests if not _integral_float(t)]
        for inst in tests:
            assert rewritten(inst) == original(inst), (f.name, inst, [str(r) for r in rw.rewrites])
        checked += 1
        instances_checked += len(tests)
    print(f"\n{checked} rewritten MaskBench schemas, {instances_checked} instances: same verdicts")
    assert checked >= 200


@pytest.mark.parametrize("schema", [
    {"type": "object", "required": ["foo"]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["foo", "a"],
     "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["foo"],
     "patternProperties": {"^f": {"type": "string"}}},
])
def test_required_keys_listed_for_engines_that_ignore_them(schema, toy_tok):
    """xgrammar 0.2.8 ignores a required key ``properties`` does not list (``{"required": ["foo"]}`` took ``{}``:
    JSON-Schema-Test-Suite items.json, "items and subitems"); ``list_required`` lists it, exactly."""
    rw = rewrite(schema, list_required=True)
    assert [r.keyword for r in rw.rewrites] == ["required"], rw.rewrites
    assert "foo" in rw.schema["properties"]
    original, rewritten = oracle(schema, None), oracle(rw.schema, "2020-12")
    seen = {True: 0, False: 0}
    for inst in instances(schema, 400, seed=1, extra=[{}, {"foo": 1}, {"foo": "x", "a": 2}, {"a": 1}, {"foo": 3, "a": 2}]):
        v = original(inst)
        assert rewritten(inst) == v, (inst, v, rw.schema)
        seen[v] += 1
    assert seen[True] and seen[False], seen
    assert rewrite(schema).rewrites == ()  # llguidance enforces them itself: no rewrite by default
    if "patternProperties" in schema:
        return  # xgrammar refuses patternProperties
    cc = compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine="xgrammar", cache=None)
    m = cc.matcher()
    assert not (m.accept_bytes(b"{}") and m.accept(toy_tok.eos_token_id)), "xgrammar took {} without foo"


def test_unlisted_required_key_that_cannot_be_present_is_refused(toy_tok):
    spec = ConstraintSpec.json_schema({"type": "object", "properties": {"p": {
        "type": "object", "required": ["foo"], "patternProperties": {"^x": {}}, "additionalProperties": {}}}})
    with pytest.raises(ConstraintError) as e:
        compile_constraint(spec, toy_tok, engine="outlines_core", cache=None)
    assert "at /properties/p/required" in str(e.value), str(e.value)


def test_step_triggers_change_nothing(monkeypatch):
    """The rewriter skips a step on a node that has none of the keywords it is listed with (``_STEPS``): on every
    MaskBench dev schema (with and without llguidance's native keywords and the required-key listing) the rewrite
    equals the one that calls every step on every node: the same schema and the same rewrites."""
    from specgrammar_plugins import schema_rewrite as R
    from specgrammar_plugins.bench.coverage import schema_files
    from specgrammar_plugins.schema import ENFORCED

    needs_shared_data("jsonschemabench", "dev")

    class Always(frozenset):
        def isdisjoint(self, other):
            return False

    every = tuple((name, Always(kws)) for name, kws in R._STEPS)
    settings = [(frozenset(), False), (ENFORCED.get("llguidance", frozenset()), False), (frozenset(), True)]
    compared = 0
    for f in schema_files():
        schema = json.loads(f.read_text())["schema"]
        for native, list_required in settings:
            fast = rewrite(schema, native, list_required)
            with monkeypatch.context() as m:
                m.setattr(R, "_STEPS", every)
                slow = rewrite(schema, native, list_required)
            assert json.dumps(fast.schema, sort_keys=True) == json.dumps(slow.schema, sort_keys=True), f.name
            assert [str(r) for r in fast.rewrites] == [str(r) for r in slow.rewrites], f.name
            compared += bool(slow.rewrites)
    assert compared > 500


def test_int64_bounds_narrowed_to_doubles_for_llguidance(toy_tok):
    """Issue 33: int64 bounds, which llguidance 1.7.6 holds exactly only as doubles (-2^63 does not compile; 2^63-1
    would be read as 2^63), are narrowed to +-(2^63-1024) for it: compiled by llguidance itself (no fallback),
    stricter by at most 1,024 integers at each end, never looser."""
    from specgrammar_plugins.bench.coverage import accepts

    big = 2 ** 63
    for schema in ({"type": "integer", "minimum": -big, "maximum": big - 1}, {"type": "integer", "format": "int64"},
                   {"type": "integer", "exclusiveMinimum": -big - 1, "exclusiveMaximum": big}):
        c = compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine="auto", cache=None)
        assert c.engine == "llguidance"
        assert json.loads(c.spec.value)["maximum"] == big - 1024 and json.loads(c.spec.value)["minimum"] == -big + 1024
        assert any("narrowed to a double" in str(r) for r in c.rewrites)
        for n, ok in ((0, True), (-big + 1024, True), (big - 1024, True), (-big + 1023, False), (big - 1023, False),
                      (big, False), (-big - 1, False)):
            assert accepts(c, toy_tok, str(n)) is ok, (schema, n)
    assert rewrite({"type": "integer", "maximum": big - 1}).schema["maximum"] == big - 1  # other engines: as given
    # where no narrowing of at most 1,024 integers fits, for "number" (compared as a double), or where a stricter
    # part could loosen the whole (under not, if, oneOf, ...): not narrowed, still refused
    for schema in ({"type": "integer", "maximum": 2 ** 64 - 1}, {"type": "number", "maximum": big - 1},
                   {"type": "integer", "not": {"type": "integer", "maximum": big - 1}}):
        assert not any("narrowed" in str(r) for r in rewrite(schema, narrow_bounds=True).rewrites)
        with pytest.raises(ConstraintError, match="past 2\\^53" if "not" not in schema else "'not' at /not"):
            compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine="llguidance", cache=None)


def test_bounds_within_2_53_are_not_narrowed():
    for schema in ({"type": "integer", "minimum": -(2 ** 53), "maximum": 2 ** 53},
                   {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 2 ** 53 - 1},
                   {"type": "integer", "format": "int32"}):
        with_narrowing = rewrite(schema, ENFORCED["llguidance"], narrow_bounds=True)
        assert with_narrowing.schema == rewrite(schema, ENFORCED["llguidance"]).schema
        assert not any("narrowed" in str(r) for r in with_narrowing.rewrites)
