"""``specgrammar bench masks``: what the grammar engines cost, through our Matcher protocol.

For each engine and workload (the seed regexes ``[0-9]{4}``, ``[a-z]+@[a-z]+\\.com``, ``[A-Z]{3}-[0-9]{4}``, a JSON
schema {name, age, email} and any JSON), on a real tokenizer (Qwen2.5 by default, masks 151,936 wide):

- compile ms (cold: our compile cache and the engine's own cache bypassed) and the one-off engine tokenizer build;
- per-token mask us (median, p99): one ``matcher.fill_mask`` per position of a valid text, over several walks with
  fresh matchers on the compiled grammar (a server's steady state); the first walk is reported apart ("cold":
  each state's first visit, where llguidance builds lexer states and outlines-core our cached row);
- repeated calls on one state: ours against the engine's own fill call on the same state (xgrammar ``fill_next_token_bitmask``, llguidance
  ``unsafe_compute_mask_ptr``, outlines-core ``Guide.write_mask_into``, the dfa's cached row), interleaved
  with ours, and our overhead against it (goal < 10%);
- the masks of a k=8 draft: fork + 9 masks + 8 accepts + rollback, from every position of the walk.

Prints a table and writes JSON (``--out``, default ``bench-out/masks.json``).  ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

from ._report import save_plot

QWEN_REL = Path("shared") / "data" / "tokenizers" / "qwen2.5" / "generated" / "tokenizer.json"
QWEN_WIDTH = 151_936
DEFAULT_ENGINES = ("xgrammar", "llguidance", "outlines_core")

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "email": {"type": "string", "format": "email"}},
    "required": ["name", "age", "email"],
}

WORKLOADS = [
    # name, spec factory args, a valid text to walk
    ("regex [0-9]{4}", ("regex", r"[0-9]{4}"), "2024"),
    ("regex email", ("regex", r"[a-z]+@[a-z]+\.com"), "alice@example.com"),
    ("regex [A-Z]{3}-[0-9]{4}", ("regex", r"[A-Z]{3}-[0-9]{4}"), "ABC-1234"),
    ("json schema {name,age,email}", ("json_schema", PERSON_SCHEMA),
     '{"name": "Alice Smith", "age": 42, "email": "alice@example.com"}'),
    ("any json", ("json", None), '{"id": 7, "tags": ["red", "blue"], "meta": {"ok": true, "score": 0.5}}'),
]


def _default_tokenizer() -> Path | None:
    here = Path(__file__).resolve()
    for base in (Path.cwd().parent, here.parents[3].parent if len(here.parents) > 3 else None):
        if base is not None and (base / QWEN_REL).exists():
            return base / QWEN_REL
    return None


def _spec(kind: str, value):
    from ..constraint import ConstraintSpec

    if kind == "regex":
        return ConstraintSpec.regex(value)
    if kind == "json_schema":
        return ConstraintSpec.json_schema(value)
    return ConstraintSpec.json()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


class _RawFill:
    """The engine's own mask call on the state of ``m`` (no adapter in between)."""

    def __init__(self, engine: str, m, compiled, history: list[int]):
        self.engine = engine
        self.m = m
        self.fn = None
        if engine in ("xgrammar", "llguidance"):
            self.fn = m.raw_fill
        elif engine == "outlines_core":
            import outlines_core as oc

            g = compiled.compiled
            guide = oc.Guide(g.index)
            for t in history:
                guide.advance(t, return_tokens=False)
            self.guide = guide
            self.fn = self._outlines
        elif engine == "dfa":
            self.fn = lambda out: out.__setitem__(slice(None), m.g.mask(m.state))

    def advance(self, token: int) -> None:
        if self.engine == "outlines_core" and token not in self.m.tok.stop_token_ids:  # no EOS transition
            self.guide.advance(token, return_tokens=False)

    def _outlines(self, out: np.ndarray) -> None:
        self.guide.write_mask_into(out.ctypes.data, out.size, 4)


def bench_one(engine: str, wname: str, spec, text: str, tok, reps: int, k: int) -> dict:
    from ..compiler import compile_constraint
    from ..masks import mask_words
    from ..errors import ConstraintError

    res: dict = {"workload": wname, "engine": engine}
    # cold compile: bypass our cache and (xgrammar) the engine's own
    try:
        t0 = time.perf_counter()
        if engine == "xgrammar":
            from ..engines.xgrammar_engine import _COMPILERS

            _COMPILERS.get(tok).clear_cache()
        elif engine == "llguidance":
            from ..engines.llguidance_engine import _TOKENIZERS

            _TOKENIZERS.get(tok)
        elif engine == "outlines_core":
            from ..engines.outlines_core_engine import _TOKENIZERS as _OC

            _OC.get(tok).vocabulary(True)
        res["tokenizer_ms"] = (time.perf_counter() - t0) * 1e3  # engine's tokenizer objects: once per tokenizer
        t0 = time.perf_counter()
        cc = compile_constraint(spec, tok, engine, cache=None)
        res["compile_ms"] = (time.perf_counter() - t0) * 1e3
        res["memory_bytes"] = cc.memory_bytes
    except ConstraintError as e:
        res["error"] = e.reason
        return res
    ids = list(tok.encode(text)) + [tok.eos_token_id]
    row = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)
    raw_row = np.zeros_like(row)
    cold, walk, ours, theirs, draft = [], [], [], [], []
    pc = time.perf_counter_ns
    walks = 1 + max(1, reps // 3)
    for w in range(walks):
        # walk 0: cold (the compiled grammar's first visit of each state), with the overhead pairs and the drafts;
        # walks 1..: a fresh matcher per walk over the same compiled grammar (a server's steady state): the
        # per-token mask figures are the one call per position a decoder makes
        m = cc.matcher()
        raw = _RawFill(engine, m, cc, []) if w == 0 else None
        walked: list[int] = []
        for pos, t in enumerate(ids):
            t0 = pc()
            m.fill_mask(row)
            (cold if w == 0 else walk).append((pc() - t0) / 1e3)
            if w == 0:
                for _ in range(reps):  # ours vs the engine's own call, interleaved, on this state
                    t0 = pc()
                    m.fill_mask(row)
                    t1 = pc()
                    raw.fn(raw_row)
                    t2 = pc()
                    ours.append((t1 - t0) / 1e3)
                    theirs.append((t2 - t1) / 1e3)
                d = ids[pos:pos + k]  # a k-token draft from here: the rest of the text
                if len(d) == k or pos == 0:
                    rows = np.zeros((len(d) + 1, row.shape[0]), dtype=np.int32)
                    for rep in range(1 + max(1, reps // 4)):  # the first run is untimed
                        t0 = pc()
                        f = m.fork()
                        n = 0
                        for i, dt in enumerate(d):
                            f.fill_mask(rows[i])
                            if not f.accept(dt):
                                break
                            n += 1
                        else:
                            if not f.is_terminated():
                                f.fill_mask(rows[len(d)])
                        f.rollback(n)
                        if rep:
                            draft.append((pc() - t0) / 1e3)
                    res.setdefault("draft_k", len(d))
            if not m.accept(t):
                res["error"] = f"{engine} rejected token {t} ({tok.token_bytes[t]!r}) of the workload text"
                return res
            if raw is not None:
                raw.advance(t)
            walked.append(t)
    res.update({
        "n_positions": len(ids), "walks": walks,
        "mask_us_median": _pct(walk, 50), "mask_us_p99": _pct(walk, 99),
        "mask_cold_us_median": _pct(cold, 50), "mask_cold_us_max": max(cold) if cold else float("nan"),
        "repeat_us_median": _pct(ours, 50), "raw_us_median": _pct(theirs, 50), "raw_us_p99": _pct(theirs, 99),
        "draft_us_median": _pct(draft, 50), "draft_us_p99": _pct(draft, 99),
    })
    if res["raw_us_median"] and not math.isnan(res["raw_us_median"]):
        res["overhead_pct"] = 100.0 * (res["repeat_us_median"] - res["raw_us_median"]) / res["raw_us_median"]
    return res


def _fmt(x, spec=".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def print_table(results: list[dict], out=sys.stdout) -> None:
    head = (f"{'workload':30} {'engine':13} {'compile ms':>10} {'mask p50':>9} {'mask p99':>9} {'cold p50':>9} "
            f"{'cold max':>9} {'ours':>6} {'raw':>6} {'ovh %':>6} {'k':>2} {'draft us':>9}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in results:
        if "error" in r and "mask_us_median" not in r:
            print(f"{r['workload'][:30]:30} {r['engine']:13} unsupported: {r['error'][:70]}", file=out)
            continue
        print(f"{r['workload'][:30]:30} {r['engine']:13} {_fmt(r.get('compile_ms')):>10} "
              f"{_fmt(r.get('mask_us_median')):>9} {_fmt(r.get('mask_us_p99')):>9} "
              f"{_fmt(r.get('mask_cold_us_median')):>9} {_fmt(r.get('mask_cold_us_max')):>9} "
              f"{_fmt(r.get('repeat_us_median')):>6} {_fmt(r.get('raw_us_median')):>6} "
              f"{_fmt(r.get('overhead_pct'), '+.0f'):>6} {r.get('draft_k', '-')!s:>2} "
              f"{_fmt(r.get('draft_us_median')):>9}", file=out)
    print("times in microseconds.  mask: one fill_mask per position, fresh matchers over the compiled grammar;\n"
          "cold: the first walk (each state's first visit); ours/raw: repeated calls on one state, fill_mask vs the\n"
          "engine's own fill call (ovh = our overhead); draft: fork + (k+1) masks + k accepts + rollback", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar bench masks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="tokenizer.json (or its folder); default: ../shared/data/tokenizers/qwen2.5/generated/"
                         "tokenizer.json with width 151,936")
    ap.add_argument("--width", type=int, default=None,
                    help="mask width = model output size (default: 151,936 for the default Qwen2.5 tokenizer, "
                         "else the tokenizer's length)")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help=f"comma-separated engines (default {','.join(DEFAULT_ENGINES)}; 'dfa' is the slow "
                         "pure-Python reference)")
    ap.add_argument("--workloads", default=None, help="comma-separated substrings of workload names to keep")
    ap.add_argument("--reps", type=int, default=None, help="mask calls timed per position (default 30; 3 quick)")
    ap.add_argument("--k", type=int, default=8, help="draft length (default 8)")
    ap.add_argument("--out", type=Path, default=Path("bench-out") / "masks.json")
    ap.add_argument("--out-dir", type=Path, default=None, help="write masks.json and masks.png here (overrides --out)")
    ap.add_argument("--no-progress", action="store_true", help="accepted for symmetry with the other benchmarks")
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 1 minute)")
    args = ap.parse_args(argv)
    if args.out_dir is not None:
        args.out = args.out_dir / "masks.json"

    from ..tokenizer import TokenizerInfo

    path = args.tokenizer
    width = args.width
    if path is None:
        path = _default_tokenizer()
        if path is None:
            print(f"error: no tokenizer given and ../{QWEN_REL} was not found (it sits beside the repository on the "
                  "project's machines); pass --tokenizer PATH/tokenizer.json", file=sys.stderr)
            return 2
        width = width or QWEN_WIDTH
    if not Path(path).exists():
        print(f"error: tokenizer {path} does not exist", file=sys.stderr)
        return 2
    tok = TokenizerInfo.from_file(path)
    if width:
        if width < len(tok.token_bytes):
            print(f"error: --width {width} is smaller than the tokenizer ({len(tok.token_bytes)} tokens)",
                  file=sys.stderr)
            return 2
        tok = tok.with_vocab_size(width)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    reps = args.reps or (3 if args.quick else 30)
    workloads = WORKLOADS
    if args.workloads:
        keep = [w.strip() for w in args.workloads.split(",")]
        workloads = [w for w in WORKLOADS if any(k in w[0] for k in keep)]

    print(f"tokenizer {path} ({len(tok.token_bytes)} tokens, mask width {tok.vocab_size}); engines "
          f"{', '.join(engines)}; {reps} timed calls per position; k={args.k}", flush=True)
    results = []
    for wname, (kind, value), text in workloads:
        spec = _spec(kind, value)
        for engine in engines:
            r = bench_one(engine, wname, spec, text, tok, reps, args.k)
            results.append(r)
            print(f"  {wname} / {engine}: " + ("unsupported: " + r["error"][:80] if "mask_us_median" not in r else
                                              f"compile {_fmt(r.get('compile_ms'))} ms, mask p50 "
                                              f"{_fmt(r['mask_us_median'])} us"), flush=True)
    print()
    print_table(results)
    report = {
        "tokenizer": str(path), "n_tokens": len(tok.token_bytes), "width": tok.vocab_size, "engines": engines,
        "reps": reps, "k": args.k, "quick": args.quick, "python": platform.python_version(),
        "machine": platform.machine(), "versions": _versions(engines), "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=_json_default))
    png = args.out.with_suffix(".png")
    print(f"\nwrote {args.out}" + (f", {png}" if save_plot(png, _plot(results, engines), (11, 4.5)) else ""))
    return 0


def _plot(results: list[dict], engines):
    from ._report import bar_groups

    def draw(fig):
        ws = list(dict.fromkeys(r["workload"] for r in results))
        get = {(r["workload"], r["engine"]): r for r in results}
        for i, (key, label) in enumerate((("mask_us_median", "per-token mask p50 (µs)"),
                                          ("compile_ms", "compile (ms)"))):
            ax = fig.add_subplot(1, 2, i + 1)
            bar_groups(ax, [w[:24] for w in ws], {e: [get.get((w, e), {}).get(key) for w in ws] for e in engines},
                       label, label)
            ax.set_yscale("log")
    return draw


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(type(x).__name__)


def _versions(engines) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("xgrammar", "llguidance", "outlines-core", "interegular", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
