"""The certified budget's work in a vLLM step, replayed without a model (issue 34: the draft step's budget check).

vLLM's grammar-aware proposer asks the request's budget how many of its drafts fit (``RowCut.fitting``: each draft
checked alone, a one-bit row, after the drafts before it: ``drafts``), and the scheduler cuts the grammar's whole row
at the target position and after each draft (``BudgetedGrammar.fill_bitmask`` -> ``mask_row``: ``rows``).  This
replays both along pretty-printed documents (as SmolLM2-135M writes JSON: ``json.dumps(indent=2)``): the valid
instance of every 7th JSONSchemaBench dev schema both compilers take (``bench vllm_host``'s ``jsb_examples``; from
``../shared/data``, skipped when absent), tokenized by the Qwen2.5 tokenizer (151,936 ids) or SmolLM2's
(``--tokenizer smollm2``), xgrammar's masks, the budget at ``--max-tokens``.  A step drafts the document's next
``--k`` tokens and commits ``--stride`` of them.  Reported: CPU us per check or row (the second of two passes: the
first fills the per-tokenizer tables) and the certificate walks; with ``--against-walks`` the same with
``CertifiedBudget.rejoin`` off (a walk after every token that leaves the certificate, as before 2026-11-28), and
whether every verdict is the same (each draft check's count; each row as cut).

    python scripts/budget_replay.py [--tokenizer qwen|smollm2] [--what drafts rows] [--max-tokens 128] [--k 4]
                                    [--stride 2] [--against-walks]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _tokenizer(which: str):
    from specgrammar_plugins.bench.overhead import qwen_tokenizer

    if which == "qwen":
        return qwen_tokenizer()
    from specgrammar_plugins.models.real import smollm2_converted, smollm2_folder_path
    from specgrammar_plugins.tokenizer import TokenizerInfo

    if not smollm2_converted():
        return None
    return TokenizerInfo.from_file(smollm2_folder_path())  # (its own width, 49,152)


def _documents(tok, max_tokens: int, n: int = 40):
    """(compiled constraint, token ids of the pretty-printed valid instance) per schema that fits."""
    from specgrammar_plugins.bench.coverage import schema_files
    from specgrammar_plugins.bench.vllm_host import jsb_examples
    from specgrammar_plugins.compiler import compile_constraint

    valid = {}
    for f in schema_files(seed_stride=7):
        doc = json.loads(f.read_text())
        if isinstance(doc.get("schema"), dict):
            data = next((t["data"] for t in doc.get("tests", []) if t.get("valid")), None)
            if data is not None:
                valid.setdefault(json.dumps(doc["schema"]), data)
    out = []
    for _, spec, schema in jsb_examples(n):
        data = valid.get(json.dumps(schema))
        if data is None:
            continue
        ids = list(tok.encode(json.dumps(data, indent=2, ensure_ascii=False))) + [tok.eos_token_id]
        if len(ids) > max_tokens - 4:
            continue
        compiled = compile_constraint(spec, tok, engine="xgrammar")
        m = compiled.matcher()
        if all(m.accept(t) for t in ids):
            out.append((compiled, ids))
    return out


def _replay(docs, make, what: str, max_tokens: int, k: int, stride: int, width: int):
    """(calls, CPU ns, walks, verdicts) along every document: the proposer's checks of its drafts (``drafts``) or the
    scheduler's whole rows at each position and after each draft (``rows``)."""
    from specgrammar_plugins.api import RowCut
    from specgrammar_plugins.history import HistoryMatcher
    from specgrammar_plugins.masks import mask_words

    calls = ns = walks = 0
    verdicts: list = []
    for compiled, ids in docs:
        budget = make(compiled, max_tokens)
        w0 = budget.walks
        cut = RowCut(budget, 16, "open", width, deterministic_drafts=True)
        hm = HistoryMatcher(compiled)
        for p in range(0, len(ids), stride):
            if what == "drafts":
                t0 = time.thread_time_ns()
                verdicts.append(cut.fitting(np.array(ids[:p]), ids[p:p + k], remember=True))
                ns += time.thread_time_ns() - t0
                calls += 1
                continue
            for i in range(min(k, len(ids) - p) + 1):
                prefix = ids[:p + i]
                if not hm.sync(prefix) or hm.matcher.is_terminated():
                    break
                row = np.zeros(mask_words(width), dtype=np.int32)
                hm.matcher.fill_mask(row)
                t0 = time.thread_time_ns()
                budget.mask_row(row, prefix, 16, whole=True, far="open")
                ns += time.thread_time_ns() - t0
                calls += 1
                verdicts.append(row.tobytes())
        walks += budget.walks - w0
    return calls, ns, walks, verdicts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", choices=("qwen", "smollm2"), default="qwen")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--what", nargs="+", choices=("drafts", "rows"), default=["drafts", "rows"])
    ap.add_argument("--against-walks", action="store_true",
                    help="also replay with CertifiedBudget.rejoin off, and compare every verdict")
    a = ap.parse_args(argv)
    from specgrammar_plugins.budget import CertifiedBudget

    tok = _tokenizer(a.tokenizer)
    if tok is None:
        print(f"budget_replay: the {a.tokenizer} tokenizer is absent; skipped", file=sys.stderr)
        return 0
    docs = _documents(tok, a.max_tokens)
    if not docs:
        print("budget_replay: no schemas from ../shared/data (absent?); skipped", file=sys.stderr)
        return 0

    class Walking(CertifiedBudget):
        rejoin = False

    makes = {"rejoined": CertifiedBudget, **({"walks only": Walking} if a.against_walks else {})}
    print(f"{len(docs)} documents, {sum(len(i) for _, i in docs)} tokens, width {tok.vocab_size}, k {a.k}, "
          f"stride {a.stride}, max_tokens {a.max_tokens}")
    for what in a.what:
        got = []
        for name, make in makes.items():
            _replay(docs, make, what, a.max_tokens, a.k, a.stride, tok.vocab_size)
            calls, ns, walks, verdicts = _replay(docs, make, what, a.max_tokens, a.k, a.stride, tok.vocab_size)
            got.append(verdicts)
            unit = "check of the drafts" if what == "drafts" else "row"
            print(f"{what:>6} {name:>10}: {ns / calls / 1e3:7.1f} us per {unit} ({calls}), {walks} walks")
        if len(got) == 2:
            print(f"{what:>6} verdicts the same: {sum(x == y for x, y in zip(*got))} of {len(got[0])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
