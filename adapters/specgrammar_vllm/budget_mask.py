"""Budget feasibility on vLLM: the budget mask composed with the structured-output bitmask vLLM already applies.

vLLM samples the target's tokens itself, and vLLM 0.32 refuses custom V1 logits processors when speculative
decoding is on (``vllm/v1/sample/logits_processor/__init__.py``: "Custom logits processors are not supported when
speculative decoding is enabled").  What every structured request does have is vLLM's grammar bitmask: the
scheduler fills one row per position (the target position and each draft position, advancing the request's
grammar through the drafts, ``StructuredOutputManager.grammar_bitmask``), and the model runner applies those rows
to the target's logits before vLLM's sampler and rejection sampler read them.  So the budget is applied there:

- **built once per request, off the engine step**: ``StructuredOutputManager._create_grammar`` runs in vLLM's
  grammar-compilation thread pool while the request waits in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` (the
  scheduler only polls the future).  ``install`` wraps it: after vLLM's backend compiled its grammar, the request's
  constraint is compiled by our engine on the same language (``structured.spec_from_params``, the backend's
  engine and options, the tokenizer as that backend reads it, the request's stop tokens) and the core's budget is
  built (``api.check_budget``: exact from the DFA, or certified), under the core's preparation deadline.  A
  request whose shortest completion does not fit fails there (the launcher's gate refuses it first with a 400,
  ``gate_check``).
- **cheap per step**: the grammar vLLM keeps for the request is wrapped (``BudgetedGrammar``); after vLLM's
  backend fills a row, ``Budget.mask_row`` cuts it in place for the position's prefix (exact: a cached row per DFA
  state and slack, and nothing at all while the budget does not bind; certified: within
  ``SPECGRAMMAR_VLLM_BUDGET_MARGIN`` tokens of the certificate the certificate's own way among a bounded set of
  candidates; farther, the tokens that can raise the certificate by more than the slack in one step, one
  certificate per structure group: ``SPECGRAMMAR_VLLM_BUDGET_FAR`` = ``open`` (default: the groups that open an
  object or an array, or start a container's next item or member: a ``,``; issue 35's two cut-offs at T = 0.7, an
  array item of ~720 tokens opened with ~200 left, are cut at that token; 7-14% of the target step on
  SmolLM2-135M, 7-9% of the step, was 16-38% of the target step with the former opener check), ``all`` (every structure group: keys,
  value strings too; ~0.5 ms a row at 151,665 tokens), ``off`` (none: the premise that no token jumps the
  margin, which those two break).  A request
  whose prefix is left without a certificate is counted (``budget_lost_midway``, and per request in ``LOST``),
  as one with none at the start is (``budget_lost``)).  The row is a function of the prefix alone, so the target
  position and every verification position of a speculative step read the same combined grammar-and-budget row
  plain decoding reads: greedy speculative output equals greedy plain output, and at T > 0 vLLM's rejection sampler returns the
  target's law under the combined row.
- **drafts**: vLLM's ``validate_tokens`` of a step's drafts goes through the wrapper too, which ends them
  before the first one the budget's row forbids where drafts are a function of the prefix (greedy requests,
  vLLM's default argmax drafts, forced and recipe drafts); sampled drafts stay whole (cutting them by value would
  bias the rejection sampler) and a forbidden one is rejected by the row.  The draft proposers
  (``proposer.GrammarStates``) find a request's budget here (``budget_of``), so that the engine's
  ``budget_cut_off`` counter counts only requests that really run without one.

``SPECGRAMMAR_VLLM_BUDGET=0`` turns it off engine-wide (vLLM then cuts structured outputs at max_tokens); a request
turns it off with ``"specgrammar": {"budget_mask": false}`` (``vllm_xargs.specgrammar`` / ``extra_args``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref

from specgrammar_plugins.api import GREEDY_T, LOST_MIDWAY, RowCut, switch_on

log = logging.getLogger("vllm.specgrammar")

MODULE = "vllm.v1.structured_output"
MARGIN = int(os.environ.get("SPECGRAMMAR_VLLM_BUDGET_MARGIN", 16))
# what the certified rows check far from the limit (``CertifiedBudget.mask_row``): open (default) | all | off
FAR = os.environ.get("SPECGRAMMAR_VLLM_BUDGET_FAR", "open")
if FAR not in ("open", "all", "off"):
    FAR = "open"
COUNTERS: dict = {"budget_requests": 0, "budget_exact": 0, "budget_certified": 0, "budget_refused": 0,
                  "budget_skipped": 0, "budget_errors": 0, "budget_rows": 0, "budget_cut_rows": 0,
                  "budget_lost": 0, "budget_lost_midway": 0, "budget_drafts_cut": 0, "budget_uncertified": 0, "budget_ns": 0,
            "budget_draft_ns": 0, "costly_cache_drops": 0}  # budget_ns: the scheduler's rows and draft checks; budget_draft_ns: the proposers'
LOST = LOST_MIDWAY  # ids of the requests that lost their certificate mid-way (budget_lost_midway), the last 4096
_LOCK = threading.Lock()
# request id -> its BudgetedGrammar (the proposers in the same EngineCore process read it)
_LIVE: "weakref.WeakValueDictionary[str, BudgetedGrammar]" = weakref.WeakValueDictionary()


def enabled() -> bool:
    return switch_on("SPECGRAMMAR_VLLM_BUDGET")


def budget_of(req_id: str):
    """The core ``Budget`` vLLM's bitmask applies for this request, or None."""
    g = _LIVE.get(req_id)
    return None if g is None else g.budget


def fitting_drafts(req_id: str, generated, drafts) -> int:
    """How many of a request's ``drafts`` (after its output ``generated``) its budget's rows allow: the draft
    proposers end their drafts there, so that vLLM's ``validate_tokens`` never has to (``BudgetedGrammar``)."""
    g = _LIVE.get(req_id)
    return len(drafts) if g is None else g.fitting(generated, drafts, "budget_draft_ns")


def _count(name: str, n: int = 1) -> None:
    COUNTERS[name] += n  # (the engine's thread; the compile threads count under _LOCK with _count_locked)


def _count_locked(name: str, n: int = 1) -> None:
    with _LOCK:
        COUNTERS[name] += n


_VIEWS: dict = {}  # id of vLLM's bitmask tensor -> (the tensor, its numpy view): one conversion per tensor


class BudgetedGrammar:
    """vLLM's ``StructuredOutputGrammar`` of one request, with the budget cut after each row it fills (the core's
    ``api.RowCut``: the row, and the drafts it allows).  The generated tokens are tracked through ``accept_tokens``
    / ``rollback`` / ``reset`` (vLLM advances the grammar through a step's drafts while it fills their rows, then
    rolls back), so a row's prefix is always known."""

    def __init__(self, inner, budget, req_id: str, margin: int = MARGIN, width: int = 0,
                 deterministic_drafts: bool = False):
        self.inner, self.req_id, self.margin = inner, req_id, margin
        # the proposer's last check of this request's drafts (``fitting`` from ``fitting_drafts``) is kept there:
        # ``validate_tokens`` reads its verdicts instead of checking the same drafts after the same prefix again
        self.cut = RowCut(budget, margin, FAR, width, deterministic_drafts, req_id)
        self.tokens: list[int] = []

    @property
    def budget(self):
        return self.cut.budget

    def __getattr__(self, name):  # everything else is vLLM's grammar's
        return getattr(self.inner, name)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for t in tokens:  # one at a time: vLLM's grammar keeps the tokens before a refused one
            if not self.inner.accept_tokens(request_id, [t]):
                return False
            self.tokens.append(int(t))
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """vLLM's check of a step's drafts, then the budget's: drafts end before the first one the budget's row
        forbids, where drafts are a function of the prefix (greedy requests, argmax drafts, host drafts).  Sampled
        drafts are left whole (cutting a sampled draft by its value would bias vLLM's rejection sampler); the
        row gives a forbidden one target probability 0 and it is rejected, exactly.  What the proposer's check of
        the same drafts after the same prefix said is read, not checked again (``RowCut.known``)."""
        ok = self.inner.validate_tokens(tokens)
        known, refused = self.cut.known(self.tokens, ok)
        n = known if refused else self.fitting(self.tokens, ok, start=known)
        if n < len(ok):
            _count("budget_drafts_cut", len(ok) - n)
        return ok[:n]

    def fitting(self, generated, drafts, counter: str = "budget_ns", start: int = 0) -> int:
        """How many of ``drafts`` (after the output ``generated``) the budget's rows allow (``RowCut.fitting``);
        the proposers' checks (``counter`` "budget_draft_ns") are kept for ``validate_tokens``."""
        t0 = time.thread_time_ns()
        try:
            return self.cut.fitting(generated, drafts, counter == "budget_draft_ns", start)
        finally:
            _count(counter, time.thread_time_ns() - t0)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens > 0:
            del self.tokens[-num_tokens:]

    def reset(self) -> None:
        self.inner.reset()
        self.tokens.clear()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def fill_bitmask(self, bitmask, idx: int) -> None:
        self.inner.fill_bitmask(bitmask, idx)
        t0 = time.thread_time_ns()  # (CPU time of the engine's thread, as the benchmark's phases)
        try:
            view = _VIEWS.get(id(bitmask))
            if view is None or view[0] is not bitmask:
                _VIEWS.clear()
                view = _VIEWS[id(bitmask)] = (bitmask, bitmask.numpy())
            row = view[1][idx]  # a view of vLLM's CPU bitmask: cut in place
            cut = self.cut.restrict(row, self.tokens)
            lost = self.cut.lost_now(len(self.tokens), log)  # (once: counted, logged, LOST)
            if lost:
                _count(lost)
            if cut:
                _count("budget_cut_rows")
        except Exception as e:  # never break the step: this request goes on without the cut
            _count("budget_errors")
            log.warning("specgrammar: budget mask failed for request %s (%s: %s); served without it", self.req_id,
                        type(e).__name__, e)
            self.cut.off()
        finally:
            _count("budget_rows")
            _count("budget_ns", time.thread_time_ns() - t0)


# ------------------------------------------------------------------------------------------- building
def request_options(sp) -> dict | None:
    """The request's ``specgrammar`` options (``extra_args``, from the launcher's ``vllm_xargs``), read by the core's
    one reader (``api.options_in``).  The launcher's gate answers a malformed value with a 400 first; one that
    reaches the engine by another way (``vllm.LLM``, vLLM's own server) is logged and ignored, as the proposer
    ignores it."""
    from specgrammar_plugins.api import RequestError, options_in

    try:
        return options_in(getattr(sp, "extra_args", None), "extra_args.specgrammar")
    except RequestError as e:
        log.warning("specgrammar: %s; ignored", e)
        return None


def grammar_tokenizer(hf, vocab_size: int, engine: str):
    """The tokenizer as vLLM's structured-output backend reads it (``api.engine_tokenizer``: xgrammar's own view)."""
    from specgrammar_plugins.api import engine_tokenizer

    return engine_tokenizer(hf, vocab_size, engine, log)


def build(manager, request, made: list | None = None):
    """The request's core ``Budget`` (None: no constraint we map, no max_tokens, or the mask is off) for the tokens it
    can generate (``tokens_left``); raises ``BudgetError`` when the shortest completion does not fit.  ``made``: our
    compiled constraint is appended to it (``_create_grammar`` watches it after a costly compile)."""
    from specgrammar_plugins.api import SpecOptions, row_budget, with_stops

    from .structured import ENGINES, compile_as_enforced, engine_options, spec_from_params

    sp = request.sampling_params
    so = getattr(sp, "structured_outputs", None)
    spec = spec_from_params(so)
    if spec is None or getattr(sp, "max_tokens", None) is None:
        return None
    if (request_options(sp) or {}).get("budget_mask") is False:
        _count_locked("budget_skipped")
        return None
    engine, options = engine_options(manager.vllm_config)
    engine = ENGINES.get(getattr(so, "_backend", None) or "", engine)
    vocab = manager.vllm_config.model_config.get_vocab_size()
    tok = with_stops(grammar_tokenizer(manager.tokenizer, vocab, engine), getattr(sp, "all_stop_token_ids", None),
                     getattr(sp, "eos_token_id", None))
    # (as vLLM's backend enforces it: a schema keyword our strict mode refuses and vLLM's xgrammar ignores is
    # ignored here too; before, such a request had no budget and was cut off, 2 of the 7 schemas vLLM answered
    # in `bench real`)
    compiled, _ = compile_as_enforced(spec, tok, engine, options)
    if made is not None:
        made.append(compiled)
    # (its tables made here, not in the step)
    return row_budget(compiled, SpecOptions(), tokens_left(manager.vllm_config, request, int(sp.max_tokens)), FAR)


def tokens_left(vllm_config, request, max_tokens: int) -> int:
    """The tokens the request can generate: ``max_tokens``, or fewer where the prompt leaves less room in the model's
    context (``max_model_len``): vLLM 0.32's offline ``LLM.generate`` does not clamp ``max_tokens`` to it, and ends
    such a request at the context's end (finish reason "length"), so a budget of ``max_tokens`` let 14 of 56
    SmolLM2 answers be cut off unfinished (docs/BENCHMARKS.md, "A longer budget, and a gap it shows")."""
    limit = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    prompt = getattr(request, "num_prompt_tokens", None)
    if not isinstance(limit, int) or not isinstance(prompt, int):
        return max_tokens
    return max(0, min(max_tokens, limit - prompt))


def bound_compile_cache() -> None:
    """Where vLLM compiles its grammars (the EngineCore), our compile cache is bounded as vLLM's own xgrammar
    cache is (``VLLM_XGRAMMAR_CACHE_MB``; the launcher sets 64 MB, which still holds a 20,000-option choice), when
    that is lower: the engine compiles each structured request's constraint twice, vLLM's backend for its bitmask
    and ours for the budget and the drafts, and ours kept up to ``SPECGRAMMAR_COMPILE_CACHE_MB`` (512 MB
    engine-reported, ~1.5x that in RSS) of grammars vLLM's cache had long dropped (issue 33).  The API server's
    gate, which vLLM's backend never runs in, keeps its own bound."""
    from specgrammar_plugins.api import cap_compile_cache

    try:
        import vllm.envs as envs

        limit = int(envs.VLLM_XGRAMMAR_CACHE_MB) << 20
    except Exception:  # (an older vLLM without the setting: the cache keeps its bound)
        return
    cap_compile_cache(limit)


def _drop_costly(manager, before: int | None) -> bool:
    """After a compile that grew the EngineCore's heap past the trim slack (``api.drop_costly``: 64 MB; a
    20,000-option choice grew it ~260 MB), both compile caches of the engine are emptied: ours (by ``drop_costly``)
    and vLLM's xgrammar cache, because xgrammar 0.2.8's ``GrammarCompiler`` holds more than it counts against
    ``cache_limit_bytes`` (emptying it gave back 161 MB while it reported 50 MB, issue 33), so its bound cannot keep
    costly grammars from staying.  The request keeps its own compiled grammar; what it held is freed when it ends,
    and the next grammar compile's ``give_back_memory(again=True)`` collects and trims it.  The cheap grammars of
    other requests compile again once (ms); a repeat of the costly one compiles again (the launcher's gate bounds
    its preparation)."""
    from specgrammar_plugins.api import drop_costly

    grew = drop_costly(before)
    if grew is None:
        return False
    clear = getattr(getattr(getattr(manager, "backend", None), "compiler", None), "clear_cache", None)
    if clear is None:
        return True
    try:
        clear()
    except Exception as e:  # (never the request's failure)
        log.warning("specgrammar: could not empty vLLM's xgrammar cache (%s: %s)", type(e).__name__, e)
        return True
    _count_locked("costly_cache_drops")
    log.info("specgrammar: a grammar compile grew the engine's heap by %d MB: the compile caches emptied", grew >> 20)
    return True


def wrap_create_grammar(cls) -> None:
    """``StructuredOutputManager._create_grammar`` (run in vLLM's compile thread pool) returns the grammar wrapped
    with the request's budget (idempotent).  Afterwards the memory vLLM's compile and the budget freed goes back to
    the system (``api.give_back_memory``): glibc 2.36 kept it in that thread's arena, and a 20,000-option choice
    left the EngineCore +308 MB (issue 33)."""
    orig = cls._create_grammar
    if getattr(orig, "_specgrammar", False):
        return

    def _create_grammar(self, request):
        from specgrammar_plugins.api import give_back_memory, rss_bytes, trim_when_freed

        bound_compile_cache()
        before = rss_bytes()
        made: list = []  # (our compiled constraint, which the request's budget and drafts hold)
        grammar = None
        try:
            grammar = _budgeted(self, request, made)
            return grammar
        finally:
            if _drop_costly(self, before):  # the heap is trimmed again as the request lets go of each grammar
                trim_when_freed(grammar, *made)
            give_back_memory(again=True)

    def _budgeted(self, request, made: list):
        grammar = orig(self, request)
        if not enabled():
            return grammar
        from specgrammar_plugins.api import BudgetError

        try:
            budget = build(self, request, made)
        except BudgetError as e:  # the launcher's gate refuses it first (400); offline the request fails here
            if e.shortest is None:  # nothing certified for vLLM's form of the grammar (its EBNF: no GBNF
                # shortest-string certificate, and the greedy walk found no end): served as before, without the
                # mask, and counted (the proposer's budget_cut_off counts it too when it cannot end)
                _count_locked("budget_uncertified")
                log.warning("specgrammar: request %s runs without the budget mask: %s", request.request_id, e)
                return grammar
            _count_locked("budget_refused")
            log.warning("specgrammar: request %s refused: %s", request.request_id, e)
            raise
        except Exception as e:  # our side failed: vLLM's grammar alone (counted, logged)
            _count_locked("budget_errors")
            log.warning("specgrammar: no budget mask for request %s (%s: %s)", request.request_id,
                        type(e).__name__, e)
            return grammar
        if budget is None:
            return grammar
        _count_locked("budget_requests")
        _count_locked("budget_exact" if budget.mode == "exact" else "budget_certified")
        spec_cfg = getattr(self.vllm_config, "speculative_config", None)
        sp = request.sampling_params
        greedy = (getattr(sp, "temperature", 1.0) or 0.0) < GREEDY_T
        g = BudgetedGrammar(grammar, budget, request.request_id,
                            width=self.vllm_config.model_config.get_vocab_size(),
                            deterministic_drafts=greedy or getattr(spec_cfg, "draft_sample_method",
                                                                   "greedy") != "probabilistic")
        _LIVE[request.request_id] = g
        return g

    _create_grammar._specgrammar = True  # type: ignore[attr-defined]
    _create_grammar.__wrapped__ = orig  # type: ignore[attr-defined]
    cls._create_grammar = _create_grammar


def install(module) -> None:
    """The wiring hook for ``vllm.v1.structured_output`` (never raises)."""
    try:
        wrap_create_grammar(module.StructuredOutputManager)
    except Exception as e:
        log.warning("specgrammar: budget mask not installed (%s: %s)", type(e).__name__, e)


# ------------------------------------------------------------------------------------------- the launcher's gate
TOKENIZER_ENV = "SPECGRAMMAR_VLLM_TOKENIZER"
# the launcher's --structured-outputs-config (a JSON object): the engine and options of vLLM's backend, for the gate
STRUCTURED_ENV = "SPECGRAMMAR_VLLM_STRUCTURED_OUTPUTS"


def gate_check(spec, options, max_tokens: int | None) -> None:
    """The launcher's up-front refusal (``BudgetError``, a 400 naming the length) of a request whose shortest
    completion does not fit in ``max_tokens``: compiled by our engine for the served tokenizer (``gate_compile``)
    under the core's preparation deadline.  Without a tokenizer or a max_tokens nothing is checked here (the engine
    still applies the mask)."""
    from specgrammar_plugins.api import check_budget

    if not os.environ.get(TOKENIZER_ENV) or max_tokens is None or options.budget_mask is False or not enabled():
        return
    check_budget(gate_compile(spec), options, int(max_tokens))


def gate_engine() -> tuple[str, dict]:
    """The engine and compile options of vLLM's backend as the launcher configured it (``SPECGRAMMAR_VLLM_STRUCTURED_
    OUTPUTS``, from ``--structured-outputs-config``; xgrammar in its strict mode by default), read by the one
    mapping the engine's budget and proposers use (``structured.backend_options``)."""
    from .structured import backend_options

    try:
        cfg = json.loads(os.environ.get(STRUCTURED_ENV) or "null")
    except ValueError:
        cfg = None
    return backend_options(cfg if isinstance(cfg, dict) else None)


def gate_compile(spec):
    """``spec`` compiled strictly for the served tokenizer (``SPECGRAMMAR_VLLM_TOKENIZER``, set by the launcher)
    with the engine and options of vLLM's backend (``gate_engine``), under the request's deadline, in a compile
    worker the launcher runs (``compile_isolation="process"``: killed at the deadline or past its memory limit).
    None without a tokenizer (a model vLLM loads from a hub name: vLLM's backend alone then decides)."""
    from specgrammar_plugins.api import compile_constraint, folder_tokenizer

    name = os.environ.get(TOKENIZER_ENV)
    if spec is None or not name:
        return None
    engine, options = gate_engine()
    # (one tokenizer table per process, as vLLM's backend reads it)
    return compile_constraint(spec, folder_tokenizer(name, engine, log), engine=engine, **options)


def stats() -> dict:
    with _LOCK:
        d = dict(COUNTERS)
    d["budget_us_per_row"] = round(d["budget_ns"] / 1e3 / d["budget_rows"], 2) if d["budget_rows"] else 0.0
    return d
