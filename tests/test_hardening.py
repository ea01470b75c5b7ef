"""Hostile inputs: each gets the specific error or the correct output, within a time bound."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgrammar_plugins import ConstraintError, ConstraintSpec, compile_constraint
from specgrammar_plugins import compiler as C
from specgrammar_plugins.masks import allowed_ids, new_mask
from specgrammar_plugins.distributions import GREEDY
from specgrammar_plugins.drafters import ModelDrafter
from specgrammar_plugins.loop import generate
from specgrammar_plugins.testing import MarkovRunner


@pytest.fixture
def limits():
    saved = (C.LIMITS.max_constraint_bytes, C.LIMITS.compile_timeout_s, C.LIMITS.auto_try_s,
             C.LIMITS.compile_isolation)
    yield C.LIMITS
    (C.LIMITS.max_constraint_bytes, C.LIMITS.compile_timeout_s, C.LIMITS.auto_try_s,
     C.LIMITS.compile_isolation) = saved


def test_exponential_regex_compiles_under_auto_within_bound(toy_tok, limits):
    """(a|b)*a(a|b){25}: a DFA has 2^25 states. 'auto' time-boxes xgrammar and falls back to llguidance (lazy)."""
    limits.auto_try_s = 1.0
    spec = ConstraintSpec.regex("(a|b)*a(a|b){25}")
    t0 = time.perf_counter()
    c = compile_constraint(spec, toy_tok, engine="auto", cache=None)
    assert time.perf_counter() - t0 < 15
    m = c.matcher()
    a, b = toy_tok.encode("a")[0], toy_tok.encode("b")[0]
    for t in [b, a] + [a] * 25:
        assert m.accept(t)
    assert m.accept(toy_tok.eos_token_id)


def test_compile_time_limit_is_a_clear_error(toy_tok, limits):
    # untimed warm-up: xgrammar's first use in a process (its import, the tokenizer's set-up) is not the compile's
    # (alone on a 2.5 GHz Xeon it put this test at 3.17 s)
    compile_constraint(ConstraintSpec.regex("[0-9]{2}"), toy_tok, engine="xgrammar", cache=None)
    limits.compile_timeout_s = 0.3
    t0 = time.perf_counter()
    with pytest.raises(ConstraintError, match="compile time limit"):
        compile_constraint(ConstraintSpec.json_schema({"enum": [f"value-{i}" for i in range(30000)]}), toy_tok,
                           engine="xgrammar", cache=None)
    assert time.perf_counter() - t0 < 3


def left_running(wait_s: float) -> None:
    """Fails when some thread's stack is still in interegular's subset construction ``wait_s`` seconds on."""
    import sys
    import traceback

    def in_interegular() -> bool:
        return any("interegular" in f.filename for frame in sys._current_frames().values()
                   for f in traceback.extract_stack(frame))

    deadline = time.monotonic() + wait_s
    while in_interegular():
        assert time.monotonic() < deadline, "the abandoned DFA construction is still running"
        time.sleep(0.05)


def test_a_schema_pattern_with_an_exponential_dfa_is_answered_in_time(toy_tok):
    """The certified budget reads a shortest example of each JSON Schema ``pattern`` from its DFA
    (``budget.shortest_match``, interegular).  ``(a|b)*a(a|b){25}`` has 2^26 states: that construction ran in the
    preparing thread with no limit (past the request's deadline, for ever); now it gets ``SHORTEST_MATCH_S`` of
    the request's CPU and is stopped, and the request is answered (here a budget or a clear ``BudgetError``)."""
    from specgrammar_plugins.bounds import prepare_deadline
    from specgrammar_plugins.budget import make_budget
    from specgrammar_plugins.errors import BudgetError

    spec = ConstraintSpec.json_schema({"type": "object", "required": ["s"],
                                       "properties": {"s": {"type": "string", "pattern": "(a|b)*a(a|b){25}"}}})
    c = compile_constraint(spec, toy_tok, engine="llguidance", cache=None)
    t0 = time.perf_counter()
    try:
        with prepare_deadline(5.0):
            make_budget(c, 64)
    except BudgetError as e:
        assert "could be certified" in str(e), e
    assert time.perf_counter() - t0 < 5
    left_running(5)


def test_a_pure_python_compile_past_the_limit_is_stopped_with_thread_isolation(toy_tok, limits):
    """compile_isolation="thread" (the library default; the vLLM EngineCore's exact budget): the dfa engine's
    compile (interegular, pure Python) of a regex with 2^25 DFA states is stopped at the limit, not left running.
    Before, it ran on in the pool's thread for as long as the process lived, its heap growing (the vLLM launcher's
    EngineCore: +50,000 objects in two minutes after one such request, which failed the memory test in CI).  The
    thread leaves interegular's code, and the process can compile again at once."""
    import gc

    limits.compile_isolation = "thread"
    limits.compile_timeout_s = 0.3
    # a gc callback in Python, as hypothesis installs: an exception delivered in the thread while it runs is lost
    # ("Exception ignored"); in a run of the whole suite one stop alone so left the construction running, so the
    # thread is stopped until it ends (``_Stoppable.halt``).  (Here the exception may land in the callback; it did
    # not make the single stop fail in three runs of this test alone.)
    # A Stopped that lands in the callback is "ignored": CPython hands it to sys.unraisablehook in the stopped thread.
    # pytest's hook (pytest 9.2) is Python code that imports tracemalloc, and the next Stopped of ``halt`` landed in
    # that import once in CI ("Failed to process unraisable exception", the test failed).  So for this test the hook is
    # a builtin, ``list.append``: no bytecode for a Stopped to land in.
    import sys
    import threading

    from specgrammar_plugins.bounds import Stopped

    calls, ignored = [], []

    def callback(phase, info):  # (most of the thread's bytecodes run here: the exception mostly lands here)
        for _ in range(300):
            pass
        calls.append(phase)

    hook = sys.unraisablehook
    sys.unraisablehook = ignored.append
    gc.callbacks.append(callback)
    threshold = gc.get_threshold()
    gc.set_threshold(10)  # (a collection, so the callback, every few allocations of the construction)
    try:
        t0 = time.perf_counter()
        with pytest.raises(ConstraintError, match="compile time limit.*stopped"):
            compile_constraint(ConstraintSpec.regex("(a|b)*a(a|b){25}"), toy_tok, engine="dfa", cache=None)
        assert time.perf_counter() - t0 < 3
        left_running(10)
        end = time.monotonic() + 10  # the stopped thread and its stopper end (nothing is delivered after)
        while any(t.name.startswith("specgrammar-stop") for t in threading.enumerate()):
            assert time.monotonic() < end, "the stopped compile thread did not end"
            time.sleep(0.05)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(callback)
        sys.unraisablehook = hook
    assert all(a.exc_type is Stopped for a in ignored)  # (only our stops were lost, nothing else went wrong)
    assert calls
    limits.compile_timeout_s = 30
    c = compile_constraint(ConstraintSpec.regex("[0-9]{4}|x"), toy_tok, engine="dfa", cache=None)
    m = c.matcher()
    assert all(m.accept(t) for t in toy_tok.encode("2024")) and m.accept(toy_tok.eos_token_id)
    with pytest.raises(ConstraintError, match="engine=dfa"):  # the engine's own error crosses over
        compile_constraint(ConstraintSpec.regex("[0-9"), toy_tok, engine="dfa", cache=None)


@pytest.mark.parametrize("engine,spec", [
    ("xgrammar", ConstraintSpec.json_schema({"enum": [f"value-{i}" for i in range(30000)]})),
    ("dfa", ConstraintSpec.regex("(a|b)*a(a|b){25}")),  # interegular builds all 2^25 states
], ids=["xgrammar-enum", "dfa-exponential"])
def test_compile_past_the_limit_is_killed_with_process_isolation(toy_tok, limits, engine, spec):
    """compile_isolation="process" (what the mlx-lm server uses): the compiling worker process is killed at the
    limit, so nothing keeps running; the next compile gets a fresh worker and a correct grammar (checked on dfa
    only: a fresh xgrammar worker imports torch again, 15-40 s on a loaded machine; the servers in
    test_concurrency.py and test_mlx_server.py compile every xgrammar grammar through workers)."""
    from pathlib import Path

    from specgrammar_plugins.compile_worker import POOL

    limits.compile_isolation = "process"
    compile_constraint(ConstraintSpec.regex("[0-9]{2}"), toy_tok, engine=engine, cache=None)  # untimed warm-up
    killed = POOL.killed
    limits.compile_timeout_s = 0.5
    t0 = time.perf_counter()
    with pytest.raises(ConstraintError, match="abandoned: the compiling process was killed"):
        compile_constraint(spec, toy_tok, engine=engine, cache=None)
    assert time.perf_counter() - t0 < 5
    assert POOL.killed == killed + 1 and not Path(f"/proc/{POOL.last_killed_pid}").exists()
    if engine != "dfa":
        return
    limits.compile_timeout_s = 120
    c = compile_constraint(ConstraintSpec.regex("[0-9]{4}|x"), toy_tok, engine=engine, cache=None)
    m = c.matcher()
    assert all(m.accept(t) for t in toy_tok.encode("2024")) and m.accept(toy_tok.eos_token_id)
    with pytest.raises(ConstraintError, match="engine=" + engine):  # the engine's own refusal crosses over
        compile_constraint(ConstraintSpec.regex("[0-9"), toy_tok, engine=engine, cache=None)


def test_size_limit(toy_tok, limits):
    limits.max_constraint_bytes = 1000
    with pytest.raises(ConstraintError, match="the limit is 1000"):
        compile_constraint(ConstraintSpec.regex("a" * 2000), toy_tok, engine="dfa", cache=None)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_schema_shapes(toy_tok, engine):
    t0 = time.perf_counter()
    with pytest.raises(ConstraintError, match="matches no string"):  # $ref cycle with nothing to produce
        compile_constraint(ConstraintSpec.json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                       "$ref": "#/$defs/a"}), toy_tok, engine=engine, cache=None)
    compile_constraint(ConstraintSpec.json_schema({"type": "object", "properties": {"child": {"$ref": "#"}}}), toy_tok,
                       engine=engine, cache=None)  # recursive: fine
    deep = {"type": "integer"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    c = compile_constraint(ConstraintSpec.json_schema(deep), toy_tok, engine=engine, cache=None)
    m = c.matcher()
    text = '{"a":' * 60 + "1" + "}" * 60
    assert all(m.accept(t) for t in toy_tok.encode(text)) and m.accept(toy_tok.eos_token_id)
    assert time.perf_counter() - t0 < 30


def test_huge_enum_with_the_policy(toy_tok):
    t0 = time.perf_counter()
    c = compile_constraint(ConstraintSpec.json_schema({"enum": [f"v{i}" for i in range(20000)]}), toy_tok,
                           engine="auto", cache=None)
    assert c.engine == "llguidance" and time.perf_counter() - t0 < 10


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_grammar_of_only_the_empty_string(toy_tok, engine):
    c = compile_constraint(ConstraintSpec.grammar('root ::= ""'), toy_tok, engine=engine, cache=None)
    out, st = generate(MarkovRunner(toy_tok.vocab_size, valid=len(toy_tok.token_bytes)), [1], constraint=c,
                       params=GREEDY, max_tokens=5, seed=0)
    assert out == [toy_tok.eos_token_id] and st.finish_reason == "stop"


@pytest.mark.parametrize("engine", ["dfa", "xgrammar", "llguidance"])
def test_partial_utf8_tokens(toy_tok, engine):
    """Byte-level tokens that split a character: a lead byte may start 'é', a lone continuation byte never."""
    c = compile_constraint(ConstraintSpec.regex("é+"), toy_tok, engine=engine, cache=None)
    m = c.matcher()
    row = new_mask(toy_tok.vocab_size)
    m.fill_mask(row)
    ids = set(allowed_ids(row, toy_tok.vocab_size).tolist())
    lead, cont, full = (toy_tok.token_bytes.index(b) for b in (b"\xc3", b"\xa9", b"\xc3\xa9"))
    assert lead in ids and full in ids and cont not in ids
    assert m.accept(lead)
    m.fill_mask(row)
    assert set(allowed_ids(row, toy_tok.vocab_size).tolist()) == {cont}


def test_draft_eos_where_grammar_is_incomplete(toy_tok):
    """A draft model that loves EOS: grammar-aware drafting never proposes it before the grammar can end, and the
    output is complete and valid."""

    class EOSLover(MarkovRunner):
        def logits_after(self, a, b):
            z = super().logits_after(a, b)
            z[0] = 50.0
            return z

    c = compile_constraint(ConstraintSpec.regex("[0-9]{5}"), toy_tok, engine="xgrammar")
    target = MarkovRunner(toy_tok.vocab_size, seed=1, valid=len(toy_tok.token_bytes))
    rng = np.random.default_rng(0)
    out, st = generate(target, [1], constraint=c, drafter=ModelDrafter(EOSLover(toy_tok.vocab_size, seed=2), GREEDY, rng),
                       k=4, params=GREEDY, max_tokens=10, rng=rng)
    text = toy_tok.decode(out[:-1])
    assert out[-1] == 0 and len(text) == 5 and text.isdigit()
    assert 0 not in out[:-1]


EMPTY_LANGUAGES = [
    (ConstraintSpec.grammar('root ::= "a" root'), "no derivation of 'root' ever ends"),
    (ConstraintSpec.grammar('root ::= x\nx ::= "(" x ")" | "[" y "]"\ny ::= x+'), "no derivation of 'root' ever ends"),
    (ConstraintSpec.grammar('root ::= "b" c\nc ::= [^\\x00-\\U0010FFFF]'), "no derivation of 'root' ever ends"),
    (ConstraintSpec.regex(r"a{0}b[^\x00-\U0010FFFF]"), "allows no character"),
    (ConstraintSpec.regex(r"([^\d\D]|x[^\x00-\U0010FFFF])+y|z[^\x00-\uD7FF\uE000-\U0010FFFF]{1,3}"), "allows no character"),
]


@pytest.mark.parametrize("engine", ["dfa", "xgrammar", "llguidance", "outlines_core", "auto"])
@pytest.mark.parametrize("spec,reason", EMPTY_LANGUAGES,
                         ids=["gbnf-self", "gbnf-cycle", "gbnf-class", "regex-class", "regex-alt"])
def test_languages_with_no_string_are_refused_at_compile_time(toy_tok, engine, spec, reason):
    """Each of these allows a first token (``a``, ``(``, ``b``, ``x``) (``z``: surrogates cannot be encoded) but no string ends: decoding
    would run to max_tokens or fail at a later mask.  Refused before any engine runs, on every engine."""
    t0 = time.perf_counter()
    with pytest.raises(ConstraintError, match="matches no string") as e:
        compile_constraint(spec, toy_tok, engine=engine, cache=None)
    assert reason in str(e.value)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("schema", [False, {"not": {}}, {"enum": []}, {"anyOf": []},
                                    {"type": "integer", "minimum": 5, "maximum": 1}])
def test_schemas_with_no_instance_are_refused(toy_tok, engine, schema):
    t0 = time.perf_counter()
    with pytest.raises(ConstraintError) as e:
        compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine=engine, cache=None)
    assert e.value.engine == engine and e.value.reason
    assert time.perf_counter() - t0 < 5.0


def test_productive_grammars_and_regexes_are_not_refused(toy_tok):
    """The emptiness checks are conservative: recursion with an exit, optional parts, wide negated classes."""
    from specgrammar_plugins.emptiness import gbnf_unproductive_root, regex_is_empty

    assert not gbnf_unproductive_root('root ::= "a" root | "b"')
    assert not gbnf_unproductive_root('root ::= x*\nx ::= "a" x')  # x is empty, but x* is the empty string
    assert not gbnf_unproductive_root('root ::= "(" root ")" | [a-z]+')
    assert not regex_is_empty(r"b[^\x00-\uffff]")  # characters past U+FFFF remain
    assert not regex_is_empty(r"([^\x00-\U0010FFFF])?b")
    assert not regex_is_empty(r"[0-9")  # unreadable here: left to the engine
    c = compile_constraint(ConstraintSpec.grammar('root ::= "a" root | "b"'), toy_tok, engine="llguidance", cache=None)
    m = c.matcher()
    assert all(m.accept(t) for t in toy_tok.encode("aab")) and m.accept(toy_tok.eos_token_id)


@pytest.mark.parametrize("engine", ["dfa", "xgrammar", "llguidance", "outlines_core"])
def test_an_empty_mask_mid_walk_is_an_empty_mask_error(toy_tok, engine):
    """A language empty only for this vocabulary (no toy token spells U+0100..U+0200), which the structural check
    cannot see: the engine refuses it at compile time, or the loop raises EmptyMaskError at the position where no
    token is allowed, instead of looping or sampling outside the mask."""
    from specgrammar_plugins import EmptyMaskError

    t0 = time.perf_counter()
    try:
        c = compile_constraint(ConstraintSpec.regex("b[\u0100-\u0200]"), toy_tok, engine=engine, cache=None)
    except ConstraintError as e:
        assert e.engine == engine and ("incompatible" in e.reason or "matches no string" in e.reason), e
    else:
        with pytest.raises(EmptyMaskError, match="no token is allowed"):
            generate(MarkovRunner(toy_tok.vocab_size, valid=len(toy_tok.token_bytes)), [1], constraint=c,
                     params=GREEDY, max_tokens=8, seed=0)
    assert time.perf_counter() - t0 < 5.0


class _Scripted(MarkovRunner):
    """Prefers the next token of ``script`` (by output position) by a wide margin: greedy follows it wherever the
    mask allows it."""

    def __init__(self, vocab_size, valid, script, prompt_len):
        super().__init__(vocab_size, valid=valid)
        self.script, self.prompt_len = script, prompt_len

    def logits_after(self, a, b):
        z = super().logits_after(a, b)
        i = len(self.tokens) - self.prompt_len
        z[self.script[min(i, len(self.script) - 1)]] += 100.0
        return z


@pytest.mark.parametrize("engine", ["dfa", "xgrammar", "llguidance"])
def test_prompt_that_already_contains_the_trigger(toy_tok, engine):
    """The prompt ends with the trigger (and, second, with half of it): only a trigger the model generates switches
    the constraint on.  Before it the model writes freely ('xy', 'nk>' completing the prompt's half does not
    count), after it the constraint holds: the scripted 'zz' is masked and digits come instead."""
    c = compile_constraint(ConstraintSpec.regex("[0-9]{4}", trigger="</think>"), toy_tok, engine=engine, cache=None)
    t0 = time.perf_counter()
    for prompt_text, script_text, expect in (("</think>", "xy</think>2024", b"xy</think>2024"),
                                             ("</thi", "nk>x</think>zz", b"nk>x</think>")):
        prompt = toy_tok.encode(prompt_text)
        script = toy_tok.encode(script_text) + [toy_tok.eos_token_id]
        runner = _Scripted(toy_tok.vocab_size, len(toy_tok.token_bytes), script, len(prompt))
        out, st = generate(runner, prompt, constraint=c, params=GREEDY, max_tokens=24, seed=0)
        text = toy_tok.decode([t for t in out if t != toy_tok.eos_token_id])
        assert text.startswith(expect), (prompt_text, text)
        after = text.split(b"</think>", 1)[1]
        assert after.isdigit() and len(after) == 4 and out[-1] == toy_tok.eos_token_id, text
    assert time.perf_counter() - t0 < 5


def test_compiled_grammars_are_held_only_by_the_bounded_cache(toy_tok):
    """xgrammar's GrammarCompiler cached every grammar it ever compiled (no limit by default), past our LRU: 600
    distinct schemas grew it by ~10 MB on a 1k vocabulary.  Now only ``CompileCache`` holds them."""
    from specgrammar_plugins.compiler import CompileCache
    from specgrammar_plugins.engines.xgrammar_engine import _COMPILERS

    cache = CompileCache(max_entries=4)
    for i in range(40):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine="xgrammar", cache=cache)
    assert len(cache) == 4
    assert _COMPILERS.get(toy_tok).get_cache_size_bytes() == 0


# ---------------------------------------------------------------------------------------------- issue 22
def test_llguidance_compiles_under_process_isolation(toy_tok, limits):
    """Regression (issue 22): with compile_isolation="process" (the mlx-lm server's setting) every llguidance
    request was refused with "compile_isolation must be 'process' or 'thread', got 'process'": llguidance is not
    isolated (its fuel bounds it), and the non-isolated path only knew "thread".  It compiles in-process."""
    limits.compile_isolation = "process"
    c = compile_constraint(ConstraintSpec.regex("[0-9]{2}"), toy_tok, engine="llguidance", cache=None)
    m = c.matcher()
    assert all(m.accept(t) for t in toy_tok.encode("42")) and m.accept(toy_tok.eos_token_id)
    limits.compile_isolation = "fork"
    with pytest.raises(ConstraintError, match="compile_isolation must be 'process' or 'thread', got 'fork'"):
        compile_constraint(ConstraintSpec.regex("[0-9]{3}"), toy_tok, engine="llguidance", cache=None)


NO_FINITE_INSTANCE = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
     "$ref": "#/$defs/n"},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}}, "required": ["a"]},
    {"type": "object", "required": ["x"], "additionalProperties": False},
]
FINITE = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional: {} ends it
    {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["a"]},
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}},
]


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance", "outlines_core", "auto"])
def test_schemas_without_a_finite_instance_are_refused_on_every_engine(toy_tok, engine):
    """A schema whose every instance would contain itself was accepted and decoded whitespace until max_tokens
    (issue 22, finding 8); refused at compile time now, while recursive schemas with a way out compile."""
    for schema in NO_FINITE_INSTANCE:
        with pytest.raises(ConstraintError, match="matches no string: no finite JSON value"):
            compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine=engine, cache=None)
    for schema in FINITE:
        try:
            compile_constraint(ConstraintSpec.json_schema(schema), toy_tok, engine=engine, cache=None)
        except ConstraintError as e:  # an engine may refuse recursion itself (outlines-core: "Ref recursion")
            assert "no finite JSON value" not in str(e), (schema, e)


def _nested_schema(n: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(n):
        s = {"type": "array", "items": s}
    return s


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance", "outlines_core", "dfa", "auto"])
def test_nesting_is_bounded_and_never_a_recursion_error(toy_tok, engine):
    """A schema nested 2,000 deep raised RecursionError (a crash, issue 22 finding 7): constraints nest at most
    ``LIMITS.max_nesting`` levels, checked without recursion, whatever the spelling (object, JSON text, regex
    groups, grammar parentheses)."""
    t0 = time.perf_counter()
    too_deep = [lambda: ConstraintSpec.json_schema(_nested_schema(2000)),
                lambda: ConstraintSpec.json_schema('{"type":"array","items":' * 5000 + "{}" + "}" * 5000),
                lambda: ConstraintSpec.regex("(" * 1000 + "a" + ")" * 1000),
                lambda: ConstraintSpec.grammar("root ::= " + "(" * 1000 + '"a"' + ")" * 1000),
                # built without the factory's checks: compile_constraint's own scan (once under "auto")
                lambda: ConstraintSpec("json_schema", '{"type":"array","items":' * 500 + "{}" + "}" * 500)]
    for make in too_deep:
        with pytest.raises(ConstraintError, match="nests more than 128 levels deep"):
            compile_constraint(make(), toy_tok, engine=engine, cache=None)
    assert time.perf_counter() - t0 < 5
    if engine != "dfa":  # within the bound: compiles
        from specgrammar_plugins import TokenizerInfo
        from specgrammar_plugins.models import tiny_path

        tok = TokenizerInfo.from_file(str(tiny_path("target")))
        deep = {"type": "integer"}
        for _ in range(60):  # 121 JSON levels (objects: arrays this deep blow up outlines-core's regex)
            deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
        compile_constraint(ConstraintSpec.json_schema(deep), tok, engine=engine, cache=None)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet='[]{}"\\ax,:é', max_size=60))
def test_json_text_depth_equals_the_character_loop(text):
    """The fast depth of JSON text (regexes and a numpy running sum) against the character-by-character reference,
    on texts of brackets, quotes, escapes and non-ASCII (unbalanced and unterminated ones too)."""
    from specgrammar_plugins import nesting

    assert nesting.json_text_depth(text) == nesting._json_text_depth_loop(text)


def test_a_recursion_error_is_a_constraint_error(toy_tok, monkeypatch):
    """The safety net behind the nesting bound: with the bound lifted, recursion that runs out while a
    constraint is built (json, our schema walkers) or compiled (interegular, under the dfa engine) reaches the
    caller as a ConstraintError (servers: a 400), never as a RecursionError.  (Native engines are left out: with
    no bound, xgrammar and llguidance spend gigabytes on such a regex.)"""
    from specgrammar_plugins import nesting

    monkeypatch.setattr(nesting, "MAX_NESTING", 10**6)
    with pytest.raises(ConstraintError, match="nests too deeply"):
        ConstraintSpec.json_schema('{"type":"array","items":' * 5000 + "{}" + "}" * 5000)
    with pytest.raises(ConstraintError, match="nests too deeply"):
        ConstraintSpec.json_schema(_nested_schema(5000))
    with pytest.raises(ConstraintError, match="RecursionError|nests too deeply"):
        compile_constraint(ConstraintSpec.regex("(" * 3000 + "a" + ")" * 3000), toy_tok, engine="dfa", cache=None)


def test_a_request_names_recipe_packs_and_opens_no_other_file(tmp_path, monkeypatch):
    """``specgrammar.recipe`` read /etc/passwd (issue 22, finding 6): a request names a pack in the server's pack
    folder or a shipped one; names that are paths are refused without any file being opened (or listed)."""
    import os
    import sys

    from specgrammar_plugins.errors import RequestError
    from specgrammar_plugins.recipes import RecipePackError, resolve_name, shipped_packs
    from specgrammar_plugins.requests import parse_request

    packs = tmp_path / "packs"
    packs.mkdir()
    (packs / "mine.json").write_text("{}")
    (tmp_path / "outside.json").write_text("{}")
    monkeypatch.chdir(tmp_path)  # a name must not find ./outside.json either
    opened: list[str] = []

    def audit(event, args):
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))

    parse_request({"specgrammar": {"recipe": "mine"}})  # (imports done before the hook watches)
    sys.addaudithook(audit)  # (audit hooks cannot be removed: this one only appends to a list)

    def outside(paths):  # anything opened or listed that is not the pack folder (or below it)
        return [p for p in paths if "passwd" in p or "outside" in p or "hidden" in p
                or (p.startswith(str(tmp_path)) and not p.startswith(str(packs)))]

    for name in ("/etc/passwd", "../outside", "../outside.json", "packs/mine", "./mine", ".hidden", "..",
                 "mine/../../outside", "C:\\x", "", "a" * 200):
        opened.clear()
        with pytest.raises(RequestError, match="specgrammar.recipe must be the name of a recipe pack"):
            parse_request({"specgrammar": {"recipe": name}})
        with pytest.raises(RecipePackError, match="not a pack name"):
            resolve_name(name, packs)
        assert not outside(opened), (name, opened)
    opened.clear()
    with pytest.raises(RecipePackError, match="not found"):
        resolve_name("outside", packs)  # a name, but not in the pack folder: ./outside.json is not looked at
    assert resolve_name("mine", packs) == packs / "mine.json"
    assert resolve_name("json_extraction", packs) == shipped_packs()["json_extraction"]
    assert opened and not outside(opened), opened
