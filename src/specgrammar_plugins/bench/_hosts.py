"""One request, one strategy, one host: the runs that ``bench strategies`` and ``bench recipes`` time.

A ``Strategy`` names a drafter chain (``None`` = the host's own constrained decoding, no speculation; ``()`` = our
loop with no drafter).  ``MLXHost`` and ``LlamaHost`` load the bundled tiny pair once and run one request with one
strategy, returning a ``Run`` with the same counters for every strategy:

    tokens     generated tokens, the end-of-generation token included
    passes     target forward passes after the prefill (the prompt's pass counts where it yields the first token)
    drafted / accepted / rounds   the loop's counters (0 for the host's own decoding)
    by_source  accepted draft tokens per drafter (forced, recipe, model)
    mask_us    grammar time: the loop's ``Stats.mask_us`` (masks, fork/accept/rollback), or for mlx-lm's own
               decoding the time spent in the grammar logits processor; None where the host hides it (llama.cpp)
    seconds    wall-clock of the whole request (prefill included), measured here for every strategy alike
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..recipes import shipped_pack
from ..requests import DEFAULT_DRAFTERS


@dataclass(frozen=True)
class Strategy:
    name: str
    drafters: tuple[str, ...] | None  # None: the host's own constrained decoding
    blind: bool = False
    what: str = ""

    @property
    def uses_model(self) -> bool:
        return bool(self.drafters) and "model" in self.drafters

    @property
    def uses_pack(self) -> bool:
        return bool(self.drafters) and "recipe" in self.drafters


BASELINE = Strategy("baseline", None, what="host's own constrained decoding, no speculation")
STRATEGIES = {s.name: s for s in (
    BASELINE,
    Strategy("blind", ("model",), blind=True, what="draft model without the grammar mask"),
    Strategy("aware", ("model",), what="draft model under the grammar mask"),
    Strategy("forced", ("forced",), what="tokens the grammar forces, no model"),
    Strategy("recipe", ("recipe",), what="shipped recipe pack only"),
    Strategy("full", DEFAULT_DRAFTERS, what="forced -> recipe pack -> draft model"),
)}


@dataclass
class Run:
    tokens: list[int]
    text: str
    passes: int
    seconds: float
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    mask_us: float | None = None
    by_source: dict = field(default_factory=dict)
    stop: bool = False
    drafted_by_source: dict = field(default_factory=dict)  # drafts per drafter (model drafts = draft model passes)
    finish_reason: str | None = None  # our loop's ("stop": the grammar ended; "length": cut off at max_tokens)
    budget: dict = field(default_factory=dict)  # Stats.budget: whether the budget mask shaped the output

    @classmethod
    def from_stats(cls, tokens, text, st, seconds, stop_ids) -> "Run":
        return cls(list(tokens), text, st.target_passes, seconds, st.drafted, st.accepted, st.rounds, st.mask_us,
                   dict(st.accepted_by_source), bool(tokens) and tokens[-1] in stop_ids, dict(st.drafted_by_source),
                   st.finish_reason, dict(st.budget))


class MLXHost:
    """mlx-lm: baseline = ``mlx_lm.generate.generate_step`` with our history-keyed grammar processor; every other
    strategy = the adapter's ``stream_generate`` twin with the strategy's drafter chain."""

    name = "mlx"

    def __init__(self, models=None):
        from mlx_lm import load

        from ..models import tiny_path

        t_dir, d_dir = models if models else (tiny_path("target"), tiny_path("draft"))
        self.model, self.tok = load(str(t_dir))
        self.draft, _ = load(str(d_dir))
        self.stops = frozenset(int(t) for t in self.tok.eos_token_ids)
        self._packs: dict = {}

    def encode(self, prompt: str) -> list[int]:
        return list(self.tok.encode(prompt, add_special_tokens=False))

    def pack(self, workload: str):
        p = shipped_pack(workload)
        return None if p is None else str(p)

    def text(self, tokens) -> str:
        return self.tok.decode([t for t in tokens if t not in self.stops])

    def run(self, s: Strategy, workload: str, ids: list[int], spec, *, k: int, max_tokens: int,
            temperature: float, seed: int, options: dict | None = None) -> Run:
        """``options``: request options for our loop (``engine``, ``budget_mask``)."""
        if s.drafters is None:
            return self._host(ids, spec, max_tokens, temperature, seed)
        from specgrammar_mlx_lm.generate import generate_tokens

        options = options or {}
        t0 = time.perf_counter()
        out, st = generate_tokens(self.model, self.tok, ids, max_tokens=max_tokens,
                                  draft_model=self.draft if s.uses_model else None,
                                  num_draft_tokens=k if s.drafters else 0, drafters=s.drafters or None,
                                  constraint=spec, temperature=temperature, seed=seed, blind=s.blind,
                                  recipe=self.pack(workload) if s.uses_pack else None,
                                  engine=options.get("engine"), budget_mask=options.get("budget_mask"))
        dt = time.perf_counter() - t0
        return Run.from_stats(out, self.text(out), st, dt, self.stops)

    def _host(self, ids, spec, max_tokens, temperature, seed) -> Run:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        from specgrammar_mlx_lm.processor import grammar_logits_processor
        from .mlx_host import _Counting

        t0 = time.perf_counter()
        target = _Counting(self.model, "target", {})
        proc = _TimedProcessor(grammar_logits_processor(spec, self.tok, self.model)) if spec is not None else None
        mx.random.seed(seed)
        gen = generate_step(mx.array(ids), target, max_tokens=max_tokens, sampler=make_sampler(temperature),
                            logits_processors=[proc] if proc else None)
        out = []
        for t, _ in gen:
            out.append(int(t))
            if t in self.stops:
                break
        dt = time.perf_counter() - t0
        gen.close()
        # the prefill call is not a decoding pass; generate_step computes one step ahead of what it yields
        passes = target.calls - (1 if len(ids) > 1 else 0) - 1
        mask_us = proc.seconds * 1e6 if proc else 0.0
        return Run(out, self.text(out), passes, dt, mask_us=mask_us, stop=bool(out) and out[-1] in self.stops)


class _TimedProcessor:
    """Times a logits processor's call (mask computation and its lazy application).  The token history is
    evaluated first, outside the timer: it holds the previous step's lazy sample, whose forward pass the processor's
    ``tokens.tolist()`` would otherwise force inside the timed region."""

    def __init__(self, proc):
        self.proc, self.seconds = proc, 0.0

    def __call__(self, tokens, logits):
        import mlx.core as mx

        if hasattr(tokens, "shape"):
            mx.eval(tokens)
        t0 = time.perf_counter()
        out = self.proc(tokens, logits)
        self.seconds += time.perf_counter() - t0
        return out


class LlamaHost:
    """llama-cpp-python: baseline = stock ``Llama`` with ``grammar=LlamaGrammar`` (llama.cpp's own grammar sampler,
    no drafting); every other strategy = ``SpecLlama`` with the strategy's chain (``specgrammar`` request field),
    ``blind_draft=True`` for the blind draft.

    The shipped recipe packs were built on the HF tokenizer of the same tiny target; they bind to the GGUF's
    tokenizer by its token bytes (``TokenizerInfo.vocab_fingerprint``; the stop ids differ)."""

    name = "llama_cpp"

    def __init__(self, threads: int = 1, n_ctx: int = 1024):
        import os

        from llama_cpp import Llama

        from specgrammar_llama_cpp import SpecLlama
        from ..models import tiny_gguf

        target, draft = str(tiny_gguf("target")), str(tiny_gguf("draft"))
        for p in (target, draft):
            if not os.path.exists(p):
                raise SystemExit(f"{p} is absent: build the tiny models first (scripts/build_models.py)")
        kw = dict(n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False, seed=0)
        self.draft = Llama(draft, **kw)
        self.stock = Llama(target, **kw)
        self.ours = SpecLlama(target, draft=self.draft, **kw)
        self.blind = SpecLlama(target, draft=self.draft, blind_draft=True, **kw)
        from .llama_cpp_host import DecodeCounter

        self.counter = DecodeCounter(self.stock)
        self._packs: dict = {}
        self._grammars: dict = {}

    def encode(self, prompt: str) -> str:
        return prompt  # llama-cpp-python takes the text

    def pack(self, workload: str):
        from ..recipes import load_pack

        if workload not in self._packs:
            from specgrammar_llama_cpp.runner import tokenizer_info
            from ..recipes import RecipePack

            p = shipped_pack(workload)
            self._packs[workload] = None if p is None else load_pack(RecipePack.load(p), tokenizer_info(self.ours))
        return self._packs[workload]

    def _grammar(self, workload: str):
        from llama_cpp import LlamaGrammar

        from .llama_cpp_host import gbnf_for

        g = gbnf_for(workload)
        return None if g is None else LlamaGrammar.from_string(g, verbose=False)

    def run(self, s: Strategy, workload: str, prompt: str, spec, *, k: int, max_tokens: int,
            temperature: float, seed: int, options: dict | None = None) -> Run:
        """``options``: request options for our loop (``engine``, ``budget_mask``), sent as ``specgrammar``."""
        if s.drafters is None:
            grammar = self._grammar(workload)
            before = self.counter.calls
            t0 = time.perf_counter()
            out = self.stock.create_completion(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                               grammar=grammar)
            dt = time.perf_counter() - t0
            choice = out["choices"][0]
            stop = choice["finish_reason"] == "stop"
            n = out["usage"]["completion_tokens"] + (1 if stop else 0)  # + the end-of-generation token
            return Run([-1] * n, choice["text"], self.counter.calls - before, dt, stop=stop)
        llm = self.blind if s.blind else self.ours
        llm.recipe = self.pack(workload) if s.uses_pack else None
        t0 = time.perf_counter()
        extra = {key: v for key, v in (options or {}).items() if v is not None}
        out = llm.create_completion(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                    constraint=spec, specgrammar={"k": k if s.drafters else 0,
                                                                  "drafters": list(s.drafters or ("forced",)),
                                                                  **extra})
        dt = time.perf_counter() - t0
        st = llm.last_stats
        choice = out["choices"][0]
        return Run([-1] * st.emitted, choice["text"], st.target_passes, dt, st.drafted, st.accepted, st.rounds,
                   st.mask_us, dict(st.accepted_by_source), choice["finish_reason"] == "stop",
                   dict(st.drafted_by_source), choice["finish_reason"], dict(st.budget))


HOSTS = {"mlx": MLXHost, "llama_cpp": LlamaHost}


def load_host(name: str, **kw):
    if name == "mlx":
        return MLXHost(kw.get("models"))
    if name == "llama_cpp":
        return LlamaHost(threads=kw.get("threads", 1))
    raise SystemExit(f"unknown host {name!r}; choose from {', '.join(HOSTS)}")
