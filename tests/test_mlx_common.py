"""Shared helpers for the mlx-lm adapter tests (collected, but holds no tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def tiny_model_dirs() -> tuple[Path, Path]:
    """The bundled tiny target/draft folders; skips when they are absent.  ``SPECGRAMMAR_MLX_MODELS=target,draft``
    points the tests at other folders (development only)."""
    pytest.importorskip("mlx_lm")
    env = os.environ.get("SPECGRAMMAR_MLX_MODELS")
    if env:
        t, d = (Path(p) for p in env.split(","))
    else:
        from specgrammar_plugins.models import tiny_path

        t, d = tiny_path("target"), tiny_path("draft")
    for p in (t, d):
        if not (p / "config.json").exists():
            pytest.skip(f"tiny model {p} is absent (built by scripts/build_models.py)")
    return t, d


def load_tiny_pair():
    """(target model, draft model, tokenizer) of the bundled tiny pair, loaded with mlx-lm (skips when absent)."""
    from mlx_lm import load

    t, d = tiny_model_dirs()
    model, tok = load(str(t))
    draft, _ = load(str(d))
    return model, draft, tok


class CountingModel:
    """Delegates to an mlx-lm model and counts its forward calls (target passes of mlx-lm's own loops)."""

    def __init__(self, model):
        self._model = model
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def prompt_ids(tokenizer, user: str) -> list[int]:
    from specgrammar_plugins.workloads import chat_prompt

    return list(tokenizer.encode(chat_prompt(user), add_special_tokens=False))


def plain_generate_step(model, prompt: list[int], *, processor=None, max_tokens: int = 48, sampler=None,
                        eos_ids=()) -> list[int]:
    """mlx-lm's own ``generate_step`` (no speculation), stopped after the first EOS."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    gen = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler,
                        logits_processors=[processor] if processor is not None else None)
    for tok, _ in gen:
        out.append(int(tok))
        if tok in eos_ids:
            break
    gen.close()
    return out


def mlx_speculative(model, draft, prompt: list[int], *, processor=None, k: int = 4, max_tokens: int = 48,
                    sampler=None, eos_ids=()) -> tuple[list[int], int]:
    """mlx-lm's own ``speculative_generate_step``; returns (tokens up to the first EOS, target passes)."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    counted = CountingModel(model)
    out = []
    gen = speculative_generate_step(mx.array(prompt), counted, draft, num_draft_tokens=k, max_tokens=max_tokens,
                                    sampler=sampler, logits_processors=[processor] if processor is not None else None)
    for tok, _, _ in gen:
        out.append(int(tok))
        if tok in eos_ids:
            break
    passes = counted.calls - (1 if len(prompt) > 1 else 0)  # the prefill call is not a decoding pass
    gen.close()
    return out, passes
