"""Recipe packs on the toy tokenizer and the numpy Markov runner: format (hash, version, tokenizer), indexes,
merge, pruning, miss log, the online suffix index, the drafter factories, and losslessness (greedy equality
token for token; exact output law at T > 0 by chi-square against the enumerated law)."""

import json
import zlib
from collections import Counter

import numpy as np
import pytest

from conftest import available_engines, outputs_chi2
from specgrammar_plugins import ConstraintSpec, SamplingParams, compile_constraint
from specgrammar_plugins.distributions import GREEDY
from specgrammar_plugins.drafters import (ChainDrafter, DraftContext, ForcedDrafter, ModelDrafter, RecipeDrafter,
                                          SuffixDrafter, build_chain, observe)
from specgrammar_plugins.loop import SpeculativeLoop, generate
from specgrammar_plugins.recipes import (ALPHA, NUM, MissLog, Recipe, RecipePack, RecipePackError, Sample,
                                         SuffixIndex, build, class_table, load_pack, merge, shape_of)
from specgrammar_plugins.recipes_cli import benchmark_lookup, sample
from specgrammar_plugins.testing import MarkovRunner, exact_law, plain_decode

ENGINES = available_engines()
RECORD = r'\{"id": [0-9]+, "name": "[a-z]+"\}'


class Ex:
    def __init__(self, prompt, constraint):
        self.prompt, self.constraint, self.workload = prompt, constraint, "toy"


def _runner(tok, seed=1, scale=4.0):
    return MarkovRunner(tok.vocab_size, seed=seed, valid=len(tok.token_bytes), scale=scale)


@pytest.fixture(scope="module")
def toy_pack(toy_tok):
    spec = ConstraintSpec.regex(RECORD)
    exs = [Ex(p, spec) for p in ("ab", "ba", "abc", "cab", "xy", "q")]
    samples = sample(_runner(toy_tok), toy_tok, exs, k=4, temperature=0.7, max_tokens=40, engine="dfa",
                     prompt_fn=lambda s: s, progress=False, self_draft=2)
    return build(samples, toy_tok, min_count=2, agree=0.9)


def _enc(tok, text):
    return tok.encode(text)


# ------------------------------------------------------------------------------------------- format
def test_roundtrip_is_stable_and_hashed(toy_pack, toy_tok, tmp_path):
    assert len(toy_pack) > 10 and toy_pack.stats()["literal"] > 0
    p = toy_pack.save(tmp_path / "a.json")
    raw = p.read_bytes()
    back = RecipePack.load(p, toy_tok)
    assert back.to_dict() == toy_pack.to_dict()
    assert back.save(tmp_path / "b.json").read_bytes() == raw  # stable bytes
    d = json.loads(raw)
    assert d["format"] == "specgrammar-recipes" and d["version"] == 1 and len(d["sha256"]) == 64
    assert d["tokenizer"]["fingerprint"] == toy_tok.vocab_fingerprint
    keys = [(r["kind"], len(r["key"])) for r in d["recipes"]]
    assert keys == sorted(keys, key=lambda k: (("literal", "shape").index(k[0]), k[1]))  # stable ordering
    assert all("text" in r for r in d["recipes"])  # human-inspectable
    # every lookup agrees after the round trip
    for s in ([1, 2, 70], _enc(toy_tok, '{"id": 12, "na'), _enc(toy_tok, '{"id": 1')):
        assert back.lookup(s) == toy_pack.lookup(s)


def test_corrupted_and_mismatched_packs_name_the_file(toy_pack, toy_tok, tmp_path):
    p = toy_pack.save(tmp_path / "pack.json")
    d = json.loads(p.read_text())
    # 1. a changed recipe: the content hash no longer matches
    d2 = json.loads(p.read_text())
    d2["recipes"][0]["run"] = [d2["recipes"][0]["run"][0] ^ 1]
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps(d2))
    with pytest.raises(RecipePackError, match=r"tampered\.json is corrupted: content hash"):
        RecipePack.load(bad)
    # 2. truncated file: not JSON
    trunc = tmp_path / "trunc.json"
    trunc.write_bytes(p.read_bytes()[:200])
    with pytest.raises(RecipePackError, match=r"trunc\.json is corrupted: not valid JSON"):
        RecipePack.load(trunc)
    # 3. another format version
    d3 = dict(d, version=99)
    v = tmp_path / "v99.json"
    v.write_text(json.dumps(d3))
    with pytest.raises(RecipePackError, match=r"v99\.json has format version 99; this build reads version 1"):
        RecipePack.load(v)
    # 4. not a pack at all
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(RecipePackError, match=r"other\.json is not a recipe pack"):
        RecipePack.load(other)
    # 5. missing file
    with pytest.raises(RecipePackError, match=r"missing\.json: cannot read"):
        RecipePack.load(tmp_path / "missing.json")
    # 6. a pack for another tokenizer
    from dataclasses import replace

    different = replace(toy_tok, token_bytes=toy_tok.token_bytes[:-1] + (b"zz",))
    with pytest.raises(RecipePackError, match=r"pack\.json was built for tokenizer 'toy'.*rebuild"):
        RecipePack.load(p, different)
    # the factory checks the request's tokenizer too
    with pytest.raises(RecipePackError, match="fingerprint"):
        build_chain(["recipe"], DraftContext(tokenizer=different, recipe=str(p)))


# ------------------------------------------------------------------------------------------- indexes
def _toy_samples(tok, outputs, prompt="::"):
    return [Sample(tuple(tok.encode(prompt)), tuple(tok.encode(o)) + (tok.eos_token_id,)) for o in outputs]


def test_literal_longest_first_shape_and_blockers(toy_tok):
    tok = toy_tok
    outs = ['{"id": 12, "name": "ab"}', '{"id": 7, "name": "ba"}', '{"id": 31, "name": "zq"}',
            '{"id": 5, "name": "abc"}', '{"id": 99, "name": "k"}']
    pack = build(_toy_samples(tok, outs), tok, min_count=2, agree=1.0)
    # literal: right after the prompt the model always opens the record with {"id":
    run = pack.lookup(tok.encode("::"))
    assert tok.decode(run).startswith(b'{"id": ')
    # the value is not deterministic: no recipe inside it (a number token follows "id": )
    assert pack.lookup(tok.encode('::{"id": ')) is None
    # shape: after an unseen number the model still decides whether more digits follow (no recipe), but once
    # it wrote the comma the next key is known whatever the number was
    ctx = tok.encode('::{"id": 4')  # 4 never followed "id": in the samples
    assert pack.lookup(ctx) is None
    run = pack.lookup(tok.encode('::{"id": 4,'))
    assert run is not None and tok.decode(run).startswith(b' "name": "'), tok.decode(run or [])
    # shape of an unseen name value: once it is closed, the brace and EOS follow
    ctx = tok.encode('::{"id": 4, "name": "xyz"')
    run = pack.lookup(ctx)
    assert run is not None and tok.decode(run) == b"}" and run[-1] == tok.eos_token_id
    rec = pack.match(ctx)
    assert rec is not None and rec.kind == "shape" and ALPHA in rec.key
    # classes: digits and letters abstract, all-capital keywords and punctuation stay literal
    cls = class_table(tok.token_bytes)
    assert cls[tok.encode("12")[0]] == NUM and cls[tok.encode("ab")[0]] == ALPHA
    assert cls[tok.encode("{")[0]] == tok.encode("{")[0]
    assert shape_of(tok.encode("ab12cd"), cls) == [ALPHA, NUM, ALPHA]


def test_blocker_stops_a_shorter_recipe(toy_tok):
    tok = toy_tok
    # after "x" the model mostly writes "y" (8 of 10, over the 0.75 agreement bar) ... but after "qx" it varies
    outs = ["axy"] * 4 + ["bxy"] * 4 + ["qxa", "qxb"]
    pack = build(_toy_samples(tok, outs, prompt="-"), tok, min_count=2, agree=0.75, shapes=False)
    assert pack.lookup(tok.encode("-ax"))[:1] == tuple(tok.encode("y"))
    assert pack.lookup(tok.encode("-qx")) is None
    assert pack.stats()["blockers"] >= 1


def test_merge_prune_and_bounds(toy_tok):
    tok = toy_tok
    a = RecipePack([Recipe("literal", (1, 2), (3, 4, 5), 10), Recipe("literal", (7,), (8,), 5),
                    Recipe("literal", (9,), (10,), 3)], fingerprint=tok.vocab_fingerprint, tokenizer=tok)
    b = RecipePack([Recipe("literal", (1, 2), (3, 4, 6), 6), Recipe("literal", (7,), (9,), 1),
                    Recipe("literal", (9,), (11,), 3), Recipe("shape", (ALPHA, 5), (6,), 4)],
                   fingerprint=tok.vocab_fingerprint, tokenizer=tok)
    m = merge(a, b, agree=0.8)
    assert m.recipes[("literal", (1, 2))].run == (3, 4) and m.recipes[("literal", (1, 2))].count == 16
    assert m.recipes[("literal", (7,))].run == (8,)  # 5 of 6 agree: the majority holds
    assert m.recipes[("literal", (9,))].run == ()  # 3 vs 3: a blocker, the model is not deterministic here
    assert m.lookup([0, 9]) is None
    assert ("shape", (ALPHA, 5)) in m.recipes
    assert m.lookup([1, 2]) == (3, 4)
    dropped = m.prune(2)
    assert dropped == 2 and len(m) == 2 and ("literal", (1, 2)) in m.recipes  # most used kept
    with pytest.raises(RecipePackError, match="different tokenizers"):
        merge(a, RecipePack([], fingerprint="other"))
    # the size bound at build time
    big = build(_toy_samples(tok, [f'{{"id": {i}, "name": "ab"}}' for i in range(40)]), tok, min_count=2,
                max_recipes=5)
    assert len(big) == 5 and big.meta["pruned"] > 0


def test_misslog_is_folded_into_a_later_build(toy_tok, tmp_path):
    tok = toy_tok
    pack = build(_toy_samples(tok, ["abab", "abab", "abab"]), tok, min_count=2)
    log = MissLog(tmp_path / "misses.jsonl", min_missed=1)
    new = tok.encode("zyx-1")
    prompt = tok.encode("qq")
    for _ in range(3):
        d = RecipeDrafter(pack, misslog=log, unconstrained=True)
        d.lookups, d.hits = 5, 0  # as after a request the pack had nothing for
        observe(d, [*prompt, *new], len(prompt))
    with open(log.path, "a") as f:
        f.write('{"prompt": [1, 2], "outp')  # a torn line is skipped
    assert len(log.samples()) == 3
    assert pack.lookup(tok.encode("qqz")) is None
    rebuilt = build(_toy_samples(tok, ["abab", "abab", "abab"]), tok, min_count=2, extra=log.samples())
    assert rebuilt.lookup(tok.encode("qqz")) == tuple(new[1:])


def test_suffix_index_learns_online_and_is_bounded(toy_tok):
    tok = toy_tok
    idx = SuffixIndex(max_tokens=60, min_key=2)
    seq = tok.encode("ab") + tok.encode('{"id": 12, "name": "x"}')
    assert idx.lookup(seq[:8]) is None
    idx.observe(seq, 2)
    assert idx.lookup(seq[:8]) is None  # seen once: min_support=2 occurrences must agree
    idx.observe(seq, 2)
    assert idx.lookup(seq[:8]) == tuple(seq[8:])
    assert idx.lookup(seq[:8], budget=3) == tuple(seq[8:11])
    for i in range(20):  # older sequences are forgotten once more than max_tokens are held
        idx.observe(tok.encode(f"zz{i}-abcdefghij"), 2)
    assert len(idx._seqs) < 22
    assert idx.lookup(seq[:8]) is None
    assert idx._held <= 60 + 20
    # the drafter and the factory
    d = build_chain(["suffix"], DraftContext(tokenizer=tok, options={"suffix_index": SuffixIndex()}))
    assert isinstance(d, SuffixDrafter)


def test_factories_and_chain_order(toy_pack, toy_tok, tmp_path):
    tok = toy_tok
    assert build_chain(["recipe"], DraftContext(tokenizer=tok)) is None  # no pack, no drafter
    d = build_chain(["forced", "recipe", "model"], DraftContext(tokenizer=tok, recipe=toy_pack))
    assert isinstance(d, ChainDrafter) and [x.name for x in d.drafters] == ["forced", "recipe"]
    p = toy_pack.save(tmp_path / "p.json")
    d = build_chain(["recipe"], DraftContext(tokenizer=tok, recipe=str(p)))
    assert isinstance(d, RecipeDrafter) and d.pack.bound
    with pytest.raises(RecipePackError, match="not found"):
        load_pack("no-such-pack")
    from specgrammar_plugins.requests import DEFAULT_DRAFTERS

    assert DEFAULT_DRAFTERS.index("forced") < DEFAULT_DRAFTERS.index("recipe") < DEFAULT_DRAFTERS.index("model")


def test_no_drafts_without_a_grammar(toy_pack, toy_tok):
    """Free prose: the recipe drafter proposes nothing, so decoding is plain decoding (one pass per token)."""
    target = _runner(toy_tok)
    out, st = generate(target, toy_tok.encode("ab"), drafter=RecipeDrafter(toy_pack), k=8, params=GREEDY,
                       max_tokens=12, seed=0, stop_token_ids=toy_tok.stop_token_ids)
    assert st.drafted == 0 and st.target_passes == len(out)


def test_lookup_benchmark_runs(toy_pack, toy_tok):
    r = benchmark_lookup(toy_pack, [toy_tok.encode('ab{"id": 12, "name": "ab')] * 3, repeat=1)
    assert r["calls"] == 3 and r["median_us"] > 0  # the figure is reported by the benchmark, not asserted here


# ------------------------------------------------------------------------------------------- lossless
def _wrong_pack(tok, seed=0):
    """A pack that proposes plausible-looking but mostly wrong runs everywhere."""
    rng = np.random.default_rng(seed)
    n = len(tok.token_bytes)
    recs = [Recipe("literal", (t,), tuple(int(x) for x in rng.integers(1, n, size=4)), 1) for t in range(n)]
    return RecipePack(recs, fingerprint=tok.vocab_fingerprint, tokenizer=tok)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("pattern", [RECORD, r"[0-9]{4}", r"(ab|ba)+(\.com)?"])
def test_greedy_with_recipes_equals_plain(toy_pack, toy_tok, engine, pattern):
    c = compile_constraint(ConstraintSpec.regex(pattern), toy_tok, engine=engine)
    for seed, pack in ((1, toy_pack), (1, _wrong_pack(toy_tok)), (3, toy_pack)):
        for prompt in (toy_tok.encode("ab"), toy_tok.encode("xy")):
            ref = plain_decode(_runner(toy_tok, seed), prompt, c.matcher(), GREEDY, 30, np.random.default_rng(0),
                               toy_tok.stop_token_ids)
            for k in (1, 4, 16):
                rng = np.random.default_rng(k)
                target = _runner(toy_tok, seed)
                draft = MarkovRunner(toy_tok.vocab_size, seed=seed + 9, noise_of=target, noise=1.0)
                for chain in ([RecipeDrafter(pack)],
                              [ForcedDrafter(toy_tok.encode), RecipeDrafter(pack), ModelDrafter(draft, GREEDY, rng)]):
                    loop = SpeculativeLoop(target, prompt, constraint=c, drafter=ChainDrafter(chain), k=k,
                                           params=GREEDY, max_tokens=30, rng=rng)
                    assert loop.generate() == ref, (engine, pattern, seed, k)
                    assert loop.stats.target_passes <= len(ref)


def test_recipes_save_passes_on_their_own_workload(toy_pack, toy_tok):
    c = compile_constraint(ConstraintSpec.regex(RECORD), toy_tok, engine="dfa")
    out, st = generate(_runner(toy_tok), toy_tok.encode("ab"), constraint=c, drafter=RecipeDrafter(toy_pack), k=16,
                       params=GREEDY, max_tokens=40, seed=0)
    assert st.accepted_by_source.get("recipe", 0) > 0 and st.target_passes < len(out)


@pytest.mark.parametrize("temperature", [0.8, 1.3])
def test_law_with_recipes_matches_plain_sampling(toy_tok, temperature):
    """The output law with recipe drafts (a pack built from this model's own samples, so its runs are often
    right and sometimes wrong) equals the enumerated law of plain constrained sampling.  Chi-square over outputs
    with expected count >= 5 (the rest pooled), N = 3000, reject at p < 0.001."""
    tok = toy_tok
    c = compile_constraint(ConstraintSpec.regex(r"(a|b|ab)(a|ba)?-[0-9]"), tok, engine="dfa")
    prompt = tok.encode("ab")
    params = SamplingParams(temperature=temperature)
    law = exact_law(_runner(tok, 5, 2.0), prompt, c, params, 8)
    assert abs(sum(law.values()) - 1) < 1e-9
    rng = np.random.default_rng(zlib.crc32(f"recipes-{temperature}".encode()))
    target = _runner(tok, 5, 2.0)
    samples = sample(target, tok, [Ex("ab", c.spec)], k=40, temperature=temperature, max_tokens=8, engine="dfa",
                     prompt_fn=lambda s: s, progress=False, self_draft=0)
    pack = build(samples, tok, min_count=2, agree=0.6)
    assert len(pack) > 0
    N = 3000
    seen: Counter = Counter()
    drafted = accepted = 0
    for _ in range(N):
        out, st = generate(target, prompt, constraint=c, drafter=ChainDrafter([RecipeDrafter(pack)]), k=4,
                           params=params, max_tokens=8, rng=rng)
        seen[tuple(out)] += 1
        drafted += st.drafted
        accepted += st.accepted
    assert drafted > 0 and 0 < accepted < drafted  # recipes were proposed, and some were rejected
    assert set(seen) <= set(law), "the loop produced an output plain sampling cannot"
    assert outputs_chi2(law, seen, N) > 0.001


# ------------------------------------------------------------------------------------------- CLI
def test_cli_inspect_and_merge(toy_pack, tmp_path, capsys):
    from specgrammar_plugins.recipes_cli import main

    a = toy_pack.save(tmp_path / "a.json")
    assert main(["inspect", str(a), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert '"recipes"' in out and "literal" in out
    assert main(["merge", str(a), str(a), "-o", str(tmp_path / "m.json")]) == 0
    m = RecipePack.load(tmp_path / "m.json")
    assert set(m.recipes) == set(toy_pack.recipes)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["inspect", str(bad)]) == 2
    assert "bad.json is corrupted" in capsys.readouterr().err


def test_online_suffix_drafts_are_lossless_and_learn(toy_tok):
    tok = toy_tok
    c = compile_constraint(ConstraintSpec.regex(RECORD), tok, engine="dfa")
    idx = SuffixIndex()
    accepted = 0
    for i in range(8):
        prompt = tok.encode(["ab", "xy", "q"][i % 3])
        ref = plain_decode(_runner(tok), prompt, c.matcher(), GREEDY, 30, np.random.default_rng(0),
                           tok.stop_token_ids)
        d = build_chain(["forced", "suffix"], DraftContext(tokenizer=tok, options={"suffix_index": idx}))
        loop = SpeculativeLoop(_runner(tok), prompt, constraint=c, drafter=d, k=8, params=GREEDY, max_tokens=30,
                               seed=0)
        assert loop.generate() == ref  # the loop tells the drafter the finished request (drafters.observe)
        accepted += loop.stats.accepted_by_source.get("suffix", 0)
    assert idx.observed == 8 and accepted > 0


def test_copy_recipes_draft_values_from_the_prompt(toy_tok):
    """Where the model copies a value from the request (here: the digits after the prompt's "-"), the pack learns
    a copy recipe instead of a token run, and the drafter proposes the prompt's tokens."""
    tok = toy_tok
    from specgrammar_plugins.recipes import COPY

    samples = []
    for v in ("4821", "7305", "1969", "5550", "8214", "6093"):
        samples.append(Sample(tuple(tok.encode(f"id-{v}.")), tuple(tok.encode(f"x{v}")) + (tok.eos_token_id,)))
    pack = build(samples, tok, min_count=2)
    assert pack.stats()["copy"] >= 1
    ctx = tok.encode("id-3141.") + tok.encode("x3")
    run = pack.lookup(ctx)
    assert run is not None and run[0] == COPY
    c = compile_constraint(ConstraintSpec.regex(r"x[0-9]{4}"), tok, engine="dfa")
    from specgrammar_plugins.block import DraftBlock

    m = c.matcher()
    for t in tok.encode("x3"):
        assert m.accept(t)
    block = DraftBlock(ctx, m, tok.vocab_size, 8, tok.stop_token_ids)
    assert RecipeDrafter(pack).extend(block, 8) >= 3
    assert tok.decode(block.tokens).startswith(b"141")
    # copy runs survive the file format and merging
    back = RecipePack.from_dict(json.loads(pack.to_json_bytes()), tokenizer=tok)
    assert back.lookup(ctx) == run
    assert merge(pack, back).lookup(ctx)[0] == COPY


def test_number_copies_draft_the_prompts_number_where_the_answer_opens_with_it(toy_tok):
    """An answer that opens with the request's number has no context to anchor a copy on (``copy_source``), and the
    training answers' digits agree on a literal run (five of six years begin with "1"): the pack learns a number
    copy there instead (``COPY_NUMBER``: the prompt's longest digit run, not the shorter count after it), and the
    drafter proposes the new request's year, "2005".  The run survives the file format and merging, and drafting
    with it keeps greedy output equal to plain decoding."""
    tok = toy_tok
    from specgrammar_plugins.block import DraftBlock
    from specgrammar_plugins.recipes import COPY_NUMBER, number_span

    samples = [Sample(tuple(tok.encode(f"in {y} for {n} k.")), tuple(tok.encode(y)) + (tok.eos_token_id,))
               for y, n in (("1938", "41"), ("1851", "7"), ("1902", "66"), ("1777", "12"), ("1969", "3"),
                            ("2015", "90"))]
    pack = build(samples, tok, min_count=2)
    assert pack.stats()["copy_number"] >= 1
    prompt = tok.encode("in 2005 for 41 k.")
    assert tok.decode(prompt[slice(*number_span(prompt, class_table(tok.token_bytes, tok.vocab_size)))]) == b"2005"
    run = pack.lookup(prompt)
    assert run is not None and run[0] == COPY_NUMBER
    c = compile_constraint(ConstraintSpec.regex(r"[0-9]{4}"), tok, engine="dfa")
    block = DraftBlock(prompt, c.matcher(), tok.vocab_size, 8, tok.stop_token_ids, prompt_len=len(prompt))
    assert RecipeDrafter(pack).extend(block, 8) >= 1
    assert tok.decode(block.tokens) == b"2005"
    back = RecipePack.from_dict(json.loads(pack.to_json_bytes()), tokenizer=tok)
    assert back.lookup(prompt) == run
    assert merge(pack, back).lookup(prompt)[0] == COPY_NUMBER
    ref = plain_decode(_runner(tok), prompt, c.matcher(), GREEDY, 12, np.random.default_rng(0), tok.stop_token_ids)
    d = build_chain(["forced", "recipe"], DraftContext(tokenizer=tok, recipe=pack))
    loop = SpeculativeLoop(_runner(tok), prompt, constraint=c, drafter=d, k=4, params=GREEDY, max_tokens=12, seed=0)
    assert loop.generate() == ref


def test_cli_build_answers_under_the_offline_deadline(tmp_path, monkeypatch):
    """``recipes build`` learns from the model's own answers whatever the machine's load: each request's preparation
    deadline is the offline one (a server's 5 s let a loaded machine's certified bound shape the sql pack's
    answers), unless SPECGRAMMAR_PREPARE_TIMEOUT_S names one."""
    from specgrammar_plugins.bounds import BOUNDS
    from specgrammar_plugins.recipes_cli import OFFLINE_PREPARE_S, main

    monkeypatch.setattr(BOUNDS, "prepare_timeout_s", 5.0)
    monkeypatch.delenv("SPECGRAMMAR_PREPARE_TIMEOUT_S", raising=False)
    out = tmp_path / "year.json"
    assert main(["build", "-w", "year", "-n", "1", "-k", "1", "--max-tokens", "8", "-o", str(out), "-q"]) == 0
    assert RecipePack.load(out).meta["workloads"] == ["year"]
    assert BOUNDS.prepare_timeout_s == OFFLINE_PREPARE_S
    monkeypatch.setattr(BOUNDS, "prepare_timeout_s", 5.0)
    monkeypatch.setenv("SPECGRAMMAR_PREPARE_TIMEOUT_S", "5")  # the operator's own limit is kept
    assert main(["build", "-w", "year", "-n", "1", "-k", "1", "--max-tokens", "8", "-o", str(out), "-q"]) == 0
    assert BOUNDS.prepare_timeout_s == 5.0
