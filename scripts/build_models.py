#!/usr/bin/env python
"""Build the bundled tiny model family from scratch, deterministically, on CPU.

    .venv/bin/python scripts/build_models.py                 # tokenizer + target + draft + GGUF + metrics
    .venv/bin/python scripts/build_models.py --eval-only     # re-measure the committed models (metrics.json)

1. tokenizer: byte-level BPE (1024 tokens: 3 ChatML specials, the 256 bytes, merges) trained with ``tokenizers``
   on the training split of every workload (``specgrammar_plugins.workloads``); saved as HF files.
2. target (Llama, hidden 256, 2 layers, 4 heads, ~2.4M params) and draft (hidden 128, 2 layers, ~0.5M params):
   AdamW on the training split, loss on the answer tokens (and EOS) only, fp32, 1 thread, seeded.  The target's
   mix adds 3,000 "Repeat exactly: ..." documents (``copy_documents``), which teach it to copy values out of the
   prompt (json_extraction exact match 0% -> 100%, tool_call 10% -> 78%, email 2% -> 76% at 2,000 steps).
   Then each model is tuned for a few steps on "Make up ..." documents (``invent_documents``: the answers are
   random draws) mixed 1:1 with its own training data, so the pair has real sampling entropy at T > 0 and learns
   the same spread there.  (Mixed into the main run instead, they cost the target its copying: json_extraction
   exact match fell to 24%.)
3. export: transformers folders (safetensors, ``rope_theta`` added to config.json, tokenizer files copied in)
   and GGUF files (llama arch, ``gpt2`` BPE vocab, ``gpt-2`` pre-tokenizer) for llama.cpp.
4. metrics.json: per structured workload, greedy validity / exact match on the eval split with the grammar on
   (through the core's matchers) and off; draft/target greedy agreement teacher-forced along the target's greedy
   answers; the recorded greedy outputs the tests reproduce.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from specgrammar_plugins import workloads as W  # noqa: E402
from specgrammar_plugins.models import GGUF_LAYER, TINY_DIR  # noqa: E402

SEED = 1234
THREADS = 1  # one thread: deterministic, and on a shared 2-core machine 2 threads spin (2-3x slower)
VOCAB = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_LEN = 128

ARCH = {
    "target": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4),
    "draft": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2),
}
TRAIN = {
    # the target trains well past the point where copying values from the prompt appears; the draft (no copy
    # documents, 300 steps) gets the structure right and the copied values often wrong: agreement ~75%
    "target": dict(steps=2000, batch=32, lr=3e-3, warmup=40, seed=SEED + 1, tune_steps=150, tune_lr=3e-4),
    "draft": dict(steps=300, batch=32, lr=3e-3, warmup=30, seed=SEED + 2, tune_steps=60, tune_lr=3e-4),
}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ---------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(out: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 512
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update(chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
               add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False,
               tokenizer_class="PreTrainedTokenizerFast", model_max_length=512)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>"]},
        indent=2) + "\n")
    # the chat_template file some transformers versions write is redundant with tokenizer_config.json
    for extra in ("chat_template.jinja",):
        if (out / extra).exists():
            (out / extra).unlink()


def load_hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# ---------------------------------------------------------------------------------------------- data
COPY_DOCS = 3000  # auxiliary "Repeat exactly" documents in the target's training mix
INVENT_DOCS = 3000  # "Make up ..." documents of both models' tuning phase


def copy_documents(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs that ask for a verbatim copy of a random string of the workloads' value shapes
    (IDs, numbers, names, addresses, random letters).  Training data only, never a workload: the structured tasks
    copy values out of the prompt, and this teaches the copy itself (an induction circuit) on far more random
    strings than the workloads hold, so the target learns it within the time budget."""
    r = random.Random(f"{seed}/copy")
    letters, lower = "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz"

    def piece() -> str:
        kind = r.randrange(6)
        if kind == 0:
            return "".join(r.choice(letters) for _ in range(r.randint(2, 5))) + "-" + str(r.randint(0, 99999))
        if kind == 1:
            return str(r.randint(0, 10 ** r.randint(1, 5)))
        if kind == 2:
            return f"{r.choice(W.FIRST)} {r.choice(W.LAST)}"
        if kind == 3:
            return "".join(r.choice(lower) for _ in range(r.randint(3, 10))) + "@" + r.choice(W.DOMAINS) + ".com"
        if kind == 4:
            return "".join(r.choice(lower) for _ in range(r.randint(2, 8)))
        return r.choice(W.OCCUPATIONS + W.CITIES)

    out = []
    for _ in range(n):
        s = " ".join(piece() for _ in range(r.randint(1, 3)))
        out.append((f"Repeat exactly: {s}", s))
    return out


def invent_documents(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs whose answer is a fresh random draw: "Make up a code of 5 digits" -> 48213.
    Training data only, never a workload.  Every workload's answer is a function of its prompt, so without these
    the pair's only uncertainty at T > 0 is model error; real models sample among many valid continuations, and
    that is where exact accept/residual verification (acceptance sum(min(p, q))) and token matching
    (sum(p * q)) part ways.  Both models learn the same uniform choices here."""
    r = random.Random(f"{seed}/invent")
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out = []
    for _ in range(n):
        kind = r.randrange(3)
        if kind == 0:
            k = r.randint(2, 8)
            out.append((f"Make up a code of {k} digits", "".join(r.choice("0123456789") for _ in range(k))))
        elif kind == 1:
            out.append(("Make up an order ID", "".join(r.choice(letters) for _ in range(3)) + "-"
                        + "".join(r.choice("0123456789") for _ in range(4))))
        else:
            person = {"age": r.randint(18, 80), "name": f"{r.choice(W.FIRST)} {r.choice(W.LAST)}",
                      "occupation": r.choice(W.OCCUPATIONS)}
            out.append(("Make up a person as JSON", json.dumps(person)))
    return out


def encode_examples(hf_tok, exs) -> list[tuple[list[int], int]]:
    """(ids, answer_start) per example: ids = prompt + answer + EOS."""
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for e in exs:
        p = hf_tok.encode(W.chat_prompt(e.prompt), add_special_tokens=False)
        a = hf_tok.encode(e.reference, add_special_tokens=False)
        ids = (p + a + [eos])[:MAX_LEN]
        out.append((ids, len(p)))
    return out


def train_model(which: str, data: list[tuple[list[int], int]], vocab_size: int, pad_id: int, eos_id: int,
                bos_id: int, tune: list[tuple[list[int], int]] = (), model=None):
    """AdamW on ``data`` (warmup, cosine to 10%), then ``tune_steps`` at ``tune_lr`` on ``tune`` mixed 1:1 with
    as many sequences drawn from ``data`` (a fresh optimizer and its own seeded stream: the tuned weights depend
    only on the main run's).  With ``model`` given, only the tuning phase runs on it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hp = TRAIN[which]
    torch.manual_seed(hp["seed"])
    main_steps = hp["steps"] if model is None else 0
    if model is None:
        cfg = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                          tie_word_embeddings=True, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
                          attention_bias=False, mlp_bias=False, hidden_act="silu", **ARCH[which])
        model = LlamaForCausalLM(cfg)
    model.to(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{which}: {n_params} parameters, {main_steps} + {hp['tune_steps'] if tune else 0} steps")

    def adamw(lr: float):
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-8)

    losses = []
    t0 = time.perf_counter()
    c0 = time.process_time()
    model.train()

    def run(phase: str, mix, steps: int, lr_at, opt, rng: random.Random) -> None:
        batches: list[list[int]] = []
        for step in range(steps):
            lr = lr_at(step)
            for g in opt.param_groups:
                g["lr"] = lr
            if not batches:
                batches = _epoch_batches(mix, hp["batch"], rng)
            batch = [mix[i] for i in batches.pop()]
            L = max(len(ids) for ids, _ in batch)
            x = torch.full((len(batch), L), pad_id, dtype=torch.long)
            y = torch.full((len(batch), L), -100, dtype=torch.long)
            for i, (ids, a) in enumerate(batch):
                x[i, : len(ids)] = torch.tensor(ids)
                y[i, a - 1: len(ids) - 1] = torch.tensor(ids[a:])
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                     ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if step % 50 == 0 or step == steps - 1:
                log(f"{which} {phase} step {step} loss {np.mean(losses[-50:]):.4f} lr {lr:.2e} "
                    f"{time.perf_counter() - t0:.0f}s")

    def main_lr(step: int) -> float:
        if step < hp["warmup"]:
            return hp["lr"] * (step + 1) / hp["warmup"]
        frac = (step - hp["warmup"]) / max(1, hp["steps"] - hp["warmup"])
        return hp["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    run("main", data, main_steps, main_lr, adamw(hp["lr"]), random.Random(hp["seed"]))
    if tune:
        rng = random.Random(f"{hp['seed']}/tune")
        mix = list(tune) + rng.sample(list(data), min(len(tune), len(data)))
        run("tune", mix, hp["tune_steps"], lambda step: hp["tune_lr"], adamw(hp["tune_lr"]), rng)
    model.eval()
    info = dict(params=n_params, steps=hp["steps"], tune_steps=hp["tune_steps"] if tune else 0, batch=hp["batch"],
                lr=hp["lr"],
                train_seconds=round(time.perf_counter() - t0, 1), train_cpu_seconds=round(time.process_time() - c0, 1),
                final_loss=round(float(np.mean(losses[-50:])), 4),
                arch=ARCH[which])
    return model, info


def _epoch_batches(data, bs: int, rng: random.Random, pool: int = 8) -> list[list[int]]:
    """One epoch of batches with little padding: shuffle, sort each pool of ``pool`` batches by length, split."""
    order = list(range(len(data)))
    rng.shuffle(order)
    out = []
    for s in range(0, len(order), bs * pool):
        chunk = sorted(order[s: s + bs * pool], key=lambda i: len(data[i][0]))
        out.extend(chunk[j: j + bs] for j in range(0, len(chunk), bs) if len(chunk[j: j + bs]) == bs)
    rng.shuffle(out)
    return out


# ---------------------------------------------------------------------------------------------- export
def save_hf(model, folder: Path, tok_dir: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(str(folder))
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rp = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = float(rp.get("rope_theta", 10000.0))  # mlx-lm reads rope_theta; transformers 5 omits it
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copy(tok_dir / f, folder / f)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF (rotate-half) q/k row order -> llama.cpp (interleaved) order, as convert_hf_to_gguf.py does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.{i}.rest
    return f"blk.{parts[2]}.{GGUF_LAYER['.'.join(parts[3:])]}"


def write_gguf(folder: Path, path: Path, name: str) -> None:
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tj = json.loads((folder / "tokenizer.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    added = {a["content"]: a["id"] for a in tj["added_tokens"]}
    n = cfg["vocab_size"]
    tokens = [None] * n
    for piece, i in {**vocab, **added}.items():
        tokens[i] = piece
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    types = [gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(hd)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(added["<|endoftext|>"])
    w.add_eos_token_id(added["<|im_end|>"])
    w.add_pad_token_id(added["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(tcfg["chat_template"])
    tensors = load_file(str(folder / "model.safetensors"))
    for k in sorted(tensors, key=_tensor_order):
        arr = np.ascontiguousarray(tensors[k].astype(np.float32))
        if k.endswith("q_proj.weight"):
            arr = permute_qk(arr, nh)
        elif k.endswith("k_proj.weight"):
            arr = permute_qk(arr, nkv)
        w.add_tensor(gguf_name(k), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tensor_order(k: str):
    parts = k.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), ".".join(parts[3:]))
    return (0 if "embed" in k else 2, 0, k)


# ---------------------------------------------------------------------------------------------- evaluation
def evaluate(out: Path, n_eval: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from specgrammar_plugins.constraint import ConstraintError
    from specgrammar_plugins.models.reference import default_engine, greedy_generate, teacher_forced_argmax
    from specgrammar_plugins.tokenizer import TokenizerInfo

    hf_tok = load_hf_tokenizer(out)
    target = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(out / "draft"), dtype=torch.float32).eval()
    V = target.config.vocab_size
    tok = TokenizerInfo.from_file(out, vocab_size=V, name="tiny")
    eos = tok.eos_token_id

    def text_of(ids):
        return hf_tok.decode([t for t in ids if t != eos], skip_special_tokens=False)

    res: dict = {"n_eval": n_eval, "workloads": {}}
    agree_hits = agree_total = 0
    for w in W.WORKLOADS:
        exs = W.examples(w, "eval", n_eval)
        spec = W.constraint(w)
        r: dict = {"constraint": None if spec is None else spec.kind}
        t0 = time.perf_counter()
        free_out, free_ids = [], []
        for e in exs:
            p = hf_tok.encode(W.chat_prompt(e.prompt), add_special_tokens=False)
            ids = greedy_generate(target, tok, p, None, max_new_tokens=64)
            free_ids.append(ids)
            free_out.append(text_of(ids))
        r["unconstrained"] = _scores(w, exs, free_out, free_ids, eos)
        r["unconstrained"]["outputs"] = free_out
        r["unconstrained"]["output_ids"] = [" ".join(map(str, i)) for i in free_ids]
        if spec is not None:
            engine = default_engine(spec)
            r["engine"] = engine
            try:
                con_out, con_ids = [], []
                for e in exs:
                    p = hf_tok.encode(W.chat_prompt(e.prompt), add_special_tokens=False)
                    ids = greedy_generate(target, tok, p, spec, engine=engine, max_new_tokens=96)
                    con_ids.append(ids)
                    con_out.append(text_of(ids))
                r["constrained"] = _scores(w, exs, con_out, con_ids, eos)
                r["constrained"]["outputs"] = con_out
                r["constrained"]["output_ids"] = [" ".join(map(str, i)) for i in con_ids]
            except ConstraintError as err:
                r["constrained"] = {"skipped": str(err)}
        # draft/target agreement, teacher-forced along the target's greedy (unconstrained) answers
        hits = total = 0
        for e, ids in zip(exs, free_ids):
            p = hf_tok.encode(W.chat_prompt(e.prompt), add_special_tokens=False)
            seq = p + ids
            ta = teacher_forced_argmax(target, seq)[len(p) - 1: len(seq) - 1]
            da = teacher_forced_argmax(draft, seq)[len(p) - 1: len(seq) - 1]
            hits += int((ta == da).sum())
            total += len(ta)
        r["agreement"] = round(hits / max(1, total), 4)
        r["agreement_tokens"] = total
        agree_hits += hits
        agree_total += total
        r["eval_seconds"] = round(time.perf_counter() - t0, 1)
        res["workloads"][w] = r
        log(w, json.dumps({k: ({kk: vv for kk, vv in v.items() if "outputs" not in kk and "ids" not in kk}
                               if isinstance(v, dict) else v)
                           for k, v in r.items()}))
    res["agreement"] = round(agree_hits / max(1, agree_total), 4)
    res["agreement_tokens"] = agree_total
    res["sampling"] = sampling_overlap(hf_tok, target, draft)
    return res


def sampling_overlap(hf_tok, target, draft, n: int = 20) -> dict:
    """Per "Make up" prompt kind, teacher-forced along ``n`` fresh random answers (another seed than training):
    the target's mean entropy per answer token at T = 1 and the two per-token acceptance rates of a draft position,
    sum(min(p, q)) (accept/residual verification) and sum(p * q) (token matching)."""
    import torch

    out = {}
    docs = invent_documents(30 * n, SEED + 99)
    for kind in ("Make up a code of 6 digits", "Make up an order ID", "Make up a person as JSON"):
        ent, smin, spq, total = 0.0, 0.0, 0.0, 0
        answers = [a for p, a in docs if p == kind][:n]
        p_ids = hf_tok.encode(W.chat_prompt(kind), add_special_tokens=False)
        for a in answers:
            a_ids = hf_tok.encode(a, add_special_tokens=False)
            seq = torch.tensor([p_ids + a_ids])
            with torch.no_grad():
                rows = slice(len(p_ids) - 1, len(p_ids) + len(a_ids) - 1)
                pt = torch.softmax(target(input_ids=seq).logits[0, rows].double(), -1)
                pd = torch.softmax(draft(input_ids=seq).logits[0, rows].double(), -1)
            ent += float(-(pt * torch.log(pt.clamp_min(1e-300))).sum())
            smin += float(torch.minimum(pt, pd).sum())
            spq += float((pt * pd).sum())
            total += len(a_ids)
        out[kind] = {"answers": len(answers), "tokens": total, "target_entropy": round(ent / total, 3),
                     "sum_min_pq": round(smin / total, 3), "sum_p_times_q": round(spq / total, 3)}
        log("sampling", kind, json.dumps(out[kind]))
    return out


def _scores(w: str, exs, outs: list[str], ids: list[list[int]], eos: int) -> dict:
    n = len(exs)
    valid = sum(W.is_valid(w, o) for o in outs)
    exact = sum(o == e.reference for o, e in zip(outs, exs))
    stopped = sum(bool(i) and i[-1] == eos for i in ids)
    return {"valid_rate": round(valid / n, 4), "exact_rate": round(exact / n, 4), "eos_rate": round(stopped / n, 4)}


# ---------------------------------------------------------------------------------------------- main
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=TINY_DIR)
    ap.add_argument("--eval-only", action="store_true", help="re-measure the models in --out, keep the weights")
    ap.add_argument("--n-eval", type=int, default=50)
    ap.add_argument("--target-steps", type=int, default=TRAIN["target"]["steps"])
    ap.add_argument("--draft-steps", type=int, default=TRAIN["draft"]["steps"])
    ap.add_argument("--target-tune-steps", type=int, default=TRAIN["target"]["tune_steps"])
    ap.add_argument("--draft-tune-steps", type=int, default=TRAIN["draft"]["tune_steps"])
    ap.add_argument("--train-n", type=int, default=None, help="training examples per workload (default: all 3000)")
    ap.add_argument("--no-eval", action="store_true", help="skip the evaluation (determinism checks)")
    ap.add_argument("--only-draft", action="store_true", help="retrain the draft only (keep tokenizer and target)")
    ap.add_argument("--tune-only", action="store_true",
                    help="run only the tuning phase on the models in --out (the main runs' weights; development)")
    args = ap.parse_args(argv)
    TRAIN["target"]["steps"], TRAIN["draft"]["steps"] = args.target_steps, args.draft_steps
    TRAIN["target"]["tune_steps"], TRAIN["draft"]["tune_steps"] = args.target_tune_steps, args.draft_tune_steps

    import torch

    torch.set_num_threads(THREADS)
    # (torch.use_deterministic_algorithms is not needed on CPU with a fixed thread count, and costs 2.4x here)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    out: Path = args.out
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if args.eval_only and metrics_path.exists() else {}
    t_all = time.perf_counter()

    if (args.only_draft or args.tune_only) and metrics_path.exists():
        metrics = json.loads(metrics_path.read_text())
    if not args.eval_only:
        train = [e for w in W.WORKLOADS for e in W.examples(w, "train", args.train_n)]
        t0 = time.perf_counter()
        if not (args.only_draft or args.tune_only):
            train_tokenizer(out, [W.training_text(e) for e in train])
            log(f"tokenizer trained in {time.perf_counter() - t0:.1f}s")
        hf_tok = load_hf_tokenizer(out)
        data = encode_examples(hf_tok, train)
        copies = encode_examples(hf_tok, [W.Example("copy", p, None, a) for p, a in copy_documents(COPY_DOCS, SEED)])
        invented = encode_examples(hf_tok, [W.Example("invent", p, None, a)
                                            for p, a in invent_documents(INVENT_DOCS, SEED)])
        lens = [len(d[0]) for d in data]
        log(f"{len(data)} training sequences, length mean {np.mean(lens):.1f} max {max(lens)}")
        ids = {s: hf_tok.convert_tokens_to_ids(s) for s in SPECIALS}
        if not (args.only_draft or args.tune_only):
            metrics = {"seed": SEED, "threads": THREADS, "torch": torch.__version__,
                       "tokenizer": {"vocab_size": VOCAB, "specials": ids, "train_sequences": len(data),
                                     "mean_sequence_tokens": round(float(np.mean(lens)), 1)}}
        for which in (("draft",) if args.only_draft else ("target", "draft")):
            start = None
            if args.tune_only:
                from transformers import AutoModelForCausalLM

                start = AutoModelForCausalLM.from_pretrained(str(out / which), dtype=torch.float32)
            model, info = train_model(which, data + copies if which == "target" else data, VOCAB,
                                      ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"], invented, start)
            if start is not None:  # the main run's figures stay, the tuning phase's time is added
                before = metrics.get(which, {})
                for key in ("train_seconds", "train_cpu_seconds"):
                    info[key] = round(before.get(key, 0.0) + info[key], 1)
                info["final_loss"] = before.get("final_loss", info["final_loss"])
            save_hf(model, out / which, out)
            write_gguf(out / which, out / f"{which}.gguf", f"specgrammar-tiny-{which}")
            info["safetensors_sha256"] = sha256(out / which / "model.safetensors")
            info["gguf_sha256"] = sha256(out / f"{which}.gguf")
            metrics[which] = info
            del model
        metrics["tokenizer"]["tokenizer_json_sha256"] = sha256(out / "tokenizer.json")
    if not args.no_eval:
        metrics["eval"] = evaluate(out, args.n_eval)
        metrics["agreement"] = metrics["eval"]["agreement"]
    metrics["build_seconds"] = round(time.perf_counter() - t_all, 1)
    metrics_path.write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    log(f"wrote {metrics_path}; agreement {metrics.get('agreement')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
