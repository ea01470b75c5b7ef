"""The mlx-lm adapter: ``MLXRunner`` (ModelRunner over an mlx-lm model and its KV cache), a ``stream_generate``
twin running the core speculative loop, the history-keyed ``GrammarLogitsProcessor`` for mlx-lm's own loops,
the ``mlx_lm.server --plugin specgrammar`` plugin, ``specgrammar patch mlx-lm`` and ``load`` (``mlx_lm.load`` by
model name, e.g. ``load("smollm2-135m")``, or path).

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
    "load": ".loading",
    "model_folder": ".loading",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(name)


__all__ = sorted(_EXPORTS)
