"""``serving.plan_request`` (issue 34: the mlx-lm server plugin's reading of a request, moved into the core): the
gate, the server's default max_tokens written back, the options planned, the constraint compiled now and its
budget checked; every error one of the core's 400s (or the gate's 404) before any work.  Toy tokenizer, DFA."""

from __future__ import annotations

import pytest

from specgrammar_plugins.api import (BudgetError, ConstraintError, Host, RecipePackError, RequestError,
                                     compile_constraint, plan_request)
from specgrammar_plugins.testing import toy_tokenizer

HOST = Host("a test server", models=("m",), default_max_tokens=40)
TOK = toy_tokenizer()


def _compile(spec, options):
    return compile_constraint(spec, TOK, engine=options.engine or "dfa")


def test_a_constrained_request_is_compiled_and_its_budget_checked():
    body = {"model": "m", "prompt": "héllo", "regex": "é?[0-9]{2}@example[.]com"}
    plan = plan_request(body, HOST, None, _compile)
    assert body["max_tokens"] == 40 and plan.spec.kind == "regex" and not plan.explicit and not plan.loop
    assert not plan.certified  # a regex's bound is exact: the host's processor cuts it as it is
    with pytest.raises(BudgetError) as e:  # "@example.com" alone takes more than 4 tokens
        plan_request(dict(body, max_tokens=4), HOST, None, _compile)
    assert e.value.budget == 4 and e.value.shortest > 4
    assert plan_request(dict(body, specgrammar={"budget_mask": False}, max_tokens=4), HOST, None, _compile)
    # no model loaded yet: planned without a compile (the host compiles at generation time)
    assert plan_request(dict(body, max_tokens=4), HOST, None, lambda spec, options: None).spec == plan.spec


def test_a_plain_request_is_the_hosts_own_and_options_alone_are_ours():
    assert plan_request({"model": "m", "prompt": "日本"}, HOST, None, _compile) is None
    plan = plan_request({"model": "m", "prompt": "日本", "specgrammar": {"k": 2}}, HOST, None, _compile)
    assert plan.explicit and plan.spec is None and plan.loop  # drafting without a constraint: our loop


@pytest.mark.parametrize("body, error, field", [
    ({"model": "other", "prompt": "x"}, RequestError, "model"),
    ({"model": "m", "prompt": "x", "regex": "é", "choice": ["ü"]}, ConstraintError, None),
    ({"model": "m", "prompt": "x", "specgrammar": {"drafters": ["ドラフト"]}}, RequestError, "specgrammar.drafters"),
    ({"model": "m", "prompt": "x", "specgrammar": {"recipe": "ñandú"}}, RequestError, "specgrammar.recipe"),
    ({"model": "m", "prompt": "x", "specgrammar": {"recipe": "no-such-pack"}}, RecipePackError, None),
])
def test_every_error_is_raised_before_any_work(body, error, field):
    compiled = []
    with pytest.raises(error) as e:
        plan_request(body, HOST, None, lambda spec, options: compiled.append(spec))
    assert not compiled and getattr(e.value, "field", None) == field
    assert getattr(e.value, "status_code", 400) == (404 if field == "model" else 400)
