"""Benchmarks: ``masks`` (grammar engines: compile, per-token masks, draft masks, our overhead), ``strategies``
(the Onyx tables: six decoding strategies per host and workload), ``recipes`` (the kolm table), ``scale`` (verify
cost at a memory-bound shape, projected speedup), and the host benchmarks (``mlx_host``,
``llama_cpp_host``, ``vllm_host``).  Each module has a ``main(argv) -> int``; ``_report`` holds what they share
(``--out-dir`` with JSON + PNG, ``--quick``, progress bar)."""

import importlib
import sys

BENCHMARKS = {
    "masks": "grammar engines: compile ms, per-token mask us, k-token draft masks, our overhead",
    "coverage": "JSON Schema / GBNF coverage on MaskBench and llama.cpp grammars per engine and policy",
    "cost": "cost-aware laws: complete+valid within a budget below typical length, untilted vs adaptive lambda",
    "strategies": "baseline / blind draft / aware draft / forced / recipe / full chain per host and workload",
    "schemas": "real JSON Schemas (MaskBench dev): complete/valid within max_tokens with and without the budget mask, "
               "blind vs aware drafting per family",
    "recipes": "the kolm table: cold / draft model / recipe pack / both, coverage and accuracy against greedy",
    "scale": "verify k vs decode 1 at the Qwen2.5-0.5B shape (fp32, random weights) and the PROJECTED speedup",
    "overhead": "the loop's host work per round at V = 151,936 per law backend, beside the 0.5B forward time",
    "mlx_host": "mlx-lm: our loop vs mlx-lm constrained and mlx-lm's own speculative loop",
    "mlx_server": "mlx_lm.server --plugin specgrammar over HTTP: N JSON Schema requests serial / concurrent through "
                  "our loop (draft model) and mlx-lm's batching with our processor",
    "llama_cpp_host": "llama-cpp-python: our Llama vs stock Llama (no drafting / blind draft_model)",
    "vllm_host": "vLLM: our proposers vs vLLM's draft_model and ngram under the same structured outputs",
    "vllm_draft_host": "vLLM: the grammar-aware draft step's host work at V = 151,936, lazy vs every-row masking",
    "real": "the real model (SmolLM2-135M-Instruct) on llama-cpp-python, mlx-lm or vLLM (--host): tokens per "
            "target pass by drafter source, validity, wall-clock vs plain decoding and the host's own speculation",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0].replace("-", "_") not in BENCHMARKS:
        print("usage: specgrammar bench NAME [options]   (NAME --help for its options)\n")
        for name, what in BENCHMARKS.items():
            print(f"  {name:16} {what}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    mod = importlib.import_module(f"{__name__}.{argv[0].replace('-', '_')}")
    return int(mod.main(argv[1:]) or 0)
