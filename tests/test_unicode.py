"""Non-ASCII constraints on every engine: emoji, CJK, combining marks, right-to-left text and 4-byte code points in
regex, choice, enum, const and GBNF, decoded by the bundled tiny pair through the core loop (mlx-lm adapter),
greedy and sampled, with speculation on (draft model, forced tokens and jump-forward strings) and off.

Every output must be whole UTF-8 that the constraint accepts, and greedy output with speculation must equal greedy
output without it (the differential).  Regression (issue 22): xgrammar 0.2.8's ``find_jump_forward_string``
raises ``UnicodeDecodeError`` when the forced bytes end inside a UTF-8 sequence (a choice of "👍"/"👎" forces
F0 9F 91 and then branches): the mlx-lm server closed the connection, vLLM's EngineCore died."""

from __future__ import annotations

import json
import re

import pytest

from specgrammar_plugins import ConstraintError, ConstraintSpec, compile_constraint
from specgrammar_plugins.drafters import whole_utf8
from test_mlx_common import load_tiny_pair

ENGINES = ("xgrammar", "llguidance", "outlines_core", "dfa")
PROMPT = "Answer with one of the allowed values."
MAX_TOKENS = 40

# (id, spec, fullmatch regex of the valid outputs)
CASES = [
    ("regex-emoji-range", ConstraintSpec.regex("[😀-😂]{2}"), "[😀-😂]{2}"),
    ("regex-cjk", ConstraintSpec.regex("(日本語|中文)[0-9]"), "(日本語|中文)[0-9]"),
    ("regex-combining", ConstraintSpec.regex("e\u0301{1,2}a\u0308"), "e\u0301{1,2}a\u0308"),
    ("regex-rtl", ConstraintSpec.regex("(שלום|مرحبا) [a-c]{1,2}"), "(שלום|مرحبا) [a-c]{1,2}"),
    ("regex-4byte", ConstraintSpec.regex("𝔘𝔫𝔦[𝟎-𝟗]"), "𝔘𝔫𝔦[𝟎-𝟗]"),
    ("choice", ConstraintSpec.choice(["👍", "👎", "日本", "é", "שלום", "𝔘𝔫𝔦"]), "👍|👎|日本|é|שלום|𝔘𝔫𝔦"),
    ("enum", ConstraintSpec.json_schema({"enum": ["🐍", "🦀", "中文", "ñ", "עברית"]}), None),
    ("const", ConstraintSpec.json_schema({"const": "e\u0301 😀 日本 שלום 𝔘"}), None),
    ("gbnf", ConstraintSpec.grammar('root ::= ("😀" | "日本" | "שלום") " " [😀-😂] [😀-😂]?'),
     "(😀|日本|שלום) [😀-😂]{1,2}"),
]
JSON_VALUES = {"enum": ["🐍", "🦀", "中文", "ñ", "עברית"], "const": ["e\u0301 😀 日本 שלום 𝔘"]}


@pytest.fixture(scope="module")
def pair():
    return load_tiny_pair()


def _valid(case_id: str, pattern: str | None, data: bytes) -> bool:
    text = data.decode("utf-8")  # strict: a partial or invalid sequence fails here
    if pattern is not None:
        return re.fullmatch(pattern, text) is not None
    return json.loads(text) in JSON_VALUES[case_id]


# what each engine compiles (the others refuse the kind itself, with a clear error)
KINDS = {"xgrammar": {"regex", "choice", "json_schema", "grammar"}, "llguidance": {"regex", "choice", "json_schema",
         "grammar"}, "outlines_core": {"regex", "choice", "json_schema"}, "dfa": {"regex", "choice"}}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case_id,spec,pattern", CASES, ids=[c[0] for c in CASES])
def test_non_ascii_outputs_valid_and_speculation_changes_nothing(pair, engine, case_id, spec, pattern):
    from specgrammar_mlx_lm.generate import generate_tokens
    from specgrammar_mlx_lm.processor import tokenizer_info
    from specgrammar_mlx_lm.runner import output_width

    target, draft, tok = pair
    info = tokenizer_info(tok, output_width(target))
    if spec.kind not in KINDS[engine]:
        with pytest.raises(ConstraintError):
            compile_constraint(spec, info, engine=engine)
        return
    eos = set(tok.eos_token_ids)
    outs = {}
    for temperature, seed in ((0.0, None), (1.0, 7)):
        for spec_on in (True, False):
            ids, stats = generate_tokens(target, tok, PROMPT, max_tokens=MAX_TOKENS, constraint=spec, engine=engine,
                                         draft_model=draft if spec_on else None, num_draft_tokens=4 if spec_on else 0,
                                         temperature=temperature, seed=seed)
            assert ids and ids[-1] in eos, (engine, case_id, temperature, spec_on, ids)  # finished, not cut
            data = info.decode(ids[:-1])
            assert _valid(case_id, pattern, data), (engine, case_id, temperature, spec_on, data)
            outs[temperature, spec_on] = ids
            if spec_on and temperature == 0.0:
                assert stats.target_passes <= len(ids), stats  # the loop ran (and drafted where it could)
    assert outs[0.0, True] == outs[0.0, False], (engine, case_id)


@pytest.mark.parametrize("engine", ENGINES)
def test_forced_text_ending_inside_a_character(engine):
    """The forced bytes of a choice of two emoji end inside the character (F0 9F 91, then 8D or 8E): ``forced()``
    answers on every engine (xgrammar 0.2.8 raised UnicodeDecodeError), and what the forced drafter tokenizes of
    such bytes is their whole characters only."""
    from specgrammar_plugins import TokenizerInfo
    from specgrammar_plugins.models import tiny_path

    tok = TokenizerInfo.from_file(str(tiny_path("target")))  # byte-level: every engine can spell any character
    c = compile_constraint(ConstraintSpec.choice(["👍", "👎"]), tok, engine=engine, cache=None)
    f = c.matcher().forced()
    assert f.text == "👍".encode()[:3] and whole_utf8(f.text) == ""
    assert whole_utf8("ab👍".encode()[:-1]) == "ab" and whole_utf8(b"a\xffb") == "a" and whole_utf8(b"") == ""
