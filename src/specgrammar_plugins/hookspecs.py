"""pluggy hook specifications for the ``specgrammar`` project (entry-point group ``specgrammar``).

A plugin is any module or object with functions named like the hooks below, decorated with ``hookimpl``::

    from specgrammar_plugins import hookimpl

    @hookimpl
    def register_engines(register):
        register("my-engine", MyEngine())

and exposed in its ``pyproject.toml``::

    [project.entry-points.specgrammar]
    my_plugin = "my_package.my_module"

The built-in engines, drafters, request parsers and cost models are registered by the modules of
``specgrammar_plugins.default_plugins`` through these very hooks (no special path).  Plugins are loaded once, lazily, on first use; set
``SPECGRAMMAR_PLUGINS`` to a comma-separated allowlist of entry-point names (empty string = none) to restrict them.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("specgrammar")
hookimpl = pluggy.HookimplMarker("specgrammar")


@hookspec
def register_engines(register):
    """Register grammar engines: call ``register(name, engine)`` where ``engine.compile(spec, tokenizer, options)``
    returns a ``CompiledConstraint`` (see ``constraint.Engine``).  Called once, when an engine is first asked for."""


@hookspec
def register_drafters(register):
    """Register drafter factories: ``register(name, factory)``; ``factory(ctx) -> Drafter | None`` gets one
    request's ``drafters.DraftContext`` (tokenizer, sampling params, rng, the draft model's runner, the target's
    width, the recipe pack and the request's extra ``specgrammar`` options) and returns its drafter, or None when it
    has nothing to work with (no draft model, no pack): it is then left out of the chain (see ``block.Drafter`` for
    the protocol).  Names are what a request's ``specgrammar.drafters`` list refers to.  Called once."""


@hookspec
def register_request_parsers(register):
    """Register request-field parsers: ``register(name, parser)``; ``parser(body: dict) -> ConstraintSpec | None``
    reads an OpenAPI-style request body (``response_format``, ``regex``, ...) and returns the constraint it asks for,
    or None when its fields are absent; it raises ``ConstraintError`` on malformed fields.  Parsers are tried in
    registration order; the first non-None answer wins.  Called once."""


@hookspec
def register_cost_models(register):
    """Register cost models for cost-aware laws: ``register(name, factory)``; ``factory(compiled, **options) ->
    CostModel`` (see ``cost.CostModel``: ``delta(generated)`` and ``cost_to_go(generated)``).  A request picks one
    with ``specgrammar.cost``; the built-ins are ``auto`` (exact for regular constraints, an estimate otherwise),
    ``regular`` and ``structural``.  Called once."""
