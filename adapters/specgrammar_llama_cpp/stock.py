"""Grammar-aware pieces for users who keep llama-cpp-python's stock ``Llama`` loop.

- ``GrammarLogitsProcessor``: a history-keyed grammar mask (core ``HistoryMatcher``) as a ``logits_processor``.
- ``GrammarDraftModel``: a ``LlamaDraftModel`` that drafts only grammar-valid tokens (forced tokens, then a draft
  ``Llama`` under the grammar mask), so the host's drafts are not wasted on tokens its grammar must reject.
- ``safe_grammar`` (grammar.py): a ``LlamaGrammar`` our engine and llama.cpp's parser both accepted.

The host's caveats (llama-cpp-python 0.3.36), which these pieces live with:

- Verification is sample-and-match (llama.py:978-1014): each position is sampled with the full sampler (grammar and
  processors included) and a draft is kept only if it equals the sample.  Exact, but at T > 0 acceptance is
  sum(p*q), not sum(min(p, q)); the draft's probabilities are never used.  For exact residual verification use
  ``SpecLlama``.
- ``draft_model=`` forces logits for every token (llama.py:351) but sizes the scores buffer from the
  ``logits_all`` *argument*: with the default ``logits_all=False`` and ``n_ctx > n_batch`` a long enough prompt
  raises ``ValueError`` (llama.py:484, 687).  Pass ``logits_all=True`` with ``draft_model`` (n_ctx x n_vocab floats).
- During verification a ``logits_processor`` is called with ``input_ids`` = every evaluated id, the unverified
  drafts included (llama.py:742), whichever position is being sampled, and it is never told which draft was
  accepted.  ``GrammarLogitsProcessor(llama=...)`` routes around it by finding the position being sampled (the
  row of the last decode whose logits it was given); without ``llama=`` it is only correct with no ``draft_model``.
  Under ``draft_model`` prefer ``grammar=safe_grammar(...)`` (llama.cpp's grammar sampler accepts only sampled
  tokens, so it follows the committed prefix).
- ``logits_processor`` together with ``logit_bias`` silently drops both (llama.py:1339; ``SpecLlama`` merges them).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from llama_cpp import llama_cpp
from llama_cpp.llama_speculative import LlamaDraftModel

from specgrammar_plugins.api import (GREEDY, CompiledConstraint, DraftBlock, HistoryMatcher, MaskProcessor, ModelRunner,
                                     RequestBoundary, SpecOptions, fill, make_drafter)

from .grammar import compile_for
from .runner import LlamaRunner, tokenizer_info

MAX_ROWS = 64  # how far back GrammarLogitsProcessor looks for the row being sampled


def _compiled(constraint: Any, llama, engine: str | None) -> CompiledConstraint:
    if isinstance(constraint, CompiledConstraint):
        return constraint
    if llama is None:
        raise ValueError("pass the Llama (its vocabulary compiles the constraint) or a CompiledConstraint")
    c = compile_for(constraint, tokenizer_info(llama), engine)
    if c is None:
        raise ValueError("no constraint given")
    return c


class GrammarLogitsProcessor:
    """A llama-cpp-python ``logits_processor`` that masks every token the grammar forbids after the history (the
    core's ``MaskProcessor``; this class only finds the history of the row being sampled and converts the row).

    constraint: ``ConstraintSpec`` / GBNF / ``LlamaGrammar`` / ``CompiledConstraint``; llama: the ``Llama`` it runs
    on (needed to compile a spec, and to find the position being sampled under ``draft_model``; see the module
    docstring).  One instance per request (or ``reset(prompt_len)`` between requests).
    """

    def __init__(self, constraint: Any, llama=None, *, prompt_len: int | None = None, engine: str | None = None):
        self.llama = llama
        self.mask = MaskProcessor(_compiled(constraint, llama, engine), prompt_len)

    def reset(self, prompt_len: int | None = None) -> None:
        self.mask.reset(prompt_len)

    @property
    def calls(self) -> int:
        return self.mask.calls

    @property
    def invalid_histories(self) -> int:
        return self.mask.invalid_calls

    def _history(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """The ids up to the position being sampled: under ``draft_model`` the host passes all evaluated ids, so
        find which of the last decode's output rows these logits are (llama.py:742 gives no index)."""
        llama = self.llama
        if llama is None or getattr(llama, "draft_model", None) is None:
            return input_ids
        n = len(input_ids)
        ctx = llama.ctx
        v = len(scores)
        for back in range(1, min(n, MAX_ROWS) + 1):
            ptr = llama_cpp.llama_get_logits_ith(ctx, -back)
            if not ptr:
                break
            if np.array_equal(np.ctypeslib.as_array(ptr, shape=(v,)), scores):
                return input_ids[: n - back + 1]
        return input_ids

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        allowed = self.mask.allowed(self._history(input_ids, scores), len(scores))
        return np.where(allowed, scores, -np.inf).astype(scores.dtype, copy=False)


class GrammarDraftModel(RequestBoundary, LlamaDraftModel):
    """A ``LlamaDraftModel`` proposing up to ``k`` grammar-valid tokens: the grammar's forced tokens, then greedy
    tokens of a draft model under the grammar mask (the host matches drafts against its own samples, so a point
    guess is all it uses).  The history comes from the ``input_ids`` the host passes (the accepted prefix plus the
    token just sampled).

    draft: a ``Llama`` (same vocabulary) or any core ``ModelRunner``, or None for forced tokens only.
    constraint: as ``GrammarLogitsProcessor``, or None for a grammar-blind draft (the usual stock drafter, which
    benchmarks compare with); target: the target ``Llama`` (its vocabulary compiles the grammar; default: the
    draft's).  One instance per request, or ``reset(prompt_len)`` between requests; otherwise the
    first call's history minus its last token is taken as the prompt.
    """

    def __init__(self, draft, constraint: Any, *, target=None, k: int = 4, drafters: Sequence[str] = ("forced", "model"),
                 prompt_len: int | None = None, engine: str | None = None):
        super().__init__(prompt_len)
        vocab_of = target if target is not None else draft
        if draft is not None and not hasattr(draft, "forward"):
            if target is not None:
                tokenizer_info(draft).check_same_vocab(tokenizer_info(target), "draft and target")
            draft = LlamaRunner(draft)
        self.runner: ModelRunner | None = draft
        self.compiled = _compiled(constraint, vocab_of, engine) if constraint is not None else None
        self.history = HistoryMatcher(self.compiled) if self.compiled is not None else None
        self.k = k
        tokinfo = self.compiled.tokenizer if self.compiled is not None else tokenizer_info(vocab_of)
        self.width = tokinfo.vocab_size if self.compiled is not None else (draft.vocab_size if draft is not None
                                                                           else tokinfo.vocab_size)
        self.stop_token_ids = tokinfo.stop_token_ids
        self.drafter = make_drafter(SpecOptions(k=k, drafters=tuple(drafters)), tokinfo, params=GREEDY,
                                    rng=np.random.default_rng(0), draft_runner=draft, target_vocab_size=self.width)
        self.calls = 0
        self.proposed = 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        self.calls += 1
        generated = self.generated(input_ids, first_is_prompt=1)
        matcher = None
        if self.history is not None:
            if not self.history.sync(generated) or self.history.matcher.is_terminated():
                return np.array([], dtype=np.intc)
            matcher = self.history.matcher.fork()
        if self.drafter is None:
            return np.array([], dtype=np.intc)
        block = DraftBlock([int(t) for t in input_ids], matcher, self.width, self.k,
                           self.stop_token_ids if matcher is not None else ())
        fill(block, self.drafter)
        self.proposed += len(block.tokens)
        return np.array(block.tokens, dtype=np.intc)


__all__ = ["GrammarDraftModel", "GrammarLogitsProcessor"]
