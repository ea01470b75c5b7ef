"""Batched grammar-aware speculative decoding on mlx-lm: many requests, one batched target pass per round.

    from specgrammar_mlx_lm.batch import BatchRequest, batch_generate
    outs = batch_generate(model, tokenizer, [BatchRequest(prompt_ids, constraint=spec, temperature=0.0), ...], k=4)
    # outs[i]: (tokens, stats) of request i, or (tokens so far, the exception that failed it)

Each request is a core ``SpeculativeLoop`` (``api.make_loop``: its own grammar, budget, drafter chain, sampling law
and random stream) on an ``api.RowRunner``; ``api.BatchLoop`` drafts for every row, feeds [pending, *drafts] of all
rows in one forward of the target (``MLXBatchTarget``: the rows padded on the right to one length, over mlx-lm's
``BatchKVCache``), lets each row's loop verify its own logits rows (the same accept/residual law, budget and
rollback as the serial loop), and then rolls each row's cache back to what the row kept.

Per-row rollback (mlx-lm 0.32.2's ``BatchKVCache.trim`` is one length for the whole batch): the batch caches are
``MaskedBatchKVCache`` (a ``BatchKVCache`` whose attention mask is kept per row and position), so a row drops its
last positions by hiding them from later queries and lowering its RoPE offset by as many; no keys move, and the
tail that no row attends any more is cut (``drop_masked``).  On a plain ``BatchKVCache`` (``masked=False``)
``drop_rows`` trims by the smallest drop and shifts each row that drops more right into its left padding
(``prepare(right_padding=...)`` + ``finalize()``): a gather through the whole cache per layer, which on the tiny
pair cost about what a draft pass does.  Rows that finish or fail leave the batch (``filter``).

Drafting is per row (each row's own chain: forced tokens, recipes, then the draft model, or without one the
model-free layout, prompt copy, suffix).  With a draft model the rows' draft models are one batched pass per draft
position (``api.draft_rows`` over ``MLXDraftBatch``: the draft model over its own ``BatchKVCache``, each row's
``DraftRow`` rolled back alone like the target's rows), so only the grammar work stays per row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specgrammar_plugins.api import (BatchLoop, DraftRow, SpecOptions, compile_for, make_loop, sampling_params,
                                     stop_ids, tokenizer_info)

from .runner import MLXRunner, check_trimmable, output_width


def forward_rows(model, cache: list, feeds: list[list[int]]):
    """One batched forward of ``feeds`` (row i: its tokens, padded on the right to the longest row) over the batch
    cache; float32 logits [B, width, V], evaluated."""
    import mlx.core as mx

    width = max(len(f) for f in feeds)
    x = mx.array([list(f) + [0] * (width - len(f)) for f in feeds], dtype=mx.uint32)
    out = model(x, cache=cache).astype(mx.float32)
    mx.eval(out)
    return out


def host_rows(out):
    """The evaluated logits ``out`` as the rows' law reads them: on the CPU device one zero-copy numpy view for the
    whole batch (the mlx law reads CPU logits through numpy anyway, one ``np.asarray`` per row slice before), else
    ``out`` itself."""
    import mlx.core as mx

    return np.asarray(out) if mx.default_device() == mx.cpu else out


def rollback_rows(cache: list, width: int, kept: list[int]) -> None:
    """After a pass that fed ``width`` positions to every row, row i keeps the first ``kept[i]`` of them."""
    drop_rows(cache, [width - k for k in kept])


def drop_rows(cache: list, drops: list[int]) -> None:
    """Row i drops its last ``drops[i]`` positions: trim the smallest drop from every row, then shift each row that
    drops more right by the rest, into its left padding (``BatchKVCache.prepare(right_padding=...)`` + ``finalize``:
    its offset falls by it, the mask hides it)."""
    import mlx.core as mx

    if all(isinstance(c, _MaskedRows) for c in cache):
        drop_masked(cache, drops)
        return
    low = min(drops)
    extra = [d - low for d in drops]
    for c in cache:
        if low:
            c.trim(low)
        if any(extra):
            c.prepare(right_padding=extra)
            c.finalize()
    mx.eval([c.state for c in cache])


def _masked_cache_class():
    """``MaskedBatchKVCache``, built once over this process's ``mlx_lm`` ``BatchKVCache``."""
    global _MASKED
    if _MASKED is None:
        from mlx_lm.models.cache import BatchKVCache

        _MASKED = type("MaskedBatchKVCache", (_MaskedRows, BatchKVCache), {"__doc__": _MaskedRows.__doc__})
    return _MASKED


_MASKED = None


class _MaskedRows:
    """A ``BatchKVCache`` whose rows drop positions without moving keys (``drop``): a dropped position stays where
    it is, hidden from every later query by the mask (``make_mask``: per row, the positions it still attends,
    ``live``), and the row's RoPE offset falls by what it dropped, so its next tokens get the positions they would
    get after ``drop_rows``' shift (the same keys, the same attended set, in other slots).  Positions dead in every
    row at the end are cut (``_idx`` falls).  For the draft model's rows (``MLXDraftBatch``): each draft pass pads
    the rows that are not waiting, and ``drop_rows`` shifted every row that dropped more than the least through the
    whole cache (a gather per layer per pass, about a target pass on the tiny pair); here a drop is host work only.

    ``live``: numpy bool [B, _idx].  Made by ``adopt`` from a ``BatchKVCache`` (left padding: not live)."""

    live = None

    def __init__(self, left_padding):
        super().__init__(left_padding)
        self.live = np.zeros((len(left_padding), 0), dtype=bool)

    @classmethod
    def adopt(cls, cache):
        """``cache`` (a ``BatchKVCache``) as a masked cache, in place: its left padding is what its rows do not
        attend."""
        cache.__class__ = _masked_cache_class()
        pad = np.asarray(cache.left_padding.tolist(), dtype=np.int64)
        cache.live = np.arange(cache._idx)[None, :] >= pad[:, None]
        return cache

    def update_and_fetch(self, keys, values):
        self.live = np.concatenate([self.live, np.ones((keys.shape[0], keys.shape[2]), dtype=bool)], axis=1)
        return super().update_and_fetch(keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        import mlx.core as mx

        if window_size is not None:
            raise ValueError("a masked batch cache has no sliding window")
        B, L = self.live.shape
        m = np.empty((B, 1, N, L + N), dtype=bool)
        m[:, 0, :, :L] = self.live[:, None, :]
        m[:, 0, :, L:] = np.tri(N, dtype=bool)
        return mx.array(m)

    def drop(self, drops: Sequence[int], offset=None) -> None:
        """Row i stops attending its last ``drops[i]`` live positions; ``offset``: the rows' new RoPE offsets when
        the caller computed them once for every layer (else ``offset - drops``)."""
        import mlx.core as mx

        live = self.live
        for i, d in enumerate(drops):
            if d:
                pos = np.flatnonzero(live[i])
                if d > len(pos):
                    raise ValueError(f"row {i} cannot drop {d} of its {len(pos)} positions")
                live[i, pos[-d:]] = False
        self.offset = offset if offset is not None else self.offset - mx.array(list(drops))
        alive = np.flatnonzero(live.any(axis=0))
        end = int(alive[-1]) + 1 if len(alive) else 0
        if end < self._idx:  # dead in every row: cut (the offsets already fell)
            self._idx = end
            self.live = live[:, :end]

    def trim(self, n):
        n = super().trim(n)
        self.live = self.live[:, : self._idx]
        return n

    def filter(self, batch_indices):
        batch_indices = list(batch_indices)
        pad = self.left_padding.tolist()
        low = min(pad[i] for i in batch_indices) if batch_indices else 0
        super().filter(batch_indices)
        self.live = self.live[batch_indices][:, low:]

    def extend(self, other):
        width = max(self._idx, other._idx)
        theirs = other.live if getattr(other, "live", None) is not None else (
            np.arange(other._idx)[None, :] >= np.asarray(other.left_padding.tolist())[:, None])

        def left(live, idx):
            return np.concatenate([np.zeros((live.shape[0], width - idx), dtype=bool), live], axis=1)

        live = np.concatenate([left(self.live, self._idx), left(theirs, other._idx)], axis=0)
        super().extend(other)
        self.live = live

    def extract(self, idx):
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        pos = mx.array(np.flatnonzero(self.live[idx]))
        cache = KVCache()
        cache.keys = mx.contiguous(mx.take(self.keys[idx: idx + 1, :, : self._idx], pos, axis=2))
        cache.values = mx.contiguous(mx.take(self.values[idx: idx + 1, :, : self._idx], pos, axis=2))
        cache.offset = cache.keys.shape[2]
        return cache


def masked(cache: list) -> list:
    """The batch cache's ``BatchKVCache`` layers as ``MaskedBatchKVCache`` (in place; those already masked kept);
    a cache with other layers (a rotating window, SSM state) as it is."""
    from mlx_lm.models.cache import BatchKVCache

    cls = _masked_cache_class()
    if not all(isinstance(c, cls) or type(c) is BatchKVCache for c in cache):
        return cache
    return [c if isinstance(c, cls) else cls.adopt(c) for c in cache]


def drop_masked(cache: list, drops: list[int]) -> None:
    """``drop_rows`` for ``MaskedBatchKVCache`` layers: row i drops its last ``drops[i]`` positions by the mask
    (no keys move); the new offsets are one array for every layer."""
    import mlx.core as mx

    offset = cache[0].offset - mx.array(drops)
    for c in cache:
        c.drop(drops, offset)


class MLXBatchTarget:
    """The target model over one ``BatchKVCache`` per layer, as ``BatchLoop`` drives it (``forward``, ``rollback``,
    ``remove``); rows join with ``add`` (prefilled alone, then merged in)."""

    tensors = "mlx"

    def __init__(self, model, prefill_step_size: int = 2048, masked: bool = True):
        self.model = model
        self.masked = masked  # rows drop by the mask (``MaskedBatchKVCache``), not by shifting keys
        self.vocab_size = output_width(model)
        self.prefill_step_size = prefill_step_size
        self.cache: list | None = None
        self.rows = 0
        self.passes = 0
        self.fed = 0  # positions fed by the batched passes (padding included)
        self.padding = 0  # of those, padding
        self.rollback_s = 0.0  # time in the per-row rollback (drop_rows)
        self.forward_s = 0.0
        self.draft_passes = 0  # batch_generate with a draft model: the batched draft passes
        self._width = 0

    def add(self, prefix: Sequence[int]) -> None:
        """A new row whose cache holds ``prefix`` (the prompt without its last token, which is pending)."""
        from mlx_lm.models.cache import make_prompt_cache

        runner = MLXRunner(self.model, make_prompt_cache(self.model), [],
                           prefill_step_size=self.prefill_step_size)
        if prefix:
            runner.forward(list(prefix), logits_for=0)
        one = [c.merge([c]) for c in runner.cache]  # KVCache.merge -> a BatchKVCache of one row
        self._join(masked(one) if self.masked else one, 1)

    def _join(self, new: list, n: int) -> None:
        """The batch cache ``new`` of ``n`` new rows merged in after the rows held."""
        import mlx.core as mx

        if self.cache is None:
            self.cache = new
        else:
            for a, b in zip(self.cache, new):
                a.extend(b)
        mx.eval([c.state for c in self.cache])
        self.rows += n

    def add_many(self, prefixes: Sequence[Sequence[int]]) -> None:
        """``add`` for several rows at once: their prefixes prefilled together in one batch (padded on the right,
        the padding dropped by the mask), then merged in.  A model whose cache layers are not all ``KVCache``
        (masked rows need ``BatchKVCache`` layers) or ``masked=False``: one ``add`` per row."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        prefixes = [[int(t) for t in p] for p in prefixes]
        layers = make_prompt_cache(self.model)
        if len(prefixes) < 2 or not self.masked or not all(type(c) is KVCache for c in layers):
            for p in prefixes:
                self.add(p)
            return
        cls = _masked_cache_class()
        new = [cls([0] * len(prefixes)) for _ in layers]
        width = max(len(p) for p in prefixes)
        if width:
            x = mx.array([p + [0] * (width - len(p)) for p in prefixes], dtype=mx.uint32)
            for i in range(0, width, self.prefill_step_size):
                self.model(x[:, i: i + self.prefill_step_size], cache=new)
                mx.eval([c.state for c in new])
            drop_masked(new, [width - len(p) for p in prefixes])
        self._join(new, len(prefixes))

    def forward(self, feeds: list[list[int]]):
        t0 = time.perf_counter()
        out = forward_rows(self.model, self.cache, feeds)
        self._width = max(len(f) for f in feeds)
        self.passes += 1
        self.fed += self._width * len(feeds)
        self.padding += sum(self._width - len(f) for f in feeds)
        self.forward_s += time.perf_counter() - t0
        return [out[i, : len(f)] for i, f in enumerate(feeds)]

    def rollback(self, kept: list[int]) -> None:
        """Row i keeps ``kept[i]`` of the positions the last pass fed: the rest (its rejected drafts, its padding)
        is dropped from its cache."""
        t0 = time.perf_counter()
        rollback_rows(self.cache, self._width, kept)
        self.rollback_s += time.perf_counter() - t0

    def remove(self, keep: list[int]) -> None:
        if not keep:
            self.cache, self.rows = None, 0
            return
        for c in self.cache:
            c.filter(keep)
        self.rows = len(keep)


class MLXDraftBatch:
    """The draft model over its own ``MaskedBatchKVCache`` per layer, for the rows that draft with it: the batched
    draft pass of ``api.draft_rows`` (``__call__``).  Rows join with ``add(key, tokens)`` (the row's ``DraftRow``
    back; the rows added since the last pass are prefilled together at the next, ``MLXBatchTarget.add_many``, and
    merged in) and leave with ``keep(keys)``.  A pass first drops, per row, what its drafter trimmed and the padding
    the last pass left it (``drop_rows``: by the mask), then feeds every waiting row's tokens in ONE forward (rows
    padded on the right; a row that is not waiting is all padding), and hands each waiting row its last position's
    logits."""

    def __init__(self, model, prefill_step_size: int = 2048):
        self.rows = MLXBatchTarget(model, prefill_step_size)
        self.keys: list = []  # the cache's rows, then the rows not prefilled yet (``_new``)
        self.pad: list[int] = []  # per row: padding the last pass left in its cache
        self._new: list[list[int]] = []  # the prefixes of the rows added since the last pass
        self.passes = 0

    def add(self, key, tokens: Sequence[int]) -> DraftRow:
        self._new.append([int(t) for t in tokens])
        self.keys.append(key)
        self.pad.append(0)
        return DraftRow(tokens, self.rows.vocab_size, self.rows.tensors)

    def keep(self, keys) -> None:
        keys = set(keys)
        idx = [j for j, k in enumerate(self.keys) if k in keys]
        if len(idx) < len(self.keys):
            held = len(self.keys) - len(self._new)
            if held:
                self.rows.remove([j for j in idx if j < held])
            self._new = [self._new[j - held] for j in idx if j >= held]
            self.keys = [self.keys[j] for j in idx]
            self.pad = [self.pad[j] for j in idx]

    def __call__(self, asks: dict) -> dict:
        if self._new:
            new, self._new = self._new, []
            self.rows.add_many(new)
        drops = [p + (asks[k][0] if k in asks else 0) for k, p in zip(self.keys, self.pad)]
        if any(drops):
            drop_rows(self.rows.cache, drops)
        feeds = [list(asks[k][1]) if k in asks else [] for k in self.keys]
        width = max(len(f) for f in feeds)
        out = host_rows(forward_rows(self.rows.model, self.rows.cache, feeds))
        self.pad = [width - len(f) for f in feeds]
        self.passes += 1
        return {k: out[j, len(f) - 1: len(f)] for j, (k, f) in enumerate(zip(self.keys, feeds)) if k in asks}


@dataclass
class BatchRequest:
    """One request of a batch: prompt token ids, its constraint (``ConstraintSpec`` or ``CompiledConstraint``;
    None: unconstrained) and options."""

    prompt: Sequence[int]
    constraint: object = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    options: SpecOptions = field(default_factory=SpecOptions)  # k, drafters, recipe, budget_mask ...


def make_row(target: MLXBatchTarget, tokenizer, req: BatchRequest, *, k: int = 4, engine: str | None = None,
             draft: MLXDraftBatch | None = None, key=None):
    """The request's ``SpeculativeLoop`` on a ``RowRunner`` (its cache row is added by the caller); with ``draft``,
    its draft model drafts in the batched draft pass (the row added to ``draft`` under ``key``)."""
    width = target.vocab_size
    compiled = compile_for(req.constraint, tokenizer, width, engine) if req.constraint is not None else None
    tokinfo = compiled.tokenizer if compiled is not None else tokenizer_info(tokenizer, width)
    options = req.options if req.options.k is not None else SpecOptions(**{**req.options.__dict__, "k": k})
    prompt = [int(t) for t in req.prompt]
    row = draft.add(key, prompt[:-1]) if draft is not None and options.model_drafts else None
    return make_loop(BatchLoop.runner(prompt, width, target.tensors), prompt, options, constraint=compiled,
                     tokenizer=tokinfo, params=sampling_params(req.temperature, req.top_p, req.top_k, req.min_p),
                     rng=np.random.default_rng(req.seed), draft_runner=row, max_tokens=req.max_tokens,
                     stop_token_ids=stop_ids(tokenizer, tokinfo))


def batch_generate(model, tokenizer, requests: Sequence[BatchRequest], *, k: int = 4, engine: str | None = None,
                   draft_model=None, target: MLXBatchTarget | None = None):
    """Run every request to its end in one batch; returns [(tokens, stats or the exception that failed it)] in
    request order, and the ``MLXBatchTarget`` (its pass and padding counters) as the second value."""
    from .generate import _wrap_tokenizer

    tokenizer = _wrap_tokenizer(tokenizer)
    target = target if target is not None else MLXBatchTarget(model)
    if target.cache is not None:
        raise ValueError("the batch target must start empty")
    draft = MLXDraftBatch(draft_model) if draft_model is not None else None
    batch = BatchLoop(target, draft)
    results: dict[int, object] = {}
    loops = {}
    for i, req in enumerate(requests):
        try:
            loop = make_row(target, tokenizer, req, k=k, engine=engine, draft=draft, key=i)
        except Exception as e:  # a request that cannot start is answered with its error alone
            results[i] = e
            if draft is not None:
                draft.keep([j for j in loops])
            continue
        target.add(loop.prompt[:-1])
        batch.add(i, loop)
        loops[i] = loop
    if target.cache is not None:
        check_trimmable(target.cache, "target")
    if draft is not None and draft.keys:  # (its rows are prefilled at the first draft pass)
        from mlx_lm.models.cache import make_prompt_cache

        check_trimmable(make_prompt_cache(draft.rows.model), "draft model")
    for out in batch.run():
        for i, c in out:
            if isinstance(c, BaseException):
                results[i] = c
            elif c.finish_reason is not None:
                results[i] = loops[i].stats
    target.draft_passes = draft.passes if draft is not None else 0
    return [(list(loops[i].emitted) if i in loops else [], results[i]) for i in range(len(requests))], target
