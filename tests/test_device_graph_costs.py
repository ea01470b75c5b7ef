"""scripts/device_graph_costs.py times a Llama decoder written out in PyTorch on a GPU; its figures stand for
SmolLM2's only if that forward is the model's.  Held here, on the CPU, against transformers' LlamaForCausalLM with
the same weights (a 2-layer SmolLM2-shaped model, the logits of 5 new tokens after a 12-token prefix in the KV cache)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_graph_costs.py"


def test_the_timed_forward_is_transformers_llama():
    spec = importlib.util.spec_from_file_location("device_graph_costs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.check() < 1e-4
