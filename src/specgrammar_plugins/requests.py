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

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .constraint import GRAMMAR_SYNTAXES, ConstraintSpec
from .errors import ConstraintError, RequestError
from .recipes.pack import PACK_NAME  # a request names a pack, never a path (``recipes.pack.resolve_name``)

# forced tokens -> a recipe pack -> a draft model; without a draft model: the model's layout -> prompt copy -> the
# online suffix index (factories with nothing to work with drop out: no pack, no draft model).  The draft model comes
# before the model-free drafters: a one-hot prompt-copy or layout draft ahead of it cost the tiny pair at T = 0.7
# (a made-up code: 1.56 tokens per target pass against 2.23 with the model there, tests/test_mlx_law.py)
DEFAULT_DRAFTERS = ("forced", "recipe", "model", "layout", "prompt", "suffix")
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

    @property
    def model_drafts(self) -> bool:
        """Whether the chain drafts with a draft model: ``k`` not 0 and ``model`` among the drafters."""
        return bool(self.k) and "model" in self.drafters


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConstraintError(msg)


def _opt(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise RequestError(f"specgrammar.{name} {msg}", field=f"specgrammar.{name}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A JSON number that is finite (``NaN`` / ``Infinity``, which Python's json module reads, are not)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (isinstance(v, int) or math.isfinite(v)))


OPTION_KEYS = ("k", "drafters", "engine", "recipe", "trigger", "budget", "lambda", "adaptive", "budget_mask")
MAX_BUDGET = 1 << 20
MAX_LAMBDA = 1e6
MAX_TRIGGER_CHARS = 256
MAX_DRAFTERS = 16


def parse_options(obj: Any) -> SpecOptions:
    """The ``specgrammar`` request object.  Every key is checked: an unknown key, a non-finite or out-of-range
    number, or a recipe given as a path raises ``RequestError`` naming the field (servers answer 400)."""
    if obj is None:
        return SpecOptions()
    if not isinstance(obj, dict):
        raise RequestError("'specgrammar' must be an object", field="specgrammar")
    unknown = sorted(str(k_) for k_ in obj if k_ not in OPTION_KEYS)
    if unknown:
        raise RequestError(f"unknown option(s) {', '.join('specgrammar.' + k_ for k_ in unknown)} (known: "
                           f"{', '.join(OPTION_KEYS)})", field=f"specgrammar.{unknown[0]}")
    k = obj.get("k")
    _opt(k is None or (is_int(k) and 0 <= k <= MAX_K), "k", f"must be an integer in [0, {MAX_K}]")
    drafters = obj.get("drafters", DEFAULT_DRAFTERS)
    _opt(isinstance(drafters, (list, tuple)) and len(drafters) <= MAX_DRAFTERS
         and all(isinstance(d, str) for d in drafters), "drafters",
         f"must be a list of at most {MAX_DRAFTERS} drafter names")
    engine = obj.get("engine")
    _opt(engine is None or isinstance(engine, str), "engine", "must be a string")
    recipe = obj.get("recipe")
    _opt(recipe is None or (isinstance(recipe, str) and PACK_NAME.fullmatch(recipe) is not None), "recipe",
         "must be the name of a recipe pack (letters, digits, '_', '-', '.'; not a path)")
    trigger = obj.get("trigger")
    _opt(trigger is None or (isinstance(trigger, str) and 0 < len(trigger) <= MAX_TRIGGER_CHARS), "trigger",
         f"must be a non-empty string of at most {MAX_TRIGGER_CHARS} characters")
    budget = obj.get("budget")
    _opt(budget is None or (is_int(budget) and 0 < budget <= MAX_BUDGET), "budget",
         f"must be an integer in [1, {MAX_BUDGET}]")
    lam = obj.get("lambda")
    _opt(lam is None or (is_number(lam) and 0 <= lam <= MAX_LAMBDA), "lambda",
         f"must be a finite number in [0, {MAX_LAMBDA:g}]")
    adaptive = obj.get("adaptive", False)
    _opt(isinstance(adaptive, bool), "adaptive", "must be true or false")
    budget_mask = obj.get("budget_mask")
    _opt(budget_mask is None or isinstance(budget_mask, bool), "budget_mask", "must be true or false")
    return SpecOptions(k, tuple(drafters), engine, recipe, trigger, budget, None if lam is None else float(lam),
                       adaptive, budget_mask=budget_mask)


def options_in(extra: Any, field: str) -> dict | None:
    """The ``specgrammar`` options a request sent in a host's extension object ``extra``, whose values may be
    strings only (vLLM's ``vllm_xargs``, which reaches the engine as ``SamplingParams.extra_args``): an object, or
    the JSON text of one.  None when ``extra`` holds none; anything else (text that is not JSON, a JSON value that
    is not an object, ``null``) raises ``RequestError`` naming ``field`` (servers answer 400; before the vLLM
    launcher checked it, a non-object there killed vLLM's EngineCore).  The keys are checked by ``parse_options``."""
    if not isinstance(extra, dict) or "specgrammar" not in extra:
        return None
    raw = extra["specgrammar"]
    try:
        opts = json.loads(raw) if isinstance(raw, str) else raw
    except (ValueError, RecursionError):
        opts = None
    if not isinstance(opts, dict):
        raise RequestError(f"{field} must be an object of specgrammar options, sent as a JSON string (or send a "
                           "top-level \"specgrammar\" object)", field=field)
    return opts


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


def _structured_outputs(so: Any, prefix: str = "structured_outputs.") -> list[ConstraintSpec]:
    """``structured_outputs`` as vLLM spells it (``prefix``: how the fields are named in errors)."""
    _need(isinstance(so, dict), "structured_outputs must be an object")
    out = []
    if so.get("json") is not None:
        out.append(_schema_spec(so["json"], f"{prefix}json"))
    if so.get("regex") is not None:
        out.append(_regex_spec(so["regex"], f"{prefix}regex"))
    if so.get("choice") is not None:
        out.append(_choice_spec(so["choice"], f"{prefix}choice"))
    if so.get("grammar") is not None:
        out.append(_grammar_spec(so["grammar"], so.get("grammar_syntax"), f"{prefix}grammar"))
    if so.get("json_object"):
        out.append(ConstraintSpec.json(options=(("object_only", True),)))
    return out


# vLLM's older per-request spellings (removed in vLLM 0.32, which now ignores them): honoured as their
# ``structured_outputs`` equivalents; the two that chose a backend or whitespace are refused (nothing honours them).
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
GUIDED_REFUSED = ("guided_decoding_backend", "guided_whitespace_pattern")
# the top-level fields ``parse_openai`` reads a constraint from, besides ``structured_outputs`` (a host that hands the
# constraint on in its own spelling drops these)
CONSTRAINT_FIELDS = ("response_format", "regex", "grammar", "grammar_syntax", "json_schema", "choice", *GUIDED)


def _choice_spec(ch: Any, where: str) -> ConstraintSpec:
    _need(isinstance(ch, list) and ch and all(isinstance(c, str) and c for c in ch),
          f"{where} must be a non-empty list of non-empty strings")
    return ConstraintSpec.choice(ch)


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
        found.append(("choice", _choice_spec(body["choice"], "choice")))
    if body.get("structured_outputs") is not None:
        found += [("structured_outputs", s) for s in _structured_outputs(body["structured_outputs"])]
    for name in GUIDED_REFUSED:
        if body.get(name) is not None:
            raise RequestError(f"{name} is not supported (vLLM removed it in 0.32); choose the engine with "
                               "specgrammar.engine where the host honours it", field=name)
    for name, so_name in GUIDED.items():
        if body.get(name) is not None:
            found += [(name, s) for s in _structured_outputs({so_name: body[name]}, "guided_")]
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
