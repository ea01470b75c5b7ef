"""The mlx-lm adapter: ``MLXRunner`` (ModelRunner over an mlx-lm model and its KV cache), a ``stream_generate``
twin running the core speculative loop, the history-keyed ``GrammarLogitsProcessor`` for mlx-lm's own loops,
the ``mlx_lm.server --plugin specgrammar`` plugin and ``specgrammar patch mlx-lm``.

mlx and mlx-lm are imported lazily: importing this package needs neither.
"""

from __future__ import annotations

_EXPORTS = {
    "MLXRunner": ".runner",
    "NotTrimmableCacheError": ".runner",
    "stream_generate": ".generate",
    "generate": ".generate",
    "generate_tokens": ".generate",
    "GenerationResponse": ".generate",
    "GrammarLogitsProcessor": ".processor",
    "grammar_logits_processor": ".processor",
    "tokenizer_info": ".processor",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(name)


__all__ = sorted(_EXPORTS)
