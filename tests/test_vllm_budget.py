"""Budget feasibility on vLLM (``specgrammar_vllm.budget_mask``): the budget mask rides in vLLM's structured-output
bitmask, so the target's own sampling, plain or speculative, ends complete within max_tokens.  In-process on
vllm-cpu with the bundled tiny pair, one plain and one speculative engine (our grammar-aware draft model) for the
whole module:

- greedy speculative output equals greedy plain output under the budget, token for token, on an exact bound
  (regex) and a certified one (JSON Schema, one with a ``pattern`` our strict compile refuses for xgrammar and vLLM
  accepts), and every output ends complete and valid ("stop") where without the mask the same requests are cut off
  at max_tokens;
- at T = 1 the output law of speculative decoding is plain decoding's under the combined grammar-and-budget row
  (two-sample chi-square on whole outputs), on a tiny output space where the budget binds;
- the launcher's gate refuses a request whose shortest completion does not fit with a 400 naming the length.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("vllm")

from specgrammar_plugins.api import ConstraintSpec  # noqa: E402
from specgrammar_plugins.models import tiny_path  # noqa: E402

if not (tiny_path("target") / "model.safetensors").exists():
    pytest.skip("the tiny target model is not in the tree (issue 3)", allow_module_level=True)

from specgrammar_vllm import budget_mask  # noqa: E402
from specgrammar_vllm.offline import make_llm, proposer_of, sampling_params  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
          "items": {"type": "string"}}}, "required": ["name", "tags"], "additionalProperties": False}
REGEX = "[a-z]{1,30}x"
PROMPTS = ["Write:", "Extract the user info as JSON: Oscar Silva is a photographer.", "List some tags"]
# (constraint, max_tokens): each natural answer of the tiny target is longer than max_tokens
# A keyword our strict compile refuses for xgrammar ("pattern": xgrammar's is not the regex) and vLLM 0.32's own
# xgrammar backend accepts: the budget is built on the schema as vLLM enforces it (``structured.compile_as_enforced``;
# before, such a request had no budget and was cut off: 2 of the 7 dev-split schemas vLLM answered in `bench real`).
PATTERNED = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "pattern": "^[a-z ]+$"}}}
CASES = [(ConstraintSpec.regex(REGEX), 4), (ConstraintSpec.json_schema(SCHEMA), 24),
         (ConstraintSpec.json_schema(SCHEMA), 40), (ConstraintSpec.json_schema(PATTERNED), 24)]
LAW_REGEX, LAW_MAX, LAW_N = "[a-c]{1,12}d", 3, 300


def _valid(spec, text: str) -> bool:
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), spec.schema)
    except Exception:
        return False
    return True


def _generate(llm, spec, max_tokens, mask=True, **kw):
    extra = None if mask else {"specgrammar": {"budget_mask": False}}
    params = sampling_params(spec, max_tokens=max_tokens, extra_args=extra, **kw)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def engines():
    plain = make_llm(tiny_path("target"), method=None)
    spec = make_llm(tiny_path("target"), method="grammar", k=4, draft_model=str(tiny_path("draft")))
    return SimpleNamespace(plain=plain, spec=spec)


@pytest.fixture(scope="module")
def greedy(engines):
    out = []
    for spec, mt in CASES:
        before = budget_mask.stats()
        plain = _generate(engines.plain, spec, mt, temperature=0.0)
        sped = _generate(engines.spec, spec, mt, temperature=0.0)
        after = budget_mask.stats()
        blind = _generate(engines.plain, spec, mt, mask=False, temperature=0.0)
        out.append(SimpleNamespace(spec=spec, max_tokens=mt, plain=plain, sped=sped, blind=blind,
                                   cut=after["budget_cut_rows"] - before["budget_cut_rows"],
                                   drafts_cut=after["budget_drafts_cut"] - before["budget_drafts_cut"],
                                   requests=after["budget_requests"] - before["budget_requests"]))
    return out


def test_greedy_speculative_equals_plain_under_the_budget(greedy, engines):
    for r in greedy:
        assert [list(o.token_ids) for o in r.sped] == [list(o.token_ids) for o in r.plain], r.spec.kind
        assert r.requests == 2 * len(PROMPTS)  # every request of both engines carried its budget
        assert r.cut > 0  # and the budget bound: rows were cut
        assert r.drafts_cut == 0  # our proposer's drafts already end where the budget's rows forbid them
    counters = proposer_of(engines.spec).counters
    assert counters["accepted_tokens"] > 0  # drafts were verified under the combined rows
    assert counters["budget_cut_off"] == 0  # (counted only for requests without the mask)


def test_outputs_longer_than_max_tokens_come_back_complete_and_valid(greedy):
    for r in greedy:
        for o in r.plain + r.sped:
            assert o.finish_reason == "stop" and len(o.token_ids) <= r.max_tokens, (o.text, o.finish_reason)
            assert _valid(r.spec, o.text), o.text
        # without the mask the same requests are cut off at max_tokens, invalid
        assert all(o.finish_reason == "length" for o in r.blind), [o.finish_reason for o in r.blind]
        assert not any(_valid(r.spec, o.text) for o in r.blind)


def test_a_prompt_that_leaves_less_room_than_max_tokens_gets_a_budget_of_that_room(engines):
    """vLLM 0.32's offline engine ends a request at the context's end (finish reason "length") without clamping
    ``max_tokens`` to the room its prompt leaves in ``max_model_len``: the budget is built from that room
    (``budget_mask.tokens_left``), so the answer comes back complete and valid within it, plain and speculative
    alike; without the mask the same request is cut off there (14 of 56 SmolLM2 answers were, before)."""
    spec, room = ConstraintSpec.json_schema(SCHEMA), 24
    limit = engines.plain.llm_engine.model_config.max_model_len
    base = list(engines.plain.get_tokenizer().encode(PROMPTS[1]))
    ids = (base * (limit // len(base) + 1))[: limit - room]
    out = {}
    for mask in (True, False):
        extra = None if mask else {"specgrammar": {"budget_mask": False}}
        params = sampling_params(spec, max_tokens=4 * room, temperature=0.0, extra_args=extra)
        out[mask] = [llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
                     for llm in (engines.plain, engines.spec)]
    for o in out[True]:
        assert o.finish_reason == "stop" and len(o.token_ids) <= room and _valid(spec, o.text), (o.text, o.finish_reason)
    assert list(out[True][0].token_ids) == list(out[True][1].token_ids)
    assert all(o.finish_reason == "length" and not _valid(spec, o.text) for o in out[False]), \
        [(o.finish_reason, o.text) for o in out[False]]


def _law(llm, spec, mask=True) -> Counter:
    extra = None if mask else {"specgrammar": {"budget_mask": False}}
    params = [sampling_params(spec, max_tokens=LAW_MAX, temperature=1.0, seed=i, extra_args=extra)
              for i in range(LAW_N)]
    outs = llm.generate(["Write:"] * LAW_N, params, use_tqdm=False)
    return Counter((tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs)


def test_output_law_at_t1_is_plain_decodings_under_grammar_and_budget(engines):
    """Two-sample chi-square (N = 300 each, categories with fewer than 5 expected pooled; fails at p < 1e-3) on
    whole outputs at T = 1 with max_tokens 3 on ``[a-c]{1,12}d``, where the budget binds: every output ends with
    its ``d`` in time (exact bound), where without the mask many are cut off."""
    from scipy.stats import chi2_contingency

    spec = ConstraintSpec.regex(LAW_REGEX)
    a, b = _law(engines.plain, spec), _law(engines.spec, spec)
    assert all(reason == "stop" for _, reason in a | b)
    blind = _law(engines.plain, spec, mask=False)
    assert sum(n for (_, reason), n in blind.items() if reason == "length") > LAW_N // 10  # the budget binds
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    rows, rare = [], [0, 0]
    for k in keys:
        if (a[k] + b[k]) / 2 < 5:
            rare[0] += a[k]
            rare[1] += b[k]
        else:
            rows.append([a[k], b[k]])
    if sum(rare):
        rows.append(rare)
    assert len(rows) >= 3  # a law, not one outcome
    p = chi2_contingency(rows).pvalue
    print(json.dumps({"categories": len(rows), "p": p}))
    assert p > 1e-3, (p, rows)


def test_the_launchers_gate_refuses_what_cannot_fit_with_a_400_naming_the_length(monkeypatch):
    from specgrammar_plugins.api import Refused
    from specgrammar_vllm.serve import gate_body

    monkeypatch.setenv(budget_mask.TOKENIZER_ENV, str(tiny_path("target")))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "regex": "[0-9]{20}"}
    with pytest.raises(Refused) as e:
        gate_body(json.dumps(body).encode())
    assert e.value.status == 400
    m = re.search(r"takes (\d+) tokens", e.value.message)
    assert m and int(m.group(1)) > 3 and "budget is 3" in e.value.message, e.value.message
    # the same with room, or with the mask turned off, passes (and budget_mask is no longer refused)
    assert gate_body(json.dumps(dict(body, max_tokens=40)).encode()) is not None
    assert gate_body(json.dumps(dict(body, specgrammar={"budget_mask": False})).encode()) is not None


def test_the_engines_compile_cache_takes_vllms_xgrammar_cache_bound(monkeypatch):
    """Issue 33: in the EngineCore our compile cache kept up to 512 MB of grammars beside vLLM's own xgrammar cache
    (the launcher's 64 MB); where vLLM compiles its grammars it now takes that bound when lower, never a higher one."""
    import vllm.envs as envs

    from specgrammar_plugins.api import COMPILE_CACHE

    # vllm.envs caches its values once an engine has started in this process (vLLM 0.32: enable_envs_cache), so the
    # environment is not read again: the setting is set on the module, which its __getattr__ never overrides
    monkeypatch.setattr(COMPILE_CACHE, "max_bytes", 512 << 20)
    monkeypatch.setattr(envs, "VLLM_XGRAMMAR_CACHE_MB", 64, raising=False)
    budget_mask.bound_compile_cache()
    assert COMPILE_CACHE.max_bytes == 64 << 20
    monkeypatch.setattr(envs, "VLLM_XGRAMMAR_CACHE_MB", 1024, raising=False)
    budget_mask.bound_compile_cache()
    assert COMPILE_CACHE.max_bytes == 64 << 20
