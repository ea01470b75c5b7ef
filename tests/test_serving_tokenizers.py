"""The core's tokenizer helpers for hosts (``serving``; issue 34, moved out of ``specgrammar_vllm.budget_mask``):
``engine_tokenizer`` (a Hugging Face tokenizer as an engine reads it: xgrammar's own view), ``with_stops`` (a
request's stop tokens), ``model_vocab_size``.  On the bundled tiny target's tokenizer."""

from __future__ import annotations

import json

import pytest

from specgrammar_plugins.api import (ConstraintSpec, compile_constraint, engine_tokenizer, model_vocab_size,
                                     with_stops)
from specgrammar_plugins.models import tiny_path
from specgrammar_plugins.testing import toy_tokenizer

if not (tiny_path("target") / "tokenizer.json").exists():
    pytest.skip("the tiny target model is not in the tree (issue 3)", allow_module_level=True)


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_path("target")))


def test_the_model_folders_width_then_the_tokenizers(hf, tmp_path):
    folder = tiny_path("target")
    assert model_vocab_size(str(folder), hf) == json.loads((folder / "config.json").read_text())["vocab_size"]
    assert model_vocab_size(str(tmp_path / "ñandú"), hf) == len(hf)  # no config.json there


def test_the_tokenizer_as_xgrammar_reads_it_is_cached_and_compiles(hf):
    pytest.importorskip("xgrammar")
    width = model_vocab_size(str(tiny_path("target")), hf)
    tok = engine_tokenizer(hf, width, "xgrammar")
    assert engine_tokenizer(hf, width, "xgrammar") is tok and tok.vocab_size == width
    assert all(tok.token_bytes[i] == b"" for i in tok.special_ids if i < len(tok.token_bytes))
    ours = engine_tokenizer(hf, width, "llguidance")  # another engine: our reading
    assert ours is not tok and ours.token_bytes == type(ours).from_hf(hf, vocab_size=width).token_bytes
    m = compile_constraint(ConstraintSpec.regex("ñandú|日本"), tok, engine="xgrammar").matcher()
    assert m.accept_bytes("日本".encode()) and m.accept(tok.eos_token_id)


def test_a_requests_stop_tokens():
    toy = toy_tokenizer()
    assert with_stops(toy, (), 0) is toy and with_stops(toy, None, 0) is toy
    t = with_stops(toy, [7, 3], 3)
    assert (t.eos_token_id, t.stop_token_ids) == (3, (3, 7))
    t = with_stops(toy, [9, 5], 0)  # the EOS is not one of them: the lowest first
    assert (t.eos_token_id, t.stop_token_ids) == (5, (5, 9))


def test_the_gates_facts_from_a_tokenizer(hf):
    from specgrammar_plugins.api import tokenizer_facts, tokenizer_info

    wrapper = pytest.importorskip("mlx_lm.tokenizer_utils").TokenizerWrapper(hf)  # (a host's wrapper: mlx-lm's)
    width = model_vocab_size(str(tiny_path("target")), hf)
    facts = tokenizer_facts(wrapper, width, 2048.0, {})
    info = tokenizer_info(wrapper, width)
    longest = max(len(b) for b in info.token_bytes)
    added = max(len(str(t).encode()) for t in hf.added_tokens_decoder.values())
    assert (facts["context_length"], facts["vocab_size"], facts["max_token_bytes"]) == (2048, width,
                                                                                         max(longest, added))
    assert facts["count_tokens"]({"prompt": "ñandú 日本"}) == len(hf.encode("ñandú 日本"))
    assert tokenizer_facts(wrapper, width)["context_length"] is None
