"""The one validation gate every host runs on a request before doing any work with it.

``check_request(body, host)`` reads a request body (a dict decoded from JSON, or a library call's keyword
arguments) with what the host can honour (``Host``), and either returns what it found (``Checked``: the
constraint, the ``specgrammar`` options, the prompt's length in tokens, the effective ``max_tokens``) or raises
``RequestError`` (servers answer its ``status_code``: 400, or 404 for a model the server does not serve) /
``ConstraintError`` (400), with a message that names the field and holds no internals.  What it checks:

- the body's nesting (``nesting.MAX_BODY_NESTING``, walked without recursion) and every number in it: ``NaN`` and
  ``Infinity`` (which Python's ``json`` reads) are refused wherever they are, naming the field;
- sampling fields, typed and in range (``SAMPLING``): temperature, top_p, top_k, min_p, seed, max_tokens, n,
  num_draft_tokens, penalties, ``logit_bias`` (token ids inside the vocabulary), ``stop``, ``stream``,
  ``stream_options``; fields the host cannot honour are refused rather than ignored (``n > 1`` where one
  choice comes back; ``specgrammar`` options the host does not apply; fields the server fixes at start-up);
- the constraint and the ``specgrammar`` options (``requests.parse_request``: unknown keys, recipe names), a
  constraint whose language is certainly empty (``emptiness.check_not_empty``, structural: no compile), and a
  constraint together with ``stop`` strings (a stop string inside the structured output would cut it invalid);
- the prompt (``prompt`` / ``messages`` shapes) and its length against the model's context: first a bound that
  costs nothing (a token spells at most ``max_token_bytes`` bytes, so a prompt of B bytes is at least
  B / max_token_bytes tokens: a 100k-character prompt is refused without tokenizing it), then the exact count
  (``Host.count_tokens``, the host's chat template); prompt + max_tokens must fit (400 naming both numbers).
  Without a ``max_tokens`` the host's default is cut to what the context leaves (``Checked.max_tokens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .bounds import check_cost, check_fit, check_text
from .constraint import ConstraintSpec
from .emptiness import check_not_empty
from .errors import RequestError
from .nesting import MAX_BODY_NESTING, json_depth
from .requests import MAX_K, OPTION_KEYS, SpecOptions, is_int, is_number, parse_request

INT32 = 2**31 - 1
INT63 = 2**63 - 1
MIN_TEMPERATURE = 1e-5  # below it (but above 0) logits / T overflows on some hosts: 0 means greedy
MAX_STOP = 16
MAX_N = 128

# field -> (integer?, low, high); None = unbounded on that side.  The union of what the hosts accept: each host
# still applies its own narrower rules afterwards (mlx-lm: top_k >= 0; vLLM: top_p > 0, n <= its own limit).
SAMPLING: dict[str, tuple[bool, float | None, float | None]] = {
    "temperature": (False, 0.0, None),
    "top_p": (False, 0.0, 1.0),
    "min_p": (False, 0.0, 1.0),
    "top_k": (True, -1, INT32),
    "seed": (True, 0, INT63),
    "max_tokens": (True, 1, INT32),
    "max_completion_tokens": (True, 1, INT32),
    "num_draft_tokens": (True, 0, MAX_K),
    "presence_penalty": (False, None, None),
    "frequency_penalty": (False, None, None),
    "repetition_penalty": (False, 0.0, None),
    "xtc_probability": (False, 0.0, 1.0),
    "xtc_threshold": (False, 0.0, 1.0),
}


@dataclass(frozen=True)
class Host:
    """What one host honours and knows about its model (every field optional: unknown = not checked here).

    name: in messages ("the mlx-lm server").  honours: the ``specgrammar`` options it applies.  n: whether it
    returns ``n`` choices.  models: the model names it serves (a request naming another gets 404).  fixed: fields
    the operator fixed at start-up -> the values a request may repeat (e.g. mlx-lm's ``adapters``).
    prompt_types: what ``prompt`` may be ("text", "tokens"; empty: the host checks prompts and messages itself).
    context_length, max_token_bytes,
    vocab_size, default_max_tokens: the model's.  count_tokens(body) -> the exact prompt length in tokens.
    ranges: the host's own range for a sampling field, where it gives a value outside the common one a meaning
    (llama-cpp-python: a negative temperature samples the full distribution).
    """

    name: str
    honours: frozenset = frozenset(OPTION_KEYS)
    n: bool = False
    models: tuple[str, ...] = ()
    fixed: tuple[tuple[str, tuple], ...] = ()
    prompt_types: tuple[str, ...] = ("text",)
    context_length: int | None = None
    max_token_bytes: int | None = None
    vocab_size: int | None = None
    default_max_tokens: int | None = None
    count_tokens: Callable[[dict], int] | None = field(default=None, compare=False)
    ranges: tuple[tuple[str, tuple[bool, float | None, float | None]], ...] = ()  # SAMPLING entries it replaces
    client_templates: bool | None = None  # a client's own chat template: None = bounds.BOUNDS.allow_client_chat_template


@dataclass(frozen=True)
class Checked:
    """What the gate read from a valid request."""

    spec: ConstraintSpec | None
    options: SpecOptions
    prompt_tokens: int | None = None  # exact, when the host can count
    max_tokens: int | None = None  # effective: the request's, or the host default cut to the context left
    max_tokens_given: bool = False


def _bad(field_: str, msg: str, status: int = 400):
    raise RequestError(f"{field_} {msg}", field=field_, status_code=status)


NON_FINITE = "is not a finite number (NaN and Infinity are not JSON numbers)"
SURROGATE = "holds a lone surrogate (not a Unicode character: no UTF-8 text spells it)"


def _bad_value(body: Any) -> tuple[str, str] | None:
    """(path, what is wrong) of the first NaN / Infinity or string holding a lone surrogate (a key or a value) in
    ``body`` (walked without recursion), or None.  JSON's ``\\ud800`` escape decodes to one; no host can encode it
    (vLLM 0.32 answered a ``stop`` holding one with a 500)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return path or "the body", NON_FINITE
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the body", SURROGATE
        elif isinstance(v, dict):
            for k, x in v.items():
                name = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return (path or "the body") + " (a key)", SURROGATE
                stack.append((name, x))
        elif isinstance(v, list):
            stack += [(f"{path}[{i}]", x) for i, x in enumerate(v)]
    return None


def _check_drafters(opts: dict) -> None:
    """``specgrammar.drafters`` given by the request: every name a registered drafter (``plugins.drafters``), else
    400 naming them (the vLLM launcher served an unknown name with 200 and no drafts)."""
    names = opts.get("drafters") if isinstance(opts, dict) else None
    if not isinstance(names, (list, tuple)):
        return
    from .plugins import drafters

    known = drafters()
    bad = [d for d in names if d not in known]
    if bad:
        _bad("specgrammar.drafters", f"names unknown drafter(s) {', '.join(repr(str(d)[:60]) for d in bad)}; "
             f"available: {', '.join(sorted(known))}")


def _check_size(spec: ConstraintSpec) -> None:
    """The constraint's size (``compiler.LIMITS.max_constraint_bytes``) first: every later check reads the whole
    text (a 16 MB regex took 18 s of the vLLM launcher's gate before it reached the compiler's own size check)."""
    from .compiler import LIMITS
    from .errors import ConstraintError

    v = spec.value
    size = len(v.encode("utf-8", "surrogatepass")) if isinstance(v, str) else len(spec.key())
    if size > LIMITS.max_constraint_bytes:
        raise ConstraintError(f"the constraint is {size} bytes; the limit is {LIMITS.max_constraint_bytes} "
                              "(SPECGRAMMAR_MAX_CONSTRAINT_BYTES)", kind=spec.kind)


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _check_number(body: dict, name: str, host: Host) -> None:
    if name not in body or body[name] is None:
        return
    integer, lo, hi = dict(host.ranges).get(name, SAMPLING[name])
    v = body[name]
    ok = is_int(v) if integer else is_number(v)
    rng = f"[{'-inf' if lo is None else _num(lo)}, {'inf' if hi is None else _num(hi)}]"
    if not ok or (lo is not None and v < lo) or (hi is not None and v > hi):
        _bad(name, f"must be {'an integer' if integer else 'a finite number'} in {rng}")
    if name == "temperature" and 0 < v < MIN_TEMPERATURE:
        _bad(name, f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")


def _check_sampling(body: dict, host: Host) -> None:
    for name in SAMPLING:
        _check_number(body, name, host)
    n = body.get("n")
    if n is not None:
        if not is_int(n) or not 1 <= n <= (MAX_N if host.n else 1):
            _bad("n", f"must be 1 on {host.name} (it returns one choice per request)" if not host.n
                 else f"must be an integer in [1, {MAX_N}]")
    for name in ("stream", "logprobs", "echo"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            _bad(name, "must be true or false")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool)):
        _bad("stream_options", "must be an object like {\"include_usage\": true}")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            _bad("logit_bias", "must be an object of token id -> bias")
        for k, v in bias.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                _bad("logit_bias", f"keys must be token ids, got {str(k)[:40]!r}")
            if tid < 0 or (host.vocab_size is not None and tid >= host.vocab_size):
                _bad("logit_bias", f"token id {tid} is outside the vocabulary (0..{(host.vocab_size or 1) - 1})"
                     if host.vocab_size else f"token id {tid} is negative")
            if not is_number(v) or not -100 <= v <= 100:
                _bad("logit_bias", f"values must be numbers in [-100, 100] (token {tid})")


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        _bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    for s in stops:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            _bad("stop", "holds a lone surrogate (not a Unicode character: no UTF-8 text spells it)")
    return stops


def _check_template(body: dict, host: Host) -> None:
    """A chat template the client chose (``chat_template`` / ``chat_template_kwargs.chat_template``) is code the
    server runs (jinja, with loops): refused unless the operator allows it (``Host.client_templates``, default
    ``bounds.BOUNDS.allow_client_chat_template``, ``SPECGRAMMAR_ALLOW_CLIENT_CHAT_TEMPLATE=1``), and then bounded in size
    (``bounds.BOUNDS.max_chat_template_bytes``, 64 KiB)."""
    from .bounds import BOUNDS as LIMITS

    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        _bad("chat_template_kwargs", "must be an object")
    for name, value in (("chat_template", body.get("chat_template")),
                        ("chat_template_kwargs.chat_template", (kw or {}).get("chat_template"))):
        if value is None:
            continue
        allowed = host.client_templates if host.client_templates is not None else LIMITS.allow_client_chat_template
        if not allowed:
            _bad(name, f"is not accepted by {host.name}: a client's own chat template is code the server would run "
                 "(the operator allows it with SPECGRAMMAR_ALLOW_CLIENT_CHAT_TEMPLATE=1)")
        if not isinstance(value, str):
            _bad(name, "must be a string")
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > LIMITS.max_chat_template_bytes:
            _bad(name, f"is {size} bytes; the limit is {LIMITS.max_chat_template_bytes} "
                 "(SPECGRAMMAR_MAX_CHAT_TEMPLATE_BYTES)")


def _prompt_bytes(body: dict, host: Host) -> int | None:
    """The bytes of prompt text in ``body`` (None: no prompt field to read); refuses malformed shapes."""
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            _bad("messages", "must be a non-empty list of messages")
        total = 0
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                _bad(f"messages[{i}]", "must be an object with a string 'role'")
            content = m.get("content")
            if isinstance(content, str):
                total += len(content.encode("utf-8", "surrogatepass"))
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                        _bad(f"messages[{i}].content[{j}]", "must be an object with a string 'type'")
                    if isinstance(part.get("text"), str):
                        total += len(part["text"].encode("utf-8", "surrogatepass"))
            elif content is not None:
                _bad(f"messages[{i}].content", "must be a string, a list of content parts or null")
        return total
    if "prompt" in body:
        p = body["prompt"]
        if isinstance(p, str):
            return len(p.encode("utf-8", "surrogatepass"))
        if "tokens" in host.prompt_types and isinstance(p, list) and p and all(is_int(t) for t in p):
            return None  # token ids: the host counts them itself
        _bad("prompt", "must be a string" + (" or a list of token ids" if "tokens" in host.prompt_types else ""))
    return None


def _context(body: dict, host: Host) -> tuple[int | None, int | None, bool]:
    """(prompt tokens, effective max_tokens, max_tokens given) against the model's context length."""
    given = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    max_tokens = given if given is not None else host.default_max_tokens
    nbytes = _prompt_bytes(body, host) if host.prompt_types else None  # () : the host checks its prompts itself
    ctx = host.context_length
    if ctx is None or nbytes is None:
        return None, max_tokens, given is not None
    field_ = "messages" if "messages" in body else "prompt"
    if host.max_token_bytes:
        at_least = -(-nbytes // host.max_token_bytes)
        if at_least >= ctx:  # certain without tokenizing: refused at once, whatever its size
            _bad(field_, f"is at least {at_least} tokens ({nbytes} bytes); the model's context length is {ctx} "
                 "tokens")
    if host.count_tokens is None:
        return None, max_tokens, given is not None
    n = int(host.count_tokens(body))
    if n >= ctx:
        _bad(field_, f"is {n} tokens; the model's context length is {ctx} tokens")
    if given is not None and n + given > ctx:
        _bad("max_tokens", f"is {given}: with the prompt's {n} tokens that is {n + given} tokens; the model's "
             f"context length is {ctx} tokens")
    if max_tokens is not None and n + max_tokens > ctx:
        max_tokens = ctx - n  # the host's default, cut to what the context leaves
    return n, max_tokens, given is not None


def check_request(body: Any, host: Host, *, host_constraint: bool = False) -> Checked:
    """Validate one request for ``host`` (see the module docstring); raise ``RequestError`` / ``ConstraintError``.
    ``host_constraint``: the request also carries a constraint in a field only the host reads (llama-cpp-python's
    ``grammar``), for the checks that depend on one."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", field="body")
    if json_depth(body, MAX_BODY_NESTING) > MAX_BODY_NESTING:
        raise RequestError(f"the request nests more than {MAX_BODY_NESTING} levels deep (the limit)", field="body")
    found = _bad_value(body)
    if found is not None:
        _bad(*found)
    if host.models:
        model = body.get("model", host.models[0])
        if model not in host.models:
            _bad("model", f"{str(model)[:200]!r} is not served here; this server serves {host.models[0]!r}"
                 + (f" (also named {', '.join(map(repr, host.models[1:]))})" if host.models[1:] else ""), 404)
    for name, allowed in host.fixed:
        if body.get(name) is not None and body[name] not in allowed:
            _bad(name, f"is fixed when {host.name} starts; a request may not choose it")
    _check_sampling(body, host)
    _check_template(body, host)
    stops = _stops(body)
    spec, options = parse_request(body)
    opts = body.get("specgrammar") or {}
    refused = [k for k in opts if k not in host.honours]
    if refused:
        _bad(f"specgrammar.{refused[0]}", f"is not applied by {host.name} (it applies: "
             f"{', '.join(k for k in OPTION_KEYS if k in host.honours) or 'none'})")
    _check_drafters(opts)
    if spec is not None:  # cheap and structural: refused here too where the host compiles it elsewhere (vLLM)
        _check_size(spec)
        check_text(spec.value if spec.kind != "json_schema" else spec.schema, f"the {spec.kind}")
        if spec.trigger is not None:
            check_text(spec.trigger, "specgrammar.trigger")
        check_cost(spec)  # the absolute bounds first (bounds.py): linear in the text, before any fixpoint
        check_not_empty(spec)
    if (spec is not None or host_constraint) and stops:
        _bad("stop", "cannot be combined with a constraint: a stop string inside the structured output would cut "
             "it short and invalid (the grammar ends the output itself)")
    n, max_tokens, given = _context(body, host)
    if spec is not None:
        check_fit(spec, options, max_tokens, host.max_token_bytes)
    return Checked(spec, options, n, max_tokens, given)
