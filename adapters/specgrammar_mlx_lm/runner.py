"""``ModelRunner`` over an mlx-lm model and its KV cache (the core's view of an mlx model).

    runner = MLXRunner(model)                 # a fresh cache from ``make_prompt_cache``
    logits = runner.forward([1, 2, 3])        # mx.array float32 [3, vocab]; the cache now holds the 3 tokens
    runner.trim(2)                            # O(1): ``trim_prompt_cache`` (KVCache.trim is ``offset -= n``)

The logits stay in mlx (``tensors = "mlx"``): the loop computes the law and verifies with the mlx law backend,
so only verdicts and sampled tokens cross to the host.

A runner may also wrap a cache that already holds tokens (the server's prompt cache): pass the tokens it holds
(``tokens=``); when they are not known, the cache's offset is trusted and the held tokens are opaque.
Caches that cannot be trimmed (``ArraysCache`` of SSM/hybrid models, ``RotatingKVCache`` once it wrapped) are
refused with ``NotTrimmableCacheError``: speculation needs rollback.
"""

from __future__ import annotations

from typing import Sequence

from specgrammar_plugins.api import SpecGrammarError, sync_runner

OPAQUE = -1  # a held token whose id is unknown (a cache handed over without its tokens)


class NotTrimmableCacheError(SpecGrammarError, ValueError):
    """The model's KV cache cannot be rolled back, so speculative decoding cannot run on it."""


def cache_offset(cache: Sequence) -> int:
    """How many tokens an mlx-lm prompt cache (list of per-layer caches) holds."""
    if not cache:
        return 0
    off = getattr(cache[0], "offset", None)
    if off is None:
        raise NotTrimmableCacheError(f"cannot tell how many tokens a {type(cache[0]).__name__} holds")
    return int(off)


def check_trimmable(cache: Sequence, what: str = "model") -> None:
    from mlx_lm.models.cache import can_trim_prompt_cache

    if not can_trim_prompt_cache(list(cache)):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise NotTrimmableCacheError(
            f"speculative decoding needs a trimmable KV cache, but the {what}'s cache holds {', '.join(kinds)} "
            "(SSM/hybrid layers or a rotating window cannot be rolled back); use a model with a plain KVCache")


def output_width(model) -> int:
    """The model's logit row length (its output width, which may exceed the tokenizer's vocabulary)."""
    args = getattr(model, "args", None)
    for name in ("vocab_size",):
        v = getattr(args, name, None)
        if isinstance(v, int) and v > 0:
            return v
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    out = model(mx.array([[0]]), cache=make_prompt_cache(model))
    return int(out.shape[-1])


class MLXRunner:
    """An mlx-lm model with its prompt cache, as a core ``ModelRunner``.

    model: an ``nn.Module`` from ``mlx_lm.load``.  cache: its prompt cache (list of layer caches; a new one when
    None).  tokens: the token ids the cache holds (prefix-consistent with its offset; extra held tokens beyond
    ``len(tokens)`` are trimmed, missing ids are marked ``OPAQUE``).  stream: the mlx stream to run on.
    """

    tensors = "mlx"  # forward returns mx.array rows (laws.for_runner picks the mlx law backend)

    def __init__(self, model, cache: list | None = None, tokens: Sequence[int] | None = None, *, stream=None,
                 prefill_step_size: int = 2048, what: str = "model"):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.cache = cache if cache is not None else make_prompt_cache(model)
        check_trimmable(self.cache, what)
        self.stream = stream
        self.prefill_step_size = prefill_step_size
        self.vocab_size = output_width(model)
        self.passes = 0  # forward calls that returned logits
        self.last_logits = None  # the rows the last forward returned (mx.array)
        off = cache_offset(self.cache)
        known = list(tokens) if tokens is not None else [OPAQUE] * off
        if off > len(known):  # held tokens we cannot name: drop them
            self._trim_cache(off - len(known))
            off = len(known)
        self._tokens: list[int] = [int(t) for t in known[:off]]

    # ---------------------------------------------------------------------------------------- protocol
    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def _call(self, tokens: Sequence[int]):
        import mlx.core as mx

        return self.model(mx.array([list(tokens)], dtype=mx.uint32), cache=self.cache)

    def forward(self, tokens: Sequence[int], logits_for: int | None = None):
        """Feed ``tokens``; mx.array float32 logits [m, vocab] of the last ``m = logits_for`` (all when None)."""
        import mlx.core as mx

        tokens = [int(t) for t in tokens]
        if any(t < 0 for t in tokens):
            raise ValueError("cannot feed tokens whose ids are unknown (OPAQUE)")
        m = len(tokens) if logits_for is None else int(logits_for)
        if not tokens:
            return mx.zeros((0, self.vocab_size), dtype=mx.float32)
        ctx = mx.stream(self.stream) if self.stream is not None else _null()
        with ctx:
            # feed the part whose logits are not wanted in chunks (long prompts), then the rest in one call
            head = len(tokens) - max(m, 1)
            i = 0
            while i < head:
                n = min(self.prefill_step_size, head - i)
                self._call(tokens[i:i + n])
                mx.eval([c.state for c in self.cache])
                i += n
            out = self._call(tokens[i:])
            self._tokens.extend(tokens)
            if m == 0:
                mx.eval([c.state for c in self.cache])
                return mx.zeros((0, self.vocab_size), dtype=mx.float32)
            rows = out[0, -m:, :].astype(mx.float32)
            mx.eval(rows)
        self.passes += 1
        self.last_logits = rows
        return rows

    def _trim_cache(self, n: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        if n > 0:
            trim_prompt_cache(self.cache, n)

    def trim(self, n: int) -> None:
        if n < 0 or n > len(self._tokens):
            raise ValueError(f"cannot trim {n} of {len(self._tokens)} tokens")
        if n:
            self._trim_cache(n)
            del self._tokens[-n:]

    # ---------------------------------------------------------------------------------------- helpers
    def sync(self, want: Sequence[int]) -> None:
        """Bring the cache to hold exactly ``want``: trim to the longest common prefix, feed the rest (a ValueError
        if the rest holds ids that are unknown, ``OPAQUE``)."""
        sync_runner(self, want)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
