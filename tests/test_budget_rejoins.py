"""The certified budget rejoins its certificate's own text after a pretty-printed token (issue 34: the budget's
check of a draft step's drafts on the real model).

A model that pretty-prints JSON writes ``  "`` before a key, ``",\\n`` after a value, ``,\\n`` after a number, where
the budget's certificate (the completion it certifies after each prefix) is written compact.  ``_next_of`` used to
walk a whole new completion for each such token (~0.8 ms a token at 151,936 tokens; SmolLM2's documents: one walk
every 3-4 tokens).  It now first certifies the candidates ``_rejoins`` reads off the parent's text, JSON whitespace
outside strings aside, and what a walk wrote before in the same lexical place; the engine certifies each, so a
candidate is never trusted.  Checked here: the candidates themselves (byte-level cases from SmolLM2's outputs);
along pretty-printed documents the certificates are as long as the walks' at every position (the same slack, so the
same cuts), each one the engine accepts to the end, with a fraction of the walks; and vLLM's whole rows along them
are cut exactly as with the walks, at a vocabulary as wide as the tokenizer and at one padded past it (Qwen2.5's
151,936 ids for 151,665 tokens: the far zone's tables are the tokenizer's length, and a padded row raised there).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from specgrammar_plugins import ConstraintSpec, compile_constraint  # noqa: E402
from specgrammar_plugins.budget import CertifiedBudget, _rejoins, _squeezed, make_budget  # noqa: E402
from specgrammar_plugins.cost import _Scan  # noqa: E402


def _scan(text: bytes) -> _Scan:
    s = _Scan()
    s.feed(text)
    return s


def _cands(before: bytes, tb: bytes, text: bytes) -> list[bytes]:
    at = _scan(before)
    after = at.copy()
    after.feed(tb)
    return list(_rejoins(text, tb, at, after, len(at.stack)))


def test_whitespace_outside_strings_is_squeezed_out():
    assert _squeezed(b'  "') == b'"' and _squeezed(b'",\n', in_str=True) == b'",'
    assert _squeezed(b' "a b",\n  ') == b'"a b",' and _squeezed(b'a \\" b", ', in_str=True) == b'a \\" b",'
    assert _squeezed(b'\\"x', in_str=True, esc=True) == b'\\"x'  # (an escaped quote does not end the string)
    assert _squeezed(b"{}") == b"{}"


@pytest.mark.parametrize("before,tb,text,want", [
    (b'{\n', b'  "', b'"name":""}', [b'name":""}']),  # a key's quote after the indentation
    (b'{"era": "Jurassic', b'",\n', b'","b":0}', [b'"b":0}']),  # the string closed, the next member
    (b'{"era": "Jurassic', b'",\n', b'"}', []),  # (the parent closes the object: a walk writes the member)
    (b'{"high": 55357', b',\n', b'0,"low":0}', [b'"low":0}']),  # a number ended where the parent goes on with it
    (b'{"c":', b' "', b'0,"p":0}', [b'","p":0}']),  # a string value where the parent writes a number
    (b'{"adults', b'":', b'waste":0},"x":""}', [b'0},"x":""}']),  # another key closed, the parent's value
    (b'{"k": "\xc3\xb1and\xc3\xba', b'",\n', b'","b":"\xc3\xa9"}', [b'"b":"\xc3\xa9"}']),  # (non-ASCII)
])
def test_rejoin_candidates(before, tb, text, want):
    assert _cands(before, tb, text) == want


class _Walking(CertifiedBudget):
    """The budget as it was: no rejoined candidate, a walk after every token that leaves the certificate."""

    rejoin = False


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "high": {"type": "integer"}, "low": {"type": "integer"}, "note": {"type": "string"},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]},
    "tags": {"type": "array", "items": {"type": "string"}}, "any": {}},
    "required": ["name", "high"]}
DOCS = [  # (in the schema's order of properties, which xgrammar keeps)
    {"name": "Jurassic", "high": 55357, "low": 56832, "note": "ñandú über",
     "address": {"city": "Santa Clara", "zip": "95050"}, "tags": ["a", "b c"], "any": "x"},
    {"name": "Ada", "high": 3, "address": {"city": "Z\u00fcrich"}, "tags": [], "any": 1.5},
]


@pytest.fixture(scope="module")
def tok():
    from specgrammar_plugins.models import TINY_DIR, tiny_tokenizer_info

    if not (TINY_DIR / "tokenizer.json").exists():
        pytest.skip("the bundled tiny tokenizer is not in the tree")
    return tiny_tokenizer_info()


@pytest.mark.parametrize("doc", DOCS, ids=["long", "short"])
def test_pretty_printed_documents_keep_every_certificate_with_fewer_walks(tok, doc):
    compiled = compile_constraint(ConstraintSpec.json_schema(SCHEMA), tok, engine="xgrammar")
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    ids = list(tok.encode(text))
    m = compiled.matcher()
    assert all(m.accept(t) for t in ids)
    room = len(ids) + 48
    new, old = make_budget(compiled, room), _Walking(compiled, room)
    assert isinstance(new, CertifiedBudget) and not new.lost and not old.lost
    w0 = (new.walks, old.walks)  # (the start's walk, where it was not kept from before)
    new._sync(ids)
    old._sync(ids)
    walks = (new.walks - w0[0], old.walks - w0[1])
    assert [len(c) for c in new._certs] == [len(c) for c in old._certs]  # (None has no length: none is lost)
    for p, c in enumerate(new._certs):  # each certificate: a completion the engine accepts after its prefix
        m = compiled.matcher()
        assert all(m.accept(t) for t in [*ids[:p], *c]) and m.is_terminated(), (p, tok.decode(list(c)))
    assert walks[1] >= 8 and walks[0] * 2 <= walks[1], walks


@pytest.mark.parametrize("pad", [0, 96], ids=["tokenizer-wide", "padded"])
def test_whole_rows_along_pretty_printed_documents_are_cut_as_with_walks(pad):
    import numpy as np

    from specgrammar_plugins.history import HistoryMatcher
    from specgrammar_plugins.masks import mask_words
    from specgrammar_plugins.models import TINY_DIR, tiny_tokenizer_info

    if not (TINY_DIR / "tokenizer.json").exists():
        pytest.skip("the bundled tiny tokenizer is not in the tree")
    tok = tiny_tokenizer_info()
    tok = tiny_tokenizer_info(tok.vocab_size + pad)
    assert tok.vocab_size == len(tok.token_bytes) + pad
    compiled = compile_constraint(ConstraintSpec.json_schema(SCHEMA), tok, engine="xgrammar")
    for doc in DOCS:
        ids = list(tok.encode(json.dumps(doc, indent=2, ensure_ascii=False)))
        rows = []
        for make in (make_budget, _Walking):  # a budget that binds near the end: rows are cut
            budget, hm, got = make(compiled, len(ids) + 12), HistoryMatcher(compiled), []
            for p in range(len(ids) + 1):  # the target position and the next 4 (a draft step's rows)
                for i in range(min(4, len(ids) - p) + 1):
                    assert hm.sync(ids[:p + i])
                    row = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)
                    hm.matcher.fill_mask(row)
                    got.append((budget.mask_row(row, ids[:p + i], 16, whole=True, far="open"), row.tobytes()))
            assert not budget.lost and not budget.lost_midway
            rows.append(got)
        assert rows[0] == rows[1] and any(c for c, _ in rows[0])
