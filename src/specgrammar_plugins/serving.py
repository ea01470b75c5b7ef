"""What a server adapter does with a request that needs no host: planning, counting, row plans, statistics.

Moved out of ``adapters/specgrammar_mlx_lm`` and ``adapters/specgrammar_vllm`` (issue 34, "the two adapters
shrink"), offered to every adapter through ``api``:

- ``plan_request``: a server's reading of one request (the gate, the default max_tokens, the options planned, the
  constraint compiled now and its budget checked) -> ``RequestPlan``: what the plugin read (constraint, options,
  whether our loop must serve it; ``row``: as a batched row's ``RowPlan``); ``plan_options``: a request's drafter
  names checked against the registered drafters and its recipe name resolved (``RequestError`` /
  ``RecipePackError``: 400); ``draft_k``: the request's ``k``, else the server's, else the host's;
- ``RowPlan``: what a batched row needs to become a speculative row (compiled constraint, options, law, budget);
  ``ServedRow``: a request's row in a host's own batch (its loop's start, its feed, its verdict, the answers with
  the host's max_tokens and stop sequences, its failure);
- ``RowCut``: a budget applied as mask rows, for a host's own sampler that cannot draw again (mlx-lm's batching
  path, vLLM's bitmask), and the drafts those rows allow, each draft checked once;
- ``PromptCounter``: a request's prompt tokens counted as a Hugging Face tokenizer's chat template counts them;
  ``tokenizer_facts``: the gate's ``Host`` facts from a tokenizer; ``served_names``: the names a request may give
  its ``model``;
- ``tokenizer_info`` / ``compile_for``: a Hugging Face tokenizer (or a host's wrapper of one) as the core's
  ``TokenizerInfo``, a constraint compiled for it at the model's output width; ``engine_tokenizer``: as an engine
  reads it (xgrammar's own view); ``with_stops``, ``stop_ids``, ``sampling_params``, ``encode_prompt``: a
  request's stop tokens, law and prompt ids; ``model_vocab_size``: a model folder's output width;
- ``server_compiles``: a server's compiles in a killable worker; ``Warmup``: a server's one-time set-up, waited for
  outside a request's deadline; ``drop_costly``: our compile cache emptied after work that grew the heap;
- ``wait_for``: a value a host loads on another thread; ``widen_listen_backlog``: ``http.server``'s listen backlog;
  ``logged``: a generator of responses whose final ``stats`` is logged;
- ``row_budget``: a budget for a host's mask rows, the far zone's tables made off the host's step; ``row_mask``: a
  request's row mask for a host's own sampler (the grammar with its budget, exact or ``RowCut``;
  stop tokens only where the constraint fails at generation time); ``RowCut.lost_now`` / ``off``: a row's budget
  found lost (once, logged, ``LOST_MIDWAY``) or dropped after a fault;
- ``compile_as_enforced``: a constraint compiled strictly, else as the host's engine enforces it (the host's
  policy: ``without_strict``); ``folder_tokenizer``: a served model folder's tokenizer as an engine reads it, once
  per process; ``cap_compile_cache``: our compile cache bounded as the host bounds its own; ``load_pack``: a
  server's engine-wide recipe pack loaded at start-up as a request's chain loads it;
- a launcher's command line and environment: ``option_value``, ``option_values``, ``json_option``,
  ``take_options``, ``switch_on``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .batch import RowRunner, judge_row
from .compile_worker import POOL as COMPILE_POOL
from .compiler import CACHE as COMPILE_CACHE, LIMITS, compile_constraint
from .constraint import CompiledConstraint, ConstraintSpec
from .distributions import SamplingParams
from .masks import mask_allows, set_bit
from .errors import ConstraintError, RequestError
from .gate import check_request
from .heap import SLACK as TRIM_SLACK, rss_bytes
from .history import MaskProcessor, StopOnlyMask
from .plugins import drafters as registered_drafters
from .recipes import resolve_name as resolve_pack_name
from .requests import SpecOptions
from .speculation import check_budget, make_drafter, make_loop
from .tokenizer import TokenizerInfo


@dataclass
class RequestPlan:
    """What the plugin read from one request."""

    spec: object  # ConstraintSpec | None
    options: SpecOptions
    explicit: bool  # the request sent a ``specgrammar`` object
    certified: bool = False  # its budget bound is certified (without our loop: a mask row, ``RowCut``)

    @property
    def loop(self) -> bool:
        """Whether the request needs our loop, served alone: its ``specgrammar`` object asks for what only our loop
        does (the cost-aware ``lambda`` / ``adaptive`` / ``budget``, a deferred ``trigger``), or for drafting
        (``k`` not 0) without a constraint (the batching path's speculative rows are its constrained rows).  A
        constrained request's own drafting options (``k``, ``drafters``, ``recipe``, ``engine``, ``budget_mask``)
        are honoured per row on the batching path (``RowPlan``)."""
        o = self.options
        if not self.explicit:
            return False
        return (o.lam is not None or o.adaptive or o.budget is not None or o.trigger is not None
                or (self.spec is None and o.k != 0)
                or (self.spec is not None and getattr(self.spec, "trigger", None) is not None))

    def row(self, compiled, server_k: int | None, host_k: int, params, max_tokens: int) -> "RowPlan":
        """The request as a batched speculative row: its options with its ``k`` resolved (``draft_k``)."""
        return RowPlan(compiled, replace(self.options, k=draft_k(self.options, server_k, host_k)), params, max_tokens)


def plan_options(options: SpecOptions, recipes_dir: str | None) -> SpecOptions:
    """The request's options with its drafter names checked (``RequestError``: 400) and its recipe, a name, looked
    up in the server's pack folder (``recipes_dir``) then the shipped packs (``RecipePackError``: 400)."""
    known = registered_drafters()
    bad = [d for d in options.drafters if d not in known]
    if bad:
        raise RequestError(f"unknown drafter(s) {', '.join(map(repr, bad))}; available: {', '.join(sorted(known))}",
                           field="specgrammar.drafters")
    if options.recipe:
        options = replace(options, recipe=str(resolve_pack_name(options.recipe, recipes_dir)))
    return options


def plan_request(body: dict, host, recipes_dir: str | None,
                 compile: Callable[[object, SpecOptions], CompiledConstraint | None] | None = None) -> RequestPlan | None:
    """A server's reading of one request, every error a 400 (or the gate's 404) before the host does any work: the
    gate (``check_request`` with the server's ``host``; the server's default max_tokens, cut to what the context
    leaves, written into ``body`` where the request gave none), then, for a request with a constraint or a
    ``specgrammar`` object (None: the host's own request), its options planned (``plan_options``) and its
    constraint compiled now (``compile(spec, options)``; None while the model is not loaded yet) with its budget
    checked (``BudgetError`` naming the shortest length; ``certified``: a bound the host applies as a mask row)."""
    checked = check_request(body, host)
    if not checked.max_tokens_given and checked.max_tokens is not None:
        body["max_tokens"] = checked.max_tokens
    spec, explicit = checked.spec, body.get("specgrammar") is not None
    if spec is None and not explicit:
        return None
    options = plan_options(checked.options, recipes_dir)
    certified = False
    compiled = compile(spec, options) if spec is not None and compile is not None else None
    if compiled is not None:  # (validated now; the compile cache keeps it for the host)
        fit = check_budget(compiled, options, checked.max_tokens)  # the request's max_tokens or the default
        certified = fit is not None and fit.settles
    return RequestPlan(spec, options, explicit, certified)


def draft_k(options: SpecOptions, server_k: int | None, host_k: int) -> int:
    """Draft tokens per round: the request's ``k``, else the server's option, else the host's own default."""
    return options.k if options.k is not None else (server_k if server_k is not None else host_k)


@dataclass
class RowPlan:
    """What a batched row needs to become a speculative row (set by the plugin on its grammar processor)."""

    compiled: object  # CompiledConstraint
    options: SpecOptions  # k resolved
    params: object  # SamplingParams
    max_tokens: int
    seed: int | None = None  # the row's verifier draws (None: fresh entropy; the batching path takes no seed)


class RowCut:
    """A budget applied as a mask row (``Budget.mask_row``), for a host whose sampler cannot draw again (mlx-lm's
    batching path, vLLM's structured-output bitmask): far from the budget the row is left as it is; in the tight
    zone only tokens with a certified completion within the tokens left stay.  The row is a function of the
    history, so the batched and the sequential loop, and every verification position of a speculative step, see
    the same row; our loop instead re-draws a token that does not fit (``Budget.draw``).

    ``margin`` / ``far``: ``CertifiedBudget.mask_row``'s (None: its defaults).  For a host that verifies drafts
    against those rows (vLLM), ``fitting`` says how many of a step's drafts they allow, where drafts are a function
    of the prefix (``deterministic_drafts``: greedy requests, argmax drafts, host drafts; sampled drafts are left
    whole, cutting one by its value would bias the host's rejection sampler), checking each draft alone in a row
    ``width`` tokens wide; a check it is asked to keep (``remember``: the proposer's) answers ``known`` for the
    same drafts after the same prefix (the host's own check of them), so each draft is checked once."""

    def __init__(self, budget, margin: int | None = None, far: str | None = None, width: int = 0,
                 deterministic_drafts: bool = False, name: str | None = None):
        self.budget = budget
        self.name = name  # the request's id (its lost budget logged and kept in LOST_MIDWAY under it)
        self.lost = False  # the budget was found lost (``lost_now``)
        self._kw = {k: v for k, v in (("margin", margin), ("far", far)) if v is not None}
        self.words = (int(width) + 31) // 32
        self.deterministic_drafts = deterministic_drafts
        # the last kept check: (the prefix it checked the drafts after, then those drafts up to the first one
        # refused; how long that prefix was; how many fit)
        self.checked: tuple[list[int], int, int] | None = None
        self._zero: np.ndarray | None = None  # (fitting's one-draft row)

    def restrict(self, row, generated) -> bool:
        return self.budget.mask_row(row, generated, **self._kw)

    def lost_now(self, generated: int, log: logging.Logger | None = None) -> str | None:
        """Once, the first time the budget is found lost after ``generated`` tokens: ``"budget_lost"`` (a token raised
        its shortest completion past the certificate at once) or ``"budget_lost_midway"`` (a committed prefix no
        certificate within the budget follows: a token the far zone does not check; the row's ``name`` kept in
        ``LOST_MIDWAY``), logged to ``log`` as a warning; else None.  The row may then be cut off at max_tokens."""
        if self.lost:
            return None
        if getattr(self.budget, "lost", False):
            self.lost = True
            if log is not None:
                log.warning("specgrammar: request %s left the certified budget (a token raised its shortest "
                            "completion by %s or more at once); it may be cut off at max_tokens", self.name,
                            self._kw.get("margin", "the margin"))
            return "budget_lost"
        if getattr(self.budget, "lost_midway", False):
            self.lost = True
            LOST_MIDWAY[self.name] = None
            while len(LOST_MIDWAY) > LOST_KEPT:
                LOST_MIDWAY.pop(next(iter(LOST_MIDWAY)))
            if log is not None:
                log.warning("specgrammar: request %s lost its budget certificate after %d tokens; it may be cut "
                            "off at max_tokens", self.name, generated)
            return "budget_lost_midway"
        return None

    def off(self) -> None:
        """The budget is dropped (a fault in it): the row is served without the cut from now on."""
        self.budget = _Uncut()

    def known(self, tokens, drafts) -> tuple[int, bool]:
        """What the kept check (``checked``) already says of ``drafts`` after ``tokens``: (j, refused), the first j
        drafts fit and, where ``refused``, the next one does not.  (0, False) where it checked after another prefix
        or other drafts.  A row is a function of the prefix alone, so the same draft after the same prefix has the
        same verdict."""
        c = self.checked
        if c is None or not len(drafts):
            return 0, False
        seen, base, n = c
        if len(tokens) != base or seen[:base] != tokens:
            return 0, False
        j = 0
        while j < len(drafts) and base + j < len(seen) and int(drafts[j]) == seen[base + j]:
            if j == n:  # the draft the kept check refused, after the same tokens
                return j, True
            j += 1
        return j, False

    def fitting(self, generated, drafts, remember: bool = False, start: int = 0) -> int:
        """How many of ``drafts`` (after the output ``generated``) the budget's rows allow, in order (all of them
        where drafts are sampled); ``start``: how many leading drafts are known to fit (``known``).  ``remember``:
        the check is kept (``checked``).  Each draft is checked alone (one zeroed row, its bit set and cleared): a
        draft the host's whole row cuts after all is rejected by that row, exactly.  A fault in the budget answers
        every draft (the host's row check still applies)."""
        if not self.deterministic_drafts or not len(drafts) or not self.words or start >= len(drafts):
            return len(drafts)
        if self._zero is None:
            self._zero = np.zeros(self.words, dtype=np.int32)
        row, w, n = self._zero, 0, len(drafts)
        kw = dict(self._kw, whole=False)
        try:
            prefix = generated.tolist() if isinstance(generated, np.ndarray) else [int(t) for t in generated]
            base = len(prefix)
            prefix.extend(int(t) for t in drafts[:start])
            for i in range(start, len(drafts)):
                t = int(drafts[i])
                w = t >> 5
                set_bit(row, t)
                self.budget.mask_row(row, prefix, **kw)
                prefix.append(t)
                if not mask_allows(row, t):
                    n = i
                    break
                row[w] = 0
        except Exception:
            n, remember = len(drafts), False
            self.checked = None
            row.fill(0)
        finally:
            row[w] = 0
            if remember:
                self.checked = (prefix, base, n)
        return n


class _Uncut:
    """A budget that cuts nothing (``RowCut.off``)."""

    lost = False

    def mask_row(self, row, generated, margin=0, whole=True, far="off") -> bool:
        return False


def row_budget(compiled: CompiledConstraint, options: SpecOptions, max_tokens: int | None, far: str | None = None):
    """``check_budget`` for a host that cuts the budget into its mask rows (``RowCut``) and builds it off its step
    (vLLM's grammar-compile thread): where the far zone is checked (``far`` not "off"), the tokenizer's table that
    zone reads is made now (``lexed``: once per tokenizer, ~0.8 s at 151,665 tokens), not in the host's step."""
    budget = check_budget(compiled, options, max_tokens)
    vocab = getattr(budget, "_vocab", None)
    if vocab is not None and far != "off":
        vocab.lexed()
    return budget


LOST_KEPT = 4096
LOST_MIDWAY: dict = {}  # the names of the rows whose budget lost its certificate mid-way, the last LOST_KEPT


def row_mask(plan: RequestPlan, compile: Callable[[], CompiledConstraint], max_tokens: int | None,
             stop_token_ids, log: logging.Logger):
    """The mask of a request's row for a host's own sampler, which cannot draw again (mlx-lm's logits processor):
    (mask, compiled).  The constraint's ``MaskProcessor`` with the request's budget in the row: an exact bound as
    it is, a certified one as ``RowCut`` (our loop, when it serves the request, re-draws instead).  Where the
    constraint or its budget fails at generation time (``compile()``, ``check_budget``), never the host's
    generation thread: logged to ``log``, a ``StopOnlyMask`` over ``stop_token_ids`` (the request ends at once)
    and None."""
    try:
        compiled = compile()
        fit = check_budget(compiled, plan.options, max_tokens)
    except (ConstraintError, ValueError) as e:
        log.error("specgrammar: constraint failed at generation time: %s", e)
        return StopOnlyMask(stop_token_ids, str(e)), None
    if fit is not None and fit.settles:
        fit = RowCut(fit)  # certified: a row
    return MaskProcessor(compiled, None, fit), compiled


class ServedRow:
    """One request's row in a host's own batch (a server's batching path), as our loop serves it: the host-neutral
    bookkeeping of a speculative row (its ``RowPlan``, its ``SpeculativeLoop`` on a ``RowRunner``, the token pending
    for the next pass) and of a plain row (``plan`` None: decoded by the host, answered here), with the host's
    stop rules (``answer``).  The host keeps its tensors: it feeds ``feed``'s tokens in its batched pass, judges each
    speculative row on its own logits rows (``judge``) and rolls its cache back by what the row kept.

    ``procs``: the host's handle of the request (mlx-lm's guarded processors), whose ``error`` the host answers the
    request with (``fail``).  ``own_first``: the host did not feed the prompt's last token (every new row of its
    prefill was speculative): the row's loop starts with it pending, as our serial loop does; else the host sampled
    the row's first token under the grammar processor and the loop starts with it in its history."""

    __slots__ = ("plan", "procs", "loop", "fresh", "pending", "done", "own_first")

    def __init__(self, plan: RowPlan | None = None, procs=None, own_first: bool = False):
        self.plan, self.procs, self.own_first = plan, procs, own_first
        self.loop = None
        self.fresh = plan is not None  # its loop is not started yet
        self.pending = None
        self.done = False

    @classmethod
    def of(cls, processors, own_first: bool = False) -> "ServedRow":
        """The row of a host's per-request logits processors: speculative when its only processor is our grammar
        processor carrying a ``RowPlan`` (``batch_row``), alone or as the only one in the host's guarded list (whose
        ``processors`` are the row's own: then that list is ``procs``); else a plain row."""
        for p in processors or ():
            inner = getattr(p, "processors", None)
            items = inner if inner is not None else [p]
            if len(items) == 1 and getattr(items[0], "batch_row", None) is not None and len(processors) == 1:
                return cls(items[0].batch_row, p if inner is not None else None, own_first)
        return cls(None, None, own_first)

    @property
    def live(self) -> bool:
        """A started speculative row that is not done: it drafts and is judged this pass."""
        return self.plan is not None and not self.done and self.loop is not None

    def start(self, tokens, first: int, width: int, tensors: str | None, max_tokens: int, draft_runner=None):
        """The row's loop starts (``make_loop`` on a ``RowRunner`` holding ``tokens``, what the host's cache holds);
        ``first``: the prompt's last token, pending (``own_first``), or the row's first token, sampled by the host,
        which must be in the grammar.  Returns that first token's finish reason ("stop" where it ends the row;
        None, and None for a pending one); raises where the loop cannot start (the host fails the row)."""
        p = self.plan
        held = list(tokens)
        loop = make_loop(RowRunner(held, width, tensors), [*held, first] if self.own_first else held, p.options,
                         constraint=p.compiled, params=p.params, rng=np.random.default_rng(p.seed),
                         max_tokens=max_tokens, draft_runner=draft_runner)
        if not self.own_first:
            if loop.matcher is not None and not loop.matcher.accept(first):
                raise RuntimeError(f"the first token {first} is outside the grammar")
            loop.emitted.append(first)
            loop.stats.emitted = 1
        self.loop, self.pending = loop, first
        if not self.own_first and (first in loop.stop_token_ids
                                   or (loop.matcher is not None and loop.matcher.is_terminated())):
            return "stop"
        return None

    def feed(self, token: int, block) -> list[int]:
        """What the row feeds the host's batched pass: a plain row its ``token``; a speculative row its pending
        token and ``block``'s drafts; a row that finished or failed this round (no block) one filler token."""
        if self.plan is None:
            return [token]
        return [self.pending, *block.tokens] if block is not None else [0]

    def judge(self, block, feed: list[int], logits, t_fwd: int):
        """The row's loop verifies its drafts on its own logits rows (``SpeculativeLoop._judge``, the serial loop's
        law and budget check) and commits: (the ``Commit``, how many of ``feed``'s positions the host's cache keeps)."""
        c, kept = judge_row(self.loop, block, feed, logits, t_fwd)
        self.pending = c.tokens[-1] if c.tokens else self.pending
        return c, kept

    def next_token(self, token: int) -> int:
        """The token the host feeds the row next: a speculative row's pending token, else the host's own."""
        return self.pending if self.plan is not None and self.pending is not None else token

    def answer(self, token: int, finish: str | None, length: bool, stopped: bool,
               log: logging.Logger | None = None) -> list[tuple[int, str | None]]:
        """The responses for one committed token, [(token, finish reason)]: ``length``, the host's max_tokens is
        reached; ``stopped``, the host's stop sequences matched (its "stop" drops the last token's text).  A grammar
        that ended without a stop token answers its last token first, then a stop token.  A row that finishes is
        done (its loop's statistics logged to ``log``)."""
        out: list[tuple[int, str | None]] = []
        if length:
            finish = "length"
        if stopped:
            finish = "stop"
        elif finish == "stop" and self.loop is not None and token not in self.loop.stop_token_ids:
            out.append((token, None))
            token = min(self.loop.stop_token_ids)
        out.append((token, finish))
        if finish is not None:
            self.done = True
            if self.loop is not None and log is not None:
                first = 0 if self.own_first else 1  # the host's pass that sampled the row's first token
                st = self.loop.stats
                log.info("specgrammar batch: %d tokens, %d target passes (%.2f tokens/pass), acceptance %.2f",
                         st.emitted, st.target_passes + first, st.emitted / (st.target_passes + first),
                         st.acceptance)
        return out

    def fail(self, e: BaseException) -> str | None:
        """The row fails with ``e``: done; the host answers the request with ``e`` through ``procs.error`` (finish
        None: the host removes the row), or, without a handle or where it already holds an error, ends it ("stop")."""
        self.done = True
        if self.procs is not None and getattr(self.procs, "error", None) is None:
            self.procs.error = e
            return None
        return "stop"


class PromptCounter:
    """Counts a request's prompt tokens as the server will (its chat template), in the handler thread, on a copy
    of the server's tokenizer (the generation thread's own is not shared across threads), one at a time."""

    def __init__(self, tokenizer, template_args: dict | None = None):
        self.tok = copy.deepcopy(tokenizer)
        self.template_args = dict(template_args or {})
        self.lock = threading.Lock()

    def __call__(self, body: dict) -> int:
        with self.lock:
            try:
                if "messages" not in body:
                    return len(self.tok.encode(body["prompt"]))
                return len(self._chat(body))
            except RequestError:
                raise
            except Exception as e:  # the template refused the messages (jinja's raise_exception, a TypeError)
                reason = str(e).strip().splitlines()[0][:200] if type(e).__name__ == "TemplateError" else ""
                raise RequestError("messages cannot be formatted with the model's chat template"
                                   + (f": {reason}" if reason else ""), field="messages") from None

    def _chat(self, body: dict) -> list[int]:
        messages = [dict(m) for m in body["messages"]]
        for m in messages:  # content parts -> their text (images are counted by the host's own processor)
            if isinstance(m.get("content"), list):
                m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p.get("text"), str))
        if not getattr(self.tok, "has_chat_template", False):
            text = "\n".join(str(m.get("content") or "") for m in messages)
            return self.tok.encode(text)
        kwargs = dict(self.template_args)
        if isinstance(body.get("chat_template_kwargs"), dict):
            kwargs.update(body["chat_template_kwargs"])
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools") or None,
                                            tokenize=True, **kwargs)


def tokenizer_facts(tokenizer, width: int, context_length: int | None = None,
                    template_args: dict | None = None) -> dict:
    """What a server's gate knows of its model from its Hugging Face tokenizer (or a host's wrapper of one), as
    ``Host`` keywords: the context length, the output width, the longest token in bytes (added tokens' text
    included), and the prompt counter of its chat template (``PromptCounter``)."""
    info = tokenizer_info(tokenizer, width)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    specials = [len(str(t).encode("utf-8")) for t in getattr(hf, "added_tokens_decoder", {}).values()]
    return dict(context_length=int(context_length) if context_length else None, vocab_size=width,
                max_token_bytes=max([1, *map(len, info.token_bytes), *specials]),
                count_tokens=PromptCounter(tokenizer, template_args))


def served_names(model: str | None) -> list[str]:
    """The names a request may give its ``model``: ``default_model``, the model as given and as a resolved path."""
    names = ["default_model"]
    if model:
        names.append(model)
        if Path(model).exists():
            names.append(str(Path(model).resolve()))
    return names


_TOKINFO: dict[tuple[int, int], tuple[object, TokenizerInfo]] = {}


def tokenizer_info(tokenizer, width: int) -> TokenizerInfo:
    """``TokenizerInfo`` of a host's tokenizer wrapper (its Hugging Face tokenizer at ``_tokenizer``) or of a
    Hugging Face tokenizer, masks padded to ``width``; every EOS id the wrapper knows (``eos_token_ids``) is a stop
    token.  Cached per tokenizer object."""
    key = (id(tokenizer), int(width))
    hit = _TOKINFO.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos_ids = sorted(int(i) for i in (getattr(tokenizer, "eos_token_ids", None) or ()))
    kw = {}
    if getattr(hf, "eos_token_id", None) is None and eos_ids:
        kw["eos_token"] = eos_ids[0]
    info = TokenizerInfo.from_hf(hf, vocab_size=None, stop_tokens=eos_ids, **kw)
    n = len(info.token_bytes)
    info = info.with_vocab_size(max(int(width), n)) if width else info
    _TOKINFO[key] = (tokenizer, info)
    return info


_ENGINE_TOKS: dict = {}  # (tokenizer name, vocab size, engine) -> TokenizerInfo as the engine reads it


def engine_tokenizer(hf, vocab_size: int, engine: str, log: logging.Logger | None = None) -> TokenizerInfo:
    """A Hugging Face tokenizer as ``engine`` reads it, masks ``vocab_size`` wide, cached per tokenizer name: for
    xgrammar, token bytes and special tokens from xgrammar's own view (``xgr.TokenizerInfo.from_huggingface``, as a
    host's xgrammar backend reads it: vLLM's).  They can differ from ours: xgrammar 0.2.8 finds no special tokens in
    a transformers-5 tokenizer whose specials are ``added_tokens``, so ``<|im_start|>`` is let through as text
    inside JSON strings, where our reading (specials never allowed) would refuse it.  Where xgrammar cannot read it,
    ours (a warning to ``log``); other engines: ours."""
    key = (getattr(hf, "name_or_path", id(hf)), vocab_size, engine)
    tok = _ENGINE_TOKS.get(key)
    if tok is None:
        tok = TokenizerInfo.from_hf(hf, vocab_size=vocab_size)
        if engine == "xgrammar":
            try:
                import xgrammar as xgr

                xi = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
                decoded = xi.decoded_vocab
                specials = frozenset(int(i) for i in xi.special_token_ids)
                n = min(len(decoded), vocab_size)
                tok = replace(tok, token_bytes=tuple(b"" if i in specials else bytes(decoded[i]) for i in range(n)),
                              special_ids=specials)
            except Exception as e:
                (log or logging.getLogger("specgrammar")).warning(
                    "specgrammar: could not read the tokenizer as xgrammar does (%s); using ours", e)
        _ENGINE_TOKS[key] = tok
    return tok


def with_stops(tok: TokenizerInfo, stop_ids, eos: int | None) -> TokenizerInfo:
    """``tok`` stopping on a request's stop tokens (a host's grammar ends on them: vLLM's ``all_stop_token_ids``),
    the EOS first when it is one of them; ``tok`` itself without any."""
    stop_ids = tuple(sorted(int(t) for t in (stop_ids or ())))
    if not stop_ids:
        return tok
    first = eos if eos in stop_ids else stop_ids[0]
    return replace(tok, eos_token_id=first, stop_token_ids=tuple(dict.fromkeys([first, *stop_ids])))


def model_vocab_size(folder: str, hf) -> int:
    """A model folder's output width (its ``config.json``'s ``vocab_size``), else the tokenizer's length."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except Exception:
        return len(hf)


def compile_for(constraint, tokenizer, width: int, engine: str | None = None) -> CompiledConstraint:
    """A ``ConstraintSpec`` (or an already compiled constraint) compiled for this tokenizer at ``width``."""
    if isinstance(constraint, CompiledConstraint):
        if constraint.tokenizer.vocab_size < width:
            raise ValueError(f"the constraint was compiled for {constraint.tokenizer.vocab_size} tokens but the model "
                             f"outputs {width}")
        return constraint
    if not isinstance(constraint, ConstraintSpec):
        raise TypeError(f"constraint must be a ConstraintSpec or CompiledConstraint, got {type(constraint).__name__}")
    return compile_constraint(constraint, tokenizer_info(tokenizer, width), engine=engine)


def stop_ids(tokenizer, tokinfo) -> tuple[int, ...]:
    """A request's stop tokens: the tokenizer's EOS ids and the constraint's (``TokenizerInfo``) stop ids."""
    eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
    return tuple(sorted(eos | set(tokinfo.stop_token_ids)))


def sampling_params(temperature: float | None = None, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                    temp: float | None = None) -> SamplingParams:
    t = temperature if temperature is not None else (temp if temp is not None else 0.0)
    return SamplingParams(temperature=float(t), top_k=int(top_k or 0), top_p=float(top_p if top_p else 1.0),
                          min_p=float(min_p or 0.0))


def encode_prompt(tokenizer, prompt) -> list[int]:
    """A prompt's ids: text encoded (with the special tokens unless it starts with BOS), an array's ids, a list."""
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    if hasattr(prompt, "tolist"):
        return [int(t) for t in prompt.tolist()]
    return [int(t) for t in prompt]


def wait_for(get: Callable[[], object], loading: Callable[[], bool], started: threading.Event,
             timeout: float = 120.0):
    """``get()`` once it is not None, waiting while ``loading()`` says it is coming (a model that loads on another
    thread at start-up; requests may arrive before it is ready).  Only then: once it was seen, a later call never
    waits (a value that is missing later, after a failed load, must not stall every request for ``timeout``)."""
    t0 = time.monotonic()
    while not started.is_set() and get() is None and loading():
        if time.monotonic() - t0 > timeout:
            break
        time.sleep(0.05)
    value = get()
    if value is not None:
        started.set()
    return value


def server_compiles(prestart: bool = False) -> None:
    """A server abandons a compile past its time limit for real: compiles run in a worker process killed at the
    deadline or past its memory limit (``compile_isolation="process"``, ``compile_worker``) unless
    ``SPECGRAMMAR_COMPILE_ISOLATION`` says otherwise (``thread`` keeps them in-process).  ``prestart``: the worker
    starts now (not where the host forks after this: a forked child must not share the parent's worker pipes)."""
    LIMITS.compile_isolation = os.environ.get("SPECGRAMMAR_COMPILE_ISOLATION", "process").strip()
    if prestart and LIMITS.compile_isolation == "process":
        COMPILE_POOL.prestart()


class Warmup:
    """A server's one-time set-up, run on its own thread before its first requests (the served tokenizer's tables,
    the compile worker, an engine's first compile: seconds on a loaded machine, more than a request's whole
    deadline).  A request that needs it waits for it (``wait``) outside its preparation deadline: the process's
    set-up is not a request's preparation.  A set-up that fails is logged, never fatal (the first requests pay)."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self.done = threading.Event()
        self.done.set()  # (cleared while a set-up runs)

    def start(self, work: Callable[[], object], log: logging.Logger, name: str = "specgrammar-warm-up") -> None:
        self.done.clear()

        def run():
            try:
                work()
            except Exception as e:
                log.warning("specgrammar: gate warm-up failed (%s: %s)", type(e).__name__, e)
            finally:
                self.done.set()

        threading.Thread(target=run, name=name, daemon=True).start()

    def wait(self, deadline=None) -> None:
        """Wait for the set-up (at most ``timeout``), outside ``deadline`` (the request's, ``prepare_deadline``)."""
        if not self.done.is_set():
            if deadline is None:
                self.done.wait(self.timeout)
                return
            with deadline.excluded():
                self.done.wait(self.timeout)


def drop_costly(before: int | None) -> int | None:
    """After costly work that began with the process at ``before`` bytes (``rss_bytes``): where it grew the heap
    past the trim slack (``heap.SLACK``, 64 MB), our compile cache is emptied (``COMPILE_CACHE.evict``: the grammars
    a live request holds stay found for it) and the growth returned, for the host to empty its own engine's cache
    too; else None.  A repeat of the costly work compiles again (bounded by the gate)."""
    after = rss_bytes()
    if before is None or after is None or after - before <= TRIM_SLACK:
        return None
    COMPILE_CACHE.evict()
    return after - before


def trim_when_freed(*objs) -> int:
    """After a costly compile (``drop_costly``): the heap is trimmed (``heap.trim``) as each of ``objs`` (the
    request's grammars: the host's and ours) is freed, since what the request holds is freed after the compile's own
    trim, when the request ends; how many are watched (None and objects without weak references are skipped).  In
    vLLM's EngineCore the 20,000-option choice's grammars were freed only after the next request's compile had
    trimmed, and glibc kept the ~50 MB until another trim (issue 33)."""
    import weakref

    from .heap import trim

    n = 0
    for obj in objs:
        if obj is None:
            continue
        try:
            weakref.finalize(obj, trim)
        except TypeError:
            continue
        n += 1
    return n


LISTEN_BACKLOG = 128


def widen_listen_backlog() -> None:
    """``http.server.ThreadingHTTPServer`` keeps socketserver's default listen backlog of 5: a burst of more
    simultaneous connections (32 in tests/test_concurrency.py) got connection resets before any handler ran.
    Widening the class's backlog before the server is built applies to it (``SPECGRAMMAR_LISTEN_BACKLOG``,
    default 128)."""
    from http.server import ThreadingHTTPServer

    backlog = int(os.environ.get("SPECGRAMMAR_LISTEN_BACKLOG", LISTEN_BACKLOG))
    if ThreadingHTTPServer.request_queue_size < backlog:
        ThreadingHTTPServer.request_queue_size = backlog


def logged(gen, log: logging.Logger):
    """``gen``'s responses, the final one's ``stats`` (tokens, target passes, acceptance, budget) logged."""
    try:
        for r in gen:
            if r.stats is not None:
                st = r.stats
                log.info("specgrammar: %d tokens, %d target passes (%.2f tokens/pass), acceptance %.2f, forced %d%s",
                         st.emitted, st.target_passes, st.tokens_per_pass, st.acceptance, st.forced_tokens,
                         f", budget {st.budget['budget']} shaped {st.budget['shaped_positions']} positions"
                         if st.budget.get("shaped") else "")
            yield r
    finally:
        gen.close()


# ---------------------------------------------------------------------------------------------- strict, else enforced
def without_strict(spec: ConstraintSpec, error: ConstraintError) -> ConstraintSpec | None:
    """A host policy for ``compile_as_enforced``: the host's engine ignores the JSON Schema keywords it does not
    enforce (vLLM 0.32's xgrammar backend), so a schema our strict mode refused for such a keyword (the refusal's
    own words, ``schema.refusal``) is the same schema with ``strict`` off; None for any other error."""
    if spec.kind != "json_schema" or spec.option("strict", True) is False or "strict=false" not in error.reason:
        return None
    return replace(spec, options=(*((k, v) for k, v in spec.options if k != "strict"), ("strict", False)))


def compile_as_enforced(spec: ConstraintSpec, tok: TokenizerInfo, engine: str | None, options: dict,
                        enforced: Callable[[ConstraintSpec, ConstraintError], ConstraintSpec | None] | None = None):
    """(compiled, lenient): ``spec`` compiled strictly by ``engine`` with ``options``, else, where the host's
    engine accepts what our strict mode refuses, the language that engine really enforces: ``enforced(spec,
    error)``, the host's policy (e.g. ``without_strict``), gives the constraint to compile instead (``lenient``
    True), or None, and the refusal stands.  Other errors stand."""
    try:
        return compile_constraint(spec, tok, engine=engine, **options), False
    except ConstraintError as e:
        instead = enforced(spec, e) if enforced is not None else None
        if instead is None:
            raise
        return compile_constraint(instead, tok, engine=engine, **options), True


# ---------------------------------------------------------------------------------------------- a served folder
_FOLDER_TOKS: dict = {}  # (folder, engine) -> TokenizerInfo: one table per process


def folder_tokenizer(folder: str, engine: str, log: logging.Logger | None = None) -> TokenizerInfo:
    """The tokenizer of a model folder as ``engine`` reads it (``engine_tokenizer``) at the model's output width
    (``model_vocab_size``), loaded once per process per folder and engine (a server's gate compiling for the model
    its host serves)."""
    tok = _FOLDER_TOKS.get((folder, engine))
    if tok is None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(folder)
        tok = _FOLDER_TOKS[(folder, engine)] = engine_tokenizer(hf, model_vocab_size(folder, hf), engine, log)
    return tok


def load_pack(recipe: str, tok: TokenizerInfo, vocab_size: int, k: int | None = None, extra: dict | None = None):
    """A server's engine-wide recipe pack loaded as a request's drafter chain loads it (``make_drafter`` with the
    ``recipe`` drafter alone: the pack file, its hash, its format, its tokenizer's fingerprint against ``tok``), so
    that a pack the server cannot load stops its start-up instead of every request's drafts: raises what the chain
    raises."""
    options = SpecOptions(k=k, drafters=("recipe",), recipe=recipe, extra={} if extra is None else extra)
    return make_drafter(options, tok, params=SamplingParams(temperature=0.0), target_vocab_size=vocab_size)


def cap_compile_cache(limit_bytes: int) -> None:
    """Our compile cache bounded by ``limit_bytes`` where that is lower than its bound (and above 0): a host that
    compiles every constraint again in its own engine, with its own cache bound (vLLM's ``VLLM_XGRAMMAR_CACHE_MB``)."""
    if 0 < limit_bytes < COMPILE_CACHE.max_bytes:
        COMPILE_CACHE.max_bytes = limit_bytes


def switch_on(name: str) -> bool:
    """An on/off environment switch (on by default): off where ``name`` is ``0``, ``false``, ``no`` or ``off``
    (any case)."""
    return os.environ.get(name, "1").lower() not in ("0", "false", "no", "off")


# ---------------------------------------------------------------------------------------------- a launcher's argv
def option_value(argv: list[str], name: str) -> str | None:
    """The value of the first ``name VALUE`` or ``name=VALUE`` in a command line, or None."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def option_values(argv: list[str], name: str) -> list[str]:
    """The values of an option that takes one or more (``--served-model-name a b``: up to the next option)."""
    for i, a in enumerate(argv):
        if a.startswith(name + "="):
            return [a.split("=", 1)[1]]
        if a == name:
            out = []
            for v in argv[i + 1:]:
                if v.startswith("-"):
                    break
                out.append(v)
            return out
    return []


def json_option(argv: list[str], name: str, *keys: str):
    """The JSON value of option ``name`` (``option_value``), or what it holds at ``keys`` (objects within objects):
    None where the option is missing, not JSON, or has nothing there."""
    raw = option_value(argv, name)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def take_options(argv: list[str], names) -> tuple[list[str], dict[str, str]]:
    """A command line split into (the rest, {name: value}) for the options ``names`` (``name VALUE`` or
    ``name=VALUE``; a later one wins), which a launcher handles itself before handing the rest on.  ``ValueError``
    when one of them ends the line with no value."""
    rest: list[str] = []
    taken: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        name = next((o for o in names if a == o or a.startswith(o + "=")), None)
        if name is None:
            rest.append(a)
            i += 1
        elif a == name:
            if i + 1 == len(argv):  # (was an IndexError out of the launcher)
                raise ValueError(f"{name} needs a value")
            taken[name] = argv[i + 1]
            i += 2
        else:
            taken[name] = a.split("=", 1)[1]
            i += 1
    return rest, taken
