import contextlib
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


def outputs_chi2(law: dict, seen, n: int) -> float:
    """p-value of the chi-square goodness of fit of ``n`` sampled whole outputs (``seen``: output -> count)
    against their exact law (``testing.exact_law``): one cell per output with expected count >= 5, the rest
    pooled in one cell."""
    from scipy import stats

    keys = [o for o in law if law[o] * n >= 5]
    rest = 1 - sum(law[o] for o in keys)
    obs = [seen[o] for o in keys] + [n - sum(seen[o] for o in keys)]
    exp = [law[o] * n for o in keys] + [rest * n]
    if rest * n < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def fault_in_one_request(states, message: str = "an injected fault in our drafting code", where: str = "begin"):
    """Inject a fault into vLLM grammar drafting for the first request that reaches ``GrammarStates.begin`` of
    ``states``, at every step: a stand-in for a bug in our code.  ``where``: ``"begin"`` raises there;
    ``"model_draft"`` lets begin succeed and makes the draft block raise when a model draft is pushed onto it (as
    its matcher failing on ``accept`` would, inside a draft position; host drafts go on).  The other requests draft
    as usual."""
    begin = states.begin
    victim = {}

    def faulty(st, context, n, k=None):
        if not victim:
            victim["st"] = st
        if st is victim["st"] and where == "begin":
            raise RuntimeError(message)
        block = begin(st, context, n, k)
        if st is victim["st"] and block is not None:
            push = block.push

            def faulty_push(token, law=None, source="model", **kw):
                if source == "model":
                    raise RuntimeError(message)
                return push(token, law, source, **kw)

            block.push = faulty_push
        return block

    states.begin = faulty
    try:
        yield
    finally:
        del states.begin
