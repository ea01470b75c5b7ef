"""Greedy: our loop's output equals mlx-lm's plain constrained ``generate_step`` (with our history-keyed grammar
processor) token for token, for every workload, k = 1..8, with and without the draft model (one eval prompt per
workload, at most 40 tokens)."""

from __future__ import annotations

import pytest

from test_mlx_common import load_tiny_pair, plain_generate_step, prompt_ids

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from specgrammar_plugins.workloads import WORKLOADS, examples  # noqa: E402

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_pair()


def _processor(spec, tok, model):
    from specgrammar_mlx_lm.processor import grammar_logits_processor

    return grammar_logits_processor(spec, tok, model) if spec is not None else None


def _cases():
    out = []
    for w in WORKLOADS:
        ex = examples(w, "eval", 1)[0]
        out.append((w, ex.prompt, ex.constraint))
    return out


@pytest.mark.parametrize("workload,user,spec", _cases(), ids=[c[0] for c in _cases()])
def test_greedy_equals_plain_generate_step(tiny, workload, user, spec):
    from specgrammar_mlx_lm.generate import generate_tokens

    model, draft, tok = tiny
    ids = prompt_ids(tok, user)
    eos = set(tok.eos_token_ids)
    ref = plain_generate_step(model, ids, processor=_processor(spec, tok, model), max_tokens=MAX_TOKENS, eos_ids=eos)
    for use_draft in (True, False):
        for k in range(1, 9):
            out, st = generate_tokens(model, tok, ids, max_tokens=MAX_TOKENS, draft_model=draft if use_draft else None,
                                      num_draft_tokens=k, constraint=spec, temperature=0.0)
            assert out == ref, (workload, use_draft, k, tok.decode(out), tok.decode(ref))
            assert st.target_passes <= len(ref)
    if spec is not None and ref and ref[-1] in eos:
        from specgrammar_plugins.workloads import is_valid

        assert is_valid(workload, tok.decode(ref[:-1])), tok.decode(ref)


