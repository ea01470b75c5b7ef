"""The host-neutral pieces the vLLM and mlx-lm adapters left to the core (``serving``, issue 34: "no host-neutral
logic is left in an adapter"): a launcher's command line (``option_value``, ``option_values``, ``json_option``,
``take_options``; was ``specgrammar_vllm.serve``), strict compile else the language the host's engine enforces
(``compile_as_enforced`` with a host's policy, ``without_strict``; was ``specgrammar_vllm.structured``), a model
folder's tokenizer per process (``folder_tokenizer``; was ``budget_mask.gate_compile``'s cache), a row's budget
found lost (``RowCut.lost_now`` / ``off``; was ``BudgetedGrammar.fill_bitmask``), a row's mask for a host's own
sampler (``row_mask``; was the mlx-lm plugin's ``logits_processors``), ``switch_on`` and ``cap_compile_cache``.
Real tokenizers and engines: the toy tokenizer on the DFA, the tiny target's as xgrammar reads it."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from specgrammar_plugins.api import (COMPILE_CACHE, LOST_MIDWAY, ConstraintError, ConstraintSpec, MaskProcessor,
                                     RecipePackError, RequestPlan, RowCut, SpecOptions, StopOnlyMask, TokenizerInfo,
                                     cap_compile_cache, check_budget, compile_as_enforced, compile_constraint,
                                     engine_tokenizer, folder_tokenizer, json_option, load_pack, model_vocab_size,
                                     option_value, option_values, row_budget, row_mask, switch_on, take_options,
                                     without_strict)
from specgrammar_plugins.masks import mask_allows, mask_words
from specgrammar_plugins.models import tiny_path
from specgrammar_plugins.testing import toy_tokenizer

TOY = toy_tokenizer()
LOG = logging.getLogger("test.serving.host")


# ---------------------------------------------------------------------------------------------- the command line
def test_a_launchers_command_line_is_read_as_vllm_serve_gives_it():
    argv = ["modèle", "--served-model-name", "ñandú", "日本", "--port", "8000", "--served-model-name=late",
            "--additional-config", json.dumps({"specgrammar": {"recipes_dir": "/packs/ñandú"}}, ensure_ascii=False),
            "--structured-outputs-config={\"backend\": \"guidance\"}", "--model"]
    assert option_value(argv, "--port") == "8000" and option_value(argv, "--model") is None  # (no value after it)
    assert option_value(argv, "--served-model-name") == "ñandú"  # the first one
    assert option_values(argv, "--served-model-name") == ["ñandú", "日本"]
    assert option_values(["--served-model-name=ü", "x"], "--served-model-name") == ["ü"]
    assert option_values(argv, "--lora-modules") == []
    assert json_option(argv, "--additional-config", "specgrammar", "recipes_dir") == "/packs/ñandú"
    assert json_option(argv, "--structured-outputs-config") == {"backend": "guidance"}
    assert json_option(argv, "--structured-outputs-config", "backend", "deeper") is None  # not an object there
    assert json_option(["--additional-config", "{not json"], "--additional-config", "specgrammar") is None
    assert json_option(["--additional-config", "[1]"], "--additional-config", "specgrammar") is None
    assert json_option([], "--additional-config") is None


def test_a_launcher_takes_its_own_options_out_of_the_command_line():
    rest, ours = take_options(["m", "--grammar-spec", "3", "--port", "1", "--grammar-draft=ドラフト", "--grammar-spec=4"],
                              ("--grammar-spec", "--grammar-draft"))
    assert rest == ["m", "--port", "1"] and ours == {"--grammar-spec": "4", "--grammar-draft": "ドラフト"}
    assert take_options(["--grammar-specx", "1"], ("--grammar-spec",)) == (["--grammar-specx", "1"], {})
    with pytest.raises(ValueError, match="--grammar-draft needs a value"):  # (was an IndexError)
        take_options(["m", "--grammar-draft"], ("--grammar-spec", "--grammar-draft"))


def test_an_environment_switch_is_on_unless_turned_off(monkeypatch):
    name = "SPECGRAMMAR_TEST_SWITCH_ÜBER"
    monkeypatch.delenv(name, raising=False)
    assert switch_on(name)
    for off in ("0", "false", "No", "OFF"):
        monkeypatch.setenv(name, off)
        assert not switch_on(name)
    monkeypatch.setenv(name, "yes")
    assert switch_on(name)


def test_the_compile_cache_takes_a_lower_bound_only(monkeypatch):
    monkeypatch.setattr(COMPILE_CACHE, "max_bytes", 512 << 20)
    cap_compile_cache(0)
    cap_compile_cache(1 << 30)
    assert COMPILE_CACHE.max_bytes == 512 << 20
    cap_compile_cache(64 << 20)
    assert COMPILE_CACHE.max_bytes == 64 << 20


# ---------------------------------------------------------------------------------------------- strict, else enforced
@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    if not (tiny_path("target") / "tokenizer.json").exists():
        pytest.skip("the tiny target model is not in the tree (issue 3)")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_path("target")))


@pytest.fixture(scope="module")
def xtok(hf):
    pytest.importorskip("xgrammar")
    folder = str(tiny_path("target"))
    return folder, engine_tokenizer(hf, model_vocab_size(folder, hf), "xgrammar")


PATTERNED = {"type": "object", "properties": {"nom": {"type": "string", "pattern": "^[a-zé ]+$"}},
             "required": ["nom"], "additionalProperties": False}


def test_a_schema_strict_mode_refuses_is_compiled_as_the_hosts_engine_enforces_it(xtok):
    _, tok = xtok
    opts = {"xgrammar_strict_mode": True}
    spec = ConstraintSpec.json_schema(PATTERNED)
    with pytest.raises(ConstraintError) as e:  # no policy: the strict refusal stands, its own words
        compile_as_enforced(spec, tok, "xgrammar", opts)
    assert "pattern" in e.value.reason and "strict=false" in e.value.reason
    compiled, lenient = compile_as_enforced(spec, tok, "xgrammar", opts, without_strict)
    assert lenient and compiled.spec.option("strict", True) is False
    m = compiled.matcher()
    assert m.accept_bytes('{"nom": "é"}'.encode()) and m.accept(tok.eos_token_id)
    plain, lenient = compile_as_enforced(ConstraintSpec.regex("ñandú"), tok, "xgrammar", opts, without_strict)
    assert not lenient and plain.matcher().accept_bytes("ñandú".encode())
    with pytest.raises(ConstraintError):  # another error stands (the policy gives nothing to compile instead)
        compile_as_enforced(ConstraintSpec.regex("(é"), tok, "xgrammar", opts, without_strict)
    assert without_strict(ConstraintSpec.json_schema(PATTERNED, options=(("strict", False),)), e.value) is None


def test_a_served_folders_tokenizer_is_loaded_once_as_the_engine_reads_it(xtok):
    folder, tok = xtok
    got = folder_tokenizer(folder, "xgrammar", LOG)
    assert folder_tokenizer(folder, "xgrammar", LOG) is got
    assert got.token_bytes == tok.token_bytes and got.vocab_size == tok.vocab_size
    assert compile_constraint(ConstraintSpec.regex("日本|ü"), got, engine="xgrammar").matcher().accept_bytes(
        "日本".encode())


# ---------------------------------------------------------------------------------------------- a row's budget
ITEM = {"type": "object", "properties": {f"champ{i}": {"type": "string"} for i in range(40)},
        "required": [f"champ{i}" for i in range(40)], "additionalProperties": False}
BIG_ITEMS = {"type": "object", "properties": {"nom": {"type": "string"}, "liste": {"type": "array", "items": ITEM}},
             "required": ["nom", "liste"], "additionalProperties": False}


def _row(m, words):
    row = np.zeros(words, dtype=np.int32)
    m.fill_mask(row)
    return row


def test_a_rows_budget_found_lost_midway_is_said_once_and_kept(xtok, caplog):
    """With the far zone unchecked an item's opener is allowed and a later row finds no certificate: ``lost_now``
    says ``budget_lost_midway`` once (logged, the row's name in ``LOST_MIDWAY``), then nothing; ``off`` drops the
    budget (the row uncut from then on)."""
    _, tok = xtok
    c = compile_constraint(ConstraintSpec.json_schema(BIG_ITEMS), tok, engine="xgrammar", xgrammar_strict_mode=True)
    m = c.matcher()
    out = tok.encode('{"nom":"ñ","liste":[')
    assert all(m.accept(t) for t in out)
    cut = RowCut(check_budget(c, SpecOptions(), 256), 16, "off", tok.vocab_size, name="requête-1")
    words = mask_words(tok.vocab_size)
    said = []
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        for _ in range(60):
            row = _row(m, words)
            cut.restrict(row, out)
            said.append(cut.lost_now(len(out), LOG))
            if said[-1]:
                break
            t = max(t for t in range(tok.vocab_size) if mask_allows(row, t))
            assert m.accept(t)
            out.append(t)
    assert said[-1] == "budget_lost_midway" and said.count("budget_lost_midway") == 1, tok.decode(out)
    assert cut.lost_now(len(out), LOG) is None and "requête-1" in LOST_MIDWAY
    LOST_MIDWAY.pop("requête-1")
    assert f"request requête-1 lost its budget certificate after {len(out)} tokens" in caplog.text
    cut.off()
    row = _row(m, words)
    before = row.copy()
    assert not cut.restrict(row, out) and (row == before).all()


# ---------------------------------------------------------------------------------------------- a row's mask
def _plan(spec, **options):
    return RequestPlan(spec, SpecOptions(**options), explicit=bool(options))


def test_a_rows_mask_carries_its_budget_or_ends_on_the_stop_tokens(caplog):
    exact = _plan(ConstraintSpec.regex("é?[0-9]{2}"))
    mask, compiled = row_mask(exact, lambda: compile_constraint(exact.spec, TOY, engine="dfa"), 8, [0], LOG)
    assert isinstance(mask, MaskProcessor) and compiled is mask.compiled and not isinstance(mask.fit, RowCut)
    assert mask.fit is not None  # an exact bound: cut in the row as it is
    free = row_mask(_plan(ConstraintSpec.regex("é?[0-9]{2}"), budget_mask=False),
                    lambda: compile_constraint(exact.spec, TOY, engine="dfa"), 8, [0], LOG)[0]
    assert isinstance(free, MaskProcessor) and free.fit is None
    with caplog.at_level(logging.ERROR, logger=LOG.name):  # cannot end within 2 tokens: stop tokens only
        mask, compiled = row_mask(exact, lambda: compile_constraint(exact.spec, TOY, engine="dfa"), 1, [3, 0], LOG)
        assert isinstance(mask, StopOnlyMask) and compiled is None and mask.stop_token_ids == [0, 3]
        assert mask.allowed([], 8).nonzero()[0].tolist() == [0, 3]
        bad = _plan(ConstraintSpec.regex("(ü"))
        mask, compiled = row_mask(bad, lambda: compile_constraint(bad.spec, TOY, engine="dfa"), 8, [0], LOG)
        assert isinstance(mask, StopOnlyMask) and compiled is None and mask.reason
    assert caplog.text.count("specgrammar: constraint failed at generation time") == 2


def test_a_certified_budget_is_a_row_cut(xtok):
    _, tok = xtok
    plan = _plan(ConstraintSpec.json_schema(BIG_ITEMS))
    mask, compiled = row_mask(plan, lambda: compile_constraint(plan.spec, tok, engine="xgrammar"), 256,
                              [tok.eos_token_id], LOG)
    assert isinstance(mask, MaskProcessor) and isinstance(mask.fit, RowCut) and mask.fit.budget.settles
    allowed = mask.allowed([], tok.vocab_size)
    assert allowed.any() and compiled is mask.compiled


def test_whether_a_requests_chain_drafts_with_a_model():
    assert SpecOptions(k=2, drafters=("forced", "model")).model_drafts
    assert not SpecOptions(k=0, drafters=("model",)).model_drafts and not SpecOptions(drafters=("model",)).model_drafts
    assert not SpecOptions(k=3, drafters=("forced", "recipe")).model_drafts


def test_a_servers_recipe_pack_is_loaded_as_a_requests_chain_loads_it(hf):
    tok = TokenizerInfo.from_hf(hf, vocab_size=1024)
    assert load_pack("json_extraction", tok, 1024, 4, {"recipes_dir": "/nulle/part/ñ"}).name == "recipe"
    with pytest.raises(RecipePackError, match="not found"):
        load_pack("pas_de_paquet_ñandú", tok, 1024, 4)
    with pytest.raises(RecipePackError, match="tokenizer"):  # built for another model's tokenizer
        load_pack("smollm2-135m.json_extraction", tok, 1024)


def test_a_budget_for_rows_has_the_far_zones_tables_made(xtok):
    _, tok = xtok
    c = compile_constraint(ConstraintSpec.json_schema(BIG_ITEMS), tok, engine="xgrammar", xgrammar_strict_mode=True)
    budget = row_budget(c, SpecOptions(), 256, "open")
    assert budget.settles and budget._vocab._lexed is not None
    assert row_budget(compile_constraint(ConstraintSpec.regex("ñ{2}"), tok, engine="xgrammar"), SpecOptions(), 8,
                      "off").mode == "exact"
