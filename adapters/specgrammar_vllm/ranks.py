"""Every worker's own drafts, read through vLLM's own channel to its workers (``LLM.collective_rpc``), to check that
the ranks of one engine drafted alike (``draws.py`` says why they must).

    llm.collective_rpc(record_drafts)          # in every worker: start keeping the drafts its proposer proposes
    llm.generate(...)
    per_worker = llm.collective_rpc(recorded_drafts)   # [{"tp": 0, "pp": 0, "drafts": {req_id: [[...], ...]}}, ...]
    assert disagreements(per_worker) == []

With the multiprocess executor (tensor or pipeline parallel), a function reaches the workers only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vLLM pickles it); these are module functions, so the workers import them.
For tests and for checking a deployment by hand; nothing here runs unless called.
"""

from __future__ import annotations

from typing import Any

from .proposer import GrammarStates


def _states(worker) -> GrammarStates | None:
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if isinstance(drafter, GrammarStates):
        return drafter
    g = getattr(drafter, "grammar", None)
    return g if isinstance(g, GrammarStates) else None


def _where(worker) -> dict[str, int]:
    from vllm.distributed import parallel_state as ps

    out = {"rank": int(getattr(worker, "rank", 0) or 0)}
    for name, group in (("tp", ps.get_tp_group), ("pp", ps.get_pp_group)):
        try:
            out[name] = int(group().rank_in_group)
        except Exception:  # (not initialised in this worker)
            out[name] = -1
    pc = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    out["dp"] = int(getattr(pc, "data_parallel_rank", 0) or 0)
    return out


def record_drafts(worker) -> dict[str, Any]:
    """In a worker: keep every draft its proposer proposes from now on, by request id (``GrammarStates.record``)."""
    states = _states(worker)
    if states is None:
        return {**_where(worker), "recording": False}
    if getattr(states, "_rank_log", None) is None:
        log: dict[str, list[list[int]]] = {}
        record = states.record

        def recording(st, req_id, tokens, sources):
            log.setdefault(str(req_id), []).append([int(t) for t in tokens])
            return record(st, req_id, tokens, sources)

        states.record = recording
        states._rank_log = log
    return {**_where(worker), "recording": True}


def recorded_drafts(worker) -> dict[str, Any]:
    """In a worker: where it sits (tensor, pipeline, data-parallel rank), the drafts its proposer proposed since
    ``record_drafts`` and its counters."""
    states = _states(worker)
    if states is None:
        return {**_where(worker), "drafts": None}
    stats = states.stats()
    return {**_where(worker), "drafts": dict(getattr(states, "_rank_log", None) or {}),
            "counters": {k: stats[k] for k in ("rounds", "draft_tokens", "proposer_errors")},
            "sources": stats["sources"]}


def disagreements(per_worker: list[dict[str, Any]]) -> list[str]:
    """Where workers of one data-parallel engine and pipeline stage drafted differently (empty: they agree)."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for w in per_worker:
        if w.get("drafts") is not None:
            groups.setdefault((w.get("dp", 0), w.get("pp", 0)), []).append(w)
    for key, ws in sorted(groups.items()):
        first = ws[0]
        for w in ws[1:]:
            for req in sorted(set(first["drafts"]) | set(w["drafts"])):
                a, b = first["drafts"].get(req), w["drafts"].get(req)
                if a != b:
                    steps = [i for i in range(max(len(a or []), len(b or [])))
                             if (a or [])[i:i + 1] != (b or [])[i:i + 1]]
                    out.append(f"dp {key[0]} pp {key[1]}: rank {first['rank']} and rank {w['rank']} drafted "
                               f"differently for request {req} at {len(steps)} step(s), first step {steps[0]}")
    return out
