"""The vLLM launcher (``python -m specgrammar_vllm.serve``) under the inputs of issue 33: constraints whose cost is
unbounded though they look valid, keywords vLLM's backend would not enforce, unknown names, oversize bodies and
non-ASCII text in every field.

One launcher per module (the bundled tiny target, ``GrammarProposer``, engine in-process), started by
``servers.launch_vllm``; the requests are sent and checked with ``test_hostile.Host``.  Every hostile body must be
answered within the preparation deadline + 1 s (``bounds``: 5 s of CPU, measured as the CPU of the launcher's API
server's threads off its event loop and of its compile workers over the request, less a killed worker's replacement's
start-up, as the deadline counts it; or the wall-clock time where that is less; and the 30 s wall-clock backstop +
1 s) with a 4xx
JSON error naming the reason, or with a correct 200 where the request is valid; while it is prepared, ``/health`` is polled and must answer within 1 s each
time; after it the server must be alive and serve a valid constrained request correctly.  Each reply is tallied
(clear 4xx / 200 correct / closed / 5xx / wedged); ``pytest -s`` prints the counts at the end.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from servers import launch_vllm
from test_hostile import Host, Reply

pytest.importorskip("vllm")

DEADLINE_S = 5.0  # bounds.BOUNDS.prepare_timeout_s (SPECGRAMMAR_PREPARE_TIMEOUT_S): CPU time
WALL_S = 30.0  # bounds.BOUNDS.wall_s() (SPECGRAMMAR_PREPARE_WALL_S): its wall-clock backstop
ANSWER_S = DEADLINE_S + 1.0
HEALTH_S = 1.0
WEDGED_S = 60.0  # no answer by then: wedged
RSS_SLACK_MB = 200  # issue 33: the server's memory comes back within this of its baseline
TALLY: dict[str, int] = {}
HEALTH_MAX: list[float] = []
RSS: dict[str, float] = {}


def server_rss_mb(pid: int, name: str) -> float:
    """The RSS of the launcher and its processes (vLLM's EngineCore), without the compile workers (at most
    ``SPECGRAMMAR_COMPILE_WORKERS``, each killed and replaced on a deadline: their memory goes with them); each
    process's is kept in ``RSS`` under ``name``."""
    import psutil

    root = psutil.Process(pid)
    procs = [root] + [p for p in root.children(recursive=True)
                      if "specgrammar_plugins.compile_worker" not in " ".join(p.cmdline())]
    for i, p in enumerate(procs):
        RSS[f"{name}:{'api server' if i == 0 else p.pid}"] = p.memory_info().rss / 2**20
    return sum(p.memory_info().rss for p in procs) / 2**20


def server_cpu(pid: int) -> dict[str, float]:
    """The CPU seconds, by part, that the launcher's API server's threads but its event loop (the gate prepares a
    request in a thread off the loop; the loop answers ``/health``) and its compile workers have used: ``"threads"``,
    ``"reaped"`` (its children's times: workers killed on a deadline) and ``"worker:<pid>"`` per live compile
    worker; not vLLM's EngineCore, which prepares nothing."""
    import psutil

    root = psutil.Process(pid)
    t = root.cpu_times()
    out = {"reaped": t.children_user + t.children_system,
           "threads": sum(th.user_time + th.system_time for th in root.threads() if th.id != pid)}
    for p in root.children(recursive=True):
        try:
            if "specgrammar_plugins.compile_worker" in " ".join(p.cmdline()):
                t = p.cpu_times()
                out[f"worker:{p.pid}"] = t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return out


def request_cpu_s(before: dict[str, float], after: dict[str, float]) -> float:
    """The server's CPU over one request, from two ``server_cpu`` readings: the threads, the reaped workers and the
    workers alive at both readings.  A worker born in between is left out: it is the replacement of a worker killed
    on the request's deadline (``compile_worker``'s pool starts one at once, in the background), and its start-up
    (imports, tokenizer upload: 20-40 s of CPU at load 3-6) is not the request's work; ``bounds.Deadline`` leaves a
    worker's start-up out the same way (``Deadline.excluded``)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if not k.startswith("worker:") or k in before)


def settle_workers(pid: int, quiet_s: float = 0.25, limit_s: float = 90.0) -> None:
    """Wait (at most ``limit_s``) until no compile worker of the server uses CPU for ``quiet_s``: a replacement
    started for an earlier request's killed worker finishes its start-up before the next probe's clock starts."""
    end = time.monotonic() + limit_s
    last = server_cpu(pid)
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = server_cpu(pid)
        if all(now[k] - last.get(k, 0.0) < 0.05 * quiet_s for k in now if k.startswith("worker:")):
            return
        last = now


def in_time(r: Reply, cpu: float) -> bool:
    """Answered within the deadline + 1 s: the server's CPU over the request (or the wall-clock time where that is
    less) under the CPU limit + 1 s, and the wall-clock time under the backstop + 1 s (a loaded machine stretches
    the wall-clock time alone; ``bounds.Deadline``)."""
    return min(r.seconds, cpu) < ANSWER_S and r.seconds < WALL_S + 1.0


def doubling(n: int) -> str:
    """GBNF of ``n`` doubling rules: one string of 2^n bytes."""
    return "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(n)) + f'\nr{n} ::= "a"'


def schema(s: dict, name: bool = True) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {**({"name": "x"} if name else {}),
                                                                         "schema": s}}}


PERSON = {"type": "object", "properties": {"名前": {"enum": ["ñandú", "🦀", "שלום"]}, "âge": {"type": "integer"}},
          "required": ["名前", "âge"], "additionalProperties": False}
CHAIN = "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(3000)) + '\nr3000 ::= "b"'

# id -> (fields of a chat request, or raw bytes; expected status; what the answer must say (a regex on the error
# message, or for a 200 a check of the content))
REFUSED = {
    "doubling-24-gbnf": ({"grammar": doubling(24)}, 400, r"SPECGRAMMAR_MAX_FORCED_BYTES"),
    "doubling-20-gbnf": ({"grammar": doubling(20)}, 400, r"SPECGRAMMAR_MAX_FORCED_BYTES"),
    "doubling-24-vllm-ebnf": ({"structured_outputs": {"grammar": doubling(24)}}, 400, r"SPECGRAMMAR_MAX_FORCED_BYTES"),
    "repeat-2^32": ({"structured_outputs": {"regex": "a{0,4294967295}"}}, 400, r"SPECGRAMMAR_MAX_REPEAT"),
    "repeat-10^8": ({"regex": "[0-9]{1,100000000}"}, 400, r"SPECGRAMMAR_MAX_REPEAT"),
    "nested-repeat": ({"regex": "(a{1000}){1000}"}, 400, r"SPECGRAMMAR_MAX_EXPANSION"),
    "regex-16MB": ({"regex": "a" * (16 << 20)}, 400, r"16777216 bytes; the limit is 1048576"),
    "enum-1MB": ({"structured_outputs": {"json": {"enum": [f"valeur-{i:06d}-é" for i in range(70000)]}}}, 400,
                 r"SPECGRAMMAR_MAX_CHOICES|SPECGRAMMAR_MAX_CONSTRAINT_BYTES"),
    "minItems-10^9": (schema({"type": "array", "items": {"type": "integer"}, "minItems": 1000000000}), 400,
                      r"SPECGRAMMAR_MAX_ITEMS"),
    "properties-10k": (schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10000)}}),
                       400, r"SPECGRAMMAR_MAX_PROPERTIES"),
    "rules-3000": ({"grammar": CHAIN}, 400, r"SPECGRAMMAR_MAX_RULES"),
    "oneOf-overlapping": (schema({"oneOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 10}]}),
                          400, r"'oneOf' at /oneOf is not enforced by xgrammar"),
    "not": ({"structured_outputs": {"json": {"type": "string", "not": {"const": "é"}}}}, 400,
            r"'not' at /not is not enforced"),
    "vllm-ebnf-empty-alternative": ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, 400, r"EBNF parser error"),
    "drafters-bogus": ({"regex": "[0-9]{4}", "specgrammar": {"drafters": ["bogus"]}}, 400,
                       r"specgrammar\.drafters names unknown drafter\(s\) 'bogus'; available: .*forced"),
    "drafters-non-ascii": ({"regex": "[0-9]{4}", "specgrammar": {"drafters": ["forced", "ドラフト"]}}, 400,
                           r"unknown drafter\(s\) 'ドラフト'"),
    "recipe-non-ascii": ({"regex": "[0-9]{4}", "specgrammar": {"recipe": "ñandú"}}, 400,
                         r"specgrammar\.recipe must be the name of a recipe pack"),
    "model-slash": ({"model": "no/such-model"}, 404, r"'no/such-model' is not served here; this server serves "
                                                     r"'default_model'"),
    "model-path": ({"model": "/etc"}, 404, r"'/etc' is not served here"),
    "model-emoji": ({"model": "模型🤖"}, 404, r"'模型🤖' is not served here"),
    "budget-exponential": ({"structured_outputs": {"regex": "(a|b)*a(a|b){25}"}, "max_tokens": 16}, 400,
                           r"takes 27 tokens|preparation time limit"),
    "non-ascii-choice-past-the-budget": ({"choice": ["日本語", "ελληνικά", "🦀🦀"], "max_tokens": 4}, 400,
                                         r"takes \d+ tokens .*but the budget is 4"),  # (was a 500 from the engine)
    "client-chat-template": ({"chat_template_kwargs": {"chat_template": "{% for i in range(6000) %}{% for j in "
                                                       "range(6000) %}x{% endfor %}{% endfor %}"}}, 400,
                             r"chat_template is not accepted by the vLLM launcher"),
    "stop-surrogate": (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', 400,
                       r"stop\[0\] holds a lone surrogate"),
    "prompt-surrogate": (b'{"messages": [{"role": "user", "content": "caf\\u00e9 \\udfff"}]}', 400,
                         r"messages\[0\]\.content holds a lone surrogate"),
    "trigger-surrogate": (b'{"messages": [{"role": "user", "content": "hi"}], "regex": "a", '
                          b'"specgrammar": {"trigger": "\\ud800"}}', 400, r"specgrammar\.trigger holds a lone"),
}


def _regex(pattern: str):
    return lambda content: re.fullmatch(pattern, content) is not None


def _instance(s: dict):
    def check(content: str) -> bool:
        import jsonschema

        try:
            jsonschema.validate(json.loads(content, strict=False), s)  # (xgrammar lets control characters in)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    return check


ONEOF = {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}
SERVED = {  # valid requests among them: a correct 200
    "gbnf-empty-alternative": ({"grammar": 'root ::= "a" |'}, _regex("a?")),
    "oneOf-disjoint-rewritten": (schema(ONEOF), _instance(ONEOF)),
    "json_schema-without-name": (schema({"type": "integer"}, name=False), _regex("-?[0-9]+")),
    "lark-in-structured_outputs": ({"structured_outputs": {"grammar": 'start: "ja" | "nein"'}}, _regex("ja|nein")),
    "non-ascii-schema": ({**schema(PERSON), "max_tokens": 96}, _instance(PERSON)),
    "non-ascii-choice": ({"choice": ["日本語", "ελληνικά", "🦀🦀"], "max_tokens": 48}, _regex("日本語|ελληνικά|🦀🦀")),
    "exponential-regex-that-fits": ({"structured_outputs": {"regex": "(a|b)*a(a|b){25}"}, "max_tokens": 64},
                                    _regex("(a|b)*a(a|b){25}")),
    "choice-20000": ({"choice": [f"opción-{i}" for i in range(20000)], "max_tokens": 24},
                     _regex(r"opción-\d+")),
}


class Probe(Host):
    """``test_hostile.Host`` with the health checks of issue 33 while a body is prepared."""

    def probe(self, fields) -> tuple[Reply, float]:
        """Send a hostile body while polling ``/health``; (the reply, the slowest health check meanwhile)."""
        out: dict = {}
        if isinstance(fields, bytes):
            job = threading.Thread(target=lambda: out.update(r=self.send(raw=fields, timeout=WEDGED_S)))
        else:
            body = self.chat(**{"max_tokens": 16, **fields})
            job = threading.Thread(target=lambda: out.update(r=self.send(body, timeout=WEDGED_S)))
        settle_workers(self.launched.pid)
        cpu = server_cpu(self.launched.pid)
        job.start()
        slowest = 0.0
        while job.is_alive():
            slowest = max(slowest, self.health())
            job.join(0.2)
        after = server_cpu(self.launched.pid)
        self.cpu = request_cpu_s(cpu, after)  # (the health checks' share is small)
        self.cpu_parts = {k: round(v - cpu.get(k, 0.0), 2) for k, v in after.items() if v - cpu.get(k, 0.0) >= 0.01}
        HEALTH_MAX.append(slowest)
        return out.get("r", Reply(None, "wedged", WEDGED_S)), slowest

    def after(self, slowest: float) -> None:
        assert self.launched.proc.poll() is None, "the server died"
        assert slowest < HEALTH_S, f"a health check took {slowest:.2f} s while the request was prepared"
        assert self.health() < HEALTH_S
        self.serves()


def tally(reply: Reply, ok: bool, clear_4xx: bool) -> None:
    kind = ("closed" if reply.status is None else "wedged" if reply.seconds >= WEDGED_S
            else "5xx" if reply.status >= 500 else "clear 4xx" if clear_4xx and ok
            else "200 correct" if ok else f"wrong {reply.status}")
    TALLY[kind] = TALLY.get(kind, 0) + 1


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile-vllm")
    launched = launch_vllm(work, k=4)
    probe = Probe("vllm", launched, work, None, None)
    # the gate's warm-up (served tokenizer, compile workers: seconds, once per process) is not a request's: a first
    # constrained request waits for it, before the clock of any probe starts
    warm = probe.send(probe.chat(structured_outputs={"regex": "[0-9]{4}"}), timeout=300)
    assert warm.status == 200, (warm.status, warm.body)
    RSS["baseline"] = server_rss_mb(launched.pid, "baseline")
    try:
        yield probe
    finally:
        if launched.proc.poll() is None:  # the memory after every body, the valid costly ones included (printed)
            server_rss_mb(launched.pid, "end")
        launched.stop()
        print(f"\nhostile vLLM probe: {sum(TALLY.values())} bodies: {json.dumps(TALLY)}; slowest health check "
              f"while one was prepared: {max(HEALTH_MAX, default=0):.2f} s; requests sent: "
              f"{sum(probe.sent.values())}; RSS MB: {json.dumps({k: round(v) for k, v in RSS.items()})}")


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_hostile_body_is_a_clear_4xx_in_time(vllm, case):
    fields, status, reason = REFUSED[case]
    r, slowest = vllm.probe(fields)
    ok = (r.status == status and isinstance(r.body, dict) and re.search(reason, r.message) is not None
          and in_time(r, vllm.cpu))
    tally(r, ok, True)
    assert r.status == status, (r.status, r.body)
    assert isinstance(r.body, dict) and re.search(reason, r.message), (reason, r.message)
    assert in_time(r, vllm.cpu), (f"answered in {r.seconds:.2f} s, {vllm.cpu:.2f} s of the server's CPU: "
                                   f"{vllm.cpu_parts}")
    vllm.after(slowest)


def test_the_memory_comes_back(vllm):
    """After every refused body above (run before it, in file order), the server's RSS is within 200 MB of its
    baseline (taken after the first constrained request).  Measured before the valid costly ones below: a
    20,000-option choice or ``(a|b)*a(a|b){25}`` served in time leaves its compiled grammars in the engine's caches
    (+870 MB seen in one run before ``heap.give_back``, +345 MB after it; docs/HARDENING.md)."""
    RSS["after"] = server_rss_mb(vllm.launched.pid, "after")
    assert RSS["after"] < RSS["baseline"] + RSS_SLACK_MB, RSS


@pytest.mark.parametrize("case", list(SERVED))
def test_a_valid_body_is_served_correctly_or_refused_in_time(vllm, case):
    """Valid but costly or unusual: served correctly, or (the costly ones) a 400 naming the deadline in time."""
    fields, check = SERVED[case]
    r, slowest = vllm.probe(fields)
    print(f"\n{case}: {r.status} after {r.seconds:.2f} s, {vllm.cpu:.2f} s of the server's CPU {vllm.cpu_parts}")
    if r.status == 400 and case in ("choice-20000", "exponential-regex-that-fits"):
        ok = "preparation time limit" in r.message and in_time(r, vllm.cpu)
        tally(r, ok, True)
        assert ok, (r.seconds, vllm.cpu, vllm.cpu_parts, r.message)
    else:
        ok = r.status == 200 and check(r.content)
        tally(r, ok, False)
        assert ok, (r.status, r.body)
    vllm.after(slowest)


def test_the_memory_comes_back_after_the_valid_costly_bodies(vllm):
    """After the valid costly bodies above (the 20,000-option choice, ``(a|b)*a(a|b){25}``) and the ordinary
    request after each, every process of the launcher (the API server, vLLM's EngineCore) is within 200 MB of its
    baseline.  The API server: glibc kept what the gate's preparation freed (+518-533 MB) until ``heap.give_back``
    trimmed it at the end of each preparation (+91 MB measured, the compile cache's share).  The EngineCore: +261
    and +267 MB before ``budget_mask._drop_costly`` emptied its compile caches after a compile that grew its heap
    past the trim slack, with a full collection and a trim at the next compile; +157 MB after (docs/HARDENING.md,
    "Memory after costly valid requests")."""
    server_rss_mb(vllm.launched.pid, "served")
    grown = {k.split(":", 1)[1]: v - RSS[f"baseline:{k.split(':', 1)[1]}"] for k, v in RSS.items()
             if k.startswith("served:") and f"baseline:{k.split(':', 1)[1]}" in RSS}
    assert "api server" in grown and len(grown) >= 2, RSS  # (the EngineCore: the same pid since the baseline)
    assert max(grown.values()) < RSS_SLACK_MB, (grown, RSS)


def test_an_oversize_body_is_a_413_before_it_is_read(vllm):
    """A ``Content-Length`` past ``SPECGRAMMAR_MAX_BODY_BYTES`` (64 MiB) is refused from the header alone."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n")
    r = vllm.send_raw_socket(head, b'{"messages": [', half_close=False, wait=ANSWER_S + 4)
    ok = r.status == 413 and "SPECGRAMMAR_MAX_BODY_BYTES" in r.message and r.seconds < ANSWER_S
    tally(r, ok, True)
    assert ok, (r.status, r.body, r.seconds)
    vllm.after(0.0)

