"""The plugin manager: built-ins and entry-point plugins, loaded once, lazily, through the same hooks.

The built-ins (``default_plugins/``) are loaded by module name, like entry points, so this registry imports none of
the things they register and sits near the bottom of the layers (``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any, Callable

import pluggy

from . import hookspecs
from .errors import ConstraintError

BUILTINS = (
    "specgrammar_plugins.default_plugins.engines",
    "specgrammar_plugins.default_plugins.drafters",
    "specgrammar_plugins.default_plugins.requests",
    "specgrammar_plugins.default_plugins.cost",
)

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_registries: dict[str, dict[str, Any]] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager("specgrammar")
            pm.add_hookspecs(hookspecs)
            for name in BUILTINS:
                pm.register(importlib.import_module(name), name=name)
            allow = os.environ.get("SPECGRAMMAR_PLUGINS")
            if allow is None:
                pm.load_setuptools_entrypoints("specgrammar")
            elif allow.strip():
                from importlib.metadata import entry_points

                names = {n.strip() for n in allow.split(",") if n.strip()}
                for ep in entry_points(group="specgrammar"):
                    if ep.name in names and pm.get_plugin(ep.name) is None:
                        pm.register(ep.load(), name=ep.name)
            _pm = pm
        return _pm


def _registry(hook: str) -> dict[str, Any]:
    with _lock:
        reg = _registries.get(hook)
        if reg is None:
            reg = {}

            def register(name: str, obj: Any) -> None:
                reg[name] = obj

            getattr(get_plugin_manager().hook, hook)(register=register)
            _registries[hook] = reg
        return reg


def reset() -> None:
    """Forget loaded plugins (tests)."""
    global _pm
    with _lock:
        _pm = None
        _registries.clear()


def engines() -> dict[str, Any]:
    return dict(_registry("register_engines"))


def get_engine(name: str):
    reg = _registry("register_engines")
    if name not in reg:
        raise ConstraintError(f"unknown engine {name!r}; available: {', '.join(sorted(reg))}", engine=name)
    return reg[name]


def drafters() -> dict[str, Callable[..., Any]]:
    return dict(_registry("register_drafters"))


def request_parsers() -> dict[str, Callable[[dict], Any]]:
    return dict(_registry("register_request_parsers"))


def cost_models() -> dict[str, Callable[..., Any]]:
    return dict(_registry("register_cost_models"))
