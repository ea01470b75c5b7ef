"""The core's public API for host adapters: the one module an adapter imports from the core.

Everything a host adapter (``adapters/specgrammar_mlx_lm``, ``specgrammar_llama_cpp``, ``specgrammar_vllm`` or a
third party's) needs is named here; what is not named here is the core's own business and may change.  The layers
contract (``pyproject.toml``, ``[tool.importlinter]``) lets adapters import this module only.

- request -> constraint and options: ``parse_request`` (``CONSTRAINT_FIELDS``: the top-level fields it reads a
  constraint from), ``SpecOptions``, ``options_in`` (the options sent in a
  host's extension field of strings, vLLM's ``vllm_xargs`` / ``extra_args``: one reader, one 400); compiling: ``compile_constraint``
  (cached: ``COMPILE_CACHE``), ``LIMITS``, ``COMPILE_POOL``;
- the one road to decoding: ``make_loop`` (hosts that let us own decoding), ``make_drafter`` + ``DraftBlock`` +
  ``fill`` (hosts that verify drafts themselves), ``with_defaults`` (merge host defaults into request options),
  ``check_budget`` / ``budget_of`` (a request's budget feasibility: ``BudgetError`` when it cannot end in time);
- history-keyed masks for hosts that keep their own loop: ``MaskProcessor``, ``StopOnlyMask``, ``HistoryMatcher``;
- the law and the verifier: ``SamplingParams``, ``GREEDY``, ``log_law``, ``verify_block`` (the reference), and
  ``law_backend(name)``: the same law and verifier where the logits live (``numpy``, ``mlx``, ``torch``);
- the gate every host runs on a request first: ``check_request`` with the host's ``Host`` -> ``Checked``;
  ``prepare_deadline()``: the one preparation deadline of a request (gate check, compile, budget) on this thread;
  ``normalize_gbnf``: a llama.cpp GBNF grammar as xgrammar's EBNF reads it (the text our xgrammar engine compiles);
  ``give_back_memory()``: after costly work the host runs outside ``prepare_deadline`` (vLLM's own grammar
  compile), the memory glibc's arenas kept handed back to the system (``heap``);
- the gate over HTTP, for hosts served over ASGI (``asgi``): ``BodyGate`` (reads a request's body under limits and
  runs the host's gate on it), ``Refused`` (a request the gate answers itself), ``json_object``,
  ``StreamErrorsAs400`` (a streaming response's leading 4xx error sent as that status);
- ``resolve_model``: a model by name (``smollm2-135m``, ``tiny``, ...) or path -> what a host loads (a GGUF for
  ``llama_cpp``, a transformers folder for ``mlx_lm`` / ``vllm``; ``models.real``), ``is_model_name``,
  ``ModelNotInstalled``, ``UnknownModelError``;
- ``patch_path``: a shipped host patch (``patches/``), applied by ``parse_diff`` / ``diff_state`` / ``apply_diff``
  (``unidiff``: exact context, reversible; ``FilePatch``, ``Hunk``, ``PatchError``); ``resolve_pack``: a recipe pack by path or shipped name (the
  operator's options); ``resolve_pack_name``: the pack a request names (a name only: the server's pack directory,
  then the shipped packs);
- the batch layer, for hosts that draft for many requests at once and verify themselves (``batch``): ``RequestTable``
  (per-request grammar state, fault isolation, counters), ``BatchDrafter`` (the per-position plan: the host chain
  first, then masked model rows; lazy masks; per-row bookkeeping) with ``Step``, ``Row``, ``Plan``,
  ``EnoughDrafts`` and the options ``refused_drafts_option`` / ``draft_confidence_option``; ``BatchLoop`` (batched
  speculative decoding: one ``SpeculativeLoop`` per request on a ``RowRunner``, one batched target pass per round,
  each row verified by its own loop, per-row rollback), ``draft_rows`` with ``DraftRow`` / ``DraftPending`` (the rows'
  draft models served by one batched draft pass per position);
- the serving layer, for server adapters (``serving``): ``plan_request`` / ``RequestPlan`` / ``plan_options`` /
  ``draft_k`` (what a request asks for: read by the gate, compiled, its budget checked), ``RowPlan`` (a batched
  speculative row), ``ServedRow`` (a request's row in a host's own batch: its loop's start, feed, verdict, and the
  answers with the host's stop rules), ``RowCut`` (a budget as mask rows, and the drafts they allow, each checked
  once), ``PromptCounter`` / ``tokenizer_facts`` / ``served_names`` (the gate's host facts), ``tokenizer_info`` /
  ``compile_for`` / ``stop_ids`` / ``engine_tokenizer`` (as an engine reads it: xgrammar's view) / ``with_stops`` /
  ``model_vocab_size`` / ``sampling_params`` / ``encode_prompt`` (a Hugging Face tokenizer's requests),
  ``wait_for``, ``widen_listen_backlog``, ``logged``; ``server_compiles`` (a server's compiles in a killable
  worker), ``Warmup`` (a server's one-time set-up, waited for outside a request's deadline), ``drop_costly`` (our
  compile cache emptied after work that grew the heap past the trim slack), ``trim_when_freed`` (the heap trimmed
  again as a costly request's grammars are freed), ``cap_compile_cache`` (our compile
  cache bounded as the host's engine bounds its own); ``row_budget`` (a budget for mask rows, its tables made off
  the host's step); ``row_mask`` (a row's mask for a host's own sampler: the
  grammar with its budget, exact or ``RowCut``, else stop tokens only), ``RowCut.lost_now`` / ``LOST_MIDWAY`` (a
  row's budget found lost, once); ``compile_as_enforced`` with a host's policy (``without_strict``: the host's
  engine ignores what our strict mode refuses), ``folder_tokenizer`` (a served model folder's tokenizer as an
  engine reads it, once per process), ``load_pack`` (a server's recipe pack loaded at start-up as a request's
  chain loads it); a launcher's command line (``option_value``, ``option_values``,
  ``json_option``, ``take_options``) and environment switches (``switch_on``);
- what a host implements: ``ModelRunner`` (a model with a trimmable KV cache; ``HiddenStatesRunner``: one that also
  hands over its hidden states), ``TokenizerInfo``.
"""

from __future__ import annotations

from .asgi import BodyGate, Refused, StreamErrorsAs400, json_object
from .batch import (COUNTERS as BATCH_COUNTERS, DRAFT_CONFIDENCE, GREEDY_T, REFUSED_DRAFTS, BatchDrafter, BatchLoop,
                    DraftPending, DraftRow, EnoughDrafts, Plan, RequestState, RequestTable, Row, RowRunner, Step,
                    draft_confidence_option, draft_rows, refused_drafts_option)
from .block import DraftBlock, Drafter, HiddenStatesRunner, ModelRunner, fill
from .bounds import prepare_deadline
from .compile_worker import POOL as COMPILE_POOL
from .compiler import CACHE as COMPILE_CACHE, LIMITS, compile_constraint
from .constraint import CompiledConstraint, ConstraintSpec, Forced, Matcher
from .distributions import GREEDY, SamplingParams, log_law
from .gbnf import normalize_gbnf
from .gate import Checked, Host, check_request
from .heap import SLACK as TRIM_SLACK_BYTES, give_back as give_back_memory, rss_bytes
from .errors import BudgetError, ConstraintError, EmptyMaskError, RequestError, SpecGrammarError, TokenizerMismatchError
from .history import HistoryMatcher, MaskProcessor, RequestBoundary, StopOnlyMask
from .laws import LawBackend
from .laws import get as law_backend
from .loop import Commit, SpeculativeLoop, Stats
from .masks import allowed_ids, mask_allows, mask_words, new_mask, set_bit, unpack_mask
from .models.real import ModelNotInstalled, UnknownModelError, is_model_name
from .models.real import resolve as resolve_model
from .resources import patch_path
from .plugins import drafters as registered_drafters
from .prefix import common_prefix_len, sync_runner
from .recipes import RecipePackError, resolve as resolve_pack, resolve_name as resolve_pack_name
from .requests import CONSTRAINT_FIELDS, DEFAULT_DRAFTERS, SpecOptions, options_in, parse_request
from .serving import (PromptCounter, RequestPlan, RowCut, RowPlan, ServedRow, compile_for, engine_tokenizer,
                      model_vocab_size, plan_request, tokenizer_facts, with_stops, Warmup, drop_costly,
                      server_compiles, draft_k, encode_prompt, logged,
                      plan_options, sampling_params, served_names, stop_ids, tokenizer_info, wait_for,
                      widen_listen_backlog, LOST_MIDWAY, cap_compile_cache, compile_as_enforced, folder_tokenizer,
                      json_option, load_pack, option_value, option_values, row_budget, row_mask, switch_on,
                      take_options, trim_when_freed, without_strict)
from .speculation import budget_of, check_budget, make_drafter, make_loop, with_defaults
from .tokenizer import TokenizerInfo
from .unidiff import FilePatch, Hunk, PatchError, apply as apply_diff, parse_diff, state as diff_state
from .verify import Verdict, verify_block

__all__ = [
    "BodyGate", "Refused", "StreamErrorsAs400", "json_object",
    "BATCH_COUNTERS", "BatchDrafter", "BatchLoop", "RowRunner", "DraftRow", "DraftPending", "draft_rows", "DRAFT_CONFIDENCE", "EnoughDrafts", "GREEDY_T", "HiddenStatesRunner", "Plan",
    "REFUSED_DRAFTS", "RequestState", "RequestTable", "Row", "Step", "draft_confidence_option", "refused_drafts_option",
    "BudgetError", "COMPILE_CACHE", "COMPILE_POOL", "Checked", "Commit", "CompiledConstraint", "ConstraintError", "ConstraintSpec", "DEFAULT_DRAFTERS",
    "DraftBlock", "Drafter", "EmptyMaskError", "Forced", "GREEDY", "HistoryMatcher", "Host", "LIMITS", "LawBackend",
    "MaskProcessor", "Matcher", "ModelNotInstalled", "ModelRunner", "RecipePackError", "RequestBoundary", "RequestError", "SamplingParams",
    "SpecGrammarError", "SpecOptions", "SpeculativeLoop", "Stats", "StopOnlyMask", "TokenizerInfo",
    "TokenizerMismatchError", "UnknownModelError", "Verdict", "budget_of", "check_budget", "check_request", "common_prefix_len", "compile_constraint", "fill",
    "allowed_ids", "give_back_memory", "rss_bytes", "TRIM_SLACK_BYTES", "is_model_name", "law_backend", "log_law", "make_drafter", "make_loop", "mask_allows", "mask_words", "new_mask",
    "normalize_gbnf", "options_in", "parse_request", "patch_path", "prepare_deadline", "registered_drafters", "resolve_model", "resolve_pack", "resolve_pack_name", "set_bit",
    "sync_runner", "unpack_mask", "verify_block",
    "with_defaults",
    "PromptCounter", "RequestPlan", "RowCut", "RowPlan", "ServedRow", "compile_for", "engine_tokenizer",
    "model_vocab_size", "plan_request", "tokenizer_facts", "with_stops", "Warmup", "drop_costly", "trim_when_freed",
    "server_compiles", "draft_k", "encode_prompt", "logged",
    "plan_options", "sampling_params", "served_names", "stop_ids", "tokenizer_info", "wait_for", "widen_listen_backlog",
    "LOST_MIDWAY", "cap_compile_cache", "compile_as_enforced", "folder_tokenizer", "json_option", "option_value",
    "option_values", "load_pack", "row_budget", "row_mask", "switch_on", "take_options", "without_strict", "CONSTRAINT_FIELDS",
    "FilePatch", "Hunk", "PatchError", "apply_diff", "diff_state", "parse_diff",
]
