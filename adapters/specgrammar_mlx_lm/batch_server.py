"""Batched grammar-aware speculative decoding inside ``mlx_lm.server``'s batching path.

The patch lets a plugin name the ``GenerationBatch`` class the server's ``BatchGenerator`` decodes with (hook
``generation_batch_class``); the specgrammar plugin answers ``SpecGenerationBatch`` (``--specgrammar-batch-drafts
on``, the default).  It is mlx-lm's ``GenerationBatch`` with one change: ``next()``.

- A constrained row (its only processor is our ``GrammarLogitsProcessor``, carrying the request's ``RowPlan``) is
  a *speculative row*: its first token is sampled as mlx-lm samples it (the prompt's last token is fed by
  ``GenerationBatch.__init__``, the grammar processor masks the row), then the row becomes a core
  ``SpeculativeLoop`` on an ``api.RowRunner`` whose history holds that token.  Each ``next()`` drafts for every
  speculative row (its own drafter chain, grammar, budget), feeds [pending, *drafts] of every row in ONE forward
  of the target (rows padded on the right), and each row's loop verifies its own logits rows (``_judge``: the
  serial loop's accept/residual law); each row's cache is rolled back alone (``batch.rollback_rows``).  A row
  answers one response per committed token, in order.
- Every other row (no constraint, other processors, xtc) decodes exactly as ``GenerationBatch._step`` does, in the
  same forward (its feed is its one token); a batch with no speculative row is mlx-lm's own ``next()``, and so is a
  model whose cache layers are not all ``BatchKVCache`` (a rotating window, SSM layers: no per-row rollback).
- A fault in a speculative row's drafting or verdict is that request's error (``_RowProcessors.error``: the server
  answers it and removes the row); the others go on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from specgrammar_plugins.api import RowRunner, SpecOptions, make_loop

from .batch import forward_rows, rollback_rows

log = logging.getLogger("specgrammar.mlx_lm")


@dataclass
class RowPlan:
    """What a batched row needs to become a speculative row (set by the plugin on its grammar processor)."""

    compiled: object  # CompiledConstraint
    options: SpecOptions  # k resolved
    params: object  # SamplingParams
    max_tokens: int
    seed: int | None = None  # the row's verifier draws (None: fresh entropy; the batching path takes no seed)


class _Row:
    __slots__ = ("plan", "procs", "loop", "fresh", "pending", "done")

    def __init__(self, plan, procs):
        self.plan = plan  # RowPlan | None (a plain row)
        self.procs = procs  # the server's guarded processors (its ``error`` answers the request), or None
        self.loop = None
        self.fresh = plan is not None  # its first token, sampled by mlx-lm, is not answered yet
        self.pending = None
        self.done = False


def _row_plan(processors):
    """(RowPlan, the guarded processors object) when the row's only processor is our grammar processor."""
    for p in processors or ():
        inner = getattr(p, "processors", None)
        items = inner if inner is not None else [p]
        if len(items) == 1 and getattr(items[0], "batch_row", None) is not None and len(processors) == 1:
            return items[0].batch_row, (p if inner is not None else None)
    return None, None


def _rollable(cache) -> bool:
    """Per-row rollback (``rollback_rows``) is for ``BatchKVCache`` layers (mlx-lm 0.32.2): a rotating window
    (``BatchRotatingKVCache``) or an SSM layer (``ArraysCache``) keeps its rows as mlx-lm decodes them."""
    from mlx_lm.models.cache import BatchKVCache

    return all(type(c) is BatchKVCache for c in cache)


_CLASS = None


def generation_batch_class():
    """``SpecGenerationBatch``, built once over the ``mlx_lm.generate.GenerationBatch`` of this process."""
    global _CLASS
    if _CLASS is None:
        from mlx_lm.generate import GenerationBatch

        _CLASS = type("SpecGenerationBatch", (_SpecMixin, GenerationBatch), {"__doc__": __doc__})
    return _CLASS


class _SpecMixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # feeds the prompts' last tokens and samples each row's first token
        self._rows = [_Row(*_row_plan(p)) for p in (self.logits_processors or [[]] * len(self.uids))]

    # ------------------------------------------------------------------ keep the rows in step with the batch
    def extend(self, batch):
        super().extend(batch)
        self._rows.extend(getattr(batch, "_rows", None) or [_Row(None, None) for _ in batch.uids])

    def filter(self, keep):
        super().filter(keep)
        self._rows = [self._rows[i] for i in keep]

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
        mx.eval(self._next_tokens, self._next_logprobs)
        cur = self._next_tokens.tolist()
        out: list = []  # (row, token, logprobs, finish)
        feeds, blocks = [], []
        for i, r in enumerate(self._rows):
            block = None
            if r.plan is not None and not r.done:
                if r.fresh:
                    r.fresh = False
                    self._start(i, r, cur[i], out)
                if r.loop is not None and not r.done:
                    try:
                        block = r.loop._draft()
                    except Exception as e:
                        self._fault(i, r, e, out)
            blocks.append(block)
            if r.plan is None:
                feeds.append([cur[i]])
            elif block is not None:
                feeds.append([r.pending, *block.tokens])
            else:
                feeds.append([0])  # a row that finished or failed this round: removed below
        kept = [1 if r.plan is None else 0 for r in self._rows]
        t_fwd = time.perf_counter_ns()
        logits = forward_rows(self.model, self.prompt_cache, feeds)
        width = max(len(f) for f in feeds)
        plain = [i for i, r in enumerate(self._rows) if r.plan is None]
        if plain:
            self._plain(plain, cur, logits, out)
        for i, (r, block) in enumerate(zip(self._rows, blocks)):
            if block is None:
                continue
            runner = r.loop.target
            runner.fed(feeds[i])
            before = runner.dropped
            try:
                c = r.loop._judge(block, logits[i, : len(feeds[i])], t_fwd)
                r.loop._settled(c)
            except Exception as e:
                self._fault(i, r, e, out)
                continue
            kept[i] = len(feeds[i]) - (runner.dropped - before)
            self.tokens[i].extend(feeds[i][: kept[i]])
            rows = logits[i]
            for j, t in enumerate(c.tokens):
                last = j == len(c.tokens) - 1
                if self._answer(i, r, t, rows[j] - mx.logsumexp(rows[j], keepdims=True),
                                c.finish_reason if last else None, out):
                    break
            r.pending = c.tokens[-1] if c.tokens else r.pending
        rollback_rows(self.prompt_cache, width, kept)
        self._next_tokens = mx.array([r.pending if r.plan is not None and r.pending is not None else t
                                      for r, t in zip(self._rows, self._next_tokens.tolist())], dtype=mx.uint32)
        return self._responses(out)

    def _start(self, i, r, first, out):
        """The row's first token (sampled by mlx-lm under the grammar processor) is answered, and its loop starts
        with that token in its history; the cache holds the whole prompt."""
        p = r.plan
        if r.procs is not None and getattr(r.procs, "error", None) is not None:
            r.done = True  # its processor failed on the first token: the server answers the error
            out.append((i, first, self._next_logprobs[i], None))
            return
        try:
            prompt = list(self.tokens[i])  # the cache holds the whole prompt
            loop = make_loop(RowRunner(prompt, self.model_width, "mlx"), prompt, p.options, constraint=p.compiled,
                             params=p.params, rng=np.random.default_rng(p.seed), max_tokens=self.max_tokens[i])
            if loop.matcher is not None and not loop.matcher.accept(first):
                raise RuntimeError(f"the first token {first} is outside the grammar")
            loop.emitted.append(first)
            loop.stats.emitted = 1
        except Exception as e:
            self._fault(i, r, e, out)
            return
        r.loop, r.pending = loop, first
        finish = None
        if first in loop.stop_token_ids or (loop.matcher is not None and loop.matcher.is_terminated()):
            finish = "stop"
        self._answer(i, r, first, self._next_logprobs[i], finish, out)

    @property
    def model_width(self) -> int:
        from .runner import output_width

        w = getattr(self, "_width_cache", None)
        if w is None:
            w = self._width_cache = output_width(self.model)
        return w

    def _answer(self, i, r, token, logprobs, finish, out) -> bool:
        """Answer one committed token of row ``i`` (the host's max_tokens and stop sequences checked); True when
        the row is done."""
        self._num_tokens[i] += 1
        if self._num_tokens[i] >= self.max_tokens[i]:
            finish = "length"
        if self._matchers[i].advance(token):
            finish = "stop"
        elif finish == "stop" and r.loop is not None and token not in r.loop.stop_token_ids:
            # the grammar ended without a stop token: the host's "stop" drops the last token's text, so that token
            # is answered first and a stop token after it
            out.append((i, token, logprobs, None))
            token, finish = min(r.loop.stop_token_ids), "stop"
        out.append((i, token, logprobs, finish))
        if finish is not None:
            r.done = True
            if r.loop is not None:
                st = r.loop.stats
                log.info("specgrammar batch: %d tokens, %d target passes (%.2f tokens/pass), acceptance %.2f",
                         st.emitted, st.target_passes + 1, st.emitted / (st.target_passes + 1), st.acceptance)
        return r.done

    def _fault(self, i, r, e, out):
        log.error("specgrammar: a batched request failed (%s: %s); the others go on", type(e).__name__, e)
        r.done = True
        if r.procs is not None and getattr(r.procs, "error", None) is None:
            r.procs.error = e  # the server answers the request with it and removes the row
            out.append((i, 0, None, None))
        else:
            out.append((i, 0, None, "stop"))

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
