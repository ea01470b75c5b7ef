"""Plain greedy decoding of a ``transformers`` causal LM with (optionally) a grammar mask from the core.

The reference the tiny models are measured with (``scripts/build_models.py``) and tested against: one token per
step, KV cache, fp32, mask -> ``log_law(..., GREEDY)`` -> first argmax -> ``matcher.accept``.  Imports torch lazily.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..compiler import compile_constraint
from ..constraint import ConstraintSpec
from ..masks import mask_words
from ..distributions import GREEDY, log_law
from ..tokenizer import TokenizerInfo


def default_engine(spec: ConstraintSpec) -> str:
    """``dfa`` for regular constraints (regex, choice), ``xgrammar`` for the rest."""
    return "dfa" if spec.as_regex() is not None else "xgrammar"


def greedy_generate(model, tok: TokenizerInfo, prompt_ids: Sequence[int], spec: ConstraintSpec | None = None,
                    engine: str | None = None, max_new_tokens: int = 64) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (stop token included when produced).

    With ``spec``, every step is masked by a matcher of ``spec`` compiled for ``tok`` (its ``vocab_size`` must be the
    model's output width) and decoding stops when the matcher terminates.  Without, it stops at a stop token.
    """
    import torch

    matcher = None
    row = None
    if spec is not None:
        matcher = compile_constraint(spec, tok, engine=engine or default_engine(spec)).matcher()
        row = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)
    stops = set(tok.stop_token_ids)
    out: list[int] = []
    with torch.no_grad():
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        res = model(input_ids=ids, use_cache=True)
        past = res.past_key_values
        logits = res.logits[0, -1].float().numpy()
        for _ in range(max_new_tokens):
            if matcher is not None:
                matcher.fill_mask(row)
                t = int(np.argmax(log_law(logits, row, GREEDY)))
                if not matcher.accept(t):
                    raise RuntimeError(f"matcher rejected token {t} it allowed")
            else:
                t = int(np.argmax(logits))
            out.append(t)
            if (matcher is not None and matcher.is_terminated()) or (matcher is None and t in stops):
                break
            res = model(input_ids=torch.tensor([[t]], dtype=torch.long), past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float().numpy()
    return out


def teacher_forced_argmax(model, ids: Sequence[int]) -> np.ndarray:
    """Greedy next-token choice at every position of ``ids`` (one forward pass)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)], dtype=torch.long)).logits[0].float().numpy()
    return np.argmax(logits, axis=-1)


__all__ = ["default_engine", "greedy_generate", "teacher_forced_argmax"]
