"""The house's layers, enforced: ``lint-imports`` (import-linter) with the contracts in ``pyproject.toml``.

- the layers contract: no module imports (at any level: function-level imports count) a module of a layer above
  its own, and every module of the core and of the adapters is in some layer (a new module cannot slip past);
- adapters import the core only through ``specgrammar_plugins.api``.
The contracts are also shown to bite: on a copy of the tree with one upward function-level import added to the
core and one core import added to an adapter, ``lint-imports`` fails and names both.
"""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

if not LINT.exists():
    pytest.skip("import-linter is not installed (pip install -e '.[dev]')", allow_module_level=True)


def _contracts() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _lint(cwd: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath))
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_lint_imports_passes():
    r = _lint(ROOT, [ROOT / "src", ROOT / "adapters"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _modules(package_dir: Path, name: str) -> list[str]:
    out = [name]
    for m in pkgutil.walk_packages([str(package_dir)], prefix=name + "."):
        out.append(m.name)
    return out


def test_every_module_is_in_a_layer():
    cfg = _contracts()
    layers = next(c for c in cfg["contracts"] if c["type"] == "layers")["layers"]
    names = [n.strip() for layer in layers for n in layer.replace("|", ":").split(":")]
    roots = {"specgrammar_plugins": ROOT / "src" / "specgrammar_plugins"}
    roots.update({p.name: p for p in (ROOT / "adapters").iterdir() if (p / "__init__.py").exists()})
    assert set(cfg["root_packages"]) == set(roots), "root_packages must list the core and every adapter package"
    missing = []
    for pkg, path in roots.items():
        for mod in _modules(path, pkg):
            if mod == "specgrammar_plugins":
                continue  # the package's face (__init__): re-exports only
            if not any(mod == n or mod.startswith(n + ".") for n in names):
                missing.append(mod)
    assert not missing, f"modules in no layer of pyproject.toml's layers contract: {missing}"


def test_the_contracts_catch_an_upward_and_an_adapter_import(tmp_path):
    for part in ("src", "adapters"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "src" / "specgrammar_plugins" / "drafters.py", "a") as f:
        f.write("\n\ndef _upward():\n    from .speculation import make_loop  # the road is above the drafters\n\n"
                "    return make_loop\n")
    with open(tmp_path / "adapters" / "specgrammar_vllm" / "config.py", "a") as f:
        f.write("\n\ndef _inside():\n    from specgrammar_plugins.loop import Stats  # not through the api\n\n"
                "    return Stats\n")
    r = _lint(tmp_path, [tmp_path / "src", tmp_path / "adapters"])
    assert r.returncode != 0, r.stdout[-3000:]
    assert "specgrammar_plugins.drafters -> specgrammar_plugins.speculation" in r.stdout, r.stdout[-3000:]
    assert "specgrammar_vllm.config -> specgrammar_plugins.loop" in r.stdout, r.stdout[-3000:]
