"""What a constraint is (``ConstraintSpec``), the ``Matcher`` protocol every engine implements, and what an engine
returns (``CompiledConstraint``).  Compiling, caching and the engine policy are in ``compiler.py``; packed masks in
``masks.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from .errors import ConstraintError
from .tokenizer import TokenizerInfo

KINDS = ("regex", "json_schema", "grammar", "json", "choice")
GRAMMAR_SYNTAXES = ("gbnf", "lark", "ebnf")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ConstraintSpec:
    """One request's constraint.

    kind: ``regex`` | ``json_schema`` | ``grammar`` | ``json`` (any JSON value... an object, like ``json_object``) | ``choice``
    value: the regex, the schema (canonical JSON text), the grammar text, or the tuple of choices
    syntax: for ``grammar``: ``gbnf`` (llama.cpp dialect), ``lark`` or ``ebnf`` (W3C-style EBNF, as xgrammar reads it)
    trigger: when set, the constraint is inactive until this string has been generated, then constrains the rest
    options: engine-neutral options, e.g. ``(("any_whitespace", False),)``
    """

    kind: str
    value: Any = None
    syntax: str | None = None
    trigger: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.kind == "grammar" and self.syntax not in GRAMMAR_SYNTAXES:
            raise ConstraintError(f"grammar syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}, got {self.syntax!r}")
        if self.kind in ("regex", "grammar") and (not isinstance(self.value, str) or not self.value):
            raise ConstraintError(f"{self.kind} must be a non-empty string", kind=self.kind)
        if self.kind == "choice":
            if not self.value or not all(isinstance(c, str) and c for c in self.value):
                raise ConstraintError("choice needs a non-empty list of non-empty strings", kind="choice")
        if self.trigger is not None and not (isinstance(self.trigger, str) and self.trigger):
            raise ConstraintError("trigger must be a non-empty string", kind=self.kind)

    # -------- constructors
    @classmethod
    def regex(cls, pattern: str, **kw) -> "ConstraintSpec":
        return cls("regex", pattern, **kw)

    @classmethod
    def json_schema(cls, schema: dict | str | bool, **kw) -> "ConstraintSpec":
        from . import nesting

        if isinstance(schema, str):
            why = nesting.too_deep("the JSON schema", nesting.json_text_depth(schema))
            if why:
                raise ConstraintError(why, kind="json_schema")
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"JSON schema is not valid JSON: {e}", kind="json_schema") from None
            except RecursionError:
                raise ConstraintError("the JSON schema nests too deeply", kind="json_schema") from None
        why = nesting.too_deep("the JSON schema", nesting.json_depth(schema, nesting.MAX_NESTING))
        if why:  # before anything that walks it recursively
            raise ConstraintError(why, kind="json_schema")
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"JSON schema must be an object or a boolean, got {type(schema).__name__}",
                                  kind="json_schema")
        from .schema import normalize

        # compact but order-preserving: engines generate properties in the schema's declared order, so two
        # schemas that differ only in key order are different constraints (and different cache keys)
        try:
            text = json.dumps(normalize(schema), separators=(",", ":"), ensure_ascii=False)
        except RecursionError:
            raise ConstraintError("the JSON schema nests too deeply", kind="json_schema") from None
        return cls("json_schema", text, **kw)

    @classmethod
    def grammar(cls, text: str, syntax: str = "gbnf", **kw) -> "ConstraintSpec":
        return cls("grammar", text, syntax=syntax, **kw)

    @classmethod
    def json(cls, **kw) -> "ConstraintSpec":
        return cls("json", None, **kw)

    @classmethod
    def choice(cls, choices: Sequence[str], **kw) -> "ConstraintSpec":
        return cls("choice", tuple(choices), **kw)

    # -------- views
    @property
    def schema(self) -> Any:
        return json.loads(self.value) if self.kind == "json_schema" else None

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def key(self) -> str:
        return canonical_json([self.kind, self.value, self.syntax, self.trigger, [list(o) for o in self.options]])

    def without_trigger(self) -> "ConstraintSpec":
        return ConstraintSpec(self.kind, self.value, self.syntax, None, self.options)

    def as_regex(self) -> str | None:
        """The constraint as a regex, when it is regular by construction (regex, choice)."""
        if self.kind == "regex":
            return self.value
        if self.kind == "choice":
            return "(" + "|".join(escape_regex(c) for c in self.value) + ")"
        return None


def escape_regex(text: str) -> str:
    """Escape every regex metacharacter in a way all four engines read the same."""
    return re.sub(r"([\\.^$|?*+()\[\]{}\-/])", r"\\\1", text)


# ---------------------------------------------------------------------------------------------- matcher protocol
@dataclass(frozen=True)
class Forced:
    """What the grammar forces next from the current state: tokens (each the only allowed token in turn)
    and the jump-forward text (bytes every continuation starts with; may span several tokens)."""

    tokens: tuple[int, ...] = ()
    text: bytes = b""


@runtime_checkable
class Matcher(Protocol):
    """A walk through one compiled constraint. Engines implement this; one per request (fork for drafts)."""

    vocab_size: int

    def fill_mask(self, out: np.ndarray) -> None:
        """Write this position's packed allowed-token row into ``out`` (int32, ``mask_words(vocab_size)``)."""

    def accept(self, token: int) -> bool:
        """Advance by ``token``; return False (state unchanged) if the grammar rejects it."""

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""

    def fork(self) -> "Matcher":
        """An independent copy at the same state."""

    def is_terminated(self) -> bool:
        """True once a stop token was accepted (or the grammar can only stop and did)."""

    def forced(self) -> Forced:
        """Tokens / text the grammar forces next."""

    def jump_forward(self, limit: int | None = None) -> bytes:
        """The bytes every continuation from here starts with (b"" when none, or when the engine cannot tell),
        at most ``limit`` bytes (default and ceiling: ``bounds.BOUNDS.max_forced_bytes``, ``engines._common.forced_cap``);
        may end inside a UTF-8 sequence.  The forced drafter asks for it where the single-token walk ends.
        An engine whose b"" always means "no byte is forced" says so with a class attribute
        ``jump_forward_complete = True`` (read with ``getattr``: absent means it cannot tell)."""

    def accept_bytes(self, data: bytes) -> bool:
        """Advance by raw bytes (used when a trigger completes mid-token); False if rejected (state unchanged)."""


@dataclass(eq=False)
class CompiledConstraint:
    """A constraint compiled for one tokenizer by one engine. ``matcher()`` makes a fresh walk."""

    spec: ConstraintSpec
    tokenizer: TokenizerInfo
    engine: str
    compiled: Any
    make_matcher: Any = field(repr=False)
    compile_ms: float = 0.0
    memory_bytes: int = 0

    # set by the compiler for a spec with a trigger: ``wrap(compiled, inner) -> Matcher`` (``trigger.TriggeredMatcher``)
    wrap: Any = field(default=None, repr=False)
    # the exact rewrites applied to a JSON Schema before the engine compiled it (``schema_rewrite.Rewrite``s);
    # ``spec`` is then the rewritten schema's spec (for a spec with a trigger: the request's)
    rewrites: tuple = ()

    def matcher(self) -> Matcher:
        m = self.make_matcher(self)
        return self.wrap(self, m) if self.wrap is not None else m


class Engine(Protocol):
    """What an engine plugin registers: ``compile`` a trigger-free spec for a tokenizer."""

    name: str

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, options: dict) -> CompiledConstraint: ...
