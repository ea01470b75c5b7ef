"""``SpecLlama``: a ``llama_cpp.Llama`` whose ``generate()`` runs the core ``SpeculativeLoop``.

llama-cpp-python's ``_create_completion`` loops over ``generate()`` (llama.py:1394 in 0.3.36), so completion, chat
completion and streaming all decode through our loop: drafts from a second ``Llama`` context (``draft=``) and/or
the grammar's forced tokens and recipe packs (no draft model needed), one target ``llama_decode`` over
[pending, d1..dk] with logits only for those rows, the core's exact verification with the grammar masks computed
once, and ``llama_memory_seq_rm`` rollback with its return value checked.

Requests may carry a constraint in any of these spellings; each is compiled by our engine before anything else
happens (an invalid one raises ``ConstraintError``; llama.cpp never sees it):

- ``grammar=``: a ``LlamaGrammar`` (GBNF), a GBNF string, or our ``ConstraintSpec``;
- ``constraint=``: a ``ConstraintSpec``;
- ``response_format=`` (chat and completion): ``{"type": "json_object", "schema": ...}`` as llama-cpp-python
  spells it, OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``, ``regex``/``grammar`` types;
- ``regex=``, ``json_schema=``, ``choice=``, ``structured_outputs=`` and ``specgrammar={"k": .., "drafters": ..,
  "engine": ..}`` as ``requests.parse_request`` reads them.

The host's sampling options map onto the core law (``distributions.log_law``) in llama.cpp's chain order
(top-k -> top-p -> min-p -> temperature, ``SamplingParams(temperature_last=True)``); ``temperature == 0`` is greedy,
``temperature < 0`` samples the full distribution (llama.cpp: ``dist`` alone); the seed the host sets
(``seed=`` or its own draw) seeds our generator.  Options the law does not have (repeat/frequency/presence
penalties, typical-p, mirostat, ``reset=False``, recurrent models) fall back to the stock ``generate()`` with the
constraint applied as our history-keyed logits processor (no llama.cpp grammar).  ``logits_processor`` and
``logit_bias`` are honoured on our path (applied to every verified row with that row's own history), and so are
``stopping_criteria`` (asked before each token is yielded, with the ids before it and the logits row it was drawn
from; the chat handlers pass one).  A processor is called for rows past a rejected draft too (their results are
discarded), so it must be a function of the history it is given, not of call order.

The chat handlers build their own ``LlamaGrammar`` for tool calls (``tool_choice``); ``LlamaGrammar`` only stores
the text, and ``generate()`` compiles it with our engine, so it never reaches llama.cpp's sampler either.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

from llama_cpp import Llama, LogitsProcessorList

from specgrammar_plugins.api import (DEFAULT_DRAFTERS, GREEDY, ConstraintError, ConstraintSpec, Host, SamplingParams,
                                     SpecOptions, check_budget, check_request, make_loop, plan_options, prepare_deadline,
                                     resolve_model, with_defaults)

from .grammar import ValidatedGrammar, compile_for
from .runner import LlamaRunner, tokenizer_info

# request fields parse_request reads (beside llama-cpp-python's own ``grammar``)
_REQUEST_FIELDS = ("response_format", "regex", "json_schema", "choice", "structured_outputs", "grammar_syntax",
                   "specgrammar", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# llama-cpp-python's own arguments the core's gate checks too (finite, in range; logit_bias ids in the vocabulary)
_GATED = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "presence_penalty", "frequency_penalty",
          "repeat_penalty", "logit_bias", "stop", "stream")


def sampling_params(temp: float, top_k: int, top_p: float, min_p: float) -> SamplingParams:
    """llama-cpp-python's sampling arguments as the core law (llama.cpp 0.3.36 chain, llama.py:704-790)."""
    if temp == 0.0:
        return GREEDY
    if temp < 0.0:  # llama.cpp: dist over the full (grammar-masked) distribution, no filters
        return SamplingParams(temperature=1.0, temperature_last=True)
    k = int(top_k) if top_k and top_k > 0 else 0
    if top_p <= 0.0:  # llama.cpp keeps min_keep = 1 token
        k, top_p = 1, 1.0
    return SamplingParams(temperature=float(temp), top_k=k, top_p=min(float(top_p), 1.0),
                          min_p=min(max(float(min_p), 0.0), 1.0), temperature_last=True)


def bias_processor(logit_bias: dict) -> Any:
    bias = {int(k): float(v) for k, v in logit_bias.items()}

    def apply(input_ids, scores):
        out = np.array(scores, copy=True)
        for t, b in bias.items():
            out[t] += b
        return out

    return apply


class SpecLlama(Llama):
    """``llama_cpp.Llama`` with grammar-aware speculative decoding in ``generate()``.

    model_path: a GGUF path, or a model name (``smollm2-135m``, ``tiny``: ``api.resolve_model``).
    draft: a ``Llama``, a GGUF path or a model name for the draft model (same vocabulary); None drafts only forced
        tokens / recipes.  A path is loaded with this model's ``n_ctx``, ``n_batch`` and thread counts.
    k: draft tokens per round (a request's ``specgrammar.k`` overrides it); drafters: the chain, in order.
    engine: the grammar engine (default: the core's, xgrammar).  blind_draft: draft without the grammar mask
        (only for benchmarks that reproduce the blind-draft problem).  recipe: a pack (path or shipped name) used
        by default; recipes_dir: a folder of packs a request may name (``specgrammar.recipe`` is a name, never a
        path: that folder, then the shipped packs).
    Everything else is ``Llama``'s own arguments; ``logits_all`` is not needed.  ``last_stats`` holds the core's
    ``Stats`` of the last request that ran through the loop (``None`` after a fallback).
    """

    def __init__(self, model_path: str, *args, draft: "Llama | str | os.PathLike | None" = None, k: int = 4,
                 drafters: Sequence[str] = DEFAULT_DRAFTERS, engine: str | None = None, recipe: Any = None,
                 blind_draft: bool = False, draft_kwargs: dict | None = None, recipes_dir: str | None = None,
                 **kwargs):
        if kwargs.get("draft_model") is not None:
            raise ValueError("SpecLlama drafts itself: pass draft=<Llama or GGUF path> instead of draft_model=")
        super().__init__(str(resolve_model(model_path, "llama_cpp")), *args, **kwargs)
        if draft is not None and not isinstance(draft, Llama):
            draft = resolve_model(draft, "llama_cpp")
            dk = dict(n_ctx=self.n_ctx(), n_batch=self.n_batch, n_threads=self.n_threads,
                      n_threads_batch=self.n_threads_batch, verbose=False)
            dk.update(draft_kwargs or {})
            draft = Llama(os.fspath(draft), **dk)
        self.draft = draft
        if draft is not None:
            tokenizer_info(draft).check_same_vocab(tokenizer_info(self), "draft and target")
        self.k = int(k)
        self.drafters = tuple(drafters)
        self.engine = engine
        self.recipe = recipe
        self.recipes_dir = recipes_dir
        self.blind_draft = blind_draft
        self.last_stats = None
        self._request_max_tokens: int | None = None

    # ------------------------------------------------------------------------------------------ request fields
    def _prepare(self, kwargs: dict, max_tokens: int | None = None) -> dict:
        """``_prepare_now`` under the request's one preparation deadline (``prepare_deadline``: 5 s,
        ``SPECGRAMMAR_PREPARE_TIMEOUT_S``) over the gate, the compile and the budget: an overrun is a
        ``ConstraintError`` naming the part that overran (issue 33)."""
        with prepare_deadline():
            return self._prepare_now(kwargs, max_tokens)

    def _prepare_now(self, kwargs: dict, max_tokens: int | None = None) -> dict:
        """Read our request fields and the host's ``grammar``; validate (compile) the constraint now, so a bad
        one raises before any generator is returned; pass it on as ``grammar=ValidatedGrammar``.  With a
        ``max_tokens`` (the request's, else the method's default) the budget feasibility is checked now too
        (``BudgetError`` when the constraint cannot end within it; without one the room left in the context
        window is the budget, checked when decoding starts)."""
        body = {f: kwargs.pop(f) for f in _REQUEST_FIELDS if f in kwargs}
        body = {f: v for f, v in body.items() if v is not None}
        if isinstance(kwargs.get("grammar"), ValidatedGrammar):
            return kwargs  # already validated (the chat path calls create_completion with it)
        # the core's gate, on our fields and the host's sampling arguments: numbers finite and in range, unknown
        # specgrammar keys, stop strings with a constraint (the prompt's length is llama-cpp-python's own check)
        gated = {f: kwargs[f] for f in _GATED if kwargs.get(f) is not None}
        checked = check_request({**gated, **body}, self._host(),
                                host_constraint=kwargs.get("grammar") is not None or kwargs.get("constraint") is not None)
        spec, options = checked.spec, checked.options
        options = plan_options(options, self.recipes_dir)  # recipe: a pack name (RecipePackError: a ValueError)
        found = [("request fields", spec)] if spec is not None else []
        c = kwargs.pop("constraint", None)
        if c is not None:
            if not isinstance(c, ConstraintSpec):
                raise TypeError(f"constraint must be a ConstraintSpec, not {type(c).__name__}")
            found.append(("constraint", c))
        g = kwargs.get("grammar")
        if g is not None:
            found.append(("grammar", g))
        if len(found) > 1:
            raise ConstraintError("only one constraint may be given per request; got " +
                                  ", ".join(name for name, _ in found))
        if not found and options == SpecOptions():
            return kwargs  # nothing to do
        obj = found[0][1] if found else None
        compiled = compile_for(obj, tokenizer_info(self), options.engine or self.engine)
        max_tokens = kwargs.get("max_tokens", max_tokens)
        if max_tokens is not None and max_tokens > 0:
            check_budget(compiled, options, max_tokens)
        kwargs["grammar"] = ValidatedGrammar(compiled.spec if compiled is not None else None, compiled, options)
        return kwargs

    def _host(self) -> Host:
        """What the core's gate checks a call against: the vocabulary (``logit_bias``), llama.cpp's meaning of a
        negative temperature (the full distribution, see ``sampling_params``) and of top_k <= 0 (off)."""
        return Host("SpecLlama", prompt_types=(), vocab_size=int(self.n_vocab()),
                    ranges=(("temperature", (False, None, None)), ("top_k", (True, None, 2**31 - 1))))

    def create_completion(self, prompt, *args, **kwargs):
        return self._reported(super().create_completion(prompt, *args, **self._prepare(kwargs, 16)))

    def __call__(self, prompt, *args, **kwargs):
        return self._reported(super().__call__(prompt, *args, **self._prepare(kwargs, 16)))

    def create_chat_completion(self, messages, *args, **kwargs):
        # take response_format away from the chat handler (it would build an unvalidated LlamaGrammar from it)
        return self._reported(super().create_chat_completion(messages, *args, **self._prepare(kwargs)))

    def _reported(self, out):
        """The response with ``"specgrammar": {"budget": ...}`` (``Stats.budget``: whether the budget shaped the
        ending) on a constrained request our loop decoded; when streaming, on the chunk that ends it."""
        if isinstance(out, dict):
            return self._annotate(out)
        return (self._annotate(c) if c.get("choices") and c["choices"][0].get("finish_reason") else c for c in out)

    def _annotate(self, out: dict) -> dict:
        st = self.last_stats
        if st is not None and st.budget:
            out["specgrammar"] = {"budget": dict(st.budget)}
        return out

    def _create_completion(self, *args, **kwargs):
        # llama-cpp-python 0.3.36 bug (llama.py:1339): with both logits_processor and logit_bias,
        # ``logits_processor = logits_processor.extend(...)`` sets it to None, dropping both. Merge them here.
        lp, bias = kwargs.get("logits_processor"), kwargs.get("logit_bias")
        if lp is not None and bias:
            kwargs["logits_processor"] = LogitsProcessorList([*lp, bias_processor(bias)])
            kwargs["logit_bias"] = None
        max_tokens = kwargs.get("max_tokens", 16)
        inner = super()._create_completion(*args, **kwargs)
        self._request_max_tokens = max_tokens
        yield from inner

    # ------------------------------------------------------------------------------------------ decoding
    def _unsupported(self, **kw) -> list[str]:
        out = []
        if kw["mirostat_mode"]:
            out.append("mirostat")
        if kw["repeat_penalty"] != 1.0 or kw["frequency_penalty"] or kw["presence_penalty"]:
            out.append("repetition penalties")
        if kw["typical_p"] != 1.0:
            out.append("typical_p")
        if not kw["reset"]:
            out.append("reset=False")
        if self._is_recurrent or self._is_hybrid:
            out.append("a recurrent/hybrid model (its cache cannot roll back)")
        return out

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None,
                 grammar=None) -> Iterator[int]:
        """Yield generated tokens (the host's ``generate`` contract; values sent into the generator are ignored).
        The constraint is compiled (validated) on the first ``next()``, before any decoding."""
        tokinfo = tokenizer_info(self)
        options = grammar.options if isinstance(grammar, ValidatedGrammar) else SpecOptions()
        compiled = compile_for(grammar, tokinfo, options.engine or self.engine)
        tokens = [int(t) for t in tokens]
        max_tokens, self._request_max_tokens = self._request_max_tokens, None
        why = self._unsupported(mirostat_mode=mirostat_mode, repeat_penalty=repeat_penalty,
                                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                typical_p=typical_p, stopping_criteria=stopping_criteria, reset=reset)
        if why:
            self.last_stats = None
            lp = list(logits_processor or [])
            if compiled is not None:
                from .stock import GrammarLogitsProcessor

                lp.append(GrammarLogitsProcessor(compiled, prompt_len=len(tokens)))
            warnings.warn(f"SpecLlama: {', '.join(why)} not in the speculative law; decoding with the stock loop "
                          "(constraint applied as a history-keyed logits processor)", RuntimeWarning, stacklevel=2)
            yield from super().generate(
                tokens, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                repeat_penalty=repeat_penalty, reset=reset, frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, penalize_nl=penalize_nl,
                logits_processor=LogitsProcessorList(lp) if lp else None, stopping_criteria=stopping_criteria,
                grammar=None)
            return
        yield from self._speculate(tokens, compiled, options, sampling_params(temp, top_k, top_p, min_p),
                                   list(logits_processor or []), max_tokens, stopping_criteria)

    def _speculate(self, prompt: list[int], compiled, options: SpecOptions, params: SamplingParams,
                   processors: list, max_tokens: int | None, stopping_criteria=None) -> Iterator[int]:
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        room = self._n_ctx - len(prompt)
        if room < 1:
            raise ValueError(f"the prompt ({len(prompt)} tokens) fills the context window ({self._n_ctx})")
        # the host's own normalization of max_tokens (llama.py:1349-1358); it stops the request there itself
        if max_tokens is None or max_tokens <= 0 or max_tokens >= room:
            max_tokens = room
        rng = np.random.default_rng(self._seed)
        tokinfo = tokenizer_info(self)
        target = LlamaRunner(self, processors)
        draft_runner = LlamaRunner(self.draft, processors) if self.draft is not None else None
        options = with_defaults(options, k=self.k, drafters=self.drafters, recipe=self.recipe)
        loop = make_loop(target, prompt, options, constraint=compiled, tokenizer=tokinfo, params=params, rng=rng,
                         draft_runner=draft_runner, max_tokens=max_tokens, stop_token_ids=tokinfo.stop_token_ids,
                         blind=self.blind_draft)
        self.last_stats = loop.stats
        stops = set(tokinfo.stop_token_ids)
        history = list(prompt)
        for commit in loop.run():
            rows = target.last  # row i of the round's target pass is the law committed token i was drawn from
            toks = list(commit.tokens)
            if commit.finish_reason == "stop" and not (toks and toks[-1] in stops):
                # the grammar completed without a stop token (engines that terminate on their own): the host stops
                # on an end-of-generation token, as llama.cpp's grammar sampler would have produced one here
                toks.append(tokinfo.eos_token_id)
            for i, t in enumerate(toks):
                # the host asks its stopping criteria before yielding each token, with the ids before it
                # (llama.py:999-1003); here with the exact logits row the token was drawn from
                if stopping_criteria is not None and stopping_criteria(
                        np.asarray(history, dtype=np.intc), rows[min(i, len(rows) - 1)]):
                    # the host asks the criteria once more on its own input_ids (llama.py:1587): leave it exactly
                    # the ids the criteria just saw
                    extra = len(target.tokens) - len(history)
                    if extra > 0:
                        target.trim(extra)
                    return
                yield t
                history.append(t)
        # the host never asks past max_tokens (or an end-of-generation token): nothing more to yield


__all__ = ["SpecLlama", "bias_processor", "sampling_params"]
