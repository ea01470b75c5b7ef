"""The grammar-aware drafting mixin (``draft_proposer.GrammarDrafting``) against vLLM's own proposer classes, without
an engine: the draft-model method runs end to end in tests/test_vllm_draft_model.py, EAGLE in
tests/test_real_model_vllm.py (SmolLM2 with the head ``models.real_eagle`` builds); EAGLE-3 and MTP (the same
``EagleProposer``; no CPU-runnable EAGLE-3 head or MTP model here) are covered here by the classes vLLM builds.

- each of vLLM's ``SpecDecodeBaseProposer`` subclasses that drafts position by position composes with the mixin: our
  three hooks come first in the MRO and ``super()`` reaches vLLM's own class;
- vLLM's base class still defines each hook with the signature we override, and its drafting loop (``propose``)
  still calls ``_sample_draft_tokens``, and the runner calls ``prepare_next_token_ids_padded``: a vLLM release that
  renames one fails here instead of silently drafting grammar-blind;
- the runner builds ``EagleProposer`` for every method that uses the target's hidden states (eagle, eagle3, mtp),
  by the name ``wiring.py`` makes build ours while ``isinstance`` keeps vLLM's meaning;
- the launcher's config helpers take the EAGLE methods.
"""

from __future__ import annotations

import inspect
import json
import types

import pytest

pytest.importorskip("vllm")

from vllm.v1.spec_decode.draft_model import DraftModelProposer  # noqa: E402
from vllm.v1.spec_decode.eagle import EagleProposer  # noqa: E402
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer  # noqa: E402

from specgrammar_vllm.draft_proposer import GrammarDraftProposer, GrammarDrafting, GrammarEagleProposer  # noqa: E402

HOOKS = ("prepare_next_token_ids_padded", "propose", "_sample_draft_tokens")


@pytest.mark.parametrize("ours, theirs", [(GrammarDraftProposer, DraftModelProposer),
                                          (GrammarEagleProposer, EagleProposer)])
def test_the_mixin_composes_with_vllms_proposer(ours, theirs):
    mro = ours.__mro__
    assert issubclass(ours, SpecDecodeBaseProposer) and issubclass(ours, theirs)
    assert mro[1] is GrammarDrafting and mro[2] is theirs  # super() in the mixin reaches vLLM's class
    for name in HOOKS:
        assert hasattr(SpecDecodeBaseProposer, name), f"vLLM's base proposer has no {name} any more"
        assert getattr(ours, name) is getattr(GrammarDrafting, name), name  # ours resolves first
        # and vLLM's implementation is the one ours calls on
        assert getattr(super(GrammarDrafting, ours), name) is getattr(theirs, name)
    assert "__init__" in GrammarDrafting.__dict__
    assert inspect.signature(theirs.__init__).parameters.keys() >= {"vllm_config", "device", "runner"}


def test_vllms_hooks_have_the_signatures_we_override():
    ours = inspect.signature(GrammarDrafting.prepare_next_token_ids_padded)
    theirs = inspect.signature(SpecDecodeBaseProposer.prepare_next_token_ids_padded)
    assert list(ours.parameters) == list(theirs.parameters)
    ours = inspect.signature(GrammarDrafting._sample_draft_tokens)
    theirs = inspect.signature(SpecDecodeBaseProposer._sample_draft_tokens)
    assert list(ours.parameters) == list(theirs.parameters)
    theirs = list(inspect.signature(SpecDecodeBaseProposer.propose).parameters)
    assert theirs[:2] == ["self", "num_speculative_tokens"] and theirs[4] == "target_hidden_states"


def test_vllms_drafting_loop_calls_our_hooks():
    """vLLM's shared loop (``SpecDecodeBaseProposer.propose``) draws every position through
    ``_sample_draft_tokens``; neither subclass replaces ``propose`` or the hook; the runner hands the batch to
    ``prepare_next_token_ids_padded`` before ``propose``."""
    src = inspect.getsource(SpecDecodeBaseProposer.propose)
    assert src.count("self._sample_draft_tokens(") >= 2
    for cls in (DraftModelProposer, EagleProposer):
        for name in HOOKS:
            assert name not in cls.__dict__, (cls.__name__, name)
    from vllm.v1.worker import gpu_model_runner

    runner_src = inspect.getsource(gpu_model_runner)
    assert ".prepare_next_token_ids_padded(" in runner_src and "EagleProposer(self.vllm_config" in runner_src


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_the_runner_builds_eagles_proposer_for_hidden_state_methods(method):
    from types import SimpleNamespace

    from vllm.config.speculative import SpeculativeConfig

    assert SpeculativeConfig.use_eagle(SimpleNamespace(method=method))


def test_wiring_makes_the_runner_build_our_eagle_proposer_and_keeps_isinstance(monkeypatch):
    """``wiring.wire`` turns ``gpu_model_runner.EagleProposer`` into a name that builds ``GrammarEagleProposer`` (for
    eagle, eagle3 and mtp: gpu_model_runner.py builds them all by it) and that ``isinstance`` / ``issubclass``
    answer for as vLLM's class (vLLM's ``Step3p5MTPProposer`` subclasses it and the runner asserts that);
    idempotent; ``SPECGRAMMAR_VLLM_DRAFTS=0`` leaves vLLM's class."""
    from vllm.v1.spec_decode.step3p5 import Step3p5MTPProposer

    from specgrammar_vllm import wiring
    from specgrammar_vllm.draft_proposer import GrammarDraftProposer

    monkeypatch.delenv("SPECGRAMMAR_VLLM_DRAFTS", raising=False)

    def runner_module():
        mod = types.ModuleType("fake_gpu_model_runner")
        mod.DraftModelProposer, mod.EagleProposer = DraftModelProposer, EagleProposer
        mod.GPUModelRunner = type("GPUModelRunner", (), {"__init__": lambda self: None})
        return mod

    mod = runner_module()
    wiring.wire(mod)
    name = mod.EagleProposer
    wiring.wire(mod)  # idempotent
    assert mod.EagleProposer is name and mod.DraftModelProposer is GrammarDraftProposer and wiring.STATE["eagle"]
    assert name.grammar_class is GrammarEagleProposer and name.__wrapped__ is EagleProposer
    built = []
    monkeypatch.setattr(name, "grammar_class", lambda *a, **kw: built.append((a, kw)) or "ours")
    assert mod.EagleProposer("cfg", "cpu", "runner") == "ours" and built == [(("cfg", "cpu", "runner"), {})]
    for cls in (EagleProposer, GrammarEagleProposer, Step3p5MTPProposer):
        obj = object.__new__(cls)
        assert isinstance(obj, name) and isinstance(obj, name | DraftModelProposer) and issubclass(cls, name)
    assert not isinstance(object.__new__(DraftModelProposer), name) and not issubclass(DraftModelProposer, name)
    with pytest.raises(TypeError):
        wiring.eagle_name(DraftModelProposer)  # not the class ours extends: vLLM's stays (wire logs it)

    monkeypatch.setenv("SPECGRAMMAR_VLLM_DRAFTS", "0")
    plain = runner_module()
    wiring.wire(plain)
    assert plain.EagleProposer is EagleProposer


def test_the_launcher_takes_the_eagle_methods():
    """``--speculative-config`` with an EAGLE method gets what our proposer needs from the launcher (no async
    scheduling; ``uses_draft_model`` also sets ``VLLM_USE_V2_MODEL_RUNNER=0``), and ``speculative_config`` writes it."""
    from specgrammar_vllm import config, serve

    assert config.speculative_config("eagle", 3, "HEAD") == {"method": "eagle", "model": "HEAD",
                                                              "num_speculative_tokens": 3}
    assert config.speculative_config("eagle3", 2, "H")["method"] == "eagle3"
    with pytest.raises(ValueError):
        config.speculative_config("eagle", 3)
    for method in ("eagle", "eagle3", "mtp"):
        sc = json.dumps({"method": method, "model": "H", "num_speculative_tokens": 2})
        assert config.uses_draft_model(sc)
        assert serve.build_argv(["m", "--speculative-config", sc])[-1] == "--no-async-scheduling"
    assert not config.uses_draft_model({"method": "ngram", "num_speculative_tokens": 2})
