"""vLLM's ``StructuredOutputsParams`` <-> our ``ConstraintSpec``, the way vLLM's own backends read them.

The proposer must walk the same language vLLM's structured-output backend masks with, so the mapping follows
``v1/structured_output/backend_xgrammar.py`` (vLLM 0.32): ``json`` -> JSON Schema, ``json_object`` ->
``{"type": "object"}``, ``regex`` as is, ``grammar`` as xgrammar's EBNF (or Lark when vLLM's
``grammar_is_likely_lark`` says so; never our llama.cpp-GBNF fix-ups, which vLLM does not apply), ``choice`` as
vLLM's ``choice_as_grammar`` EBNF (the front end already rewrote it so).  ``structural_tag`` is not mapped (no
grammar drafts for it).  Whitespace: the engine-wide ``disable_any_whitespace`` of ``structured_outputs_config``.
"""

from __future__ import annotations

import json

from specgrammar_plugins.api import ConstraintSpec, compile_as_enforced as _compile_as_enforced, without_strict

# vLLM backend name -> our engine name
ENGINES = {"xgrammar": "xgrammar", "guidance": "llguidance", "outlines": "outlines_core"}


def spec_from_params(so) -> ConstraintSpec | None:
    """The constraint of one request's ``StructuredOutputsParams`` (None when there is none we can map)."""
    if so is None:
        return None
    if getattr(so, "json", None) is not None:
        return ConstraintSpec.json_schema(so.json)
    if getattr(so, "json_object", None):
        return ConstraintSpec.json(options=(("object_only", True),))
    if getattr(so, "regex", None) is not None:
        return ConstraintSpec.regex(so.regex)
    if getattr(so, "choice", None) is not None:
        from vllm.v1.structured_output.utils import choice_as_grammar

        choice = json.loads(so.choice) if isinstance(so.choice, str) else so.choice
        return ConstraintSpec.grammar(choice_as_grammar(list(choice)), "ebnf")
    if getattr(so, "grammar", None) is not None:
        from vllm.v1.structured_output.utils import grammar_is_likely_lark

        return ConstraintSpec.grammar(so.grammar, "lark" if grammar_is_likely_lark(so.grammar) else "ebnf")
    return None


def params_key(so) -> tuple | None:
    """A hashable key of what ``spec_from_params`` reads of ``so`` (the same precedence): equal keys, equal specs.
    Strings are their own key, other values their ``repr`` (``{1: ...}`` and ``{"1": ...}`` stay apart; a key
    order or a spelling that differs only misses).  None when there is no constraint."""
    if so is None:
        return None
    for name in ("json", "json_object", "regex", "choice", "grammar"):
        v = getattr(so, name, None)
        if v is None or (name == "json_object" and not v):
            continue
        if name == "json_object":
            return (name,)
        return (name, v) if isinstance(v, str) else (name, type(v).__name__, repr(v))
    return None


def engine_options(vllm_config) -> tuple[str, dict]:
    """(our engine name, compile options) matching vLLM's structured-output backend configuration."""
    return backend_options(getattr(vllm_config, "structured_outputs_config", None))


def backend_options(so_cfg) -> tuple[str, dict]:
    """(our engine name, compile options) for vLLM's ``structured_outputs_config``: the engine's (``engine_options``)
    or, in the launcher's API server, where no engine config exists, the object of ``--structured-outputs-config``
    (a dict, or None), so the gate compiles with the options the engine enforces (``budget_mask.gate_compile``)."""
    get = so_cfg.get if isinstance(so_cfg, dict) else (lambda name, default=None: getattr(so_cfg, name, default))
    backend = get("backend", "xgrammar") or "xgrammar"
    engine = ENGINES.get(backend, "xgrammar")  # "auto" resolves to xgrammar for what xgrammar supports
    options = {}
    if engine == "xgrammar":  # vLLM 0.32's backend compiles with xgrammar's default, strict_mode on
        options["xgrammar_strict_mode"] = True
    if get("disable_any_whitespace", False):
        options["any_whitespace"] = False
    return engine, options


def compile_as_enforced(spec: ConstraintSpec, tok, engine: str, options: dict):
    """(compiled, lenient): ``spec`` compiled by our engine as vLLM's backend enforces it (``api.compile_as_enforced``
    with vLLM's policy, ``api.without_strict``).  Our strict mode refuses a JSON Schema keyword the engine does not
    enforce (``pattern``, some ``format``s); vLLM 0.32's own xgrammar backend accepts such a request and ignores
    that keyword, so the request is compiled again with ``strict`` off (``lenient`` True), the engine ignoring what
    vLLM's ignores.  The drafts (``proposer``) and the budget mask (``budget_mask.build``) then follow the language
    vLLM's bitmask really enforces.  Our launcher refuses these schemas up front (``serve.py``); this is for every
    other way into the engine (``vllm.LLM``, vLLM's own server).  Other errors stand."""
    return _compile_as_enforced(spec, tok, engine, options, without_strict)


def params_from_spec(spec: ConstraintSpec | None) -> dict | None:
    """Keyword arguments of ``StructuredOutputsParams`` for one of our constraints (tests, benchmarks, clients)."""
    if spec is None:
        return None
    if spec.kind == "json_schema":
        return {"json": spec.schema}
    if spec.kind == "json":
        return {"json_object": True}
    if spec.kind == "regex":
        return {"regex": spec.value}
    if spec.kind == "choice":
        return {"choice": list(spec.value)}
    return {"grammar": spec.value}
