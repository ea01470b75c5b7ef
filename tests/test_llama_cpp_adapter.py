"""llama-cpp-python adapter: SpecLlama's loop against the stock Llama on the committed tiny GGUF models.

Greedy: our output equals the stock ``Llama`` with the same grammar and no drafting, token for token, for every
workload and k = 1..8 (drafts from the draft model, and from forced tokens alone).  Constraints in every spelling,
chat completion with a JSON schema (streaming and not), invalid constraints as a clear ``ConstraintError``.
Runs with n_threads=1; skips when llama-cpp-python or the tiny models are absent.
"""

import json
import re

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from specgrammar_plugins import ConstraintError, ConstraintSpec  # noqa: E402
from specgrammar_plugins.errors import BudgetError  # noqa: E402
from specgrammar_plugins.models import tiny_gguf  # noqa: E402
from specgrammar_plugins.workloads import (  # noqa: E402
    EMAIL_REGEX, JSON_EXTRACTION_SCHEMA, WORKLOADS, chat_prompt, constraint, examples, is_valid)

TARGET, DRAFT = tiny_gguf("target"), tiny_gguf("draft")
pytestmark = pytest.mark.skipif(not (TARGET.exists() and DRAFT.exists()),
                                reason="the tiny GGUF models (specgrammar_plugins/models/tiny/*.gguf) are absent")
KW = dict(n_threads=1, n_threads_batch=1, n_ctx=512, verbose=False, seed=0)
MAX_TOKENS = 40

# The same language as each workload's constraint, as llama.cpp GBNF: both sides get exactly this grammar text.
REGEX_GBNF = {
    "order_id": 'root ::= [A-Z]{3} "-" [0-9]{4}',
    "year": "root ::= [0-9]{4}",
    "email": 'root ::= [a-z]+ "@" [a-z]+ ".com"',
}


def gbnf_for(workload):
    from llama_cpp import llama_grammar

    spec = constraint(workload)
    if spec is None:
        return None
    if workload in REGEX_GBNF:
        return REGEX_GBNF[workload]
    if spec.kind == "json_schema":
        return llama_grammar.json_schema_to_gbnf(spec.value)
    return spec.value  # sql: GBNF already


@pytest.fixture(scope="module")
def stock():
    return llama_cpp.Llama(str(TARGET), **KW)


@pytest.fixture(scope="module")
def draft_llama():
    return llama_cpp.Llama(str(DRAFT), **KW)


@pytest.fixture(scope="module")
def ours(draft_llama):
    from specgrammar_llama_cpp import SpecLlama

    return SpecLlama(str(TARGET), draft=draft_llama, k=4, **KW)


@pytest.fixture(scope="module")
def ours_nodraft():
    from specgrammar_llama_cpp import SpecLlama

    return SpecLlama(str(TARGET), k=4, **KW)


def prompt_tokens(llm, user):
    return llm.tokenize(chat_prompt(user).encode("utf-8"), add_bos=False, special=True)


def greedy_tokens(llm, tokens, gbnf):
    """Tokens ``generate`` yields at temperature 0 up to and including the first end-of-generation token."""
    grammar = None if gbnf is None else llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)
    out = []
    for t in llm.generate(tokens, temp=0.0, grammar=grammar):
        out.append(int(t))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t) or len(out) >= MAX_TOKENS:
            break
    return out


@pytest.mark.parametrize("workload", WORKLOADS)
def test_greedy_equals_stock_every_k(stock, ours, ours_nodraft, workload):
    gbnf = gbnf_for(workload)
    ex = examples(workload, "eval", 2)
    for i, e in enumerate(ex):
        p = prompt_tokens(stock, e.prompt)
        want = greedy_tokens(stock, p, gbnf)
        ks = range(1, 9) if i == 0 else (3, 8)
        for k in ks:
            ours.k = k
            got = greedy_tokens(ours, p, gbnf)
            assert got == want, (workload, k, stock.detokenize(want), ours.detokenize(got))
            assert ours.last_stats.target_passes <= len(want)
        for k in (1, 4, 8):  # no draft model: forced tokens only
            ours_nodraft.k = k
            assert greedy_tokens(ours_nodraft, p, gbnf) == want, (workload, k)
    ours.k = 4


def test_completion_api_and_spellings(stock, ours):
    """create_completion through our generate(): the text equals stock's; a ConstraintSpec, a GBNF string and a
    LlamaGrammar of one language give one output; a regex spec equals its GBNF twin."""
    e = examples("year", "eval", 1)[0]
    prompt = chat_prompt(e.prompt)
    g = REGEX_GBNF["year"]
    want = stock.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   grammar=llama_cpp.LlamaGrammar.from_string(g, verbose=False))
    outs = [
        ours.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0, grammar=g),
        ours.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0,
                               grammar=llama_cpp.LlamaGrammar.from_string(g, verbose=False)),
        ours.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0, constraint=ConstraintSpec.regex("[0-9]{4}")),
        ours(prompt, max_tokens=MAX_TOKENS, temperature=0, regex="[0-9]{4}"),
        ours.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0, response_format={"type": "regex", "regex": "[0-9]{4}"},
                               specgrammar={"k": 2}),
    ]
    for o in outs:
        assert o["choices"][0]["text"] == want["choices"][0]["text"]
        assert o["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "stop"
        assert o["usage"] == want["usage"]
    assert is_valid("year", outs[0]["choices"][0]["text"])
    # streaming: the chunks add up to the same text
    chunks = list(ours.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0, grammar=g, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == want["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # a max_tokens the grammar cannot end within is refused up front (budget feasibility, on by default), naming
    # the shortest length; with the budget mask off the request stops where the host stops it
    with pytest.raises(BudgetError, match="takes 3 tokens") as err:
        ours.create_completion(prompt, max_tokens=2, temperature=0, grammar=g)
    assert err.value.shortest == 3 and err.value.budget == 2
    short = ours.create_completion(prompt, max_tokens=2, temperature=0, grammar=g,
                                   specgrammar={"budget_mask": False})
    ref = stock.create_completion(prompt, max_tokens=2, temperature=0,
                                  grammar=llama_cpp.LlamaGrammar.from_string(g, verbose=False))
    assert short["choices"][0]["text"] == ref["choices"][0]["text"]
    assert short["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spelling", ["llama_cpp", "openai"])
def test_chat_completion_json_schema(ours, stream, spelling):
    import jsonschema

    e = examples("json_extraction", "eval", 1)[0]
    schema = constraint("json_extraction").schema
    rf = ({"type": "json_object", "schema": schema} if spelling == "llama_cpp"
          else {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    res = ours.create_chat_completion([{"role": "user", "content": e.prompt}], response_format=rf, temperature=0,
                                      max_tokens=200, stream=stream)
    if stream:
        parts = list(res)
        text = "".join(p["choices"][0]["delta"].get("content", "") or "" for p in parts)
        finish = parts[-1]["choices"][0]["finish_reason"]
    else:
        text = res["choices"][0]["message"]["content"]
        finish = res["choices"][0]["finish_reason"]
    assert finish == "stop", text
    jsonschema.validate(json.loads(text, strict=False), schema)  # xgrammar lets raw control chars into strings
    assert ours.last_stats is not None and ours.last_stats.emitted >= 1


def test_chat_stream_equals_nonstream_at_t_positive(ours):
    """Sampling at T > 0 with a fixed seed is reproducible and the same through both chat paths."""
    e = examples("tool_call", "eval", 1)[0]
    rf = {"type": "json_object", "schema": constraint("tool_call").schema}
    msgs = [{"role": "user", "content": e.prompt}]
    a = ours.create_chat_completion(msgs, response_format=rf, temperature=0.9, seed=11, max_tokens=120)
    b = ours.create_chat_completion(msgs, response_format=rf, temperature=0.9, seed=11, max_tokens=120, stream=True)
    text_b = "".join(p["choices"][0]["delta"].get("content", "") or "" for p in b)
    assert a["choices"][0]["message"]["content"] == text_b


@pytest.mark.parametrize("bad", [
    dict(response_format={"type": "json_object", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}),
    dict(response_format={"type": "json_schema", "json_schema": {"schema": "{not json"}}),
    dict(grammar="root ::= ("),
    dict(grammar='root ::= "a" undefined_rule'),
    dict(regex="[a-"),
])
def test_invalid_constraint_is_a_clear_error_and_the_process_survives(ours, bad):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ConstraintError):
        ours.create_chat_completion(msgs, max_tokens=4, **bad)
    with pytest.raises(ConstraintError):  # streaming: raised at the call, not at the first chunk
        ours.create_chat_completion(msgs, max_tokens=4, stream=True, **bad)
    # still alive and serving
    ok = ours.create_completion(chat_prompt("What year? 1999"), max_tokens=4, temperature=0, regex="[0-9]{4}")
    assert ok["choices"][0]["text"]


@pytest.mark.parametrize("bad,field", [
    (dict(temperature=float("nan"), regex="[0-9]{4}"), "temperature"),
    (dict(top_p=float("inf")), "top_p"),
    (dict(regex="[0-9]{4}", specgrammar={"lambda": float("inf")}), "specgrammar.lambda"),
    (dict(regex="[0-9]{4}", specgrammar={"turbo": True}), "specgrammar.turbo"),
    (dict(regex="[0-9]{4}", specgrammar={"recipe": "/etc/passwd"}), "specgrammar.recipe"),
    (dict(regex="[0-9]{4}", specgrammar={"k": 10**5}), "specgrammar.k"),
    (dict(seed=-1), "seed"),
    (dict(logit_bias={"99999": 1.0}), "logit_bias"),
    (dict(regex="[0-9]{4}", stop=["9"]), "stop"),
    (dict(grammar='root ::= "19" [0-9] [0-9]', stop=["9"]), "stop"),
])
def test_the_gate_refuses_bad_arguments_naming_them(ours, bad, field):
    """The core's gate on SpecLlama's calls (issue 22): non-finite or out-of-range numbers, unknown specgrammar
    keys, a recipe given as a path, a constraint with stop strings; the model keeps serving."""
    from specgrammar_plugins.errors import RequestError

    with pytest.raises(RequestError) as e:
        ours.create_completion(chat_prompt("What year? 1999"), max_tokens=4, **bad)
    assert e.value.field == field, (e.value.field, str(e.value))
    ok = ours.create_completion(chat_prompt("What year? 1999"), max_tokens=4, temperature=0, regex="[0-9]{4}")
    assert re.fullmatch("[0-9]{4}", ok["choices"][0]["text"])


def test_non_ascii_choice_and_a_shipped_pack_by_name(ours):
    """An emoji choice (its forced bytes end inside a character) decodes whole; a pack is named, not a path."""
    out = ours.create_completion(chat_prompt("Thumbs?"), max_tokens=12, temperature=0, choice=["👍", "👎"],
                                 specgrammar={"recipe": "year"})
    assert out["choices"][0]["text"] in ("👍", "👎")


def test_two_constraints_are_refused(ours):
    with pytest.raises(ConstraintError, match="only one constraint"):
        ours.create_completion("x", grammar="root ::= \"a\"", regex="a")


def test_sampling_params_mapping():
    from specgrammar_llama_cpp import sampling_params

    assert sampling_params(0.0, 40, 0.95, 0.05).greedy
    p = sampling_params(0.7, 40, 0.9, 0.1)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.temperature_last) == (0.7, 40, 0.9, 0.1, True)
    full = sampling_params(-1.0, 40, 0.9, 0.1)  # llama.cpp: temp < 0 -> dist alone
    assert (full.temperature, full.top_k, full.top_p, full.min_p) == (1.0, 0, 1.0, 0.0)
    assert sampling_params(1.0, 0, 1.5, -1).top_p == 1.0


def test_seed_reaches_the_law(ours):
    prompt = chat_prompt(examples("email", "eval", 1)[0].prompt)
    outs = [ours.create_completion(prompt, max_tokens=12, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                                   seed=s, regex="[a-z]+@[a-z]+\\.com")["choices"][0]["text"] for s in (1, 1, 2, 3, 4)]
    assert outs[0] == outs[1]
    assert len(set(outs)) > 1


def test_tokenizer_info_matches_the_hf_tokenizer(stock):
    """Token bytes read from the GGUF vocabulary equal the HF tokenizer's (the models share one)."""
    from specgrammar_llama_cpp import tokenizer_info
    from specgrammar_plugins.models import tiny_tokenizer_info

    ours = tokenizer_info(stock)
    hf = tiny_tokenizer_info(vocab_size=ours.vocab_size)
    assert ours.vocab_size == stock.n_vocab()
    diff = [i for i, (a, b) in enumerate(zip(ours.token_bytes, hf.token_bytes)) if a != b]
    assert not diff, diff[:10]
    assert hf.eos_token_id in ours.stop_token_ids


def test_runner_rollback_and_rows(stock):
    """forward computes logits only for the rows asked, equal to one-at-a-time decoding; trim checks
    llama_memory_seq_rm's answer."""
    from specgrammar_llama_cpp import LlamaRunner

    llm = llama_cpp.Llama(str(TARGET), **KW)
    r = LlamaRunner(llm)
    p = prompt_tokens(llm, examples("sql", "eval", 1)[0].prompt)
    assert r.forward(p, logits_for=0).shape == (0, r.vocab_size)
    r.trim(3)
    batch = r.forward(p[-3:], logits_for=2)
    assert batch.shape == (2, r.vocab_size) and r.tokens == p
    r.trim(2)
    one = r.forward(p[-2:-1], logits_for=1)
    np.testing.assert_allclose(one[0], batch[0], atol=1e-4)
    assert r.tokens == p[:-1]
    with pytest.raises(ValueError):
        r.trim(len(p) + 5)


def test_logprobs_with_logits_all_match_stock():
    """With logits_all=True the host reads logprobs from its scores buffer; our runner fills it like its eval."""
    from specgrammar_llama_cpp import SpecLlama

    kw = dict(KW, logits_all=True)
    prompt = chat_prompt(examples("email", "eval", 1)[0].prompt)
    g = REGEX_GBNF["email"]
    a = llama_cpp.Llama(str(TARGET), **kw).create_completion(prompt, max_tokens=12, temperature=0, logprobs=2,
                                                            grammar=llama_cpp.LlamaGrammar.from_string(g, verbose=False))
    b = SpecLlama(str(TARGET), draft=str(DRAFT), k=3, **kw).create_completion(prompt, max_tokens=12, temperature=0,
                                                                              logprobs=2, grammar=g)
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    assert la["tokens"] == lb["tokens"]
    np.testing.assert_allclose(la["token_logprobs"], lb["token_logprobs"], atol=1e-3)
    assert [sorted(d) for d in la["top_logprobs"]] == [sorted(d) for d in lb["top_logprobs"]]


def test_recipe_pack_drafts_without_a_draft_model(stock):
    """Drafts from a recipe pack (built from the target's own greedy outputs) and forced tokens, no draft model:
    the output is unchanged and most tokens come from drafts."""
    from specgrammar_llama_cpp import SpecLlama, tokenizer_info
    from specgrammar_plugins.recipes import Sample, build

    gbnf = gbnf_for("tool_call")
    exs = examples("tool_call", "eval", 3)
    outs = []
    for e in exs:
        p = prompt_tokens(stock, e.prompt)
        outs.append((p, greedy_tokens(stock, p, gbnf)))
    pack = build([Sample(tuple(p), tuple(o)) for p, o in outs for _ in range(3)], tokenizer_info(stock), min_count=1)
    llm = SpecLlama(str(TARGET), k=8, drafters=("forced", "recipe"), recipe=pack, **KW)
    for p, want in outs:
        assert greedy_tokens(llm, p, gbnf) == want
        st = llm.last_stats
        assert st.accepted_by_source.get("recipe", 0) > 0
        assert st.tokens_per_pass > 1.5, st.as_dict()


def test_shipped_recipe_pack_loads_on_the_gguf(stock):
    """The shipped packs (built through the HF tokenizer, which stops on <|im_end|> only) bind to the GGUF's
    tokenizer, where llama.cpp also marks <|endoftext|> as end-of-generation: packs are bound to the token bytes,
    not the stop set (a pack was refused here with a fingerprint mismatch).  Greedy output unchanged."""
    from specgrammar_llama_cpp import SpecLlama, tokenizer_info
    from specgrammar_plugins.models import tiny_tokenizer_info

    assert tokenizer_info(stock).fingerprint != tiny_tokenizer_info().fingerprint  # the stop sets differ
    gbnf = gbnf_for("json_extraction")
    llm = SpecLlama(str(TARGET), k=8, drafters=("forced", "recipe"), recipe="json_extraction", **KW)
    for e in examples("json_extraction", "eval", 2):
        p = prompt_tokens(stock, e.prompt)
        assert greedy_tokens(llm, p, gbnf) == greedy_tokens(stock, p, gbnf)
        assert llm.last_stats.accepted_by_source.get("recipe", 0) > 0


def test_stopping_criteria_like_the_host(stock, ours):
    """A criterion that stops on a (non end-of-generation) token: same text and finish as the stock loop."""
    prompt = chat_prompt(examples("sql", "eval", 1)[0].prompt)
    from_tok = stock.tokenize(b" FROM", add_bos=False)[-1]

    def make():
        return llama_cpp.StoppingCriteriaList([lambda ids, logits: int(ids[-1]) == from_tok])

    g = gbnf_for("sql")
    a = stock.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0, stopping_criteria=make(),
                                grammar=llama_cpp.LlamaGrammar.from_string(g, verbose=False))["choices"][0]
    for k in (1, 4):
        ours.k = k
        b = ours.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0, stopping_criteria=make(),
                                   grammar=g)["choices"][0]
        assert (b["text"], b["finish_reason"]) == (a["text"], a["finish_reason"])
    ours.k = 4


def test_cost_aware_options_finish_within_budget(ours):
    """specgrammar {"adaptive": true}: the tilted law steers to an end within max_tokens (the exact regular J);
    the same request without it runs into the limit mid-answer when the limit is below the model's answer."""
    from specgrammar_plugins.compiler import compile_constraint
    from specgrammar_plugins.cost import cost_model_for
    from specgrammar_plugins.models import tiny_tokenizer_info

    e = examples("email", "eval", 1)[0]
    spec = ConstraintSpec.regex(EMAIL_REGEX)
    j0 = int(cost_model_for(compile_constraint(spec, tiny_tokenizer_info())).cost_to_go([]))
    prompt = chat_prompt(e.prompt)
    plain = ours.create_completion(prompt, max_tokens=64, temperature=0, regex=EMAIL_REGEX)
    n_plain = plain["usage"]["completion_tokens"]
    budget = j0 + 1
    out = ours.create_completion(prompt, max_tokens=budget, temperature=0, regex=EMAIL_REGEX,
                                 specgrammar={"adaptive": True, "budget_mask": False})  # the tilt alone
    c = out["choices"][0]
    assert c["finish_reason"] == "stop" and is_valid("email", c["text"]), (c, j0)
    cost = ours.last_stats.cost
    assert cost and cost["adaptive"] and cost["budget"] == budget
    if n_plain > budget:  # the untilted answer is longer than the budget: cut mid-answer without tilt or mask
        assert cost["lambda_max"] > 0
        cut = ours.create_completion(prompt, max_tokens=budget, temperature=0, regex=EMAIL_REGEX,
                                     specgrammar={"budget_mask": False})
        assert cut["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_budget_mask_ends_within_max_tokens_and_says_so(ours, stream):
    """On by default: with max_tokens below the model's own answer the output still ends complete and valid within
    it (an exact bound for the regex, a certified one for the JSON Schema on llguidance), and the response says the
    budget shaped it (``"specgrammar": {"budget": ...}``, on the final chunk when streaming)."""
    import jsonschema

    from specgrammar_plugins.compiler import compile_constraint
    from specgrammar_plugins.cost import cost_model_for
    from specgrammar_plugins.models import tiny_tokenizer_info

    e = examples("email", "eval", 1)[0]
    j0 = int(cost_model_for(compile_constraint(ConstraintSpec.regex(EMAIL_REGEX), tiny_tokenizer_info())).cost_to_go([]))
    prompt = chat_prompt(e.prompt)
    n_plain = ours.create_completion(prompt, max_tokens=64, temperature=0, regex=EMAIL_REGEX,
                                     specgrammar={"budget_mask": False})["usage"]["completion_tokens"]
    assert n_plain + 1 > j0 + 1  # the model's own answer does not fit in j0 + 1 tokens
    cases = [({"regex": EMAIL_REGEX}, j0 + 1, lambda t: is_valid("email", t), "exact")]
    from specgrammar_llama_cpp.runner import tokenizer_info
    from specgrammar_plugins.budget import make_budget

    x = examples("json_extraction", "eval", 1)[0]
    schema = compile_constraint(ConstraintSpec.json_schema(JSON_EXTRACTION_SCHEMA), tokenizer_info(ours),
                                engine="llguidance")
    cases.append(({"response_format": {"type": "json_object", "schema": JSON_EXTRACTION_SCHEMA},
                   "specgrammar": {"engine": "llguidance"}}, int(make_budget(schema, 256).shortest) + 2,
                  lambda t: jsonschema.validate(json.loads(t), JSON_EXTRACTION_SCHEMA) is None, "certified"))
    for fields, budget, valid, mode in cases:
        p = prompt if mode == "exact" else chat_prompt(x.prompt)
        out = ours.create_completion(p, max_tokens=budget, temperature=0, stream=stream, **fields)
        chunks = list(out) if stream else [out]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        last = chunks[-1]
        assert last["choices"][0]["finish_reason"] == "stop" and valid(text), (mode, text)
        b = last["specgrammar"]["budget"]
        assert b["mode"] == mode and b["budget"] == budget and b["shaped"], b
        assert ours.last_stats.emitted <= budget
