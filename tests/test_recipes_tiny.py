"""The shipped recipe packs on the bundled tiny target through the mlx-lm adapter's runner: they load for its
tokenizer, greedy output with recipes equals greedy output without them token for token, free prose gets no
drafts, and (when the packs were built from this very model) the json_extraction goal holds on eval prompts the
build never saw: recipe coverage >= 70% and >= 3 tokens per target pass with no draft model.  Skips when the
tiny models, mlx-lm or the packs are absent."""

import pytest

from specgrammar_plugins import recipes as R
from specgrammar_plugins.recipes_cli import evaluate
from specgrammar_plugins.models import tiny_path

pytestmark = pytest.mark.skipif(not (tiny_path("target") / "model.safetensors").exists(),
                                reason="the bundled tiny target is absent")


def _packs():
    return sorted(R.shipped_packs().values())


@pytest.fixture(scope="module")
def target():
    pytest.importorskip("mlx_lm")
    try:
        from specgrammar_plugins.recipes_cli import load_target
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"recipes CLI unavailable: {e}")
    try:
        import specgrammar_mlx_lm.runner  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the mlx-lm adapter's runner is absent: {e}")
    return load_target(None)


def _pack(name, tok):
    p = R.shipped_pack(name)
    assert p is not None, f"no shipped recipe pack {name!r} (build it: specgrammar recipes build)"
    return R.load_pack(p, tok)


def test_shipped_packs_load_for_the_tiny_tokenizer():
    from specgrammar_plugins.models import tiny_tokenizer_info

    packs = _packs()
    if not packs:
        pytest.skip("no packs in recipes/")
    import json

    tok = tiny_tokenizer_info()
    # the packs built for the tiny tokenizer (the others, e.g. SmolLM2's, are tests/test_real_drafting.py's), each
    # small; a pack for another tokenizer is refused by name
    mine = [p for p in packs if json.loads(p.read_text())["tokenizer"]["fingerprint"] == tok.vocab_fingerprint]
    assert len(mine) >= 6, [p.name for p in packs]
    for p in packs:
        assert p.stat().st_size < 512 * 1024, f"{p} is not small"
        if p not in mine:
            with pytest.raises(R.RecipePackError, match="rebuild the pack for this model"):
                R.RecipePack.load(p, tok)
            continue
        pack = R.RecipePack.load(p, tok)
        assert pack.bound and len(pack) > 0


@pytest.mark.parametrize("workload", ["json_extraction", "sql", "tool_call"])
def test_greedy_with_recipes_equals_greedy_without(target, workload):
    from specgrammar_plugins.workloads import examples

    runner, tok = target
    pack = _pack(workload, tok)
    res = evaluate(runner, tok, examples(workload, "eval", 3), pack=pack, drafters=("forced", "recipe"), k=8,
                     max_tokens=64, check_greedy=True)
    assert res["greedy_equal"] == 3, res


def test_prose_gets_no_recipe_drafts(target):
    from specgrammar_plugins.workloads import examples

    runner, tok = target
    pack = _pack("json_extraction", tok)
    res = evaluate(runner, tok, examples("prose", "eval", 2), pack=pack, drafters=("forced", "recipe"), k=8,
                     max_tokens=24)
    assert res["drafted_by_source"] == {} and res["target_passes"] == res["emitted"]


def test_json_extraction_goal(target):
    import hashlib

    from specgrammar_plugins.workloads import examples

    runner, tok = target
    pack = _pack("json_extraction", tok)
    digest = hashlib.sha256((tiny_path("target") / "model.safetensors").read_bytes()).hexdigest()[:16]
    if pack.meta.get("model_sha256") != digest:
        pytest.skip("the shipped pack was built from another build of the tiny target: rebuild the packs")
    res = evaluate(runner, tok, examples("json_extraction", "eval", 30), pack=pack, drafters=("forced", "recipe"),
                     k=8, max_tokens=64)
    assert res["coverage"] >= 0.70, res
    assert res["tokens_per_pass"] >= 3.0, res
