"""Generated JSON instances for a schema, and jsonschema as the oracle that says which are valid.

``instances(schema, n, seed, extra)`` draws JSON values from the schema's own vocabulary (its property names, const
and enum values, numbers at and around its bounds, strings at and around its lengths) plus ``extra`` seed values,
nested up to depth 3: small keyword-focused schemas get both valid and invalid instances in a few hundred draws.
``oracle(schema)`` validates with the schema's declared draft (2020-12 when it declares none), ``format`` asserted
(jsonschema's checkers plus the integer widths int8 .. uint64: an integer in range, other types pass).
"""

from __future__ import annotations

import json
import math
import random
from typing import Any, Callable

from jsonschema import Draft4Validator, Draft7Validator, Draft202012Validator, FormatChecker, validators
from referencing import Registry

from specgrammar_plugins.schema_rewrite import INT_FORMATS

def _int_format(lo: int, hi: int) -> Callable[[Any], bool]:
    def check(x: Any) -> bool:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return True
        return float(x).is_integer() and lo <= x <= hi
    return check


def format_checker(cls) -> FormatChecker:
    """The draft's own format checkers (``FormatChecker()`` mixes every draft's: draft-03's "time" has no offset)
    plus the integer widths."""
    fc = FormatChecker(())
    fc.checkers = dict(cls.FORMAT_CHECKER.checkers)
    for name, (lo, hi) in INT_FORMATS.items():
        fc.checks(name)(_int_format(lo, hi))
    return fc


DRAFTS = {"draft4": Draft4Validator, "draft7": Draft7Validator, "2020-12": Draft202012Validator}
_CHECKERS: dict = {}


def oracle(schema: Any, draft: str | None = None, formats: str | None = None) -> Callable[[Any], bool]:
    """``schema``'s validity test: its declared draft (or ``draft``); ``format`` as that draft defines it, or as
    ``formats`` does (``"2020-12"``: engines read a format name the same whatever the draft)."""
    cls = DRAFTS[draft] if draft else validators.validator_for(schema, default=Draft202012Validator)
    fcls = DRAFTS[formats] if formats else cls
    fc = _CHECKERS.get(fcls) or _CHECKERS.setdefault(fcls, format_checker(fcls))
    return cls(schema, format_checker=fc, registry=_LOCAL).is_valid


def _no_retrieval(uri: str):
    raise LookupError(f"remote $ref {uri} (tests read no network)")


_LOCAL = Registry(retrieve=_no_retrieval)


def _vocab(schema: Any) -> tuple[list[str], list[Any], list[float], list[int]]:
    keys: list[str] = []
    values: list[Any] = []
    numbers: list[float] = []
    lengths: list[int] = []

    def visit(s: Any) -> None:
        if isinstance(s, list):
            for x in s:
                visit(x)
            return
        if not isinstance(s, dict):
            return
        for k, v in s.items():
            if k in ("properties", "patternProperties", "dependentRequired", "dependentSchemas", "dependencies",
                     "$defs", "definitions") and isinstance(v, dict):
                if k != "patternProperties" and k not in ("$defs", "definitions"):
                    keys.extend(v)
                for sub in v.values():
                    visit(sub)
                    if isinstance(sub, list):
                        keys.extend(x for x in sub if isinstance(x, str))
            elif k == "required" and isinstance(v, list):
                keys.extend(x for x in v if isinstance(x, str))
            elif k in ("enum", "examples") and isinstance(v, list):
                values.extend(v)
            elif k == "const":
                values.append(v)
            elif k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf") \
                    and isinstance(v, (int, float)) and not isinstance(v, bool):
                numbers.extend([v, v - 1, v + 1, v - 0.5, v + 0.5, 2 * v, -v])
            elif k in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                       "minContains", "maxContains") and isinstance(v, (int, float)):
                lengths.extend([int(v), int(v) - 1, int(v) + 1])
            else:
                visit(v)

    visit(schema)
    return list(dict.fromkeys(keys)), values, numbers, [x for x in lengths if x >= 0]


def instances(schema: Any, n: int = 300, seed: int = 0, extra: list | None = None) -> list[Any]:
    """``n`` distinct JSON values (fewer if the draws repeat) drawn from the schema's vocabulary."""
    rng = random.Random(seed)
    keys, values, numbers, lengths = _vocab(schema)
    keys = keys + ["a", "b", "x1", "zz"]
    values = values + list(extra or [])
    numbers = numbers + [0, 1, -1, 2, 3, 2.5, 10, 2 ** 31, -2 ** 31 - 1, 256, -129, 1e3]
    lengths = [x for x in lengths if x <= 40] + [0, 1, 2, 3, 5]  # string lengths
    sizes = [x for x in lengths if x <= 5] + [0, 1, 2, 3]  # container sizes (kept small: nesting multiplies them)
    strings = [v for v in values if isinstance(v, str)] + keys

    def string() -> str:
        r = rng.random()
        if r < 0.4 and strings:
            return rng.choice(strings)
        k = rng.choice(lengths)
        if r < 0.7 and strings:
            base = rng.choice(strings) or "a"
            return (base * (k // max(1, len(base)) + 1))[:k]
        return "".join(rng.choice("abcxyz019-_:/. ") for _ in range(k))

    def value(depth: int) -> Any:
        r = rng.random()
        if values and r < 0.25:
            return rng.choice(values)
        kinds = ["null", "bool", "int", "num", "str", "str"] + (["arr", "obj", "obj"] if depth < 3 else [])
        kind = rng.choice(kinds)
        if kind == "null":
            return None
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "int":
            x = rng.choice(numbers)
            return int(x) if math.isfinite(x) else 0
        if kind == "num":
            return rng.choice(numbers)
        if kind == "str":
            return string()
        if kind == "arr":
            return [value(depth + 1) for _ in range(rng.choice(sizes))]
        chosen = rng.sample(keys, min(len(keys), rng.choice(sizes)))
        return {k: value(depth + 1) for k in chosen}

    out: dict[str, Any] = {}
    for v in list(extra or []) + values:
        out.setdefault(json.dumps(v, sort_keys=True), v)
    tries = 0
    while len(out) < n and tries < 20 * n:
        tries += 1
        v = value(0)
        out.setdefault(json.dumps(v, sort_keys=True), v)
    return list(out.values())[:n]
