"""``specgrammar models``: the models a host can load by name, and the one-time conversion of the real model.

    specgrammar models list                      # each name, its GGUF and folder, converted or not
    specgrammar models convert smollm2-135m      # GGUF -> float32 transformers folder (mlx-lm, vLLM), once
    specgrammar models path smollm2-135m --host mlx_lm   # what that host loads for the name (converts if needed)

Names work wherever a host adapter takes a model: ``SpecLlama("smollm2-135m")``,
``specgrammar_mlx_lm.load("smollm2-135m")``, ``python -m specgrammar_vllm.serve smollm2-135m``.  The converted
folders live in ``$SPECGRAMMAR_CACHE`` (default ``~/.cache/specgrammar``), never in the repository.
"""

from __future__ import annotations

import argparse
import sys
import time


def _list(out=print) -> int:
    from .models.real import SMOLLM2, cache_dir, model_table

    rows = model_table()
    for r in rows:
        out(f"{r['name']}: {r['what']}")
        if r.get("missing"):
            out(f"  not available: {r['missing']}")
        if r.get("gguf"):
            out(f"  gguf   (llama_cpp):                {r['gguf']}")
        if r.get("folder"):
            if r["name"] == SMOLLM2:
                state = "converted" if r.get("folder_ready") else f"not converted yet: specgrammar models convert {SMOLLM2}"
            else:
                state = "present" if r.get("folder_ready") else "absent"
            out(f"  folder (mlx_lm, vllm, transformers): {r['folder']}   [{state}]")
    out(f"\ncache: {cache_dir()} ($SPECGRAMMAR_CACHE)")
    return 0


def _convert(name: str, out=print) -> int:
    from .models.real import SMOLLM2, resolve, smollm2_converted

    before = smollm2_converted()
    t0 = time.perf_counter()
    path = resolve(name, "transformers", progress=True)
    took = time.perf_counter() - t0
    if name == SMOLLM2:
        out(f"{name}: {path}  ({'already converted' if before else f'converted in {took:.1f}s'})")
    else:
        out(f"{name}: {path}  (a folder already; nothing to convert)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .models.real import HOST_FORMATS, MODELS, ModelNotInstalled, UnknownModelError

    ap = argparse.ArgumentParser(prog="specgrammar models", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="each model name, where it is, converted or not")
    c = sub.add_parser("convert", help="make a name's transformers folder (mlx-lm, vLLM) now; prints it")
    c.add_argument("name", choices=list(MODELS))
    p = sub.add_parser("path", help="what a host loads for a name or path (converts if needed)")
    p.add_argument("name")
    p.add_argument("--host", default="llama_cpp", help=f"one of {', '.join(HOST_FORMATS)} (default llama_cpp)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            return _list()
        if args.cmd == "convert":
            return _convert(args.name)
        from .models.real import resolve

        print(resolve(args.name, args.host))
        return 0
    except (ModelNotInstalled, UnknownModelError, ValueError) as e:
        print(f"specgrammar models: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
