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
    ({"json_schema": "{oops"}, "not valid JSON"),
    ({"choice": []}, "choice"),
    ({"guided_regex": "a", "regex": "b"}, "only one constraint may be given per request; got regex, guided_regex"),
])
def test_malformed_requests(body, match):
    with pytest.raises(ConstraintError, match=match):
        parse_request(body)


@pytest.mark.parametrize("opts,match", [
    ({"k": 99}, r"specgrammar\.k must be an integer in \[0, 32\]"),
    ({"k": "4"}, r"specgrammar\.k"),
    ({"k": True}, r"specgrammar\.k"),
    ("fast", "'specgrammar' must be an object"),
    ({"lambda": float("inf")}, r"specgrammar\.lambda must be a finite number"),
    ({"lambda": float("nan")}, r"specgrammar\.lambda must be a finite number"),
    ({"lambda": -1}, r"specgrammar\.lambda"),
    ({"budget": 0}, r"specgrammar\.budget"),
    ({"budget": 2**40}, r"specgrammar\.budget"),
    ({"recipe": "/etc/passwd"}, r"specgrammar\.recipe must be the name of a recipe pack"),
    ({"recipe": "../x"}, r"specgrammar\.recipe"),
    ({"trigger": ""}, r"specgrammar\.trigger"),
    ({"drafters": ["forced"] * 50}, r"specgrammar\.drafters"),
    ({"recipe_misslog": "/tmp/x"}, r"unknown option\(s\) specgrammar\.recipe_misslog"),
    ({"k": 2, "turbo": True}, r"unknown option\(s\) specgrammar\.turbo \(known: k, drafters"),
])
def test_malformed_options_name_the_field(opts, match):
    """Every ``specgrammar`` key is checked (issue 22): unknown keys were passed on as drafter options (one,
    ``recipe_misslog``, names a file the server would write), non-finite numbers crashed the loop."""
    with pytest.raises(RequestError, match=match) as e:
        parse_request({"regex": "a", "specgrammar": opts})
    assert e.value.status_code == 400 and (e.value.field or "").startswith("specgrammar")


@pytest.mark.parametrize("field,kind", [("guided_json", "json_schema"), ("guided_regex", "regex"),
                                        ("guided_choice", "choice"), ("guided_grammar", "grammar")])
def test_vllm_guided_spellings_are_honoured(field, kind):
    value = {"guided_json": SCHEMA, "guided_regex": "[0-9]+", "guided_choice": ["a", "b"],
             "guided_grammar": 'root ::= "a"'}[field]
    spec, _ = parse_request({field: value})
    assert spec.kind == kind
    for refused in ("guided_decoding_backend", "guided_whitespace_pattern"):
        with pytest.raises(RequestError, match=refused):
            parse_request({field: value, refused: "x"})


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


# ---------------------------------------------------------------------------------------------- the gate
from specgrammar_plugins.gate import Host, check_request  # noqa: E402

MSG = [{"role": "user", "content": "Find the year: 1999"}]


def _host(**kw):
    def count(body):  # a stand-in tokenizer: one token per 4 bytes of text (the gate only needs a count)
        text = body["prompt"] if "prompt" in body else "".join(m.get("content") or "" for m in body["messages"])
        return len(text.encode()) // 4 + 3

    base = dict(models=("default_model", "/models/tiny"), context_length=512, max_token_bytes=8, vocab_size=1024,
                default_max_tokens=256, count_tokens=count, fixed=(("adapters", (None,)),))
    base.update(kw)
    return Host("the test server", **base)


@pytest.mark.parametrize("extra,field", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"specgrammar": {"lambda": float("inf")}}, "specgrammar.lambda"),
    ({"json_schema": {"type": "integer", "minimum": float("-inf")}}, "json_schema.minimum"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 1e-9}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": "5"}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"num_draft_tokens": 100000}, "num_draft_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 3}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": []}, "stream_options"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ({"stop": ["}"], "json_schema": SCHEMA}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"adapters": "/tmp/evil"}, "adapters"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]"),
    ({"specgrammar": {"nope": 1}}, "specgrammar.nope"),
])
def test_the_gate_refuses_naming_the_field(extra, field):
    with pytest.raises(RequestError) as e:
        check_request({"messages": MSG, **extra}, _host())
    assert e.value.field == field and e.value.status_code == 400, (e.value.field, str(e.value))
    assert str(e.value).startswith(field) or field in str(e.value)


def test_the_gate_model_name_is_a_404_naming_the_served_model():
    with pytest.raises(RequestError, match="'gpt-4' is not served here; this server serves 'default_model'") as e:
        check_request({"messages": MSG, "model": "gpt-4"}, _host())
    assert e.value.status_code == 404
    for name in ("default_model", "/models/tiny"):
        check_request({"messages": MSG, "model": name}, _host())


def test_the_gate_refuses_options_the_host_does_not_apply():
    host = _host(honours=frozenset({"k", "drafters", "recipe"}))
    with pytest.raises(RequestError, match=r"specgrammar\.lambda is not applied by the test server"):
        check_request({"messages": MSG, "specgrammar": {"lambda": 0.5}}, host)
    check_request({"messages": MSG, "specgrammar": {"k": 2}}, host)
    with pytest.raises(RequestError, match="must be 1 on the test server"):
        check_request({"messages": MSG, "n": 2}, host)
    assert check_request({"messages": MSG, "n": 2}, _host(n=True)).spec is None


def test_the_gate_checks_the_context_length_before_any_work():
    """A 100k-character prompt is refused from its size alone (the tokenizer is never called), an over-long
    one after counting it, and prompt + max_tokens must fit: each message names both numbers."""
    def never(body):
        raise AssertionError("the prompt was tokenized")

    with pytest.raises(RequestError, match=r"messages is at least 12500 tokens \(100000 bytes\); the model's "
                                           r"context length is 512 tokens"):
        check_request({"messages": [{"role": "user", "content": "x" * 100000}]}, _host(count_tokens=never))
    with pytest.raises(RequestError, match=r"prompt is 528 tokens; the model's context length is 512 tokens"):
        check_request({"prompt": "y" * 2100}, _host())
    with pytest.raises(RequestError, match=r"max_tokens is 500: with the prompt's 7 tokens that is 507 tokens; the "
                                           r"model's context length is 500 tokens"):
        check_request({"messages": MSG, "max_tokens": 500}, _host(context_length=500))
    c = check_request({"messages": MSG}, _host(context_length=200))  # the default (256) cut to what is left
    assert (c.prompt_tokens, c.max_tokens, c.max_tokens_given) == (7, 193, False)
    c = check_request({"messages": MSG, "max_completion_tokens": 5}, _host())
    assert (c.max_tokens, c.max_tokens_given) == (5, True)


def test_the_gate_bounds_the_body_nesting():
    deep: object = 1
    for _ in range(500):
        deep = [deep]
    with pytest.raises(RequestError, match="nests more than 136 levels deep"):
        check_request({"messages": MSG, "metadata": deep}, _host())


def test_the_gate_refuses_an_empty_language_without_compiling():
    """vLLM compiles a request's grammar in its own backend, so the launcher's gate refuses what is certainly empty
    (structurally, no engine run): otherwise the request would generate to max_tokens."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    with pytest.raises(ConstraintError, match="no finite JSON value"):
        check_request({"messages": MSG, "structured_outputs": {"json": schema}}, Host("the vLLM launcher"))
    with pytest.raises(ConstraintError, match="matches no string"):
        check_request({"messages": MSG, "regex": "a{0}b[^\\x00-\\U0010FFFF]"}, Host("the vLLM launcher"))
