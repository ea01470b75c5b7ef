"""Constraint coverage on real corpora: MaskBench dev schemas (../shared/data/jsonschemabench/dev) per engine setting.

For each schema: compile (strict mode, exact rewrites first), then walk every test instance token by token
(Qwen2.5 tokenizer) through a fresh matcher and end with EOS.  A valid instance should be accepted; an invalid one
must be rejected whenever we compiled the schema (we claim to enforce every keyword in it).  An instance counts as
accepted if its compact or spaced serialization is (each also tried with the schema's property order: engines fix
the order to the schema's, JSON Schema does not).

Engine settings: ``default`` (what ``compile_constraint`` does without an engine: the per-kind policy), ``auto``,
an engine name, and ``NAME/norewrite`` (strict, no rewrites) or ``NAME/nostrict`` (no rewrites, no strict check:
what the engine alone does) to see what each layer adds.

    specgrammar bench coverage [--limit N] [--engines default,llguidance,xgrammar] [--out-dir bench-out/coverage]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Iterable

from ..compiler import compile_constraint
from ..constraint import ConstraintSpec
from ..errors import ConstraintError
from ..tokenizer import TokenizerInfo
from ._report import save_plot

ROOT = Path(__file__).resolve().parents[3]
DATA = Path(os.environ.get("SPECGRAMMAR_SHARED_DATA", ROOT.parent / "shared" / "data"))


def _resolve(schema: Any, defs: dict, depth: int = 0) -> Any:
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#/") \
            and depth < 16:
        node: Any = defs
        for part in schema["$ref"][2:].split("/"):
            node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(node, dict) else {}
        schema, depth = node, depth + 1
    return schema


def _property_schemas(schema: Any, defs: dict, keys: set, depth: int = 0) -> dict:
    """The ``properties`` of a schema, then of its allOf members, then of the anyOf/oneOf branch that lists most of
    ``keys`` ($refs followed), in schema order: the order engines generate an object's properties in."""
    schema = _resolve(schema, defs)
    if not isinstance(schema, dict) or depth > 8:
        return {}
    out = dict(schema.get("properties")) if isinstance(schema.get("properties"), dict) else {}
    for branch in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        for k, v in _property_schemas(branch, defs, keys, depth + 1).items():
            out.setdefault(k, v)
    for kw in ("anyOf", "oneOf"):
        options = [_property_schemas(b, defs, keys, depth + 1) for b in schema.get(kw, [])] \
            if isinstance(schema.get(kw), list) else []
        if options:
            best = max(options, key=lambda o: (len(keys & set(o)), -len(set(o) - keys)))
            for k, v in best.items():
                out.setdefault(k, v)
    return out


def _order_like(data: Any, schema: Any, defs: dict) -> Any:
    """Reorder object keys to follow the schema's ``properties`` order (recursively, through $refs and the
    branches of allOf/anyOf/oneOf, best effort): engines fix the order to the schema's, JSON Schema does not."""
    schema = _resolve(schema, defs)
    if isinstance(data, dict) and isinstance(schema, dict):
        props = _property_schemas(schema, defs, set(data))
        out = {}
        for k in props:
            if k in data:
                out[k] = _order_like(data[k], props[k], defs)
        extra = schema.get("additionalProperties")
        for k, v in data.items():
            if k not in out:
                out[k] = _order_like(v, extra, defs) if isinstance(extra, dict) else v
        return out
    if isinstance(data, list) and isinstance(schema, dict):
        items = schema.get("items")
        if isinstance(items, dict):
            return [_order_like(x, items, defs) for x in data]
        if not isinstance(items, dict) and isinstance(schema.get("anyOf") or schema.get("oneOf"), list):
            for branch in schema.get("anyOf") or schema.get("oneOf"):
                b = _resolve(branch, defs)
                if isinstance(b, dict) and isinstance(b.get("items"), dict):
                    return [_order_like(x, b["items"], defs) for x in data]
    return data


def serializations(data: Any, schema: Any) -> list[str]:
    ordered = _order_like(data, schema, schema if isinstance(schema, dict) else {})
    out = []
    for seps in ((",", ":"), (", ", ": ")):
        for d in (ordered, data):
            s = json.dumps(d, ensure_ascii=False, separators=seps)
            if s not in out:
                out.append(s)
    return out


def accepts(compiled, tok: TokenizerInfo, text: str) -> bool | None:
    """True/False: the matcher takes/refuses the text then EOS.  None: the tokenizer cannot spell the text exactly
    (e.g. Qwen2.5 normalizes to NFC, so a combining-mark spelling would be tested as its composed twin)."""
    ids = tok.encode(text)
    if tok.decode(ids) != text.encode("utf-8"):
        return None
    m = compiled.matcher()
    for t in ids:
        if not m.accept(t):
            return False
    return m.accept(tok.eos_token_id)


def schema_files(limit: int | None = None, seed_stride: int = 1) -> list[Path]:
    files = sorted(glob.glob(str(DATA / "jsonschemabench" / "dev" / "*.json")))
    files = files[::seed_stride]
    return [Path(f) for f in (files[:limit] if limit else files)]


def setting(name: str) -> tuple[str | None, tuple]:
    """An engine setting's (engine for ``compile_constraint``, spec options)."""
    engine, _, mode = name.partition("/")
    opts = {"": (), "norewrite": (("rewrite", False),), "nostrict": (("rewrite", False), ("strict", False))}
    if mode not in opts:
        raise SystemExit(f"unknown engine setting {name!r}: NAME, NAME/norewrite or NAME/nostrict")
    return (None if engine == "default" else engine), opts[mode]


_KEYWORD = re.compile(r"keyword '([^' ]+)")


def refusal_key(err: ConstraintError) -> str:
    """A short name for why a schema was refused: the keyword strict mode named, or the engine's first words."""
    m = _KEYWORD.search(err.reason)
    if m:
        return m.group(1).rstrip(":")
    first = err.reason.split("\n")[0].replace("failed to compile JSON schema: ", "")
    return re.sub(r"^(\w+: )?at \d+\(\d+\): ", r"\1", first)[:60]


def warm_up(engines: list[str], tok: TokenizerInfo) -> None:
    """Before timing, what happens once per process and not per schema (the first compile would count it): each
    engine's per-tokenizer index (llguidance's: ~0.8 s at 151,936 tokens), and the import of jsonschema, which
    the exact rewrites of a finite domain use (~0.1 s)."""
    from ..compiler import POLICY, default_engine
    from ..plugins import get_engine

    import jsonschema  # noqa: F401
    import referencing  # noqa: F401

    names = set()
    for e in engines:
        engine = setting(e)[0] or default_engine(ConstraintSpec.json_schema({}))  # (the default for JSON Schema)
        names.update(POLICY["json_schema"] if engine == "auto" else (engine,))
    for name in sorted(names):
        try:
            get_engine(name).prepare(tok)
        except (AttributeError, ConstraintError, ImportError):
            pass


def evaluate(files: Iterable[Path], engines: list[str], tok: TokenizerInfo, progress: bool = False) -> dict:
    """Per engine setting: compiled count, compile ms, valid accepted/total, invalid rejected/total, the violations
    (invalid instances accepted by a schema we compiled), the rejections (valid instances rejected), refusal reasons,
    rewrites applied, engines picked."""
    files = list(files)
    res = {e: {"schemas": 0, "compiled": 0, "compile_ms": [], "valid": 0, "valid_accepted": 0, "invalid": 0,
               "invalid_rejected": 0, "violations": [], "refused": {}, "rewritten": 0, "rewrites": {},
               "picked": {}, "matcher_errors": [], "rejections": []} for e in engines}
    it = files
    if progress:
        from ._report import progress as bar

        it = bar(files, "schemas")
    for f in it:
        doc = json.loads(Path(f).read_text())
        schema = doc["schema"]
        for e in engines:
            r = res[e]
            r["schemas"] += 1
            engine, opts = setting(e)
            try:
                spec = ConstraintSpec.json_schema(schema, options=opts)
                t0 = time.perf_counter()
                c = compile_constraint(spec, tok, engine=engine, cache=None)
                r["compile_ms"].append((time.perf_counter() - t0) * 1e3)
            except ConstraintError as err:
                key = refusal_key(err)
                r["refused"][key] = r["refused"].get(key, 0) + 1
                continue
            r["compiled"] += 1
            r["picked"][c.engine] = r["picked"].get(c.engine, 0) + 1
            r["rewritten"] += bool(c.rewrites)
            for rw in c.rewrites:
                r["rewrites"][rw.keyword] = r["rewrites"].get(rw.keyword, 0) + 1
            for test in doc.get("tests", []):
                try:
                    verdicts = [accepts(c, tok, s) for s in serializations(test["data"], schema)]
                except (ConstraintError, RuntimeError) as err:  # the engine failed while matching
                    r["matcher_errors"].append({"file": Path(f).name, "error": str(err)[:200]})
                    verdicts = [False]
                if all(v is None for v in verdicts):
                    continue
                ok = any(verdicts)
                if test["valid"]:
                    r["valid"] += 1
                    r["valid_accepted"] += ok
                    if not ok:
                        r["rejections"].append({"file": Path(f).name, "test": test.get("description", ""),
                                                "engine": c.engine})
                else:
                    r["invalid"] += 1
                    r["invalid_rejected"] += not ok
                    if ok:
                        r["violations"].append({"file": Path(f).name, "test": test.get("description", "")})
    for r in res.values():
        ms = sorted(r.pop("compile_ms"))
        r["compile_ms_p50"] = statistics.median(ms) if ms else None
        r["compile_ms_p99"] = ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None
        r["compile_ms_max"] = ms[-1] if ms else None
        r["invalid_accepted"] = r["invalid"] - r["invalid_rejected"]
        r["refused"] = dict(sorted(r["refused"].items(), key=lambda kv: -kv[1])[:20])
        r["rewrites"] = dict(sorted(r["rewrites"].items(), key=lambda kv: -kv[1]))
    return res


def table(res: dict) -> str:
    """The results as the markdown table docs/BENCHMARKS.md records."""
    from ._report import fmt, md_table

    def pct(a, b):  # rounded down: 2,388 / 2,389 is 99.9%, never 100.0%
        return f"{a:,} / {b:,} ({math.floor(1000 * a / b) / 10:.1f}%)" if b else "-"

    rows = [[f"`{e}`" + (f" ({', '.join(f'{k} {v}' for k, v in r['picked'].items())})" if e in ("default", "auto")
                         else ""),
             pct(r["compiled"], r["schemas"]), f"{r['invalid_accepted']:,} / {r['invalid']:,}",
             pct(r["valid_accepted"], r["valid"]),
             f"{fmt(r['compile_ms_p50'], '.1f')} / {fmt(r['compile_ms_p99'], '.1f')} ms"] for e, r in res.items()]
    return md_table(["engine setting", "schemas compiled", "invalid instances accepted", "valid instances accepted",
                     "compile p50 / p99"], rows, right=(1, 2, 3, 4))


def qwen_tokenizer() -> TokenizerInfo:
    path = DATA / "tokenizers" / "qwen2.5" / "generated" / "tokenizer.json"
    if not path.exists():
        raise SystemExit(f"the Qwen2.5 tokenizer is missing: {path} (../shared/data beside the repo)")
    return TokenizerInfo.from_file(path, vocab_size=151936, eos_token="<|im_end|>")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar bench coverage", description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="first N schemas (sorted by file name)")
    ap.add_argument("--stride", type=int, default=1, help="take every Nth schema")
    ap.add_argument("--engines", default="default,llguidance",
                    help="comma-separated engine settings (default: default,llguidance, about a minute on the full "
                         "corpus; xgrammar and outlines_core compile some schemas for seconds to the compile time "
                         "limit each: on the full corpus they take far longer); NAME/norewrite, NAME/nostrict too")
    ap.add_argument("--out", default="bench-out/coverage.json")
    ap.add_argument("--quick", action="store_true", help="40 schemas, llguidance and auto")
    ap.add_argument("--out-dir", default=None, help="write coverage.json and coverage.png here (overrides --out)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    if a.out_dir is not None:
        a.out = str(Path(a.out_dir) / "coverage.json")
    if a.quick:
        a.limit, a.stride, a.engines = 40, 50, "default,llguidance"
    tok = qwen_tokenizer()
    files = schema_files(a.limit, a.stride)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    warm_up(engines, tok)
    t0 = time.perf_counter()
    res = evaluate(files, engines, tok, progress=not a.no_progress)
    seconds = time.perf_counter() - t0
    print(f"\nMaskBench dev: {len(files)} schemas, Qwen2.5 tokenizer (mask width {tok.vocab_size}), strict mode "
          f"({seconds:.0f} s)\n")
    print(table(res))
    for e, r in res.items():
        print(f"\n{e}: refused {dict(list(r['refused'].items())[:10])}; rewritten {r['rewritten']} schemas "
              f"{r['rewrites']}; violations {r['violations'][:5]}; valid rejected {r['rejections'][:10]}; engine errors while matching "
              f"{len(r['matcher_errors'])} {r['matcher_errors'][:3]}")
    from ._report import machine

    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"schemas": len(files), "seconds": round(seconds, 1), "argv": argv,
                                       "machine": machine(), "results": res}, indent=1))
    png = Path(a.out).with_suffix(".png")
    print(f"wrote {a.out}" + (f", {png}" if save_plot(png, _plot(res), (10, 4)) else ""))
    return 0


def _plot(res: dict):
    from ._report import bar_groups

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        engines = list(res)
        share = lambda a, b: [r[a] / r[b] if r[b] else None for r in res.values()]  # noqa: E731
        bar_groups(ax, engines, {"compiled / schemas": share("compiled", "schemas"),
                                 "valid accepted": share("valid_accepted", "valid"),
                                 "invalid rejected": share("invalid_rejected", "invalid")},
                   "share", "MaskBench dev, strict mode", hline=1.0)
    return draw
