"""Cost-aware laws: exact J on regular constraints, the verifier samples q_lambda exactly, lambda = 0 changes
nothing, and the adaptive controller finishes within budget."""

import zlib
from collections import Counter, deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import outputs_chi2
from specgrammar_plugins import ConstraintSpec, SamplingParams, compile_constraint
from specgrammar_plugins.masks import new_mask
from specgrammar_plugins.cost import RegularCost, StructuralCost, Tilt, make_tilt
from specgrammar_plugins.drafters import ChainDrafter, ForcedDrafter, ModelDrafter
from specgrammar_plugins.loop import generate
from specgrammar_plugins.testing import MarkovRunner, exact_law


def _brute_force_j(tok, compiled, prefix, limit=12):
    """Fewest tokens (stop token included) from the state after ``prefix`` to termination, by BFS over tokens."""
    m = compiled.matcher()
    for t in prefix:
        assert m.accept(t)
    row = new_mask(tok.vocab_size)
    seen = {m.state}
    q = deque([(m, 0)])
    while q:
        cur, d = q.popleft()
        if d > limit:
            return float("inf")
        cur.fill_mask(row)
        from specgrammar_plugins.masks import allowed_ids

        for t in allowed_ids(row, tok.vocab_size):
            if int(t) in tok.stop_token_ids:
                return d + 1
            nxt = cur.fork()
            assert nxt.accept(int(t))
            if nxt.state not in seen:
                seen.add(nxt.state)
                q.append((nxt, d + 1))
    return float("inf")


ATOMS = ["a", "b", "ab", "[0-9]", "[a-c]", "x", r"\.com", "-"]


@st.composite
def small_regex(draw):
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        atom = draw(st.sampled_from(ATOMS))
        q = draw(st.sampled_from(["", "?", "+", "*", "{2}", "{1,3}"]))
        parts.append(f"({atom}){q}")
    if draw(st.booleans()):
        parts = ["(" + "".join(parts) + "|" + draw(st.sampled_from(ATOMS)) + ")"]
    return "".join(parts)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(pattern=small_regex(), walk_seed=st.integers(0, 2**16))
def test_regular_j_matches_brute_force(toy_tok, pattern, walk_seed):
    c = compile_constraint(ConstraintSpec.regex(pattern), toy_tok, engine="dfa")
    cost = RegularCost(c.spec, toy_tok)
    rng = np.random.default_rng(walk_seed)
    m = c.matcher()
    prefix = []
    row = new_mask(toy_tok.vocab_size)
    from specgrammar_plugins.masks import allowed_ids

    for _ in range(6):
        assert cost.cost_to_go(prefix) == _brute_force_j(toy_tok, c, prefix)
        d = cost.delta(prefix)
        m.fill_mask(row)
        ids = [int(t) for t in allowed_ids(row, toy_tok.vocab_size)]
        # Delta >= 0 on allowed tokens, and some allowed token lies on a shortest path (Delta == 0)
        assert min(d[t] for t in ids) == 0 and all(d[t] >= 0 for t in ids)
        t = int(rng.choice([i for i in ids if i not in toy_tok.stop_token_ids] or ids))
        if t in toy_tok.stop_token_ids:
            break
        assert m.accept(t)
        prefix.append(t)


@pytest.mark.parametrize("lam,adaptive", [(0.8, False), (0.0, True)])
def test_verifier_samples_q_lambda_exactly(toy_tok, lam, adaptive):
    """Whole outputs of the speculative loop under a tilt (fixed lambda, or the adaptive controller) follow the
    enumerated law of plain sampling from q_lambda.  Chi-square, expected counts >= 5, p > 0.001, fixed seed."""
    spec = ConstraintSpec.regex(r"(a|b|ab)+-[0-9]")
    c = compile_constraint(spec, toy_tok, engine="dfa")
    prompt = toy_tok.encode("ab")
    params = SamplingParams(temperature=1.0)

    def new_tilt():
        return Tilt(RegularCost(spec, toy_tok), lam=lam, adaptive=adaptive, budget=4 if adaptive else None, eta=1.0)

    law = exact_law(MarkovRunner(toy_tok.vocab_size, seed=9, valid=len(toy_tok.token_bytes)), prompt, c, params, 6,
                    new_tilt())
    assert abs(sum(law.values()) - 1) < 1e-9
    N = 3000
    rng = np.random.default_rng(zlib.crc32(f"{lam}{adaptive}".encode()))
    target = MarkovRunner(toy_tok.vocab_size, seed=9, valid=len(toy_tok.token_bytes))
    draft = MarkovRunner(toy_tok.vocab_size, seed=10, noise_of=target, noise=1.0)
    seen = Counter()
    for _ in range(N):
        drafter = ChainDrafter([ForcedDrafter(toy_tok.encode), ModelDrafter(draft, params, rng)])
        out, st_ = generate(target, prompt, constraint=c, drafter=drafter, k=3, params=params, max_tokens=6, rng=rng,
                            tilt_fn=new_tilt())
        seen[tuple(out)] += 1
    assert set(seen) <= set(law)
    assert outputs_chi2(law, seen, N) > 0.001


def test_lambda_zero_is_the_untilted_path(toy_tok):
    spec = ConstraintSpec.regex(r"[a-z]+@[a-z]+\.com")
    c = compile_constraint(spec, toy_tok, engine="dfa")
    params = SamplingParams(temperature=0.9)
    outs = []
    for tilt in (None, Tilt(RegularCost(spec, toy_tok), lam=0.0)):
        rng = np.random.default_rng(3)
        target = MarkovRunner(toy_tok.vocab_size, seed=3, valid=len(toy_tok.token_bytes))
        draft = MarkovRunner(toy_tok.vocab_size, seed=4, noise_of=target, noise=1.0)
        res = [generate(target, [1, 2], constraint=c, drafter=ModelDrafter(draft, params, rng), k=4, params=params,
                        max_tokens=30, rng=rng, tilt_fn=tilt)[0] for _ in range(20)]
        outs.append(res)
    assert outs[0] == outs[1]
    assert make_tilt(c, lam=0.0, adaptive=False) is None


def test_adaptive_controller_finishes_within_budget(toy_tok):
    """A long regex language, a budget below the untilted typical length: the untilted baseline rarely finishes,
    the controller finishes (valid, complete) in >= 99% of runs."""
    spec = ConstraintSpec.regex(r"[a-z]{2,40}@[a-z]{2,40}\.com")
    c = compile_constraint(spec, toy_tok, engine="dfa")
    params = SamplingParams(temperature=1.0)
    budget = 12
    import re

    results = {}
    for mode in ("untilted", "adaptive"):
        ok = 0
        lams = []
        for seed in range(100):
            rng = np.random.default_rng(seed)
            target = MarkovRunner(toy_tok.vocab_size, seed=11, valid=len(toy_tok.token_bytes), scale=1.0)
            tilt = make_tilt(c, adaptive=True, max_tokens=budget) if mode == "adaptive" else None
            out, st_ = generate(target, [1], constraint=c, params=params, max_tokens=budget, rng=rng, tilt_fn=tilt)
            text = toy_tok.decode([t for t in out if t not in toy_tok.stop_token_ids]).decode()
            if st_.finish_reason == "stop" and re.fullmatch(spec.value, text):
                ok += 1
            if tilt is not None:
                lams.append(st_.cost["lambda_max"])
        results[mode] = ok
    assert results["untilted"] < 50, results
    assert results["adaptive"] >= 99, results


def test_structural_cost_estimate(toy_tok):
    spec = ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    cost = StructuralCost(toy_tok, spec)
    enc = toy_tok.encode
    assert cost.cost_to_go([]) > cost.cost_to_go(enc('{"a":"x'))
    assert cost.cost_to_go(enc('{"a":"x"}')) == 1  # only the stop token left
    j_open = cost.cost_to_go(enc("{"))
    # stop + close brace + one missing required property, at its cheapest spelling in this tokenizer
    assert j_open == 1 + 1 + cost.key_cost["a"] and cost.key_cost["a"] == len(enc(', "a": ""'))
    d = cost.delta(enc('{"a":"x"'))
    assert d[toy_tok.token_bytes.index(b"}")] < d[toy_tok.token_bytes.index(b",")]


# ------------------------------------------------------------------------------ regular forms of CFG constraints
def _shortest_walk(cost, tok, limit=200):
    """Follow Delta == 0 tokens (ties: lowest id) from the start; (tokens, J0)."""
    out, j0 = [], cost.cost_to_go([])
    for _ in range(limit):
        d = cost.delta(out)
        t = int(np.argmin(d))
        assert d[t] == 0.0
        if t in tok.stop_token_ids:
            return out, j0
        out.append(t)
    raise AssertionError("no end")


@pytest.mark.parametrize("workload", ["json_extraction", "tool_call", "sql"])
def test_cfg_workloads_get_the_exact_cost_and_its_shortest_way_is_valid(workload):
    """JSON Schemas without recursion and GBNF without recursion are regular: J is exact there.  Following the
    Delta = 0 tokens from the start gives an output of exactly J0 - 1 tokens (+ stop) that the real engine
    accepts and the workload's validator passes; J never exceeds what a reference answer still needs."""
    from specgrammar_plugins import workloads as W
    from specgrammar_plugins.cost import cost_model_for
    from specgrammar_plugins.models import tiny_tokenizer_info

    tok = tiny_tokenizer_info()
    spec = W.constraint(workload)
    compiled = compile_constraint(spec, tok)
    cost = cost_model_for(compiled)
    assert isinstance(cost, RegularCost) and cost.fallback is not None
    walk, j0 = _shortest_walk(cost, tok)
    assert len(walk) + 1 == j0
    m = compiled.matcher()
    for t in walk + [min(tok.stop_token_ids)]:
        assert m.accept(t)
    assert m.is_terminated()
    assert W.is_valid(workload, bytes(tok.decode(walk)).decode("utf-8"))
    for ex in W.examples(workload, "eval", 5):
        ids = tok.encode(ex.reference)
        for i in range(len(ids) + 1):
            assert cost.cost_to_go(ids[:i]) <= len(ids) - i + 1


def test_leaving_the_regular_sub_language_falls_back_to_the_estimate(toy_tok):
    from specgrammar_plugins.cost import cost_model_for

    spec = ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                                       "additionalProperties": False})
    cost = cost_model_for(compile_constraint(spec, toy_tok, engine="llguidance"))
    assert isinstance(cost, RegularCost)
    inside = toy_tok.encode('{"a": "x')
    outside = toy_tok.encode('{\n  "a": "x')  # the engine allows the newline; outlines' regex does not
    assert cost._state(inside) is not None and cost._state(outside) is None
    j = cost.cost_to_go(outside)
    assert j == cost.fallback.cost_to_go(outside) and np.isfinite(j)
    d_in = cost.delta(inside)
    # inside, a token outside the sub-language is discouraged (Delta >= 1) but not forbidden like masked ones
    nl = toy_tok.token_bytes.index(b"\n") if b"\n" in toy_tok.token_bytes else None
    if nl is not None:
        assert 1.0 <= d_in[nl] < 1e6


def test_gbnf_to_regex():
    import re

    from specgrammar_plugins import workloads as W
    from specgrammar_plugins.gbnf import to_regex

    r = to_regex(W.SQL_GBNF)
    samples = ["SELECT * FROM users;", "SELECT a, b FROM t WHERE x = 'ab c' AND y >= 3 ORDER BY a DESC LIMIT 5;",
               "SELECT FROM x;", "SELECT * FROM users WHERE age < 3", "SELECT * FROM t LIMIT ;", "SELECT *  FROM t;"]
    for s in samples:
        assert bool(re.fullmatch(r, s)) == bool(re.fullmatch(W.SQL_REGEX, s)), s
    assert to_regex('root ::= "a" root | "b"') is None  # recursion: not regular by construction
    assert to_regex('root ::= x\nx ::= "(" x ")" | ""') is None
    assert to_regex('root ::= undefined') is None
    r2 = to_regex('root ::= [a-c\\-]{2,3} "\\x41\\n" ("." | [^x])? # comment\n')
    for s, ok in [("ab-A\n", True), ("a-A\n", True), ("aA\n", False), ("abcA\n.", True), ("abcA\nx", False),
                  ("abcdA\n", False)]:
        assert bool(re.fullmatch(r2, s)) == ok, s
