"""The HTTP side of a request gate for hosts served over ASGI (vLLM's OpenAI server; any Starlette / FastAPI app).

Host-neutral: nothing here knows the host.  A host's launcher hands ``BodyGate`` its own ``gate`` (request body in,
rewritten body or None out, ``Refused`` for a request it answers itself) and adds ``StreamErrorsAs400``; both are
plain ASGI middlewares.

- ``BodyGate``: reads the whole body of a POST to one of its paths (415 for a Content-Type other than JSON, 413
  past ``SPECGRAMMAR_MAX_BODY_BYTES``, from the header alone where it says so, 408 when the body does not arrive
  within ``SPECGRAMMAR_BODY_TIMEOUT_S``), runs the gate off the event loop, answers a ``Refused`` with its status
  and an OpenAI-style error naming the field (a fault in the gate: a 500, never a closed connection), and replays
  the body (rewritten where the gate rewrote it) to the app.
- ``StreamErrorsAs400``: a *streaming* response whose first event is a 4xx error (vLLM 0.32 answers a streaming
  request whose constraint is invalid with HTTP 200 and ``data: {"error": {..., "code": 400}}``, where the same
  request without ``stream`` gets a 400) is sent as that error's status and JSON body instead.
- ``json_object``: a request body read as a JSON object, or the ``Refused`` naming why not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable

BODY_TIMEOUT_S = float(os.environ.get("SPECGRAMMAR_BODY_TIMEOUT_S", 30.0))
# the largest request body the gate reads (a larger one is a 413 before it is read whole; a constraint in it still
# has its own limit, SPECGRAMMAR_MAX_CONSTRAINT_BYTES)
MAX_BODY_BYTES = int(os.environ.get("SPECGRAMMAR_MAX_BODY_BYTES", 64 << 20))


class Refused(Exception):
    """A request the gate answers itself: ``status`` and an OpenAI-style error naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def error(self) -> dict:
        kind = "NotFoundError" if self.status == 404 else "BadRequestError"
        return {"message": self.message, "type": kind, "param": self.param, "code": self.status}


async def send_error(send, status: int, err: dict) -> None:
    payload = json.dumps({"error": err}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def _refuse_constant(name):
    raise ValueError(f"{name} is not a valid JSON value")


def json_object(raw: bytes) -> dict:
    """``raw`` as a JSON object; ``Refused`` (400, naming ``body``) for invalid UTF-8 or JSON, ``NaN`` /
    ``Infinity``, nesting past the interpreter's recursion limit, or a value that is not an object."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise Refused(400, "The request body is nested too deeply", "body") from None
    except UnicodeDecodeError as e:
        raise Refused(400, f"The request body is not valid UTF-8 (byte {e.start})", "body") from None
    except ValueError as e:
        raise Refused(400, f"Invalid JSON in request body: {e}", "body") from None
    if not isinstance(body, dict):
        raise Refused(400, "Request should be a JSON object", "body")
    return body


class BodyGate:
    """ASGI middleware: every POST to one of ``paths`` goes through ``gate(body) -> new body | None`` (run in a
    thread: a gate may compile) before ``app`` sees it; see the module docstring.  ``log``: the logger a fault in
    the gate is logged to."""

    def __init__(self, app, gate: Callable[[bytes], bytes | None], paths: tuple[str, ...], log: str):
        self.app, self.gate, self.paths, self.log = app, gate, paths, log

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in self.paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        ctype = headers.get(b"content-type")
        if ctype is not None and ctype.split(b";")[0].strip().lower() != b"application/json":
            media = ctype.split(b";")[0].strip().decode("latin-1")
            return await send_error(send, 415, Refused(415, f"Content-Type must be application/json, got {media!r}",
                                                       "content-type").error())
        too_large = Refused(413, f"The request body is larger than {MAX_BODY_BYTES} bytes (the limit, "
                                 "SPECGRAMMAR_MAX_BODY_BYTES)", "body").error()
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:  # refused before a byte of it is read
            return await send_error(send, 413, too_large)
        chunks, size = [], 0
        end = asyncio.get_running_loop().time() + BODY_TIMEOUT_S  # a deadline for the whole body, not per chunk
        try:
            while True:
                msg = await asyncio.wait_for(receive(), max(0.0, end - asyncio.get_running_loop().time()))
                if msg["type"] != "http.request":
                    return None  # the client went away
                chunks.append(msg.get("body", b""))
                size += len(chunks[-1])
                if size > MAX_BODY_BYTES:
                    return await send_error(send, 413, too_large)
                if not msg.get("more_body"):
                    break
        except asyncio.TimeoutError:
            return await send_error(send, 408, Refused(
                408, f"The request body did not arrive within {BODY_TIMEOUT_S:g} s", "body").error())
        body = b"".join(chunks)
        try:
            new = await asyncio.to_thread(self.gate, body)  # (a gate may compile: off the event loop)
        except Refused as r:
            return await send_error(send, r.status, r.error())
        except Exception:  # never a closed connection: whatever failed in the gate, the client gets an answer
            logging.getLogger(self.log).exception("specgrammar: the request gate failed")
            return await send_error(send, 500, Refused(500, "internal error in the specgrammar gate (see the "
                                                       "server log)").error())
        if new is not None:
            body = new
            scope = dict(scope, headers=[(k, v) for k, v in scope.get("headers") or [] if k != b"content-length"]
                         + [(b"content-length", str(len(body)).encode())])
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)


def leading_error(body: bytes) -> dict | None:
    """The error of a server-sent-events body whose first event is ``data: {"error": {... "code": 4xx}}``."""
    if not body.startswith(b"data:"):
        return None
    try:
        event = json.loads(body.split(b"\n\n", 1)[0][5:])
    except ValueError:
        return None
    err = event.get("error") if isinstance(event, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), int) and 400 <= err["code"] < 500:
        return err
    return None


class StreamErrorsAs400:
    """ASGI middleware: a streaming response whose first event is a 4xx error becomes that error's status and
    JSON body (see the module docstring); every other response passes through unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        state = {"mode": "undecided", "start": None}

        async def relay(msg):
            mode = state["mode"]
            if mode == "pass":
                return await send(msg)
            if mode == "swallow":
                return None
            if msg["type"] == "http.response.start":
                ctype = dict(msg.get("headers") or []).get(b"content-type", b"")
                if msg.get("status") == 200 and ctype.startswith(b"text/event-stream"):
                    state["start"] = msg  # held until the first event
                    return None
                state["mode"] = "pass"
                return await send(msg)
            if msg["type"] == "http.response.body" and state["start"] is not None:
                body = msg.get("body", b"")
                if not body and msg.get("more_body"):
                    return None
                err = leading_error(body)
                if err is None:
                    state["mode"] = "pass"
                    await send(state["start"])
                    return await send(msg)
                state["mode"] = "swallow"
                return await send_error(send, err["code"], err)
            return await send(msg)

        return await self.app(scope, receive, relay)
