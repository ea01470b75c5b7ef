"""Valid-looking requests whose cost was unbounded (issue 33), driven through the core's request gate and the
preparation a host runs after it (``gate.check_request``, ``compile_constraint``, ``check_budget``) under one
``bounds.prepare_deadline``.  Each must get its clear error (or its correct answer) within the deadline + 1 s.
The inputs that once took the machine's memory run in a child process with an address-space rlimit, so that a
regression fails the test instead of killing the test machine, and report the child's peak RSS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from specgrammar_plugins import ConstraintError, ConstraintSpec, compile_constraint
from specgrammar_plugins.requests import SpecOptions
from specgrammar_plugins.bounds import gbnf_shortest, prepare_deadline
from specgrammar_plugins.bounds import BOUNDS as LIMITS
from specgrammar_plugins.errors import BudgetError, RequestError, SpecGrammarError
from specgrammar_plugins.gate import Host, check_request
from specgrammar_plugins.speculation import check_budget
from specgrammar_plugins.tokenizer import TokenizerInfo

M = [{"role": "user", "content": "hi"}]
PIECES = [b""] + [bytes([c]) for c in range(32, 127)] + [b"\n", b"ab", b"aa", b'{"', b'":', b'",']
TOK = TokenizerInfo(tuple(PIECES), 0, (0,), 128, frozenset({0}), None, None, "ascii128")
HOST = Host("the test server", context_length=4096, max_token_bytes=2, vocab_size=128, count_tokens=lambda b: 8)
SLACK_S = 1.0

DOUBLING = "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(40)) + '\nr40 ::= "a"'
CHAIN = "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(3000)) + '\nr3000 ::= "b"'


def prepare(body: dict):
    """What a host does with a request before its first token: the gate, the compile, the budget."""
    with prepare_deadline():
        checked = check_request(body, HOST)
        if checked.spec is None:
            return None, None
        compiled = compile_constraint(checked.spec, TOK, engine="auto")
        return compiled, check_budget(compiled, checked.options, checked.max_tokens)


def schema(s: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}


@pytest.fixture(scope="module", autouse=True)
def warm():
    """The engines' imports and per-tokenizer tables (seconds: a server does this at start-up)."""
    for engine in ("xgrammar", "llguidance"):
        compile_constraint(ConstraintSpec.regex("[ab]"), TOK, engine=engine)


def in_time(wall: float, cpu: float) -> None:
    """Answered within the deadline + 1 s: its CPU limit (this process's CPU, or the wall-clock time where that is
    less) and its wall-clock backstop (``bounds.Deadline``: a loaded machine stretches the wall-clock time alone)."""
    assert min(wall, cpu) < LIMITS.prepare_timeout_s + SLACK_S, f"answered after {wall:.1f} s, {cpu:.1f} s of CPU"
    assert wall < LIMITS.wall_s() + SLACK_S, f"answered after {wall:.1f} s"


def answered(body: dict, error=SpecGrammarError, match: str | None = None):
    t, c = time.monotonic(), time.process_time()
    if error is None:
        out = prepare(body)
    else:
        with pytest.raises(error, match=match) as e:
            prepare(body)
        out = e.value
    in_time(time.monotonic() - t, time.process_time() - c)
    return out


# ------------------------------------------------------------------------------------------- in a child, rlimited
CHILD = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    sys.path.insert(0, {tests!r})
    import test_hostile_cost as t
    body = json.loads(sys.argv[1])
    for engine in ("xgrammar", "llguidance"):  # the engines' imports (seconds on a loaded machine) are not the request's
        try:
            __import__(engine)
        except ImportError:
            pass
    t0, c0 = time.monotonic(), time.process_time()
    try:
        t.prepare(body)
        out = "ok"
    except Exception as e:
        out = type(e).__name__ + ": " + str(e)
    s, cpu = time.monotonic() - t0, time.process_time() - c0
    # The peak RSS of this process's own memory (VmHWM).  Not getrusage's ru_maxrss: Linux carries that across
    # execve from the parent (a pytest process holding 5 GB reported 5 GB here in a CI run).
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({{"s": s, "cpu": cpu, "rss_mb": hwm_kb / 1024, "out": out}}))
""")


def in_child(body: dict) -> dict:
    code = CHILD.format(tests=os.path.dirname(__file__))
    p = subprocess.run([sys.executable, "-c", code, json.dumps(body)], capture_output=True, text=True,
                       timeout=LIMITS.prepare_timeout_s + 60)  # (the child's imports are not the request's)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name, body, words", [
    ("40 doubling GBNF rules (2^40 bytes forced)", {"grammar": DOUBLING}, "SPECGRAMMAR_MAX_FORCED_BYTES"),
    ("40 doubling Lark rules", {"grammar": "start: r0\n" + "\n".join(f"r{i}: r{i + 1} r{i + 1}" for i in range(40))
                                + '\nr40: "a"', "grammar_syntax": "lark"}, "SPECGRAMMAR_MAX_FORCED_BYTES"),
    ("40 doubling EBNF rules", {"grammar": DOUBLING, "grammar_syntax": "ebnf"}, "SPECGRAMMAR_MAX_FORCED_BYTES"),
    ("minItems 10^9", schema({"type": "array", "items": {"type": "integer"}, "minItems": 1000000000}),
     "SPECGRAMMAR_MAX_ITEMS"),
    ("maxItems 10^9", schema({"type": "array", "items": {"type": "integer"}, "maxItems": 1000000000}),
     "SPECGRAMMAR_MAX_ITEMS"),
])
def test_memory_bombs_are_refused_before_any_work(name, body, words):
    r = in_child({"messages": M, "max_tokens": 16, **body})
    assert words in r["out"] and "ConstraintError" in r["out"], r
    in_time(r["s"], r["cpu"])
    assert r["rss_mb"] < 1024, r  # the child's whole RSS (Python, numpy and the engines): nothing was expanded


@pytest.mark.parametrize("body, words", [
    ({"regex": "a{0,4294967295}"}, "SPECGRAMMAR_MAX_REPEAT"),
    ({"regex": "[0-9]{1,100000000}"}, "SPECGRAMMAR_MAX_REPEAT"),
    ({"regex": "(a{1000}){1000}"}, "SPECGRAMMAR_MAX_EXPANSION"),
    ({"regex": "((ab){100}c){1000}"}, "SPECGRAMMAR_MAX_EXPANSION"),
    ({"choice": [f"option{i}" for i in range(60000)]}, "SPECGRAMMAR_MAX_CHOICES"),
    (schema({"enum": list(range(60000))}), "SPECGRAMMAR_MAX_CHOICES"),
    (schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10000)}}),
     "SPECGRAMMAR_MAX_PROPERTIES"),
    (schema({"type": "string", "pattern": "^[a-z]{1,50000}$"}), "SPECGRAMMAR_MAX_REPEAT"),
    (schema({"type": "array", "items": {"const": "x" * 1000}, "minItems": 1000}), "SPECGRAMMAR_MAX_EXPANSION"),
    ({"grammar": CHAIN}, "SPECGRAMMAR_MAX_RULES"),
    ({"grammar": 'root ::= "a"{20000}'}, "SPECGRAMMAR_MAX_REPEAT"),
    ({"grammar": 'start: "a"~100000', "grammar_syntax": "lark"}, "SPECGRAMMAR_MAX_REPEAT"),
])
def test_cheap_bounds_each_with_its_own_error(body, words):
    e = answered({"messages": M, "max_tokens": 64, **body}, ConstraintError)
    assert words in str(e)


def test_a_chain_of_rules_under_the_rule_limit_is_no_recursion_error():
    chain = "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(990)) + '\nr990 ::= "b"'
    _, fit = answered({"messages": M, "max_tokens": 1000, "grammar": chain}, None)
    assert fit is not None and fit.shortest <= 1000


def test_lone_surrogates_are_400s():
    """Wherever one is in the body (a value or a key), the gate names its path (a 400 on every host)."""
    for body, where in (({"regex": "a+", "specgrammar": {"trigger": "\ud800"}}, "specgrammar.trigger"),
                        ({"choice": ["a", "\udc00"]}, "choice[1]"), ({"stop": ["\ud800"]}, "stop[0]"),
                        ({"messages": [{"role": "user", "content": "caf\u00e9 \udfff"}]}, "messages[0].content"),
                        ({"json_schema": {"properties": {"\ud83d": {}}}}, "json_schema.properties (a key)")):
        e = answered({"messages": M, **body}, RequestError)
        assert e.field == where and "lone surrogate" in str(e), (e.field, str(e))
    answered({"messages": M, "choice": ["caf\u00e9", json.loads('"\\ud83e\\udd80"')]}, None)  # JSON's pair: a crab


def test_what_cannot_fit_the_budget_is_refused_before_compiling():
    e = answered({"messages": M, "max_tokens": 16, **schema({"type": "array", "items": {"type": "integer"},
                                                            "minItems": 5000})}, BudgetError)
    assert "minItems" in str(e) and "budget_mask" in str(e)
    # a keyword that need not bind (another type allowed, or one branch of anyOf) is not a reason to refuse
    answered({"messages": M, "max_tokens": 16, **schema({"anyOf": [{"type": "array", "minItems": 5000},
                                                                   {"type": "integer"}]})}, None)
    answered({"messages": M, "max_tokens": 16, **schema({"minLength": 5000})}, None)
    e = answered({"messages": M, "max_tokens": 16, "grammar": 'root ::= "a"{100}'}, BudgetError)
    assert "shortest" in str(e)
    # the switch turns the refusal off (the output may then be cut at max_tokens)
    compiled, fit = answered({"messages": M, "max_tokens": 16, "specgrammar": {"budget_mask": False},
                              "grammar": 'root ::= "a"{100}'}, None)
    assert compiled is not None and fit is None


@pytest.mark.parametrize("body, shortest", [
    ({"grammar": 'root ::= "a" root | "b"'}, 2),  # "b" + stop: exact
    ({"grammar": "start: /a*b/", "grammar_syntax": "lark"}, None),
    ({"grammar": "start: /(a|aa)*b/", "grammar_syntax": "lark"}, None),
    ({"regex": "(a|aa)*b"}, 2),
])
def test_recursive_grammars_get_a_bound(body, shortest):
    compiled, fit = answered({"messages": M, "max_tokens": 64, **body}, None)
    assert fit is not None and fit.shortest <= 64
    if shortest is not None:
        assert fit.shortest == shortest


def test_gbnf_shortest_string():
    assert gbnf_shortest('root ::= "a" root | "b"') == "b"
    assert gbnf_shortest('root ::= x x\nx ::= "ab" | [0-9]') == "00"
    assert gbnf_shortest('root ::= ("x" "y"?)+ "z"') == "xz"
    assert gbnf_shortest('root ::= "a" root') is None


def test_the_deadline_names_the_part_that_overran():
    before = LIMITS.prepare_timeout_s
    LIMITS.prepare_timeout_s = 0.0
    try:
        with pytest.raises(ConstraintError, match="preparation time limit.*overran"):
            prepare({"messages": M, "max_tokens": 64, "regex": "(x|y)*z[a-q]{3}", "specgrammar": {"engine": "dfa"}})
    finally:
        LIMITS.prepare_timeout_s = before


def test_the_start_certificate_is_computed_once_per_request():
    from specgrammar_plugins import budget as budget_mod

    body = {"messages": M, "max_tokens": 40, **schema({"type": "object", "properties": {"zz": {"type": "string"}},
                                                      "required": ["zz"]})}
    compiled, fit = prepare(body)
    assert fit is not None and fit.mode == "certified"
    walks = []
    orig = budget_mod.CertifiedBudget._start
    budget_mod.CertifiedBudget._start = lambda self, *a: walks.append(1) or orig(self, *a)
    try:
        for _ in range(3):  # the handler, the generation thread, the loop: the same start, not walked again
            again = check_budget(compiled, SpecOptions(), 40)
            assert again.shortest == fit.shortest
    finally:
        budget_mod.CertifiedBudget._start = orig
    assert walks == []


def test_jump_forward_is_capped_on_every_engine():
    from conftest import available_engines

    for engine in available_engines():
        if engine == "dfa":
            continue
        c = compile_constraint(ConstraintSpec.regex("abcdefghij{5}k"), TOK,
                               engine=engine)
        m = c.matcher()
        full = m.jump_forward()
        assert len(m.jump_forward(3)) == min(3, len(full)), engine
        assert full in (b"", b"abcdefghijjjjjk"), (engine, full)


@pytest.mark.parametrize("where", ["chat_template", "chat_template_kwargs"])
def test_a_client_chat_template_is_off_unless_allowed(where):
    tpl = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    body = {"messages": M, **({"chat_template": tpl} if where == "chat_template"
                              else {"chat_template_kwargs": {"chat_template": tpl}})}
    with pytest.raises(RequestError, match="SPECGRAMMAR_ALLOW_CLIENT_CHAT_TEMPLATE") as e:
        check_request(body, HOST)
    assert e.value.field.startswith("chat_template")
    allowed = Host("the test server", client_templates=True)
    check_request(body, allowed)
    big = {"messages": M, "chat_template": "x" * (LIMITS.max_chat_template_bytes + 1)}
    with pytest.raises(RequestError, match="SPECGRAMMAR_MAX_CHAT_TEMPLATE_BYTES"):
        check_request(big, allowed)
    check_request({"messages": M, "chat_template_kwargs": {"enable_thinking": False}}, HOST)  # other kwargs pass


def test_a_20000_option_choice_is_answered_within_the_deadline():
    t, c = time.monotonic(), time.process_time()
    try:
        prepare({"messages": M, "max_tokens": 64, "choice": [f"option{i}" for i in range(20000)]})
    except ConstraintError as e:  # on a heavily loaded machine: the deadline's wall-clock backstop, named
        assert "preparation time limit" in str(e)
    in_time(time.monotonic() - t, time.process_time() - c)
