"""The xgrammar engine: regex, choice, JSON Schema, any JSON, GBNF / W3C-style EBNF (xgrammar's own dialect) and Lark.

xgrammar's ``GrammarMatcher`` already speaks our protocol almost word for word (packed int32 rows, ``fork()``,
``rollback``, ``accept_string``, stop tokens allowed where the grammar may end); the adapter adds step bookkeeping
so ``accept_bytes`` merges into the current position, masks of zeros after termination, and two fixes:
llama.cpp GBNF's empty alternatives (``a ::= "x" |``) are rewritten to ``""`` (xgrammar rejects them), and a
constraint that allows no first token is refused at compile time.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from ..constraint import CompiledConstraint, ConstraintSpec, Forced
from ..masks import mask_words
from ..errors import ConstraintError
from ..gbnf import fill_empty_alternatives, normalize_gbnf  # noqa: F401  (re-exported)
from ..tokenizer import TokenizerInfo
from ._common import (
    PerTokenizerCache, StepBook, ascii_shorthands, clear_past, engine_words, forced_cap, forced_from_masks, native_stderr,
    no_start_error, popcount, refuse_empty_choices, write_stderr)

NAME = "xgrammar"


def _build_info(tok: TokenizerInfo):
    import xgrammar as xgr

    return xgr.TokenizerInfo(list(tok.token_bytes), xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                             stop_token_ids=list(tok.stop_token_ids))


def _build_compiler(tok: TokenizerInfo):
    import xgrammar as xgr

    threads = max(1, min(8, os.cpu_count() or 1))
    # xgrammar's own compile cache is unbounded by default (cache_limit_bytes=-1): it kept every grammar ever
    # compiled (~16 KB per small schema on a 1k vocabulary, far more on a 150k one), past our bounded LRU
    # (constraint.CACHE), which already keeps the compiled grammars worth keeping
    return xgr.GrammarCompiler(_INFOS.get(tok), max_threads=threads, cache_enabled=False)


_INFOS = PerTokenizerCache(_build_info)
_COMPILERS = PerTokenizerCache(_build_compiler)


def _no_surrogate_row(tok: TokenizerInfo) -> np.ndarray:
    """Packed row allowing every token except those starting with a byte A0..BF (what may not follow a lone ED)."""
    keep = np.ones(tok.vocab_size, dtype=bool)
    for i, b in enumerate(tok.token_bytes[: tok.vocab_size]):
        if b and 0xA0 <= b[0] <= 0xBF:
            keep[i] = False
    from ..masks import pack_mask

    return pack_mask(keep)


# xgrammar 0.2.8 lets a lone ED byte go on with A0..BF, the UTF-8-like encoding of a UTF-16 surrogate
# (U+D800..U+DFFF), which is not UTF-8: ``[^a-z]`` (or any JSON string) could produce b"\xed\xbb\x80".  The
# matcher remembers whether the bytes so far end in ED and then clears the tokens that start with A0..BF.
_NO_SURROGATE = PerTokenizerCache(_no_surrogate_row)
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")


# ---------------------------------------------------------------------------------------------- engine
def _json_options(spec: ConstraintSpec, options: dict) -> dict:
    opts = {**dict(spec.options), **options}
    kw: dict = {}
    if "any_whitespace" in opts:
        kw["any_whitespace"] = bool(opts["any_whitespace"])
        if not kw["any_whitespace"]:
            kw["separators"] = (",", ":")
    # xgrammar's strict_mode (its default: on) reads an unspecified additionalProperties / additionalItems as false:
    # a narrower language than the schema's (dev-split Kubernetes---kb_137_Normalized: valid instances with keys
    # the schema does not list were refused).  Our ``strict`` is another thing (refuse what the engine ignores), so
    # the schema's own language unless asked (``xgrammar_strict_mode``: vLLM's xgrammar backend keeps it on).
    kw["strict_mode"] = bool(opts.get("xgrammar_strict_mode", False))
    return kw


def _schema_grammar(spec: ConstraintSpec, options: dict):
    """The schema's grammar, converted with xgrammar's warnings captured: xgrammar logs (to stderr, from C++) the
    keywords it ignores ("pattern combined with minLength/maxLength is not supported; ignoring minLength/maxLength",
    "multipleOf is not supported for type:number; ignoring multipleOf"); in strict mode (the default) each is a
    refusal naming the keyword and its pointer, as ``schema.require_supported`` words it."""
    import xgrammar as xgr

    from ..schema import ignored_in_warning, refusal

    with native_stderr() as lines:
        grammar = xgr.Grammar.from_json_schema(spec.value, **_json_options(spec, options))
    warnings = [ln for ln in lines if "Warning" in ln and "ignoring" in ln]
    write_stderr([ln for ln in lines if ln not in warnings])
    if warnings and {**dict(spec.options), **options}.get("strict", True):
        found = ignored_in_warning(spec.schema, warnings[0])
        if found is not None:
            why = "xgrammar: " + warnings[0].split("Warning:", 1)[-1].strip()
            raise refusal(found[0], found[1], NAME, len(warnings) - 1, why)
    write_stderr(warnings)
    return grammar


class XGrammarEngine:
    name = NAME
    isolate = True  # no resource limits of its own: compiled in a worker process under compile_isolation="process"

    def prepare(self, tokenizer: TokenizerInfo) -> None:
        """Import xgrammar and build its per-tokenizer compiler (outside the compile time limit)."""
        _COMPILERS.get(tokenizer)

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, options: dict) -> CompiledConstraint:
        try:
            import xgrammar  # noqa: F401
        except ImportError as e:  # pragma: no cover - the dependency is required
            raise ConstraintError(f"the xgrammar engine needs the xgrammar package ({e})", engine=NAME) from None
        refuse_empty_choices(spec, NAME)  # xgrammar 0.2.8 reads an empty anyOf as the empty string
        comp = _COMPILERS.get(tokenizer)
        try:
            if spec.kind in ("regex", "choice"):
                cg = comp.compile_regex(ascii_shorthands(spec.as_regex(), dot=True))
            elif spec.kind == "json_schema":
                cg = comp.compile_grammar(_schema_grammar(spec, options))
            elif spec.kind == "json":
                schema = {"type": "object"} if spec.option("object_only") else {}
                cg = comp.compile_json_schema(json.dumps(schema), **_json_options(spec, options))
            elif spec.syntax == "lark":
                cg = comp.compile_lark(spec.value)
            elif spec.syntax == "gbnf":
                cg = comp.compile_grammar(normalize_gbnf(spec.value), root_rule_name="root")
            else:  # ebnf: xgrammar's own EBNF dialect
                cg = comp.compile_grammar(spec.value, root_rule_name=options.get("root_rule", "root"))
        except ConstraintError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / InvalidJSONError with its reason
            raise ConstraintError(engine_words(e), engine=NAME, kind=spec.kind) from None
        return self._finish(spec, tokenizer, cg)

    # compile_worker: the compiled grammar crosses the process boundary as xgrammar's own JSON
    @staticmethod
    def export(cc: CompiledConstraint) -> str:
        return cc.compiled.serialize_json()

    def import_compiled(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, options: dict, payload: str):
        import xgrammar as xgr

        return self._finish(spec, tokenizer, xgr.CompiledGrammar.deserialize_json(payload, _INFOS.get(tokenizer)))

    @staticmethod
    def _finish(spec: ConstraintSpec, tokenizer: TokenizerInfo, cg) -> CompiledConstraint:
        cc = CompiledConstraint(spec, tokenizer, NAME, cg, XGrammarMatcher.start,
                                memory_bytes=int(getattr(cg, "memory_size_bytes", 0) or 0))
        row = np.zeros(mask_words(tokenizer.vocab_size), dtype=np.int32)
        XGrammarMatcher.start(cc).fill_mask(row)
        if popcount(row) == 0:
            raise no_start_error(NAME, spec.kind)
        return cc


class XGrammarMatcher:
    """One walk through an xgrammar ``CompiledGrammar``."""

    __slots__ = ("compiled", "tok", "vocab_size", "gm", "book", "ed", "_accept_token", "_jump_forward")
    # b"" from find_jump_forward_string means no byte is forced, except where the forced bytes end inside a UTF-8
    # sequence (jump_forward then says b"": a forced token is then missed, never invented); tests/test_block.py
    jump_forward_complete = True

    def __init__(self, compiled: CompiledConstraint, gm, book: StepBook, ed: list[bool] | None = None):
        self.compiled = compiled
        self.tok = compiled.tokenizer
        self.vocab_size = self.tok.vocab_size
        self.gm = gm
        self.book = book
        self.ed = ed if ed is not None else [False]  # per position (base first): the bytes so far end in ED
        # xgrammar 0.2.8's GrammarMatcher.accept_token and find_jump_forward_string are one-line Python wrappers
        # of its native handle's; a batch host calls both once per request per draft position, so the handle's
        # own (a Python frame less each), where the matcher has one
        handle = getattr(gm, "_handle", None)
        if handle is not None and hasattr(handle, "accept_token") and hasattr(handle, "find_jump_forward_string"):
            self._accept_token = handle.accept_token
            self._jump_forward = handle.find_jump_forward_string
        else:
            self._accept_token = lambda token, debug_print: gm.accept_token(token)
            self._jump_forward = gm.find_jump_forward_string

    @classmethod
    def start(cls, compiled: CompiledConstraint) -> "XGrammarMatcher":
        import xgrammar as xgr

        return cls(compiled, xgr.GrammarMatcher(compiled.compiled), StepBook())

    def fill_mask(self, out: np.ndarray) -> None:
        if self.book.terminated:
            out[:] = 0
            return
        self.gm.fill_next_token_bitmask(out)
        if self.vocab_size & 31:  # xgrammar sets the bits past vocab_size in the last word
            clear_past(out, self.vocab_size)
        if self.ed[-1]:
            np.bitwise_and(out, _NO_SURROGATE.get(self.tok), out=out)

    def _ends_in_ed(self, data: bytes) -> bool:
        return data[-1] == 0xED if data else self.ed[-1]

    def accept(self, token: int) -> bool:
        # (called once per draft position per request by a batch host: attributes read once, the book's own
        # push and _ends_in_ed written out)
        book = self.book
        tok = self.tok
        data = tok.token_bytes
        if book.stop_at is not None or not (0 <= token < len(data)):
            return False
        data = data[token]
        if not data and token not in tok.stop_token_ids:
            # a special token: never in the grammar's language.  xgrammar 0.2.8 would refuse it too, but writes a
            # warning to stderr for each ("GrammarMatcher cannot accept special token id ..."), ~10 us; a draft
            # model's argmax offered to a lazy draft block (vLLM) may be one at any position
            return False
        ed = self.ed
        if ed[-1] and 0xA0 <= (data[:1] or b"\0")[0] <= 0xBF:
            return False  # a surrogate (see _NO_SURROGATE)
        if not self._accept_token(token, False):  # (debug_print off)
            return False
        ed.append(data[-1] == 0xED if data else ed[-1])
        book.steps.append(1)
        if token in tok.stop_token_ids:
            book.stop_at = len(book.steps) - 1
        return True

    def accept_bytes(self, data: bytes) -> bool:
        if self.book.terminated:
            return False
        if not data:
            return True
        data = bytes(data)
        if (self.ed[-1] and 0xA0 <= data[0] <= 0xBF) or _SURROGATE_BYTES.search(data):
            return False  # a surrogate (see _NO_SURROGATE)
        if not self.gm.accept_string(data):
            return False
        self.ed[-1] = self._ends_in_ed(data)
        self.book.merge(1)
        return True

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        undo = self.book.pop(n)
        del self.ed[-n:]
        if undo:
            self.gm.rollback(undo)

    def fork(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self.compiled, self.gm.fork(), self.book.copy(), list(self.ed))

    def is_terminated(self) -> bool:
        return self.book.stop_at is not None  # (StepBook.terminated, one call less: asked at every position)

    def forced(self) -> Forced:
        if self.book.terminated:
            return Forced()
        chain = forced_from_masks(self, self.tok)
        text = self.jump_forward()
        if len(chain.text) > len(text):
            text = chain.text
        return Forced(chain.tokens, text)

    def jump_forward(self, limit: int | None = None) -> bytes:
        # xgrammar 0.2.8 has no capped call: find_jump_forward_string builds the whole forced string.  What bounds
        # it is the constraint, checked before compiling (bounds.check_cost: counts, expansions and a GBNF
        # grammar's forced length, at most LIMITS.max_forced_bytes); the result is cut at the caller's limit.
        if self.book.stop_at is not None:
            return b""
        try:
            text = self._jump_forward()
            return text.encode("utf-8")[: forced_cap(limit)] if text else b""  # (mostly nothing forced)
        except UnicodeDecodeError:
            # xgrammar 0.2.8 returns the jump-forward string as a Python str, and raises when the forced bytes end
            # inside a UTF-8 sequence (a choice of "👍"/"👎" forces F0 9F 91 and then branches): no jump-forward
            # string then (``forced()`` still has the mask chain's bytes; tests/test_unicode.py)
            return b""

    # the raw engine call, for overhead measurements
    def raw_fill(self, out: np.ndarray) -> None:
        self.gm.fill_next_token_bitmask(out)


__all__ = ["XGrammarEngine", "XGrammarMatcher", "fill_empty_alternatives"]
