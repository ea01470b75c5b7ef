"""The exceptions the core raises. Every bad constraint raises ``ConstraintError`` (or a subclass)."""

from __future__ import annotations


class SpecGrammarError(Exception):
    """Base class of every error this package raises on purpose."""


class ConstraintError(SpecGrammarError, ValueError):
    """A constraint cannot be used: invalid regex/schema/grammar, unsupported feature, empty language, ...

    ``engine`` names the engine that refused it (or ``None`` when the spec itself is malformed) and
    ``reason`` carries the engine's own words.  Servers answer HTTP 400 with ``str(error)``.
    """

    def __init__(self, reason: str, *, engine: str | None = None, kind: str | None = None):
        self.reason = reason
        self.engine = engine
        self.kind = kind
        where = ", ".join(x for x in (f"engine={engine}" if engine else "", f"kind={kind}" if kind else "") if x)
        super().__init__(f"invalid constraint ({where}): {reason}" if where else f"invalid constraint: {reason}")


class TokenizerMismatchError(ConstraintError):
    """Draft and target (or a grammar and a model) do not share one tokenizer."""


class EmptyMaskError(ConstraintError):
    """No token is allowed at some position: the constraint cannot be continued (or the mask was filtered empty)."""


class BudgetError(ConstraintError):
    """The constraint's shortest completion does not fit in the request's budget (``max_tokens`` or
    ``specgrammar.budget``): refused up front rather than cut off mid-structure.  ``shortest`` is that length in
    tokens (stop token included; ``None`` when no completion was found at all), ``budget`` the request's."""

    def __init__(self, reason: str, *, shortest: int | None, budget: int, engine: str | None = None,
                 kind: str | None = None):
        super().__init__(reason, engine=engine, kind=kind)
        self.shortest = shortest
        self.budget = budget


class RequestError(SpecGrammarError, ValueError):
    """A request option is malformed (unknown drafter, bad k, ...). Servers answer HTTP 400.

    ``field`` names the request field at fault (``"temperature"``, ``"specgrammar.k"``, ...) when one is;
    ``status_code`` is the HTTP status a server answers with (400; 404 for a model the server does not serve).
    """

    def __init__(self, message: str, *, field: str | None = None, status_code: int = 400):
        super().__init__(message)
        self.field = field
        self.status_code = status_code
