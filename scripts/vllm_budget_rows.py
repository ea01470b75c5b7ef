"""What the vLLM budget mask costs per bitmask row at a real vocabulary (not a test; figures for docs/BENCHMARKS.md).

vLLM's structured-output bitmask gets one row per request per position (the target's and each draft's); the budget
mask (``specgrammar_vllm.budget_mask``) cuts each after vLLM's backend filled it (``Budget.mask_row``).  This walks
a valid output of a constraint token by token with the Qwen2.5 tokenizer (151,665 tokens,
``../shared/data/tokenizers/qwen2.5``), fills each position's row with our xgrammar matcher (what vLLM's xgrammar
backend does) and times that fill and the budget's cut, with the budget tight (the output's own length: the cut
binds at the end) and loose (+64 tokens), each for a first request of the constraint and again for a
later one (what is kept per constraint is then built).  CPU time of this thread, median and mean per row.
``SPECGRAMMAR_VLLM_BUDGET_FAR`` picks what the certified rows check far from the limit, as in the engine.

    python scripts/vllm_budget_rows.py
    SPECGRAMMAR_VLLM_BUDGET_FAR=open python scripts/vllm_budget_rows.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specgrammar_plugins.api import ConstraintSpec, SpecOptions, TokenizerInfo, check_budget, compile_constraint
from specgrammar_plugins.api import mask_words

TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers" / "qwen2.5"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "occupation": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "occupation", "tags"], "additionalProperties": False}
CASES = [
    ("JSON Schema (certified)", ConstraintSpec.json_schema(SCHEMA),
     json.dumps({"name": "Oscar Silva", "age": 22, "occupation": "photographer", "tags": ["travel", "portraits"]})),
    ("regex (exact)", ConstraintSpec.regex(r"\d{3}-\d{3}-\d{4}( ext\. \d{1,5})?"), "555-123-4567 ext. 89"),
]


def main() -> int:
    from specgrammar_vllm.budget_mask import FAR

    if not TOKENIZER.exists():
        print(f"no tokenizer at {TOKENIZER}", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(TOKENIZER))
    tok = TokenizerInfo.from_hf(hf)
    print(f"far zone: {FAR}; vocabulary {tok.vocab_size}; CPU us per row (median / mean over the output's positions)")
    print("| constraint | budget | mode | positions | rows cut | xgrammar fill | budget cut | cut / fill | output's own token cut |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, spec, text in CASES:
        compiled = compile_constraint(spec, tok, engine="xgrammar", xgrammar_strict_mode=True)
        ids = list(hf.encode(text, add_special_tokens=False)) + [tok.eos_token_id]
        for label, budget in (("tight", len(ids)), ("loose", len(ids) + 64), ("tight, again", len(ids)),
                              ("loose, again", len(ids) + 64)):  # again: a later request of the same constraint
            b = check_budget(compiled, SpecOptions(), budget)
            m = compiled.matcher()
            row = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)
            fill, cut, ncut, own_cut = [], [], 0, 0
            for i, t in enumerate(ids):
                t0 = time.thread_time_ns()
                m.fill_mask(row)
                t1 = time.thread_time_ns()
                ncut += bool(b.mask_row(row, ids[:i], 16, far=FAR))
                t2 = time.thread_time_ns()
                fill.append((t1 - t0) / 1e3)
                cut.append((t2 - t1) / 1e3)
                own_cut += not (int(row[t >> 5]) >> (t & 31) & 1)  # (certified: the tight zone keeps the
                # certificate's way only, a subset of the tokens that fit; the walk goes on along the output)
                if t != tok.eos_token_id:
                    assert m.accept(t)
            print(f"| {name} | {label} ({budget}) | {b.mode} | {len(ids)} | {ncut} | "
                  f"{statistics.median(fill):.0f} / {statistics.mean(fill):.0f} | "
                  f"{statistics.median(cut):.0f} / {statistics.mean(cut):.0f} | "
                  f"{statistics.mean(cut) / statistics.mean(fill):.2f} | {own_cut} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
