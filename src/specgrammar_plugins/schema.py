"""JSON Schema support policy: which keywords each engine enforces, and the strict check that refuses the rest.

No silent ignoring: in strict mode (the default) every validation keyword of JSON Schema draft 2020-12 (and the
draft-07 spellings still common in the wild) that the chosen engine does not enforce is an error naming the keyword
and its JSON pointer.  Annotations (title, description, default, examples, ...), ``x-*`` extensions and keywords
JSON Schema does not define are ignored, as every validator ignores them.  Turn strict off per request with the
spec option ``("strict", False)`` to let the engine decide (it may then ignore keywords).

The ENFORCED tables were measured, not guessed: ``tests/test_schema_coverage.py`` runs the MaskBench dev corpus
and checks that for every schema we accept, no invalid instance is accepted by the engine's matcher.
"""

from __future__ import annotations

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
    # llguidance refuses what it cannot enforce (oneOf only when provably equal to anyOf); see its json README
    "llguidance": _COMMON | {"oneOf", "multipleOf"},
    # xgrammar 0.2.8 does not intersect allOf branches (MaskBench Github_easy---o58616: invalid instances accepted)
    "xgrammar": _COMMON - {"allOf"},
    "outlines_core": frozenset({"type", "enum", "const", "properties", "required", "items", "prefixItems", "minItems",
                                "maxItems", "anyOf", "$ref", "pattern", "minLength", "maxLength", "format"}),
}
FORMATS: dict[str, frozenset[str]] = {
    "llguidance": frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}),
    "xgrammar": frozenset({"date-time", "time", "date", "email", "ipv4", "ipv6", "uuid", "hostname"}),
    "outlines_core": frozenset({"date-time", "time", "date", "uuid", "email"}),
}
# Schema-valued and list-of-schema keywords (where the walk descends)
_SUB = ("additionalProperties", "items", "not", "contains", "propertyNames", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUB_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _esc(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def walk(schema: Any, pointer: str = "") -> Iterator[tuple[str, str, Any, dict]]:
    """Yield (keyword, JSON pointer of the keyword, value, owning schema) for every keyword of every sub-schema."""
    if not isinstance(schema, dict):
        return
    for kw, val in schema.items():
        yield kw, f"{pointer}/{_esc(kw)}", val, schema
        if kw in _SUB_MAP and isinstance(val, dict):
            for name, sub in val.items():
                yield from walk(sub, f"{pointer}/{_esc(kw)}/{_esc(name)}")
        elif kw in _SUB_LIST and isinstance(val, list):
            for i, sub in enumerate(val):
                yield from walk(sub, f"{pointer}/{_esc(kw)}/{i}")
        elif kw in _SUB and isinstance(val, dict):
            yield from walk(val, f"{pointer}/{_esc(kw)}")
        elif kw == "dependencies" and isinstance(val, dict):
            for name, sub in val.items():
                if isinstance(sub, dict):
                    yield from walk(sub, f"{pointer}/{_esc(kw)}/{_esc(name)}")


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


def check_schema(schema: Any, engine: str) -> SchemaReport:
    """Classify every keyword of ``schema`` for ``engine``."""
    rep = SchemaReport(engine)
    enforced = ENFORCED.get(engine)
    formats = FORMATS.get(engine, frozenset())
    needs_type = _NEEDS_TYPE.get(engine, frozenset())
    has_id = engine in _NO_ID_REFS and any(kw == "$id" for kw, *_ in walk(schema))
    for kw, ptr, val, owner in walk(schema):
        if kw in needs_type and "type" not in owner and not (kw == "additionalProperties" and val is True):
            rep.unsupported.append((f"{kw} (without a sibling 'type')", ptr))
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


def require_supported(schema: Any, engine: str) -> SchemaReport:
    """Strict mode: raise ``ConstraintError`` naming the first unsupported keyword and its JSON pointer."""
    rep = check_schema(schema, engine)
    if rep.unsupported:
        kw, ptr = rep.unsupported[0]
        more = f" (and {len(rep.unsupported) - 1} more)" if len(rep.unsupported) > 1 else ""
        raise ConstraintError(f"JSON Schema keyword '{kw}' at {ptr or '/'} is not enforced by {engine}{more}; "
                              "use another engine, or set strict=false to let the engine ignore it",
                              engine=engine, kind="json_schema")
    return rep


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
