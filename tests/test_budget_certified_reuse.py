"""The certified budget's kept work changes no verdict (issue 34: the draft step's budget check).

``CertifiedBudget`` keeps what its certificate work worked out: each certificate per (prefix, token, room, parent
certificate) (``_next``: the draft check, the far zone's opener, the tight zone's candidates and the path ask for
the same one again and again), each text's spellings (``_spellings``), each certificate's text (``_text``), and it
certifies a mask-checked matcher's way without a wrapper per fork (``_certify``).  A ``_Reference`` budget works
every one of them out afresh, as before.  Both are driven through the same calls vLLM makes (a draft proposer's
check of each draft after the drafts before it, a row alone; then the grammar's whole rows at the position and after
each draft; the path taken back where drafts are rejected) at every prefix of real outputs, for several JSON Schemas
on the tiny pair's tokenizer, one with a budget that binds near the end (rows cut, drafts refused): every verdict
(the cut row and whether it cut), every lost flag and the certificates along the output must be the same.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("xgrammar")

from specgrammar_plugins import ConstraintSpec, compile_constraint  # noqa: E402
from specgrammar_plugins.budget import CertifiedBudget, make_budget  # noqa: E402
from specgrammar_plugins.history import HistoryMatcher  # noqa: E402
from specgrammar_plugins.masks import mask_allows, mask_words, set_bit  # noqa: E402

K = 4
MARGIN = 16

TOOL = {"type": "object", "properties": {
    "name": {"type": "string"},
    "arguments": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "units": {"type": "string", "enum": ["metric", "imperial"]}},
                  "required": ["city", "days", "units"]},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "arguments", "tags"]}
TOOL_TEXT = json.dumps({"name": "get_weather_forecast_for_the_week", "arguments": {
    "city": "San Francisco de Asis", "days": 12345, "units": "imperial"}, "tags": ["travel", "weather", "a b c"]})
PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "items": {"type": "object", "properties": {
    "first": {"type": "string"}, "age": {"type": "integer"}}, "required": ["first", "age"]}}},
    "required": ["people"]}
PEOPLE_TEXT = json.dumps({"people": [{"first": "Ada Lovelace", "age": 36}, {"first": "Alan", "age": 41},
                                     {"first": "Grace Hopper", "age": 85}]})


class _Reference(CertifiedBudget):
    """Every certificate worked out afresh: no certificate, spelling or text kept, the wrapper's own forks."""

    def _next(self, parent, h, t, r):
        return self._next_of(parent, h, t, r)

    def _certify(self, m, ids):
        f = m.fork()
        for t in ids:
            if not f.accept(int(t)):
                return False
        return f.is_terminated()

    def _spellings(self, text):
        self._spells.clear()
        return super()._spellings(text)

    def _text(self, cert):
        return self.tok.decode([t for t in cert if t not in self.stops])


@pytest.fixture(scope="module")
def tok():
    from specgrammar_plugins.models import TINY_DIR, tiny_tokenizer_info

    if not (TINY_DIR / "tokenizer.json").exists():
        pytest.skip("the bundled tiny tokenizer is not in the tree")
    return tiny_tokenizer_info()


def _alternative(hm: HistoryMatcher, prefix: list[int], avoid: int, words: int) -> int | None:
    """A token the grammar allows after ``prefix`` other than ``avoid`` (a rejected draft's branch): the first
    allowed opener (``{``, ``[``, ``,``, a quote) if any, else the lowest allowed id."""
    if not hm.sync(prefix):
        return None
    row = np.zeros(words, dtype=np.int32)
    hm.matcher.fill_mask(row)
    ids = [int(i) for i in np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))]
    ids = [i for i in ids if i != avoid and i < hm.vocab_size]
    tb = hm.compiled.tokenizer.token_bytes
    return next((i for i in ids if tb[i][:1] in (b"{", b"[", b",", b'"', b" ")), ids[0] if ids else None)


def _drive(budgets, compiled, ids: list[int], stop: int) -> tuple[list, int, int]:
    """The calls vLLM makes, on each budget alike, at every prefix of ``ids`` (then the stop token): the proposer's
    check of K drafts (the output's next tokens; every other position a rejected branch first: a token the grammar
    allows there other than the output's), then the whole rows at the position and after each draft.  Returns the
    verdicts of each budget (per call: whether it cut, the row after), how many rows were cut, how many drafts
    refused."""
    width = mask_words(compiled.tokenizer.vocab_size)
    hm = HistoryMatcher(compiled)
    out: list[list] = [[] for _ in budgets]
    cut = refused = 0
    full = [*ids, stop]

    def call(row, prefix, whole):
        got = []
        for b, o in zip(budgets, out):
            r = row.copy()
            c = b.mask_row(r, prefix, MARGIN, whole=whole, far="open")
            got.append((c, r.tobytes(), b.lost, b.lost_midway))
            o.append(got[-1])
        return got[0]

    for p in range(len(full)):
        prefix = full[:p]
        branches = [full[p:p + K]]
        if p % 2:  # a rejected branch first: another token the grammar allows here, then K - 1 more after it
            alt: list[int] = []
            while len(alt) < K:
                a = _alternative(hm, prefix + alt, -1 if alt else full[p], width)
                if a is None:
                    break
                alt.append(a)
            if alt:
                branches.insert(0, alt)
        for drafts in branches:
            for i, d in enumerate(drafts):  # the proposer's check (budget_mask.BudgetedGrammar.fitting)
                row = np.zeros(width, dtype=np.int32)
                set_bit(row, d)
                c, after, _, _ = call(row, prefix + drafts[:i], False)
                if not mask_allows(np.frombuffer(after, dtype=np.int32), d):
                    refused += 1
                    break
            for i in range(len(drafts) + 1):  # the grammar's rows (vLLM's bitmask): the position, each draft
                pre = prefix + drafts[:i]
                if not hm.sync(pre) or hm.matcher.is_terminated():
                    break
                row = np.zeros(width, dtype=np.int32)
                hm.matcher.fill_mask(row)
                cut += call(row, pre, True)[0]
    return out, cut, refused


@pytest.mark.parametrize("schema,text,room", [(TOOL, TOOL_TEXT, 128), (PEOPLE, PEOPLE_TEXT, 160),
                                              (TOOL, TOOL_TEXT, None)], ids=["tool", "people", "tool-binding"])
def test_kept_certificates_change_no_verdict(tok, schema, text, room):
    compiled = compile_constraint(ConstraintSpec.json_schema(schema), tok, engine="xgrammar",
                                  xgrammar_strict_mode=True)
    ids = list(tok.encode(text))
    assert tok.decode(ids) == text.encode()
    budget = room if room is not None else len(ids) + 3  # binding: the output's own length and the stop token
    fast = make_budget(compiled, budget)
    assert isinstance(fast, CertifiedBudget) and not fast.lost
    ref = _Reference(compiled, budget)
    (got, want), cut, refused = _drive([fast, ref], compiled, ids, fast.stop)
    assert len(got) == len(want) > 4 * len(ids)
    assert got == want  # every verdict, call by call
    n = min(len(fast._path), len(ref._path))
    assert fast._path[:n] == ref._path[:n] and fast._certs[:n + 1] == ref._certs[:n + 1]
    # the certificates along the whole output, one token at a time from the start, as ``_sync`` works them out
    for b in (fast, ref):
        b._sync(ids)
    assert fast._certs[:len(ids) + 1] == ref._certs[:len(ids) + 1]
    assert all(c is not None for c in fast._certs[:len(ids) + 1])
    assert fast._nexts  # (the kept certificates were used)
    if room is None:  # the budget binds: rows were cut and drafts refused, the same way
        assert cut > 0 and refused > 0
