"""Files that ship as package data beside the code: the host patches (the repository's ``patches/`` folder,
installed as ``specgrammar_plugins.patches``).  The shipped recipe packs are found by ``recipes.shipped_packs``."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

PATCHES_PACKAGE = "specgrammar_plugins.patches"


def patch_path(name: str) -> Path:
    """The file of the shipped host patch ``name`` (e.g. ``"mlx_lm-server-plugin.diff"``); FileNotFoundError if
    it is not shipped."""
    try:
        p = Path(str(files(PATCHES_PACKAGE) / name))
    except ModuleNotFoundError:
        raise FileNotFoundError(f"{name}: this build ships no patches ({PATCHES_PACKAGE} is missing)") from None
    if not p.is_file():
        raise FileNotFoundError(f"{name} is not among the shipped patches ({p.parent})")
    return p
