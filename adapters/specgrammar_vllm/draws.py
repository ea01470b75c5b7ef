"""The random draws of our vLLM drafters, the same on every rank by construction.

vLLM runs a proposer in every worker: one per tensor-parallel rank, per pipeline stage, per data-parallel engine.
The drafts vLLM verifies come from one of them (the executor's output rank, TP rank 0 of the last stage,
multiproc_executor.py ``_get_output_rank``) and every rank verifies those same tokens, each with the draft
probabilities *its own* proposer kept.  If two ranks drew different drafts, a rank would verify another rank's
tokens against its own law: its accepted tokens, and so its KV cache, would part from rank 0's.  So no draw may
depend on per-process state (the order requests arrived in, what else that process drew, an unseeded generator).

Every draw of a request's host drafter chain comes from a ``RequestDraws`` generator that is restarted at each
draft step from three things every rank sees alike:

- the seed: the request's own ``SamplingParams.seed`` when it has one (then the request id is left out, so a seeded
  request drafts the same in every run, as vLLM samples it the same: the engine appends a random suffix to every
  request id), else the engine's ``--seed`` (``model_config.seed``; None counts as 0) and the request id;
- the position: the number of committed tokens (prompt included) when the step starts;
- the index of the draw within the step.

The key is a BLAKE2b digest of the seed and the request id (never Python's ``hash()``, which is salted per process:
``PYTHONHASHSEED``), and the generator is numpy's counter-based Philox with that key and the position in its
counter, so restarting it costs one state assignment (~5 us) and two positions' streams never overlap.

vLLM's own draws are not ours: the draft model's sampled drafts (``draft_sample_method="probabilistic"``) come
from ``compute_probs_and_sample_next_token`` (llm_base_proposer.py), ``q.exponential_()`` on torch's default
generator of the worker, which ignores request seeds.  Every worker seeds that generator with
``set_random_seed(model_config.seed)`` at start-up (cpu_worker.py / gpu_worker.py; data-parallel engines add their
index), and tensor-parallel ranks stay in step because they run the same calls in the same order: the same
invariant vLLM's own sampler relies on for unseeded requests (config/model.py, the ``seed`` field's docstring).
"""

from __future__ import annotations

import hashlib

import numpy as np

_U64 = (1 << 64) - 1


def draw_key(request_seed: int | None, engine_seed: int | None, req_id: str | None) -> tuple[int, int]:
    """The 128-bit Philox key of a request's draws: a stable digest of its seed (and, unseeded, the engine's seed and
    the request id); the same in every process and every run."""
    if request_seed is not None:
        text = f"request-seed\0{int(request_seed)}"
    else:
        text = f"engine-seed\0{int(engine_seed or 0)}\0{req_id or ''}"
    d = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


class RequestDraws:
    """One request's random draws: ``rng`` (a ``numpy.random.Generator``, handed to the request's drafters once) is
    restarted by ``at(position)`` at the start of each draft step, so its stream is a function of (key, position)
    alone."""

    __slots__ = ("key", "rng", "_bits", "_state")

    def __init__(self, request_seed: int | None, engine_seed: int | None, req_id: str | None):
        self.key = draw_key(request_seed, engine_seed, req_id)
        self._bits = np.random.Philox(key=np.array(self.key, dtype=np.uint64))
        self.rng = np.random.Generator(self._bits)
        self._state = self._bits.state  # a template: the key stays, the counter and buffer are set by at()

    def at(self, position: int) -> np.random.Generator:
        """Restart the stream at draft-step ``position`` (committed tokens so far) and return the generator."""
        s = self._state
        s["state"]["counter"] = np.array([0, 0, int(position) & _U64, 0], dtype=np.uint64)
        s["buffer_pos"] = 4  # (Philox buffers 4 words: none buffered)
        s["has_uint32"] = 0
        s["uinteger"] = 0
        self._bits.state = s
        return self.rng
