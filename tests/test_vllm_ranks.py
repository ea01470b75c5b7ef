"""Our vLLM proposers on several ranks (issue 36): every worker draws the same drafts for a request.

vLLM builds a proposer in every worker (tensor-parallel rank, pipeline stage, data-parallel engine).  The drafts the
scheduler verifies come from one worker (TP rank 0 of the last stage) and every rank verifies them, sampled drafts
with the draft probabilities its own proposer kept, so ranks that drew different drafts part ways
(``specgrammar_vllm/draws.py``).

- ``test_two_ranks_draw_the_same_drafts``: two ``GrammarStates``, each built from the same real vLLM engine config
  as two ranks build theirs, serve the same three requests (T = 1, a drafter that samples from the request's
  generator), one in arrival order, the other in reverse order after serving a request of its own first and with
  one request dropped and rebuilt mid-way (as a preempted request is).  Their drafts must be equal at every step.
  The same test run with the per-process generator the proposer had before (one ``np.random.default_rng(seed)``
  per ``GrammarStates``, shared by its requests: the ``per-process`` case) finds the drafts differ, so the check
  can fail: it is the old behaviour's failure, shown on every run.  (By hand: with generators keyed by request
  but not restarted at each position, ``RequestDraws.at`` a no-op, it fails at 3 of 53 steps: the rebuilt request.)
- seeded requests draft the same whatever their request id (vLLM appends a random suffix to every id); unseeded
  ones differ by id; keys are the same under any ``PYTHONHASHSEED``.
- a recipe pack a worker cannot load stops the engine at start-up, naming the option and the reason
  (``startup.py``), on both proposers' paths; a pack the engine can load starts it.
- ``test_tensor_parallel_2_greedy_equals_plain``: the real engine under ``tensor_parallel_size=2`` (two worker
  processes on vllm-cpu, each bound to one core; the whole chain: forced tokens, the json_extraction recipe pack,
  the draft model; slow): greedy output equals plain constrained decoding token for token on the six workloads,
  and the two ranks' proposers drafted the same tokens at every step (read from each worker through vLLM's
  ``collective_rpc``, ``ranks.py``); ``test_tensor_parallel_2_sampled_drafts_keep_the_law``: with sampled drafts
  at T = 1 its output law is the plain one-worker engine's.  This file is also the child process that runs that
  engine; without two cores or ~5 GB of free memory those tests skip, saying which.
- a JSON Schema holding a keyword xgrammar does not enforce (``pattern``): vLLM's xgrammar backend accepts the
  request and ignores the keyword, so the request is drafted for under the schema as vLLM enforces it.  Before
  (issue 32) our strict compile refused it and the request got no drafts at all: 3 of the 7 dev-split schemas vLLM
  answered in ``bench real`` decoded at 1.00 token per target pass with the full chain.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if __name__ != "__main__":  # (the tensor-parallel child below needs vLLM's multiprocessing)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

pytest.importorskip("vllm")

from specgrammar_plugins import workloads as W  # noqa: E402
from specgrammar_plugins.models import tiny_path  # noqa: E402

TARGET = tiny_path("target")
if not (TARGET / "model.safetensors").exists():
    pytest.skip("the tiny target model is not in the tree (issue 3)", allow_module_level=True)

from specgrammar_vllm.config import speculative_config  # noqa: E402
from specgrammar_vllm.draws import RequestDraws, draw_key  # noqa: E402
from specgrammar_vllm.offline import make_llm, sampling_params  # noqa: E402
from specgrammar_vllm.proposer import GrammarStates  # noqa: E402
from specgrammar_vllm.startup import RecipePackStartupError  # noqa: E402

K = 4
WORKLOADS = ("json_extraction", "order_id", "sql")  # a schema, a regex, a grammar
SAMPLED = "sampled-test-drafter"


class _SampledDrafter:
    """Registered for these tests (``register_drafters``): the core's ``ModelDrafter`` over ``MarkovRunner`` (a
    fixed logits table), so each draft is drawn from the request's generator by the core's own law at the request's
    temperature: a drafter whose drafts depend on the random stream, which the shipped host chain (forced tokens,
    recipe packs) never does."""

    from specgrammar_plugins.hookspecs import hookimpl

    @hookimpl
    def register_drafters(self, register):
        from specgrammar_plugins.drafters import ModelDrafter
        from specgrammar_plugins.testing import MarkovRunner

        def factory(ctx):
            return ModelDrafter(MarkovRunner(ctx.target_vocab_size, seed=1, scale=1.0), ctx.params, ctx.rng,
                                target_vocab_size=ctx.target_vocab_size)

        register(SAMPLED, factory)


@pytest.fixture(scope="module")
def sampled_drafter():
    from specgrammar_plugins import plugins

    plugins.reset()
    plugins.get_plugin_manager().register(_SampledDrafter())
    yield SAMPLED
    plugins.reset()


@pytest.fixture(scope="module")
def vllm_config(sampled_drafter):
    """The engine config every rank of one engine is built from (vLLM's own ``EngineArgs``, the tiny target)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(TARGET), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                      speculative_config=speculative_config("grammar", K),
                      additional_config={"specgrammar": {"drafters": ["forced", sampled_drafter]}}
                      ).create_engine_config()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET))


def _request(tokenizer, ex, req_id, seed=None):
    """A request as the model runner holds it (vLLM's ``CachedRequestState``) and its committed answer's tokens."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    prompt = tokenizer.encode(W.chat_prompt(ex.prompt), add_special_tokens=False)
    answer = tokenizer.encode(ex.reference + W.EOS, add_special_tokens=False)
    sp = sampling_params(ex.constraint, temperature=1.0, max_tokens=256, seed=seed)
    req = CachedRequestState(req_id=req_id, prompt_token_ids=prompt, mm_features=[], sampling_params=sp,
                             generator=None, block_ids=([],), num_computed_tokens=0, output_token_ids=[])
    return req, np.array(prompt + answer, dtype=np.int64), len(prompt)


def _serve(states, requests, order, *, warmup=None, drop_at=None):
    """One rank's drafting over the requests' committed answers, step by step (every request one committed token
    further per step; ``order``: the rank's row order).  ``warmup``: a request this rank serves alone first;
    ``drop_at``: (request id, step) where the rank drops that request's state and builds it again from its history.
    Returns {(request id, committed tokens): drafts} and how many drafts the sampling drafter drew."""
    from specgrammar_plugins.api import fill

    sampled = [0]

    def step(req_id, n):
        req, tokens, _ = requests[req_id]
        st = states.state(req_id, req)
        block = states.begin(st, tokens, n)
        if block is None:
            return ()
        fill(block, st.drafter)
        sampled[0] += sum(src == "model" for src in block.sources)  # (ModelDrafter pushes as "model")
        return tuple(block.tokens)

    if warmup is not None:
        req, tokens, p = warmup
        for n in range(p, len(tokens)):
            step(req.req_id, n)
    out = {}
    longest = max(len(t) - p for _, t, p in requests.values())
    for i in range(longest):
        if drop_at is not None and drop_at[1] == i:
            states.prune({r for r in requests if r != drop_at[0]})
        for req_id in order:
            _, tokens, p = requests[req_id]
            if p + i < len(tokens):
                out[(req_id, p + i)] = step(req_id, p + i)
    return out, sampled[0]


def _old_per_process_draws(monkeypatch):
    """The proposer's draws as they were before issue 36: one generator per ``GrammarStates`` (per process),
    ``np.random.default_rng(engine seed)``, shared by its requests in the order they draw, never restarted."""
    shared = {}

    class PerProcess:
        def __init__(self, rng):
            self.rng = rng

        def at(self, position):
            return self.rng

    def request_draws(self, sp, req_id):
        if id(self) not in shared:
            shared[id(self)] = (self, np.random.default_rng(self.seed))
        return PerProcess(shared[id(self)][1])

    monkeypatch.setattr(GrammarStates, "_request_draws", request_draws)


@pytest.mark.parametrize("draws", ["per-request", "per-process"])
def test_two_ranks_draw_the_same_drafts(vllm_config, tokenizer, monkeypatch, draws):
    if draws == "per-process":
        _old_per_process_draws(monkeypatch)
    exs = [W.examples(w, "eval", 1)[0] for w in WORKLOADS]
    requests = {f"req-{i}": _request(tokenizer, ex, f"req-{i}") for i, ex in enumerate(exs)}
    rank0, rank1 = GrammarStates(vllm_config), GrammarStates(vllm_config)
    a, sampled = _serve(rank0, requests, list(requests))
    other = _request(tokenizer, W.examples("year", "eval", 1)[0], "req-other")
    b, _ = _serve(rank1, {**requests, "req-other": other}, list(reversed(requests)), warmup=other,
               drop_at=("req-1", 5))
    b = {key: d for key, d in b.items() if key[0] != "req-other"}
    assert a.keys() == b.keys()
    drafted = sum(len(d) for d in a.values())
    assert drafted > 3 * len(a), f"too few drafts to compare: {drafted} at {len(a)} steps"
    assert sampled > len(a), f"{sampled} sampled drafts at {len(a)} steps"  # the draws decided most drafts
    differ = sorted(key for key in a if a[key] != b[key])
    if draws == "per-request":
        assert not differ, f"two ranks drafted differently for {len(differ)} of {len(a)} steps, first {differ[:3]}"
    else:  # the old generator: the same comparison catches the ranks parting
        assert len(differ) > len(a) // 2, f"the per-process generator diverged at only {len(differ)} of {len(a)}"


def test_a_seeded_request_drafts_the_same_under_any_request_id(vllm_config, tokenizer):
    ex = W.examples("json_extraction", "eval", 1)[0]
    runs = {}
    for req_id, seed in (("a-1f2e3d4c", 7), ("a-99aa88bb", 7), ("b-1f2e3d4c", None), ("b-99aa88bb", None)):
        states = GrammarStates(vllm_config)
        runs[req_id] = list(_serve(states, {req_id: _request(tokenizer, ex, req_id, seed)}, [req_id])[0].values())
    assert runs["a-1f2e3d4c"] == runs["a-99aa88bb"]  # the request's seed alone decides its draws
    assert runs["b-1f2e3d4c"] != runs["b-99aa88bb"]  # unseeded: the request id (and the engine seed) do


def test_draws_are_a_function_of_the_request_and_position_only():
    d = RequestDraws(None, 0, "req-1")
    first = d.at(10).random(6)
    d.at(11).random(3)
    assert np.array_equal(d.at(10).random(6), first)
    assert np.array_equal(RequestDraws(None, 0, "req-1").at(10).random(6), first)
    assert not np.array_equal(RequestDraws(None, 0, "req-1").at(11).random(6), first)
    assert not np.array_equal(RequestDraws(None, 1, "req-1").at(10).random(6), first)  # the engine seed
    assert not np.array_equal(RequestDraws(None, 0, "req-2").at(10).random(6), first)
    assert RequestDraws(None, None, "req-1").key == RequestDraws(None, 0, "req-1").key


def test_keys_do_not_depend_on_pythons_hash_seed():
    code = ("import json; from specgrammar_vllm.draws import RequestDraws; "
            "print(json.dumps([RequestDraws(s, 0, 'req-\\u00e9-1').at(3).random(4).tolist() for s in (None, 5)]))")
    seen = set()
    for hash_seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout
        seen.add(out)
    here = json.dumps([RequestDraws(s, 0, "req-\u00e9-1").at(3).random(4).tolist() for s in (None, 5)]) + "\n"
    assert seen == {here}
    assert draw_key(None, 0, "req-1") != draw_key(None, 0, "req-2") != draw_key(5, 0, "req-2")


# ---------------------------------------------------------------------------------------------- start-up
def _config(**specgrammar):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(TARGET), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                      speculative_config=speculative_config("grammar", K),
                      additional_config={"specgrammar": specgrammar}).create_engine_config()


@pytest.mark.parametrize("pack, why", [("no_such_pack", "not found"),
                                       ("smollm2-135m.json_extraction", "tokenizer")])
def test_a_recipe_pack_this_rank_cannot_load_fails_at_start_up(pack, why):
    with pytest.raises(RecipePackStartupError) as e:
        GrammarStates(_config(recipe=pack))
    msg = str(e.value)
    assert f"specgrammar.recipe = {pack!r}" in msg and why in msg, msg
    GrammarStates(_config(recipe="json_extraction"))  # the pack for this model's tokenizer: starts
    GrammarStates(_config(recipe="no_such_pack", drafters=["forced"]))  # the recipe drafter is off: not read


@pytest.mark.parametrize("draft", [False, True], ids=["custom_class", "draft_model"])
def test_the_engine_does_not_start_without_its_recipe_pack(draft):
    """The real engine (in-process): vLLM's start-up fails with our message; before, it started and served every
    request without the pack, logging "drafters unavailable" per request."""
    with pytest.raises(Exception) as e:
        make_llm(TARGET, method="grammar", k=K, draft_model=str(tiny_path("draft")) if draft else None,
                 specgrammar={"recipe": "no_such_pack"})
    chain, seen = [], e.value
    while seen is not None:
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    assert any("specgrammar.recipe = 'no_such_pack'" in c for c in chain), chain


# ---------------------------------------------------------------------------------------------- tensor parallel 2
TP_TIMEOUT_S = 480
RECIPE = "json_extraction"


def _greedy_batch():
    exs = [ex for w in W.STRUCTURED for ex in W.examples(w, "eval", 1)]
    return exs, [W.chat_prompt(e.prompt) for e in exs], [sampling_params(e.constraint, temperature=0.0,
                                                                          max_tokens=80) for e in exs]


def _tensor_parallel_child() -> None:
    """Run in a fresh process: the full chain under tensor_parallel_size=2; prints one RESULT line."""
    from specgrammar_vllm.ranks import disagreements, record_drafts, recorded_drafts

    llm = make_llm(TARGET, method="grammar", k=K, draft_model=str(tiny_path("draft")), tensor_parallel_size=2,
                   specgrammar={"recipe": RECIPE}, draft_sample_method="probabilistic")
    recording = llm.collective_rpc(record_drafts)
    exs, prompts, params = _greedy_batch()
    outs = llm.generate(prompts, params, use_tqdm=False)
    law = _sample_law(llm)
    ranks = llm.collective_rpc(recorded_drafts)
    print("RESULT " + json.dumps({
        "recording": recording, "disagreements": disagreements(ranks),
        "rank_steps": [sum(len(d) for d in (r["drafts"] or {}).values()) for r in ranks],
        "rank_sources": [r.get("sources") for r in ranks],
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "law": [[list(k), n] for k, n in law.items()]}), flush=True)


LAW_N = 400


def _sample_law(llm):
    """LAW_N answers at T = 1 to one prompt under a small regex, by whole output (unseeded: vllm-cpu 0.32.0 crashes
    on per-request seeds when a chunked prefill is discarded, see test_vllm_proposer)."""
    from collections import Counter

    prompt = W.chat_prompt(W.examples("sql", "eval", 1)[0].prompt)
    from specgrammar_plugins.constraint import ConstraintSpec

    spec = ConstraintSpec.regex("(SELECT|DELETE) (id|name|email) FROM (users|orders);")
    outs = llm.generate([prompt] * LAW_N, sampling_params(spec, temperature=1.0, max_tokens=24), use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


def _same_law_p(a, b) -> float:
    """The p-value of a two-sample chi-square over whole outputs, outputs seen fewer than 10 times in all pooled."""
    from scipy.stats import chi2_contingency

    common = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) >= 10]
    table = [[a.get(k, 0) for k in common], [b.get(k, 0) for k in common]]
    table[0].append(sum(a.values()) - sum(table[0]))
    table[1].append(sum(b.values()) - sum(table[1]))
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    return 1.0 if len(table[0]) < 2 else float(chi2_contingency(table).pvalue)


def _available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


@pytest.fixture(scope="module")
def tensor_parallel_2():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor_parallel_size=2 on vllm-cpu binds each worker to its own core "
                    "(VLLM_CPU_OMP_THREADS_BIND=\"0|1\"): this machine has one")
    if _available_gb() < 5:
        pytest.skip(f"tensor_parallel_size=2 starts three vLLM processes (~4 GB): {_available_gb():.1f} GB available")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # vllm-cpu 0.32.0: without a bind list per worker vLLM stops with "Not enough allowed NUMA nodes to bind threads
    # of 2 local CPUWorkers" on a one-node machine; a function reaches the workers only with insecure serialization
    env.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_KVCACHE_SPACE="1")
    child = subprocess.Popen([sys.executable, __file__], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        out, _ = child.communicate(timeout=TP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the child and vLLM's worker processes (one session)
        child.communicate()
        pytest.fail(f"the tensor-parallel engine did not finish within {TP_TIMEOUT_S} s")
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # any worker left behind
        except ProcessLookupError:
            pass
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert child.returncode == 0 and lines, out[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def plain_one_worker():
    llm = make_llm(TARGET, method=None)
    _, prompts, params = _greedy_batch()
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return greedy, _sample_law(llm)


def test_tensor_parallel_2_greedy_equals_plain(tensor_parallel_2, plain_one_worker):
    exs, _, _ = _greedy_batch()
    got = tensor_parallel_2
    assert [r["recording"] for r in got["recording"]] == [True, True], got["recording"]
    for ex, a, b in zip(exs, plain_one_worker[0], got["outputs"]):
        assert b == a, (ex.workload, ex.prompt)
    assert got["disagreements"] == [], got["disagreements"]
    steps = got["rank_steps"]
    assert len(steps) == 2 and steps[0] == steps[1] > 0, steps
    sources = got["rank_sources"]
    assert sources[0] == sources[1] and sources[0].get("recipe", 0) > 0 and sources[0].get("model", 0) > 0, sources


def test_tensor_parallel_2_sampled_drafts_keep_the_law(tensor_parallel_2, plain_one_worker):
    """At T = 1 with sampled drafts (``draft_sample_method="probabilistic"``: every rank verifies the scheduler's
    drafts with the draft probabilities its own proposer kept), the TP = 2 engine's output law is the plain
    one-worker engine's: two-sample chi-square over LAW_N whole outputs each, fails at p < 1e-3."""
    from collections import Counter

    law = Counter({tuple(k): n for k, n in tensor_parallel_2["law"]})
    assert sum(law.values()) == LAW_N
    p = _same_law_p(plain_one_worker[1], law)
    print(json.dumps({"p": p, "outputs": len(set(law) | set(plain_one_worker[1])),
                      "rank_sources": tensor_parallel_2["rank_sources"]}))
    assert p > 1e-3, (p, plain_one_worker[1].most_common(5), law.most_common(5))


if __name__ == "__main__":
    _tensor_parallel_child()


# ---------------------------------------------------------------------------------------------- the schema vLLM enforces
def test_a_schema_keyword_vllm_ignores_still_gets_grammar_drafts(tokenizer):
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    from specgrammar_plugins.api import ConstraintError, ConstraintSpec, compile_constraint, fill

    states = GrammarStates(_config(drafters=["forced"]))
    spec = ConstraintSpec.json_schema({"type": "object", "required": ["code", "count"], "additionalProperties": False,
                                       "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                                      "count": {"type": "integer"}}})
    with pytest.raises(ConstraintError, match="pattern"):  # our strict compile refuses it, as the launcher does
        compile_constraint(spec, states._tokenizer_info((), None), engine="xgrammar", **states.engine_options)
    prompt = tokenizer.encode("Give a code.", add_special_tokens=False)
    answer = tokenizer.encode('{"code": "ABC", "', add_special_tokens=False)
    req = CachedRequestState(req_id="r", prompt_token_ids=prompt, mm_features=[], generator=None, block_ids=([],),
                             sampling_params=sampling_params(spec, temperature=0.0, max_tokens=64),
                             num_computed_tokens=0, output_token_ids=[])
    st = states.state("r", req)
    assert st.history is not None and states.counters["compile_errors"] == 0
    block = states.begin(st, np.array(prompt + answer, dtype=np.int64), len(prompt) + len(answer))
    fill(block, st.drafter)
    # the next key is forced (only "count" is left): the forced drafter drafts it (the single-token walk, then the
    # jump-forward string: source forced-jump)
    assert block.tokens and set(block.sources) <= {"forced", "forced-jump"}
    assert tokenizer.decode(block.tokens).startswith("count")
