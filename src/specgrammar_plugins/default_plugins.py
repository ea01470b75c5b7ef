"""The built-in engines, drafters and request parsers, registered through the same hooks third parties use."""

from __future__ import annotations

import importlib

from .errors import ConstraintError
from .hookspecs import hookimpl


class LazyEngine:
    """Imports an engine's module on first use, so ``import specgrammar_plugins`` needs none of them."""

    def __init__(self, name: str, module: str, cls: str, package: str):
        self.name, self._module, self._cls, self._package = name, module, cls, package
        self._engine = None

    def load(self):
        if self._engine is None:
            try:
                mod = importlib.import_module(self._module, __package__)
            except ImportError as e:
                raise ConstraintError(f"engine {self.name!r} needs the {self._package!r} package ({e})",
                                      engine=self.name) from None
            self._engine = getattr(mod, self._cls)()
        return self._engine

    def compile(self, spec, tokenizer, options):
        return self.load().compile(spec, tokenizer, options)

    def __getattr__(self, attr):  # engine-specific extras (e.g. supported keyword lists)
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self.load(), attr)


@hookimpl
def register_engines(register):
    register("xgrammar", LazyEngine("xgrammar", ".engines.xgrammar_engine", "XGrammarEngine", "xgrammar"))
    register("llguidance", LazyEngine("llguidance", ".engines.llguidance_engine", "LLGuidanceEngine", "llguidance"))
    register("outlines_core", LazyEngine("outlines_core", ".engines.outlines_core_engine", "OutlinesCoreEngine",
                                         "outlines-core"))
    register("dfa", LazyEngine("dfa", ".engines.dfa", "DFAEngine", "interegular"))


def _forced(ctx):
    from .drafters import ForcedDrafter

    return ForcedDrafter(ctx.tokenizer.encode if ctx.tokenizer is not None else None)


def _model(ctx):
    from .drafters import ModelDrafter

    if ctx.draft_runner is None:
        return None
    return ModelDrafter(ctx.draft_runner, ctx.params, ctx.rng, blind=ctx.blind, target_vocab_size=ctx.target_vocab_size)


def _recipe(ctx):
    """A ``RecipeDrafter`` over ``ctx.recipe`` (a ``RecipePack``, a pack file, or a shipped pack's name; also
    ``ctx.options["recipe"]``); no pack, no drafter.  The pack must be for ``ctx.tokenizer``
    (fingerprint-checked).  ``ctx.options``: ``recipe_misslog`` (a ``MissLog`` or a path),
    ``recipe_unconstrained`` (draft without a grammar too)."""
    from .drafters import RecipeDrafter
    from .recipes import MissLog, load_pack

    pack = ctx.recipe if ctx.recipe is not None else ctx.options.get("recipe")
    if pack is None:
        return None
    tok = ctx.tokenizer if hasattr(ctx.tokenizer, "fingerprint") else None
    pack = load_pack(pack, tok)
    if tok is not None and tok.fingerprint != pack.fingerprint:
        pack.bind(tok)  # raises RecipePackError naming the pack and both tokenizers
    log = ctx.options.get("recipe_misslog")
    if log is not None and not isinstance(log, MissLog):
        log = MissLog(log)
    return RecipeDrafter(pack, unconstrained=bool(ctx.options.get("recipe_unconstrained", False)), misslog=log)


def _suffix(ctx):
    """A ``SuffixDrafter`` over the server's online suffix index (``ctx.options["suffix_index"]``, else the
    process-wide one for this tokenizer)."""
    from .drafters import SuffixDrafter
    from .recipes import server_suffix_index

    index = ctx.options.get("suffix_index")
    if index is None:
        index = server_suffix_index(getattr(ctx.tokenizer, "fingerprint", None) or "default")
    return SuffixDrafter(index)


@hookimpl
def register_drafters(register):
    register("forced", _forced)
    register("recipe", _recipe)
    register("suffix", _suffix)
    register("model", _model)


@hookimpl
def register_request_parsers(register):
    from .requests import parse_openai

    register("openai", parse_openai)


def _regular_cost(compiled, token_cost=None):
    from .cost import RegularCost

    return RegularCost(compiled.spec, compiled.tokenizer, token_cost)


def _structural_cost(compiled, token_cost=None, prop_cost=5.0):
    from .cost import StructuralCost

    return StructuralCost(compiled.tokenizer, compiled.spec, prop_cost=prop_cost, token_cost=token_cost)


def _auto_cost(compiled, token_cost=None):
    from .cost import cost_model_for

    return cost_model_for(compiled, token_cost)


@hookimpl
def register_cost_models(register):
    register("auto", _auto_cost)
    register("regular", _regular_cost)
    register("structural", _structural_cost)
