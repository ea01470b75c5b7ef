"""Exact JSON Schema rewrites, applied before an engine compiles a schema: keywords no engine enforces, turned
into equivalent forms the engines do enforce.

Every rewrite here but one (``narrow_bounds``, below) is exact (the rewritten schema accepts exactly the instances
the original accepts; held against ``jsonschema`` on generated valid and invalid instances in
``tests/test_schema_rewrite.py``), and every one is reported (``Rewrite``: keyword, JSON pointer in the caller's
schema, what it became).  What has no exact rewrite is left as it is, and strict mode then refuses it with its
pointer (``schema.require_supported``).

- older drafts' spellings: ``definitions`` -> ``$defs`` (``$ref`` fixed up); ``items: [...]`` + ``additionalItems``
  -> ``prefixItems`` + ``items``; ``dependencies`` -> ``dependentRequired`` / ``dependentSchemas``; draft-04's
  boolean ``exclusiveMinimum``/``exclusiveMaximum`` -> the numeric keywords;
- ``dependentRequired`` / ``dependentSchemas`` -> ``anyOf`` [the key is absent, the dependency holds];
- ``format`` int8 .. uint64 on an integer/number type -> ``type: integer`` + ``minimum``/``maximum`` (the format
  asserts "an integer in range" of numbers, OpenAPI's meaning; other types are unaffected);
- ``not`` with an exact positive form: ``not {type}`` -> the other types; ``not {const/enum}`` on a finite domain
  (the sibling ``enum``/``const``, boolean, null); ``not {required: [k]}`` -> an object without ``k``; bounds
  (``not {minimum: m}`` -> a non-number or a number below m, likewise lengths and counts); ``not`` of ``anyOf`` /
  ``allOf`` / ``not`` / a local ``$ref`` by De Morgan when every part negates;
- ``oneOf`` -> ``anyOf`` when its branches are pairwise disjoint (by type, ``const``/``enum``, or a property that
  one side requires and the other side's schema for it excludes: a discriminator), or when the overlapping
  branches negate exactly (``oneOf [{required: [a]}, {required: [b]}]`` -> ``anyOf`` [a and not b, b and not a]);
- ``if``/``then``/``else`` -> ``anyOf`` (``if`` without ``then``: ``anyOf [if, else]``; otherwise ``not if`` must
  negate exactly);
- ``minProperties``/``maxProperties`` on an object whose property set is finite (``additionalProperties: false``,
  no ``patternProperties``) -> ``anyOf`` over which optional properties are present (at most 64 branches; left to
  an engine that counts keys itself: ``native``);
- ``uniqueItems`` where at most one item is allowed -> dropped;
- a finite domain (``enum``/``const``, here or in an ``allOf`` member) holding a keyword no engine enforces ->
  ``enum`` of the values that pass, as jsonschema judges them; ``enum`` beside a ``type`` some values lack ->
  the values of that type.

One rewrite is not exact, and only for llguidance (``narrow_bounds``): an integer bound past 2^53 that llguidance
1.7.6 cannot hold exactly (it reads bounds as doubles) is narrowed to the nearest double inside it (int64's
-2^63 .. 2^63-1 -> -2^63+1024 .. 2^63-1024): stricter, never looser, so every output stays valid, and at most the
1,024 integers at each end are no longer generated.

A rewrite never moves what a local ``$ref`` points into, and one whose ``anyOf``s would intersect into more than 64
alternatives (llguidance expands them; past its parser limits it fails while matching) is not made.  Schemas with
a nested ``$id`` (draft-04: ``id``) and ``$ref``s are left as they are (their refs resolve against other bases).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from .schema import _SUB, _SUB_LIST, _SUB_MAP, _esc, walk

DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07", "draft/2019-09")
MAX_BRANCHES = 64  # combinatorial rewrites (minProperties, oneOf exclusions) past this stay refused
_MAX_DEPTH = 12  # $ref chains followed when proving disjointness / negating

# canonical type atoms: "number" is integer + fraction
_ATOMS = frozenset({"null", "boolean", "object", "array", "string", "integer", "fraction"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "markdownDescription",
                         "enumDescriptions", "markdownEnumDescriptions", "errorMessage"})
# RFC 3339 as jsonschema checks it (its date: Python's date.fromisoformat; date-time and time: rfc3339-validator,
# "t"/"z" in either case): years 0001-9999, days that exist in their month and year (leap years), seconds 00-59
# (no leap second), optional fraction, offset Z or +hh:mm.  Engines' own formats accept 2023-02-29 or 12:00:60Z.
_D = "[0-9]"
_YEAR = f"(?:000[1-9]|00[1-9]{_D}|0[1-9]{_D}{{2}}|[1-9]{_D}{{3}})"
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              "|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_LEAP = f"(?:{_D}{{2}}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)"
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}[Tt]{_TIME}$", "time": f"^{_TIME}$"}
INT_FORMATS = {f"{'u' if u else ''}int{b}": ((0, 2 ** b - 1) if u else (-2 ** (b - 1), 2 ** (b - 1) - 1))
               for b in (8, 16, 32, 64) for u in (False, True)}


@dataclass(frozen=True)
class Rewrite:
    keyword: str
    pointer: str  # where the keyword is in the schema as given
    into: str  # what it became

    def __str__(self) -> str:
        return f"{self.keyword} at {self.pointer or '/'} -> {self.into}"


@dataclass
class Rewritten:
    schema: Any
    rewrites: tuple[Rewrite, ...] = ()
    # id(sub-schema dict in ``schema``) -> its JSON pointer in the schema as given, so strict mode names keywords
    # where the caller wrote them (valid while ``schema`` is alive)
    origins: dict[int, str] = field(default_factory=dict)


def ptr_of(ref: str) -> str:
    """The JSON pointer of a local ``$ref`` ("#/a/b" -> "/a/b"; "#" -> "")."""
    from urllib.parse import unquote

    return unquote(ref[1:])


def json_equal(a: Any, b: Any) -> bool:
    """JSON Schema equality: numbers by value (1 == 1.0), booleans apart from numbers, containers deeply."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _atom_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if isinstance(value, int) or (math.isfinite(value) and value.is_integer()) else "fraction"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def atoms(type_value: Any) -> frozenset[str] | None:
    """The type atoms a ``type`` keyword allows (None: not a valid ``type`` value)."""
    names = [type_value] if isinstance(type_value, str) else type_value
    if not isinstance(names, list):
        return None
    out: set[str] = set()
    for n in names:
        if n == "number":
            out |= {"integer", "fraction"}
        elif n in _ATOMS and n != "fraction":
            out.add(n)
        else:
            return None
    return frozenset(out)


def type_value(a: frozenset[str]) -> Any:
    """The ``type`` keyword for a set of atoms (None when it has no spelling: fractions without integers)."""
    if "fraction" in a and "integer" not in a:
        return None
    names = sorted(x for x in a if x not in ("integer", "fraction"))
    if "fraction" in a:
        names.append("number")
    elif "integer" in a:
        names.append("integer")
    return names[0] if len(names) == 1 else names


def _is_trivial(s: Any) -> bool:
    """True for a schema every instance satisfies (``true``, ``{}``, annotations only)."""
    return s is True or (isinstance(s, dict) and all(k in ANNOTATIONS or k.startswith("x-") for k in s))


def _only(s: dict) -> dict:
    """The keywords of ``s`` that constrain (annotations and extensions left out)."""
    return {k: v for k, v in s.items() if k not in ANNOTATIONS and not k.startswith("x-")}


def _any_of(parts: list) -> Any:
    """anyOf of ``parts``, simplified (false dropped, true absorbs, one part is itself)."""
    flat: list = []
    for p in parts:
        if p is True or _is_trivial(p):
            return True
        if p is False:
            continue
        if isinstance(p, dict) and list(_only(p)) == ["anyOf"]:
            flat.extend(p["anyOf"])
        else:
            flat.append(p)
    if not flat:
        return False
    return flat[0] if len(flat) == 1 else {"anyOf": flat}


def _all_of(parts: list) -> Any:
    flat: list = []
    for p in parts:
        if p is False:
            return False
        if p is True or _is_trivial(p):
            continue
        flat.append(p)
    if not flat:
        return True
    if len(flat) == 1:
        return flat[0]
    merged = flat[0]
    rest = []
    for p in flat[1:]:
        m = merge(merged, p) if isinstance(merged, dict) else None
        if m is False:
            return False
        if m is None:
            rest.append(p)
        else:
            merged = m
    return merged if not rest else {"allOf": [merged, *rest]}


# keywords no engine enforces (a finite domain is then worth evaluating)
_UNENFORCEABLE = frozenset({"not", "oneOf", "if", "uniqueItems", "contains", "minContains", "maxContains",
                            "propertyNames", "unevaluatedProperties", "unevaluatedItems", "dependencies",
                            "dependentRequired", "dependentSchemas", "$dynamicRef", "$recursiveRef"})
_OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "patternProperties", "minProperties",
                              "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas"})
# keywords whose meaning depends on siblings: merging them into another schema may change what they mean
_CONTEXTUAL = frozenset({"additionalProperties", "patternProperties", "properties", "items", "prefixItems",
                         "additionalItems", "unevaluatedItems", "unevaluatedProperties", "if", "then", "else",
                         "contains", "minContains", "maxContains", "$ref", "$defs", "definitions",
                         "dependentSchemas", "dependencies"})


def _truth(s: Any) -> bool | None:
    """True for a schema every instance passes, False for one none passes, None for the rest."""
    if s is True or _is_trivial(s):
        return True
    return False if s is False else None


def merge(a: dict, b: Any) -> Any:
    """``a`` and ``b`` as one schema object when that is plainly exact, else None (the caller uses allOf)."""
    truth = _truth(b)
    if truth is not None:
        return a if truth else False
    if not isinstance(b, dict):
        return None
    out = dict(a)
    for k, v in _only(b).items():
        if k not in out:
            if k in _CONTEXTUAL and not _closed_props_ok(k, v, out):
                return None
            out[k] = v
        elif k == "type":
            x, y = atoms(out[k]), atoms(v)
            if x is None or y is None:
                return None
            if not x & y:
                return False
            t = type_value(x & y)
            if t is None:
                return None
            out[k] = t
        elif k in ("enum", "const") and _values({k: v}) is not None and _values(out) is not None:
            common = [x for x in _values(out) if any(json_equal(x, y) for y in _values({k: v}))]
            if not common:
                return False
            out.pop("const", None)
            out["enum"] = common
        elif k == "required" and isinstance(v, list) and isinstance(out[k], list):
            out[k] = out[k] + [r for r in v if r not in out[k]]
        elif k == "properties" and isinstance(v, dict) and isinstance(out[k], dict) and all(
                x is False for x in v.values()):
            out[k] = {**out[k], **v}  # an absent key stays absent whatever the other side says of it
        elif json_equal(out[k], v):
            continue
        else:
            return None
    return out


def _closed_props_ok(k: str, v: Any, into: dict) -> bool:
    """Adding ``properties`` that only forbid keys is exact whatever the siblings; anything else contextual is
    exact only into a schema that has none of the keywords it interacts with."""
    if k == "properties" and isinstance(v, dict) and all(x is False for x in v.values()):
        return True
    return not any(c in into for c in _CONTEXTUAL)


# The rewriter's steps, in order, each with the keywords without which it returns the node as it is
_STEPS: tuple[tuple[str, frozenset[str]], ...] = tuple((name, frozenset(kws)) for name, kws in (
    ("_finite_domain", ("enum", "const", "allOf")),
    ("_enum_type", ("enum", "const")),
    ("_ref_siblings", ("$ref",)),
    ("_tuple_items", ("items", "additionalItems")),
    ("_dependencies", ("dependencies", "dependentRequired", "dependentSchemas")),
    ("_required_listed", ("required",)),
    ("_draft4_exclusive", ("exclusiveMinimum", "exclusiveMaximum")),
    ("_format", ("format",)),
    ("_not", ("not",)),
    ("_if", ("if",)),
    ("_one_of", ("oneOf",)),
    ("_property_counts", ("minProperties", "maxProperties")),
    ("_unique_items", ("uniqueItems",)),
))


class _Rewriter:
    def __init__(self, root: Any, native: frozenset[str] = frozenset(), list_required: bool = False,
                 false_properties: bool = True):
        self.root = root
        self.list_required = list_required
        self.false_properties = false_properties
        self.rewrites: dict[tuple[str, str], Rewrite] = {}
        self.origins: dict[int, str] = {}
        sch = root.get("$schema")
        self.old_draft = isinstance(sch, str) and any(d in sch for d in _OLD_DRAFTS)
        draft4 = isinstance(sch, str) and ("draft-04" in sch or "draft-03" in sch)
        self._ref_memo: dict[str, Any] = {}
        self._in_progress: set[str] = set()
        self._from_dependencies: set[str] = set()  # pointers whose dependentRequired/-Schemas were dependencies
        self._facts: dict[int, tuple[Any, Any]] = {}
        self.native = native
        # where local $refs point: a rewrite never moves what a $ref points into
        self._targets: list[str] = []
        self._check = None  # jsonschema validator for the schema as given (finite domains), built when first needed
        # a nested $id (draft-04: id) moves the base of the $refs below it: such schemas are not rewritten
        found = set()
        for kw, ptr, v, _ in walk(root):  # one walk for both
            if kw == "$ref":
                found.add(kw)
                if isinstance(v, str) and v.startswith("#"):
                    self._targets.append(ptr_of(v))
            elif (kw == "$id" or kw == "id" and draft4) and ptr.count("/") > 1 and isinstance(v, str):
                found.add(kw)
        self.nested_ids = "$ref" in found and len(found) > 1

    def note(self, keyword: str, pointer: str, into: str) -> None:
        self.rewrites.setdefault((keyword, pointer), Rewrite(keyword, pointer, into))

    def pinned(self, pointer: str) -> bool:
        """Whether a $ref points at or into ``pointer`` (then what is there must stay where it is)."""
        return any(t == pointer or t.startswith(pointer + "/") for t in self._targets)

    # ------------------------------------------------------------------ the walk
    def node(self, s: Any, ptr: str) -> Any:
        if not isinstance(s, dict):
            return s
        out: dict = {}
        for kw, v in s.items():
            p = f"{ptr}/{_esc(kw)}"
            if kw in _SUB_MAP and isinstance(v, dict):
                out[kw] = {name: self.node(sub, f"{p}/{_esc(name)}") for name, sub in v.items()}
            elif kw in _SUB_LIST and isinstance(v, list):
                out[kw] = [self.node(sub, f"{p}/{i}") for i, sub in enumerate(v)]
            elif kw in _SUB and isinstance(v, (dict, bool)):
                out[kw] = self.node(v, p)
            elif kw == "dependencies" and isinstance(v, dict):
                out[kw] = {n: self.node(sub, f"{p}/{_esc(n)}") if isinstance(sub, (dict, bool)) else sub
                           for n, sub in v.items()}
            else:
                out[kw] = v
        for name, triggers in _STEPS:
            if triggers.isdisjoint(out):
                continue  # the step returns the node as it is without one of these (a call per node and step saved)
            noted = len(self.rewrites)
            new = getattr(self, name)(out, ptr)
            if new is out:
                continue
            if isinstance(new, dict) and _branches(new) > max(MAX_BRANCHES, _branches(out)):
                # the engines would expand the intersection of these anyOfs into this many alternatives
                # (llguidance: a parser row past its limit while matching): not rewritten
                for key in list(self.rewrites)[noted:]:
                    del self.rewrites[key]
                continue
            out = new
            if not isinstance(out, dict):
                return out
        self.origins[id(out)] = ptr
        return out

    # ------------------------------------------------------------------ finite domains
    def _finite_domain(self, s: dict, ptr: str) -> Any:
        """A schema whose values are a finite set (its ``enum``/``const``, or an ``allOf`` member's) and that uses a
        keyword no engine enforces -> ``enum`` of the values that pass it, as jsonschema judges them (the schema as
        given, its declared draft).  Left alone where a format is involved (whether jsonschema checks one depends
        on optional packages) or where a $ref points inside."""
        if "enum" not in s and "const" not in s and "allOf" not in s:
            return s
        orig = self.original(ptr)
        if not isinstance(orig, dict):
            return s
        vals = _values(orig)
        for m in orig.get("allOf", []) if isinstance(orig.get("allOf"), list) else []:
            mv = _values(m)
            if mv is not None:
                vals = mv if vals is None else [v for v in vals if any(json_equal(v, w) for w in mv)]
        if vals is None or len(vals) > 256:
            return s
        kws = {kw for kw, *_ in walk(orig)}
        hard = kws & _UNENFORCEABLE
        if not hard or "format" in kws or any(t.startswith(ptr + "/") for t in self._targets):
            return s
        check = self.validator()
        if check is None:
            return s
        try:
            sub = check.evolve(schema=orig)
            keep = [v for v in vals if sub.is_valid(v)]
        except Exception:  # noqa: BLE001 - a $ref jsonschema cannot resolve here, an odd schema: no rewrite
            return s
        for kw in sorted(hard):
            self.note(kw, f"{ptr}", f"enum of the {len(keep)} of {len(vals)} values that pass (a finite domain)")
        if not keep:
            return False
        return {**{k: v for k, v in s.items() if k in ANNOTATIONS}, "enum": keep}

    def _enum_type(self, s: dict, ptr: str) -> Any:
        """``enum``/``const`` beside a ``type`` some of its values do not have -> ``enum`` of those that do
        (xgrammar 0.2.8 reads the enum and drops the type: {"type": "object", "enum": ["A"]} took "A")."""
        vals = _values(s)
        a = atoms(s["type"]) if "type" in s else None
        if vals is None or a is None:
            return s
        keep = [v for v in vals if _atom_of(v) in a]
        if len(keep) == len(vals):
            return s
        self.note("type", f"{ptr}/type", f"enum of the {len(keep)} of {len(vals)} values of that type")
        if not keep:
            return False
        return {**{k: v for k, v in s.items() if k not in ("type", "enum", "const")}, "enum": keep}

    def original(self, ptr: str) -> Any:
        """The sub-schema at JSON pointer ``ptr`` in the schema as given (None when there is none)."""
        node: Any = self.root
        for part in ptr.split("/")[1:] if ptr else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def validator(self):
        """jsonschema's validator for the schema as given (its declared draft; no network: remote $refs fail)."""
        if self._check is None:
            from jsonschema import Draft202012Validator, validators
            from referencing import Registry

            def no_retrieval(uri: str):
                raise LookupError(f"remote $ref {uri}")

            try:
                cls = validators.validator_for(self.root, default=Draft202012Validator)
                self._check = cls(self.root, registry=Registry(retrieve=no_retrieval))
            except Exception:  # noqa: BLE001 - a schema jsonschema cannot read
                self._check = False
        return self._check or None

    # ------------------------------------------------------------------ older drafts
    def _tuple_items(self, s: dict, ptr: str) -> dict:
        items = s.get("items")
        if isinstance(items, list) and "prefixItems" not in s and not self.pinned(f"{ptr}/items"):
            extra = s.get("additionalItems", True)
            repl = [("prefixItems", items)] + ([] if extra is True else [("items", extra)])
            s = _replace(s, "items", repl)
            s.pop("additionalItems", None)
            self.note("items", f"{ptr}/items",
                      "prefixItems" + ("" if extra is True else " + items (from additionalItems)"))
        elif "additionalItems" in s and not isinstance(items, list):
            s = dict(s)
            s.pop("additionalItems")
            self.note("additionalItems", f"{ptr}/additionalItems", "dropped (no effect without an items array)")
        return s

    def _dependencies(self, s: dict, ptr: str) -> dict:
        deps = s.get("dependencies")
        if not isinstance(deps, dict) or self.pinned(f"{ptr}/dependencies"):
            return self._dependent(s, ptr)
        req = dict(s.get("dependentRequired", {}))
        sch = dict(s.get("dependentSchemas", {}))
        for name, d in deps.items():
            if isinstance(d, list):
                req[name] = list(req.get(name, [])) + [x for x in d if x not in req.get(name, [])]
            elif name in sch:
                sch[name] = {"allOf": [sch[name], d]}
            else:
                sch[name] = d
        repl = ([("dependentRequired", req)] if req else []) + ([("dependentSchemas", sch)] if sch else [])
        self._from_dependencies.add(ptr)
        return self._dependent(_replace(s, "dependencies", repl), ptr)

    def _draft4_exclusive(self, s: dict, ptr: str) -> dict:
        for ex, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            v = s.get(ex)
            if not isinstance(v, bool):
                continue
            if v and _num(s.get(bound)):
                s = _replace(s, bound, [(ex, s[bound])])
                self.note(ex, f"{ptr}/{ex}", f"{ex}: {s[ex]} (draft-04's boolean form)")
            else:
                s = {k: x for k, x in s.items() if k != ex}
                self.note(ex, f"{ptr}/{ex}", "dropped (draft-04's boolean form without effect here)")
        return s

    def _ref_siblings(self, s: dict, ptr: str) -> dict:
        """Before draft 2019-09 the keywords beside ``$ref`` are ignored: they go (annotations and ``$defs`` /
        ``definitions``, which ``$ref``s may point into, stay)."""
        if not self.old_draft or not isinstance(s.get("$ref"), str):
            return s
        dropped = [k for k in _only(s) if k not in ("$ref", "$defs", "definitions")]
        if not dropped or any(self.pinned(f"{ptr}/{k}") for k in dropped):
            return s
        self.note("$ref", f"{ptr}/$ref", f"alone (beside it {', '.join(dropped)} had no effect before draft 2019-09)")
        return {k: v for k, v in s.items() if k not in dropped}

    # ------------------------------------------------------------------ dependencies as anyOf
    def _dependent(self, s: dict, ptr: str) -> Any:
        if not self.false_properties:  # ("the key is absent" is {"properties": {key: false}}: see rewrite())
            return s
        conds = []
        for kw in ("dependentRequired", "dependentSchemas"):
            deps = s.get(kw)
            if not isinstance(deps, dict) or self.pinned(f"{ptr}/{kw}") or self.pinned(f"{ptr}/dependencies"):
                continue
            for name, d in deps.items():
                then = {"required": d} if kw == "dependentRequired" else d
                if kw == "dependentRequired" and (not isinstance(d, list) or not d):
                    continue
                conds.append(_any_of([{"properties": {name: False}}, then]))
            s = {k: v for k, v in s.items() if k != kw}
            src = "dependencies" if ptr in self._from_dependencies else kw
            self.note(src, f"{ptr}/{src}", "anyOf [the property is absent, the dependency holds]")
        for c in conds:
            s = conjoin(s, c)
        return s

    # ------------------------------------------------------------------ format: integer widths
    def _format(self, s: dict, ptr: str) -> Any:
        fmt = s.get("format")
        if fmt in FORMAT_PATTERNS:
            self.note("format", f"{ptr}/format", f"pattern (RFC 3339 {fmt}: days of the month and leap years)")
            return conjoin({k: v for k, v in s.items() if k != "format"}, {"pattern": FORMAT_PATTERNS[fmt]})
        if fmt not in INT_FORMATS or "type" not in s:
            return s
        a = atoms(s["type"])
        if a is None or "string" in a or not (a & {"integer", "fraction"}):
            return s  # a string holding an integer (Google's spelling) or no number at all: not rewritten
        lo, hi = INT_FORMATS[fmt]
        out = {k: v for k, v in s.items() if k != "format"}
        out["type"] = type_value((a - {"fraction"}) | {"integer"})
        if not _num(out.get("minimum")) or out["minimum"] < lo:
            out["minimum"] = lo
        if not _num(out.get("maximum")) or out["maximum"] > hi:
            out["maximum"] = hi
        self.note("format", f"{ptr}/format", f"type integer, minimum {lo}, maximum {hi} ({fmt})")
        return out

    # ------------------------------------------------------------------ not
    def _not(self, s: dict, ptr: str) -> Any:
        if "not" not in s or self.pinned(f"{ptr}/not"):
            return s
        n = s["not"]
        neg = self.negate(n, 0)
        how = "its positive form"
        if neg is None:
            neg = self._not_type_in_owner(s, n)
            how = "the other types"
        if neg is None:
            neg = self._not_in_domain(s, n)
            how = "the rest of a finite domain"
        if neg is None:
            return s
        rest = {k: v for k, v in s.items() if k != "not"}
        self.note("not", f"{ptr}/not", how)
        return conjoin(rest, neg)

    def _not_type_in_owner(self, s: dict, n: Any) -> Any:
        """``not {type}`` beside a ``type`` that leaves a spelling (``[integer, string]`` minus integer)."""
        if not isinstance(n, dict) or set(_only(n)) != {"type"} or "type" not in s:
            return None
        owner, banned = atoms(s["type"]), atoms(n["type"])
        if owner is None or banned is None:
            return None
        rest = owner - banned
        return False if not rest else _typed(rest)

    def _not_in_domain(self, s: dict, n: Any) -> Any:
        """``not {const/enum}`` where the sibling ``enum``/``const``/``type`` leaves finitely many values."""
        if not isinstance(n, dict) or set(_only(n)) - {"const", "enum"} or not _only(n):
            return None
        banned = _values(n)
        if banned is None:
            return None
        domain = _values(s)
        if domain is None and "type" in s:
            a = atoms(s["type"])
            if a is not None and a <= {"boolean", "null"}:
                domain = ([True, False] if "boolean" in a else []) + ([None] if "null" in a else [])
        if domain is None:
            return None
        keep = [v for v in domain if not any(json_equal(v, b) for b in banned)]
        return {"enum": keep} if keep else False

    def negate(self, n: Any, depth: int) -> Any:
        """A positive schema accepting exactly what ``n`` rejects, or None when there is none we can write."""
        truth = _truth(n)
        if truth is not None:
            return not truth
        if depth > _MAX_DEPTH or not isinstance(n, dict):
            return None
        kws = _only(n)
        if self.old_draft and isinstance(kws.get("$ref"), str):
            kws = {"$ref": kws["$ref"]}  # its siblings had no effect
        vals = _values(kws)
        if vals is not None and set(kws) <= {"const", "enum", "type"} and "type" in kws:
            a = atoms(kws["type"])  # a finite set of values of some types: not those values
            if a is None:
                return None
            kws = {"enum": [x for x in vals if _atom_of(x) in a]}
        if len(kws) > 1:
            if set(kws) & _CONTEXTUAL - {"properties", "$ref"} or ("properties" in kws and (
                    {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(kws))):
                return None
            parts = [self.negate({k: v}, depth + 1) for k, v in kws.items()]
            return None if any(p is None for p in parts) else _any_of(parts)
        (k, v), = kws.items()
        if k == "type":
            a = atoms(v)
            if a is None:
                return None
            rest = _ATOMS - a
            return False if not rest else _typed(rest)
        if k == "required" and isinstance(v, list):
            if not v:
                return False
            if not self.false_properties:
                return None
            absent = [{"properties": {key: False}} for key in dict.fromkeys(v)]
            return {"type": "object", **(absent[0] if len(absent) == 1 else {"anyOf": absent})}
        if k in ("const", "enum"):
            vals = _values(n)
            if vals is None:
                return None
            if not vals:
                return True
            hit = {_atom_of(x) for x in vals}
            if hit & {"integer", "fraction"}:
                hit |= {"integer", "fraction"}
            if hit - {"boolean", "null"}:
                return None  # infinitely many strings/numbers/... remain: no finite enum says "not these"
            free = _ATOMS - hit
            keep = [x for x in ([True, False] if "boolean" in hit else []) + ([None] if "null" in hit else [])
                    if not any(json_equal(x, b) for b in vals)]
            return _any_of([_typed(free)] + ([{"enum": keep}] if keep else []))
        bound = _NEGATED_BOUNDS.get(k)
        if bound is not None and _num(v):
            # every other type satisfies the bound: what fails it is a value of its type beyond it
            applies, inner = bound[0], bound[1](v)
            return False if inner is False else {"type": type_value(applies), **inner}
        if k == "not":
            return v
        if k == "anyOf" and isinstance(v, list):
            parts = [self.negate(x, depth + 1) for x in v]
            return None if any(p is None for p in parts) else _all_of(parts)
        if k == "allOf" and isinstance(v, list):
            parts = [self.negate(x, depth + 1) for x in v]
            return None if any(p is None for p in parts) else _any_of(parts)
        if k == "$ref" and isinstance(v, str):
            target = self.resolve(v)
            return None if target is None else self.negate(target, depth + 1)
        if k == "properties" and isinstance(v, dict):
            parts = []
            for key, sub in v.items():
                ns = self.negate(sub, depth + 1)
                if ns is None:
                    return None
                if ns is False:
                    continue
                parts.append({"type": "object", "required": [key], "properties": {key: ns}}
                             if ns is not True else {"type": "object", "required": [key]})
            return _any_of(parts)
        return None

    def resolve(self, ref: str) -> Any:
        """The (rewritten) sub-schema a local ``$ref`` points at; None for remote or unresolvable refs."""
        if not ref.startswith("#") or self.nested_ids:
            return None
        if ref in self._ref_memo:
            return self._ref_memo[ref]
        if ref in self._in_progress:
            return None
        node = self.original(ptr_of(ref))
        if node is None:
            return None
        self._in_progress.add(ref)
        try:
            out = self.node(node, ref[1:]) if isinstance(node, (dict, bool)) else None
        finally:
            self._in_progress.discard(ref)
        self._ref_memo[ref] = out
        return out

    # ------------------------------------------------------------------ if / then / else
    def _if(self, s: dict, ptr: str) -> Any:
        if "if" not in s or any(self.pinned(f"{ptr}/{k}") for k in ("if", "then", "else")):
            return s
        cond, then, other = s["if"], s.get("then", True), s.get("else", True)
        rest = {k: v for k, v in s.items() if k not in ("if", "then", "else")}
        if _is_trivial(then) and _is_trivial(other):
            out = rest
        elif _is_trivial(then):
            out = conjoin(rest, _any_of([cond, other]))
        else:
            neg = self.negate(cond, 0)
            if neg is None:
                return s
            out = conjoin(rest, _any_of([_all_of([cond, then]), _all_of([neg, other])]))
        self.note("if", f"{ptr}/if", "anyOf [if and then, not-if and else]")
        return out

    # ------------------------------------------------------------------ oneOf
    def _one_of(self, s: dict, ptr: str) -> Any:
        branches = s.get("oneOf")
        if not isinstance(branches, list) or not branches or self.pinned(f"{ptr}/oneOf"):
            return s
        ctx = {k: v for k, v in s.items() if k != "oneOf"}
        n = len(branches)
        if n > 1 and all(self._object_only(b, 0) for b in branches):
            # every branch holds for every non-object (its keywords only speak of objects), so oneOf rejects
            # non-objects: the same as an object that passes exactly one branch
            ctx = conjoin(ctx, {"type": "object"})
            if ctx is False:
                return False
        overlap: dict[int, list[int]] = {i: [] for i in range(n)}
        for i, j in itertools.combinations(range(n), 2):
            if not self.disjoint(branches[i], branches[j], ctx):
                overlap[i].append(j)
                overlap[j].append(i)
        if not any(overlap.values()):
            out = conjoin(ctx, _any_of(list(branches)) if n > 1 else branches[0])
            self.note("oneOf", f"{ptr}/oneOf", "anyOf (branches pairwise disjoint)" if n > 1 else "its one branch")
            return out
        negs = {}
        for j in {j for js in overlap.values() for j in js}:
            negs[j] = self.negate(branches[j], 0)
            if negs[j] is None:
                return s
        if sum(len(js) for js in overlap.values()) > MAX_BRANCHES:
            return s
        parts = [_all_of([branches[i]] + [negs[j] for j in overlap[i]]) for i in range(n)]
        self.note("oneOf", f"{ptr}/oneOf", "anyOf (each branch excluding the branches it overlaps)")
        return conjoin(ctx, _any_of(parts))

    def _object_only(self, b: Any, depth: int) -> bool:
        """True when ``b`` constrains objects only (every non-object satisfies it)."""
        if not isinstance(b, dict) or depth > _MAX_DEPTH:
            return False
        kws = _only(b)
        if set(kws) == {"$ref"} and isinstance(kws["$ref"], str):
            return self._object_only(self.resolve(kws["$ref"]), depth + 1)
        return bool(kws) and set(kws) <= _OBJECT_KEYWORDS

    def facts(self, s: Any, depth: int = 0) -> dict | None:
        """What every instance of ``s`` has: type atoms, a finite value set, required keys, property schemas,
        forbidden keys.  None for ``false``."""
        if s is False:
            return None
        hit = self._facts.get(id(s))
        if hit is not None and hit[0] is s:  # the memo holds s, so its id cannot be reused meanwhile
            return hit[1]
        f = self._facts_of(s, depth)
        self._facts[id(s)] = (s, f)
        return f

    def _facts_of(self, s: Any, depth: int) -> dict | None:
        f: dict = {"atoms": _ATOMS, "values": None, "required": set(), "props": {}, "closed": None}
        if not isinstance(s, dict) or depth > _MAX_DEPTH:
            return f
        parts = [s]
        ref = s.get("$ref")
        if isinstance(ref, str):
            target = self.resolve(ref)
            if target is not None:
                parts.append(target)
        if isinstance(s.get("allOf"), list):
            parts.extend(s["allOf"])
        for p in parts:
            if p is False:
                return None
            if not isinstance(p, dict):
                continue
            if p is not s:
                g = self.facts(p, depth + 1)
                if g is None:
                    return None
                f = _and_facts(f, g)
                continue
            a = atoms(p["type"]) if "type" in p else None
            if a is not None:
                f["atoms"] = f["atoms"] & a
            vals = _values(p)
            if vals is not None:
                f["values"] = vals if f["values"] is None else [v for v in f["values"] if any(
                    json_equal(v, w) for w in vals)]
            if isinstance(p.get("required"), list):
                f["required"] |= {r for r in p["required"] if isinstance(r, str)}
            if isinstance(p.get("properties"), dict):
                f["props"] = {**p["properties"], **f["props"]}
            if p.get("additionalProperties") is False and not p.get("patternProperties"):
                f["closed"] = set(p.get("properties") or {})
            for kw in ("anyOf", "oneOf"):  # every instance passes some branch: its type is one of theirs
                if isinstance(p.get(kw), list):
                    branches = [self.facts(b, depth + 1) for b in p[kw]]
                    f["atoms"] = f["atoms"] & frozenset().union(*(b["atoms"] for b in branches if b is not None))
        if f["values"] is not None:
            f["atoms"] = f["atoms"] & {_atom_of(v) for v in f["values"]}
        return f

    def disjoint(self, a: Any, b: Any, ctx: dict, depth: int = 0) -> bool:
        """True when no instance satisfies ``ctx``, ``a`` and ``b`` together (a proof; False = don't know)."""
        if depth > _MAX_DEPTH:
            return False
        fa, fb, fc = self.facts(a), self.facts(b), self.facts(ctx)
        if fa is None or fb is None or fc is None:
            return True
        common = fa["atoms"] & fb["atoms"] & fc["atoms"]
        if not common:
            return True
        for x, y in ((fa, fb), (fb, fa)):
            if x["values"] is not None and not any(
                    _atom_of(v) in y["atoms"] and (y["values"] is None or any(json_equal(v, w) for w in y["values"]))
                    for v in x["values"] if _atom_of(v) in common):
                return True
        if common <= {"object"}:
            for x, y in ((fa, fb), (fb, fa)):
                for key in x["required"] | fc["required"]:
                    ys = y["props"].get(key)
                    if ys is False or (ys is None and y["closed"] is not None and key not in y["closed"]):
                        return True
                    if ys is not None and any(xs is not None and self.disjoint(xs, ys, {}, depth + 1)
                                              for xs in (x["props"].get(key), fc["props"].get(key))):
                        return True
        return False

    def _required_listed(self, s: dict, ptr: str) -> dict:
        """``required`` keys that ``properties`` does not list -> listed, with the schema their value meets already:
        ``{}`` where ``additionalProperties`` is absent or true (``patternProperties`` still apply to a listed key),
        the ``additionalProperties`` schema where no ``patternProperties`` could claim the key instead.  Only for
        engines that ignore unlisted required keys (``list_required``: xgrammar took ``{}`` for ``{"required":
        ["foo"]}``); an unlisted key that can never be present is left (and refused)."""
        req, props = s.get("required"), s.get("properties", {})
        if not self.list_required or not isinstance(req, list) or not isinstance(props, dict) \
                or self.pinned(f"{ptr}/properties"):
            return s
        missing = [k for k in dict.fromkeys(req) if isinstance(k, str) and k not in props]
        extra = s.get("additionalProperties", True)
        if not missing or not (extra is True or isinstance(extra, dict) and not s.get("patternProperties")):
            return s
        self.note("required", f"{ptr}/required",
                  f"properties lists the {len(missing)} required key(s) it did not ({', '.join(missing[:3])})")
        return {**s, "properties": {**props, **{k: {} if extra is True else extra for k in missing}}}

    # ------------------------------------------------------------------ property counts, unique items
    def _property_counts(self, s: dict, ptr: str) -> Any:
        if not ({"minProperties", "maxProperties"} & set(s)) or {"minProperties", "maxProperties"} & self.native:
            return s
        props = s.get("properties", {})
        if s.get("additionalProperties") is not False or s.get("patternProperties") or not isinstance(props, dict):
            return s
        keys = [k for k, v in props.items() if v is not False]
        req = [k for k in dict.fromkeys(s.get("required", [])) if k in keys]
        if len(req) < len(set(s.get("required", []))):
            return s  # a required key that can never be present: leave it to the engine
        opt = [k for k in keys if k not in req]
        out = dict(s)
        conds = []
        lo, hi = s.get("minProperties"), s.get("maxProperties")
        if lo is not None:
            if not _num(lo):
                return s
            need = math.ceil(lo) - len(req)
            if need > len(opt) or (need > 0 and math.comb(len(opt), need) > MAX_BRANCHES):
                return s
            if need > 0:
                conds.append(_any_of([{"required": list(c)} for c in itertools.combinations(opt, need)]))
            out.pop("minProperties")
        if hi is not None:
            if not _num(hi):
                return s
            absent = len(keys) - math.floor(hi)
            if absent > len(opt) or (absent > 0 and math.comb(len(opt), absent) > MAX_BRANCHES):
                return s
            if absent > 0:
                conds.append(_any_of([{"properties": {k: False for k in c}}
                                      for c in itertools.combinations(opt, absent)]))
            out.pop("maxProperties")
        for c in conds:
            out = conjoin(out, c)
        for kw in ("minProperties", "maxProperties"):
            if kw in s:
                self.note(kw, f"{ptr}/{kw}", "anyOf over which of the listed properties are present")
        return out

    def _unique_items(self, s: dict, ptr: str) -> dict:
        if s.get("uniqueItems") is True and _num(s.get("maxItems")) and s["maxItems"] <= 1:
            self.note("uniqueItems", f"{ptr}/uniqueItems", "dropped (at most one item)")
            return {k: v for k, v in s.items() if k != "uniqueItems"}
        return s


def _branches(s: dict) -> int:
    """How many alternatives the intersection of the ``anyOf``s of ``s`` and of its ``allOf`` members spans."""
    n = len(s["anyOf"]) if isinstance(s.get("anyOf"), list) and s["anyOf"] else 1
    for m in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
        if isinstance(m, dict):
            n *= _branches(m)
    return n


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _typed(a: frozenset[str] | set[str]) -> Any:
    """A schema for exactly the instances whose type atom is in ``a``."""
    a = frozenset(a)
    if not a:
        return False
    if a == _ATOMS:
        return True
    t = type_value(a)
    if t is None:  # fractions without integers: no type spelling
        return None
    return {"type": t}


def _values(s: Any) -> list | None:
    """The finite value set ``const``/``enum`` allow (None when neither is present)."""
    if not isinstance(s, dict):
        return None
    vals = None
    if isinstance(s.get("enum"), list):
        vals = list(s["enum"])
    if "const" in s:
        vals = [s["const"]] if vals is None else [v for v in vals if json_equal(v, s["const"])]
    return vals


def _and_facts(f: dict, g: dict) -> dict:
    vals = f["values"] if g["values"] is None else g["values"] if f["values"] is None else [
        v for v in f["values"] if any(json_equal(v, w) for w in g["values"])]
    closed = f["closed"] if g["closed"] is None else g["closed"] if f["closed"] is None else f["closed"] & g["closed"]
    return {"atoms": f["atoms"] & g["atoms"], "values": vals, "required": f["required"] | g["required"],
            "props": {**g["props"], **f["props"]}, "closed": closed}




def _below(keyword: str):
    """not {min*: v}: values of the type with at most ceil(v) - 1 (none when v <= 0)."""
    return lambda v: False if math.ceil(v) <= 0 else {keyword: math.ceil(v) - 1}


def _above(keyword: str):
    return lambda v: {keyword: math.floor(v) + 1}


_NUMBERS = frozenset({"integer", "fraction"})
# not {k: v} for a bound k: (the atoms k applies to, v -> what the rest of those atoms satisfy; False: none)
_NEGATED_BOUNDS = {
    "minimum": (_NUMBERS, lambda v: {"exclusiveMaximum": v}),
    "maximum": (_NUMBERS, lambda v: {"exclusiveMinimum": v}),
    "exclusiveMinimum": (_NUMBERS, lambda v: {"maximum": v}),
    "exclusiveMaximum": (_NUMBERS, lambda v: {"minimum": v}),
    "minLength": (frozenset({"string"}), _below("maxLength")),
    "maxLength": (frozenset({"string"}), _above("minLength")),
    "minItems": (frozenset({"array"}), _below("maxItems")),
    "maxItems": (frozenset({"array"}), _above("minItems")),
    "minProperties": (frozenset({"object"}), _below("maxProperties")),
    "maxProperties": (frozenset({"object"}), _above("minProperties")),
}


def _replace(s: dict, key: str, items: list[tuple[str, Any]]) -> dict:
    """``s`` with ``key`` replaced, in place in the key order, by ``items``."""
    out = {}
    for k, v in s.items():
        if k == key:
            out.update(items)
        elif k not in dict(items):
            out[k] = v
    return out


def conjoin(s: dict, extra: Any) -> Any:
    """``s`` and ``extra``, merged into one schema object where that is plainly exact, else through ``allOf``
    (or ``anyOf`` when ``extra`` is one and ``s`` has none)."""
    if extra is True or _is_trivial(extra):
        return s
    if extra is False:
        return False
    m = merge(s, extra)
    if m is not None:
        return m
    if isinstance(extra, dict) and list(_only(extra)) == ["anyOf"] and "anyOf" not in s:
        return {**s, "anyOf": extra["anyOf"]}
    if not isinstance(s.get("allOf", []), list):
        return {"allOf": [s, extra]}
    return {**s, "allOf": [*s.get("allOf", []), extra]}


_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
# keywords where a stricter sub-schema can make the whole looser (``not``; ``if``, whose stricter condition sends
# instances to ``else``; ``oneOf``, where one branch fewer can make "exactly one"; the counts of ``contains``; what
# ``unevaluated*`` sees as evaluated): with one of these left anywhere, bounds are not narrowed (the schema stays
# refused for llguidance, as before)
_NOT_MONOTONE = frozenset({"not", "if", "oneOf", "contains", "unevaluatedItems", "unevaluatedProperties",
                           "dependencies"})


def _narrowed(s: Any, ptr: str, rw: _Rewriter) -> Any:
    """NOT exact, and only with ``narrow_bounds`` (llguidance), applied last, to a schema in which every sub-schema
    counts positively (no ``_NOT_MONOTONE`` keyword: each sub-schema made stricter makes the whole stricter, never
    looser): an integer bound past 2^53 that llguidance 1.7.6 cannot hold exactly -> the nearest inclusive bound
    inside it that is a double (``narrowed_bound``).  Every output stays valid; the integers between the narrowed
    and the real bound are no longer generated (int64's ``maximum`` 2^63-1 -> 2^63-1024: 1,023 values; ``minimum``
    -2^63 -> -2^63+1024: 1,024 values).  Only where the ``type`` allows integers and no fractions (llguidance 1.7.6
    compares a ``number`` as a double: ``maximum`` 2^63-1024 took 2^63-1023); a bound within 2^53 (every integer
    there is a double) or one that no such narrowing fits is left as it is (strict mode then refuses it for
    llguidance, and ``auto`` falls back to the next engine)."""
    if not isinstance(s, dict):
        return s
    ptr = rw.origins.get(id(s), ptr)
    out: dict = {}
    for kw, v in s.items():
        p = f"{ptr}/{_esc(kw)}"
        if kw in _SUB_MAP and isinstance(v, dict):
            out[kw] = {name: _narrowed(sub, f"{p}/{_esc(name)}", rw) for name, sub in v.items()}
        elif kw in _SUB_LIST and isinstance(v, list):
            out[kw] = [_narrowed(sub, f"{p}/{i}", rw) for i, sub in enumerate(v)]
        elif kw in _SUB and isinstance(v, dict):
            out[kw] = _narrowed(v, p, rw)
        else:
            out[kw] = v
    a = atoms(out.get("type"))
    if a is not None and "integer" in a and "fraction" not in a:
        for kw in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            v = out.get(kw)
            new = narrowed_bound(kw, v) if _num(v) and abs(v) > 2 ** 53 else None
            if new is None:
                continue
            inclusive = "maximum" if "aximum" in kw else "minimum"
            out = {k: x for k, x in out.items() if k != kw}
            if _num(out.get(inclusive)) and (out[inclusive] < new if inclusive == "maximum" else out[inclusive] > new):
                continue  # the other bound on that side is stricter already (and was narrowed itself when needed)
            out[inclusive] = new
            rw.note(kw, f"{ptr}/{_esc(kw)}", f"{inclusive} {new} (narrowed to a double: llguidance 1.7.6 holds "
                    f"integer bounds past 2^53 exactly only as doubles; {abs(new - admitted_end(kw, v)):,} valid "
                    "integers between it and the bound no longer generated)")
    if id(s) in rw.origins:
        rw.origins[id(out)] = rw.origins[id(s)]
    return out


def narrowed_bound(keyword: str, v: Any) -> int | None:
    """The inclusive integer bound (``minimum`` for the lower keywords, ``maximum`` for the upper) that llguidance
    1.7.6 enforces exactly and that keeps every integer it admits inside ``keyword: v``: the nearest double inside
    ``v`` (strictly inside for the exclusive keywords), within +-(2^63-1024) (probed: such a bound is exact; a
    ``minimum`` of -2^63 fails to compile, and bounds past 2^63 saturate to int64's).  A lower bound of -2^63 is
    narrowed to -2^63+1024.  None where that would refuse more than the last 1,024 integers of int64 (a bound past
    +-2^63, or a lower bound near the top / an upper bound near the bottom)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    upper = "aximum" in keyword
    x = admitted_end(keyword, v)  # the last integer the bound admits
    d = float(x)  # the nearest double (ties to even): one step inward where that lands outside
    if upper and int(d) > x:
        d = math.nextafter(d, -math.inf)
    elif not upper and int(d) < x:
        d = math.nextafter(d, math.inf)
    top = 2 ** 63 - 1024  # the largest double below 2^63
    if not upper and int(d) < -top and x >= -2 ** 63:
        d = float(-top)
    return int(d) if abs(int(d)) <= top else None


def admitted_end(keyword: str, v: int | float) -> int:
    """The last integer ``keyword: v`` admits on its side (the largest for the upper bounds)."""
    if "aximum" in keyword:
        return math.ceil(v) - 1 if keyword.startswith("exclusive") else math.floor(v)
    return math.floor(v) + 1 if keyword.startswith("exclusive") else math.ceil(v)


def rewrite(schema: Any, native: frozenset[str] = frozenset(), list_required: bool = False,
            false_properties: bool = True, narrow_bounds: bool = False) -> Rewritten:
    """``schema`` with every exact rewrite above applied (a new object; ``schema`` is not changed).

    ``native``: keywords the target engine enforces itself, left to it where a rewrite would only make its grammar
    bigger (``minProperties``/``maxProperties``: llguidance counts keys natively, while the ``anyOf`` over which
    properties are present cost it 35x the compile time on MaskBench Github_hard---o62820).  ``list_required``: list
    required keys in ``properties`` (``_required_listed``: for engines that ignore unlisted ones).
    ``false_properties``: whether the engine takes ``{"properties": {key: false}}`` (the key is absent), the form
    the ``dependentRequired``/``dependentSchemas`` and ``not required`` rewrites produce; without it they are left
    as they are (the strict check then names the keyword), where before the engine's own compile failed
    (xgrammar 0.2.8: "Schema 'false' cannot accept any value", 2 of 100 dev-split schemas in ``bench real``).
    ``narrow_bounds`` (llguidance): integer bounds past 2^53 narrowed to doubles, the one rewrite that is not exact
    (stricter: see ``_narrowed``)."""
    if not isinstance(schema, dict):
        return Rewritten(schema)
    rw = _Rewriter(schema, native, list_required, false_properties)
    if rw.nested_ids:
        return Rewritten(schema)
    out = rw.node(schema, "")
    if isinstance(out, dict):
        out = _defs(out, rw)
        if rw.rewrites and rw.old_draft:
            # what comes out is read with draft 2020-12's meaning (siblings of $ref apply, prefixItems, ...)
            out = {**out, "$schema": DRAFT_2020_12}
            rw.note("$schema", "/$schema", f"{DRAFT_2020_12} (the older draft's forms rewritten)")
        rw.origins[id(out)] = ""
        if narrow_bounds:
            kws = {kw for kw, _, v, _ in walk(out) if kw not in _BOUNDS or _num(v) and abs(v) > 2 ** 53}
            if kws & _BOUNDS and not kws & _NOT_MONOTONE:
                rw.before_narrowing = out  # alive: rw.origins is keyed by the ids of its dicts
                out = _narrowed(out, "", rw)
    return Rewritten(out, tuple(rw.rewrites.values()), rw.origins)


def _defs(root: dict, rw: _Rewriter) -> dict:
    """Root ``definitions`` -> ``$defs``, with every ``#/definitions/...`` ``$ref`` pointed at the new place."""
    defs = root.get("definitions")
    if not isinstance(defs, dict) or rw.nested_ids:
        return root
    have = root.get("$defs", {})
    if not isinstance(have, dict) or set(have) & set(defs):
        return root
    out = _replace(root, "definitions", [("$defs", {**have, **defs})])
    if "$defs" in root and "definitions" in root:
        out.pop("definitions", None)
    rw.note("definitions", "/definitions", "$defs")
    _fix_refs(out, set())
    return out


def _fix_refs(s: Any, seen: set[int]) -> None:
    """In place, through schema positions only: every dict there was made by the rewriter, none is the caller's."""
    if not isinstance(s, dict) or id(s) in seen:
        return
    seen.add(id(s))
    ref = s.get("$ref")
    if isinstance(ref, str) and (ref == "#/definitions" or ref.startswith("#/definitions/")):
        s["$ref"] = "#/$defs" + ref[len("#/definitions"):]
    for kw, v in s.items():
        if kw in _SUB_MAP and isinstance(v, dict):
            for sub in v.values():
                _fix_refs(sub, seen)
        elif kw in _SUB_LIST and isinstance(v, list):
            for sub in v:
                _fix_refs(sub, seen)
        elif kw in _SUB:
            _fix_refs(v, seen)
