"""The budget's draft check runs once per draft on vLLM (``budget_mask.BudgetedGrammar``): the draft proposer checks a
request's drafts (``fitting_drafts``) and vLLM's ``validate_tokens`` reads that verdict where it sees the same drafts
after the same prefix, instead of walking the budget's rows again.  Its outcome must be the one checking twice gives:
the same accepted lengths, on real parts (vLLM's own xgrammar grammar, our certified budget for a JSON Schema on the
tiny pair's tokenizer), at every prefix of an output that runs into the budget (so that drafts are refused), including
where ``validate_tokens`` is handed the draft the proposer refused, other drafts than it checked, or a prefix it did
not check after."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
xgr = pytest.importorskip("xgrammar")

from specgrammar_plugins.api import ConstraintSpec, SpecOptions, check_budget, compile_constraint  # noqa: E402
from specgrammar_plugins.models import tiny_path  # noqa: E402

if not (tiny_path("target") / "tokenizer.json").exists() and not (tiny_path("target") / "config.json").exists():
    pytest.skip("the tiny target is not in the tree (issue 3)", allow_module_level=True)

from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402

from specgrammar_vllm import budget_mask  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
          "items": {"type": "string"}}}, "required": ["name", "tags"], "additionalProperties": False}
MAX_TOKENS = 24
K = 4
# an output whose name runs past what the budget leaves: the budget refuses its drafts near the end
TEXT = '{"name": "' + "abcdefghij klmnopqrst uvwxyz " * 3 + '", "tags": ["a"]}'


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoTokenizer

    path = tiny_path("target")
    hf = AutoTokenizer.from_pretrained(str(path))
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    tok = budget_mask.grammar_tokenizer(hf, vocab, "xgrammar")
    compiled = compile_constraint(ConstraintSpec.json_schema(SCHEMA), tok, engine="xgrammar",
                                  xgrammar_strict_mode=True)
    ctx = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)).compile_json_schema(
        json.dumps(SCHEMA))

    def grammar(name: str) -> budget_mask.BudgetedGrammar:
        budget = check_budget(compiled, SpecOptions(), MAX_TOKENS)
        assert budget.mode == "certified"
        inner = XgrammarGrammar(vocab_size=vocab, matcher=xgr.GrammarMatcher(ctx, max_rollback_tokens=K + 1), ctx=ctx)
        return budget_mask.BudgetedGrammar(inner, budget, name, width=vocab, deterministic_drafts=True)

    return grammar, hf.encode(TEXT, add_special_tokens=False)


def _walk(parts, before_validate):
    """Along the output, one token committed at a time: at each prefix the drafts (the next K tokens, as far as the
    grammar takes them) are checked by a grammar that only validates (the reference) and by one whose proposer
    checked first (``before_validate(g, drafts)``, then vLLM's ``validate_tokens``).  Returns the accepted lengths
    of both, per prefix."""
    grammar, ids = parts
    ref, once = grammar("ref"), grammar("once")
    got = []
    for p in range(len(ids)):
        drafts = ids[p:p + K]
        want = len(ref.validate_tokens(list(drafts)))
        handed = before_validate(once, list(drafts))
        got.append((want, len(once.validate_tokens(handed))))
        if not ref.accept_tokens("ref", [ids[p]]) or not once.accept_tokens("once", [ids[p]]):
            break  # (the grammar ends or refuses the output here)
        if len(ref.tokens) >= MAX_TOKENS - 1:
            break
    assert any(w < min(K, len(ids) - p) for p, (w, _) in enumerate(got)), "no draft was refused: the test is void"
    return got


def _proposer_checks(g, drafts):
    """As the draft proposer: its check ends the drafts (the rest are -1, stripped by vLLM) before validate_tokens."""
    n = g.fitting(list(g.tokens), g.inner.validate_tokens(drafts), "budget_draft_ns")
    return drafts[:n]


def test_checking_once_gives_the_accepted_lengths_checking_twice_gives(parts):
    got = _walk(parts, _proposer_checks)
    assert [w for w, _ in got] == [o for _, o in got]


def test_validate_tokens_refuses_the_draft_the_proposer_refused_without_walking_again(parts):
    def hand_all(g, drafts):  # the proposer's check, then the whole drafts handed on (its refused one included)
        g.fitting(list(g.tokens), g.inner.validate_tokens(drafts), "budget_draft_ns")
        return drafts

    got = _walk(parts, hand_all)
    assert [w for w, _ in got] == [o for _, o in got]


def test_other_drafts_or_another_prefix_are_checked_again(parts):
    grammar, ids = parts

    def other_drafts(g, drafts):  # the proposer checked drafts that differ from the second one on
        g.fitting(list(g.tokens), drafts[:1], "budget_draft_ns")
        return drafts

    got = _walk(parts, other_drafts)
    assert [w for w, _ in got] == [o for _, o in got]

    def stale(g, drafts):  # a check after the prefix one token shorter (the last step's): not this prefix's
        if g.tokens:
            g.fitting(list(g.tokens[:-1]), [g.tokens[-1], *drafts], "budget_draft_ns")
        return drafts

    got = _walk(parts, stale)
    assert [w for w, _ in got] == [o for _, o in got]


def test_a_check_the_proposer_made_is_not_walked_again(parts):
    grammar, ids = parts
    g = grammar("walks")
    walked = []
    for p in range(len(ids) - K):
        drafts = _proposer_checks(g, list(ids[p:p + K]))
        ns = g.budget.ns
        assert len(g.validate_tokens(drafts)) == len(drafts)
        walked.append(g.budget.ns - ns)
        if not g.accept_tokens("walks", [ids[p]]) or len(g.tokens) >= MAX_TOKENS - 1:
            break
    assert walked and not any(walked)  # (the budget's clock did not move: no row was walked)
