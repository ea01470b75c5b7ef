"""The built-in grammar engines (xgrammar, llguidance, outlines-core, the interegular DFA), each imported on first
use, so that ``import specgrammar_plugins`` needs none of them."""

from __future__ import annotations

import importlib

from ..errors import ConstraintError
from ..hookspecs import hookimpl


class LazyEngine:
    """Imports an engine's module on first use, so ``import specgrammar_plugins`` needs none of them."""

    def __init__(self, name: str, module: str, cls: str, package: str):
        self.name, self._module, self._cls, self._package = name, module, cls, package
        self._engine = None

    def load(self):
        if self._engine is None:
            try:
                mod = importlib.import_module(self._module)
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
    register("xgrammar", LazyEngine("xgrammar", "specgrammar_plugins.engines.xgrammar_engine", "XGrammarEngine", "xgrammar"))
    register("llguidance", LazyEngine("llguidance", "specgrammar_plugins.engines.llguidance_engine", "LLGuidanceEngine", "llguidance"))
    register("outlines_core", LazyEngine("outlines_core", "specgrammar_plugins.engines.outlines_core_engine", "OutlinesCoreEngine",
                                         "outlines-core"))
    register("dfa", LazyEngine("dfa", "specgrammar_plugins.engines.dfa", "DFAEngine", "interegular"))


