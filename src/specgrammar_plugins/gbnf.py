"""GBNF (llama.cpp dialect) normalization, so llama.cpp's own grammars compile and run fast on every engine.

- ``fill_empty_alternatives``: ``x ::= a |`` -> ``x ::= a | ""`` (xgrammar's parser wants
  an element where llama.cpp reads the empty string).
- ``rewrite_class_star``: ``( [^"\\] | "\\" escape )*`` -> ``( [^"\\]* ( ( "\\" escape ) [^"\\]* )* )``.  The
  same language ((a|b)* = a*(b a*)*), but the character-class repetition becomes a plain class star, which
  xgrammar matches on its fast path: the string body of llama.cpp's ``json.gbnf`` cost ~100 ms per mask verbatim.
Comments are dropped by the rewrite (they carry no meaning).
"""

from __future__ import annotations

import re


def _skip_literal(text: str, i: int) -> int:
    """Index just past the ``"..."`` string or ``[...]`` class starting at ``text[i]``."""
    close = '"' if text[i] == '"' else "]"
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == close:
            return j + 1
        j += 1
    return j


def strip_comments(text: str) -> str:
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in '"[':
            j = _skip_literal(text, i)
            out.append(text[i:j])
            i = j
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _match_paren(text: str, i: int) -> int:
    """Index of the ``)`` closing the ``(`` at ``text[i]``."""
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c in '"[':
            j = _skip_literal(text, j)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    raise ValueError("unbalanced parentheses in grammar")


def _alternatives(text: str) -> list[str]:
    alts, start, depth, j, n = [], 0, 0, 0, len(text)
    while j < n:
        c = text[j]
        if c in '"[':
            j = _skip_literal(text, j)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            alts.append(text[start:j])
            start = j + 1
        j += 1
    alts.append(text[start:])
    return alts


def _is_single_class(alt: str) -> bool:
    a = alt.strip()
    return a.startswith("[") and _skip_literal(a, 0) == len(a)


def rewrite_class_star(text: str) -> str:
    text = strip_comments(text)
    return _rewrite(text)


def _rewrite(text: str) -> str:
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in '"[':
            j = _skip_literal(text, i)
            out.append(text[i:j])
            i = j
            continue
        if c == "(":
            j = _match_paren(text, i)
            inner = _rewrite(text[i + 1:j])
            if j + 1 < n and text[j + 1] == "*":
                alts = _alternatives(inner)
                if len(alts) >= 2 and _is_single_class(alts[0]):
                    cls = alts[0].strip()
                    rest = "|".join(alts[1:]).strip()
                    out.append(f"({cls}* (({rest}) {cls}*)*)")
                    i = j + 2
                    continue
            out.append(f"({inner})")
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


_NAME = re.compile(r"[A-Za-z0-9_-]+")
_RULE_START = re.compile(r"[A-Za-z0-9_-]+[ \t]*(?:\r?\n[ \t]*)*::=")


def fill_empty_alternatives(gbnf: str) -> str:
    """Rewrite empty alternatives / groups of llama.cpp GBNF (``x ::= a |``, ``( | b)``, ``()``) to ``""``.

    llama.cpp reads an empty alternative as the empty string; xgrammar's parser wants an element there.  The scan
    skips string literals, character classes and comments, so ``"|"`` or ``[|]`` are left alone.
    """
    out: list[str] = []
    pending: int | None = None  # index in ``out`` after which an element is still owed
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == '"' or c == "[":
            j = _skip_literal(gbnf, i)
            out.append(gbnf[i:j])
            pending = None
            i = j
        elif c == "#":
            j = gbnf.find("\n", i)
            j = n if j < 0 else j
            out.append(gbnf[i:j])
            i = j
        elif gbnf.startswith("::=", i):
            out.append("::=")
            pending = len(out) - 1
            i += 3
        elif c in "|(":
            if c == "|" and pending is not None:
                out.insert(pending + 1, ' ""')
            out.append(c)
            pending = len(out) - 1
            i += 1
        elif c == ")":
            if pending is not None:
                out.insert(pending + 1, ' ""')
            out.append(c)
            pending = None
            i += 1
        elif _NAME.match(gbnf, i):
            m = _NAME.match(gbnf, i)
            if _RULE_START.match(gbnf, i) and pending is not None:
                out.insert(pending + 1, ' ""')
                pending = None
            elif not _RULE_START.match(gbnf, i):
                pending = None
            out.append(m.group())
            i = m.end()
        elif c == ".":
            out.append(c)
            pending = None
            i += 1
        else:
            out.append(c)
            i += 1
    if pending is not None:
        out.insert(pending + 1, ' ""')
    return "".join(out)


def normalize_gbnf(text: str) -> str:
    """Both rewrites; the language is unchanged (tests/test_gbnf.py checks it on samples)."""
    return fill_empty_alternatives(rewrite_class_star(text))


# ---------------------------------------------------------------------------------------------- regular form
_ESC = {"n": "\n", "t": "\t", "r": "\r"}


def read_char(text: str, i: int) -> tuple[str, int]:
    """The character a GBNF literal or class spells at ``text[i]`` (escapes ``\\n \\t \\r \\xHH \\uHHHH
    \\UHHHHHHHH``, any other escaped character as itself) and the index after it.  ValueError on a bad hex."""
    c = text[i]
    if c == "\\" and i + 1 < len(text):
        e = text[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            return chr(int(text[i + 2:i + 2 + width], 16)), i + 2 + width
        return _ESC.get(e, e), i + 2
    return c, i + 1


def class_items(cls: str) -> tuple[bool, list[str | None]]:
    """A GBNF ``[...]`` class as (negated, characters), ``None`` standing for the dash of a range."""
    inner = cls[1:-1]
    negated = inner.startswith("^")
    items: list[str | None] = []
    i = 1 if negated else 0
    while i < len(inner):
        is_range = inner[i] == "-" and bool(items) and i + 1 < len(inner)
        ch, i = read_char(inner, i)
        items.append(None if is_range else ch)
    return negated, items


def _literal_text(body: str) -> str:
    """The characters a GBNF ``"..."`` literal (without its quotes) stands for."""
    out, i = [], 0
    while i < len(body):
        ch, i = read_char(body, i)
        out.append(ch)
    return "".join(out)


def _escape_char(ch: str) -> str:
    if ch.isalnum() or ch in " _,;:'\"@#%&=<>!~`":
        return ch
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x80 else ch  # interegular reads no \\u escapes: non-ASCII as is


def _class_regex(cls: str) -> str:
    """A GBNF ``[...]`` class as a regex class: every member escaped, ranges kept."""
    negated, items = class_items(cls)
    return "[" + ("^" if negated else "") + "".join("-" if ch is None else _escape_char(ch) for ch in items) + "]"


def split_rules(gbnf: str) -> dict[str, str]:
    """The grammar's rules, name -> body text (comments dropped); a rule starts at a line ``name ::=``."""
    text = strip_comments(gbnf)
    starts = list(re.finditer(r"(?m)^[ \t]*([A-Za-z0-9_-]+)[ \t]*::=", text))
    return {m.group(1): text[m.end(): nxt.start() if nxt else len(text)] for m, nxt in zip(starts, starts[1:] + [None])}


def to_regex(gbnf: str, max_len: int = 20000) -> str | None:
    """The grammar as one regex when its language is regular because no rule reaches itself (rules are inlined),
    else None.  None too when the grammar uses what this reader does not know, or the regex would exceed
    ``max_len`` characters.  The language is the grammar's own (tests check it against samples)."""
    rules = split_rules(gbnf)
    if "root" not in rules:
        return None
    done: dict[str, str] = {}

    def rule(name: str, stack: tuple) -> str:
        if name in done:
            return done[name]
        if name in stack or name not in rules:
            raise ValueError(name)
        r = "(?:" + expr(rules[name], stack + (name,)) + ")"
        if len(r) > max_len:
            raise ValueError("too long")
        done[name] = r
        return r

    def expr(body: str, stack: tuple) -> str:
        out, i, n = [], 0, len(body)
        while i < n:
            c = body[i]
            if c.isspace():
                i += 1
            elif c == '"':
                j = _skip_literal(body, i)
                out.append("".join(_escape_char(ch) for ch in _literal_text(body[i + 1:j - 1])))
                i = j
            elif c == "[":
                j = _skip_literal(body, i)
                out.append(_class_regex(body[i:j]))
                i = j
            elif c == "(":
                j = _match_paren(body, i)
                out.append("(?:" + expr(body[i + 1:j], stack) + ")")
                i = j + 1
            elif c == "|":
                out.append("|")
                i += 1
            elif c in "*+?":
                out.append(c)
                i += 1
            elif c == "{":
                j = body.index("}", i)
                if not re.fullmatch(r"\{\s*\d*\s*(,\s*\d*\s*)?\}", body[i:j + 1]):
                    raise ValueError(body[i:j + 1])
                out.append(re.sub(r"\s", "", body[i:j + 1]))
                i = j + 1
            elif c == ".":
                out.append("(?:[^\\n]|\\n)")
                i += 1
            else:
                m = _NAME.match(body, i)
                if not m:
                    raise ValueError(c)
                out.append(rule(m.group(), stack))
                i = m.end()
        return "".join(out)

    try:
        r = rule("root", ())
    except (ValueError, IndexError):
        return None
    return r if len(r) <= max_len else None
