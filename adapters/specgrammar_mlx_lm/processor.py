"""A history-keyed, rollback-safe grammar logits processor for mlx-lm's own loops.

    proc = grammar_logits_processor(ConstraintSpec.regex(r"[0-9]{4}"), tokenizer, model)
    mlx_lm.generate(model, tokenizer, prompt, logits_processors=[proc])            # generate_step
    mlx_lm.generate(..., draft_model=draft, logits_processors=[proc])              # speculative_generate_step
    BatchGenerator(model).insert(..., logits_processors=[[proc]])                  # the server's batching path

mlx-lm calls a processor as ``processor(tokens, logits)`` with a token history, never telling it which tokens
were accepted.  The history's start differs by loop (mlx-lm 0.32.2): the whole prompt in ``generate_step`` and
``BatchGenerator``, only the last prompt token in ``speculative_generate_step``; under speculation it moves
backwards (rejected drafts) and forwards (accepted blocks).  So the processor takes the history length of its
first call as the prompt, and derives the grammar state from what follows it alone: the core's
``MaskProcessor`` (roll back to the longest common prefix, never feed a token the grammar rejects).  This module
only converts its boolean row into an mlx array.  One processor per request.
"""

from __future__ import annotations

import numpy as np

from specgrammar_plugins.api import (CompiledConstraint, MaskProcessor, SpecOptions, StopOnlyMask, check_budget,
                                     compile_for, tokenizer_info)

__all__ = ["GrammarLogitsProcessor", "compile_for", "grammar_logits_processor", "stop_only_processor",
           "tokenizer_info"]  # compile_for, tokenizer_info: the core's (api), as this module named them

class GrammarLogitsProcessor:
    """``processor(tokens, logits) -> logits`` with every token the mask forbids set to -inf.

    mask: a core ``MaskProcessor`` (the grammar after the history) or ``StopOnlyMask``; a ``CompiledConstraint``
    is wrapped in a fresh ``MaskProcessor`` (``prompt_len``: the history length that is prompt; None = the length
    of the first call's history; ``fit``: the request's exact budget, ``check_budget(..., exact_only=True)``).
    """

    def __init__(self, mask, prompt_len: int | None = None, fit=None):
        if isinstance(mask, CompiledConstraint):
            mask = MaskProcessor(mask, prompt_len, fit)
        self.mask = mask

    @property
    def compiled(self):
        return getattr(self.mask, "compiled", None)

    @property
    def calls(self) -> int:
        return getattr(self.mask, "calls", 0)

    @property
    def invalid_calls(self) -> int:
        return getattr(self.mask, "invalid_calls", 0)

    def __call__(self, tokens, logits):
        import mlx.core as mx

        hist = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens or [])
        allowed = self.mask.allowed(hist, logits.shape[-1])
        return mx.where(mx.array(allowed), logits, mx.array(-np.inf, dtype=logits.dtype))


def stop_only_processor(stop_token_ids, reason: str = "") -> GrammarLogitsProcessor:
    """A processor that allows only the stop tokens (a request whose constraint failed at generation time)."""
    return GrammarLogitsProcessor(StopOnlyMask(stop_token_ids, reason))


def grammar_logits_processor(constraint, tokenizer, model=None, *, width: int | None = None,
                             engine: str | None = None, prompt_len: int | None = None,
                             max_tokens: int | None = None, options: SpecOptions | None = None
                             ) -> GrammarLogitsProcessor:
    """A fresh processor for one request (``constraint``: ConstraintSpec or CompiledConstraint).  With
    ``max_tokens`` the exact budget bound is part of the row where the constraint has one (regex, choice, GBNF
    without recursion, ...; ``BudgetError`` when it cannot end in time): mlx-lm's own sampler cannot draw again,
    so the certified bound (``check_budget``) needs our loop (``stream_generate``)."""
    if width is None:
        if model is None:
            raise ValueError("pass the model (or width=) so masks match its output width")
        from .runner import output_width

        width = output_width(model)
    compiled = compile_for(constraint, tokenizer, width, engine)
    fit = check_budget(compiled, options or SpecOptions(), max_tokens, exact_only=True) if max_tokens else None
    return GrammarLogitsProcessor(compiled, prompt_len, fit)
