"""Issue 35's whole-dev-split check through vLLM (``bench schemas --completeness 0 --completeness-host vllm``): the
two bugs it found, each on one schema with the tiny pair's tokenizer as vLLM's xgrammar backend reads it (no
engine is built: the budget and the masks are the ones vLLM's bitmask rows are cut with), and what the run counts.

- xgrammar 0.2.8 accepts tokens its own mask leaves out (``ssi`` after ``"Cla`` in an enum's "Classical"): the
  certified budget's certificate used them, the tight zone kept only the certificate's way, which vLLM's row did
  not hold, and the row came back empty: vLLM sampled token 0 and failed the request (4 of 1,348 answered);
- the certified walk refused a comma as "the same token again and again" after eight, so an object of many
  required keys was walked into endless numbers (``"p8":123456789e1234...``): certificates far too long, and an
  iobroker schema got none at all and was served without the mask, cut off at 256 tokens (300 required array items
  none either).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

from specgrammar_plugins.api import (BudgetError, ConstraintSpec, SpecOptions, check_budget,  # noqa: E402
                                     compile_constraint)
from specgrammar_plugins.masks import mask_allows, mask_words  # noqa: E402
from specgrammar_plugins.models import tiny_path  # noqa: E402

# BFCL_simple_284 of the MaskBench dev split
CONCERT = {"type": "object", "properties": {"concert_info.get": {
    "type": "object", "properties": {"location": {"type": "string"}, "date": {"type": "string"},
                                     "genre": {"type": "string", "enum": ["Pop", "Rock", "Country", "Classical",
                                                                          "Electronic", "Hip-Hop"]}},
    "required": ["location", "date", "genre"], "additionalProperties": False}},
    "required": ["concert_info.get"], "additionalProperties": False}
# the tiny target's greedy output for it on vLLM before the fix: 249 tokens, ending `"genre":"Cla` (the next row
# was empty): `{"concert_info.get"`, 197 spaces, `:{"location":"","date":"","genre":"Cla`
PATH = ([305, 69, 81, 80, 69, 71, 84, 86, 65, 293, 394, 16, 73, 71, 86, 4] + [223] * 197
        + [28, 305, 78, 81, 69, 67, 86, 75, 81, 80, 4, 28, 4, 4, 14, 4, 70, 320, 71, 4, 28, 4, 4, 14, 4, 73, 71, 80,
           84, 71, 4, 28, 4, 37, 78, 67])
BUDGET = 256


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from specgrammar_vllm.budget_mask import grammar_tokenizer

    return grammar_tokenizer(AutoTokenizer.from_pretrained(str(tiny_path("target"))), 1024, "xgrammar")


def _compile(tok, schema, engine="xgrammar"):
    opts = {"xgrammar_strict_mode": True} if engine == "xgrammar" else {}
    return compile_constraint(ConstraintSpec.json_schema(schema), tok, engine=engine, **opts)


def _row(m, words):
    row = np.zeros(words, dtype=np.int32)
    m.fill_mask(row)
    return row


def test_certificates_are_ways_the_engines_own_masks_allow(tok):
    """Along the recorded path, each prefix's certificate (where one fits) is taken token by token from the rows
    xgrammar's mask gives, to the end."""
    c = _compile(tok, CONCERT)
    budget = check_budget(c, SpecOptions(), BUDGET)
    words = mask_words(tok.vocab_size)
    checked = 0
    for n in range(len(PATH) - 12, len(PATH) + 1):
        cert = budget._sync(PATH[:n])
        if not cert:
            continue
        m = c.matcher()
        assert all(m.accept(t) for t in PATH[:n])
        for t in cert:  # (its stop token included)
            assert mask_allows(_row(m, words), t), (n, tok.decode(list(cert)), tok.token_bytes[t])
            assert m.accept(t)
        assert m.is_terminated()
        checked += 1
    assert checked >= 6


def test_every_choice_the_combined_rows_leave_ends_within_the_budget_on_vllms_failing_path(tok):
    """The recorded path while the combined row (xgrammar's row, cut by ``Budget.mask_row`` as vLLM's is) still
    holds its tokens, then the most wasteful choice the rows leave (the highest id: spaces, long strings): every
    row has a token, and the output ends complete and valid within the budget."""
    import jsonschema

    c = _compile(tok, CONCERT)
    budget = check_budget(c, SpecOptions(), BUDGET)
    m, words = c.matcher(), mask_words(tok.vocab_size)
    out: list[int] = []
    followed = 0
    while not m.is_terminated():
        assert len(out) < BUDGET, tok.decode(out)
        row = _row(m, words)
        budget.mask_row(row, out, 16)
        allowed = [t for t in range(tok.vocab_size) if mask_allows(row, t)]
        assert allowed, f"an empty row after {len(out)} tokens: {tok.decode(out)[-40:]!r}"
        t = PATH[len(out)] if followed == len(out) and len(out) < len(PATH) and PATH[len(out)] in allowed \
            else allowed[-1]
        followed += t == PATH[len(out)] if len(out) < len(PATH) else 0
        if t in tok.stop_token_ids:
            break
        assert m.accept(t)
        out.append(t)
    assert len(out) + 1 <= BUDGET
    assert followed > 200  # the recorded path was followed into the tight zone
    jsonschema.validate(json.loads(tok.decode(out)), CONCERT)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_an_object_of_many_required_keys_is_certified_without_endless_numbers(tok, engine):
    props = {f"p{i}": {"type": "number"} for i in range(12)}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    budget = check_budget(_compile(tok, schema, engine), SpecOptions(), BUDGET)
    cert = budget._sync([])
    value = json.loads(tok.decode([t for t in cert if t not in tok.stop_token_ids]))
    assert all(abs(v) < 10 for v in value.values()), value  # one digit each (was 123456789e1234...: 168 tokens)
    assert len(cert) <= 80, len(cert)


def test_what_the_run_counts_as_refused_at_compile_and_by_the_budget(tok):
    """The run's gate (``vllm_host.gate``, vLLM itself not imported here): a keyword strict xgrammar does not
    enforce is a compile refusal named by that keyword; 300 required items are a budget refusal naming a length
    (before the comma fix the walk found no certificate: served without the mask); the report's counts."""
    from specgrammar_plugins.api import ConstraintError
    from specgrammar_plugins.bench.schemas import vllm_rows
    from specgrammar_plugins.bench.vllm_host import _lost, refusal_reason

    # (vLLM 0.32 keys the engine's request by its id and a random suffix: the budget records that one)
    assert _lost("1074", {"1074-b2538804": None}) and not _lost("107", {"1074-b2538804": None})

    with pytest.raises(ConstraintError) as e:
        _compile(tok, {"type": "object", "properties": {"u": {"type": "string", "format": "uri"}}, "required": ["u"]})
    assert refusal_reason(e.value) == "format: uri"
    with pytest.raises(BudgetError) as b:
        check_budget(_compile(tok, {"type": "array", "items": {"type": "integer"}, "minItems": 300}), SpecOptions(),
                     BUDGET)
    assert b.value.shortest is not None and b.value.shortest > BUDGET
    base = {"family": "x", "temperature": 0.0, "refused": False, "refused_at": None, "complete": True, "valid": True,
            "cut": False}
    recs = [dict(base, schema="uri", refused=True, refused_at="compile", complete=False, valid=False),
            dict(base, schema="long", refused=True, refused_at="budget", complete=False, valid=False),
            dict(base, schema="ok"), dict(base, schema="cut", complete=False, valid=False, cut=True),
            dict(base, schema="bad", valid=False)]
    every = vllm_rows(recs)[-1]
    assert {k: every[k] for k in ("schemas", "refused_compile", "refused_budget", "answered", "complete", "valid",
                                  "cut_off", "invalid")} == {"schemas": 5, "refused_compile": 1, "refused_budget": 1,
                                                             "answered": 3, "complete": 2, "valid": 1, "cut_off": 1,
                                                             "invalid": 1}


# an array whose item needs far more tokens than the budget leaves (issue 35's two cut-offs at T = 0.7, GitHub hard
# o48771 and o47247: one token, `{"` after `[`, opened an item of ~720 tokens while the certificate's slack was ~200)
ITEM = {"type": "object", "properties": {f"field{i}": {"type": "string"} for i in range(40)},
        "required": [f"field{i}" for i in range(40)], "additionalProperties": False}
BIG_ITEMS = {"type": "object", "properties": {"name": {"type": "string"}, "list": {"type": "array", "items": ITEM}},
             "required": ["name", "list"], "additionalProperties": False}


def _opener_first(tok, allowed):
    """The most wasteful choice: a token that opens a container, else the highest id (long strings, spaces)."""
    return next((t for t in allowed if any(c in tok.token_bytes[t] for c in b"{[")), allowed[-1])


def test_a_token_that_opens_an_item_longer_than_the_budget_is_cut_far_from_the_limit(tok):
    """Far from the limit (the certificate's slack ~200 tokens, well above the margin of 16) the row still cuts a
    token that would leave no completion within the budget: the item's opening brace, whose shortest completion is
    longer than the whole budget.  Choosing an opener wherever the combined rows allow one, every row has a token
    and the output ends complete and valid within the budget, the certificate never lost (before: the brace was
    allowed, the certificate lost, and the output ran to the budget)."""
    import jsonschema

    c = _compile(tok, BIG_ITEMS)
    budget = check_budget(c, SpecOptions(), BUDGET)
    assert budget.mode == "certified" and budget.shortest < 40
    m, words = c.matcher(), mask_words(tok.vocab_size)
    start = tok.encode('{"name":"x","list":[')  # the array opened early (the slack still ~200)
    out: list[int] = []
    while not m.is_terminated():
        assert len(out) < BUDGET, tok.decode(out)
        row = _row(m, words)
        budget.mask_row(row, out, 16, far="open")
        assert not budget.lost_midway, tok.decode(out)
        allowed = [t for t in range(tok.vocab_size) if mask_allows(row, t)]
        assert allowed, f"an empty row after {len(out)} tokens: {tok.decode(out)[-40:]!r}"
        t = start[len(out)] if len(out) < len(start) else _opener_first(tok, allowed)
        if t in tok.stop_token_ids:
            break
        assert m.accept(t)
        out.append(t)
    value = json.loads(tok.decode(out))
    jsonschema.validate(value, BIG_ITEMS)
    assert value["list"] == []


def _in_the_array(tok):
    """BIG_ITEMS' budget, and a matcher after ``{"name":"x","list":[`` (the prefix)."""
    c = _compile(tok, BIG_ITEMS)
    prefix = tok.encode('{"name":"x","list":[')
    m = c.matcher()
    assert all(m.accept(t) for t in prefix)
    return check_budget(c, SpecOptions(), BUDGET), prefix, m, mask_words(tok.vocab_size)


def test_a_draft_alone_is_checked_as_in_the_whole_row(tok):
    """``BudgetedGrammar.fitting`` checks a draft alone (``whole=False``): the item's opener is cut there too."""
    from specgrammar_plugins.masks import set_bit

    budget, prefix, m, words = _in_the_array(tok)
    row = _row(m, words)
    openers = [t for t in range(tok.vocab_size) if mask_allows(row, t) and tok.token_bytes[t].startswith(b"{")]
    assert openers
    budget.mask_row(row, prefix, 16, far="open")
    assert not any(mask_allows(row, t) for t in openers)
    for t in openers:
        one = np.zeros(words, dtype=np.int32)
        set_bit(one, t)
        budget.mask_row(one, prefix, 16, whole=False, far="open")
        assert not mask_allows(one, t)


def test_a_prefix_left_without_a_certificate_is_counted(tok):
    """With the far zone unchecked (``far="off"``, the former rows) the item's opener is allowed, and a later row
    finds no certificate: ``lost_midway`` says so (``budget_mask`` counts it, ``budget_lost_midway``; before, a
    request that lost its certificate mid-way was counted nowhere)."""
    budget, prefix, m, words = _in_the_array(tok)
    row = _row(m, words)
    budget.mask_row(row, prefix, 16, far="off")
    opener = next(t for t in range(tok.vocab_size) if mask_allows(row, t) and tok.token_bytes[t].startswith(b"{"))
    out = [*prefix, opener]
    assert m.accept(opener)
    for _ in range(40):  # (far from the limit the prefixes since the last certified one are not worked out)
        row = _row(m, words)
        budget.mask_row(row, out, 16, far="off")
        if budget.lost_midway:
            break
        t = max(t for t in range(tok.vocab_size) if mask_allows(row, t))
        assert m.accept(t)
        out.append(t)
    assert budget.lost_midway, tok.decode(out)


def test_only_a_brace_or_bracket_outside_a_string_opens():
    """The far zone's ``open`` check looks at tokens that open an object or an array: a ``{`` or ``[`` in a key's or
    a value's content opens nothing (it made ``open`` certify every key-content group far from the limit: 16-38% of
    SmolLM2's target step), one after a string's closing quote does; a key's content is part of a token's structure
    (``{"name`` and ``{"id`` commit to different keys: certified apart)."""
    from specgrammar_plugins.budget import _opens

    assert not _opens(b'={"', True, True, "{")[2]  # key content, then the key's closing quote
    assert not _opens(b'[{', True, False, "[")[2]  # a value string's content
    assert _opens(b'":{', True, True, "{")[2] and _opens(b'"}, {', True, False, "[")[2]
    assert _opens(b' {"', False, False, "[")[2] and _opens(b"[", False, False, "{")[2]
    assert _opens(b",", False, False, "[")[2] and _opens(b"},", False, False, "[")[2]  # an array's next item
    assert _opens(b",", False, False, "{")[2] and not _opens(b"]", False, False, "[")[2]  # (an object's member)
    assert not _opens(b"", False, False, "[")[2]
    assert _opens(b'{"name', False, False, "[")[1] != _opens(b'{"id', False, False, "[")[1]


def test_a_comma_whose_next_member_is_too_long_for_the_room_is_cut_far_from_the_limit(tok):
    """An object's comma commits to another member: where the only one left has a 60-byte name (~40 tokens here)
    and 25 tokens are left (the certificate, ``}``, has a slack of 22), the comma is cut far from the limit; the
    former opener check let it through (a dev-split answer at T = 0.7, Github_medium o29990, lost its certificate
    after such a comma)."""
    name = "consistency_" * 5
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, name: {"type": "integer"}},
              "required": ["a"], "additionalProperties": False}
    c = _compile(tok, schema)
    prefix = tok.encode('{"a":1')
    comma = tok.encode(",")[0]
    m = c.matcher()
    assert all(m.accept(t) for t in prefix)
    budget = check_budget(c, SpecOptions(), len(prefix) + 25)
    assert len(budget._sync(prefix)) <= 3 and len(tok.encode(f',"{name}":0}}')) > 25
    for far, allowed in (("open", False), ("off", True)):
        row = _row(m, mask_words(tok.vocab_size))
        assert mask_allows(row, comma)
        budget.mask_row(row, prefix, 16, far=far)
        assert mask_allows(row, comma) is allowed, far


PROPS = {**{k: {"type": "integer"} for k in "acdefg"}, "b": {"type": "array", "items": {"type": "integer"}}}
ITEMS = {"type": "object", "properties": {"name": {"type": "string"}, "list": {"type": "array", "items": {
    "type": "object", "properties": PROPS, "required": list(PROPS), "additionalProperties": False}}},
    "required": ["name", "list"], "additionalProperties": False}


def test_far_rows_are_a_function_of_the_prefix_whatever_was_asked_before(tok, monkeypatch):
    """The far zone's shortcuts (a walk that closes what a token opened and rejoins the parent's certificate, the
    lexical scan carried from the last row) change no row: along a path that opens items far from the limit, up to
    the comma that would start a third item, cut there (a comma in an array is checked as an opener: the item needs
    36 tokens, 30 are left, the certificate's slack is 27), each row equals the row of a budget that saw no other
    prefix, and the row with the walk alone (no rejoin); and the rejoin is taken."""
    from specgrammar_plugins import budget as B

    c = _compile(tok, ITEMS)
    words = mask_words(tok.vocab_size)
    item = '{"a":%d,"c":1,"d":2,"e":3,"f":4,"g":5,"b":[%d]}'
    head = tok.encode('{"name":"x","list":[' + item % (1, 1) + ", " + item % (2, 2))
    path = head + tok.encode("," + item % (3, 3) + "]}")
    m = c.matcher()
    assert all(m.accept(t) for t in path)
    budget = len(head) + 30
    rejoins = []
    after = B._after_value
    monkeypatch.setattr(B, "_after_value", lambda *a: rejoins.append(1) or after(*a))

    def rows(b, n):
        m = c.matcher()
        assert all(m.accept(t) for t in path[:n])
        row = _row(m, words)
        b.mask_row(row, path[:n], 16, far="open")
        return row

    along = check_budget(c, SpecOptions(), budget)
    seen, carried = [], 0
    for n in range(len(head) + 1):
        seen.append(rows(along, n))
        ids, scan = along._ahead  # the lexical scan carried from row to row: the scan of its prefix's text
        if ids == path[:n]:
            fresh = along._scan_of(path[:n])
            assert (scan.stack, scan.in_str, scan.esc, scan.key_buf, bytes(scan.str_buf)) == \
                (fresh.stack, fresh.in_str, fresh.esc, fresh.key_buf, bytes(fresh.str_buf)), tok.decode(path[:n])
            carried += 1
    assert carried > 10
    assert all(mask_allows(seen[n], path[n]) for n in range(len(head)))
    assert not mask_allows(seen[-1], path[len(head)]) and tok.token_bytes[path[len(head)]] == b","
    assert budget - len(head) - len(along._sync(head)) >= 16 and rejoins
    for n in [*range(0, len(head), 5), len(head)]:
        assert np.array_equal(rows(check_budget(c, SpecOptions(), budget), n), seen[n]), tok.decode(path[:n])
    monkeypatch.setattr(B, "_after_value", lambda *a: None)  # the walk alone
    alone = check_budget(c, SpecOptions(), budget)
    assert all(np.array_equal(rows(alone, n), seen[n]) for n in range(len(head) + 1))


def test_the_longest_match_per_first_byte_spells_as_the_longest_token_of_all(tok):
    """``GreedyBytes`` looks for the longest match from the longest token that starts with the byte, not the longest
    of the vocabulary: the same spelling."""
    from specgrammar_plugins.engines._common import GreedyBytes

    g = GreedyBytes(tok)

    def naive(data):
        out, i = [], 0
        while i < len(data):
            k = next(k for k in range(min(g.max_len, len(data) - i), 0, -1) if data[i:i + k] in g.table)
            out.append(g.table[data[i:i + k]])
            i += k
        return out

    for text in [b'{"name": "x", "list": [{"a": 1}]}', b'   \n\t  {"results":   [ {"', b"Hello, world! 12345",
                 json.dumps(CONCERT).encode(), bytes(range(32, 127))]:
        assert g(text) == naive(text)
