"""The ``specgrammar`` command: demo, bench, check, recipes, patch, soak, models.

Each subcommand lives in its own module and is imported only when run, so ``specgrammar --help`` is instant and
needs no host stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    # name: (module, help)
    "demo": ("specgrammar_plugins.demo", "run grammar-aware speculative decoding on the real model (--tiny: the bundled pair)"),
    "bench": ("specgrammar_plugins.bench", "benchmarks: masks, strategies, recipes, scale"),
    "check": ("specgrammar_plugins.check", "compile a schema/grammar/regex with each engine and report"),
    "recipes": ("specgrammar_plugins.recipes_cli", "build, inspect, merge and measure recipe packs"),
    "patch": ("specgrammar_mlx_lm.patch", "apply (or --revert) the host patch: patch mlx-lm"),
    "soak": ("specgrammar_plugins.soak", "mixed-request soak of a server: validity, 400s, latency, RSS"),
    "models": ("specgrammar_plugins.models_cli", "models by name: list them, convert the real model once"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="specgrammar", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    ns = parser.parse_args(argv[:1])
    module, _ = COMMANDS[ns.command]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            print(f"specgrammar {ns.command}: not available in this build ({module} is missing)", file=sys.stderr)
            return 2
        raise
    return int(mod.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
