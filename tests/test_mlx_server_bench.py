"""``specgrammar bench mlx_server --quick``: the benchmark of concurrent JSON Schema requests over HTTP (four servers
on the tiny pair) runs and its figures hold what they claim."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_mlx_common import tiny_model_dirs

pytest.importorskip("mlx_lm")


def test_bench_mlx_server_quick(tmp_path):
    """``specgrammar bench mlx_server --quick`` (four servers on the tiny pair): every output valid in every
    configuration, each batched greedy answer equal to the same request served alone without drafts, our loop's
    tokens per target pass read from the server's log (every request on the ``--specgrammar-batch never`` server is
    its), and finite figures."""
    import math

    from specgrammar_plugins.bench import mlx_server

    tiny_model_dirs()
    # in a process of its own: the benchmark re-executes itself with OpenBLAS preloaded
    r = subprocess.run([sys.executable, "-m", "specgrammar_plugins.bench.mlx_server", "--quick", "--out-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "mlx_server.json").read_text())
    n, rows = doc["n"], doc["rows"]
    assert set(rows) == set(mlx_server.CONFIGS)
    for name, r in rows.items():
        assert r["valid"] == n, (name, r["texts"])
        assert r["tokens"] > 0 and math.isfinite(r["tokens_per_s"]) and r["wall_s"] > 0
    assert rows["batch-concurrent"]["equal_to_batch_serial"] == n
    # speculative rows and our loop check a certified budget at commit (max_tokens 32 here: it binds), mlx-lm's own
    # rows cut the row (Budget.mask_row): the speculative rows' answers are our loop's
    assert rows["draft-concurrent"]["equal_to_loop_serial"] == n
    assert rows["loop-serial"]["served_by_loop"] == n and rows["loop-serial"]["tokens_per_pass_mean"] > 1.0
    # the draft server (--specgrammar-batch auto): a constrained request alone is a batch of one (issue 34), its
    # greedy answer our loop's
    assert rows["draft-serial"]["speculative_rows"] == n and rows["draft-serial"]["equal_to_loop_serial"] == n
    spec = rows["spec-batch-concurrent"]  # speculative rows: greedy answers equal to our loop's, served alone
    assert spec["equal_to_loop_serial"] == n and spec["speculative_rows"] == n and spec["tokens_per_pass_mean"] > 1.0


def test_bench_mlx_server_in_process_with_the_draft_model():
    """``--in-process`` (no server): with the draft model, the batch's rows (one batched draft pass per position)
    answer as our serial loop with it does, at its tokens per target pass per row (within 10%: near-ties in
    batched against single-row logits), in fewer draft passes than the rows drafted with the model."""
    from specgrammar_plugins.bench import mlx_server

    tiny_model_dirs()
    n = 3
    d = mlx_server.in_process("tiny", n, 24, 4)["draft"]
    assert d["equal"] == n
    assert sum(d["tokens_per_pass_batch"]) >= 0.9 * sum(d["tokens_per_pass_serial"]), d
    assert 0 < d["draft_passes"] < d["model_drafts"], d
    assert d["serial_s"] > 0 and d["batch_s"] > 0
