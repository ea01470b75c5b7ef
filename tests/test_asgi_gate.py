"""The core's ASGI gate (``asgi``: ``BodyGate``, ``StreamErrorsAs400``, ``json_object``), driven as a server drives
it: ASGI messages in, messages out, around a small ASGI app that records what reached it."""

from __future__ import annotations

import asyncio
import json

import pytest

from specgrammar_plugins import asgi
from specgrammar_plugins.api import BodyGate, Refused, StreamErrorsAs400, json_object

PATHS = ("/v1/completions",)


def _call(mw, scope, chunks, *, stall=False):
    """Run middleware ``mw`` on one request whose body arrives as ``chunks``; returns the messages it sent."""
    sent = []

    async def run():
        queue = [{"type": "http.request", "body": c, "more_body": stall or i < len(chunks) - 1}
                 for i, c in enumerate(chunks)]

        async def receive():
            if queue:
                return queue.pop(0)
            if stall:
                await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)

        await mw(scope, receive, send)

    asyncio.run(run())
    return sent


async def _echo(scope, receive, send):
    """The app behind the gate: answers 200 with the body it read and its Content-Length header."""
    msg = await receive()
    headers = dict(scope.get("headers") or [])
    payload = json.dumps({"body": msg["body"].decode(), "length": headers.get(b"content-length", b"").decode()})
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload.encode(), "more_body": False})


def _scope(path="/v1/completions", ctype=b"application/json", length=None):
    headers = [(b"content-type", ctype)] if ctype else []
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http", "method": "POST", "path": path, "headers": headers}


def _answer(sent):
    return sent[0]["status"], json.loads(sent[-1]["body"])


def _gate(raw: bytes):
    body = json_object(raw)
    if body.get("refuse"):
        raise Refused(400, "refused here", "refuse")
    if body.get("boom"):
        raise RuntimeError("a fault in the gate")
    return json.dumps({**body, "rewritten": True}).encode() if body.get("rewrite") else None


def test_the_gate_replays_a_body_in_chunks_rewritten_with_its_new_length():
    raw = json.dumps({"rewrite": True, "prompt": "x" * 100}).encode()
    sent = _call(BodyGate(_echo, _gate, PATHS, "test"), _scope(length=len(raw)), [raw[:40], raw[40:]])
    status, out = _answer(sent)
    assert status == 200 and json.loads(out["body"]) == {"rewrite": True, "prompt": "x" * 100, "rewritten": True}
    assert int(out["length"]) == len(out["body"].encode())
    sent = _call(BodyGate(_echo, _gate, PATHS, "test"), _scope(), [b'{"prompt": "as sent"}'])
    assert _answer(sent) == (200, {"body": '{"prompt": "as sent"}', "length": ""})


@pytest.mark.parametrize("scope, chunks, status, param", [
    (_scope(), [b'{"refuse": true}'], 400, "refuse"),
    (_scope(), [b'{"a": NaN}'], 400, "body"),
    (_scope(), [b"\xff"], 400, "body"),
    (_scope(), [b"[1, 2]"], 400, "body"),
    (_scope(), [b"[" * 100_000 + b"]" * 100_000], 400, "body"),
    (_scope(ctype=b"text/plain; charset=utf-8"), [b"{}"], 415, "content-type"),
    (_scope(length=asgi.MAX_BODY_BYTES + 1), [b"{}"], 413, "body"),
    (_scope(), [b" " * (asgi.MAX_BODY_BYTES // 2 + 1)] * 2, 413, "body"),
    (_scope(), [b'{"boom": true}'], 500, None),
])
def test_the_gate_answers_what_it_refuses_with_its_status_naming_the_field(scope, chunks, status, param):
    got, out = _answer(_call(BodyGate(_echo, _gate, PATHS, "test"), scope, chunks))
    assert (got, out["error"]["code"], out["error"]["param"]) == (status, status, param)


def test_the_gate_answers_a_body_that_does_not_arrive_with_a_408(monkeypatch):
    monkeypatch.setattr(asgi, "BODY_TIMEOUT_S", 0.2)
    got, out = _answer(_call(BodyGate(_echo, _gate, PATHS, "test"), _scope(), [b'{"pro'], stall=True))
    assert got == 408 and "did not arrive within 0.2 s" in out["error"]["message"]


def test_the_gate_passes_other_paths_and_methods_untouched():
    for scope in (_scope(path="/v1/models"), dict(_scope(), method="GET")):
        assert _answer(_call(BodyGate(_echo, _gate, PATHS, "test"), scope, [b'{"refuse": true}']))[0] == 200


def _stream(first: bytes, status=200):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type",
                                                                                  b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    return app


def test_a_stream_that_opens_with_a_4xx_error_is_sent_as_that_error():
    err = {"message": "bad schema", "type": "BadRequestError", "param": None, "code": 400}
    sent = _call(StreamErrorsAs400(_stream(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")), _scope(),
                 [b"{}"])
    assert _answer(sent) == (400, {"error": err}) and len(sent) == 2
    for first in (b'data: {"choices": []}\n\n', b'data: {"error": {"code": 500}}\n\n', b"data: not json\n\n"):
        sent = _call(StreamErrorsAs400(_stream(first)), _scope(), [b"{}"])
        assert sent[0]["status"] == 200 and [m.get("body") for m in sent[1:]] == [first, b"data: [DONE]\n\n"]
