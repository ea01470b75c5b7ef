import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
QWEN_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen2.5" / "generated" / "tokenizer.json"


def needs_shared_data(*parts: str) -> pathlib.Path:
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"../shared/data/{'/'.join(parts)} is absent (it sits beside the repo on the project's machines)")
    return p


@pytest.fixture(scope="session")
def toy_tok():
    from specgrammar_plugins.testing import toy_tokenizer

    return toy_tokenizer()


def available_engines():
    out = []
    for name, mod in (("dfa", "interegular"), ("xgrammar", "xgrammar"), ("llguidance", "llguidance"),
                      ("outlines_core", "outlines_core")):
        try:
            __import__(mod)
        except ImportError:
            continue
        eng_file = ROOT / "src" / "specgrammar_plugins" / "engines" / {
            "dfa": "dfa.py", "xgrammar": "xgrammar_engine.py", "llguidance": "llguidance_engine.py",
            "outlines_core": "outlines_core_engine.py"}[name]
        if eng_file.exists():
            out.append(name)
    return out


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
