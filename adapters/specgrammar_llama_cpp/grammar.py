"""Constraints in llama-cpp-python's spellings, validated by our engines before llama.cpp ever sees them.

llama-cpp-python 0.3.36's ``LlamaGrammar.from_string`` only stores the text; llama.cpp parses it when the sampler
is built, and an invalid grammar makes ``llama_sampler_init_grammar`` return NULL, which
``LlamaSampler.add_grammar`` hands to ``llama_sampler_chain_add`` unchecked: the process segfaults
(_internals.py:755-759).  Here every grammar is compiled by one of our engines first (a clear ``ConstraintError``
when it is invalid); ``safe_grammar`` (for the stock sampling paths) then also asks llama.cpp's own parser, through
``llama_sampler_init_grammar`` directly and with its NULL checked, so nothing it returns can crash the host.
"""

from __future__ import annotations

import json
from typing import Any

from llama_cpp import llama_cpp
from llama_cpp.llama_grammar import LlamaGrammar

from specgrammar_plugins.api import (CompiledConstraint, ConstraintError, ConstraintSpec, SpecOptions, TokenizerInfo,
                                     compile_constraint)


class ValidatedGrammar(LlamaGrammar):
    """A constraint compiled by our engine, carried through llama-cpp-python's ``grammar=`` argument (which the
    completion and chat paths pass untouched down to ``Llama.generate``) together with the request's
    speculation options.  ``SpecLlama.generate`` uses ``compiled``; llama.cpp's sampler never sees it
    (``_grammar`` is empty: were it ever handed to llama.cpp, an empty grammar string builds no grammar rather
    than crashing)."""

    def __init__(self, spec: ConstraintSpec | None, compiled: CompiledConstraint | None,
                 options: SpecOptions = SpecOptions()):
        super().__init__(_grammar="")
        self.spec = spec
        self.compiled = compiled
        self.options = options

    def __repr__(self) -> str:
        return f"ValidatedGrammar({self.spec!r})"


def spec_of(obj: Any) -> ConstraintSpec | None:
    """Our ``ConstraintSpec`` for anything llama-cpp-python code passes as a grammar: a ``LlamaGrammar`` (its GBNF
    text, root rule ``root``), a GBNF string, a ``ConstraintSpec`` or a ``ValidatedGrammar``."""
    if obj is None:
        return None
    if isinstance(obj, ValidatedGrammar):
        return obj.spec
    if isinstance(obj, ConstraintSpec):
        return obj
    if isinstance(obj, LlamaGrammar):
        if getattr(obj, "_root", "root") != "root":
            raise ConstraintError(f"grammar root rule must be 'root', got {obj._root!r}", kind="grammar")
        return ConstraintSpec.grammar(obj._grammar, "gbnf")
    if isinstance(obj, str):
        return ConstraintSpec.grammar(obj, "gbnf")
    raise TypeError(f"grammar must be a LlamaGrammar, a GBNF string or a ConstraintSpec, not {type(obj).__name__}")


def compile_for(obj: Any, tokinfo: TokenizerInfo, engine: str | None = None) -> CompiledConstraint | None:
    """Compile whatever ``spec_of`` reads (reusing a ``ValidatedGrammar``'s compilation when it was made for this
    vocabulary and width). Raises ``ConstraintError`` for anything invalid."""
    if isinstance(obj, ValidatedGrammar) and obj.compiled is not None:
        c = obj.compiled
        if c.tokenizer.fingerprint == tokinfo.fingerprint and c.tokenizer.vocab_size == tokinfo.vocab_size:
            return c
    spec = spec_of(obj)
    if spec is None:
        return None
    if isinstance(obj, ValidatedGrammar) and engine is None:
        engine = obj.options.engine
    return compile_constraint(spec, tokinfo, engine=engine)


def _choice_gbnf(choices) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + "\n"


def gbnf_of(spec: ConstraintSpec) -> str:
    """GBNF text for llama.cpp's own grammar sampler (gbnf grammars, JSON schemas through llama-cpp-python's own
    converter, any-JSON, choices).  Regexes and Lark/EBNF have none: use ``SpecLlama`` or the history-keyed
    ``GrammarLogitsProcessor`` for those."""
    from llama_cpp import llama_grammar

    if spec.trigger is not None:
        raise ConstraintError("llama.cpp's grammar sampler has no deferred trigger: use SpecLlama", kind=spec.kind)
    if spec.kind == "grammar" and spec.syntax == "gbnf":
        return spec.value
    if spec.kind == "json_schema":
        try:
            return llama_grammar.json_schema_to_gbnf(spec.value)
        except Exception as e:  # the host's converter refuses something our engine accepted
            raise ConstraintError(f"llama-cpp-python's schema converter: {type(e).__name__}: {e}",
                                  kind="json_schema") from None
    if spec.kind == "json":
        schema = {"type": "object"} if spec.option("object_only") else {}
        return llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    if spec.kind == "choice":
        return _choice_gbnf(spec.value)
    raise ConstraintError(f"llama.cpp's grammar sampler takes GBNF; a {spec.kind} constraint"
                          f"{' (' + spec.syntax + ')' if spec.syntax else ''} has no GBNF form here: use SpecLlama "
                          "or GrammarLogitsProcessor", kind=spec.kind)


def llama_cpp_accepts(llama, gbnf: str) -> bool:
    """Ask llama.cpp's own parser (``llama_sampler_init_grammar`` returns NULL for a grammar it rejects; only the
    unchecked chain insertion in llama-cpp-python crashes)."""
    s = llama_cpp.llama_sampler_init_grammar(llama._model.vocab, gbnf.encode("utf-8"), b"root")
    if not s:
        return False
    llama_cpp.llama_sampler_free(s)
    return True


def safe_grammar(constraint: Any, llama, engine: str | None = None) -> LlamaGrammar:
    """A ``LlamaGrammar`` that is safe to hand to the stock ``Llama`` paths (``grammar=``).

    constraint: a GBNF string, a ``LlamaGrammar``, a ``ConstraintSpec`` (gbnf, json_schema, json, choice).
    Our engine compiles it first (``ConstraintError`` with the engine's reason when invalid); then llama.cpp's
    parser is asked directly, NULL checked; only then is a ``LlamaGrammar`` made.
    """
    from .runner import tokenizer_info

    spec = spec_of(constraint)
    if spec is None:
        raise ConstraintError("no constraint given")
    compile_constraint(spec, tokenizer_info(llama), engine=engine)  # our engines judge first
    text = gbnf_of(spec)
    if not llama_cpp_accepts(llama, text):
        raise ConstraintError("llama.cpp's grammar parser rejects this grammar (our engine accepted it): "
                              "see llama.cpp's log above for its reason", engine="llama.cpp", kind=spec.kind)
    return LlamaGrammar.from_string(text, verbose=False)


__all__ = ["ValidatedGrammar", "compile_for", "gbnf_of", "llama_cpp_accepts", "safe_grammar", "spec_of"]
