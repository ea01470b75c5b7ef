"""The built-in cost models for cost-aware laws: ``auto``, ``regular`` and ``structural``."""

from __future__ import annotations

from ..cost import RegularCost, StructuralCost, cost_model_for
from ..hookspecs import hookimpl


def _regular_cost(compiled, token_cost=None):
    return RegularCost(compiled.spec, compiled.tokenizer, token_cost)


def _structural_cost(compiled, token_cost=None, prop_cost=5.0):
    return StructuralCost(compiled.tokenizer, compiled.spec, prop_cost=prop_cost, token_cost=token_cost)


def _auto_cost(compiled, token_cost=None):
    return cost_model_for(compiled, token_cost)


@hookimpl
def register_cost_models(register):
    register("auto", _auto_cost)
    register("regular", _regular_cost)
    register("structural", _structural_cost)
