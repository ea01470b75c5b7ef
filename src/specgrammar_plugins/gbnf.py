"""GBNF (llama.cpp dialect) normalization, so llama.cpp's own grammars compile and run fast on every engine.

- ``fill_empty_alternatives`` (in the xgrammar engine): ``x ::= a |`` -> ``x ::= a | ""`` (xgrammar's parser wants
  an element where llama.cpp reads the empty string).
- ``rewrite_class_star``: ``( [^"\\] | "\\" escape )*`` -> ``( [^"\\]* ( ( "\\" escape ) [^"\\]* )* )``.  The
  same language ((a|b)* = a*(b a*)*), but the character-class repetition becomes a plain class star, which
  xgrammar matches on its fast path: the string body of llama.cpp's ``json.gbnf`` cost ~100 ms per mask verbatim.
Comments are dropped by the rewrite (they carry no meaning).
"""

from __future__ import annotations


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


def normalize_gbnf(text: str) -> str:
    """Both rewrites; the language is unchanged (tests/test_gbnf.py checks it on samples)."""
    from .engines.xgrammar_engine import fill_empty_alternatives

    return fill_empty_alternatives(rewrite_class_star(text))
