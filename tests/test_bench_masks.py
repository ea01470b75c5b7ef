"""``specgrammar bench masks --quick`` completes and reports finite numbers (the figures themselves are not asserted)."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "src" / "specgrammar_plugins" / "models" / "tiny" / "tokenizer.json"
QWEN = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen2.5" / "generated" / "tokenizer.json"


def _tokenizer() -> list[str]:
    if TINY.exists():
        return ["--tokenizer", str(TINY)]
    if QWEN.exists():
        return ["--tokenizer", str(QWEN), "--width", "151936"]
    pytest.skip("neither the bundled tiny tokenizer nor ../shared/data's Qwen2.5 tokenizer is there")


def test_bench_masks_quick(tmp_path, capsys):
    pytest.importorskip("xgrammar")
    pytest.importorskip("llguidance")
    pytest.importorskip("outlines_core")
    from specgrammar_plugins.bench.masks import main

    out = tmp_path / "masks.json"
    assert main(["--quick", "--reps", "2", "--out", str(out), *_tokenizer()]) == 0
    report = json.loads(out.read_text())
    assert report["engines"] == ["xgrammar", "llguidance", "outlines_core"]
    measured = [r for r in report["results"] if "mask_us_median" in r]
    assert {r["engine"] for r in measured} == {"xgrammar", "llguidance", "outlines_core"}
    assert len({r["workload"] for r in measured}) == 5
    for r in measured:
        assert "error" not in r, r
        for key in ("compile_ms", "mask_us_median", "mask_us_p99", "mask_cold_us_median", "repeat_us_median",
                    "raw_us_median", "draft_us_median", "overhead_pct"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (r["workload"], r["engine"], key)
        assert r["draft_k"] >= 1 and r["n_positions"] >= 1
    # what an engine cannot do is reported, not raised (outlines-core has no any-JSON)
    refused = [r for r in report["results"] if "mask_us_median" not in r]
    assert all(r["engine"] == "outlines_core" and r["error"] for r in refused)
    assert "mask p50" in capsys.readouterr().out


def test_bench_masks_missing_tokenizer(tmp_path, capsys):
    from specgrammar_plugins.bench.masks import main

    assert main(["--quick", "--tokenizer", str(tmp_path / "nope.json"), "--out", str(tmp_path / "m.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
