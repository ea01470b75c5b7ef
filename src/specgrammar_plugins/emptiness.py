"""Compile-time detection of constraints whose language is empty (they accept no string at all).

The engines refuse a constraint that allows no first token, but an empty language can still allow one: the regex
``b[^\\x00-\\U0010FFFF]`` allows ``b`` and then nothing, the GBNF grammar ``root ::= "a" root`` allows ``a``
forever and never an end.  Decoding such a constraint either fails at a later mask or runs to ``max_tokens``
without ever producing a valid answer.  These checks are structural, cheap (linear in the text) and conservative:
they say "empty" only when it is certain, so a language they pass may still be empty in a way they do not model
(then the engine's own first-mask check or the loop's ``EmptyMaskError`` still applies).

- regex (and choice): read with Python's regex parser; a negated class that covers every Unicode scalar value is
  empty, a sequence with an empty part is empty, an alternation is empty when every branch is, a repeat with
  minimum > 0 of an empty part is empty.  A pattern Python cannot read is left to the engine.
- GBNF: the classic productive-symbol fixpoint: a rule is productive when one of its alternatives has only
  productive parts (literals, non-empty classes, optional/starred parts, productive rules).  The language is empty
  when ``root`` is not productive.
- JSON Schema: the same fixpoint over subschemas (``schema_unproductive``): a schema whose every instance would
  contain itself (a required property, a required item or a ``$ref`` chain leading back) has no finite instance.
"""

from __future__ import annotations

import re
from functools import lru_cache

from .errors import ConstraintError

_MAX_CP = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # no UTF-8 string holds them: a class need not cover them


def _re_parser():
    try:
        import re._parser as p  # Python 3.11+
    except ImportError:  # pragma: no cover
        import sre_parse as p
    return p


def _class_is_empty(items) -> bool:
    if not items or str(items[0][0]) != "NEGATE":
        return False  # a positive class always names a member
    spans: list[tuple[int, int]] = []
    cats: set[str] = set()
    for op, av in items[1:]:
        op = str(op)
        if op == "LITERAL":
            spans.append((av, av))
        elif op == "RANGE":
            spans.append(av)
        elif op == "CATEGORY":
            cats.add(str(av))
    for c in cats:  # [^\d\D]: a category and its negation cover everything
        if c.replace("_NOT_", "_") != c and c.replace("_NOT_", "_") in cats:
            return True
    return _covers_unicode(spans)


def _seq_is_empty(seq) -> bool:
    for op, av in seq:
        op = str(op)
        if op == "IN" and _class_is_empty(av):
            return True
        if op == "BRANCH" and all(_seq_is_empty(b) for b in av[1]):
            return True
        if op == "SUBPATTERN" and _seq_is_empty(av[-1]):
            return True
        if op == "ATOMIC_GROUP" and _seq_is_empty(av):
            return True
        if op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and av[0] > 0 and _seq_is_empty(av[2]):
            return True
    return False


def regex_is_empty(pattern: str) -> bool:
    """True when ``pattern`` certainly matches no string (False when it matches some, or cannot be read here)."""
    try:
        parsed = _re_parser().parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return False
    return _seq_is_empty(list(parsed))


# ---------------------------------------------------------------------------------------------- GBNF
def _gbnf_parts(body: str) -> list[list[tuple]]:
    """A GBNF rule body as alternatives of parts: ``("lit",)``, ``("class", text)``, ``("ref", name)``,
    ``("group", alternatives)``, each with ``optional`` (a quantifier allowing zero repeats) as the last item."""
    from .gbnf import _NAME, _match_paren, _skip_literal

    alts: list[list[tuple]] = [[]]
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c.isspace():
            i += 1
            continue
        if c == "|":
            alts.append([])
            i += 1
            continue
        if c in "*?":
            if alts[-1]:
                alts[-1][-1] = (*alts[-1][-1][:-1], True)
            i += 1
            continue
        if c == "+":
            i += 1
            continue
        if c == "{":
            j = body.index("}", i)
            lo = body[i + 1:j].split(",")[0].strip()
            if alts[-1] and (lo == "" or int(lo) == 0):
                alts[-1][-1] = (*alts[-1][-1][:-1], True)
            i = j + 1
            continue
        if c == '"':
            j = _skip_literal(body, i)
            alts[-1].append(("lit", False))
        elif c == "[":
            j = _skip_literal(body, i)
            alts[-1].append(("class", body[i:j], False))
        elif c == "(":
            j = _match_paren(body, i) + 1
            alts[-1].append(("group", _gbnf_parts(body[i + 1:j - 1]), False))
        elif c == ".":
            j = i + 1
            alts[-1].append(("lit", False))
        else:
            m = _NAME.match(body, i)
            if not m:
                raise ValueError(f"unexpected {c!r}")
            j = m.end()
            alts[-1].append(("ref", m.group(), False))
        i = j
    return alts


def _gbnf_class_is_empty(cls: str) -> bool:
    """Whether a GBNF ``[...]`` class allows no character (only a negated class covering all of Unicode)."""
    from .gbnf import class_items

    try:
        negated, items = class_items(cls)
    except ValueError:
        return False
    if not negated:
        return False
    chars: list[int | None] = [None if ch is None else ord(ch) for ch in items]  # None marks a range dash
    spans, k = [], 0
    while k < len(chars):
        if k + 2 < len(chars) and chars[k + 1] is None and chars[k] is not None and chars[k + 2] is not None:
            spans.append((chars[k], chars[k + 2]))
            k += 3
        else:
            if chars[k] is not None:
                spans.append((chars[k], chars[k]))
            k += 1
    return _covers_unicode(spans)


def _covers_unicode(spans: list[tuple[int, int]]) -> bool:
    covered = -1
    for lo, hi in sorted([*spans, _SURROGATES]):
        if lo > covered + 1:
            return False
        covered = max(covered, hi)
    return covered >= _MAX_CP


def gbnf_unproductive_root(text: str) -> bool:
    """True when the GBNF grammar's ``root`` derives no finite string (False when it does, or cannot be read)."""
    from .gbnf import split_rules

    try:
        rules = {name: _gbnf_parts(body) for name, body in split_rules(text).items()}
    except (ValueError, IndexError):
        return False
    if "root" not in rules:
        return False
    productive: set[str] = set()

    def part_ok(p) -> bool:
        if p[-1]:  # may repeat zero times
            return True
        if p[0] == "lit":
            return True
        if p[0] == "class":
            return not _gbnf_class_is_empty(p[1])
        if p[0] == "ref":
            return p[1] in productive or p[1] not in rules  # an unknown rule is the engine's error to report
        return any(all(part_ok(q) for q in alt) for alt in p[1])

    users: dict[str, set] = {}  # rule -> the rules that name it (a worklist: linear, where sweeps were quadratic
    for name, alts in rules.items():  # on a chain of rules, issue 33)
        stack = [p for alt in alts for p in alt]
        while stack:
            p = stack.pop()
            if p[0] == "ref":
                users.setdefault(p[1], set()).add(name)
            elif p[0] == "group":
                stack.extend(q for alt in p[1] for q in alt)
    todo = list(rules)
    while todo:
        name = todo.pop()
        if name not in productive and any(all(part_ok(p) for p in alt) for alt in rules[name]):
            productive.add(name)
            todo.extend(u for u in users.get(name, ()) if u not in productive)
    return "root" not in productive


# ---------------------------------------------------------------------------------------------- JSON Schema
_SUBSCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
_SUBSCHEMA_LISTS = frozenset(("allOf", "anyOf", "oneOf", "prefixItems"))
_SUBSCHEMA_ONE = frozenset(("items", "additionalProperties", "not", "contains", "if", "then", "else"))


def _schema_nodes(schema) -> dict[str, object]:
    """JSON pointer -> subschema, for every subschema reachable through schema keywords (walked without recursion)."""
    nodes: dict[str, object] = {}
    stack = [("", schema)]
    while stack:
        ptr, node = stack.pop()
        nodes[ptr] = node
        if not isinstance(node, dict):
            continue
        for key, v in node.items():  # (the node's own keys: most have a few, the keyword lists are 16 long)
            if key in _SUBSCHEMA_MAPS:
                if isinstance(v, dict):
                    stack += [(f"{ptr}/{key}/{_esc(name)}", sub) for name, sub in v.items()]
            elif key in _SUBSCHEMA_LISTS:
                if isinstance(v, list):
                    stack += [(f"{ptr}/{key}/{i}", sub) for i, sub in enumerate(v)]
            elif key in _SUBSCHEMA_ONE and isinstance(v, (dict, bool)):
                stack.append((f"{ptr}/{key}", v))
    return nodes


def _esc(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _needs(node, nodes: dict) -> list[list[str]] | None:
    """What makes ``node`` have a finite instance, as alternatives of conjunctions of subschema pointers
    (``[[]]``: nothing needed; ``[]``: impossible); None when this check does not model the node (then it is
    taken as satisfiable: the check only says "empty" when it is certain)."""
    if node is True:
        return [[]]
    if node is False:
        return []
    if not isinstance(node, dict):
        return None
    if "const" in node or (isinstance(node.get("enum"), list) and node["enum"]):
        return [[]]
    need: list[str] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not (ref == "#" or ref.startswith("#/")) or ref[1:] not in nodes:
            return None  # a remote or unresolvable reference: the engine's to judge
        need.append(ref[1:])
    if isinstance(node.get("allOf"), list):
        need += [f"{node['_ptr']}/allOf/{i}" for i in range(len(node["allOf"]))]
    alts: list[list[str]] = [need]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key]:
            alts = [a + [f"{node['_ptr']}/{key}/{i}"] for a in alts for i in range(len(node[key]))]
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if not types or any(t not in ("object", "array") for t in types):
        return alts  # a scalar (or any) type satisfies what remains
    by_type: list[list[str]] = []
    for t in types:
        if t == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            req = [r for r in node.get("required", []) if isinstance(r, str)] if isinstance(
                node.get("required"), list) else []
            parts: list[str] = []
            ok = True
            for r in req:
                if r in props:
                    parts.append(f"{node['_ptr']}/properties/{_esc(r)}")
                elif node.get("additionalProperties") is False and not node.get("patternProperties"):
                    ok = False  # required, yet no property may have that name
                elif isinstance(node.get("additionalProperties"), (dict, bool)) and not node.get("patternProperties"):
                    parts.append(f"{node['_ptr']}/additionalProperties")
            if ok:
                by_type.append(parts)
        else:
            n = node.get("minItems", 0)
            n = n if isinstance(n, int) and not isinstance(n, bool) else 0
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            parts = [f"{node['_ptr']}/prefixItems/{i}" for i in range(min(n, len(prefix)))]
            if n > len(prefix) and isinstance(node.get("items"), (dict, bool)):
                parts.append(f"{node['_ptr']}/items")
            by_type.append(parts)
    return [a + b for a in alts for b in by_type]


def schema_unproductive(schema) -> str | None:
    """Where a JSON Schema has no finite instance, or None.  The productive-symbol fixpoint (as for GBNF) over
    subschemas: a subschema is productive when one of its alternatives needs only productive subschemas
    (required properties, ``minItems`` items, ``$ref`` targets, ``allOf`` members, one ``anyOf``/``oneOf``
    member).  ``{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}`` is not: every
    instance would contain itself.  Keywords this does not model count as satisfiable (no false refusals)."""
    nodes = _schema_nodes(schema)
    for ptr, node in nodes.items():
        if isinstance(node, dict):
            nodes[ptr] = {**node, "_ptr": ptr}
    needs = {ptr: _needs(node, nodes) for ptr, node in nodes.items()}
    productive = {ptr for ptr, alts in needs.items() if alts is None or any(not a for a in alts)}
    waiting: dict[str, list[str]] = {}
    for ptr, alts in needs.items():
        if ptr not in productive:
            for a in alts:
                for dep in a:
                    waiting.setdefault(dep, []).append(ptr)
    work = list(productive)
    while work:  # worklist: re-check a subschema only when one it needs became productive
        dep = work.pop()
        for ptr in waiting.pop(dep, ()):
            if ptr not in productive and any(all(d in productive for d in a) for a in needs[ptr]):
                productive.add(ptr)
                work.append(ptr)
    if "" in productive:
        return None
    return "no finite JSON value satisfies the schema (every instance would have to contain itself: a required " \
           "property, item or $ref that leads back to where it started)"


@lru_cache(maxsize=1024)
def _why_empty(kind: str, syntax: str | None, value) -> str | None:
    if kind == "regex" and regex_is_empty(value):
        return "a part of the regex that must occur allows no character"
    if kind == "grammar" and syntax == "gbnf" and gbnf_unproductive_root(value):
        return "no derivation of 'root' ever ends (every alternative needs a rule that never finishes)"
    if kind == "json_schema" and isinstance(value, str):
        import json

        try:
            schema = json.loads(value)
        except (ValueError, RecursionError):
            return None
        return schema_unproductive(schema)
    return None


def check_not_empty(spec, engine: str | None = None) -> None:
    """Raise ``ConstraintError`` ("matches no string") when ``spec``'s language is certainly empty."""
    why = _why_empty(spec.kind, spec.syntax, spec.value) if spec.kind in ("regex", "grammar", "json_schema") else None
    if why:
        raise ConstraintError(f"the constraint matches no string: {why}", engine=engine, kind=spec.kind)
