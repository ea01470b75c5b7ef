"""Issue 34: one reader of a request's ``specgrammar`` options sent in a host's extension field of strings
(``api.options_in``: vLLM's ``vllm_xargs`` at the launcher's gate, ``SamplingParams.extra_args`` in the engine's
budget mask), with one error (a 400 naming the field), and one source of the engine options of vLLM's backend
(``structured.backend_options``: the engine's budget and proposers, and the launcher's gate).  No vLLM engine runs:
the gate's reading of a body, the budget mask's reading of a request's options, the mapping of a backend config."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from specgrammar_plugins.api import RequestError, Refused, options_in

FIELD = "vllm_xargs.specgrammar"
MESSAGE = ("vllm_xargs.specgrammar must be an object of specgrammar options, sent as a JSON string (or send a "
           "top-level \"specgrammar\" object)")


@pytest.mark.parametrize("extra, want", [
    (None, None), ({}, None), ({"other": "1"}, None), ("not a dict", None),
    ({"specgrammar": {"k": 2}}, {"k": 2}),
    ({"specgrammar": json.dumps({"recipe": "ñandú", "drafters": ["ドラフト"]})},
     {"recipe": "ñandú", "drafters": ["ドラフト"]}),
])
def test_the_reader_returns_the_object_sent_or_none(extra, want):
    assert options_in(extra, FIELD) == want


@pytest.mark.parametrize("raw", ["ドラフト", '"ñandú"', "null", None, "", "[1, 2]", 3, ["k"], "[" * 100_000,
                                 '{"k": 2', "\udc80"])
def test_anything_else_is_one_400_naming_the_field(raw):
    with pytest.raises(RequestError) as e:
        options_in({"specgrammar": raw}, FIELD)
    assert (e.value.status_code, e.value.field, str(e.value)) == (400, FIELD, MESSAGE)


def _gate(body):
    from specgrammar_vllm.serve import gate_body

    return gate_body(json.dumps(body).encode())


BODY = {"messages": [{"role": "user", "content": "héllo"}], "max_tokens": 8, "regex": "[0-9]{2}"}


@pytest.mark.parametrize("raw", ["ドラフト", '"ñandú"', None, "[1]"])
def test_the_vllm_gate_answers_the_readers_error_as_before(monkeypatch, raw):
    monkeypatch.delenv("SPECGRAMMAR_VLLM_TOKENIZER", raising=False)  # (nothing compiled for a served tokenizer)
    with pytest.raises(Refused) as e:
        _gate(dict(BODY, vllm_xargs={"specgrammar": raw}))
    assert (e.value.status, e.value.param, e.value.message) == (400, FIELD, MESSAGE)
    assert e.value.error()["type"] == "BadRequestError"


def test_the_vllm_gate_checks_the_options_it_read(monkeypatch):
    monkeypatch.delenv("SPECGRAMMAR_VLLM_TOKENIZER", raising=False)
    with pytest.raises(Refused) as e:  # read, then checked by the core's gate like a top-level object
        _gate(dict(BODY, vllm_xargs={"specgrammar": json.dumps({"recipe": "ñandú"})}))
    assert (e.value.status, e.value.param) == (400, "specgrammar.recipe")
    with pytest.raises(Refused) as e:
        _gate(dict(BODY, specgrammar={"k": 2}, vllm_xargs={"specgrammar": json.dumps({"k": 2})}))
    assert (e.value.status, e.value.param) == (400, "specgrammar")
    out = json.loads(_gate(dict(BODY, vllm_xargs={"specgrammar": json.dumps({"drafters": ["forced"]})})))
    assert json.loads(out["vllm_xargs"]["specgrammar"]) == {"drafters": ["forced"]}


def test_the_budget_mask_reads_the_same_options_and_ignores_a_bad_value(caplog):
    from specgrammar_vllm.budget_mask import request_options

    def sp(raw):
        return SimpleNamespace(extra_args={"specgrammar": raw})

    assert request_options(sp(json.dumps({"budget_mask": False}))) == {"budget_mask": False}
    assert request_options(SimpleNamespace()) is None
    with caplog.at_level(logging.WARNING, logger="vllm.specgrammar"):
        assert request_options(sp("ドラフト")) is None  # the gate answered it with a 400; here: logged, ignored
    assert "extra_args.specgrammar must be an object" in caplog.text


def test_one_source_of_the_engine_options(monkeypatch):
    from specgrammar_vllm.budget_mask import STRUCTURED_ENV, gate_engine
    from specgrammar_vllm.serve import configure_gate
    from specgrammar_vllm.structured import backend_options, engine_options

    for cfg, want in ((None, ("xgrammar", {"xgrammar_strict_mode": True})),
                      ({"backend": "guidance"}, ("llguidance", {})),
                      ({"backend": "auto"}, ("xgrammar", {"xgrammar_strict_mode": True})),
                      ({"backend": "xgrammar", "disable_any_whitespace": True},
                       ("xgrammar", {"xgrammar_strict_mode": True, "any_whitespace": False}))):
        assert backend_options(cfg) == want  # the launcher's dict
        obj = None if cfg is None else SimpleNamespace(**cfg)  # the engine's config object
        assert engine_options(SimpleNamespace(structured_outputs_config=obj)) == want
    from specgrammar_plugins.api import LIMITS

    monkeypatch.setattr(LIMITS, "compile_isolation", LIMITS.compile_isolation)  # (configure_gate sets it)
    # configure_gate writes the variable with os.environ.setdefault, outside monkeypatch: setenv first so that its
    # undo removes it again (a leaked backend here made every later vLLM server's gate compile with outlines_core)
    monkeypatch.setenv(STRUCTURED_ENV, "null")
    monkeypatch.delenv(STRUCTURED_ENV)
    monkeypatch.setenv("SPECGRAMMAR_VLLM_SERVED_MODELS", "[]")
    monkeypatch.setenv("SPECGRAMMAR_COMPILE_ISOLATION", "thread")
    assert gate_engine() == ("xgrammar", {"xgrammar_strict_mode": True})
    configure_gate(["m", "--structured-outputs-config", '{"backend": "outlines", "disable_any_whitespace": true}'],
                   "m")
    assert gate_engine() == ("outlines_core", {"any_whitespace": False})
