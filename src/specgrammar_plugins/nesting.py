"""How deeply a request or a constraint nests, measured without recursion.

Python's ``json`` module, our schema walkers and several engines recurse once per level: a schema nested 1,000 deep
raised ``RecursionError`` (a crash, not a 400) and llguidance / outlines-core refuse schemas past ~100 levels with
parse errors of their own.  Constraints are therefore bounded by ``MAX_NESTING`` levels (JSON containers of a
schema, parenthesized groups of a regex or grammar) and request bodies by ``MAX_BODY_NESTING`` (the constraint plus
the few levels a request wraps it in), both checked here iteratively before anything recursive sees them.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

# 128 JSON levels hold a schema of 60 nested objects ({"properties": {"a": {...}}} is two levels each)
MAX_NESTING = int(os.environ.get("SPECGRAMMAR_MAX_NESTING", 128))
MAX_BODY_NESTING = MAX_NESTING + 8


def json_depth(value: Any, limit: int | None = None) -> int:
    """The nesting depth of a JSON-like value (a scalar is 0, ``[]`` and ``{}`` are 1), walked without recursion.
    Stops early and returns ``limit + 1`` once the depth passes ``limit``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if limit is not None and deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return deepest


def group_depth(text: str, quotes: str = "") -> int:
    """The deepest nesting of parentheses in a regex or grammar text: escapes (``\\(``), character classes
    (``[(]``) and, for grammars, quoted literals (``quotes``) are skipped."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i += 1
            if i < n and text[i] == "^":
                i += 1
            if i < n and text[i] == "]":
                i += 1
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
        elif c in quotes:
            i += 1
            while i < n and text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest


# a JSON string (an unterminated one runs to the end), and a run of characters that are not brackets
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_STEP = np.zeros(256, dtype=np.int32)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_text_depth(text: str) -> int:
    """The nesting depth of JSON text (brackets outside strings), read without parsing it: strings and everything
    but brackets dropped by two regexes, the brackets' running sum in numpy (an 80 KB schema: ~0.2 ms instead of
    3 ms a character at a time; ``_json_text_depth_loop`` is the reference, held against it in tests/test_nesting)."""
    bare = _NOT_BRACKETS.sub("", _STRING.sub("", text))
    if not bare:
        return 0
    depth = np.cumsum(_STEP[np.frombuffer(bare.encode("ascii"), dtype=np.uint8)])
    if depth.min() < 0:  # a closing bracket too many (not JSON): the reference clamps at 0
        return _json_text_depth_loop(bare)
    return int(depth.max())


def _json_text_depth_loop(text: str) -> int:
    depth = deepest = 0
    in_str = esc = False
    for c in text:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(0, depth - 1)
    return deepest


def constraint_depth(kind: str, value: Any, syntax: str | None = None) -> int:
    """How deeply a constraint (``ConstraintSpec`` fields) nests: JSON levels of a schema, groups of a regex or
    grammar (choices and any-JSON do not nest)."""
    if not isinstance(value, str):
        return 0
    if kind == "json_schema":
        return json_text_depth(value)
    if kind == "regex":
        return group_depth(value)
    if kind == "grammar":
        return group_depth(value, quotes="\"'" if syntax != "gbnf" else '"')
    return 0


def too_deep(what: str, depth: int, limit: int | None = None) -> str | None:
    """The refusal message when ``depth`` passes ``limit`` (default: ``MAX_NESTING``, read at call time), else
    None."""
    limit = MAX_NESTING if limit is None else limit
    if depth <= limit:
        return None
    return f"{what} nests more than {limit} levels deep (the limit; SPECGRAMMAR_MAX_NESTING)"
