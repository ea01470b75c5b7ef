"""The llguidance engine: regex, choice, JSON Schema, any JSON, Lark, and GBNF / EBNF (through llguidance's own
``gbnf_to_lark``, which takes llama.cpp's grammars verbatim).

Adapter notes: an ``LLMatcher`` enters a permanent error state when it consumes a token the grammar rejects, so
``accept`` asks ``validate_tokens`` first; every request's matcher is a ``deep_copy()`` of one template built at
compile time (building an ``LLMatcher`` re-reads the grammar, ~1 ms); llguidance's masks are as wide as the
tokenizer, the rest of the row (up to the model's output width) is cleared; ``accept_bytes`` spells the bytes
with vocabulary tokens (llguidance matches bytes, so any spelling is the same to it).
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..constraint import CompiledConstraint, ConstraintSpec, Forced
from ..masks import mask_words
from ..errors import ConstraintError
from ..tokenizer import TokenizerInfo
from ._common import (
    GreedyBytes, PerTokenizerCache, StepBook, ascii_shorthands, engine_words, forced_cap, forced_from_masks, no_start_error,
    popcount)

NAME = "llguidance"

# The lexer fuel of one step (llguidance's default 200k), raised; ``SPECGRAMMAR_LLGUIDANCE_STEP_FUEL`` sets it.
# llguidance 1.7.6 shares one lexer (its derived regex states) between a template and every deep_copy of it; when
# ``validate_tokens`` runs out of step fuel on a string whose pattern is intersected with a length
# (``{"pattern": "^(?:\\S+\\s+){0,49}\\S+$", "maxLength": 500}``: dev-split Github_medium---o21142,
# Github_hard---o21073) it refuses the token *without* an error, and the states it gave up on stay dead in the
# shared lexer: that text, and then "a b", are refused by every later copy (every later request with the schema).
# The mask path runs out too, there with an error ("too many expressions constructed").  5M lets the dev split's
# schemas through (2M does not: o21142's second instance).  The price: a schema that does run 5M out takes that
# much longer per mask before its error (docs/HARDENING.md; tests/test_engines.py::test_llguidance_lexer_fuel).
STEP_LEXER_FUEL = int(os.environ.get("SPECGRAMMAR_LLGUIDANCE_STEP_FUEL", 5_000_000))


def _limits():
    import llguidance as llg

    return llg.LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL)


class _Spelling:
    """The text -> ids callback llguidance's ``TokenizerWrapper`` wants (it passes UTF-8 bytes)."""

    def __init__(self, tok: TokenizerInfo):
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = None
        # padded to the model's width with byte-less (special) tokens: llguidance ignores n_vocab here, and a mask
        # as wide as the model saves clearing the tail of every row
        self.tokens = list(tok.token_bytes) + [b""] * (tok.vocab_size - len(tok.token_bytes))
        # every token without bytes is special to llguidance (never produced by a grammar); stop tokens too
        self.special_token_ids = sorted({i for i, b in enumerate(self.tokens) if not b} | set(tok.special_ids))
        self._encode = tok.encode
        self._greedy = GreedyBytes(tok)

    def __call__(self, text):
        # never raise: llguidance calls this from inside mask computation (fast-forward tokens), and an exception
        # there is a panic that leaves the matcher in its error state
        data = text if isinstance(text, bytes) else str(text).encode("utf-8")
        if self._encode is not None:
            try:
                return list(self._encode(data.decode("utf-8")))
            except Exception:
                pass
        ids = self._greedy(data)
        if ids is None:  # a byte no token spells (not a byte-level vocabulary): spell the longest prefix we can
            for k in range(len(data) - 1, -1, -1):
                ids = self._greedy(data[:k])
                if ids is not None:
                    break
        return ids


class _LLTok:
    def __init__(self, tok: TokenizerInfo):
        import llguidance as llg

        spelling = _Spelling(tok)
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(spelling), n_vocab=tok.vocab_size,
                                     eos_token=list(tok.stop_token_ids))
        self.greedy = spelling._greedy
        self.words = mask_words(self.lltok.vocab_size)  # llguidance's row (tokenizer length, not model width)


_TOKENIZERS = PerTokenizerCache(_LLTok)


def _json_overrides(spec: ConstraintSpec, options: dict) -> dict | None:
    opts = {**dict(spec.options), **options}
    if "any_whitespace" in opts and not opts["any_whitespace"]:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if opts.get("any_whitespace"):
        return {"whitespace_flexible": True}
    return None


NO_FORCING = '%llguidance {"no_forcing": true}'


def _lark(body: str, forcing: bool) -> str:
    """Lark text with llguidance's forcing switched off (unless asked for, or the text sets its own options).

    With forcing, where the grammar forces bytes llguidance allows only the canonical tokenization of them
    ("maybe" after "m": only "aybe", not "a" or "ay"): a sound choice, but not the mask of the language, which is
    what the other engines and the reference compute.  ``forcing=True`` (option ``llguidance_forcing``) restores it.
    """
    if forcing:
        return body
    if body.lstrip().startswith("%llguidance {}"):
        return body.replace("%llguidance {}", NO_FORCING, 1)
    if "%llguidance" in body:
        return body
    return f"{NO_FORCING}\n{body}"


def grammar_text(spec: ConstraintSpec, options: dict) -> str:
    """The llguidance grammar for ``spec`` (raises ``ConstraintError`` for what cannot be converted)."""
    import llguidance as llg

    forcing = bool({**dict(spec.options), **options}.get("llguidance_forcing", False))
    if spec.kind in ("regex", "choice"):
        body = f"start: /{llg.regex_to_lark(ascii_shorthands(spec.as_regex()))}/"
    elif spec.kind in ("json_schema", "json"):
        overrides = _json_overrides(spec, options)
        if spec.kind == "json_schema" and not overrides and spec.value.startswith("{"):
            body = "start: %json " + spec.value  # already compact JSON: no second parse and dump of a large schema
        else:
            if spec.kind == "json":
                schema = {"type": "object"} if spec.option("object_only") else {}
            else:
                schema = spec.schema
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if overrides:
                schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **overrides}}
            body = "start: %json " + json.dumps(schema)
    elif spec.syntax == "lark":
        body = spec.value
    else:  # gbnf / ebnf: llguidance converts llama.cpp's dialect to Lark
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            body = any_to_lark(spec.value)
        except Exception as e:
            raise ConstraintError(f"cannot convert the grammar from GBNF to Lark: {engine_words(e)}", engine=NAME,
                                  kind=spec.kind) from None
    return llg.LLMatcher.grammar_from_lark(_lark(body, forcing))


class _Compiled:
    __slots__ = ("lt", "grammar", "template")

    def __init__(self, lt: _LLTok, grammar: str, template):
        self.lt, self.grammar, self.template = lt, grammar, template


class LLGuidanceEngine:
    name = NAME
    isolate = False  # bounded by its own fuel (LLParserLimits): compiled in-process

    def prepare(self, tokenizer: TokenizerInfo) -> None:
        """Import llguidance and build its per-tokenizer index (outside the compile time limit)."""
        _TOKENIZERS.get(tokenizer)

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, options: dict) -> CompiledConstraint:
        import llguidance as llg

        lt = _TOKENIZERS.get(tokenizer)
        grammar = grammar_text(spec, options)
        # one compile: building the matcher reports what validate_grammar_with_warnings would (the same words),
        # and validating first compiled every grammar twice (40% of the compile time of a large JSON Schema)
        template = llg.LLMatcher(lt.lltok, grammar, log_level=0, limits=_limits())
        if template.is_error():
            raise ConstraintError(template.get_error().strip(), engine=NAME, kind=spec.kind)
        cc = CompiledConstraint(spec, tokenizer, NAME, _Compiled(lt, grammar, template), LLGuidanceMatcher.start)
        probe = LLGuidanceMatcher.start(cc)
        row = np.zeros(mask_words(tokenizer.vocab_size), dtype=np.int32)
        probe.raw_fill(row)
        if probe.m.is_error() or popcount(row) == 0:
            why = _error_text(probe.m.get_error()) if probe.m.is_error() else ""
            err = no_start_error(NAME, spec.kind)
            raise ConstraintError(f"{err.reason} ({why})" if why else err.reason, engine=NAME, kind=spec.kind)
        return cc


def _error_text(err: str) -> str:
    """llguidance's error without the parser-state dump it appends."""
    return err.split("\n<state>", 1)[0].strip()


class LLGuidanceMatcher:
    """One walk through an llguidance grammar."""

    __slots__ = ("compiled", "tok", "vocab_size", "m", "book", "_words")
    jump_forward_complete = True  # compute_ff_bytes: b"" where no byte is forced (tests/test_block.py)

    def __init__(self, compiled: CompiledConstraint, m, book: StepBook):
        self.compiled = compiled
        self.tok = compiled.tokenizer
        self.vocab_size = self.tok.vocab_size
        self.m = m
        self.book = book
        self._words = compiled.compiled.lt.words

    @classmethod
    def start(cls, compiled: CompiledConstraint) -> "LLGuidanceMatcher":
        return cls(compiled, compiled.compiled.template.deep_copy(), StepBook())

    def fill_mask(self, out: np.ndarray) -> None:
        if self.book.stop_at is not None:
            out[:] = 0
            return
        nbytes = self._words * 4
        if out.nbytes < nbytes:  # the engine writes through a raw pointer: never past the buffer
            raise ValueError(f"mask row must be int32 of {mask_words(self.vocab_size)} words")
        self.m.unsafe_compute_mask_ptr(out.ctypes.data, nbytes)  # a C-contiguous int32 row
        if out.nbytes > nbytes:
            out[self._words:] = 0
        if self.m.is_error():
            err = _error_text(self.m.get_error())
            if err.startswith("NoExtensionBias"):
                # llguidance 1.7.6 puts the matcher in its error state where no token can continue (a language
                # empty for this vocabulary): an empty row, as every other engine gives (the loop then raises
                # EmptyMaskError); the error state only forbids going on from here
                out[:] = 0
                return
            raise ConstraintError(err, engine=NAME, kind=self.compiled.spec.kind)

    def accept(self, token: int) -> bool:
        if self.book.terminated or not (0 <= token < len(self.tok.token_bytes)):
            return False
        if token in self.tok.stop_token_ids:
            # Stop tokens are kept out of llguidance: a stopped matcher (no byte can follow) validates no token
            # and consumes EOS without counting it as a step, so rollback would go wrong.  Nothing follows a
            # stop token anyway: record it here, as zero engine steps.
            if not self.m.is_accepting():
                return False
            self.book.push(0)
            self.book.stop_at = len(self.book) - 1
            return True
        if self.m.validate_tokens([token]) != 1:
            return False
        if not self.m.consume_token(token):  # pragma: no cover - validated just above
            raise RuntimeError(f"llguidance refused a validated token: {self.m.get_error()}")
        self.book.push(1)
        return True

    def accept_bytes(self, data: bytes) -> bool:
        if self.book.terminated:
            return False
        if not data:
            return True
        ids = self.compiled.compiled.lt.greedy(bytes(data))
        if ids is None or self.m.validate_tokens(ids) != len(ids):
            return False
        if not self.m.consume_tokens(ids):  # pragma: no cover
            raise RuntimeError(f"llguidance refused validated tokens: {self.m.get_error()}")
        self.book.merge(len(ids))
        return True

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        undo = self.book.pop(n)
        if undo and not self.m.rollback(undo):
            raise RuntimeError(f"llguidance could not roll back {undo} tokens: {self.m.get_error()}")

    def fork(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self.compiled, self.m.deep_copy(), self.book.copy())

    def is_terminated(self) -> bool:
        return self.book.terminated

    def forced(self) -> Forced:
        if self.book.terminated or self.m.is_stopped():
            return Forced()
        text = bytes(self.m.compute_ff_bytes())
        if not text:
            return Forced()
        tokens = tuple(self.m.compute_ff_tokens())  # empty unless llguidance_forcing is on
        if not tokens:
            tokens = forced_from_masks(self, self.tok).tokens
        return Forced(tokens, text)

    def jump_forward(self, limit: int | None = None) -> bytes:
        if self.book.terminated or self.m.is_stopped():
            return b""
        return bytes(self.m.compute_ff_bytes())[: forced_cap(limit)]  # (bounded by the constraint: bounds.py)

    # the raw engine call, for overhead measurements
    def raw_fill(self, out: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(out.ctypes.data, self._words * 4)


__all__ = ["LLGuidanceEngine", "LLGuidanceMatcher", "grammar_text"]
