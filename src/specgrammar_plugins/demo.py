"""``specgrammar demo``: grammar-aware speculative decoding on the bundled tiny models, with mlx-lm.

    specgrammar demo                      # a few eval prompts of every structured workload: outputs + stats
    specgrammar demo --temperature 0.7 --n 3 --k 6 --workloads json_extraction sql
    specgrammar demo --serve [--port 8080]   # start mlx_lm.server --plugin specgrammar on the tiny pair instead

Offline: the models, tokenizer and workloads ship with the package.  Each output is checked against its
constraint (JSON Schema / regex / grammar) and printed with the loop's counters: target passes per token
(1.00 without speculation), draft acceptance and tokens the grammar forced.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def _models_present() -> bool:
    from .models import tiny_path

    return all((tiny_path(w) / "config.json").exists() for w in ("target", "draft"))


def _need_mlx() -> str | None:
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as e:
        return f"the demo runs on mlx-lm: pip install 'specgrammar-plugins[mlx]' ({e})"
    return None


def run_demo(n: int, k: int, temperature: float, max_tokens: int, workloads, engine: str | None, seed: int,
             out=print, recipes: bool = True) -> dict:
    from mlx_lm import load

    from . import workloads as W
    from specgrammar_mlx_lm.generate import stream_generate
    from .models import tiny_path

    t_load = time.perf_counter()
    model, tok = load(str(tiny_path("target")))
    draft, _ = load(str(tiny_path("draft")))
    out(f"tiny target + draft loaded in {time.perf_counter() - t_load:.1f}s; k={k}, temperature={temperature}, "
        f"engine={engine or 'default'}\n")
    total = {"tokens": 0, "passes": 0, "drafted": 0, "accepted": 0, "forced": 0, "valid": 0, "outputs": 0}
    t0 = time.perf_counter()
    from .recipes import shipped_pack

    for w in workloads:
        spec = W.constraint(w)
        pack = shipped_pack(w) if recipes else None
        out(f"== {w} ({spec.kind if spec else 'no constraint'}{', recipe pack ' + w if pack else ''})")
        for i, ex in enumerate(W.examples(w, "eval", n)):
            ids = list(tok.encode(W.chat_prompt(ex.prompt), add_special_tokens=False))
            text, stats = "", None
            for r in stream_generate(model, tok, ids, max_tokens=max_tokens, draft_model=draft, num_draft_tokens=k,
                                     constraint=spec, engine=engine, temperature=temperature, seed=seed + i,
                                     recipe=pack):
                text += r.text
                if r.stats is not None:
                    stats = r.stats
            ok = W.is_valid(w, text) and stats.finish_reason == "stop"
            total["valid"] += ok
            total["outputs"] += 1
            total["tokens"] += stats.emitted
            total["passes"] += stats.target_passes
            total["drafted"] += stats.drafted
            total["accepted"] += stats.accepted
            total["forced"] += stats.forced_tokens
            out(f"  {ex.prompt}")
            out(f"  -> {text}   [{'valid' if ok else 'INVALID'}]")
            out(f"     {stats.emitted} tokens, {stats.passes_per_token:.2f} target passes/token, acceptance "
                f"{stats.acceptance:.0%}, forced {stats.forced_tokens}")
        out("")
    wall = time.perf_counter() - t0
    ppt = total["passes"] / max(total["tokens"], 1)
    acc = total["accepted"] / max(total["drafted"], 1)
    out(f"{total['valid']}/{total['outputs']} outputs valid; {total['tokens']} tokens in {total['passes']} target passes "
        f"= {ppt:.2f} passes/token (1.00 without speculation, {1 / max(ppt, 1e-9):.2f} tokens/pass); acceptance "
        f"{acc:.0%}; {total['forced']} forced tokens; {wall:.1f}s")
    total.update(passes_per_token=ppt, acceptance=acc, seconds=wall)
    return total


def _patched_root() -> tuple[Path, str]:
    """Where a patched mlx_lm lives: the installed one if patched, else a patched copy in a temp folder."""
    from specgrammar_mlx_lm.patch import patched_root

    root, installed = patched_root()
    if installed:
        return root, "installed mlx-lm (patched)"
    return root, f"a patched copy of mlx-lm in {root} (run `specgrammar patch mlx-lm` to patch the installed one)"


def serve(host: str, port: int, k: int, engine: str | None) -> int:
    from .models import tiny_path

    root, where = _patched_root()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--host", host, "--port", str(port), "--model",
           str(tiny_path("target")), "--draft-model", str(tiny_path("draft")), "--num-draft-tokens", str(k),
           "--plugin", "specgrammar"]
    if engine:
        cmd += ["--specgrammar-engine", engine]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(root), os.environ.get("PYTHONPATH")) if x))
    print(f"serving the tiny pair with {where}\n  {' '.join(cmd)}\n")
    print("try:\n  curl -s http://%s:%d/v1/chat/completions -H 'Content-Type: application/json' -d '"
          '{"messages": [{"role": "user", "content": "Find the order ID: Package QZT-0412 was shipped."}], '
          '"max_tokens": 32, "response_format": {"type": "regex", "regex": "[A-Z]{3}-[0-9]{4}"}}'
          "'\n" % (host, port), flush=True)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(20)
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .workloads import STRUCTURED, WORKLOADS

    ap = argparse.ArgumentParser(prog="specgrammar demo", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--n", type=int, default=2, help="eval prompts per workload (default 2)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round (default 4)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", default=None, help="grammar engine (xgrammar, llguidance, outlines_core, dfa)")
    ap.add_argument("--workloads", nargs="+", default=list(STRUCTURED), choices=list(WORKLOADS))
    ap.add_argument("--no-recipes", action="store_true", help="draft without the shipped recipe packs")
    ap.add_argument("--serve", action="store_true", help="start mlx_lm.server --plugin specgrammar instead")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args(argv)
    why = _need_mlx()
    if why:
        print(f"specgrammar demo: {why}", file=sys.stderr)
        return 2
    if not _models_present():
        print("specgrammar demo: the bundled tiny models are missing (build them: python scripts/build_models.py)",
              file=sys.stderr)
        return 2
    from specgrammar_mlx_lm.blas import reexec_with_openblas

    if not args.serve:
        reexec_with_openblas("specgrammar_plugins.demo", argv)
        run_demo(args.n, args.k, args.temperature, args.max_tokens, args.workloads, args.engine, args.seed,
                 recipes=not args.no_recipes)
        return 0
    return serve(args.host, args.port, args.k, args.engine)


if __name__ == "__main__":
    sys.exit(main())
