"""The speculative rows of the mlx-lm server's batching path answer each committed token with its log-probabilities
(what mlx-lm's server reads as ``logprobs[token].item()``): computed once per batched pass for every row and
evaluated together (``SpecGenerationBatch.next``), they are the target's log-softmax at that token's position, as a
single-row forward of the same tokens gives them (real parts: mlx-lm on mlx[cpu], the tiny pair)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from test_mlx_common import tiny_model_dirs  # noqa: E402

from test_mlx_server_batch import _body, _Guard, _provider, _rows, _spec_processors, tiny  # noqa: E402,F401


def test_speculative_rows_answer_the_targets_log_probabilities(tiny, monkeypatch):  # noqa: F811
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from specgrammar_mlx_lm import server_plugin

    model, tok = tiny
    draft, _ = load(str(tiny_model_dirs()[1]))
    provider = _provider(model, tok)
    provider.draft_model = draft
    monkeypatch.setitem(server_plugin._config, "batch_drafts", "on")
    G = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(G, "GenerationBatch", server_plugin.generation_batch_class(provider))
    rows = _rows(tok, 1)[:4]
    prompts = [p for _, _, p in rows]
    procs = [[_Guard(_spec_processors(provider, _body(ex, 24)))] for _, ex, _ in rows]
    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts),
                         stop_tokens=[[e] for e in sorted(tok.eos_token_ids)])
    uids = gen.insert(prompts, max_tokens=[24] * len(prompts), logits_processors=procs)
    got = {u: [] for u in uids}
    done = set()
    try:
        while len(done) < len(uids):
            for r in gen.next_generated():
                got[r.uid].append((int(r.token), r.logprobs, r.finish_reason))
                if r.finish_reason is not None:
                    done.add(r.uid)
    finally:
        gen.close()
    checked = 0
    for u, prompt in zip(uids, prompts):
        answers = got[u]
        tokens = [t for t, _, _ in answers]
        logits = model(mx.array([list(prompt) + tokens])).astype(mx.float32)[0]
        want = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        for j, (t, lp, finish) in enumerate(answers):
            assert lp.shape == (want.shape[-1],)
            value = lp[t].item()  # what mlx-lm's server reads per token
            assert np.isfinite(value)
            if finish is None:  # (a row's last answer may be the stop token added after its grammar ended)
                np.testing.assert_allclose(np.asarray(lp), want[len(prompt) - 1 + j], atol=2e-3)
                checked += 1
    assert checked > 20
