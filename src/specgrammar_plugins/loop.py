"""The speculative loop, for hosts that let us own decoding.

    draft up to k (masks computed once, on the request's matcher) -> one target pass over [pending, d1..dk]
    -> verify with the same masks -> commit the accepted drafts + one residual/bonus token
    -> roll the matcher back to the committed prefix, trim the target cache (the draft cache follows by prefix).

Invariants after every round: ``target.tokens == prompt + emitted[:-1]`` (the last committed token is pending,
fed at the start of the next pass) and the matcher has accepted exactly the emitted tokens.  ``finalize()`` feeds
the pending token so that the cache holds prompt + emitted.  With ``drafter=None`` this is plain constrained
decoding: one target pass per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from . import laws
from .block import FORCED_SOURCES, DraftBlock, Drafter, ModelRunner, fill
from .constraint import CompiledConstraint, Matcher
from .distributions import SamplingParams, log_law, sample_u
from .drafters import observe
from .errors import ConstraintError
from .laws import LawBackend
from .prefix import sync_runner


@dataclass
class Stats:
    """Per-request counters. Positions are 0-based within a draft block."""

    prompt_tokens: int = 0
    emitted: int = 0
    rounds: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    mask_us: float = 0.0
    mask_fills: int = 0  # grammar masks filled: one per position a round visits (mask_rows - mask_placeholders)
    mask_rows: int = 0  # positions the rounds visited (their drafts and the bonus position)
    mask_placeholders: int = 0  # of those, rows past the grammar's end: no fill needed
    # host work per phase, ns: mask (fills, in mask_us), draft_forward / draft_law (the drafter's model and its
    # laws), target_law, verify, copy, and "round": the whole round less the target's forward pass
    host_ns: dict = field(default_factory=dict)
    target_s: float = 0.0
    wall_s: float = 0.0
    finish_reason: str | None = None
    cost: dict = field(default_factory=dict)  # cost-aware runs: the lambda the controller chose
    # budget feasibility (``budget.Budget.report``): mode, budget, shortest completion, whether it shaped the output
    budget: dict = field(default_factory=dict)

    @property
    def forced_tokens(self) -> int:
        return sum(self.accepted_by_source.get(s, 0) for s in FORCED_SOURCES)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / self.target_passes if self.target_passes else 0.0

    @property
    def passes_per_token(self) -> float:
        return self.target_passes / self.emitted if self.emitted else 0.0

    @property
    def mask_us_per_token(self) -> float:
        return self.mask_us / self.emitted if self.emitted else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d.update(forced_tokens=self.forced_tokens, acceptance=self.acceptance, tokens_per_pass=self.tokens_per_pass,
                 passes_per_token=self.passes_per_token, mask_us_per_token=self.mask_us_per_token)
        return d

    def _count(self, block: DraftBlock, accepted: int) -> None:
        for i, src in enumerate(block.sources):
            while len(self.drafted_by_pos) <= i:
                self.drafted_by_pos.append(0)
                self.accepted_by_pos.append(0)
            self.drafted_by_pos[i] += 1
            self.drafted_by_source[src] = self.drafted_by_source.get(src, 0) + 1
            if i < accepted:
                self.accepted_by_pos[i] += 1
                self.accepted_by_source[src] = self.accepted_by_source.get(src, 0) + 1
        self.drafted += len(block.tokens)
        self.accepted += accepted


@dataclass(frozen=True)
class Commit:
    """Tokens committed by one round (accepted drafts + the residual/bonus token)."""

    tokens: tuple[int, ...]
    finish_reason: str | None = None  # "stop" (EOS / grammar complete) | "length" | None while running


class SpeculativeLoop:
    """One request.  Iterate ``run()`` for commits; ``stats`` and ``emitted`` hold the outcome."""

    def __init__(self, target: ModelRunner, prompt: Sequence[int], *, constraint: CompiledConstraint | None = None,
                 matcher: Matcher | None = None, drafter: Drafter | None = None, k: int = 4,
                 params: SamplingParams = SamplingParams(), max_tokens: int = 256, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, rng: np.random.Generator | None = None,
                 tilt_fn: Callable[[Sequence[int], Matcher | None], np.ndarray | None] | None = None,
                 max_k: int = 64, free_forced: int = 16, law: str | LawBackend | None = None, fit=None):
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if k < 0 or k > max_k:
            raise ValueError(f"k (draft tokens per round) must be in [0, {max_k}], got {k}")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.target = target
        self.prompt = list(prompt)
        self.constraint = constraint
        self.matcher = matcher if matcher is not None else (constraint.matcher() if constraint is not None else None)
        self.drafter = drafter
        self.k = k if drafter is not None else 0
        # grammar-forced drafts do not count against k: up to this many more ride along in a round
        self.free_forced = max(0, int(free_forced))
        self.params = params
        self.max_tokens = max_tokens
        self.rng = rng if rng is not None else np.random.default_rng(seed)
        if stop_token_ids is None:
            stop_token_ids = constraint.tokenizer.stop_token_ids if constraint is not None else ()
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tilt_fn = tilt_fn
        self.fit = fit  # budget.Budget: the budget-feasibility cut of each row (and the check of what commits)
        # where the law and the verifier run: the fast backend for the target's tensors unless named
        self.law = laws.for_runner(target) if law is None else (laws.get(law) if isinstance(law, str) else law)
        self.width = target.vocab_size
        if constraint is not None and constraint.tokenizer.vocab_size < self.width:
            raise ConstraintError(
                f"the constraint was compiled for {constraint.tokenizer.vocab_size} tokens but the model outputs "
                f"{self.width}: compile with TokenizerInfo.with_vocab_size({self.width})")
        self.emitted: list[int] = []
        self.on_finish: Callable[["SpeculativeLoop"], None] | None = None  # e.g. recipes.served.ServedLog.record
        self.stats = Stats(prompt_tokens=len(self.prompt))
        self.finish_reason: str | None = None

    # -------------------------------------------------------------------------------------------- helpers
    def _prefill(self) -> None:
        """Bring the target cache to prompt[:-1], reusing any common prefix it already holds."""
        sync_runner(self.target, self.prompt[:-1])

    def _round(self) -> Commit:
        block = self._draft()
        pending = self.prompt[-1] if not self.emitted else self.emitted[-1]
        t_fwd = time.perf_counter_ns()
        logits = self.target.forward([pending, *block.tokens])
        return self._judge(block, logits, t_fwd)

    def _draft(self) -> DraftBlock:
        """A round's first half: the drafts of this round (masks filled once), finished for verification.  A host
        that verifies many requests in one batched target pass (``batch.BatchLoop``) calls it per request, then
        feeds [pending, *block.tokens] of every request at once and hands each its rows (``_judge``)."""
        block = self._open()
        if block.budget > 0:
            fill(block, self.drafter)
        block.finish()
        return block

    def _open(self) -> DraftBlock:
        """The round's empty draft block (``_draft`` fills and finishes it; ``batch.draft_rows`` fills many rows'
        blocks in step, each waiting where its draft model needs the batched draft pass)."""
        remaining = self.max_tokens - len(self.emitted)
        budget = min(self.k, remaining - 1)
        free = max(0, min(self.free_forced, remaining - 1 - budget))
        return DraftBlock([*self.prompt, *self.emitted], self.matcher, self.width, max(budget, 0),
                          self.stop_token_ids, self.tilt_fn, prompt_len=len(self.prompt), free=free, law=self.law,
                          fit=self.fit)

    def _judge(self, block: DraftBlock, logits, t_fwd: int) -> Commit:
        """A round's second half: the target's logits of [pending, *block.tokens] (started at ``t_fwd``) -> verify
        -> commit the accepted drafts + the residual/bonus token -> roll the matcher and ``target.trim`` back to the
        committed prefix."""
        t1 = time.perf_counter_ns()
        self.stats.target_s += (t1 - t_fwd) / 1e9
        self.stats.target_passes += 1
        n = len(block.tokens)
        u = self.rng.random(n) if n else np.zeros(0)  # the uniforms every law backend verifies with
        verdict = self.law.verify(logits, block, self.params, u, self.rng.random())
        a, token = verdict.accepted, verdict.token
        drafts = block.tokens
        # the round ends on an accepted stop token (or a complete grammar): then the bonus token is not used
        bonus = not (a and drafts[a - 1] in self.stop_token_ids) and not (
            a == n and self.matcher is not None and self.matcher.is_terminated())
        if self.fit is not None and self.fit.settles:
            a2, token = self._settle(block, logits, a, token, bonus)
            bonus = bonus or a2 < a
            a = a2
        self.stats.rounds += 1
        self.stats._count(block, a)
        self.stats.mask_us += block.mask_ns / 1e3
        self.stats.mask_fills += block.mask_fills
        self.stats.mask_rows += len(block.masks) if block.masks is not None else 0
        self.stats.mask_placeholders += block.placeholders
        for phase, ns in block.timing.items():
            self.stats.host_ns[phase] = self.stats.host_ns.get(phase, 0) + ns
        # roll back the matcher to the committed prefix and the target cache to prompt + committed[:-1]
        if self.matcher is not None:
            self.matcher.rollback(min(block.matched, n) - min(a, block.matched))
        if n - a:
            self.target.trim(n - a)
        new = list(drafts[:a])
        if bonus:
            new.append(token)
            if self.matcher is not None:
                t0 = time.perf_counter_ns()
                if not self.matcher.accept(token):  # the law only puts mass on allowed tokens
                    raise RuntimeError(f"internal error: verified token {token} rejected by the matcher")
                self.stats.mask_us += (time.perf_counter_ns() - t0) / 1e3
        else:
            # the block ended with a stop token (or a complete grammar) that was accepted: the bonus is not used;
            # the target pass fed it, so drop it from the cache (it was the pending token's successor)
            pass
        if self.fit is not None and not self.fit.settles:
            self.fit.shaped += sum(block.fit_cut[: len(new)])
        self.emitted.extend(new)
        finish = None
        if new and new[-1] in self.stop_token_ids:
            finish = "stop"
        elif self.matcher is not None and self.matcher.is_terminated():
            finish = "stop"
        elif len(self.emitted) >= self.max_tokens:
            finish = "length"
        # the round's time less the target's forward pass (the draft model's passes are in host_ns["draft_forward"])
        self.stats.host_ns["round"] = self.stats.host_ns.get("round", 0) + (time.perf_counter_ns() - t1) + (
            t_fwd - block.t_start)
        return Commit(tuple(new), finish)

    def _settle(self, block: DraftBlock, logits, a: int, token: int, bonus: bool) -> tuple[int, int]:
        """A budget checked at commit (``budget.CertifiedBudget``): the committed tokens are checked in order; at
        the first that does not fit, that position is drawn again from the target's own row without it (in the
        law's order of preference: ``Budget.draw``), and the round ends there.  Returns (accepted, token)."""
        drafts = block.tokens
        for i in range(a + (1 if bonus else 0)):
            t = drafts[i] if i < a else token
            h = [*self.emitted, *drafts[:i]]
            if self.fit.feasible(h, t):
                continue
            z = _host_row(logits[i])
            tilt = block.tilts[i] if block.tilts else None

            def sample(row, z=z, tilt=tilt):
                return sample_u(log_law(z, row, self.params, tilt), self.rng.random())

            t2 = self.fit.draw(h, block.masks[i], sample, first=t)
            self.fit.shaped += 1
            return i, t2
        return a, token

    # -------------------------------------------------------------------------------------------- API
    def run(self) -> Iterator[Commit]:
        t0 = time.perf_counter()
        self._prefill()
        try:
            while True:
                c = self._round()
                self._settled(c)
                yield c
                if c.finish_reason is not None:
                    return
        finally:
            self.stats.wall_s = time.perf_counter() - t0
            self._report()

    def _settled(self, c: Commit) -> None:
        """After a round's commit, before it is yielded: the counters, and at the end the reports and the learning
        drafters (the online suffix index, layout, recipe miss logs) see the finished request, before its last
        commit is yielded: a host stops iterating once it has the end (llama-cpp-python breaks on the
        end-of-generation token), so nothing after that yield runs."""
        self.stats.emitted = len(self.emitted)
        if c.finish_reason is not None:
            self.finish_reason = self.stats.finish_reason = c.finish_reason
            self._report()  # before the last commit is yielded: a host reads the stats with it
            observe(self.drafter, [*self.prompt, *self.emitted], len(self.prompt))
            if self.on_finish is not None:
                self.on_finish(self)

    def _report(self) -> None:
        if hasattr(self.tilt_fn, "report"):
            self.stats.cost = self.tilt_fn.report(self.emitted)
        if self.fit is not None:
            self.stats.budget = self.fit.report()

    def generate(self) -> list[int]:
        for _ in self.run():
            pass
        return self.emitted

    def finalize(self) -> None:
        """Feed the pending (last emitted) token so the target cache holds exactly prompt + emitted."""
        if self.emitted and len(self.target.tokens) == len(self.prompt) + len(self.emitted) - 1:
            self.target.forward([self.emitted[-1]], logits_for=0)


def _host_row(x) -> np.ndarray:
    """A logits row as float64 numpy (mlx / torch tensors copied to the host: only for a budget re-draw)."""
    try:
        return np.asarray(x, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        return np.asarray(x.tolist(), dtype=np.float64).reshape(-1)


def generate(target: ModelRunner, prompt: Sequence[int], **kw) -> tuple[list[int], Stats]:
    """Run one request to the end; returns (emitted tokens, stats)."""
    loop = SpeculativeLoop(target, prompt, **kw)
    out = loop.generate()
    return out, loop.stats
