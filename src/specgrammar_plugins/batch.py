"""The batch layer: grammar-aware drafting for many requests at once, for hosts that batch and verify themselves.

A host that drafts for a batch of requests (vLLM's draft-model, EAGLE and MTP proposers; any batched server) calls
this layer; the host keeps only what touches its own classes (its request objects, its tensors, its loop).

- ``RequestTable``: per-request grammar state keyed by the host's request id (``RequestState``: the history-keyed
  matcher, the host chain, the prompt length), synced to the committed tokens at every step (``begin``: a lazy
  ``DraftBlock`` on the history's own matcher), the outcome of the last drafts (``observe``), the counters, and
  per-request fault isolation (``fault``: a fault in our drafting for one request ends that request's grammar
  drafts, logged once; the others go on).  A host subclasses it and implements ``new_state(req, req_id)``: its
  request -> a ``RequestState`` (constraint, drafters).
- ``BatchDrafter``: one draft step over the batch, position by position (``Step`` of ``Row``s).  At each position
  ``plan`` runs every row's host chain first (forced tokens, jump-forward strings, recipes: once per block length)
  and sorts the rows into host drafts, model rows (the draft model drafts under the row's grammar) and rows with
  nothing of ours (``Plan``); ``known`` is every row's token when no row needs the model there, so the host skips
  the draft pass.  Argmax drafts are masked lazily (``lazy``: each model row's unmasked argmax offered to its
  block's matcher; only a refused row has its mask filled and its masked argmax taken, by the host's
  ``masked_argmax``); sampled drafts need every row's mask (``eager_rows``: one packed bitmask [B, V/32] per
  position, applied by the host's kernel).  ``advance`` pushes the position's tokens and counts each row's real
  drafts; ``unsure`` names the rows whose draft probability ``draft_confidence`` needs; ``needs_model`` says
  whether a later position needs the model (else the host ends its loop: ``EnoughDrafts``); ``tails`` and ``cuts``
  build and cut the step's [B, k] drafts.
- The target's hidden states: a drafter that reads them (EAGLE, MTP) gets them from its host; ``Step.hidden``
  carries what the host hands over for the step (opaque to this layer, which never reads a tensor), and
  ``block.HiddenStatesRunner`` is the runner face that returns them beside the logits.

Options (a host reads them from its configuration): ``refused_drafts`` (``REFUSED_DRAFTS``) and ``draft_confidence``
(``DRAFT_CONFIDENCE``).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from .block import DraftBlock, fill
from .drafters import observe as teach
from .history import HistoryMatcher
from .masks import set_bit

log = logging.getLogger("specgrammar")

# An argmax draft the grammar refuses means the draft model's law is mostly outside the grammar there: the masked
# argmax drafted in its place was accepted 21% of the times it was reached (389 of 1,822, the tiny pair on unseen
# schemas), so the positions after it are rarely reached, yet each costs a draft pass and a verification slot.  A
# request's drafts end after this many refused positions per step (option "refused_drafts"; None: up to k).  2, not
# 1: on SmolLM2-135M the first refused position's masked argmax is often right (pretty-printed JSON's whitespace),
# and ending there cost tokens per target pass (six workloads 3.70 -> 3.64, unseen schemas 2.30 -> 2.29; the tiny
# pair's schemas 1.58 -> 1.51) for 13-15% fewer draft-model passes per step (docs/BENCHMARKS.md, issue 32)
REFUSED_DRAFTS = 2
GREEDY_T = 1e-5  # a row with a temperature below it is greedy (vLLM's _SAMPLING_EPS; vLLM stores 0 for greedy)
# A request's drafts also end after a model draft when the chance the next position is reached falls below this:
# the product of the draft model's probabilities of its drafts at this step (option "draft_confidence"; None: off)
DRAFT_CONFIDENCE = 0.2
MEMO_SIZE = 256  # RequestTable.memo: requests' specs and compiled constraints kept, most recently used
COUNTERS = ("rounds", "draft_tokens", "verified_rounds", "verified_draft_tokens", "accepted_tokens",
            "requests_seen", "requests_without_grammar", "compile_errors", "invalid_history", "proposer_errors",
            "draft_passes", "draft_passes_skipped", "positions_without_logits", "budget_cut_off",
            "draft_rows_unmasked", "draft_rows_masked", "draft_rows_ended", "draft_rows_unlikely")
_MISS = object()


def refused_drafts_option(opts: dict) -> int | None:
    """The option ``"refused_drafts"``: after how many refused positions a request's drafts end at a step (0: at the
    first, with nothing drafted there, as vLLM's ``validate_tokens`` cuts a blind draft; None: never, up to k)."""
    n = opts.get("refused_drafts", REFUSED_DRAFTS)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f'the specgrammar option "refused_drafts" must be a non-negative integer or null, got {n!r}')
    return n


def draft_confidence_option(opts: dict) -> float | None:
    """The option ``"draft_confidence"``: a request's drafts end at a step after the model draft where the product of
    the draft model's probabilities of its drafts falls below this (0 or None: never)."""
    x = opts.get("draft_confidence", DRAFT_CONFIDENCE)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < 1:
        raise ValueError(f'the specgrammar option "draft_confidence" must be a number in [0, 1) or null, got {x!r}')
    return float(x) or None


# ---------------------------------------------------------------------------------------------- per request
class RequestState:
    __slots__ = ("history", "drafter", "prompt_len", "stop_ids", "pending", "grammar", "draws", "prompt", "stop_set")

    def __init__(self, history: HistoryMatcher | None, drafter, prompt_len: int, stop_ids: tuple[int, ...],
                 grammar: bool = True, draws=None):
        self.history = history  # None: no grammar drafts (no constraint, or it cannot be followed)
        self.drafter = drafter  # the host chain (forced, recipe), or None
        self.prompt_len = prompt_len
        self.stop_ids = stop_ids
        self.stop_set = frozenset(stop_ids)  # (each step's draft block takes it as it is)
        self.pending = 0  # drafts proposed at the last step, outcome not yet seen
        self.grammar = grammar  # the request has a constraint (False: unconstrained)
        # its drafters' random draws (the host's: ``at(position)`` restarts them at each step, so that they are a
        # function of the request and the position only, the same on every rank), or None
        self.draws = draws
        self.prompt: list[int] | None = None  # the prompt's tokens (``begin``), taught to the drafters at the end


class RequestTable:
    """Per-request grammar state keyed by the host's request id, and the counters.  A host subclass implements
    ``new_state(req, req_id) -> RequestState`` and calls ``init_table`` from its constructor."""

    def init_table(self, k: int, vocab_size: int, max_model_len: int, logger: logging.Logger | None = None) -> None:
        self.k = k
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.log = logger or log
        self._states: dict[str, RequestState] = {}
        self.counters = {name: 0 for name in COUNTERS}
        self.sources: dict[str, int] = {}
        self.accepted_by_position = [0] * k
        self.timing_ns = {"grammar": 0}  # host work of the grammar drafts (benchmarks read it)
        self.last_drafted: dict[str, int] = {}  # request id -> drafts proposed at its last step (tests)
        self._faulted: set = set()  # requests (and kinds of step-wide faults) already logged
        self._memos: OrderedDict = OrderedDict()  # memo's: a request's spec and compiled constraint by its params

    def new_state(self, req, req_id: str | None = None) -> RequestState:
        raise NotImplementedError

    def state(self, req_id: str, req) -> RequestState:
        st = self._states.get(req_id)
        if st is None:
            self.counters["requests_seen"] += 1
            st = self._states[req_id] = self.new_state(req, req_id)
        return st

    def memo(self, key, make):
        """``make()``, once per ``key`` (None: every time) among the last ``MEMO_SIZE`` keys.  For a request's spec
        and compiled constraint: building them runs in the host's step of each new request's first draft step, and
        many requests share one constraint.  A compiled constraint (a value with ``memory_bytes``) is kept by weak
        reference, as long as something else holds it: the compile cache, within its bound in bytes, or a live
        request.  (Issue 33: the memo held every compiled grammar of its last 256 keys however large; then, bounded
        by the cache's bytes, still the grammars the cache had dropped: in vLLM's EngineCore a 20,000-option choice,
        ~66 MB, after every cache was emptied, and one more per distinct costly grammar.)  Errors are not kept
        (they are raised again for every request)."""
        if key is None:
            return make()
        memo = self._memos
        hit = memo.get(key, _MISS)
        if isinstance(hit, weakref.ref):
            hit = hit()
            if hit is None:  # dropped by the cache and by every request
                hit = _MISS
        if hit is _MISS:
            hit = make()
            memo[key] = weakref.ref(hit) if hasattr(hit, "memory_bytes") else hit
            memo.move_to_end(key)
            while len(memo) > MEMO_SIZE:
                memo.popitem(last=False)
        else:
            memo.move_to_end(key)
        return hit

    def begin(self, st: RequestState, context: np.ndarray, n: int, k: int | None = None) -> DraftBlock | None:
        """The request's draft block for this step, on its history's own matcher synced to ``context[:n]`` (the
        committed tokens; a lazy block: the host verifies with masks of its own), or None when it gets no grammar
        drafts (no grammar, grammar complete, no room)."""
        h = st.history
        if h is None:
            return None
        # committed tokens only grow: compare and feed only what follows the last synced history (its last token
        # checked), the whole history otherwise (a new request, a preempted one recomputed)
        p, base = st.prompt_len, h.synced
        if st.prompt is None:
            st.prompt = context[:p].tolist()
        if 0 < base <= len(h.fed) and p + base <= n and h.fed[base - 1] == context[p + base - 1]:
            ok = h.sync_tail(base, context[p + base:n].tolist())
        else:
            ok = h.sync(context[p:n].tolist())
        if not ok:
            # The history holds a token our matcher rejects.  After the grammar's stop token this is the host's
            # bonus token past the end of a finishing request (vLLM's scheduler cuts it at the stop token): benign.
            # Anything else means our grammar and the host's disagree: never draft for this request again.
            if not st.history.matcher.is_terminated():
                self.counters["invalid_history"] += 1
                self.log.warning("specgrammar: committed tokens outside the grammar (fed ...%s, history ...%s); "
                                 "no more drafts for this request", st.history.fed[-8:],
                                 context[max(p, n - 8):n].tolist())
                st.history = None
            return None
        m = st.history.matcher
        if m.is_terminated():
            return None
        budget = min(self.k if k is None else k, self.max_model_len - n)
        if budget <= 0:
            return None
        if st.draws is not None:  # this step's draws: a function of the request and the position only
            st.draws.at(n)
        # the history's own matcher, not a fork (O(tokens so far) on xgrammar): the next sync rolls back the drafts
        # the host did not commit; lazy: a position's mask is filled only where something reads it
        # prompt_len: the drafters that tell the prompt from the output (prompt copy, layout, copy recipes) read it
        return DraftBlock(context[:n], st.history.draft(), self.vocab_size, budget, st.stop_set, prompt_len=p,
                          lazy=True)

    def record(self, st: RequestState, req_id: str, tokens: Sequence[int], sources: Sequence[str]) -> None:
        """Count the drafts proposed for a request at this step (its outcome is seen at the next one)."""
        self.last_drafted[req_id] = len(tokens)
        if not tokens:
            return
        st.pending = len(tokens)
        self.counters["rounds"] += 1
        self.counters["draft_tokens"] += len(tokens)
        for s in sources:
            self.sources[s] = self.sources.get(s, 0) + 1

    def observe(self, st: RequestState, num_sampled: int) -> None:
        """The outcome of the last round: ``num_sampled - 1`` drafts were accepted (plus one target token)."""
        if not st.pending:
            return
        accepted = max(0, min(st.pending, num_sampled - 1))
        self.counters["verified_rounds"] += 1
        self.counters["verified_draft_tokens"] += st.pending
        self.counters["accepted_tokens"] += accepted
        for j in range(min(accepted, len(self.accepted_by_position))):
            self.accepted_by_position[j] += 1
        st.pending = 0

    def prune(self, live) -> None:
        """Drop the state of every request not in ``live`` (finished or aborted), first teaching its drafters the
        request's tokens (``finished``)."""
        if len(self._states) > len(live) or any(r not in live for r in self._states):
            for r in [r for r in self._states if r not in live]:
                self.finished(r, self._states.pop(r))
                self.last_drafted.pop(r, None)
                self._faulted.discard(r)

    def finished(self, req_id: str, st: RequestState) -> None:
        """A request left the host: its learning drafters (the online suffix index, the server's layout index,
        recipe miss logs) see its prompt and the output its history synced, as the serial loop's drafters see
        every finished request (``drafters.observe``).  A fault here is logged, never raised."""
        h = st.history
        if st.drafter is None or st.prompt is None or h is None or not h.fed:
            return
        try:
            teach(st.drafter, [*st.prompt, *h.fed[:h.synced]], len(st.prompt))
        except Exception as e:
            self.fault("teaching its drafters", e)

    def fault(self, where: str, e: BaseException, req_id: str | None = None) -> None:
        """A fault in our own drafting: the request (or the step) gets no grammar drafts, the host goes on.
        Logged once per request, and once per kind of step-wide fault (with the traceback for the first few)."""
        self.counters["proposer_errors"] += 1
        key = req_id if req_id is not None else (where, type(e).__name__)
        if key not in self._faulted:
            if len(self._faulted) < 10_000:  # (request ids leave with their requests; step-wide kinds are few)
                self._faulted.add(key)
            self.log.warning("specgrammar: %s failed (%s: %s)%s; no grammar drafts there", where, type(e).__name__,
                             e, f" for request {req_id}" if req_id else "",
                             exc_info=self.counters["proposer_errors"] <= 3)
        if req_id is not None:
            if req_id in self._states:
                self._states[req_id].history = None

    @property
    def num_live_requests(self) -> int:
        return len(self._states)

    def stats(self) -> dict:
        return {**self.counters, "sources": dict(self.sources), "accepted_by_position": list(self.accepted_by_position),
                "live_requests": len(self._states), "grammar_ms": self.timing_ns["grammar"] / 1e6}


# ---------------------------------------------------------------------------------------------- one draft step
class Row:
    """One batch row's drafting at this step: its request state and draft block (None: no grammar drafts)."""

    __slots__ = ("req_id", "st", "block", "real", "tried", "refused", "reach", "temperature", "pending")

    def __init__(self, req_id, st, block, temperature: float = 0.0):
        self.req_id = req_id
        self.temperature = temperature  # the request's sampling temperature (below GREEDY_T: greedy)
        self.st = st
        self.block = block
        self.real = 0  # leading positions whose drafted token is the block's (the request's real drafts)
        self.tried = -1  # the block length at which the host chain last ran and stopped (it would stop there again)
        self.refused = 0  # positions at this step where the grammar refused the draft model's argmax
        self.reach = 1.0  # the product of the draft model's probabilities of its drafts at this step
        self.pending: list[int] | None = None  # positions of host drafts the draft arbiter judges when it gets there

    def chain(self, j: int, arbiter: "Arbiter | None" = None, i: int = -1) -> None:
        """Run the request's host chain (forced tokens, jump-forward strings, recipes) until the block has a token
        at position ``j``, is done, or the chain has nothing more: once per block length, since the chain is a
        function of the block's sequence (``plan`` and ``needs_model`` both ask at the same length).  ``arbiter``
        (the chain has a ``draft_arbiter``): the host's draft model judges the chain's one-hot drafts, at position
        ``j`` now where it has that position's logits (row ``i``'s), past it where they come (``judge``)."""
        b = self.block
        n = len(b.tokens)
        if n <= j and n != self.tried and not b.done:
            d = self.st.drafter
            if d is not None:  # (``fill``, its first ``done`` asked above: once per row per position)
                judged = arbiter is not None and getattr(d, "host_sure", None) is not None
                if judged:
                    arbiter.row, arbiter.i = self, i
                    d.judge = arbiter
                try:
                    while d.extend(b, b.room) > 0 and not b.done:
                        pass
                finally:
                    if judged:
                        d.judge = None
            self.tried = len(b.tokens)

    def judge(self, j: int, arbiter: "Arbiter") -> None:
        """The draft arbiter at position ``j`` for a one-hot draft the chain pushed there before the draft model's
        logits of ``j`` came (``pending``): where the draft model overrules it (its masked argmax another token,
        held with at least the chain's ``host_sure`` in its untempered law), the block is cut back to ``j`` and the
        chain runs there again, judged now (the position may become the draft model's), as where the chain holds
        the draft model and judges each draft at its own position."""
        p = self.pending
        while p and p[0] < j:
            p.pop(0)
        if not p or p[0] != j:
            return
        p.pop(0)
        b = self.block
        d = self.st.drafter
        if len(b.tokens) <= j or b.dead or b.masks is None or b.masks[j] is None or d is None:
            return
        best, q = arbiter.top_of(b.masks[j])
        if best != b.tokens[j] and q >= d.host_sure:
            b.cut(j)
            self.pending = None
            self.tried = -1
            d.gated += 1


class Arbiter:
    """The host's draft model as the judge of the rows' one-hot host drafts at draft position ``pos``
    (``drafters.draft_arbiter``, through ``ChainDrafter.judge``): ``top(block)`` is the host's ``top(i, mask)`` for
    the row being run (``i``): the draft model's most likely token at the block's position under its packed mask,
    and its probability in the untempered masked law, from the logits of this position (the host computes them on
    first demand).  ``ready(block)``: whether the block is at ``pos`` (else, or with no ``top``: the logits are not
    there yet, and the draft pushed there is judged later: ``defer``, ``Row.judge``)."""

    __slots__ = ("pos", "_top", "i", "row")

    def __init__(self, pos: int, top: Callable[[int, np.ndarray], tuple[int, float]] | None = None):
        self.pos = pos
        self._top = top
        self.i = -1
        self.row: Row | None = None

    def ready(self, block: DraftBlock) -> bool:
        return self._top is not None and len(block.tokens) == self.pos

    def top(self, block: DraftBlock) -> tuple[int, float]:
        return self.top_of(block.mask())

    def top_of(self, mask: np.ndarray) -> tuple[int, float]:
        return self._top(self.i, mask)

    def defer(self, position: int) -> None:
        r = self.row
        if r.pending is None:
            r.pending = []
        r.pending.append(position)


class Step:
    """One draft step: its rows (None: a row the host ignores, e.g. a partial prefill), k, the position being
    drafted, what the host keeps per drafted position (``tokens``, ``probs``: its tensors) and ``hidden``: the
    target's hidden states the host hands over for drafters that read them (opaque here)."""

    __slots__ = ("rows", "k", "pos", "tokens", "probs", "hidden", "judged")

    def __init__(self, rows: list[Row | None], k: int, hidden: Any = None):
        self.rows = rows
        self.k = k
        self.pos = 0
        self.tokens: list = []  # per drafted position: the [B] draft tokens (host tensor)
        self.probs: list = []  # per drafted position: their [B, V] probabilities, or None (argmax drafts)
        self.hidden = hidden
        self.judged = False  # the host's draft model judges the chains' one-hot drafts (``plan``'s ``top``)


class Plan:
    """One draft position's rows (``BatchDrafter.plan``): ``host`` (row, host draft), ``model`` (the rows whose draft
    the model makes under their grammar), ``masked`` (row, its filled packed mask: sampled drafts only, which need
    every such row masked), ``known``: every row's token when no row needs the model there."""

    __slots__ = ("host", "model", "masked", "known")

    def __init__(self):
        self.host: list[tuple[int, int]] = []
        self.model: list[int] = []
        self.masked: list[tuple[int, np.ndarray]] = []
        self.known: list[int] | None = None


class EnoughDrafts(Exception):
    """Raised from inside a host's drafting loop when no request needs the draft model at a later position: every
    draft left is a host draft or nothing, so the remaining draft-model passes are skipped (the host catches it
    around its loop and assembles the drafts: ``BatchDrafter.tails``)."""


class BatchDrafter:
    """The per-position logic of one draft step over a batch (see the module docstring).  ``table``: the host's
    ``RequestTable`` (or anything with its ``counters``, ``fault``, ``begin``, ``state``, ``observe``, ``record``).
    ``refused_drafts`` and ``confidence``: the options."""

    def __init__(self, table, vocab_size: int, refused_drafts: int | None = REFUSED_DRAFTS,
                 confidence: float | None = DRAFT_CONFIDENCE):
        self.table = table
        self.vocab_size = vocab_size
        self.refused_drafts = refused_drafts
        self.confidence = confidence

    # ------------------------------------------------------------------ a step's rows
    def row(self, req_id: str, req, accepted: int, context: Callable[[], np.ndarray] | None, k: int,
            temperature: float = 0.0) -> Row:
        """Row of request ``req_id`` (the host's request object ``req``): the outcome of its last drafts (``accepted``
        tokens sampled at the last step, the bonus token included), its committed tokens (``context()``; None: no
        room for drafts) and its draft block.  A fault here is the request's alone: it drafts as the host's own."""
        g = self.table
        try:
            st = g.state(req_id, req)
            g.observe(st, accepted)
            block = None
            if context is not None:
                ctx = context()
                block = g.begin(st, ctx, len(ctx), k)
            return Row(req_id, st, block, temperature)
        except Exception as e:
            g.fault("starting its draft step", e, req_id)
            return Row(req_id, None, None)

    def plan(self, step: Step, num_rows: int, fill: bool = False,
             top: Callable[[int, np.ndarray], tuple[int, float]] | None = None) -> Plan:
        """Each row's draft at position ``step.pos``: a host draft (the chain runs first), a model draft under the
        row's grammar (``fill``: its mask filled now, for sampled drafts; argmax drafts fill only the rows whose
        argmax the grammar rejects, in ``lazy``), or nothing of ours (no grammar: the model drafts as the host's
        own; past a request's drafts: padding, cut by ``cuts``).  ``top(i, mask)``: the host's draft model's most
        likely token for row ``i`` at this position under a packed mask and its untempered masked probability
        (``Arbiter``): with it, the chains' one-hot drafts are judged by the draft arbiter, each at its own
        position's pass (``Row.judge``)."""
        j = step.pos
        arbiter = None
        if top is not None:
            step.judged = True
            arbiter = Arbiter(j, top)
        rows = step.rows
        plan = Plan()
        known: list[int] | None = [0] * num_rows
        for i in range(min(num_rows, len(rows))):
            r = rows[i]
            if r is None:
                continue
            b = r.block
            if b is None:
                if r.st is None or not r.st.grammar:
                    known = None  # no grammar (or a fault): the model drafts, as the host's own
                continue
            try:
                if r.pending and arbiter is not None:
                    arbiter.i = i
                    r.judge(j, arbiter)
                r.chain(j, arbiter, i)  # the host chain first: forced tokens, jump-forward strings, recipes
                if len(b.tokens) > j:  # a host draft
                    t = b.tokens[j]
                    plan.host.append((i, t))
                    if known is not None:
                        known[i] = t
                elif not b.done:
                    if fill:
                        row = b.mask()
                        if not np.count_nonzero(row):  # nothing allowed (cannot happen for a live grammar)
                            b.closed = True
                            continue
                        plan.masked.append((i, row))
                    plan.model.append(i)
                    known = None
                # else: past the request's drafts (e.g. the grammar is complete): padding
            except Exception as e:
                self.table.fault("the grammar mask at a draft position", e, r.req_id)
                r.block = None
                known = None
        plan.known = known
        return plan

    def lazy(self, plan: Plan, rows, toks: list[int], masked_argmax: Callable[[list], list[int]]) -> bool:
        """Argmax drafts under the grammar without masking every row, on ``toks`` (the unmasked argmax of every row,
        changed in place).  The unmasked argmax of a row whose grammar allows it is the masked argmax too (masking
        only lowers other entries to -inf, and ``argmax`` takes the first maximum, which is then the first allowed
        one), so each model row's argmax is offered to its block first: on a lazy block (``DraftBlock.lazy``) the
        matcher's own ``accept`` checks and takes it, with no [V]-wide mask filled at all.  Only a row whose argmax
        the grammar rejects has its mask filled and its masked argmax found (``masked_argmax(items)``, the host's,
        items: (row, its packed mask)); a row with a host draft takes that token (the argmax of its one-hot mask).
        Exact, token for token, against masking every row.  The model's tokens are pushed onto their blocks here
        (``advance`` then only counts).  A row refused at its ``refused_drafts``-th position of the step drafts the
        masked argmax there and its block closes; past that (limit 0) it closes before, with no mask filled and the
        host's own token left in the row (``cuts`` cuts it).  Returns whether ``toks`` changed."""
        vocab = self.vocab_size
        changed = False
        for i, t in plan.host:
            if toks[i] != t:
                toks[i] = t
                changed = True
        limit = self.refused_drafts
        items = []  # the refused rows: (i, its mask)
        ended = 0  # rows whose drafts end here (``refused_drafts``)
        for i in plan.model:
            t = toks[i]
            r = rows[i]
            try:  # the matcher's accept, and for a refused row its mask: a fault there is this request's alone
                if t < vocab and r.block.push(t, None, "model"):
                    continue
                r.refused += 1
                if limit is not None and r.refused > limit:  # (limit 0) its drafts end before this position: no
                    r.block.closed = True  # mask; the row keeps the host's draft, cut by cuts
                    ended += 1
                    continue
                items.append((i, r.block.mask()))
            except Exception as e:  # no grammar drafts for it (its row keeps the host's draft, cut by cuts)
                self.row_fault(r, e)
        c = self.table.counters
        c["draft_rows_unmasked"] += len(plan.model) - len(items) - ended
        c["draft_rows_masked"] += len(items)
        if items:
            for (i, _), t in zip(items, masked_argmax(items)):
                toks[i] = t
                r = rows[i]
                try:
                    if not r.block.push(t, None, "model"):  # (nothing allowed there: cannot happen for a live
                        r.block.closed = True  # grammar) no more drafts for it
                    elif limit is not None and r.refused >= limit:  # the masked argmax is its last draft here
                        r.block.closed = True
                        ended += 1
                except Exception as e:
                    self.row_fault(r, e)
            changed = True
        c["draft_rows_ended"] += ended
        return changed

    def row_fault(self, r: Row, e: BaseException) -> None:
        """A fault in one request's drafting at this position: that request gets no grammar drafts from here on
        (``RequestTable.fault``); this step's drafts for it are cut by ``cuts``."""
        self.table.fault("a draft position", e, r.req_id)
        r.block = None

    @staticmethod
    def eager_rows(plan: Plan, bitmask: np.ndarray, num_rows: int) -> int:
        """Every row's mask in the packed ``bitmask`` [B, V/32] (draws from the masked law need its probabilities):
        a host draft's one-hot row, the grammar's row, else all ones.  Returns ``num_rows``."""
        bitmask[:num_rows] = -1
        for i, t in plan.host:
            bitmask[i] = 0
            set_bit(bitmask[i], t)
        for i, row in plan.masked:
            bitmask[i] = row
        return num_rows

    def advance(self, step: Step, tokens: list[int], conf: dict[int, float] | None = None) -> None:
        """Push the model's draft of position ``step.pos`` onto each block that has no token there yet (a host
        draft, or an argmax draft ``lazy`` pushed, has), and count the positions where the drafted token is the
        block's.  ``conf``: row -> the draft model's probability of its token (``unsure``'s rows); a request whose
        product of them at this step falls below ``confidence`` drafts nothing more at this step (that draft is
        its last: ``draft_confidence``)."""
        j = step.pos
        low = self.confidence
        ended = 0
        for i, r in enumerate(step.rows):
            b = r.block if r is not None else None
            if b is None:
                continue
            t = int(tokens[i])
            if len(b.tokens) == j and not b.done and not b.push(t, None, "model"):
                b.closed = True  # outside the mask: cannot happen after masking
            if r.real == j and len(b.tokens) > j and b.tokens[j] == t:
                r.real += 1
                if conf and i in conf and low is not None and b.sources[j] == "model" and not b.closed:
                    r.reach *= conf[i]
                    if r.reach < low:
                        b.closed = True
                        ended += 1
        if ended:
            self.table.counters["draft_rows_unlikely"] += ended

    def unsure(self, step: Step, plan: Plan) -> list[int]:
        """The rows whose draft-model probability ``draft_confidence`` needs at this position: model rows of sampled
        requests (a greedy request's argmax draft is accepted or not by the target's argmax, not by chance) whose
        drafts go on, before the last position (nothing follows it)."""
        if self.confidence is None or step.pos >= step.k - 1:
            return []
        rows = step.rows
        out = []
        for i in plan.model:
            r = rows[i]
            if r.temperature >= GREEDY_T and r.block is not None and not r.block.closed:
                out.append(i)
        return out

    @staticmethod
    def needs_model(step: Step) -> bool:
        """Whether any request needs a draft-model token at position ``step.pos`` or later: one without grammar
        drafts (the host's own drafting), or one whose host chain stops before its block is done, or (the draft
        arbiter) one with a host draft there or later that the draft model's logits are still to judge."""
        p = step.pos
        arbiter = Arbiter(p) if step.judged else None
        for r in step.rows:
            if r is None:  # a row the host ignores (a partial prefill)
                continue
            b = r.block
            if b is None:
                if r.st is None or not r.st.grammar:
                    return True
                continue
            r.chain(p, arbiter)  # what plan does first at position p
            if not b.done or (r.pending and r.pending[-1] >= p):  # (the arbiter judges it at its pass)
                return True
        return False

    @staticmethod
    def tails(step: Step) -> list[list[int]]:
        """Each row's tokens for the positions the host's loop did not draw (from ``step.pos`` to k), when it
        stopped early: each block's host drafts, then padding 0 (cut by ``cuts``); the rows' real drafts counted."""
        done, k = step.pos, step.k
        out = []
        for r in step.rows:
            b = r.block if r is not None else None
            tail = []
            for p in range(done, k):
                t = b.tokens[p] if b is not None and p < len(b.tokens) else -1
                if t >= 0 and r.real == p:
                    r.real += 1
                tail.append(max(t, 0))
            out.append(tail)
        return out

    def cuts(self, step: Step, k: int, fits: Callable[[Row, int], int] | None = None) -> list[tuple[int, int]]:
        """Count each request's drafts and say where each row's drafts end: (row, real drafts) for every row with
        fewer than k (the host cuts what follows, e.g. with -1).  Rows without a grammar keep the model's drafts.
        ``fits(row, real)``: how many of a row's real drafts the host lets through (its budget's rows)."""
        g = self.table
        cut = []
        for i, r in enumerate(step.rows):
            if r is None or r.st is None:
                continue
            if not r.st.grammar:  # no grammar: the model's drafts, as the host's own
                g.record(r.st, r.req_id, [0] * k, ["model"] * k)
                continue
            real = r.real if r.block is not None else 0
            b = r.block
            if real and fits is not None and r.st.history is not None:
                real = fits(r, real)
            if b is None:
                g.record(r.st, r.req_id, [], [])
            else:
                g.record(r.st, r.req_id, b.tokens[:real], b.sources[:real])
            if real < k:
                cut.append((i, real))
        return cut

    @staticmethod
    def end(step: Step) -> None:
        """No more grammar drafts at this step (a step-wide fault): every open block closes."""
        for r in step.rows:
            if r is not None and r.block is not None:
                r.block.closed = True



# ---------------------------------------------------------------------------------------------- batched verification
class RowRunner:
    """The target as one row of a batched host sees it (a ``ModelRunner`` for the row's ``SpeculativeLoop``): the
    tokens the host's cache holds for the row, and the rollback the row's verdict asks for (``trim``: counted in
    ``dropped``, carried out by the host for all rows at once).  ``forward`` is the host's batched pass, never this
    row's alone (``BatchLoop.step``)."""

    def __init__(self, tokens: Sequence[int], vocab_size: int, tensors: str | None = None):
        self._tokens = [int(t) for t in tokens]
        self.vocab_size = vocab_size
        self.tensors = tensors  # the host's tensor library (the row's law backend: ``laws.for_runner``)
        self.dropped = 0

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def forward(self, tokens, logits_for=None):
        raise RuntimeError("a batch row is fed by its host's batched target pass (BatchLoop.step)")

    def fed(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(int(t) for t in tokens)

    def trim(self, n: int) -> None:
        if n < 0 or n > len(self._tokens):
            raise ValueError(f"cannot trim {n} of {len(self._tokens)} tokens")
        if n:
            del self._tokens[-n:]
            self.dropped += n


class DraftPending(Exception):
    """A ``DraftRow`` was asked for logits its host has not computed yet (``draft_rows`` catches it)."""


class DraftRow(RowRunner):
    """The draft model as one row of a host's batched draft cache sees it (the runner of the row's
    ``ModelDrafter``): the tokens the host's cache holds for the row; ``trim`` is counted and carried out by the host
    before the row's next feed; ``forward`` returns the logits the host's batched draft pass computed for exactly
    these tokens, else records them (``want``) and raises ``DraftPending``: the row's drafting waits at that position
    for the next batched draft pass (``draft_rows``)."""

    def __init__(self, tokens: Sequence[int], vocab_size: int, tensors: str | None = None):
        super().__init__(tokens, vocab_size, tensors)
        self.want: list[int] | None = None
        self._ready = None  # (tokens, logits) from the host's pass
        self._told = 0  # of ``dropped``, what the host was told to drop

    def forward(self, tokens, logits_for=None):
        tokens = [int(t) for t in tokens]
        if logits_for != 1:
            raise ValueError("a draft row hands over the logits of its last fed position only (logits_for=1)")
        if self._ready is not None and self._ready[0] == tokens:
            logits, self._ready = self._ready[1], None
            self._tokens.extend(tokens)
            return logits
        self.want = tokens
        raise DraftPending()

    def ask(self) -> tuple[int, list[int]]:
        """What the host's pass does for this row: (tokens to drop from the row's cache first, tokens to feed)."""
        drop, self._told = self.dropped - self._told, self.dropped
        return drop, list(self.want or ())

    def give(self, logits) -> None:
        """The host's logits [1, V] for the tokens the row asked for."""
        self._ready, self.want = (self.want, logits), None


def _waiting_drafter(loop):
    """The row's drafter that drafts with a ``DraftRow`` (the one that can wait for a batched draft pass)."""
    for d in getattr(loop.drafter, "drafters", None) or [loop.drafter]:
        if isinstance(getattr(d, "runner", None), DraftRow):
            return d
    return None


def _fill_row(loop, block: DraftBlock) -> bool:
    """Fill ``block`` with the row's chain; True when the row waits for a draft pass.  After the pass the whole chain
    runs again from the position where it waited (it is a function of the block's sequence, and the waiting
    drafter's runner now holds the logits), not the waiting drafter alone: the draft model may have been asked to
    judge another source's one-hot draft there (``drafters.draft_arbiter``), which must be judged as the serial loop
    judges it."""
    try:
        if block.budget > 0:
            fill(block, loop.drafter)
    except DraftPending:
        return True
    return False


def draft_rows(rows: Sequence[tuple[Any, Any]], draft: Callable[[dict], dict] | None = None) -> list:
    """One round's drafts for every row ``(key, SpeculativeLoop)``, in step: each row's chain fills its block as
    ``SpeculativeLoop._draft`` does, and a row whose draft model (a ``ModelDrafter`` over a ``DraftRow``) needs
    logits waits at that position.  When every row waits or is done, ONE batched draft pass serves every waiting
    row, ``draft({key: (drop, tokens)}) -> {key: logits [1, V]}`` (the host drops ``drop`` tokens from the row's
    cache, feeds ``tokens`` and returns the logits of the last), and the rows go on from where they waited.  So a row
    drafts exactly as it would alone (same chain, masks, law and random draws); only the draft passes are shared.
    Returns per row its finished ``DraftBlock``, or the exception that failed its drafting (its own, or the draft
    pass's for the rows that waited on it)."""
    out: list = [None] * len(rows)
    waiting: dict[int, DraftBlock] = {}

    def go(i: int, block: DraftBlock) -> None:
        try:
            if _fill_row(rows[i][1], block):
                if draft is None:
                    raise RuntimeError("a row's draft model waits for a batched draft pass, but the host has none")
                waiting[i] = block
                return
            block.finish()
            out[i] = block
        except Exception as e:
            out[i] = e

    for i, (_, loop) in enumerate(rows):
        try:
            block = loop._open()
        except Exception as e:
            out[i] = e
            continue
        go(i, block)
    while waiting:
        now, waiting = waiting, {}
        runners = {i: _waiting_drafter(rows[i][1]) for i in now}
        try:
            logits = draft({rows[i][0]: runners[i].runner.ask() for i in now})
        except Exception as e:  # the shared pass failed: the rows that waited on it fail, the others go on
            for i in now:
                out[i] = e
            break
        for i, block in now.items():
            try:
                runners[i].runner.give(logits[rows[i][0]])
            except Exception as e:
                out[i] = e
                continue
            go(i, block)
    return out


def judge_row(loop, block, feed: list[int], logits, t_fwd: int):
    """One row of a batched pass verified by its own loop (``SpeculativeLoop._judge``: the serial loop's law and
    budget check) and committed: (the ``Commit``, how many of ``feed``'s positions the host's cache keeps).
    ``loop.target`` is the row's ``RowRunner``, told what the pass fed it."""
    runner = loop.target
    runner.fed(feed)
    before = runner.dropped
    c = loop._judge(block, logits, t_fwd)
    loop._settled(c)
    return c, len(feed) - (runner.dropped - before)


class BatchLoop:
    """Batched speculative decoding: one ``SpeculativeLoop`` per request (its drafter chain, matcher, budget,
    sampling law and random stream, built by ``speculation.make_loop`` on a ``RowRunner``), and per round ONE
    batched target pass over every row's [pending, *drafts] (``target.forward``: the host pads the rows to one
    length).  Each row is then verified and committed by its own loop (``SpeculativeLoop._judge``: the same
    accept/residual law and budget check as the serial loop), and the host rolls each row's cache back to what
    the row kept (``target.rollback(kept)``: per row, the number of this round's fed positions that stay).  A
    fault in one row's drafting or verdict is that row's alone: it leaves the batch with its error.

    The host's ``target``: ``forward(feeds: list[list[int]]) -> list[logits rows]`` (row i: [len(feeds[i]), V]),
    ``rollback(kept: list[int])`` and ``remove(keep: list[int])`` (the batch rows that stay, in order), with its
    rows in the order of ``rows``; ``add`` is called after the host added the request's row, its cache holding
    prompt[:-1].  ``draft``: the host's batched draft pass for rows that draft with a draft model over a ``DraftRow``
    (``draft_rows``; ``draft.keep(request ids)`` when rows leave), else None."""

    def __init__(self, target, draft=None):
        self.target = target
        self.draft = draft
        self.rows: list[tuple[Any, Any]] = []  # (request id, its SpeculativeLoop)
        self.passes = 0  # batched target passes

    def add(self, req_id, loop) -> None:
        if not isinstance(loop.target, RowRunner):
            raise TypeError("a batch row's loop runs on a RowRunner (BatchLoop.runner)")
        self.rows.append((req_id, loop))

    @staticmethod
    def runner(prompt: Sequence[int], vocab_size: int, tensors: str | None = None) -> RowRunner:
        """The row's target, holding prompt[:-1] (the host prefilled it; the last prompt token is pending)."""
        return RowRunner(list(prompt)[:-1], vocab_size, tensors)

    def step(self) -> list[tuple[Any, Any]]:
        """One round for every row: [(request id, its ``Commit``, or the exception that failed it)], in row order.
        Rows that finished or failed leave the batch (``target.remove``)."""
        blocks = draft_rows(self.rows, self.draft)
        feeds: list[list[int]] = []
        out: list[tuple[Any, Any]] = []
        for (_, loop), block in zip(self.rows, blocks):
            pending = loop.prompt[-1] if not loop.emitted else loop.emitted[-1]
            # a row whose drafting failed is fed its pending token only, then leaves
            feeds.append([pending] if isinstance(block, BaseException) else [pending, *block.tokens])
        t_fwd = time.perf_counter_ns()
        logits = self.target.forward(feeds)
        self.passes += 1
        kept, keep = [], []
        for i, ((req_id, loop), block, feed) in enumerate(zip(self.rows, blocks, feeds)):
            if isinstance(block, BaseException):
                out.append((req_id, block))
                kept.append(0)
                continue
            try:
                c, n = judge_row(loop, block, feed, logits[i], t_fwd)
            except Exception as e:
                out.append((req_id, e))
                kept.append(0)
                continue
            kept.append(n)
            out.append((req_id, c))
            if c.finish_reason is None:
                keep.append(i)
        self.target.rollback(kept)
        if len(keep) < len(self.rows):
            self.target.remove(keep)
            self.rows = [self.rows[i] for i in keep]
            if self.draft is not None:
                self.draft.keep([req_id for req_id, _ in self.rows])
        return out

    def run(self):
        """Rounds until every row has finished or failed; yields each round's ``step``."""
        while self.rows:
            yield self.step()
