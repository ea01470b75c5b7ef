"""The wheel carries everything a user needs: the core, the three adapter packages, the bundled tiny models, the
shipped recipe packs and the mlx-lm patch (package data, found with ``importlib.resources``).

The wheel is built (``pip wheel . --no-deps``) and installed into a fresh venv whose only other packages are the
already installed dependencies (the project venv's site-packages, added as a plain path: no editable install comes
with it), and there, from a folder outside the checkout, ``specgrammar demo --n 1`` (which drafts from a shipped
pack) and ``specgrammar patch mlx-lm --check`` must run (``--tiny``: the bundled pair, which the wheel carries).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_list_matches_the_folders():
    """``[tool.setuptools] packages`` is written out by hand (the data packages map top-level folders, and the
    model folders are data packages of their own): every package folder on disk, and every folder of data files
    under the core, must be in it, and every entry must exist (setuptools warns of a folder it could import but
    was not told about)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(cfg["packages"]), cfg["package-dir"]
    on_disk = set()
    for top, where in (("specgrammar_plugins", ROOT / "src" / "specgrammar_plugins"),
                       *((p.name, p) for p in (ROOT / "adapters").iterdir() if (p / "__init__.py").exists())):
        on_disk.add(top)
        for init in where.rglob("__init__.py"):
            rel = init.parent.relative_to(where)
            if "__pycache__" not in rel.parts and rel.parts:
                on_disk.add(".".join((top, *rel.parts)))
    for folder in (ROOT / "src" / "specgrammar_plugins" / "models").rglob("*"):
        if folder.is_dir() and "__pycache__" not in folder.parts and any(f.is_file() for f in folder.iterdir()):
            on_disk.add(".".join(("specgrammar_plugins", *folder.relative_to(ROOT / "src" / "specgrammar_plugins").parts)))
    on_disk |= {"specgrammar_plugins.recipes.shipped", "specgrammar_plugins.patches"}
    assert listed == on_disk, f"listed but absent: {listed - on_disk}; on disk but not listed: {on_disk - listed}"
    for pkg, folder in dirs.items():
        assert (ROOT / folder).is_dir(), (pkg, folder)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("specgrammar_plugins-*.whl")
    return whl


def test_the_wheel_holds_the_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for must in ("specgrammar_plugins/api.py", "specgrammar_mlx_lm/server_plugin.py", "specgrammar_vllm/proposer.py",
                 "specgrammar_vllm/draft_proposer.py", "specgrammar_vllm/wiring.py",
                 "specgrammar_llama_cpp/llama.py", "specgrammar_plugins/patches/mlx_lm-server-plugin.diff",
                 "specgrammar_plugins/patches/vllm-custom-proposer-runner.diff",
                 "specgrammar_plugins/recipes/shipped/json_extraction.json",
                 "specgrammar_plugins/models/tiny/target/model.safetensors",
                 "specgrammar_plugins/models/tiny/target.gguf",
                 "specgrammar_plugins/models/smollm2_draft/layers.safetensors",
                 "specgrammar_plugins/recipes/shipped/smollm2-135m.json"):
        assert must in names, must
    assert not any(n.startswith(("tests/", "adapters/", "src/")) for n in names)


@pytest.mark.slow
def test_the_installed_wheel_runs_the_demo_and_finds_its_patch(wheel, tmp_path):
    pytest.importorskip("mlx_lm")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies: the project venv's site-packages as a plain path (its .pth files, the editable install's
    # among them, are not processed from there)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-compile",
                        "-q", str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    where = subprocess.run([str(py), "-c", "import specgrammar_plugins, specgrammar_mlx_lm; "
                            "print(specgrammar_plugins.__file__, specgrammar_mlx_lm.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert str(ROOT) not in where.stdout and str(site) in where.stdout, where.stdout
    cli = [str(venv / "bin" / "specgrammar")]  # the wheel's console script
    check = subprocess.run([*cli, "patch", "mlx-lm", "--check"], cwd=work, env=env, capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr[-3000:]
    assert "mlx-lm 0.32.2 at" in check.stdout, check.stdout
    demo = subprocess.run([*cli, "demo", "--tiny", "--n", "1"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=900)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "recipe pack json_extraction" in demo.stdout, demo.stdout[-3000:]
    assert "outputs valid" in demo.stdout, demo.stdout[-3000:]
