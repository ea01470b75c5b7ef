"""Every ``specgrammar bench NAME --quick`` completes, writes its JSON (and PNG) and reports finite numbers.

Smoke tests only: no figure and no speed is asserted (speed is measured by the benchmarks, not by tests).  Each
runs as its own process through the ``specgrammar`` entry point, as a user would (benchmarks re-execute themselves
with OpenBLAS preloaded, which must not happen inside pytest)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specgrammar_plugins.bench._report import finite_numbers

ROOT = Path(__file__).resolve().parents[1]


def _have(*mods: str) -> None:
    for m in mods:
        pytest.importorskip(m)


def _tiny(*names: str) -> None:
    from specgrammar_plugins.models import tiny_gguf, tiny_path

    for n in names:
        p = tiny_gguf(n[:-5]) if n.endswith(".gguf") else tiny_path(n)
        if not Path(p).exists():
            pytest.skip(f"the bundled tiny model {p} is absent")


def bench(tmp_path: Path, name: str, *args: str, png: bool = True) -> dict:
    out = tmp_path / name
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "specgrammar_plugins.cli", "bench", name, "--quick",
                           "--no-progress", "--out-dir", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / f"{name}.json").read_text())
    if png:
        import matplotlib  # noqa: F401  (the plot is written when matplotlib is installed: a dev dependency)

        assert (out / f"{name}.png").stat().st_size > 1000
    assert doc["benchmark"] == name and doc["machine"]["nproc"] >= 1
    doc["_stdout"] = proc.stdout
    return doc


def _finite(rows, keys) -> None:
    assert rows
    for r in rows:
        for k in keys:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (k, r)


def test_strategies_quick(tmp_path):
    _have("mlx_lm", "llama_cpp", "matplotlib")
    _tiny("target", "draft", "target.gguf", "draft.gguf")
    doc = bench(tmp_path, "strategies")
    rows = doc["rows"]
    assert {r["host"] for r in rows} == {"mlx", "llama_cpp"}
    assert {r["strategy"] for r in rows} == {"baseline", "blind", "aware", "forced", "recipe", "full"}
    _finite(rows, ["passes_per_token", "tokens_per_s", "speed_vs_baseline", "tokens", "target_passes"])
    _finite([r for r in rows if r["strategy"] in ("blind", "aware", "full")],
            ["acceptance", "accepted_per_round", "grammar_us_per_token"])
    assert len(doc["claims"]) == 2 and all(isinstance(c["pass"], bool) for c in doc["claims"])
    assert "aware >= blind" in doc["_stdout"]


def test_recipes_quick(tmp_path):
    _have("mlx_lm", "matplotlib")
    _tiny("target", "draft")
    doc = bench(tmp_path, "recipes")
    rows = doc["rows"]
    assert [r["strategy"] for r in rows] == ["greedy", "none", "forced", "model", "pack", "both"]
    _finite(rows, ["accuracy_vs_greedy", "passes_per_token", "tokens_per_s", "speed_vs_baseline"])
    _finite([r for r in rows if r["strategy"] in ("pack", "both")], ["coverage", "forced_share"])
    _finite([r for r in rows if r["strategy"] in ("model", "both")], ["model_share"])
    assert isinstance(doc["all_equal_greedy"], bool)
    assert "accuracy against greedy" in doc["_stdout"]


def test_scale_quick(tmp_path):
    _have("mlx_lm", "matplotlib")
    _tiny("target", "draft")
    # no strategies JSON: the acceptance is measured on the spot
    doc = bench(tmp_path, "scale", "--strategies", str(tmp_path / "absent.json"))
    assert doc["results"] and doc["results"][0]["params"] > 4e8
    for m in doc["results"]:
        _finite(m["rows"], ["t1_ms", "tk1_ms", "cost_ratio"])
    _finite(doc["projection"], ["tokens_per_pass", "projected_speedup", "passes_only_speedup", "ms_per_token",
                                 "rounds_per_token", "draft_passes_per_token"])
    assert all(m["draft"]["t1_ms"] > 0 for m in doc["results"])  # the draft's own passes are counted
    assert "PROJECTION" in doc["_stdout"]
    # the projection alone, from the timings just measured (no model run)
    again = bench(tmp_path / "again", "scale", "--timings", str(tmp_path / "scale" / "scale.json"),
                  "--strategies", str(tmp_path / "absent.json"))
    assert again["timings_from"] and [m["rows"] for m in again["results"]] == [m["rows"] for m in doc["results"]]
    _finite(again["projection"], ["projected_speedup"])


def test_overhead_quick(tmp_path):
    from conftest import needs_shared_data

    needs_shared_data("tokenizers", "qwen2.5", "generated", "tokenizer.json")
    doc = bench(tmp_path, "overhead", "--backends", "reference", "numpy")
    rows = doc["rows"]
    assert doc["vocab_size"] == 151936
    assert {(r["backend"], r["mode"]) for r in rows} == {(b, m) for b in ("reference", "numpy")
                                                         for m in ("greedy", "T=0.7", "T=0.7, top-p 0.9")}
    _finite(rows, ["host_ms", "fills_per_round", "tokens_per_round", "acceptance"])
    for r in rows:
        _finite([r["split_ms"]], list(r["split_ms"]))
        assert r["fills_per_round"] >= 1


def test_mlx_host_quick(tmp_path):
    _have("mlx_lm", "matplotlib")
    _tiny("target", "draft")
    doc = bench(tmp_path, "mlx_host")
    assert doc["rows"]
    for r in doc["rows"]:
        _finite([r[c] for c in ("ours", "plain", "mlx-blind", "mlx-aware")], ["tokens_per_pass", "seconds"])
        _finite([r], ["wall_plain_over_ours", "wall_mlx-blind_over_ours"])


def test_llama_cpp_host_quick(tmp_path):
    _have("llama_cpp", "matplotlib")
    _tiny("target.gguf", "draft.gguf")
    doc = bench(tmp_path, "llama_cpp_host")
    res = doc["results"]
    assert set(res) == {"stock", "stock+blind", "stock+grammar", "ours", "ours-forced"}
    _finite(list(res.values()), ["tokens", "target_passes", "tokens_per_pass", "seconds", "ms_per_token"])


def test_coverage_quick(tmp_path):
    _have("llguidance", "matplotlib")
    from specgrammar_plugins.bench.coverage import DATA

    if not (DATA / "tokenizers" / "qwen2.5").exists() or not (DATA / "jsonschemabench").exists():
        pytest.skip("../shared/data (Qwen2.5 tokenizer, MaskBench) is absent")
    out = tmp_path / "coverage"
    proc = subprocess.run([sys.executable, "-m", "specgrammar_plugins.cli", "bench", "coverage", "--quick",
                           "--no-progress", "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "coverage.json").read_text())
    assert (out / "coverage.png").stat().st_size > 1000
    for r in doc["results"].values():
        assert r["schemas"] > 0 and all(math.isfinite(x) for x in finite_numbers(r))


def test_coverage_warm_up_builds_what_the_default_compiles_with():
    """``bench coverage`` builds the per-tokenizer index of every engine a setting compiles with before timing:
    for ``default`` that is JSON Schema's default, llguidance then xgrammar (it warmed xgrammar only, so the first
    schema's compile counted llguidance's index: 0.8 s, one of the dev split's 19 slowest)."""
    _have("llguidance")
    from specgrammar_plugins.bench.coverage import warm_up
    from specgrammar_plugins.engines import llguidance_engine, xgrammar_engine
    from specgrammar_plugins.models import tiny_tokenizer_info

    tok = tiny_tokenizer_info().with_vocab_size(1056)  # (a width no other test builds: a fresh index)
    before = llguidance_engine._TOKENIZERS.builds, xgrammar_engine._INFOS.builds
    warm_up(["default"], tok)
    assert (llguidance_engine._TOKENIZERS.builds, xgrammar_engine._INFOS.builds) == (before[0] + 1, before[1] + 1)


def test_vllm_host_quick(tmp_path, monkeypatch):
    _have("vllm", "matplotlib")
    _tiny("target", "draft")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # --together: the prompts in one generate call, at most 2 at a time; the draft step kept by its batch
    doc = bench(tmp_path, "vllm_host", "--together", "--max-num-seqs", "2")
    rows = [r for r in doc["rows"] if "timing" not in r]
    assert {r["method"] for r in rows} == {"plain", "grammar_chain"}
    assert {r["workload"] for r in rows} == {"together"} and all(r["requests"] == 2 for r in rows)
    _finite(rows, ["tokens", "rounds", "accepted", "acceptance", "tokens_per_pass"])
    timing = {r["method"]: r["timing"] for r in doc["rows"] if "timing" in r}
    _finite(list(timing.values()), ["step_ms", "target_ms", "draft_ms", "our_grammar_ms", "vllm_grammar_ms",
                                    "draft_forward_ms_per_draft_step", "draft_pass_tokens_per_draft_step"])
    by = timing["grammar_chain"]["draft_by_batch"]
    assert sum(v["steps"] for v in by.values()) == timing["grammar_chain"]["draft_steps"] > 0
    assert {int(b) for b in by} <= {1, 2} and all(v["ms"] > 0 and v["ours_ms"] >= 0 for v in by.values())
    assert "The draft step at the largest batch" in doc["_stdout"]


def test_schemas_quick(tmp_path):
    from conftest import needs_shared_data

    needs_shared_data("jsonschemabench", "dev")
    _have("mlx_lm", "llama_cpp", "matplotlib", "jsonschema")
    _tiny("target", "draft", "target.gguf", "draft.gguf")
    doc = bench(tmp_path, "schemas")
    rows = doc["rows"]
    assert {r["host"] for r in rows} == {"mlx", "llama_cpp"} and {r["mask"] for r in rows} == {"on", "off"}
    assert {r["strategy"] for r in rows} == {"plain", "blind", "aware", "forced", "suffix", "full"}
    for r in rows:
        assert r["refused"] + r["complete"] + r["cut"] <= r["n"] and r["valid"] <= r["complete"]
    _finite(rows, ["tokens_per_pass", "tokens"])
    _finite([r for r in rows if r["strategy"] in ("blind", "aware", "full")], ["acceptance", "draft_passes_per_token"])
    assert len(doc["claims"]) == 2 and all(isinstance(c["pass"], bool) for c in doc["claims"])
    assert doc["families"] and "aware > blind" in doc["_stdout"]
    comp = doc["completeness"]
    assert comp["counts"]["compiled"] >= 1 and comp["rows"]
    assert all(r["complete_valid"] <= r["fits"] <= r["compiled"] for r in comp["rows"])


def test_cost_quick(tmp_path):
    _have("mlx_lm", "matplotlib")
    _tiny("target", "draft")
    doc = bench(tmp_path, "cost")
    assert doc["rows"] and doc["n"] > 0
    for r in doc["rows"].values():
        for m in ("untilted", "adaptive", "budget mask", "adaptive + mask"):
            assert 0 <= r[m]["complete_valid"] <= r[m]["n"]
        assert r["budget mask"]["complete_valid"] == r["budget mask"]["n"]  # the mask's guarantee (budget >= J0)
        assert math.isfinite(r["j0"]) and r["budget"] > 0


def test_vllm_draft_host_quick(tmp_path):
    _have("vllm", "xgrammar", "torch")
    from conftest import needs_shared_data

    needs_shared_data("tokenizers", "qwen2.5", "generated", "tokenizer.json")
    needs_shared_data("jsonschemabench", "dev")
    doc = bench(tmp_path, "vllm_draft_host", "--batch", "2", "--steps", "3", png=False)
    assert doc["vocab_size"] == 151936
    assert {(r["constraints"], r["batch"], r["lazy"]) for r in doc["rows"]} == {
        (c, 2, lazy) for c in ("schemas", "string") for lazy in (False, True)}
    _finite(doc["rows"], ["host_ms", "rows_masked", "positions_per_step"])
    for r in doc["rows"]:
        _finite([r["ms"]], list(r["ms"]))


def test_progress_bars_redraw_rarely_into_a_log(monkeypatch):
    """Into a log or a pipe a benchmark's bar is redrawn at most every 30 s (each redraw is a line there); on a
    terminal as often as tqdm likes."""
    import io

    from specgrammar_plugins.bench import _report as R

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for stream, interval in ((io.StringIO(), R.NON_TTY_INTERVAL_S), (Tty(), 0.1)):
        monkeypatch.setattr(sys, "stderr", stream)
        bar = R.progress(range(50), "x")
        assert bar.mininterval == interval
        assert list(bar) == list(range(50))
        bar.close()
