import pytest

from specgrammar_plugins import ConstraintError, ConstraintSpec
from specgrammar_plugins.drafters import ChainDrafter, DraftContext, ForcedDrafter, build_chain
from specgrammar_plugins.errors import RequestError
from specgrammar_plugins.requests import parse_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body,kind", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json_schema"),
    ({"response_format": {"type": "json_object"}}, "json"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "json_schema"),
    ({"response_format": {"type": "regex", "regex": "[0-9]+"}}, "regex"),
    ({"response_format": {"type": "grammar", "grammar": "root ::= \"a\""}}, "grammar"),
    ({"regex": "[0-9]+"}, "regex"),
    ({"grammar": "root ::= \"a\""}, "grammar"),
    ({"json_schema": SCHEMA}, "json_schema"),
    ({"choice": ["yes", "no"]}, "choice"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema"),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "grammar"),
    ({"structured_outputs": {"json_object": True}}, "json"),
])
def test_spellings(body, kind):
    spec, opts = parse_request(body)
    assert spec.kind == kind


def test_no_constraint_and_options():
    spec, opts = parse_request({"response_format": {"type": "text"},
                                "specgrammar": {"k": 6, "drafters": ["forced"], "engine": "llguidance"}})
    assert spec is None and opts.k == 6 and opts.drafters == ("forced",) and opts.engine == "llguidance"
    spec, opts = parse_request({"regex": "a", "specgrammar": {"trigger": "</think>"}})
    assert spec == ConstraintSpec.regex("a", trigger="</think>")


@pytest.mark.parametrize("body,match", [
    ({"regex": "a", "json_schema": SCHEMA}, "only one constraint"),
    ({"response_format": {"type": "xml"}}, "unsupported response_format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"regex": ""}, "non-empty"),
    ({"specgrammar": {"k": 99}}, "specgrammar.k"),
    ({"specgrammar": {"k": "4"}}, "specgrammar.k"),
    ({"specgrammar": "fast"}, "must be an object"),
    ({"json_schema": "{oops"}, "not valid JSON"),
    ({"choice": []}, "choice"),
])
def test_malformed_requests(body, match):
    with pytest.raises(ConstraintError, match=match):
        parse_request(body)


def test_build_chain(toy_tok):
    d = build_chain(["forced", "recipe", "model"], DraftContext(tokenizer=toy_tok))
    assert isinstance(d, ForcedDrafter)  # no recipe pack, no draft model: forced tokens only
    with pytest.raises(RequestError, match="unknown drafter"):
        build_chain(["psychic"], DraftContext(tokenizer=toy_tok))
    from specgrammar_plugins.testing import MarkovRunner

    d = build_chain(["forced", "model"], DraftContext(tokenizer=toy_tok, draft_runner=MarkovRunner(toy_tok.vocab_size)))
    assert isinstance(d, ChainDrafter) and len(d.drafters) == 2


def test_third_party_plugin_takes_the_same_road(monkeypatch, toy_tok):
    """A plugin registered on the manager adds an engine through the same hook as the built-ins."""
    from specgrammar_plugins import hookimpl, plugins
    from specgrammar_plugins.engines.dfa import DFAEngine

    class Plugin:
        @hookimpl
        def register_engines(self, register):
            register("my-dfa", DFAEngine())

    plugins.reset()
    try:
        plugins.get_plugin_manager().register(Plugin())
        assert "my-dfa" in plugins.engines() and "xgrammar" in plugins.engines()
        from specgrammar_plugins import compile_constraint

        c = compile_constraint(ConstraintSpec.regex("[0-9]"), toy_tok, engine="my-dfa", cache=None)
        assert c.engine == "dfa"
    finally:
        plugins.reset()
