"""Request fields -> (ConstraintSpec, SpecOptions): the one parser every server adapter uses.

Accepted spellings (OpenAI / vLLM / llama-cpp-python / ours):
- ``response_format``: ``{"type": "json_schema", "json_schema": {"schema": {...}, "name": ..., "strict": ...}}``,
  ``{"type": "json_object"}`` (optionally with ``"schema"``, as llama-cpp-python spells it),
  ``{"type": "regex", "regex": "..."}`` (or ``"pattern"``), ``{"type": "grammar", "grammar": "...", "syntax": "gbnf"}``,
  ``{"type": "text"}`` (no constraint).
- top level: ``regex``, ``grammar`` (GBNF unless ``grammar_syntax`` says lark/ebnf), ``json_schema``, ``choice``.
- ``structured_outputs`` as vLLM spells it: ``{"json": schema, "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true}``.
- ``specgrammar``: options ``{"k": 4, "drafters": ["forced", "recipe", "model"], "engine": "xgrammar",
  "recipe": "path-or-name", "trigger": "</think>", "budget": ..., "lambda": ..., "adaptive": false,
  "budget_mask": true}``.

At most one constraint may be given; anything malformed raises ``ConstraintError`` (servers answer 400).
Parsers are registered through the ``register_request_parsers`` hook; the built-in one is ``parse_openai``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .constraint import GRAMMAR_SYNTAXES, ConstraintSpec
from .errors import ConstraintError

DEFAULT_DRAFTERS = ("forced", "recipe", "model")
MAX_K = 32


@dataclass(frozen=True)
class SpecOptions:
    """Per-request speculation options (the ``specgrammar`` request object)."""

    k: int | None = None  # draft tokens per round (None = the server's default)
    drafters: tuple[str, ...] = DEFAULT_DRAFTERS
    engine: str | None = None
    recipe: str | None = None
    trigger: str | None = None
    budget: int | None = None
    lam: float | None = None
    adaptive: bool = False
    extra: dict = field(default_factory=dict)
    budget_mask: bool | None = None  # None: on for constrained requests (speculation.budget_of); False: off


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConstraintError(msg)


def parse_options(obj: Any) -> SpecOptions:
    if obj is None:
        return SpecOptions()
    _need(isinstance(obj, dict), "'specgrammar' must be an object")
    known = {"k", "drafters", "engine", "recipe", "trigger", "budget", "lambda", "adaptive", "budget_mask"}
    k = obj.get("k")
    if k is not None:
        _need(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_K,
              f"specgrammar.k must be an integer in [0, {MAX_K}]")
    drafters = obj.get("drafters", DEFAULT_DRAFTERS)
    _need(isinstance(drafters, (list, tuple)) and all(isinstance(d, str) for d in drafters),
          "specgrammar.drafters must be a list of drafter names")
    engine = obj.get("engine")
    _need(engine is None or isinstance(engine, str), "specgrammar.engine must be a string")
    for name in ("recipe", "trigger"):
        _need(obj.get(name) is None or isinstance(obj.get(name), str), f"specgrammar.{name} must be a string")
    budget = obj.get("budget")
    _need(budget is None or (isinstance(budget, int) and budget > 0), "specgrammar.budget must be a positive integer")
    lam = obj.get("lambda")
    _need(lam is None or (isinstance(lam, (int, float)) and lam >= 0), "specgrammar.lambda must be a number >= 0")
    adaptive = obj.get("adaptive", False)
    _need(isinstance(adaptive, bool), "specgrammar.adaptive must be true or false")
    budget_mask = obj.get("budget_mask")
    _need(budget_mask is None or isinstance(budget_mask, bool), "specgrammar.budget_mask must be true or false")
    return SpecOptions(k, tuple(drafters), engine, obj.get("recipe"), obj.get("trigger"), budget,
                       None if lam is None else float(lam), adaptive,
                       {k_: v for k_, v in obj.items() if k_ not in known}, budget_mask)


def _schema_spec(schema: Any, where: str) -> ConstraintSpec:
    if isinstance(schema, str):
        return ConstraintSpec.json_schema(schema)
    _need(isinstance(schema, (dict, bool)), f"{where} must be a JSON Schema object")
    return ConstraintSpec.json_schema(schema)


def _grammar_spec(text: Any, syntax: Any, where: str) -> ConstraintSpec:
    _need(isinstance(text, str) and text.strip() != "", f"{where} must be a non-empty grammar string")
    _need(syntax is None or isinstance(syntax, str), f"{where} syntax must be a string (gbnf, lark or ebnf)")
    syntax = (syntax or "gbnf").lower()
    _need(syntax in GRAMMAR_SYNTAXES, f"grammar syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}")
    return ConstraintSpec.grammar(text, syntax)


def _regex_spec(pattern: Any, where: str) -> ConstraintSpec:
    _need(isinstance(pattern, str) and pattern != "", f"{where} must be a non-empty regex string")
    return ConstraintSpec.regex(pattern)


def _response_format(rf: Any) -> ConstraintSpec | None:
    _need(isinstance(rf, dict), "response_format must be an object")
    t = rf.get("type")
    if t in (None, "text"):
        return None
    if t == "json_schema":
        js = rf.get("json_schema")
        _need(isinstance(js, dict), "response_format.json_schema must be an object with a 'schema'")
        schema = js.get("schema", js.get("json_schema"))
        _need(schema is not None, "response_format.json_schema.schema is missing")
        return _schema_spec(schema, "response_format.json_schema.schema")
    if t == "json_object":
        if rf.get("schema") is not None:
            return _schema_spec(rf["schema"], "response_format.schema")
        return ConstraintSpec.json(options=(("object_only", True),))
    if t == "regex":
        return _regex_spec(rf.get("regex", rf.get("pattern")), "response_format.regex")
    if t == "grammar":
        return _grammar_spec(rf.get("grammar"), rf.get("syntax"), "response_format.grammar")
    raise ConstraintError(f"unsupported response_format type {t!r} (json_schema, json_object, regex, grammar, text)")


def _structured_outputs(so: Any) -> list[ConstraintSpec]:
    _need(isinstance(so, dict), "structured_outputs must be an object")
    out = []
    if so.get("json") is not None:
        out.append(_schema_spec(so["json"], "structured_outputs.json"))
    if so.get("regex") is not None:
        out.append(_regex_spec(so["regex"], "structured_outputs.regex"))
    if so.get("choice") is not None:
        ch = so["choice"]
        _need(isinstance(ch, list) and ch and all(isinstance(c, str) and c for c in ch),
              "structured_outputs.choice must be a non-empty list of strings")
        out.append(ConstraintSpec.choice(ch))
    if so.get("grammar") is not None:
        out.append(_grammar_spec(so["grammar"], so.get("grammar_syntax"), "structured_outputs.grammar"))
    if so.get("json_object"):
        out.append(ConstraintSpec.json(options=(("object_only", True),)))
    return out


def parse_openai(body: dict) -> ConstraintSpec | None:
    """The built-in parser (see the module docstring for the fields)."""
    found: list[tuple[str, ConstraintSpec]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if body.get("regex") is not None:
        found.append(("regex", _regex_spec(body["regex"], "regex")))
    if body.get("grammar") is not None:
        found.append(("grammar", _grammar_spec(body["grammar"], body.get("grammar_syntax"), "grammar")))
    if body.get("json_schema") is not None:
        found.append(("json_schema", _schema_spec(body["json_schema"], "json_schema")))
    if body.get("choice") is not None:
        ch = body["choice"]
        _need(isinstance(ch, list) and ch and all(isinstance(c, str) and c for c in ch),
              "choice must be a non-empty list of strings")
        found.append(("choice", ConstraintSpec.choice(ch)))
    if body.get("structured_outputs") is not None:
        found += [("structured_outputs", s) for s in _structured_outputs(body["structured_outputs"])]
    if len(found) > 1:
        raise ConstraintError("only one constraint may be given per request; got " +
                              ", ".join(name for name, _ in found))
    return found[0][1] if found else None


def parse_request(body: dict) -> tuple[ConstraintSpec | None, SpecOptions]:
    """Read a request body with every registered parser (first non-None wins) and the ``specgrammar`` options.
    A ``specgrammar.trigger`` is attached to the constraint."""
    from .plugins import request_parsers

    _need(isinstance(body, dict), "the request body must be a JSON object")
    options = parse_options(body.get("specgrammar"))
    spec = None
    for parser in request_parsers().values():
        spec = parser(body)
        if spec is not None:
            break
    if spec is not None and options.trigger:
        spec = ConstraintSpec(spec.kind, spec.value, spec.syntax, options.trigger, spec.options)
    return spec, options
