"""Loading a model by name or path for mlx-lm: ``load("smollm2-135m")`` is ``mlx_lm.load`` on the folder
``api.resolve_model`` names (the real model's float32 folder is converted from its GGUF on first use, with progress;
``tiny`` / ``tiny-draft`` are the bundled pair); a path passes through to ``mlx_lm.load`` unchanged."""

from __future__ import annotations

import os

from specgrammar_plugins.api import resolve_model


def model_folder(name_or_path: str | os.PathLike, progress: bool = True) -> str:
    """The folder (or path) ``mlx_lm.load`` gets for ``name_or_path``."""
    return os.fspath(resolve_model(name_or_path, "mlx_lm", progress=progress))


def load(name_or_path: str | os.PathLike, **kwargs):
    """``mlx_lm.load`` by model name or path: (model, tokenizer); ``kwargs`` go to ``mlx_lm.load``."""
    from mlx_lm import load as mlx_load

    return mlx_load(model_folder(name_or_path), **kwargs)
