"""Constraint coverage on real corpora: MaskBench dev schemas (../shared/data/jsonschemabench/dev) per engine and with
the ``auto`` policy, and llama.cpp's GBNF grammars on every CFG engine.

For each schema: compile (strict mode), then walk every test instance token by token (Qwen2.5 tokenizer) through a
fresh matcher and end with EOS.  A valid instance should be accepted; an invalid one must be rejected whenever we
compiled the schema (we claim to enforce every keyword in it).  Instances are serialized with the schema's property
order (engines fix the order to the schema's; JSON Schema does not) and, failing that, with spaces after ':' and ','.

    specgrammar bench coverage [--limit N] [--engines llguidance,xgrammar,auto] [--out bench-out/coverage.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
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


def _order_like(data: Any, schema: Any, defs: dict) -> Any:
    """Reorder object keys to follow the schema's ``properties`` order (recursively, best effort)."""
    if isinstance(schema, dict) and "$ref" in schema and isinstance(schema["$ref"], str):
        ref = schema["$ref"]
        if ref.startswith("#/"):
            node: Any = defs
            for part in ref[2:].split("/"):
                node = node.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(node, dict) else {}
            schema = node
    if isinstance(data, dict) and isinstance(schema, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        out = {}
        for k in props:
            if k in data:
                out[k] = _order_like(data[k], props[k], defs)
        for k, v in data.items():
            if k not in out:
                out[k] = v
        return out
    if isinstance(data, list) and isinstance(schema, dict) and isinstance(schema.get("items"), dict):
        return [_order_like(x, schema["items"], defs) for x in data]
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


def evaluate(files: Iterable[Path], engines: list[str], tok: TokenizerInfo, progress: bool = False) -> dict:
    """Per engine: compiled count, compile ms, valid accepted/total, invalid rejected/total, and the violations
    (invalid instances accepted by a schema we compiled)."""
    files = list(files)
    res = {e: {"schemas": 0, "compiled": 0, "compile_ms": [], "valid": 0, "valid_accepted": 0, "invalid": 0,
               "invalid_rejected": 0, "violations": [], "refused": {}} for e in engines}
    it = files
    if progress:
        from tqdm import tqdm

        it = tqdm(files, desc="schemas", unit="schema")
    for f in it:
        doc = json.loads(Path(f).read_text())
        schema = doc["schema"]
        for e in engines:
            r = res[e]
            r["schemas"] += 1
            try:
                spec = ConstraintSpec.json_schema(schema)
                t0 = time.perf_counter()
                c = compile_constraint(spec, tok, engine=e, cache=None)
                r["compile_ms"].append((time.perf_counter() - t0) * 1e3)
            except ConstraintError as err:
                key = err.reason.split(":")[0][:60]
                r["refused"][key] = r["refused"].get(key, 0) + 1
                continue
            r["compiled"] += 1
            for test in doc.get("tests", []):
                verdicts = [accepts(c, tok, s) for s in serializations(test["data"], schema)]
                if all(v is None for v in verdicts):
                    continue
                ok = any(verdicts)
                if test["valid"]:
                    r["valid"] += 1
                    r["valid_accepted"] += ok
                else:
                    r["invalid"] += 1
                    r["invalid_rejected"] += not ok
                    if ok:
                        r["violations"].append({"file": Path(f).name, "test": test.get("description", "")})
    for e, r in res.items():
        ms = sorted(r.pop("compile_ms"))
        r["compile_ms_p50"] = statistics.median(ms) if ms else None
        r["compile_ms_p99"] = ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None
        r["refused"] = dict(sorted(r["refused"].items(), key=lambda kv: -kv[1])[:12])
    return res


def qwen_tokenizer() -> TokenizerInfo:
    path = DATA / "tokenizers" / "qwen2.5" / "generated" / "tokenizer.json"
    if not path.exists():
        raise SystemExit(f"the Qwen2.5 tokenizer is missing: {path} (../shared/data beside the repo)")
    return TokenizerInfo.from_file(path, vocab_size=151936, eos_token="<|im_end|>")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar bench coverage", description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="first N schemas (sorted by file name)")
    ap.add_argument("--stride", type=int, default=1, help="take every Nth schema")
    ap.add_argument("--engines", default="llguidance,auto",
                    help="comma-separated (default llguidance,auto: about a minute on the full corpus; xgrammar and "
                         "outlines_core compile some schemas for up to a minute each, so on the full corpus they take "
                         "hours: give them with --limit/--stride)")
    ap.add_argument("--out", default="bench-out/coverage.json")
    ap.add_argument("--quick", action="store_true", help="40 schemas, llguidance and auto")
    ap.add_argument("--out-dir", default=None, help="write coverage.json and coverage.png here (overrides --out)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    if a.out_dir is not None:
        a.out = str(Path(a.out_dir) / "coverage.json")
    if a.quick:
        a.limit, a.stride, a.engines = 40, 50, "llguidance,auto"
    tok = qwen_tokenizer()
    files = schema_files(a.limit, a.stride)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    t0 = time.perf_counter()
    res = evaluate(files, engines, tok, progress=not a.no_progress)
    print(f"\nMaskBench dev: {len(files)} schemas, Qwen2.5 tokenizer, strict mode ({time.perf_counter() - t0:.0f} s)")
    print(f"{'engine':14} {'compiled':>10} {'compile p50/p99 ms':>20} {'valid accepted':>16} {'invalid rejected':>18} "
          f"{'violations':>10}")
    for e, r in res.items():
        p50 = f"{r['compile_ms_p50']:.1f}" if r["compile_ms_p50"] is not None else "-"
        p99 = f"{r['compile_ms_p99']:.1f}" if r["compile_ms_p99"] is not None else "-"
        print(f"{e:14} {r['compiled']:>5}/{r['schemas']:<4} {p50 + ' / ' + p99:>20} "
              f"{r['valid_accepted']:>7}/{r['valid']:<7} {r['invalid_rejected']:>8}/{r['invalid']:<8} "
              f"{len(r['violations']):>10}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"schemas": len(files), "results": res}, indent=1))
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
