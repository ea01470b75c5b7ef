"""``specgrammar recipes build|inspect|merge|stats``: make, read, combine and measure recipe packs.

    specgrammar recipes build                         # one pack per structured workload -> recipes/<workload>.json
    specgrammar recipes build -w json_extraction -n 300 -k 4 --out my.json
    specgrammar recipes inspect recipes/json_extraction.json --top 20
    specgrammar recipes merge recipes/a.json recipes/b.json -o recipes/ab.json
    specgrammar recipes stats recipes/json_extraction.json -w json_extraction     # coverage on the eval split

``build`` and ``stats`` run the target model through the mlx-lm adapter's runner (default: the bundled tiny
target, ``specgrammar_plugins.models.tiny_path("target")``); ``build`` samples the workload's *train* split,
``stats`` measures on the *eval* split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import recipes as R


def _default_model() -> str:
    from .models import tiny_path

    return str(tiny_path("target"))


def model_digest(model: str | None) -> str | None:
    """First 16 hex digits of the sha256 of the model's weights (recorded in a pack's meta)."""
    import hashlib

    files = sorted(Path(model or _default_model()).glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def load_target(model: str | None):
    """(runner, TokenizerInfo) for a model folder, through the mlx-lm adapter's runner."""
    from .tokenizer import TokenizerInfo

    path = model or _default_model()
    if not Path(path).exists():
        raise SystemExit(f"model {path} not found (pass --model PATH)")
    try:
        from mlx_lm import load

        from .adapters.mlx_lm.runner import MLXRunner
    except ImportError as e:
        raise SystemExit(f"building and measuring packs runs the target through mlx-lm: {e}") from None
    model_obj, _ = load(path)
    runner = MLXRunner(model_obj)
    tok = TokenizerInfo.from_file(path, vocab_size=runner.vocab_size)
    return runner, tok


def _workloads(names):
    from .workloads import STRUCTURED

    names = names or list(STRUCTURED)
    for w in names:
        if w not in STRUCTURED:
            raise SystemExit(f"unknown structured workload {w!r}; expected one of {', '.join(STRUCTURED)}")
    return names


def cmd_build(a) -> int:
    from .workloads import examples

    runner, tok = load_target(a.model)
    names = _workloads(a.workload)
    extra = R.MissLog(a.misses).samples() if a.misses else []
    packs = []
    all_samples = []
    for w in names:
        exs = examples(w, "train", a.n)
        cache = Path(a.samples) / f"{w}.jsonl" if a.samples else None
        if cache is not None and cache.exists():
            samples = [R.Sample(tuple(d["prompt"]), tuple(d["output"]), w)
                       for d in map(json.loads, cache.read_text().splitlines())]
            print(f"{w}: {len(samples)} samples from {cache}", file=sys.stderr)
        else:
            print(f"{w}: sampling {len(exs)} train prompts x {a.k}", file=sys.stderr)
            samples = R.sample(runner, tok, exs, k=a.k, temperature=a.temperature, max_tokens=a.max_tokens,
                               engine=a.engine, seed=a.seed, progress=not a.quiet)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text("".join(json.dumps({"prompt": list(x.prompt), "output": list(x.output)}) + "\n"
                                         for x in samples))
        pack = R.build(samples, tok, min_count=a.min_count, agree=a.agree, max_recipes=a.max_recipes, progress=False,
                       extra=extra, meta={"workloads": [w], "split": "train", "prompts": len(exs), "k": a.k,
                                          "temperature": a.temperature, "model": Path(a.model or _default_model()).name,
                                          "model_sha256": model_digest(a.model)})
        packs.append(pack)
        all_samples.append(samples)
        if not a.merged_only:
            out = Path(a.out) if a.out and len(names) == 1 else Path(a.dir) / f"{w}.json"
            pack.save(out)
            print(f"{out}: {json.dumps(pack.stats())}")
    if len(packs) > 1 and (a.merged or a.merged_only):
        # one pack from every workload's samples (more faithful than merging the packs: a key two workloads
        # share is judged on all its occurrences)
        m = R.build([s for ss in all_samples for s in ss], tok, min_count=a.min_count, agree=a.agree,
                    max_recipes=a.max_recipes, extra=extra,
                    meta={"workloads": names, "split": "train", "prompts": a.n, "k": a.k, "temperature": a.temperature,
                          "model": Path(a.model or _default_model()).name, "model_sha256": model_digest(a.model)})
        out = Path(a.out) if a.out else Path(a.dir) / "structured.json"
        m.save(out)
        print(f"{out}: {json.dumps(m.stats())}")
    return 0


def _load_for_inspect(path, model):
    tok = None
    if model or Path(_default_model()).exists():
        from .tokenizer import TokenizerInfo

        try:
            tok = TokenizerInfo.from_file(model or _default_model())
        except Exception:  # inspecting needs no tokenizer: ids only
            tok = None
    pack = R.RecipePack.load(R.resolve(path))
    if tok is not None and tok.vocab_fingerprint == pack.fingerprint:
        pack.bind(tok)
    return pack


def cmd_inspect(a) -> int:
    pack = _load_for_inspect(a.pack, a.model)
    print(json.dumps({"file": pack.source, **pack.stats(), "meta": pack.meta}, indent=1))
    ranked = sorted(pack.recipes.values(), key=lambda r: (-r.count * len(r.run), r.sort_key()))
    for r in ranked[: a.top]:
        if pack.bound:
            key = pack._key_text(r)
            print(f"{r.kind:7s} x{r.count:<5d} {key[-40:]!r:>44} -> {pack._text(r.run)!r}")
        else:
            print(f"{r.kind:7s} x{r.count:<5d} {list(r.key)} -> {list(r.run)}")
    return 0


def cmd_merge(a) -> int:
    packs = [R.RecipePack.load(R.resolve(p)) for p in a.packs]
    m = packs[0]
    for p in packs[1:]:
        m = R.merge(m, p, agree=a.agree)
    if a.max_recipes:
        m.prune(a.max_recipes)
    pack = _load_for_inspect(a.packs[0], a.model)
    if pack.bound:
        m._token_bytes, m._classes = pack._token_bytes, pack._classes
    m.save(a.output)
    print(f"{a.output}: {json.dumps(m.stats())}")
    return 0


def cmd_stats(a) -> int:
    from .workloads import chat_prompt, examples

    runner, tok = load_target(a.model)
    pack = R.load_pack(a.pack, tok)
    names = _workloads(a.workload) if a.workload else pack.meta.get("workloads") or _workloads(None)
    rows = []
    for w in names:
        exs = examples(w, "eval", a.n)
        res = R.evaluate(runner, tok, exs, pack=pack, drafters=a.drafters.split(","), k=a.k, engine=a.engine,
                         max_tokens=a.max_tokens, check_greedy=a.check)
        res["workload"] = w
        rows.append(res)
        print(json.dumps(res))
    contexts = []  # every decoding position of a few eval answers
    for w in names:
        for ex in examples(w, "eval", 5):
            p = tok.encode(chat_prompt(ex.prompt))
            ref = tok.encode(ex.reference)
            contexts += [p + ref[:i] for i in range(len(ref) + 1)]
    print(json.dumps({"lookup": R.benchmark_lookup(pack, contexts), "pack": pack.stats()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar recipes", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="sample the target on train prompts and build packs")
    b.add_argument("-w", "--workload", action="append", help="structured workload (repeatable; default: all)")
    b.add_argument("-n", type=int, default=200, help="train prompts per workload (default 200)")
    b.add_argument("-k", type=int, default=4, help="samples per prompt (default 4)")
    b.add_argument("--temperature", type=float, default=0.5,
                   help="sampling temperature of the k verified samples (default 0.5: recipes for the model's mode)")
    b.add_argument("--max-tokens", type=int, default=96)
    b.add_argument("--model", help="target model folder (default: the bundled tiny target)")
    b.add_argument("--engine", help="grammar engine (default: the core's)")
    b.add_argument("--min-count", type=int, default=R.DEFAULTS["min_count"])
    b.add_argument("--agree", type=float, default=R.DEFAULTS["agree"])
    b.add_argument("--max-recipes", type=int, default=R.DEFAULTS["max_recipes"])
    b.add_argument("--misses", help="a miss log (JSON lines) to fold in")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--samples", help="folder caching the verified samples per workload (reused when present)")
    b.add_argument("--dir", default=str(R.SHIPPED_DIR), help="output folder (default: the shipped recipes/)")
    b.add_argument("-o", "--out", help="output file (one workload, or the merged pack)")
    b.add_argument("--merged", action="store_true", help="also write the merged pack (structured.json)")
    b.add_argument("--merged-only", action="store_true", help="write only the merged pack")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    b.set_defaults(fn=cmd_build)

    i = sub.add_parser("inspect", help="summary and top recipes of a pack")
    i.add_argument("pack")
    i.add_argument("--top", type=int, default=20)
    i.add_argument("--model", help="model folder whose tokenizer decodes the recipes")
    i.set_defaults(fn=cmd_inspect)

    m = sub.add_parser("merge", help="merge packs for one tokenizer")
    m.add_argument("packs", nargs="+")
    m.add_argument("-o", "--output", required=True)
    m.add_argument("--agree", type=float, default=R.DEFAULTS["agree"])
    m.add_argument("--max-recipes", type=int, default=None)
    m.add_argument("--model")
    m.set_defaults(fn=cmd_merge)

    s = sub.add_parser("stats", help="coverage, acceptance and tokens per target pass on the eval split")
    s.add_argument("pack")
    s.add_argument("-w", "--workload", action="append")
    s.add_argument("-n", type=int, default=50, help="eval prompts per workload (default 50)")
    s.add_argument("-k", type=int, default=8, help="draft tokens per round (default 8)")
    s.add_argument("--drafters", default="forced,recipe", help="drafter chain (default forced,recipe: no draft model)")
    s.add_argument("--max-tokens", type=int, default=96)
    s.add_argument("--model")
    s.add_argument("--engine")
    s.add_argument("--check", action="store_true", help="also check greedy equality with plain decoding")
    s.set_defaults(fn=cmd_stats)

    a = ap.parse_args(argv)
    try:
        return int(a.fn(a) or 0)
    except R.RecipePackError as e:
        print(f"specgrammar recipes: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
