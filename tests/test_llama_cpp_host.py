"""llama-cpp-python 0.3.36: the law at T > 0 against the stock constrained sampler, the host bugs we route around
(regression tests: each first shows the host's behaviour, then ours), and the stock-path pieces.

Law test: the language of ``root ::= [12] [0-9]`` (20 strings) after a year prompt, at temperature 2.5 with
top_k=40, top_p=0.9, min_p=0.2 (llama.cpp applies the filters before the temperature; with these the order changes
the law by total variation ~0.14, and the test must also reject the temperature-first law).  The
exact law of the output string is enumerated from the target's logits through the core law; 400 draws from the
stock ``Llama`` (llama.cpp's grammar sampler) and 400 from ``SpecLlama`` (draft model, k=3, residual verification)
are each held against it with a chi-square goodness-of-fit test (bins merged to expected >= 5), failing at
p < 1e-3: the noise floor is a 0.1% false-failure rate per comparison (seeds are fixed, so a run is reproducible).
"""

import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from scipy import stats

llama_cpp = pytest.importorskip("llama_cpp")

from specgrammar_plugins import ConstraintError, ConstraintSpec  # noqa: E402
from specgrammar_plugins.models import tiny_gguf  # noqa: E402
from specgrammar_plugins.workloads import chat_prompt, examples, is_valid  # noqa: E402

TARGET, DRAFT = tiny_gguf("target"), tiny_gguf("draft")
pytestmark = pytest.mark.skipif(not (TARGET.exists() and DRAFT.exists()),
                                reason="the tiny GGUF models (specgrammar_plugins/models/tiny/*.gguf) are absent")
KW = dict(n_threads=1, n_threads_batch=1, n_ctx=256, verbose=False, seed=0)
YEAR_GBNF = "root ::= [0-9]{4}"


def year_prompt():
    return chat_prompt(examples("year", "eval", 1)[0].prompt)


@pytest.fixture(scope="module")
def stock():
    return llama_cpp.Llama(str(TARGET), **KW)


@pytest.fixture(scope="module")
def ours():
    from specgrammar_llama_cpp import SpecLlama

    return SpecLlama(str(TARGET), draft=str(DRAFT), k=3, **KW)


def grammar(text):
    return llama_cpp.LlamaGrammar.from_string(text, verbose=False)


# ---------------------------------------------------------------------------------------------- the law at T > 0
def exact_law(llm, prompt, gbnf, params):
    """P(output string) under the core law, enumerating every token path of the (finite) language."""
    from specgrammar_llama_cpp import LlamaRunner, tokenizer_info
    from specgrammar_llama_cpp.grammar import compile_for
    from specgrammar_plugins.masks import new_mask
    from specgrammar_plugins.distributions import log_law

    tok = tokenizer_info(llm)
    runner = LlamaRunner(llm)
    law: dict[str, float] = {}

    def walk(seq, matcher, prob):
        runner.trim(len(runner.tokens))
        logits = runner.forward(prompt + seq, logits_for=1)[0]
        row = new_mask(runner.vocab_size)
        matcher.fill_mask(row)
        q = np.exp(log_law(logits, row, params))
        for t in np.flatnonzero(q > 0):
            if int(t) in tok.stop_token_ids:
                s = tok.decode(seq).decode()
                law[s] = law.get(s, 0.0) + prob * q[t]
                continue
            m = matcher.fork()
            assert m.accept(int(t))
            walk(seq + [int(t)], m, prob * q[t])

    walk([], compile_for(gbnf, tok).matcher(), 1.0)
    return law


def chi_square_p(samples, law):
    keys = sorted(law, key=lambda s: -law[s])
    n = len(samples)
    exp, obs, rest_e, rest_o = [], [], 0.0, 0
    for s in keys:
        if law[s] * n >= 5:
            exp.append(law[s] * n)
            obs.append(sum(1 for x in samples if x == s))
        else:
            rest_e += law[s] * n
            rest_o += sum(1 for x in samples if x == s)
    assert all(s in law for s in samples), "a sample outside the language"
    if rest_e > 0:
        exp.append(rest_e)
        obs.append(rest_o)
    return stats.chisquare(obs, np.array(exp) * (n / sum(exp))).pvalue


def test_law_at_positive_temperature_matches_the_stock_sampler(stock, ours):
    from specgrammar_llama_cpp import sampling_params

    g = "root ::= [12] [0-9]"
    # filters that bite, where their order matters; the trained tiny target is peaked on this prompt (it answers
    # years right), so a high temperature and a small min_p are needed for a spread law (3 outcomes, max 0.64,
    # TV 0.25 between the orders, on the committed target)
    temp, top_k, top_p, min_p = 8.0, 40, 1.0, 1e-5
    prompt = year_prompt()
    ptoks = stock.tokenize(prompt.encode(), add_bos=False, special=True)
    law = exact_law(llama_cpp.Llama(str(TARGET), **KW), ptoks, g, sampling_params(temp, top_k, top_p, min_p))
    assert abs(sum(law.values()) - 1) < 1e-9 and len(law) >= 3
    assert max(law.values()) < 0.9  # a spread law: the test can see a wrong one
    n = 400
    sk = dict(max_tokens=4, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    host = [stock.create_completion(prompt, grammar=grammar(g), seed=1000 + i, **sk)["choices"][0]["text"]
            for i in range(n)]
    mine = [ours.create_completion(prompt, grammar=g, seed=1000 + i, **sk)["choices"][0]["text"] for i in range(n)]
    p_host, p_ours = chi_square_p(host, law), chi_square_p(mine, law)
    assert p_host > 1e-3, ("the core law is not the stock sampler's law", p_host)
    assert p_ours > 1e-3, ("SpecLlama's outputs do not follow the law", p_ours)
    # ...and a law with the filters in the other order (temperature first) is visibly not the host's
    from specgrammar_plugins.distributions import SamplingParams

    other = exact_law(llama_cpp.Llama(str(TARGET), **KW), ptoks, g,
                      SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p))
    tv = 0.5 * sum(abs(law.get(s, 0) - other.get(s, 0)) for s in set(law) | set(other))
    p_other = chi_square_p(host, other) if set(host) <= set(other) else 0.0
    print(f"p(stock | law)={p_host:.3g} p(ours | law)={p_ours:.3g} TV(law, temperature-first law)={tv:.3f} "
          f"p(stock | temperature-first law)={p_other:.3g}")
    assert tv > 0.1 and p_other < 1e-3  # the test has the power to tell the two orders apart


# ---------------------------------------------------------------------------------------------- host bugs
def test_host_draft_model_with_default_logits_all_raises(ours):
    """Host bug: draft_model forces logits for every token (llama.py:351) but the scores buffer is sized by the
    logits_all argument (n_batch rows, llama.py:484): a prompt longer than n_batch raises ValueError.  SpecLlama
    needs no logits_all."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from specgrammar_llama_cpp import SpecLlama

    long_prompt = chat_prompt(" ".join(examples("prose", "eval", 3)[i].prompt for i in range(3)))
    kw = dict(KW, n_batch=16)
    host = llama_cpp.Llama(str(TARGET), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=3), **kw)
    assert len(host.tokenize(long_prompt.encode(), add_bos=False, special=True)) > 16
    with pytest.raises(ValueError):
        host.create_completion(long_prompt, max_tokens=4, temperature=0)
    mine = SpecLlama(str(TARGET), draft=str(DRAFT), k=3, **kw)
    plain = llama_cpp.Llama(str(TARGET), **kw)
    a = mine.create_completion(long_prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    b = plain.create_completion(long_prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    assert a == b


from llama_cpp.llama_speculative import LlamaDraftModel  # noqa: E402


class FixedDraft(LlamaDraftModel):
    """A draft model proposing the same (grammar-invalid) tokens every time."""

    def __init__(self, tokens):
        self.tokens = np.array(tokens, dtype=np.intc)

    def __call__(self, input_ids, /, **kw):
        return self.tokens


def test_host_processor_sees_unverified_drafts():
    """Host bug: under draft_model a logits_processor gets every evaluated id, drafts included, whatever position
    is sampled (llama.py:742).  A naive history-keyed mask then works from a wrong history; our
    GrammarLogitsProcessor(llama=...) finds the row being sampled and stays exact."""
    from specgrammar_llama_cpp import GrammarLogitsProcessor

    prompt = year_prompt()
    spec = ConstraintSpec.regex("[0-9]{4}")
    plain = llama_cpp.Llama(str(TARGET), **KW)
    want = plain.create_completion(prompt, max_tokens=8, temperature=0, grammar=grammar(YEAR_GBNF))["choices"][0]
    letters = plain.tokenize(b"ZZZ", add_bos=False)
    host = llama_cpp.Llama(str(TARGET), draft_model=FixedDraft(letters * 2), logits_all=True, **KW)
    ptoks = host.tokenize(prompt.encode(), add_bos=False, special=True)

    seen = []

    def record(input_ids, scores):
        seen.append(np.array(input_ids))
        return scores

    out = host.create_completion(prompt, max_tokens=8, temperature=0, grammar=grammar(YEAR_GBNF),
                                 logits_processor=llama_cpp.LogitsProcessorList([record]))["choices"][0]
    assert out["text"] == want["text"]
    final = ptoks + host.tokenize(out["text"].encode(), add_bos=False)
    # the processor saw histories holding drafted tokens that were never accepted
    assert any(len(h) > len(ptoks) and list(h[len(ptoks):]) != final[len(ptoks):len(h)] for h in seen)

    naive = GrammarLogitsProcessor(spec, host)
    naive.llama = None  # history = whatever the host passes
    bad = host.create_completion(prompt, max_tokens=8, temperature=0,
                                 logits_processor=llama_cpp.LogitsProcessorList([naive]))["choices"][0]
    assert naive.invalid_histories > 0  # it was handed drafts the grammar rejects as if they were the history
    fixed = GrammarLogitsProcessor(spec, host)
    good = host.create_completion(prompt, max_tokens=8, temperature=0,
                                  logits_processor=llama_cpp.LogitsProcessorList([fixed]))["choices"][0]
    assert good["text"] == want["text"] and is_valid("year", good["text"])
    assert fixed.invalid_histories == 0
    del bad


def test_invalid_grammar_never_reaches_llama_cpp(ours, monkeypatch):
    """Host bug: LlamaGrammar.from_string does not validate, and an invalid grammar segfaults at sampler
    construction (_internals.py:755-759).  Ours raises ConstraintError first; llama.cpp is never called."""
    from llama_cpp import llama_grammar
    from specgrammar_llama_cpp import safe_grammar

    calls = []

    def spy(*a, **k):
        calls.append(a)
        raise AssertionError("llama.cpp must not see this grammar")

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_sampler_init_grammar", spy)
    monkeypatch.setattr(llama_grammar.LlamaGrammar, "from_string", classmethod(lambda cls, *a, **k: spy(*a)))
    bad = "root ::= ( \"a\""
    for kwargs in (dict(grammar=bad), dict(grammar=llama_grammar.LlamaGrammar(_grammar=bad)),
                   dict(response_format={"type": "json_object", "schema": {"type": "object", "required": 5}})):
        with pytest.raises(ConstraintError):
            ours.create_completion("x", max_tokens=2, **kwargs)
        with pytest.raises(ConstraintError):
            ours.create_chat_completion([{"role": "user", "content": "x"}], max_tokens=2, stream=True, **kwargs)
    with pytest.raises(ConstraintError):
        safe_grammar(bad, ours)
    assert calls == []


def test_safe_grammar_for_the_stock_path(stock):
    from specgrammar_llama_cpp import safe_grammar

    g = safe_grammar(ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]}), stock)
    assert isinstance(g, llama_cpp.LlamaGrammar) and "root" in g._grammar
    out = stock.create_completion(year_prompt(), max_tokens=30, temperature=0, grammar=safe_grammar(YEAR_GBNF, stock))
    assert is_valid("year", out["choices"][0]["text"])
    with pytest.raises(ConstraintError, match="GBNF"):
        safe_grammar(ConstraintSpec.regex("[0-9]+"), stock)  # regexes: SpecLlama or the processor


def test_host_invalid_grammar_segfaults_in_a_subprocess():
    """The crash itself, demonstrated in a child process (never in this one): it dies by a signal."""
    code = textwrap.dedent(f"""
        import llama_cpp
        llm = llama_cpp.Llama({str(TARGET)!r}, n_threads=1, n_threads_batch=1, n_ctx=64, verbose=False)
        llm.create_completion("x", max_tokens=2, grammar=llama_cpp.LlamaGrammar.from_string("root ::= (", verbose=False))
        print("survived")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode < 0, (r.returncode, r.stdout[-500:], r.stderr[-500:])
    assert -r.returncode in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)


def test_host_logits_processor_with_logit_bias_drops_both(stock, ours):
    """Host bug (llama.py:1339): ``logits_processor = logits_processor.extend(...)`` is None, so a request with both
    a logits_processor and a logit_bias runs with neither.  SpecLlama applies both."""
    prompt = year_prompt()
    target = stock.tokenize(b"Q", add_bos=False)[0]
    calls = {"stock": 0, "ours": 0}

    def counter(name):
        def f(input_ids, scores):
            calls[name] += 1
            return scores
        return f

    plain = stock.create_completion(prompt, max_tokens=3, temperature=0)["choices"][0]["text"]
    host = stock.create_completion(prompt, max_tokens=3, temperature=0, logit_bias={target: 100.0},
                                   logits_processor=llama_cpp.LogitsProcessorList([counter("stock")]))
    assert calls["stock"] == 0 and host["choices"][0]["text"] == plain  # both dropped
    mine = ours.create_completion(prompt, max_tokens=3, temperature=0, logit_bias={target: 100.0},
                                  logits_processor=llama_cpp.LogitsProcessorList([counter("ours")]))
    assert calls["ours"] > 0 and mine["choices"][0]["text"] == "QQQ"


def test_rollback_checks_llama_memory_seq_rm(monkeypatch):
    """Host: the return value of kv_cache_seq_rm is ignored (llama.py:1010-1014).  Ours refuses to go on."""
    from specgrammar_llama_cpp import LlamaRunner

    llm = llama_cpp.Llama(str(TARGET), **KW)
    r = LlamaRunner(llm)
    r.forward(llm.tokenize(b"hello world", add_bos=False), logits_for=1)
    monkeypatch.setattr(llama_cpp, "llama_memory_seq_rm", lambda *a: False)  # what a recurrent cache answers
    with pytest.raises(RuntimeError, match="cannot roll back"):
        r.trim(1)


# ---------------------------------------------------------------------------------------------- stock-path pieces
def test_grammar_draft_model_on_the_stock_path(stock):
    """Stock Llama + draft_model=GrammarDraftModel + grammar=safe_grammar: same greedy output as no drafting, and
    the drafts are grammar-valid (most are accepted)."""
    from specgrammar_llama_cpp import GrammarDraftModel, safe_grammar

    for workload in ("tool_call", "sql"):
        from specgrammar_plugins.workloads import constraint

        spec = constraint(workload)
        e = examples(workload, "eval", 1)[0]
        prompt = chat_prompt(e.prompt)
        g = safe_grammar(spec, stock)
        want = stock.create_completion(prompt, max_tokens=40, temperature=0, grammar=g)["choices"][0]["text"]
        dm = GrammarDraftModel(llama_cpp.Llama(str(DRAFT), **KW), spec, target=stock, k=4)
        host = llama_cpp.Llama(str(TARGET), draft_model=dm, logits_all=True, **KW)
        got = host.create_completion(prompt, max_tokens=40, temperature=0, grammar=safe_grammar(spec, host))
        assert got["choices"][0]["text"] == want, workload
        assert dm.proposed > 0


def test_fallback_for_options_outside_the_law(ours):
    """repeat_penalty is not in the law: the stock loop runs, the constraint still holds (history-keyed mask)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = ours.create_completion(year_prompt(), max_tokens=8, temperature=0, repeat_penalty=1.3,
                                     regex="[0-9]{4}")
    assert any("stock loop" in str(x.message) for x in w)
    assert is_valid("year", out["choices"][0]["text"]) and ours.last_stats is None
