"""Batched grammar-aware speculative decoding inside ``mlx_lm.server``'s batching path.

The patch lets a plugin name the ``GenerationBatch`` class the server's ``BatchGenerator`` decodes with (hook
``generation_batch_class``); the specgrammar plugin answers ``SpecGenerationBatch`` (``--specgrammar-batch-drafts
on``, the default).  It is mlx-lm's ``GenerationBatch`` with one change: ``next()``.

- A constrained row (its only processor is our ``GrammarLogitsProcessor``, carrying the request's ``RowPlan``) is
  a *speculative row*: a core ``SpeculativeLoop`` on an ``api.RowRunner`` with the request's options.  When every
  row of a new prefill is speculative, ``GenerationBatch.__init__``'s first step is skipped (``_step``) and each
  row's loop feeds the prompt's last token with its first drafts, as our serial loop does; in a mixed prefill the
  row's first token is sampled as mlx-lm samples it (the grammar processor masks the row) and its loop starts with
  that token in its history.  Each ``next()`` drafts for every
  speculative row (its own drafter chain, grammar, budget, ``k``: ``api.draft_rows``), feeds [pending, *drafts] of
  every row in ONE forward of the target (rows padded on the right), and each row's loop verifies its own logits
  rows (``_judge``: the serial loop's accept/residual law); each row's cache is rolled back alone
  (``batch.rollback_rows``; the batch's ``BatchKVCache`` layers are adopted as ``batch.MaskedBatchKVCache``: a row
  drops positions by the mask, no keys move).  A row answers one response per committed token, in order.
- With the server's draft model (``generation_batch_class(draft_model)``), a row whose chain holds ``model`` drafts
  with it as the serial loop does (masked by the row's grammar, its own draws), but the rows' draft models are
  ONE batched draft forward per draft position over the rows that need the model there
  (``batch.MLXDraftBatch``: the draft model's own ``BatchKVCache``, each row rolled back alone like the target's).
- Every other row (no constraint, other processors, xtc) decodes exactly as ``GenerationBatch._step`` does, in the
  same forward (its feed is its one token); a batch with no speculative row is mlx-lm's own ``next()``, and so is a
  model whose cache layers are not all ``BatchKVCache`` (a rotating window, SSM layers: no per-row rollback).
- A fault in a speculative row's drafting or verdict is that request's error (``_RowProcessors.error``: the server
  answers it and removes the row); the others go on.
"""

from __future__ import annotations

import logging
import time

from specgrammar_plugins.api import ServedRow, draft_rows

from .batch import MLXDraftBatch, _MaskedRows, forward_rows, host_rows, masked, rollback_rows

log = logging.getLogger("specgrammar.mlx_lm")


def _rollable(cache) -> bool:
    """Per-row rollback (``rollback_rows``) is for ``BatchKVCache`` layers (mlx-lm 0.32.2): a rotating window
    (``BatchRotatingKVCache``) or an SSM layer (``ArraysCache``) keeps its rows as mlx-lm decodes them."""
    from mlx_lm.models.cache import BatchKVCache

    return all(type(c) is BatchKVCache or isinstance(c, _MaskedRows) for c in cache)


def _draft_rollable(model) -> bool:
    """Whether the model's cache layers are plain ``KVCache`` (merged: ``BatchKVCache``, rolled back per row); else
    a draft model's rows draft without it (and a target's rows decode as mlx-lm's own, ``_rollable``)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    ok = getattr(model, "_specgrammar_rollable", None)
    if ok is None:
        ok = all(type(c) is KVCache for c in make_prompt_cache(model))
        try:
            model._specgrammar_rollable = ok
        except AttributeError:
            pass
    return ok


_CLASS = None


def generation_batch_class(draft_model=None):
    """``SpecGenerationBatch``, built once over the ``mlx_lm.generate.GenerationBatch`` of this process; with a draft
    model, a subclass whose rows draft with it (one per call: the server builds its ``BatchGenerator`` once per
    model it loads)."""
    global _CLASS
    if _CLASS is None:
        from mlx_lm.generate import GenerationBatch

        _CLASS = type("SpecGenerationBatch", (_SpecMixin, GenerationBatch), {"__doc__": __doc__})
    if draft_model is None:
        return _CLASS
    return type("SpecGenerationBatch", (_CLASS,), {"draft_model": draft_model})


class _SpecMixin:
    draft_model = None  # the server's draft model: rows whose chain holds "model" draft with it
    _rows = None

    def __init__(self, *args, **kwargs):
        self._own_first = False
        # feeds the prompts' last tokens and samples each row's first token (``_step``), unless every new row is a
        # speculative row: then their loops feed it with their first drafts
        super().__init__(*args, **kwargs)
        self._rows = [ServedRow.of(p, self._own_first) for p in (self.logits_processors or [[]] * len(self.uids))]
        self._drafts = None  # MLXDraftBatch: the rows' draft models (made at the first row that drafts with it)

    def _step(self):
        """mlx-lm's step; at ``__init__`` (the new rows' first step: their prompts' last tokens fed, each row's first
        token sampled) skipped when every new row is a speculative row over a cache that rolls back per row: each
        row's loop then feeds the prompt's last token with its first drafts, as our serial loop does, instead of a
        first token sampled alone without drafts (one more target pass per request)."""
        if self._rows is None and self._all_speculative():
            import mlx.core as mx

            self._own_first = True
            self._next_logprobs = [mx.zeros((self.model_width,)) for _ in self.uids]  # (no token sampled yet)
            return None
        return super()._step()

    def _all_speculative(self) -> bool:
        procs = self.logits_processors or []
        return (len(procs) == len(self.uids) and all(ServedRow.of(p).plan is not None for p in procs)
                and _rollable(self.prompt_cache))

    # ------------------------------------------------------------------ keep the rows in step with the batch
    def extend(self, batch):
        super().extend(batch)
        self._rows.extend(getattr(batch, "_rows", None) or [ServedRow() for _ in batch.uids])

    def filter(self, keep):
        super().filter(keep)
        self._rows = [self._rows[i] for i in keep]
        if self._drafts is not None:
            self._drafts.keep(self._rows)

    # ------------------------------------------------------------------ one round
    def next(self):
        if not self.uids:
            return []
        if not any(r.plan is not None for r in self._rows):
            return super().next()  # mlx-lm's own step
        import mlx.core as mx

        if not _rollable(self.prompt_cache):
            for r in self._rows:  # rows not started yet decode as mlx-lm's own (their first token is pending)
                if r.fresh:
                    r.plan, r.fresh = None, False
            if not any(r.plan is not None for r in self._rows):
                return super().next()
        self.prompt_cache = masked(self.prompt_cache)  # rows drop by the mask (a batch that joined: adopted now)
        mx.eval(self._next_tokens, self._next_logprobs)
        cur = self._next_tokens.tolist()
        out: list = []  # (row, token, logprobs, finish)
        for i, r in enumerate(self._rows):
            if r.plan is not None and not r.done and r.fresh:
                r.fresh = False
                self._start(i, r, cur[i], out)
        live = [i for i, r in enumerate(self._rows) if r.live]
        drafted = dict(zip(live, draft_rows([(self._rows[i], self._rows[i].loop) for i in live], self._drafts)))
        feeds, blocks = [], []
        for i, r in enumerate(self._rows):
            block = drafted.get(i)
            if isinstance(block, BaseException):
                self._fault(i, r, block, out)
                block = None
            blocks.append(block)
            feeds.append(r.feed(cur[i], block))
        kept = [1 if r.plan is None else 0 for r in self._rows]
        t_fwd = time.perf_counter_ns()
        logits = forward_rows(self.model, self.prompt_cache, feeds)
        host = host_rows(logits)  # what each row's verdict reads
        width = max(len(f) for f in feeds)
        plain = [i for i, r in enumerate(self._rows) if r.plan is None]
        if plain:
            self._plain(plain, cur, logits, out)
        # every row's log-probabilities in one op over the pass (lazy; the committed tokens' rows are evaluated
        # together below: mlx-lm's server reads ``logprobs[token].item()`` per response, which was one graph of
        # its own per token)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        answered = len(out)
        for i, (r, block) in enumerate(zip(self._rows, blocks)):
            if block is None:
                continue
            try:
                c, kept[i] = r.judge(block, feeds[i], host[i, : len(feeds[i])], t_fwd)
            except Exception as e:
                self._fault(i, r, e, out)
                continue
            self.tokens[i].extend(feeds[i][: kept[i]])
            for j, t in enumerate(c.tokens):
                last = j == len(c.tokens) - 1
                if self._answer(i, r, t, lp[i, j], c.finish_reason if last else None, out):
                    break
        mx.eval([o[2] for o in out[answered:] if o[2] is not None])
        rollback_rows(self.prompt_cache, width, kept)
        self._next_tokens = mx.array([r.next_token(t) for r, t in zip(self._rows, self._next_tokens.tolist())],
                                     dtype=mx.uint32)
        return self._responses(out)

    def _start(self, i, r, first, out):
        """The row's loop starts (``ServedRow.start``).  ``own_first``: ``first`` is the prompt's last token, pending
        (the cache holds the prompt before it), as in our serial loop.  Else ``first`` is the row's first token
        (sampled by mlx-lm under the grammar processor): it is answered, and the loop starts with it in its history
        (the cache holds the whole prompt)."""
        if not r.own_first and r.procs is not None and getattr(r.procs, "error", None) is not None:
            r.done = True  # its processor failed on the first token: the server answers the error
            out.append((i, first, self._next_logprobs[i], None))
            return
        try:
            finish = r.start(self.tokens[i], first, self.model_width, "mlx", self.max_tokens[i],
                             self._draft_row(r, list(self.tokens[i])))
        except Exception as e:
            self._fault(i, r, e, out)
            return
        if not r.own_first:
            self._answer(i, r, first, self._next_logprobs[i], finish, out)

    def _draft_row(self, r, prompt):
        """The row's ``DraftRow`` in the batched draft cache (its prompt prefilled), when the server has a draft
        model and the row's chain drafts with it; else None."""
        if self.draft_model is None or not r.plan.options.model_drafts or not _draft_rollable(self.draft_model):
            return None
        if self._drafts is None:
            self._drafts = MLXDraftBatch(self.draft_model)
        return self._drafts.add(r, prompt)

    @property
    def model_width(self) -> int:
        from .runner import output_width

        w = getattr(self, "_width_cache", None)
        if w is None:
            w = self._width_cache = output_width(self.model)
        return w

    def _answer(self, i, r, token, logprobs, finish, out) -> bool:
        """Answer one committed token of row ``i`` (``ServedRow.answer``, with mlx-lm's max_tokens and stop
        sequences); True when the row is done."""
        self._num_tokens[i] += 1
        for t, f in r.answer(token, finish, self._num_tokens[i] >= self.max_tokens[i],
                             self._matchers[i].advance(token), log):
            out.append((i, t, logprobs, f))
        return r.done

    def _fault(self, i, r, e, out):
        log.error("specgrammar: a batched request failed (%s: %s); the others go on", type(e).__name__, e)
        out.append((i, 0, None, r.fail(e)))  # (with the request's error: the server answers it, removes the row)

    def _plain(self, plain, cur, logits, out):
        """Rows without drafts: ``GenerationBatch._step`` for them, on their first logits row of this pass."""
        import mlx.core as mx

        for i in plain:
            row = logits[i, 0:1]
            procs = self.logits_processors[i] if self.logits_processors else None
            if procs:
                context = self._token_context[i].update_and_fetch(mx.array([cur[i]], dtype=mx.uint32))
                for proc in procs:
                    row = proc(context, row)
            lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
            s = self.samplers[i] if self.samplers and self.samplers[i] is not None else self.fallback_sampler
            nxt = s(lp)
            self.tokens[i].append(cur[i])
            self._answer(i, self._rows[i], cur[i], self._next_logprobs[i], None, out)
            self._next_logprobs[i] = lp[0]
            self._next_tokens[i] = nxt[0]

    def _responses(self, out):
        import mlx.core as mx

        responses = []
        for i, token, logprobs, finish in out:
            if logprobs is None:
                logprobs = mx.zeros((self.model_width,))
            responses.append(self.Response(
                uid=self.uids[i], token=int(token), logprobs=logprobs, finish_reason=finish,
                prompt_cache=self.extract_cache(i) if finish is not None else None,
                all_tokens=self.tokens[i] if finish is not None else None))
        keep = [i for i, r in enumerate(self._rows) if not r.done]
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses
