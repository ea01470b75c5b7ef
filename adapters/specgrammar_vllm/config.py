"""The one definition of how vLLM is told to use our proposers (``--speculative-config``), for the launcher
(``serve.py``), the offline ``LLM`` helpers (``offline.py``) and the benchmarks.

- forced tokens + recipe packs, no draft model: ``method="custom_class"`` with ``GrammarProposer``;
- with a draft model: vLLM's own ``method="draft_model"``; the specgrammar general plugin makes vLLM build the
  grammar-aware ``GrammarDraftProposer`` for it (host drafts first, then the draft model masked by the grammar).
  vLLM's grammar-blind proposer, for comparison: the same config with ``additional_config={"specgrammar":
  {"grammar_drafts": False}}`` (``BLIND``), or ``SPECGRAMMAR_VLLM_DRAFTS=0`` for the whole process;
- with an EAGLE / EAGLE-3 head: vLLM's own ``method="eagle"`` / ``"eagle3"``; the plugin makes vLLM build the
  grammar-aware ``GrammarEagleProposer`` for it (and for ``"mtp"``, the target's own MTP layers); grammar-blind
  with ``BLIND`` as above.
"""

from __future__ import annotations

import json

PROPOSER = "specgrammar_vllm.proposer.GrammarProposer"
METHODS = ("grammar", "ngram", "draft_model", "eagle", "eagle3")
# the methods whose proposer is a SpecDecodeBaseProposer running a model (ours, with the plugin): V1 model runner,
# committed tokens on the host (no async scheduling)
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# the methods of ``speculative_config`` that take a draft model or head (``draft_model=PATH``; "grammar" only with one)
DRAFT_MODEL_METHODS = ("grammar", "draft_model", "eagle", "eagle3")
BLIND = {"grammar_drafts": False}
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


def speculative_config(method: str | None = "grammar", k: int = 4, draft_model: str | None = None,
                       **extra) -> dict | None:
    """vLLM's ``speculative_config`` for ``method``: ``"grammar"`` (ours: ``GrammarProposer`` through
    ``method="custom_class"``, or with ``draft_model`` vLLM's ``draft_model`` method, which the plugin makes
    grammar-aware), ``"ngram"`` or ``"draft_model"`` (the draft-model config; grammar-blind only with ``BLIND``
    in the engine's additional config), ``"eagle"`` / ``"eagle3"`` (vLLM's EAGLE method with the head
    ``draft_model``, grammar-aware unless ``BLIND``), None (no speculation).  ``k``: draft tokens per step;
    ``extra``: more ``SpeculativeConfig`` fields (e.g. ``draft_sample_method="probabilistic"``)."""
    if method is None:
        return None
    if method == "grammar" and draft_model is None:
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(k), **extra}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                **extra}
    if method in DRAFT_MODEL_METHODS:
        name = "draft_model" if method == "grammar" else method
        if draft_model is None:
            raise ValueError(f"method={name!r} needs draft_model=PATH")
        return {"method": name, "model": str(draft_model), "num_speculative_tokens": int(k), **extra}
    raise ValueError(f"unknown method {method!r} ({', '.join(METHODS)} or None)")


def speculative_config_arg(k: int, draft_model: str | None = None, **extra) -> str:
    """The ``--speculative-config`` command-line value for our proposers with ``k`` draft tokens."""
    return json.dumps(speculative_config("grammar", k, draft_model, **extra))


def uses_draft_model(sc: dict | str | None) -> bool:
    """Whether a ``--speculative-config`` (dict or JSON) runs a draft model or head through one of vLLM's
    ``SpecDecodeBaseProposer`` classes (``MODEL_METHODS``: draft_model, eagle, eagle3, mtp), which our proposers
    extend."""
    if isinstance(sc, str):
        try:
            sc = json.loads(sc)
        except ValueError:
            return False
    if not isinstance(sc, dict):
        return False
    return sc.get("method") in MODEL_METHODS or (sc.get("method") is None and bool(sc.get("model")))
