"""The mlx-lm server plugin's request preparation and batching, in process, on the bundled tiny models (real
mlx-lm, real engines): preparation under one deadline; constrained requests on mlx-lm's own ``BatchGenerator``,
one constraint and budget per row, each row's greedy output equal to serial constrained decoding, a faulty row
answered with its error while the rest of its batch goes on."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from test_mlx_common import tiny_model_dirs

pytest.importorskip("mlx_lm")

from specgrammar_plugins import bounds  # noqa: E402
from specgrammar_plugins.errors import ConstraintError  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from mlx_lm import load

    t, _ = tiny_model_dirs()
    model, tok = load(str(t))
    return model, tok


def _provider(model, tok):
    """What the plugin's hooks read of mlx-lm's ``ModelProvider``: the loaded model, its tokenizer, the command line."""
    return SimpleNamespace(model=model, tokenizer=tok, cli_args=SimpleNamespace(model=None, max_tokens=64))


def test_request_preparation_runs_under_the_deadline(tiny, monkeypatch):
    """Gate check, compile and budget check share one deadline (issue 33): with no time at all a new constraint
    is refused with the preparation time limit's reason; with the default it is prepared."""
    from specgrammar_mlx_lm import server_plugin

    provider = _provider(*tiny)
    schema = {"type": "object", "properties": {"deadline_probe": {"type": "integer"}}, "required": ["deadline_probe"]}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 32, "json_schema": schema}
    monkeypatch.setattr(bounds.BOUNDS, "prepare_timeout_s", 0.0)
    with pytest.raises(ConstraintError, match="preparation time limit"):
        server_plugin.request_fields(json.loads(json.dumps(body)), provider)
    assert bounds.current() is None  # the deadline is closed after the request
    monkeypatch.setattr(bounds.BOUNDS, "prepare_timeout_s", 30.0)
    plan = server_plugin.request_fields(json.loads(json.dumps(body)), provider)["specgrammar"]
    assert plan.spec is not None and plan.spec.kind == "json_schema"


# ------------------------------------------------------------------------------------------------ batched rows
MAX_TOKENS = 64


def _rows(tok, n_per=2):
    """Requests of every structured workload (JSON Schemas with a certified budget, regexes, GBNF), eval prompts."""
    from specgrammar_plugins.workloads import STRUCTURED, examples

    from test_mlx_common import prompt_ids

    return [(w, ex, prompt_ids(tok, ex.prompt)) for w in STRUCTURED for ex in examples(w, "eval", n_per)]


def _body(ex, max_tokens=MAX_TOKENS):
    spec = ex.constraint
    field = {"json_schema": {"json_schema": spec.schema}, "regex": {"regex": spec.value},
             "grammar": {"grammar": spec.value}}[spec.kind]
    return {"messages": [{"role": "user", "content": ex.prompt}], "max_tokens": max_tokens, **field}


def _processors(provider, body):
    """The plugin's processors for one request, as the patched server gets them (``request_fields`` in the handler,
    ``logits_processors`` on the generation thread)."""
    from specgrammar_mlx_lm import server_plugin

    fields = server_plugin.request_fields(body, provider)
    args = SimpleNamespace(plugin_fields=fields, max_tokens=body["max_tokens"])
    assert server_plugin.is_batchable(args, provider, 0) is None  # no vote against mlx-lm's batching path
    return fields["specgrammar"], server_plugin.logits_processors(args, provider.tokenizer, provider.model)


def _batched(model, prompts, processors, eos, max_tokens=MAX_TOKENS, sampler=None):
    """mlx-lm's own ``BatchGenerator`` (greedy unless ``sampler``, ending on the EOS tokens), every row with its own
    processors; the tokens of each row."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts),
                         stop_tokens=[[e] for e in sorted(eos)], sampler=sampler)
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    uids = gen.insert(prompts, max_tokens=list(max_tokens), logits_processors=processors)
    out = {u: [] for u in uids}
    done = set()
    try:
        while len(done) < len(uids):
            for r in gen.next_generated():
                out[r.uid].append(int(r.token))
                if r.finish_reason is not None:
                    done.add(r.uid)
    finally:
        gen.close()
    return [out[u] for u in uids]


def test_constrained_rows_batch_with_their_own_constraint_and_budget(tiny):
    """Twelve requests of six workloads (JSON Schemas with a certified budget among them) in one BatchGenerator,
    each row with the processor the plugin makes for it: each row's greedy output equals the same request decoded
    alone with mlx-lm's ``generate_step`` and the same processor, and equals our loop with no drafts (k = 0:
    plain constrained decoding) where the budget is not tight, and is valid where it ends."""
    import mlx.core as mx  # noqa: F401
    from specgrammar_mlx_lm.generate import stream_generate
    from specgrammar_plugins.workloads import is_valid

    from test_mlx_common import plain_generate_step

    model, tok = tiny
    provider = _provider(model, tok)
    rows = _rows(tok)
    plans, procs = zip(*(_processors(provider, _body(ex)) for _, ex, _ in rows))
    assert any(p.certified for p in plans) and not all(p.certified for p in plans)
    eos = set(tok.eos_token_ids)
    batched = _batched(model, [p for _, _, p in rows], list(procs), eos)
    ended = 0
    for (w, ex, prompt), out in zip(rows, batched):
        _, (alone,) = _processors(provider, _body(ex))
        serial = plain_generate_step(model, prompt, processor=alone, max_tokens=MAX_TOKENS, eos_ids=eos)
        assert out == serial, (w, ex.prompt)
        loop = [r.token for r in stream_generate(model, tok, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=0,
                                                 constraint=ex.constraint, temperature=0.0)]
        assert out == loop, (w, ex.prompt)
        if out and out[-1] in eos:
            ended += 1
            assert is_valid(w, tok.decode(out[:-1])), (w, tok.decode(out))
    assert ended >= len(rows) // 2


def test_tight_certified_budget_row_in_a_batch(tiny):
    """A JSON Schema request whose max_tokens is one above its shortest certified completion (below the model's own
    answer), batched with the same request at a generous max_tokens: the certified budget as a mask row makes the
    tight row end complete and valid within its max_tokens, other than the generous row, and the same as decoded
    alone (the row is a function of the history)."""
    import re

    from specgrammar_plugins.errors import BudgetError
    from specgrammar_plugins.workloads import examples, is_valid

    from test_mlx_common import plain_generate_step, prompt_ids

    model, tok = tiny
    provider = _provider(model, tok)
    eos = set(tok.eos_token_ids)
    ex = examples("json_extraction", "eval", 1)[0]
    with pytest.raises(BudgetError) as e:
        _processors(provider, _body(ex, max_tokens=1))
    n = int(re.search(r"takes (\d+) tokens", str(e.value)).group(1)) + 1
    prompt = prompt_ids(tok, ex.prompt)
    (plan, tight), (_, loose) = _processors(provider, _body(ex, n)), _processors(provider, _body(ex))
    assert plan.certified
    out_tight, out_loose = _batched(model, [prompt, prompt], [tight, loose], eos, max_tokens=[n, MAX_TOKENS])
    assert len(out_tight) <= n and out_tight[-1] in eos and is_valid("json_extraction", tok.decode(out_tight[:-1]))
    assert out_tight != out_loose
    _, (alone,) = _processors(provider, _body(ex, n))
    assert plain_generate_step(model, prompt, processor=alone, max_tokens=n, eos_ids=eos) == out_tight


# ------------------------------------------------------------------------------------------------ over HTTP
FAULT_PLUGIN = '''"""A server plugin for tests: records each request's processor calls (its ``user`` field) in SG_FAULT_LOG, and
makes the processor of the request whose ``user`` is "fault" raise at its 5th call.  The first processor call
waits (at most 60 s) until SG_FAULT_WAIT_FOR requests have arrived, and each call takes 10 ms more, so that on a
loaded machine the first request is not done before the others reach the server."""
import os
import threading
import time

import pluggy

hookimpl = pluggy.HookimplMarker("mlx_lm.server")
_lock = threading.Lock()
_arrived = [0]
_waited = []


@hookimpl
def request_fields(body, model_provider):
    with _lock:
        _arrived[0] += 1
    return {"sgfault": body.get("user")}


def _wait_for_all():
    t0 = time.monotonic()
    while _arrived[0] < int(os.environ["SG_FAULT_WAIT_FOR"]) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    time.sleep(1.0)  # the last one's tokenizing and queueing


@hookimpl
def logits_processors(args, tokenizer, model):
    tag = (args.plugin_fields or {}).get("sgfault")
    if not tag:
        return None
    calls = [0]

    def record(tokens, logits):
        calls[0] += 1
        if not _waited:
            _waited.append(tag)
            _wait_for_all()
        time.sleep(0.01)
        with _lock, open(os.environ["SG_FAULT_LOG"], "a") as f:
            f.write(tag + "\\n")
        if tag == "fault" and calls[0] == 5:
            raise RuntimeError("injected fault in this request's processor")
        return logits

    return [record]
'''


def _fault_plugin(where, name="sgfault", source=FAULT_PLUGIN):
    """A server plugin (the one above by default) installed in ``where`` (a module and its dist-info with the entry
    point)."""
    (where / f"{name}.py").write_text(source)
    info = where / f"{name}-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[mlx_lm.server_plugins]\n{name} = {name}\n")
    return where


def _alone_refs(model, tok, exs):
    """Each JSON Schema request's greedy answer decoded alone (mlx-lm's ``generate_step`` with the plugin's
    processor: plain constrained decoding), as the server answers it."""
    from test_mlx_common import plain_generate_step, prompt_ids

    provider = _provider(model, tok)
    eos = set(tok.eos_token_ids)
    refs = []
    for ex in exs:
        _, (proc,) = _processors(provider, _body(ex))
        out = plain_generate_step(model, prompt_ids(tok, ex.prompt), processor=proc, max_tokens=MAX_TOKENS,
                                  eos_ids=eos)
        refs.append(tok.decode(out[:-1] if out and out[-1] in eos else out))
    return refs


@pytest.mark.parametrize("draft", [False, True], ids=["no-draft", "draft"])
def test_batched_requests_over_http_one_fault_fails_only_its_request(tiny, tmp_path, draft):
    """``mlx_lm.server --plugin specgrammar``, without a draft model and with one (which turns mlx-lm's batching
    off; the plugin batches constrained requests anyway): concurrent JSON Schema requests
    (certified budget) are decoded together on mlx-lm's batching path (their processor calls interleave), each
    answer equal to the same request decoded alone; one whose processor fails mid-way is answered 500 while the
    others go on, and the server keeps serving (the same request alone afterwards: the same answer)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    openai = pytest.importorskip("openai")
    from servers import launch_mlx, patched_mlx_root
    from specgrammar_plugins.workloads import examples

    exs = examples("json_extraction", "eval", 4)
    refs = _alone_refs(*tiny, exs)
    log = tmp_path / "calls.log"
    srv = launch_mlx(tmp_path / "srv", draft=draft, max_tokens=MAX_TOKENS, extra=["--plugin", "sgfault"],
                     root=patched_mlx_root(tmp_path / "mlx"),
                     env={"PYTHONPATH": str(_fault_plugin(tmp_path)), "SG_FAULT_LOG": str(log), "SG_FAULT_WAIT_FOR": "5"})
    client = srv.client()

    def ask(i):
        ex = exs[i % len(exs)]
        try:
            r = client.chat.completions.create(
                model="default_model", messages=[{"role": "user", "content": ex.prompt}], max_tokens=MAX_TOKENS,
                temperature=0.0, user="fault" if i == 4 else f"row{i}",
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ex.constraint.schema}})
            return r.choices[0].message.content
        except openai.APIStatusError as e:
            return e

    try:
        with ThreadPoolExecutor(5) as pool:
            futs = []
            for i in range(5):
                futs.append(pool.submit(ask, i))
                time.sleep(0.05)
            outs = [f.result() for f in futs]
        assert isinstance(outs[4], openai.InternalServerError) and outs[4].status_code == 500, outs[4]
        assert outs[:4] == refs
        tags = log.read_text().split()
        assert tags.count("fault") == 5
        span = {t: (tags.index(t), len(tags) - 1 - tags[::-1].index(t)) for t in set(tags)}
        rows = sorted(t for t in span if t.startswith("row"))
        overlapping = [(a, b) for a in rows for b in rows if a < b
                       and span[a][0] < span[b][1] and span[b][0] < span[a][1]]
        assert overlapping, span  # two requests decoded at the same time: the batching path
        assert ask(1) == refs[1]  # the server keeps serving
    finally:
        srv.stop()


JOIN_SPY = '''"""A spy loaded with ``--plugin sgjoin``: every ``next()`` of the batching path's SpecGenerationBatch
writes how many rows its batch holds to SG_JOIN_LOG.  While the batch holds the test's second request alone, it
waits until a third one has arrived (``request_fields``) and is queued: a request sent later finds the first still decoding."""
import os
import threading
import time

import pluggy

from specgrammar_mlx_lm import batch_server

hookimpl = pluggy.HookimplMarker("mlx_lm.server")
_next = batch_server._SpecMixin.next
_arrived = [0]
_lock = threading.Lock()


def _spied(self):
    with open(os.environ["SG_JOIN_LOG"], "a") as f:
        f.write(f"{len(self.uids)}\\n")
    if len(self.uids) == 1 and _arrived[0] == 2:
        t0 = time.monotonic()
        while _arrived[0] < 3 and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        time.sleep(0.5)  # the third one's tokenizing and queueing
    return _next(self)


batch_server._SpecMixin.next = _spied


@hookimpl
def request_fields(body, model_provider):
    if body.get("response_format"):  # the test's requests (not the start-up probe)
        with _lock:
            _arrived[0] += 1
    return None
'''


def test_a_lone_request_on_a_draft_server_is_a_batch_that_others_join(tiny, tmp_path):
    """Issue 34: on ``mlx_lm.server --plugin specgrammar --draft-model`` a constrained request that arrives alone goes
    to the batching path (``is_batchable`` votes True with nothing waiting): it is a speculative row, a batch of one
    (the spy sees one row, the log a ``specgrammar batch:`` line and no serial-loop line), and a second request sent
    while it decodes joins the same batch (two rows in one ``next()``); each greedy answer equals plain constrained
    decoding of the same request alone."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from servers import launch_mlx, patched_mlx_root
    from specgrammar_plugins.workloads import examples

    exs = examples("json_extraction", "eval", 2)
    refs = _alone_refs(*tiny, exs)
    _fault_plugin(tmp_path, "sgjoin", JOIN_SPY)
    spy = tmp_path / "rows.log"
    srv = launch_mlx(tmp_path / "srv", draft=True, max_tokens=MAX_TOKENS,
                     extra=["--plugin", "sgjoin", "--log-level", "INFO"], root=patched_mlx_root(tmp_path / "mlx"),
                     env={"PYTHONPATH": str(tmp_path), "SG_JOIN_LOG": str(spy)})
    client = srv.client()

    def ask(ex):
        r = client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": ex.prompt}], max_tokens=MAX_TOKENS,
            temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ex.constraint.schema}})
        return r.choices[0].message.content

    def rows():
        return [int(x) for x in spy.read_text().split()] if spy.exists() else []

    try:
        start = len(srv.log.read_text())
        assert ask(exs[0]) == refs[0]  # alone, nothing else in flight
        assert rows() and set(rows()) == {1}, rows()  # a batch of one
        alone = len(rows())
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask, exs[0])
            t0 = time.monotonic()
            while len(rows()) == alone and time.monotonic() - t0 < 60:
                time.sleep(0.01)  # the first request is decoding on the batching path
            second = pool.submit(ask, exs[1])
            assert [first.result(), second.result()] == refs
        assert max(rows()[alone:]) == 2, rows()  # the second joined the first's batch
        log = srv.log.read_text()[start:]
        assert len(re.findall(r"specgrammar batch: \d+ tokens", log)) == 3, log[-3000:]
        assert not re.findall(r"specgrammar: \d+ tokens", log), log[-3000:]  # never our serial loop
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------ speculative rows
class _Guard:
    """The server's ``_RowProcessors`` (the patch): a request's processors as one, its fault kept in ``error``."""

    def __init__(self, processors):
        self.processors = list(processors)
        self.error = None

    def __call__(self, tokens, logits):
        if self.error is None:
            try:
                for p in self.processors:
                    logits = p(tokens, logits)
            except Exception as e:
                self.error = e
        return logits


class _FailingConstraint:
    """A compiled constraint whose matchers fail at their ``n``-th accepted token (a fault mid-way in one row)."""

    def __init__(self, compiled, n):
        self._c, self._n = compiled, n

    def __getattr__(self, name):
        return getattr(self._c, name)

    def matcher(self):
        return _FailingMatcher(self._c.matcher(), self._n)


class _FailingMatcher:
    def __init__(self, m, n):
        self._m, self._n, self.calls = m, n, 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def accept(self, t):
        self.calls += 1
        if self.calls == self._n:
            raise RuntimeError("injected fault in this row's matcher")
        return self._m.accept(t)


def _served(model, prompts, processors, eos, max_tokens=MAX_TOKENS, steps=500):
    """``_batched`` as the server reads the responses: a row whose guarded processors hold an error is done (the
    server answers the error and removes the row)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts),
                         stop_tokens=[[e] for e in sorted(eos)])
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts), logits_processors=processors)
    guards = {u: (p[0] if p else None) for u, p in zip(uids, processors)}
    out = {u: [] for u in uids}
    done = set()
    try:
        for _ in range(steps):
            if len(done) == len(uids):
                break
            for r in gen.next_generated():
                if r.uid in done:
                    continue
                if guards[r.uid] is not None and guards[r.uid].error is not None:
                    done.add(r.uid)
                    gen.remove([r.uid])
                    continue
                out[r.uid].append(int(r.token))
                if r.finish_reason is not None:
                    done.add(r.uid)
        assert len(done) == len(uids), "rows left unfinished"
    finally:
        gen.close()
    return [out[u] for u in uids]


def _spec_processors(provider, body, k=4):
    """The plugin's processors for a batched request with its sampling options (a speculative row)."""
    from specgrammar_mlx_lm import server_plugin

    fields = server_plugin.request_fields(body, provider)
    args = SimpleNamespace(plugin_fields=fields, max_tokens=body["max_tokens"], num_draft_tokens=k,
                           sampling=SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                                    xtc_probability=0.0))
    return server_plugin.logits_processors(args, provider.tokenizer, provider.model)


def test_speculative_rows_on_the_batching_path(tiny, monkeypatch):
    """The batching path with the plugin's ``SpecGenerationBatch`` (``generation_batch_class``, what the patched
    server builds its ``BatchGenerator`` with): twelve constrained requests of six workloads, one unconstrained
    request (a plain row in the same forward) and one whose matcher fails at its 6th token.  Each constrained row's
    greedy output equals the same request decoded alone (mlx-lm's ``generate_step`` with its processor), the
    unconstrained one equals mlx-lm's plain greedy decoding, the failing row's error is kept for the server to
    answer, and the batch takes fewer target forwards than the longest row has tokens."""
    import importlib

    from specgrammar_mlx_lm import server_plugin
    from specgrammar_mlx_lm.batch_server import generation_batch_class

    from test_mlx_common import CountingModel, plain_generate_step, prompt_ids

    model, tok = tiny
    provider = _provider(model, tok)
    monkeypatch.setitem(server_plugin._config, "batch_drafts", "on")
    assert server_plugin.generation_batch_class(provider) is generation_batch_class()
    G = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(G, "GenerationBatch", generation_batch_class())  # what the patch's hook does
    rows = _rows(tok)
    procs = [[_Guard(_spec_processors(provider, _body(ex)))] for _, ex, _ in rows]
    assert all(p[0].processors[0].batch_row is not None for p in procs)
    prompts = [p for _, _, p in rows]
    fault = _Guard(_spec_processors(provider, _body(rows[0][1])))
    plan = fault.processors[0].batch_row
    fault.processors[0].batch_row = replace(plan, compiled=_FailingConstraint(plan.compiled, 6))
    hello = prompt_ids(tok, "Say hello")
    eos = set(tok.eos_token_ids)
    counting = CountingModel(model)
    outs = _served(counting, prompts + [hello, rows[0][2]], procs + [[], [fault]], eos)
    *outs, plain, failed = outs
    for (w, ex, prompt), out in zip(rows, outs):
        _, (alone,) = _processors(provider, _body(ex))
        assert out == plain_generate_step(model, prompt, processor=alone, max_tokens=MAX_TOKENS, eos_ids=eos), w
    assert plain == plain_generate_step(model, hello, max_tokens=MAX_TOKENS, eos_ids=eos)
    assert isinstance(fault.error, RuntimeError) and "injected" in str(fault.error), fault.error
    assert len(failed) < 6  # answered up to its fault (drafts reach the matcher first: maybe nothing)
    longest = max(len(o) for o in outs)
    assert counting.calls < longest, (counting.calls, longest)  # prefill + one batched forward per round


def test_speculative_rows_with_the_draft_model(tiny, monkeypatch):
    """A server with a draft model (``generation_batch_class(draft)``, what the plugin answers then): the batched
    rows of six workloads draft with it as our loop does, the rows' draft models in ONE batched draft forward per
    draft position (``MLXDraftBatch``, several rows per pass), and each row's greedy output equals the same request
    decoded alone (mlx-lm's ``generate_step`` with its processor: plain constrained decoding)."""
    import importlib

    from mlx_lm import load

    from specgrammar_mlx_lm import batch_server, server_plugin

    from test_mlx_common import plain_generate_step

    model, tok = tiny
    draft, _ = load(str(tiny_model_dirs()[1]))
    provider = _provider(model, tok)
    provider.draft_model = draft
    monkeypatch.setitem(server_plugin._config, "batch_drafts", "on")
    cls = server_plugin.generation_batch_class(provider)
    assert cls.draft_model is draft and issubclass(cls, batch_server.generation_batch_class())
    G = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(G, "GenerationBatch", cls)
    asks = []
    call = batch_server.MLXDraftBatch.__call__
    monkeypatch.setattr(batch_server.MLXDraftBatch, "__call__", lambda self, a: asks.append(len(a)) or call(self, a))
    rows = _rows(tok, 1)
    procs = [[_Guard(_spec_processors(provider, _body(ex)))] for _, ex, _ in rows]
    outs = _served(model, [p for _, _, p in rows], procs, set(tok.eos_token_ids))
    assert all(p[0].error is None for p in procs)
    for (w, ex, prompt), out in zip(rows, outs):
        _, (alone,) = _processors(_provider(model, tok), _body(ex))
        assert out == plain_generate_step(model, prompt, processor=alone, max_tokens=MAX_TOKENS,
                                          eos_ids=set(tok.eos_token_ids)), w
    assert asks and max(asks) > 1, asks  # the draft model drafted, for several rows in one pass


def test_a_request_with_its_own_k_is_a_batched_row(tiny, monkeypatch):
    """A constrained request with its own ``specgrammar.k`` (and drafters) is no longer sent to our serial loop:
    ``is_batchable`` does not vote against batching, the ``stream_generate`` hook leaves it to the batching path,
    and in the batch its row runs a loop with that k and those drafters (spied on ``make_loop``), its greedy output
    equal to plain constrained decoding.  Without a constraint, a request asking for drafts still goes to our
    loop."""
    import importlib

    from specgrammar_mlx_lm import batch_server, server_plugin
    from specgrammar_plugins.workloads import examples

    from test_mlx_common import plain_generate_step, prompt_ids

    model, tok = tiny
    provider = _provider(model, tok)
    monkeypatch.setitem(server_plugin._config, "batch_drafts", "on")
    G = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(G, "GenerationBatch", batch_server.generation_batch_class())
    loops = []
    from specgrammar_plugins import serving  # (a batched row's loop starts there: ServedRow.start)

    make = serving.make_loop
    monkeypatch.setattr(serving, "make_loop", lambda *a, **kw: loops.append(make(*a, **kw)) or loops[-1])
    ex = examples("json_extraction", "eval", 1)[0]
    body = {**_body(ex), "specgrammar": {"k": 1, "drafters": ["forced", "prompt"]}}
    fields = server_plugin.request_fields(json.loads(json.dumps(body)), provider)
    args = SimpleNamespace(plugin_fields=fields, max_tokens=MAX_TOKENS, num_draft_tokens=4,
                           sampling=SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                                    xtc_probability=0.0))
    assert not fields["specgrammar"].loop and server_plugin.is_batchable(args, provider, 0) is None
    assert server_plugin.stream_generate(model, tok, None, [], None, None, args, None, None, {}) is None
    own = _Guard(server_plugin.logits_processors(args, tok, model))
    other = _Guard(_spec_processors(provider, _body(ex)))
    prompt = prompt_ids(tok, ex.prompt)
    out, out_default = _served(model, [prompt, prompt], [[own], [other]], set(tok.eos_token_ids))
    assert len(loops) == 2 and [lp.k for lp in loops] == [1, 4]
    assert [d.name for d in loops[0].drafter.drafters] == ["forced", "prompt"] and loops[0].stats.rounds > 1
    _, (alone,) = _processors(provider, _body(ex))
    plain = plain_generate_step(model, prompt, processor=alone, max_tokens=MAX_TOKENS, eos_ids=set(tok.eos_token_ids))
    assert out == plain and out_default == plain
    free = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "specgrammar": {"k": 2}}
    assert server_plugin.request_fields(free, provider)["specgrammar"].loop  # unconstrained drafting: our loop


@pytest.mark.slow  # 9-15 s (300 rows in 5 batches, the exact law enumerated twice)
def test_speculative_rows_keep_the_law_at_t1(tiny, monkeypatch, caplog):
    """The batching path's speculative rows at T = 1, drafting with the server's draft model (one batched draft
    forward per position), verified in batched forwards: 300 rows of the email grammar (``test_mlx_law``'s
    ``email`` case: [a-d]{1,3}), in batches of 60 (odd batches with one plain row more: there the rows' first token
    is mlx-lm's sample under the grammar processor; else each row's loop feeds the prompt's last token with its
    first drafts), against the enumerated law of plain constrained sampling (chi-square, fails below p = 1e-3); the
    same samples against the T = 0.7 law must fail."""
    import importlib

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from specgrammar_mlx_lm.batch_server import generation_batch_class
    from specgrammar_mlx_lm.processor import GrammarLogitsProcessor
    from specgrammar_plugins.api import SamplingParams, SpecOptions

    from test_mlx_law import P_FLOOR, chi_square_p, exact_law, law_case

    from specgrammar_plugins.api import RowPlan

    from mlx_lm import load

    model, tok = tiny
    draft, _ = load(str(tiny_model_dirs()[1]))
    ids, compiled = law_case((model, None, tok), "email")
    G = importlib.import_module("mlx_lm.generate")
    monkeypatch.setattr(G, "GenerationBatch", generation_batch_class(draft))
    from specgrammar_mlx_lm import batch_server

    passes = []
    call = batch_server.MLXDraftBatch.__call__
    monkeypatch.setattr(batch_server.MLXDraftBatch, "__call__", lambda self, a: passes.append(len(a)) or call(self, a))
    eos = set(tok.eos_token_ids)
    mx.random.seed(0)
    caplog.set_level(logging.INFO, logger="specgrammar.mlx_lm")
    samples, per = [], 60
    for b in range(300 // per):
        procs = []
        for i in range(per):
            p = GrammarLogitsProcessor(compiled)
            p.batch_row = RowPlan(compiled, SpecOptions(k=4), SamplingParams(temperature=1.0), 8, seed=1000 * b + i)
            procs.append([_Guard([p])])
        plain = [[]] * (b % 2)  # a plain row: the batch's first step is mlx-lm's
        outs = _batched(model, [ids] * (per + len(plain)), procs + plain, eos, max_tokens=8, sampler=make_sampler(1.0))
        samples += map(tuple, outs[:per])
    assert all(g.error is None for p in procs for g in p)
    rows = [tuple(map(int, m.groups())) for m in
            (re.search(r"batch: (\d+) tokens, (\d+) target passes", r.getMessage()) for r in caplog.records) if m]
    assert len(rows) == 300 and sum(t for t, _ in rows) > sum(p for _, p in rows) + 50  # drafts were accepted
    assert passes and max(passes) > 1  # the rows' draft models, several rows per batched draft pass
    p1 = chi_square_p(samples, exact_law(model, ids, compiled, SamplingParams(temperature=1.0)))
    print(f"speculative rows, email T=1: chi-square p {p1:.3g}")
    assert p1 > P_FLOOR
    assert chi_square_p(samples, exact_law(model, ids, compiled, SamplingParams(temperature=0.7))) < P_FLOOR
