"""``specgrammar recipes build|inspect|merge|stats``: make, read, combine and measure recipe packs.

    specgrammar recipes build                         # one pack per structured workload -> recipes/<workload>.json
    specgrammar recipes build -w json_extraction -n 300 -k 4 --out my.json
    specgrammar recipes inspect recipes/json_extraction.json --top 20
    specgrammar recipes merge recipes/a.json recipes/b.json -o recipes/ab.json
    specgrammar recipes stats recipes/json_extraction.json -w json_extraction     # coverage on the eval split

Any model, any requests (a GGUF through llama-cpp-python, with the chat template it serves with; an HF folder
through mlx-lm, with its tokenizer's chat template; ``smollm2-135m`` names the registry's SmolLM2 GGUF):

    specgrammar recipes prompts -o train.jsonl                  # seeded training requests, never the eval prompts
    specgrammar recipes build --requests train.jsonl --model smollm2-135m --name smollm2-135m --auto
    specgrammar recipes build --served /var/specgrammar/served --model smollm2-135m -o served.json

``--requests``: JSON Lines, each line ``messages`` (or ``prompt``) plus the constraint in the request-field
spelling (``response_format``, ``regex``, ``grammar``, ``json_schema``, ``choice``, ``structured_outputs``); the
model answers each under its constraint through the core loop (exact: drafting only saves passes) and the pack
is learnt from those verified outputs (recipes, plus the model's layout table: ``recipes.layout``).
``--served``: the folder a server appended its verified outputs to (``SPECGRAMMAR_SERVED_DIR``,
``recipes.served``).

``build`` and ``stats`` run the target model through the mlx-lm adapter's runner (default: the bundled tiny
target, ``specgrammar_plugins.models.tiny_path("target")``); ``build`` samples the workload's *train* split,
``stats`` measures on the *eval* split.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from . import recipes as R
from .compiler import compile_constraint
from .distributions import SamplingParams
from .requests import SpecOptions
from .speculation import make_loop


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

        from specgrammar_mlx_lm.runner import MLXRunner
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


# ---------------------------------------------------------------------------------------------- sampling
def sample(runner, tokenizer, examples, *, k: int = 4, temperature: float = 1.0, max_tokens: int = 96,
           engine: str | None = None, seed: int = 0, prompt_fn=None, progress: bool = True, self_draft: int = 25,
           build_kw: dict | None = None) -> list[R.Sample]:
    """Verified labels: ``k`` outputs of the target per example, by constrained sampling through the core loop.

    With ``self_draft > 0`` the loop drafts from a pack built from the samples so far (rebuilt every
    ``self_draft``, 2 x, 4 x ... prompts, ``build_kw`` as for ``build``): the loop is lossless, so the samples have exactly the law
    of plain constrained sampling (``SpeculativeLoop(drafter=None)``); drafting only saves target passes.

    ``examples``: items with ``prompt`` (user text) and ``constraint`` (ConstraintSpec or None), e.g.
    ``workloads.examples(w, "train")``; ``prompt_fn`` maps the user text to the model's prompt text (default:
    ``workloads.chat_prompt``)."""
    if prompt_fn is None:
        from .workloads import chat_prompt as prompt_fn
    if tokenizer.encode is None:
        raise ValueError("the tokenizer has no encode function")
    params = SamplingParams(temperature=temperature)
    rng = np.random.default_rng(seed)
    out: list[R.Sample] = []
    it = tqdm(examples, desc="sampling", unit="prompt", disable=not progress)
    pack = None
    next_build = self_draft
    for n_ex, ex in enumerate(it):
        if self_draft and n_ex == next_build:
            pack = R.build(out, tokenizer, **(build_kw or {}))
            next_build *= 2
        spec = getattr(ex, "constraint", None)
        c = None if spec is None else compile_constraint(spec, tokenizer, engine=engine)  # compiled once: cached
        prompt = tuple(tokenizer.encode(prompt_fn(ex.prompt)))
        options = SpecOptions(k=16, drafters=("forced", "recipe"), recipe=pack) if pack is not None else SpecOptions(k=0)
        for _ in range(k):
            loop = make_loop(runner, prompt, options, constraint=c, tokenizer=tokenizer, params=params,
                             max_tokens=max_tokens, rng=rng)
            out.append(R.Sample(prompt, tuple(loop.generate()), getattr(ex, "workload", None)))
    return out



# ---------------------------------------------------------------------------------------------- measuring
def evaluate(runner, tokenizer, examples, *, pack=None, drafters: Sequence[str] = ("forced", "recipe"), k: int = 8,
             temperature: float = 0.0, max_tokens: int = 96, engine: str | None = None, seed: int = 0,
             prompt_fn=None, check_greedy: bool = False, suffix_index=None) -> dict:
    """Run ``examples`` through the core loop with the named drafter chain and report: coverage (share of emitted
    tokens that came from recipes), acceptance, tokens per target pass, and (``check_greedy``) whether every output
    equals plain constrained decoding's.  ``drafters`` may name "suffix" (uses ``suffix_index``, which the loop
    teaches each finished request)."""
    from .loop import Stats

    if prompt_fn is None:
        from .workloads import chat_prompt as prompt_fn
    params = SamplingParams(temperature=temperature)
    rng = np.random.default_rng(seed)
    tot = Stats()
    same = 0
    wall = 0.0
    for ex in examples:
        spec = getattr(ex, "constraint", None)
        c = None if spec is None else compile_constraint(spec, tokenizer, engine=engine)  # compiled once: cached
        prompt = tokenizer.encode(prompt_fn(ex.prompt))
        opts = {"suffix_index": suffix_index} if suffix_index is not None else {}
        options = SpecOptions(k=k if drafters else 0, drafters=tuple(drafters), recipe=pack, extra=opts)
        loop = make_loop(runner, prompt, options, constraint=c, tokenizer=tokenizer, params=params,
                         max_tokens=max_tokens, rng=rng)
        out = loop.generate()
        st = loop.stats
        wall += st.wall_s
        tot.emitted += st.emitted
        tot.target_passes += st.target_passes
        tot.drafted += st.drafted
        tot.accepted += st.accepted
        for src, n in st.accepted_by_source.items():
            tot.accepted_by_source[src] = tot.accepted_by_source.get(src, 0) + n
        for src, n in st.drafted_by_source.items():
            tot.drafted_by_source[src] = tot.drafted_by_source.get(src, 0) + n
        if check_greedy:
            ref = make_loop(runner, prompt, SpecOptions(k=0), constraint=c, tokenizer=tokenizer, params=params,
                            max_tokens=max_tokens, rng=rng).generate()
            same += ref == out
    rec = tot.accepted_by_source.get("recipe", 0) + tot.accepted_by_source.get("suffix", 0)
    res = {
        "requests": len(examples), "emitted": tot.emitted, "target_passes": tot.target_passes,
        "tokens_per_pass": tot.tokens_per_pass, "acceptance": tot.acceptance,
        "coverage": rec / tot.emitted if tot.emitted else 0.0,
        "forced_share": tot.accepted_by_source.get("forced", 0) / tot.emitted if tot.emitted else 0.0,
        "drafted_by_source": dict(tot.drafted_by_source), "accepted_by_source": dict(tot.accepted_by_source),
        "wall_s": wall,
    }
    if check_greedy:
        res["greedy_equal"] = same
    return res


def benchmark_lookup(pack, contexts: Sequence[Sequence[int]], repeat: int = 5) -> dict:
    """Median/p90 wall time of one ``pack.lookup`` call over ``contexts`` (each timed in a batch of calls)."""
    if not contexts:
        return {"calls": 0}
    per_call = []
    batch = 200
    for ctx in contexts:
        ctx = list(ctx)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter_ns()
            for _ in range(batch):
                pack.lookup(ctx)
            best = min(best, (time.perf_counter_ns() - t0) / batch)
        per_call.append(best / 1e3)
    per_call.sort()
    return {"calls": len(per_call), "median_us": statistics.median(per_call),
            "p90_us": per_call[int(0.9 * (len(per_call) - 1))], "max_us": per_call[-1]}


OFFLINE_PREPARE_S = 600.0


def offline_deadlines() -> None:
    """An offline build answers with the model's own law whatever the machine's load: the preparation deadline of
    each request (``bounds.BOUNDS.prepare_timeout_s``, 5 s of CPU for a server) becomes ``OFFLINE_PREPARE_S``
    unless ``SPECGRAMMAR_PREPARE_TIMEOUT_S`` names one.  Under a server's deadline, three shards on two loaded
    cores ran the sql grammar's exact budget out of time, the certified bound shaped the answers, and the pack
    learnt them (recipes/smollm2-135m.sql.json before 2026-11-27: ``' FROM' -> ' '``, ``urn_users_by_...``)."""
    from .bounds import BOUNDS

    if "SPECGRAMMAR_PREPARE_TIMEOUT_S" not in os.environ:
        BOUNDS.prepare_timeout_s = max(BOUNDS.prepare_timeout_s, OFFLINE_PREPARE_S)


def cmd_build(a) -> int:
    offline_deadlines()
    if a.requests or a.served:
        return cmd_build_requests(a)
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
            samples = sample(runner, tok, exs, k=a.k, temperature=a.temperature, max_tokens=a.max_tokens,
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


# ---------------------------------------------------------------------------------------------- any model, any requests
def read_requests(path) -> list[dict]:
    """A JSON Lines file of requests: each line an object with ``messages`` (a list of chat turns) or ``prompt``
    (text), plus at most one constraint in the request-field spelling.  Raises ``SystemExit`` naming the line."""
    from .requests import parse_request

    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except ValueError as e:
            raise SystemExit(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(body, dict) or not (isinstance(body.get("messages"), list) or isinstance(body.get("prompt"), str)):
            raise SystemExit(f"{path}:{n}: a request needs 'messages' (a list) or 'prompt' (a string)")
        fields = {k: v for k, v in body.items() if k not in ("messages", "prompt", "workload")}
        try:
            spec, _ = parse_request(fields)
        except ValueError as e:
            raise SystemExit(f"{path}:{n}: {e}") from None
        out.append({"messages": body.get("messages"), "prompt": body.get("prompt"), "spec": spec,
                    "workload": body.get("workload")})
    return out


def model_path(model: str) -> str:
    """A model argument: ``smollm2-135m`` (the registry's GGUF), a GGUF file or an HF folder."""
    from .models.real import SMOLLM2, smollm2_gguf

    if model == SMOLLM2:
        return str(smollm2_gguf())
    if not Path(model).exists():
        raise SystemExit(f"model {model} not found (a GGUF file, an HF folder, or {SMOLLM2})")
    return model


class GGUFSampler:
    """A GGUF through ``SpecLlama``: each request answered as llama-cpp-python serves it (its chat template), the
    prompt and output token ids recorded from the host's own ``generate`` call."""

    def __init__(self, path: str, *, threads: int = 1, n_ctx: int = 2048, k: int = 4):
        from specgrammar_llama_cpp import SpecLlama, tokenizer_info

        self.llm = SpecLlama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0,
                             k=k, drafters=("forced", "recipe", "layout", "prompt", "suffix"))
        self.tokenizer = tokenizer_info(self.llm)
        self.name = Path(path).name
        self._rec: list = []
        inner = self.llm.generate

        def generate(tokens, *a, **kw):
            self._rec = [list(tokens), []]
            for t in inner(tokens, *a, **kw):
                self._rec[1].append(int(t))
                yield t

        self.llm.generate = generate

    def __call__(self, req: dict, *, temperature: float, max_tokens: int, seed: int, pack=None):
        llm = self.llm
        llm.recipe = pack
        kw = dict(max_tokens=max_tokens, temperature=temperature, seed=seed)
        if req["spec"] is not None:
            kw["constraint"] = req["spec"]
        if req["messages"] is not None:
            llm.create_chat_completion(req["messages"], **kw)
        else:
            llm.create_completion(req["prompt"], **kw)
        st = llm.last_stats
        prompt, out = self._rec
        complete = st is not None and st.finish_reason == "stop"
        return R.Sample(tuple(prompt), tuple(out), req.get("workload")), complete


class FolderSampler:
    """An HF folder through mlx-lm's runner and the core loop, the prompt made by its tokenizer's chat template."""

    def __init__(self, path: str):
        self.runner, self.tokenizer = load_target(path)
        self.name = Path(path).name
        try:
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - a folder without a usable tokenizer config
            raise SystemExit(f"{path}: cannot load its tokenizer for the chat template ({e})") from None

    def __call__(self, req: dict, *, temperature: float, max_tokens: int, seed: int, pack=None):
        text = req["prompt"] if req["messages"] is None else self.hf.apply_chat_template(
            req["messages"], tokenize=False, add_generation_prompt=True)
        prompt = self.tokenizer.encode(text)
        c = None if req["spec"] is None else compile_constraint(req["spec"], self.tokenizer)
        options = SpecOptions(k=4, drafters=("forced", "recipe", "layout", "prompt", "suffix"), recipe=pack)
        loop = make_loop(self.runner, prompt, options, constraint=c, tokenizer=self.tokenizer,
                         params=SamplingParams(temperature=temperature), max_tokens=max_tokens,
                         rng=np.random.default_rng(seed))
        out = loop.generate()
        return R.Sample(tuple(prompt), tuple(out), req.get("workload")), loop.finish_reason == "stop"


def layout_table(samples, tokenizer, *, min_support: int = 3, agree: float = 0.8) -> dict:
    """The model's layout, frozen from its verified outputs (``recipes.layout.LayoutIndex.table``)."""
    from .recipes.layout import LayoutIndex

    idx = LayoutIndex(tokenizer.token_bytes, per_key=64, max_tokens=1 << 30, max_keys=1 << 30)
    for s in samples:
        idx.observe(s.output)
    return idx.table(min_support=min_support, agree=agree)


def cmd_build_requests(a) -> int:
    path = model_path(a.model)
    sampler = GGUFSampler(path, threads=a.threads) if Path(path).is_file() else FolderSampler(path)
    tok = sampler.tokenizer
    samples: list[R.Sample] = []
    reqs = read_requests(a.requests) if a.requests else []
    temps = [float(t) for t in str(a.temperatures).split(",")]
    shard, shards = (int(x) for x in a.shard.split("/")) if a.shard else (0, 1)
    # answers already made (--samples caches: one JSON line per answer, the first file is appended to)
    cached: dict = {}
    for f in a.samples_cache or ():
        if Path(f).exists():
            for line in Path(f).read_text(encoding="utf-8").splitlines():
                try:
                    d = json.loads(line)
                    cached[(d["i"], d["t"])] = d
                except (ValueError, KeyError):
                    continue
    cache = open(a.samples_cache[0], "a", encoding="utf-8") if a.samples_cache else None
    todo = [(i, req) for i, req in enumerate(reqs) if i % shards == shard]
    pack = None
    next_build = 25
    done = 0
    incomplete = 0
    with tqdm(total=len(todo) * len(temps), desc=f"building on {sampler.name}", unit="answer",
              disable=a.quiet) as bar:
        for i, req in todo:
            if a.self_draft and done >= next_build:  # draft from what is learnt so far (lossless: saves passes)
                pack = R.build(samples, tok, max_recipes=a.max_recipes)
                next_build *= 2
            for j, t in enumerate(temps):
                d = cached.get((i, t))
                if d is not None:
                    s, complete = R.Sample(tuple(d["prompt"]), tuple(d["output"]), d.get("workload")), d["complete"]
                else:
                    s, complete = sampler(req, temperature=t, max_tokens=a.max_tokens,
                                          seed=a.seed + 1000 * i + j, pack=pack)
                    if cache is not None:
                        cache.write(json.dumps({"i": i, "t": t, "prompt": list(s.prompt), "output": list(s.output),
                                                "workload": s.workload, "complete": complete}) + "\n")
                        cache.flush()
                done += 1
                bar.update(1)
                if complete and s.output:
                    samples.append(s)
                else:
                    incomplete += 1
    if cache is not None:
        cache.close()
    if shards > 1 and a.shard_only:
        print(f"shard {shard}/{shards}: {len(samples)} verified outputs in {a.samples_cache[0]}", file=sys.stderr)
        return 0
    if a.served:
        from .recipes.served import ServedLog

        got = [R.Sample(p, o, "served") for p, o in ServedLog(a.served).samples(tok.vocab_fingerprint)]
        print(f"{a.served}: {len(got)} served outputs for this tokenizer", file=sys.stderr)
        samples += got
    if not samples:
        raise SystemExit("no verified outputs to learn from (no --requests answered completely, no --served lines)")
    by: dict[str, list] = {}
    for s in samples:
        by.setdefault(s.workload or "requests", []).append(s)
    meta = {"model": sampler.name, "requests": Path(a.requests).name if a.requests else None, "temperatures": temps,
            "verified_outputs": len(samples), "incomplete": incomplete, "seed": a.seed,
            "workloads": sorted(by), "auto": bool(a.auto)}
    name = a.name or Path(path).stem
    outs = []
    pack = R.build(samples, tok, min_count=a.min_count, agree=a.agree, max_recipes=a.max_recipes, meta=meta)
    pack.layout = layout_table(samples, tok)
    out = Path(a.out) if a.out else Path(a.dir) / f"{name}.json"
    pack.save(out)
    outs.append((out, pack))
    if a.per_workload:
        for w, ss in sorted(by.items()):
            m = {**meta, "workloads": [w], "verified_outputs": len(ss), "auto": False}
            p = R.build(ss, tok, min_count=a.min_count, agree=a.agree, max_recipes=a.max_recipes, meta=m)
            p.layout = layout_table(ss, tok)
            o = Path(a.dir) / f"{name}.{w}.json"
            p.save(o)
            outs.append((o, p))
    for o, p in outs:
        print(f"{o}: {json.dumps({**p.stats(), 'layout': len(p.layout)})}")
    return 0


def cmd_prompts(a) -> int:
    from .recipes.train import training_requests

    n = 0
    with open(a.output, "w", encoding="utf-8") as f:
        for req in training_requests(a.n, a.schemas, a.seed):
            f.write(json.dumps(req, sort_keys=True) + "\n")
            n += 1
    print(f"{a.output}: {n} requests", file=sys.stderr)
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
        res = evaluate(runner, tok, exs, pack=pack, drafters=a.drafters.split(","), k=a.k, engine=a.engine,
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
    print(json.dumps({"lookup": benchmark_lookup(pack, contexts), "pack": pack.stats()}))
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
    b.add_argument("--min-count", type=int, default=R.pack.DEFAULTS["min_count"])
    b.add_argument("--agree", type=float, default=R.pack.DEFAULTS["agree"])
    b.add_argument("--max-recipes", type=int, default=R.pack.DEFAULTS["max_recipes"])
    b.add_argument("--misses", help="a miss log (JSON lines) to fold in")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--samples", help="folder caching the verified samples per workload (reused when present)")
    b.add_argument("--dir", default="recipes", help="output folder (default: recipes/, the shipped packs' folder "
                   "when run from the repository's root)")
    b.add_argument("-o", "--out", help="output file (one workload, or the merged pack)")
    b.add_argument("--merged", action="store_true", help="also write the merged pack (structured.json)")
    b.add_argument("--merged-only", action="store_true", help="write only the merged pack")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    b.add_argument("--requests", help="JSON Lines of requests (messages or prompt + constraint): run --model on them "
                   "(a GGUF, an HF folder or smollm2-135m) and learn from its verified outputs")
    b.add_argument("--served", help="a folder of served verified outputs (SPECGRAMMAR_SERVED_DIR) to learn from")
    b.add_argument("--name", help="pack name (with --requests: <dir>/<name>.json; default: the model's file stem)")
    b.add_argument("--temperatures", default="0", help="with --requests: one answer per temperature (default 0)")
    b.add_argument("--per-workload", action="store_true",
                   help="with --requests: also one pack per request 'workload' field (<name>.<workload>.json)")
    b.add_argument("--auto", action="store_true",
                   help="mark the pack as the one chosen for this tokenizer when a request names none")
    b.add_argument("--threads", type=int, default=1, help="with a GGUF: llama.cpp threads (default 1)")
    b.add_argument("--self-draft", type=int, default=1, help="draft from the pack learnt so far (default 1; 0: off)")
    b.add_argument("--samples-cache", action="append",
                   help="with --requests: JSON Lines of answers made so far (reused; new ones are appended to the "
                        "first); repeatable, so shards' caches can be built together")
    b.add_argument("--shard", help="with --requests: K/N answers only requests with index %% N == K")
    b.add_argument("--shard-only", action="store_true", help="with --shard: answer and cache, build no pack")
    b.set_defaults(fn=cmd_build)

    pr = sub.add_parser("prompts", help="write seeded training requests (JSON Lines), never the eval prompts")
    pr.add_argument("-o", "--output", required=True)
    pr.add_argument("-n", type=int, default=40, help="train-split prompts per structured workload (default 40)")
    pr.add_argument("--schemas", type=int, default=60, help="generated-schema requests (default 60)")
    pr.add_argument("--seed", type=int, default=20261126)
    pr.set_defaults(fn=cmd_prompts)

    i = sub.add_parser("inspect", help="summary and top recipes of a pack")
    i.add_argument("pack")
    i.add_argument("--top", type=int, default=20)
    i.add_argument("--model", help="model folder whose tokenizer decodes the recipes")
    i.set_defaults(fn=cmd_inspect)

    m = sub.add_parser("merge", help="merge packs for one tokenizer")
    m.add_argument("packs", nargs="+")
    m.add_argument("-o", "--output", required=True)
    m.add_argument("--agree", type=float, default=R.pack.DEFAULTS["agree"])
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
