"""The mlx-lm server plugin's request preparation and batching, in process, on the bundled tiny models (real
mlx-lm, real engines): preparation under one deadline; constrained requests on mlx-lm's own ``BatchGenerator``,
one constraint and budget per row, each row's greedy output equal to serial constrained decoding, a faulty row
answered with its error while the rest of its batch goes on."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from test_mlx_common import tiny_model_dirs

pytest.importorskip("mlx_lm")

from specgrammar_plugins import bounds  # noqa: E402
from specgrammar_plugins.errors import ConstraintError  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from mlx_lm import load

    t, _ = tiny_model_dirs()
    model, tok = load(str(t))
    return model, tok


def _provider(model, tok):
    """What the plugin's hooks read of mlx-lm's ``ModelProvider``: the loaded model, its tokenizer, the command line."""
    return SimpleNamespace(model=model, tokenizer=tok, cli_args=SimpleNamespace(model=None, max_tokens=64))


def test_request_preparation_runs_under_the_deadline(tiny, monkeypatch):
    """Gate check, compile and budget check share one deadline (issue 33): with no time at all a new constraint
    is refused with the preparation time limit's reason; with the default it is prepared."""
    from specgrammar_mlx_lm import server_plugin

    provider = _provider(*tiny)
    schema = {"type": "object", "properties": {"deadline_probe": {"type": "integer"}}, "required": ["deadline_probe"]}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 32, "json_schema": schema}
    monkeypatch.setattr(bounds.BOUNDS, "prepare_timeout_s", 0.0)
    with pytest.raises(ConstraintError, match="preparation time limit"):
        server_plugin.request_fields(json.loads(json.dumps(body)), provider)
    assert bounds.current() is None  # the deadline is closed after the request
    monkeypatch.setattr(bounds.BOUNDS, "prepare_timeout_s", 30.0)
    plan = server_plugin.request_fields(json.loads(json.dumps(body)), provider)["specgrammar"]
    assert plan.spec is not None and plan.spec.kind == "json_schema"
