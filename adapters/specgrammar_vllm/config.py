"""The one definition of how vLLM is told to use our proposer (``--speculative-config``), for the launcher
(``serve.py``), the offline ``LLM`` helpers (``offline.py``) and the benchmarks."""

from __future__ import annotations

import json

PROPOSER = "specgrammar_vllm.proposer.GrammarProposer"
METHODS = ("grammar", "ngram", "draft_model")


def speculative_config(method: str | None = "grammar", k: int = 4, draft_model: str | None = None,
                       **extra) -> dict | None:
    """vLLM's ``speculative_config`` for ``method``: ``"grammar"`` (our ``GrammarProposer`` through
    ``method="custom_class"``), ``"ngram"`` or ``"draft_model"`` (vLLM's own, for comparison), None (no speculation).
    ``k``: draft tokens per step."""
    if method is None:
        return None
    if method == "grammar":
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(k), **extra}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                **extra}
    if method == "draft_model":
        if draft_model is None:
            raise ValueError("method='draft_model' needs draft_model=PATH")
        return {"method": "draft_model", "model": draft_model, "num_speculative_tokens": int(k), **extra}
    raise ValueError(f"unknown method {method!r} ({', '.join(METHODS)} or None)")


def speculative_config_arg(k: int, **extra) -> str:
    """The ``--speculative-config`` command-line value for our proposer with ``k`` draft tokens."""
    return json.dumps(speculative_config("grammar", k, **extra))
