"""``specgrammar patch mlx-lm``: idempotent, version-checked, reversible (on copies of the installed mlx-lm), the
plugin loading the patch adds, and the host's prompt-cache off-by-one with a draft model (mlx-lm 0.32.2)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from specgrammar_mlx_lm import patch  # noqa: E402


def _installed() -> Path:
    return Path(list(importlib.util.find_spec("mlx_lm").submodule_search_locations)[0])


@pytest.fixture
def copy(tmp_path) -> Path:
    src = _installed()
    shutil.copytree(src, tmp_path / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"))
    patches = patch.parse_diff(patch.diff_path().read_text())
    if patch.state(tmp_path, patches) == "applied":  # the venv's mlx-lm is patched: start from its pristine form
        patch.apply(tmp_path, patches, reverse=True)
    return tmp_path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "mlx_lm").rglob("*.py"))}


def test_apply_is_idempotent_and_reversible(copy):
    before = _tree(copy)
    msgs = []
    assert patch.run(copy, check=True, out=msgs.append) == "clean"
    assert patch.run(copy, out=msgs.append) == "applied"
    after = _tree(copy)
    assert "mlx_lm/server_plugins.py" in after and after["mlx_lm/server.py"] != before["mlx_lm/server.py"]
    assert patch.run(copy, out=msgs.append) == "applied"  # second run: nothing changes
    assert _tree(copy) == after
    assert "already patched" in msgs[-1]
    assert patch.run(copy, revert=True, out=msgs.append) == "clean"
    assert _tree(copy) == before
    assert patch.run(copy, revert=True, out=msgs.append) == "clean"
    assert "nothing to revert" in msgs[-1]


def test_the_diff_is_plain_git_apply_input(copy):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    r = subprocess.run(["git", "apply", "--check", "-p1", str(patch.diff_path())], cwd=copy, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_other_versions_are_refused(copy):
    vf = copy / "mlx_lm" / "_version.py"
    vf.write_text(vf.read_text().replace(patch.SUPPORTED_VERSIONS[0], "0.99.0"))
    with pytest.raises(patch.PatchError, match=r"0\.99\.0 .*not supported.*0\.32\.2"):
        patch.run(copy, out=lambda *_: None)
    assert not (copy / "mlx_lm" / "server_plugins.py").exists()


def test_a_modified_server_is_refused_untouched(copy):
    server = copy / "mlx_lm" / "server.py"
    text = server.read_text().replace("def _make_logits_processors(args):", "def _make_logits_processors(a):")
    server.write_text(text)
    with pytest.raises(patch.PatchError, match="modified"):
        patch.run(copy, out=lambda *_: None)
    assert server.read_text() == text and not (copy / "mlx_lm" / "server_plugins.py").exists()


def test_cli(copy, capsys):
    from specgrammar_plugins.cli import main

    assert main(["patch", "mlx-lm", "--target", str(copy)]) == 0
    assert "patched" in capsys.readouterr().out
    assert main(["patch", "mlx-lm", "--target", str(copy), "--check"]) == 0
    assert "patched" in capsys.readouterr().out
    assert main(["patch", "mlx-lm", "--target", str(copy), "--revert"]) == 0
    assert "reverted" in capsys.readouterr().out
    assert main(["patch", "mlx-lm", "--target", str(copy / "nowhere")]) == 1
    assert "does not look like mlx-lm" in capsys.readouterr().err


def test_patched_server_loads_our_plugin_by_name(copy):
    patch.run(copy, out=lambda *_: None)
    code = (
        "from mlx_lm import server_plugins as sp\n"
        "pm = sp.load_plugins(['specgrammar'])\n"
        "names = sorted(h for h in dir(pm.hook) if not h.startswith('_'))\n"
        "print(names)\n"
        "print(sp.request_fields({'regex': '[0-9]+'}, type('P', (), {'model': None, 'tokenizer': None, 'cli_args': None})()))\n"
        "try:\n"
        "    sp.load_plugins(['no-such-plugin'])\n"
        "except SystemExit as e:\n"
        "    print('refused:', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(copy))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for hook in ("add_arguments", "configure", "request_fields", "logits_processors", "is_batchable",
                 "stream_generate"):
        assert hook in out
    assert "RequestPlan" in out and "regex" in out
    assert "refused: unknown server plugin 'no-such-plugin'" in out


def test_host_prompt_cache_off_by_one_with_a_draft_model_and_our_twin_does_not_have_it():
    """mlx-lm 0.32.2: after ``stream_generate(..., draft_model=...)`` the target cache holds one token less than
    the prompt + yielded tokens the server stores it under, when the request ends on the target's own token
    (``speculative_generate_step`` never feeds that token back).  Our twin leaves both caches at exactly prompt +
    yielded tokens.  (If the first assertion starts failing, mlx-lm fixed it; the patch's
    ``_consistent_cache_key`` stays correct either way.)"""
    from test_mlx_common import prompt_ids, tiny_model_dirs

    from mlx_lm import load, stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from specgrammar_mlx_lm.generate import stream_generate as ours
    from specgrammar_plugins.workloads import examples

    t, d = tiny_model_dirs()
    model, tok = load(str(t))
    draft, _ = load(str(d))
    n_layers = len(model.layers)
    host_gaps, our_gaps = [], []
    for ex in examples("json_extraction", "eval", 2):
        ids = prompt_ids(tok, ex.prompt)
        for max_tokens in (3, 5, 8, 13):  # "length" endings land on draft and on target tokens alike
            for gen, gaps in ((stream_generate, host_gaps), (ours, our_gaps)):
                cache = make_prompt_cache(model) + make_prompt_cache(draft)
                key = list(ids)
                last = None
                for r in gen(model, tok, ids, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=2,
                             prompt_cache=cache):
                    key.append(r.token)
                    last = r
                gaps.append((len(key) - cache[0].offset, last.from_draft))
                if gen is ours:
                    assert all(c.offset == len(key) for c in cache[n_layers:])
    assert all(g == 0 for g, _ in our_gaps), our_gaps
    on_target = [g for g, from_draft in host_gaps if not from_draft]
    assert on_target, f"no request ended on the target's own token: {host_gaps}"
    assert all(g == 1 for g in on_target), host_gaps
