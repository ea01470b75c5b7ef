"""A ``ModelRunner`` over a ``transformers`` causal LM (torch, CPU): the proposer's optional draft model.

One runner per request (its own ``DynamicCache``; the weights are shared).  ``trim`` crops the cache, so the
core's ``ModelDrafter`` can follow the committed sequence by longest common prefix.  Logits stay torch tensors
(``tensors = "torch"``): the draft laws are computed by the torch law backend.
"""

from __future__ import annotations

from typing import Sequence


def load_draft_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


class TorchRunner:
    tensors = "torch"

    def __init__(self, model, vocab_size: int | None = None):
        self.model = model
        self.vocab_size = int(vocab_size or model.config.vocab_size)
        self._tokens: list[int] = []
        self._cache = None

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    def forward(self, tokens: Sequence[int], logits_for: int | None = None):
        """Feed ``tokens``; torch float32 logits [m, vocab_size] of the last ``m = logits_for``."""
        import torch
        from transformers import DynamicCache

        toks = [int(t) for t in tokens]
        m = len(toks) if logits_for is None else int(logits_for)
        if not toks:
            return torch.zeros((0, self.vocab_size), dtype=torch.float32)
        if self._cache is None:
            self._cache = DynamicCache()
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([toks]), past_key_values=self._cache, use_cache=True,
                             logits_to_keep=max(m, 1))
        self._tokens.extend(toks)
        if m == 0:
            return torch.zeros((0, self.vocab_size), dtype=torch.float32)
        logits = out.logits[0, -m:].float()
        if logits.shape[-1] < self.vocab_size:
            pad = torch.full((m, self.vocab_size - logits.shape[-1]), float("-inf"), dtype=torch.float32)
            logits = torch.cat([logits, pad], dim=-1)
        return logits[:, : self.vocab_size]

    def trim(self, n: int) -> None:
        if n <= 0:
            return
        n = min(n, len(self._tokens))
        keep = len(self._tokens) - n
        if self._cache is not None and n:
            self._cache.crop(-n)
        del self._tokens[keep:]
