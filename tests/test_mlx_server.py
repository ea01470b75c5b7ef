"""``mlx_lm.server --plugin specgrammar`` over HTTP, with the ``openai`` client, on the bundled tiny models.

The server runs as a real process on 127.0.0.1 from a patched copy of the installed mlx-lm (``specgrammar patch
mlx-lm --target COPY``; the venv's mlx-lm is left alone), once with ``--draft-model`` (our speculative loop) and
once without (mlx-lm's batching path with the history-keyed processor).  Every structured request must return
output that validates; invalid constraints get HTTP 400 with the reason while the server keeps serving; 8
concurrent requests all validate; a greedy request gives the same text before and after 10 other requests.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from servers import launch_mlx, patched_mlx_root
from test_mlx_common import tiny_model_dirs

openai = pytest.importorskip("openai")
pytest.importorskip("mlx_lm")

from specgrammar_plugins.workloads import STRUCTURED, constraint, examples, is_valid  # noqa: E402
from specgrammar_plugins.workloads import JSON_EXTRACTION_SCHEMA, TOOL_CALL_SCHEMA  # noqa: E402

MAX_TOKENS = 64


class Server:
    """A launched ``mlx_lm.server --plugin specgrammar`` with an ``openai`` client."""

    def __init__(self, launched):
        self.launched = launched
        self.port = launched.port
        self.log = launched.log
        self.client = launched.client()

    def chat(self, user: str, **kw):
        kw.setdefault("max_tokens", MAX_TOKENS)
        kw.setdefault("temperature", 0.0)
        return self.client.chat.completions.create(model="default_model",
                                                   messages=[{"role": "user", "content": user}], **kw)

    def stop(self):
        self.launched.stop()


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory):
    tiny_model_dirs()
    return patched_mlx_root(tmp_path_factory.mktemp("mlx"))


@pytest.fixture(scope="module")
def references():
    """Per structured workload, eval prompts whose greedy constrained answer (mlx-lm's own ``generate_step`` with
    our processor, in this process) ends within MAX_TOKENS, with that answer.  A structured output cut off by
    max_tokens cannot validate, and the tiny model loops (e.g. on JSON whitespace) on a few prompts: those are
    left out here, so every server request below must both validate and equal the in-process greedy answer."""
    from mlx_lm import load

    from specgrammar_mlx_lm.processor import grammar_logits_processor
    from test_mlx_common import plain_generate_step, prompt_ids

    t, _ = tiny_model_dirs()
    model, tok = load(str(t))
    eos = set(tok.eos_token_ids)
    refs = {}
    for w in STRUCTURED:
        good = []
        for ex in examples(w, "eval", 5):
            out = plain_generate_step(model, prompt_ids(tok, ex.prompt), max_tokens=MAX_TOKENS, eos_ids=eos,
                                      processor=grammar_logits_processor(ex.constraint, tok, model))
            if out and out[-1] in eos:
                good.append((ex.prompt, tok.decode(out[:-1])))
        refs[w] = good
    return refs


def _refs(references, workload, n=3):
    good = references[workload]
    if not good:
        pytest.skip(f"the tiny model does not finish any {workload} eval prompt within {MAX_TOKENS} tokens")
    return [good[i % len(good)] for i in range(n)]


@pytest.fixture(scope="module", params=["draft", "batch"])
def server(request, patched_root, tmp_path_factory):
    tiny_model_dirs()
    srv = Server(launch_mlx(tmp_path_factory.mktemp(f"server-{request.param}"), draft=request.param == "draft",
                            max_tokens=MAX_TOKENS, root=patched_root))
    srv.mode = request.param
    yield srv
    srv.stop()


# ------------------------------------------------------------------------------------------------ request spellings
def _spellings(workload: str) -> list[dict]:
    """Request fields asking for ``workload``'s constraint, in every spelling we accept."""
    spec = constraint(workload)
    if spec.kind == "json_schema":
        schema = spec.schema
        return [
            {"response_format": {"type": "json_schema", "json_schema": {"name": workload, "schema": schema}}},
            {"extra_body": {"json_schema": schema}},
            {"extra_body": {"structured_outputs": {"json": schema}, "specgrammar": {"k": 3}}},
        ]
    if spec.kind == "regex":
        return [
            {"response_format": {"type": "regex", "regex": spec.value}},
            {"extra_body": {"regex": spec.value}},
            {"extra_body": {"structured_outputs": {"regex": spec.value}}},
        ]
    return [
        {"response_format": {"type": "grammar", "grammar": spec.value, "syntax": "gbnf"}},
        {"extra_body": {"grammar": spec.value, "specgrammar": {"drafters": ["forced", "model"]}}},
        {"extra_body": {"structured_outputs": {"grammar": spec.value}}},
    ]


def _call(srv: Server, user: str, fields: dict, stream: bool = False, **kw) -> str:
    fields = dict(fields)
    extra = fields.pop("extra_body", None)
    if stream:
        chunks = srv.chat(user, stream=True, extra_body=extra, **fields, **kw)
        return "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    r = srv.chat(user, extra_body=extra, **fields, **kw)
    return r.choices[0].message.content


@pytest.mark.parametrize("workload", STRUCTURED)
def test_structured_requests_validate(server, references, workload):
    for i, (fields, (user, ref)) in enumerate(zip(_spellings(workload), _refs(references, workload))):
        stream = (i + STRUCTURED.index(workload)) % 2 == 1  # streaming and not, across spellings and workloads
        text = _call(server, user, fields, stream=stream)
        assert is_valid(workload, text), (server.mode, workload, fields, stream, text)
        assert text == ref, (server.mode, workload, fields, stream, text, ref)


def test_json_object_and_sampling(server, references):
    (user, _), = _refs(references, "json_extraction", 1)
    for seed in range(3):
        text = _call(server, user, {"response_format": {"type": "json_object"}, "seed": seed}, temperature=0.7)
        assert isinstance(json.loads(text, strict=False), dict), text
    (user, _), = _refs(references, "tool_call", 1)
    text = _call(server, user,
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TOOL_CALL_SCHEMA}},
                  "seed": 1}, temperature=0.7, top_p=0.9)
    assert is_valid("tool_call", text), text


def test_unconstrained_request_still_works(server):
    r = server.chat(examples("prose", "eval", 1)[0].prompt, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     r"invalid constraint|schema"),
    ({"extra_body": {"regex": "[0-9"}}, r"invalid constraint"),
    ({"extra_body": {"grammar": "root ::= missing_rule"}}, r"invalid constraint"),
    ({"extra_body": {"regex": "[0-9]+", "json_schema": {"type": "object"}}}, r"only one constraint"),
    ({"extra_body": {"regex": "[0-9]+", "specgrammar": {"k": -1}}}, r"specgrammar\.k"),
    ({"extra_body": {"regex": "[0-9]+", "specgrammar": {"drafters": ["nope"]}}}, r"unknown drafter"),
]


@pytest.mark.parametrize("fields,reason", BAD, ids=["schema", "regex", "grammar", "two", "k", "drafter"])
def test_invalid_constraint_is_a_400_and_the_server_keeps_serving(server, references, fields, reason):
    with pytest.raises(openai.BadRequestError) as e:
        _call(server, "Find the year: 1999", fields)
    assert e.value.status_code == 400
    body = e.value.response.text
    assert re.search(reason, body), body
    (user, ref), = _refs(references, "year", 1)
    assert _call(server, user, {"extra_body": {"regex": constraint("year").value}}) == ref


def test_budget_feasibility_over_http(server, references):
    """On by default: a max_tokens the constraint cannot end within is a 400 naming the shortest length; a
    max_tokens below the model's own answer still gives a complete, valid answer (the exact bound in the batching
    path's processor row for a regex; a JSON Schema on xgrammar, whose bound is certified, is served by our loop);
    ``budget_mask: false`` gives the cut-off answer back."""
    with pytest.raises(openai.BadRequestError) as e:
        _call(server, "Find the year: 1999", {"extra_body": {"regex": constraint("year").value}}, max_tokens=2)
    assert e.value.status_code == 400 and re.search(r"shortest completion .* takes \d+ tokens", e.value.response.text)
    for w, fields in (("email", {"extra_body": {"regex": constraint("email").value}}),
                      ("json_extraction", {"extra_body": {"json_schema": JSON_EXTRACTION_SCHEMA}})):
        (user, ref), = _refs(references, w, 1)
        with pytest.raises(openai.BadRequestError) as e:
            _call(server, user, fields, max_tokens=1)
        n = int(re.search(r"takes (\d+) tokens", e.value.response.text).group(1)) + 1  # shortest + 1: below the answer
        tight = _call(server, user, fields, max_tokens=n)
        assert is_valid(w, tight) and tight != ref, (server.mode, w, tight)
        off = dict(fields, extra_body={**fields["extra_body"], "specgrammar": {
            **fields["extra_body"].get("specgrammar", {}), "budget_mask": False}})
        assert not is_valid(w, _call(server, user, off, max_tokens=n)), (server.mode, w)


def test_eight_concurrent_requests_all_valid(server, references):
    jobs = []
    for i in range(8):
        w = STRUCTURED[i % len(STRUCTURED)]
        user, _ = _refs(references, w, 2)[i // len(STRUCTURED)]
        jobs.append((w, user, _spellings(w)[0], i % 2 == 1))
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda j: _call(server, j[1], j[2], stream=j[3]), jobs))
    for (w, _, _, _), text in zip(jobs, outs):
        assert is_valid(w, text), (server.mode, w, text)


def test_same_greedy_request_same_text_after_other_requests(server, references):
    """Regression (mlx-lm 0.32.2, --draft-model): the stored prompt cache was one token short of its key when a
    request ended on the target's own token, so a repeated greedy request changed its text."""
    (user, ref), = _refs(references, "json_extraction", 1)
    fields = {"extra_body": {"json_schema": JSON_EXTRACTION_SCHEMA}}
    first = _call(server, user, fields)
    plain_first = server.chat(user, max_tokens=24).choices[0].message.content
    for i in range(10):
        w = STRUCTURED[i % len(STRUCTURED)]
        other, _ = _refs(references, w, 3)[i % 3]
        _call(server, other, _spellings(w)[i % 3], stream=i % 2 == 0)
    assert _call(server, user, fields) == first == ref
    assert server.chat(user, max_tokens=24).choices[0].message.content == plain_first
    assert _call(server, user, fields, stream=True) == first


def test_stock_patched_server_without_plugin_keeps_greedy_text(patched_root, tmp_path):
    """The patch alone (no plugin loaded) fixes the stock speculative path's cache key as well."""
    tiny_model_dirs()
    srv = Server(launch_mlx(tmp_path, draft=True, num_draft_tokens=3, max_tokens=MAX_TOKENS, plugin=False,
                            root=patched_root))
    try:
        def ask(user):
            return srv.chat(user, max_tokens=24).choices[0].message.content

        prompts = [e.prompt for w in ("year", "order_id", "email") for e in examples(w, "eval", 3)]
        first = [ask(p) for p in prompts[:3]]
        for p in prompts[3:]:
            ask(p)
        assert [ask(p) for p in prompts[:3]] == first
    finally:
        srv.stop()
