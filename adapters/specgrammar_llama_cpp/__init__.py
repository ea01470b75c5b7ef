"""llama-cpp-python adapter (llama-cpp-python 0.3.36).

- ``SpecLlama``: a ``llama_cpp.Llama`` whose ``generate()`` runs the core speculative loop (completion, chat
  completion and streaming all go through it); see ``llama.py``.
- Stock-path pieces: ``GrammarDraftModel`` (grammar-aware ``LlamaDraftModel``), ``GrammarLogitsProcessor``
  (history-keyed mask) and ``safe_grammar`` (a ``LlamaGrammar`` validated before llama.cpp sees it); see ``stock.py``.
- ``LlamaRunner`` / ``tokenizer_info``: the core's view of a llama.cpp context and vocabulary; see ``runner.py``.

``llama_cpp`` is imported only when one of these names is first used.
"""

_EXPORTS = {
    "SpecLlama": ".llama", "sampling_params": ".llama",
    "GrammarDraftModel": ".stock", "GrammarLogitsProcessor": ".stock",
    "ValidatedGrammar": ".grammar", "safe_grammar": ".grammar", "gbnf_of": ".grammar",
    "LlamaRunner": ".runner", "tokenizer_info": ".runner",
}


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(mod, __name__), name)


__all__ = sorted(_EXPORTS)
