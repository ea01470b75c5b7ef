"""The certified budget's check of a draft step's drafts, replayed (issue 34: the draft step's budget check).

vLLM's grammar-aware proposer asks the request's budget how many of its drafts fit (``RowCut.fitting``: each draft
checked alone, a one-bit row, after the drafts before it).  This replays that call along pretty-printed documents (as
SmolLM2-135M writes JSON: ``json.dumps(indent=2)``), with no model and no vLLM: the valid instance of every 7th
JSONSchemaBench dev schema both compilers take (``bench vllm_host``'s ``jsb_examples``; from ``../shared/data``,
skipped when absent), tokenized by the Qwen2.5 tokenizer (width 151,936) or SmolLM2's (``--tokenizer smollm2``),
xgrammar's masks, the budget at ``--max-tokens``.  A draft step drafts the document's next ``--k`` tokens and
commits ``--stride`` of them.  Reported: CPU us per check (the second of two passes: the first fills the
per-tokenizer tables), the certificate walks along the documents, and, with ``--against-walks``, the same with the
rejoined candidates off (``_rejoins``: a walk after every token that leaves the certificate, as before), and whether
every certificate along every document is as long in both.

    python scripts/budget_draft_check.py [--tokenizer qwen|smollm2] [--max-tokens 128] [--k 4] [--stride 2]
                                         [--against-walks]
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
    return TokenizerInfo.from_file(smollm2_folder_path(), vocab_size=49152)


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


def _replay(docs, make, max_tokens: int, k: int, stride: int, width: int) -> tuple[int, int, int]:
    """(checks, CPU ns, walks) of the drafts' checks along every document."""
    from specgrammar_plugins.api import RowCut

    calls = ns = walks = 0
    for compiled, ids in docs:
        budget = make(compiled, max_tokens)
        w0 = budget.walks
        cut = RowCut(budget, 16, "open", width, deterministic_drafts=True)
        for p in range(0, len(ids), stride):
            t0 = time.thread_time_ns()
            cut.fitting(np.array(ids[:p]), ids[p:p + k], remember=True)
            ns += time.thread_time_ns() - t0
            calls += 1
        walks += budget.walks - w0
    return calls, ns, walks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", choices=("qwen", "smollm2"), default="qwen")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--against-walks", action="store_true",
                    help="also replay with the rejoined candidates off, and compare the certificates")
    a = ap.parse_args(argv)
    from specgrammar_plugins.budget import CertifiedBudget

    tok = _tokenizer(a.tokenizer)
    if tok is None:
        print(f"budget_draft_check: the {a.tokenizer} tokenizer is absent; skipped", file=sys.stderr)
        return 0
    docs = _documents(tok, a.max_tokens)
    if not docs:
        print("budget_draft_check: no schemas from ../shared/data (absent?); skipped", file=sys.stderr)
        return 0

    class Walking(CertifiedBudget):
        @staticmethod
        def _rejoins(*args):
            return iter(())

    makes = {"rejoined": CertifiedBudget}
    if a.against_walks:
        makes["walks only"] = Walking
    print(f"{len(docs)} documents, {sum(len(i) for _, i in docs)} tokens, width {tok.vocab_size}, k {a.k}, "
          f"stride {a.stride}, max_tokens {a.max_tokens}")
    for name, make in makes.items():
        _replay(docs, make, a.max_tokens, a.k, a.stride, tok.vocab_size)
        calls, ns, walks = _replay(docs, make, a.max_tokens, a.k, a.stride, tok.vocab_size)
        print(f"{name:>10}: {ns / calls / 1e3:7.1f} us per check ({calls} checks), {walks} walks")
    if a.against_walks:
        same = 0
        for compiled, ids in docs:
            got = []
            for make in makes.values():
                b = make(compiled, a.max_tokens)
                b._sync(ids)
                got.append([None if c is None else len(c) for c in b._certs])
            same += got[0] == got[1]
        print(f"certificates as long at every position: {same} of {len(docs)} documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
