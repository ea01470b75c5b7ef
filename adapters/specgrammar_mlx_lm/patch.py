"""``specgrammar patch mlx-lm [--revert] [--check] [--target DIR]``: apply the server-plugin diff to mlx-lm.

mlx-lm has no plugin mechanism; ``patches/mlx_lm-server-plugin.diff`` (upstream-ready, host-neutral) adds
``mlx_lm.server --plugin NAME`` (pluggy plugins from the ``mlx_lm.server_plugins`` entry-point group, hooks in the
new module ``mlx_lm/server_plugins.py``; a plugin may batch a request although a draft model is loaded, the
target alone decoding it; a plugin may name the ``GenerationBatch`` class the batching path decodes with, hook
``generation_batch_class``) and makes the server store prompt caches under the tokens they hold.  On the batching
path a fault in one request's logits processor fails that request only (``upstream/batch-processor-faults.diff``).  It
also closes holes of the host's own HTTP server (made against mlx-lm 0.32.2; issue 33, ``tests/test_hostile_host.py``):
image URLs are never fetched (image parts on a text-only model are a 400), stop strings end the generation instead of
being cut out of the text, logprobs name the chosen token, ``/v1/models`` answers, exactly one valid
``Content-Length``, ``--header-timeout`` / ``--body-timeout`` deadlines, ``--max-connections``, clear 400s for lone
surrogates and malformed ``stop`` / ``chat_template_kwargs``.  Each of those fixes is also in
``patches/upstream/NAME.diff``, apart, for upstream.

The command is idempotent (an applied patch is reported, not applied twice), checks the installed version
(only the version the diff was made against is patched; anything else is refused with the reason), and is
reversible (``--revert``).  ``--target`` names the folder that contains the ``mlx_lm`` package (default: the
installed one), so a copy can be patched instead.  The diff is applied by this module (exact context, no fuzz);
it is also plain ``git apply -p1`` / ``patch -p1`` input from that folder.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from specgrammar_plugins.api import FilePatch, Hunk, PatchError, apply_diff as apply, diff_state as state, parse_diff

__all__ = ["FilePatch", "Hunk", "PatchError", "apply", "diff_path", "main", "parse_diff", "patched_root", "run",
           "state"]  # the unified diffs are the core's (api): Hunk, FilePatch, parse_diff, state, apply, PatchError

SUPPORTED_VERSIONS = ("0.32.2",)
DIFF_NAME = "mlx_lm-server-plugin.diff"


def diff_path() -> Path:
    """The shipped diff (the repository's ``patches/`` folder, installed as package data)."""
    from specgrammar_plugins.api import patch_path

    try:
        return patch_path(DIFF_NAME)
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise PatchError(f"cannot find {DIFF_NAME}: {e}") from None


# ------------------------------------------------------------------------------------------------ the command
def installed_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("mlx-lm is not installed (pip install 'specgrammar-plugins[mlx]')")
    return Path(list(spec.submodule_search_locations)[0]).parent


def version_of(root: Path) -> str:
    vf = root / "mlx_lm" / "_version.py"
    if not vf.exists():
        raise PatchError(f"{root / 'mlx_lm'} does not look like mlx-lm (no _version.py)")
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", vf.read_text())
    if not m:
        raise PatchError(f"cannot read the mlx-lm version from {vf}")
    return m.group(1)


def run(target: Path | None = None, revert: bool = False, check: bool = False, out=print) -> str:
    """Apply (or revert) the patch; returns the final state ('applied' / 'clean')."""
    root = Path(target) if target is not None else installed_root()
    version = version_of(root)
    if version not in SUPPORTED_VERSIONS:
        raise PatchError(f"mlx-lm {version} at {root / 'mlx_lm'} is not supported: the server-plugin patch is made "
                         f"for mlx-lm {', '.join(SUPPORTED_VERSIONS)} (pip install 'mlx-lm=={SUPPORTED_VERSIONS[-1]}')")
    patches = parse_diff(diff_path().read_text())
    st = state(root, patches)
    where = root / "mlx_lm"
    if check:
        out(f"mlx-lm {version} at {where}: {'patched' if st == 'applied' else st}")
        return st
    if st == "conflict":
        raise PatchError(f"mlx-lm {version} at {where} is modified in a way the patch does not recognize; "
                         "reinstall it (pip install --force-reinstall --no-deps mlx-lm) and retry")
    if revert:
        if st == "clean":
            out(f"mlx-lm {version} at {where}: not patched, nothing to revert")
            return "clean"
        apply(root, patches, reverse=True)
        out(f"mlx-lm {version} at {where}: patch reverted")
        return "clean"
    if st == "applied":
        out(f"mlx-lm {version} at {where}: already patched (mlx_lm.server --plugin NAME)")
        return "applied"
    apply(root, patches)
    out(f"mlx-lm {version} at {where}: patched; run: mlx_lm.server --model PATH --plugin specgrammar")
    return "applied"


def patched_root(dest: Path | None = None) -> tuple[Path, bool]:
    """A folder to put first on ``PYTHONPATH`` so that ``import mlx_lm`` is patched: (the installed mlx-lm's folder,
    True) when it is patched already, else (a patched copy under ``dest``, False); ``dest`` defaults to a new
    temporary folder, and a copy already patched there is reused.  The installed mlx-lm is left alone."""
    import shutil
    import tempfile

    src = installed_root()
    patches = parse_diff(diff_path().read_text())
    if state(src, patches) == "applied":
        return src, True
    dest = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="specgrammar-mlx-"))
    if (dest / "mlx_lm").exists() and state(dest, patches) == "applied":
        return dest, False
    shutil.copytree(src / "mlx_lm", dest / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    if run(dest, out=lambda *_: None) != "applied":
        raise PatchError(f"could not patch the copy of mlx-lm in {dest}")
    return dest, False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar patch", description=__doc__.splitlines()[0])
    ap.add_argument("host", choices=["mlx-lm", "mlx_lm"], help="the host to patch")
    ap.add_argument("--revert", action="store_true", help="undo the patch")
    ap.add_argument("--check", action="store_true", help="only report whether the host is patched")
    ap.add_argument("--target", type=Path, default=None,
                    help="folder containing the mlx_lm package (default: the installed mlx-lm)")
    args = ap.parse_args(argv)
    try:
        run(args.target, revert=args.revert, check=args.check)
    except PatchError as e:
        print(f"specgrammar patch: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
