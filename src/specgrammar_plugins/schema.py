"""JSON Schema support policy: which keywords each engine enforces, and the strict check that refuses the rest.

No silent ignoring: in strict mode (the default) every validation keyword of JSON Schema draft 2020-12 (and the
draft-07 spellings still common in the wild) that the chosen engine does not enforce is an error naming the keyword
and its JSON pointer.  Annotations (title, description, default, examples, ...), ``x-*`` extensions and keywords
JSON Schema does not define are ignored, as every validator ignores them.  Turn strict off per request with the
spec option ``("strict", False)`` to let the engine decide (it may then ignore keywords).

Exact rewrites (``schema_rewrite.py``) run first: the check reads the rewritten schema, and names keywords by their
pointer in the schema as given (``origins``).

The ENFORCED tables were measured, not guessed: ``tests/test_schema_keywords.py`` holds every keyword against every
engine on instances that violate only that keyword (each must be rejected, or strict mode must refuse the keyword),
and ``tests/test_schema_coverage.py`` runs the JSON-Schema-Test-Suite and a MaskBench dev sample.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import ConstraintError

# Validation/applicator keywords: the ones that change which instances are valid.
VALIDATION = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
    "contains", "maxProperties", "minProperties", "required", "dependentRequired", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "items", "prefixItems", "additionalItems", "unevaluatedItems",
    "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas",
    "dependencies", "$ref", "$dynamicRef", "$recursiveRef", "contentMediaType", "contentEncoding",
})
# Keywords that hold sub-schemas but do not constrain by themselves.
CONTAINERS = frozenset({"$defs", "definitions"})

_COMMON = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
                     "minItems", "maxItems", "anyOf", "allOf", "$ref", "pattern", "minLength", "maxLength", "format",
                     "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})

ENFORCED: dict[str, frozenset[str]] = {
    # llguidance refuses what it cannot enforce (patternProperties only when disjoint, min/maxProperties only beside
    # all-required properties); see its json README.  Its oneOf (taken only when provably equal to anyOf) is left
    # to schema_rewrite, which proves more and turns it into anyOf, so what is left is refused with its pointer
    "llguidance": _COMMON | {"multipleOf", "patternProperties", "minProperties", "maxProperties"},
    # xgrammar 0.2.8 does not intersect allOf branches (MaskBench Github_easy---o58616: invalid instances accepted),
    # and its JSON Schema pattern is not the regex: "^[0-9](x[0-9]+)?Z$" takes "01Z" (its regex constraints do not)
    "xgrammar": _COMMON - {"allOf", "pattern"},
    # outlines-core 0.2.14's prefixItems accepts no instance at all ([1] for prefixItems [{type: integer}])
    "outlines_core": frozenset({"type", "enum", "const", "properties", "required", "items", "minItems",
                                "maxItems", "anyOf", "$ref", "pattern", "minLength", "maxLength", "format"}),
}
# The formats each engine checks exactly as jsonschema does (tests/test_schema_keywords.py).  date, date-time and
# time are no engine's: every one accepts 2023-02-29 or 12:00:60Z; schema_rewrite turns them into exact patterns.
# duration is left out: jsonschema here has no checker to hold an engine's against.
FORMATS: dict[str, frozenset[str]] = {
    "llguidance": frozenset({"email", "hostname", "ipv4", "ipv6", "uuid", "uri"}),
    "xgrammar": frozenset({"email", "ipv6", "uuid"}),  # its hostname takes 64-byte labels, its ipv4 01.2.3.4
    "outlines_core": frozenset({"uuid"}),  # its email takes ""
}
# Schema-valued and list-of-schema keywords (where the walk descends)
_SUB = ("additionalProperties", "items", "not", "contains", "propertyNames", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUB_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _esc(key: str) -> str:
    if "~" not in key and "/" not in key:  # nearly every key: no copies
        return key
    return key.replace("~", "~0").replace("/", "~1")


def walk(schema: Any, pointer: str = "", origins: dict[int, str] | None = None
         ) -> Iterator[tuple[str, str, Any, dict]]:
    """Yield (keyword, JSON pointer of the keyword, value, owning schema) for every keyword of every sub-schema.

    ``origins`` (id of a sub-schema -> its pointer in the schema as given: ``schema_rewrite.Rewritten.origins``)
    makes the pointers those of the schema before rewriting.  (Collected by plain recursion, then yielded: a
    recursive generator pays one frame per level for every keyword, 2-3x the time on a deep 80 KB schema.)"""
    out: list[tuple[str, str, Any, dict]] = []
    _collect(schema, pointer, origins, out)
    return iter(out)


def _collect(schema: Any, pointer: str, origins: dict[int, str] | None, out: list) -> None:
    if not isinstance(schema, dict):
        return
    if origins:
        pointer = origins.get(id(schema), pointer)
    for kw, val in schema.items():
        p = f"{pointer}/{_esc(kw)}"
        out.append((kw, p, val, schema))
        if kw in _SUB_MAP and isinstance(val, dict):
            for name, sub in val.items():
                _collect(sub, f"{p}/{_esc(name)}", origins, out)
        elif kw in _SUB_LIST and isinstance(val, list):
            for i, sub in enumerate(val):
                _collect(sub, f"{p}/{i}", origins, out)
        elif kw in _SUB and isinstance(val, dict):
            _collect(val, p, origins, out)
        elif kw == "dependencies" and isinstance(val, dict):
            for name, sub in val.items():
                if isinstance(sub, dict):
                    _collect(sub, f"{p}/{_esc(name)}", origins, out)


@dataclass
class SchemaReport:
    engine: str
    enforced: set[str] = field(default_factory=set)  # keywords present and enforced
    ignored: set[str] = field(default_factory=set)  # annotations / unknown keywords (no effect on validity)
    unsupported: list[tuple[str, str]] = field(default_factory=list)  # (keyword, pointer)

    @property
    def ok(self) -> bool:
        return not self.unsupported


# xgrammar 0.2.8 applies type-specific keywords only when the schema names its type: {"minItems": 1} accepts [],
# {"minimum": -2} accepts -3 (JSON-Schema-Test-Suite draft2020-12, measured); and it ignores "$id" when resolving $ref.
_NEEDS_TYPE = {"xgrammar": frozenset({"minItems", "maxItems", "items", "prefixItems", "minLength", "maxLength",
                                      "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                                      "exclusiveMaximum", "required", "properties", "additionalProperties"})}
_NO_ID_REFS = frozenset({"xgrammar"})
# outlines-core 0.2.14 reads {"properties": {"a": false}} ("a" must be absent) as no constraint: {"a": true} passes;
# xgrammar 0.2.8 refuses to compile it ("Schema 'false' cannot accept any value"), in any context
NO_FALSE_PROPERTIES = frozenset({"outlines_core", "xgrammar"})
# xgrammar 0.2.8 and outlines-core 0.2.14 ignore a required key that ``properties`` does not list: {"required":
# ["foo"]} takes {} (JSON-Schema-Test-Suite draft2020-12 items.json "items and subitems"); schema_rewrite lists such
# keys where that is exact (``rewrite(..., list_required=True)``, for LIST_REQUIRED), what is left is refused
UNLISTED_REQUIRED = frozenset({"xgrammar", "outlines_core"})
# llguidance 1.7.6 reads numeric bounds as doubles: {"type": "integer", "maximum": 4611686018427387903} (2^62 - 1, no
# double) took 2^62, "minimum": -4611686018427387903 took -2^62, and even "exclusiveMaximum": 2^62 (a double) took
# 2^62 (invalid instances accepted): a bound past 2^53, where doubles skip integers, is refused for it, except an
# inclusive bound on an integer-only type that is itself a double within +-(2^63-1024), which it holds exactly
# (probed: ``maximum`` 2^63-1024 takes it and refuses 2^63-1023; not so for "number": it took 2^63-1023).
# ``schema_rewrite``'s ``narrow_bounds`` narrows the other integer bounds to such doubles for it (stricter)
DOUBLE_BOUNDS = _DOUBLE_BOUNDS = frozenset({"llguidance"})
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
LIST_REQUIRED = frozenset({"xgrammar"})  # not outlines-core: its regex for {} (any value) compiles past 30 s
# keyword -> siblings beside which the engine ignores it (xgrammar 0.2.8 logs "pattern combined with
# minLength/maxLength is not supported; ignoring minLength/maxLength" and accepts "aa" for {pattern: "^a+$",
# minLength: 3}; a warning it logs that this table misses is refused at compile time, see xgrammar_engine)
_IGNORED_BESIDE = {"xgrammar": {"minLength": ("pattern",), "maxLength": ("pattern",)}}


def _past_doubles(val: Any, kw: str = "", owner: dict | None = None) -> bool:
    """A bound past 2^53 that an engine reading bounds as doubles does not hold exactly (see _DOUBLE_BOUNDS)."""
    if not isinstance(val, (int, float)) or isinstance(val, bool) or abs(val) <= 2 ** 53:
        return False
    t = (owner or {}).get("type")
    types = set(t) if isinstance(t, list) else {t}
    integer_only = "integer" in types and "number" not in types
    exact = math.isfinite(val) and val == int(val) and float(int(val)) == int(val) and abs(val) <= 2 ** 63 - 1024
    return not (kw in ("minimum", "maximum") and integer_only and exact)


def _unlisted(owner: dict, val: Any) -> bool:
    props = owner.get("properties") if isinstance(owner.get("properties"), dict) else {}
    return isinstance(val, list) and any(k not in props for k in val)


def _extra_keys_repeat(owner: dict, val: Any) -> bool:
    """minProperties that extra keys would have to meet: engines do not keep the keys that ``additionalProperties``
    / ``patternProperties`` allow unique (``{"a": 1, "a": 2}`` passes ``minProperties: 2`` token by token, and is
    one property once parsed), so only the required keys plus one more are sure to be distinct."""
    if owner.get("additionalProperties") is False and not owner.get("patternProperties"):
        return False
    req = owner.get("required") if isinstance(owner.get("required"), list) else []
    return isinstance(val, (int, float)) and val > len(set(req)) + 1


def check_schema(schema: Any, engine: str, origins: dict[int, str] | None = None) -> SchemaReport:
    """Classify every keyword of ``schema`` for ``engine`` (``origins``: see ``walk``)."""
    rep = SchemaReport(engine)
    enforced = ENFORCED.get(engine)
    formats = FORMATS.get(engine, frozenset())
    needs_type = _NEEDS_TYPE.get(engine, frozenset())
    ignored_beside = _IGNORED_BESIDE.get(engine, {})
    has_id = engine in _NO_ID_REFS and any(kw == "$id" for kw, *_ in walk(schema))
    for kw, ptr, val, owner in walk(schema, "", origins):
        if kw in needs_type and "type" not in owner and not (kw == "additionalProperties" and val is True):
            rep.unsupported.append((f"{kw} (without a sibling 'type')", ptr))
            continue
        beside = [s for s in ignored_beside.get(kw, ()) if s in owner]
        if beside:
            rep.unsupported.append((f"{kw} (beside '{beside[0]}')", ptr))
            continue
        if kw == "minProperties" and _extra_keys_repeat(owner, val):
            rep.unsupported.append(("minProperties (counting keys that may repeat)", ptr))
            continue
        if kw == "properties" and engine in NO_FALSE_PROPERTIES and isinstance(val, dict) and False in val.values():
            rep.unsupported.append(("properties (a property that must be absent: false)", ptr))
            continue
        if kw in _BOUNDS and engine in _DOUBLE_BOUNDS and _past_doubles(val, kw, owner):
            rep.unsupported.append((f"{kw} ({val}: past 2^53, where llguidance's doubles skip integers)", ptr))
            continue
        if kw == "required" and engine in UNLISTED_REQUIRED and _unlisted(owner, val):
            rep.unsupported.append(("required (a key that properties does not list)", ptr))
            continue
        if kw == "$ref" and has_id:
            rep.unsupported.append(("$ref (with $id base URIs)", ptr))
            continue
        if kw in CONTAINERS or kw.startswith("x-"):
            continue
        if kw not in VALIDATION:
            rep.ignored.add(kw)
            continue
        if kw in ("if", "then", "else") and kw != "if" and "if" not in owner:
            rep.ignored.add(kw)  # then/else without if have no effect
            continue
        if kw == "additionalProperties" and val is True:
            rep.enforced.add(kw)
            continue
        if kw == "uniqueItems" and val is False or kw in ("minItems", "minLength", "minProperties") and val == 0:
            rep.enforced.add(kw)  # no-op values
            continue
        if enforced is None or kw in enforced:
            if kw == "format" and enforced is not None and val not in formats:
                rep.unsupported.append((f"format: {val}", ptr))
                continue
            if kw == "$ref" and isinstance(val, str) and not val.startswith("#"):
                rep.unsupported.append(("$ref (remote)", ptr))
                continue
            rep.enforced.add(kw)
        else:
            rep.unsupported.append((kw, ptr))
    return rep


def refusal(keyword: str, pointer: str, engine: str, more: int = 0, why: str = "") -> ConstraintError:
    """Strict mode's error for a keyword ``engine`` does not enforce."""
    more_s = f" (and {more} more)" if more else ""
    why_s = f" ({why})" if why else ""
    return ConstraintError(f"JSON Schema keyword '{keyword}' at {pointer or '/'} is not enforced by {engine}{more_s}"
                           f"{why_s}; use another engine, or set strict=false to let the engine ignore it",
                           engine=engine, kind="json_schema")


def require_supported(schema: Any, engine: str, origins: dict[int, str] | None = None) -> SchemaReport:
    """Strict mode: raise ``ConstraintError`` naming the first unsupported keyword and its JSON pointer."""
    rep = check_schema(schema, engine, origins)
    if rep.unsupported:
        kw, ptr = rep.unsupported[0]
        raise refusal(kw, ptr, engine, len(rep.unsupported) - 1)
    return rep


_IGNORING = re.compile(r"ignoring ([A-Za-z$]+(?:/[A-Za-z$]+)*)")


def ignored_in_warning(schema: Any, message: str) -> tuple[str, str] | None:
    """(keyword, pointer) an engine's warning says it ignores ("...; ignoring minLength/maxLength"), found in
    ``schema``: the first place holding that keyword beside every other keyword the message names.  None when the
    message names no ignored keyword."""
    m = _IGNORING.search(message)
    if m is None:
        return None
    ignored = m.group(1).split("/")
    named = [k for k in re.findall(r"[A-Za-z$]+", message[: m.start()]) if k in VALIDATION and k not in ignored]
    best = None
    for kw, ptr, _, owner in walk(schema):
        if kw in ignored:
            if all(k in owner for k in named):
                return kw, ptr
            best = best or (kw, ptr)
    return best or (ignored[0], "")


_COUNTS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
                     "minContains", "maxContains"})


def normalize(schema: Any) -> Any:
    """Integral decimals in count keywords become integers (``"minItems": 2.0`` means 2 in JSON Schema; llguidance
    1.7 silently ignored the decimal spelling: JSON-Schema-Test-Suite 'minItems validation with a decimal')."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k in _COUNTS and isinstance(v, float) and v.is_integer():
                out[k] = int(v)
            elif k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(v, dict):
                out[k] = {name: normalize(sub) for name, sub in v.items()}
            elif k in ("enum", "const", "default", "examples", "required"):
                out[k] = v  # data, not schemas
            else:
                out[k] = normalize(v)
        return out
    if isinstance(schema, list):
        return [normalize(x) for x in schema]
    return schema
