"""The holes of mlx-lm 0.32.2's own HTTP server that ``mlx_lm.server --plugin specgrammar`` inherited (issue 33, items
6, 7, 9, 10), closed in ``patches/mlx_lm-server-plugin.diff`` (each fix also as ``patches/upstream/*.diff``).

One real server per module (the patched copy of the installed mlx-lm, the bundled tiny target and draft, on
127.0.0.1, with ``--body-timeout 1 --header-timeout 1 --max-connections 16`` so that the slow-client cases take
seconds).  Every probe is bounded in time, and the server must answer ``/health`` within 1 s after each one:

- image content parts: refused with 400 on this text-only model; no URL is fetched (a listener on 127.0.0.1
  counts the connections it gets: none);
- stop strings end the generation and are never cut out of the middle of the text (streamed or not);
- logprobs name the chosen token, and the top ones come sorted;
- ``GET /v1/models`` answers OpenAI's list (and ``/v1/models/ID``);
- exactly one ``Content-Length`` of decimal digits (400 / 411 otherwise);
- the header and body timeouts are deadlines (a byte every 0.3 s gets its 408 at the deadline), and at most
  ``--max-connections`` connections hold threads: many slow clients all get an answer (408 or 503), the thread
  count stays bounded and a health check meanwhile answers at once;
- a lone surrogate anywhere in the body, ``stop`` and ``chat_template_kwargs`` of the wrong type: clear 400s.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from servers import launch_mlx, patched_mlx_root

pytest.importorskip("mlx_lm")

BODY_S = 1.0  # --body-timeout
HEADER_S = 1.0  # --header-timeout
MAX_CONNECTIONS = 16  # --max-connections
ANSWER_S = 2.0
PROMPT = [{"role": "user", "content": "Extract: Oscar Silva is 22 years old and lives in Lisbon."}]


class Server:
    def __init__(self, launched, root):
        self.launched, self.root = launched, root
        self.port, self.pid = launched.port, launched.pid

    def request(self, method, path, body=None, *, headers=None, timeout=30.0):
        """(status, parsed JSON body or text, seconds); status None: closed without a response."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        t0 = time.monotonic()
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            text = r.read().decode("utf-8", "replace")
            status = r.status
        except (http.client.RemoteDisconnected, ConnectionError):
            return None, None, time.monotonic() - t0
        finally:
            conn.close()
        try:
            return status, json.loads(text), time.monotonic() - t0
        except ValueError:
            return status, text, time.monotonic() - t0

    def chat(self, timeout=60.0, **fields):
        body = {"messages": PROMPT, "max_tokens": 40, "temperature": 0, **fields}
        return self.request("POST", "/v1/chat/completions", body, timeout=timeout)

    def healthy(self):
        status, body, seconds = self.request("GET", "/health", timeout=5)
        assert status == 200 and body == {"status": "ok"}, (status, body)
        assert seconds < 1.0, f"/health took {seconds:.2f} s"
        assert self.launched.proc.poll() is None

    def refused(self, reply, status, reason):
        code, body, seconds = reply
        assert code == status, (code, body)
        assert isinstance(body, dict) and re.search(reason, json.dumps(body["error"])), body
        assert seconds < ANSWER_S, f"answered in {seconds:.2f} s"
        self.healthy()

    def threads(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            return int(next(line for line in f if line.startswith("Threads:")).split()[1])

    def raw(self, data: bytes, *, wait: float = 5.0) -> tuple[bytes, float]:
        """Send ``data`` on a fresh connection and read until the server closes it (or ``wait``)."""
        s = socket.create_connection(("127.0.0.1", self.port), timeout=wait)
        t0 = time.monotonic()
        out = b""
        try:
            s.sendall(data)
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except OSError:
            pass
        finally:
            s.close()
        return out, time.monotonic() - t0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile-host")
    root = patched_mlx_root(work / "mlx")
    launched = launch_mlx(work, draft=True, max_tokens=64, root=root,
                          extra=["--body-timeout", str(BODY_S), "--header-timeout", str(HEADER_S),
                                 "--max-connections", str(MAX_CONNECTIONS)])
    try:
        yield Server(launched, root)
    finally:
        launched.stop()


def _status(response: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", response)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------- 6. SSRF
class Listener:
    """A TCP listener on 127.0.0.1 that counts the connections it gets (and never answers)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self):
        self.sock.close()


def test_image_parts_are_refused_on_a_text_model_and_no_url_is_fetched(server):
    """mlx-lm 0.32.2 fetched every http(s) image URL (127.0.0.1 included, 30 s timeout, no size bound) before the
    text-only model refused the request with 404."""
    listener = Listener()
    url = f"http://127.0.0.1:{listener.port}/x.png"
    try:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "image_url": url},
                 {"type": "input_image", "image_url": url.replace("http", "https")}, {"type": "image", "image": url},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
        for part in parts:
            msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
            server.refused(server.chat(messages=msgs, max_tokens=4), 400,
                           r"messages\[0\]\.content\[1\]: this model reads only text; image content parts are not "
                           r"accepted")
        msgs = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
        server.refused(server.chat(messages=msgs, max_tokens=4), 400, r"content type 'input_audio' is not supported")
        time.sleep(0.2)
        assert listener.connections == 0, f"the server connected to the URL {listener.connections} times"
    finally:
        listener.close()


def test_a_model_that_reads_images_takes_only_data_urls(server):
    """The check a vision model's requests get (no vision model is bundled: the patched server's function itself,
    in a subprocess on the patched copy)."""
    code = ("from mlx_lm.server import _check_content_parts as c\n"
            "u = [{'role': 'user', 'content': [{'type': 'text', 'text': 'x'}, {'type': 'image_url', "
            "'image_url': {'url': ''}}]}]\n"
            "for U in ('http://127.0.0.1:9/x.png', 'file:///etc/passwd', 'data:image/png;base64,AA=='):\n"
            "    u[0]['content'][1]['image_url']['url'] = U\n"
            "    print(repr(c(u, True)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(server.root), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[:2] == ["'messages[0].content[1]: images must be sent as data: URLs (the server does not fetch "
                         "URLs)'"] * 2, lines
    assert lines[2] == "None", lines


# ---------------------------------------------------------------------------------------------- 7. wrong 200s
def test_a_stop_string_ends_the_generation_and_is_never_cut_out(server):
    """mlx-lm 0.32.2 matched stop words on the tokens of each word alone and cut their text out wherever it
    appeared: ``"Oscar Silva"`` with ``stop: ["Sil"]`` came back as ``"Oscarva"`` and the generation went on."""
    status, body, _ = server.chat()
    assert status == 200, body
    full = body["choices"][0]["message"]["content"]
    n_full = body["usage"]["completion_tokens"]
    assert len(full) >= 12, full
    for start in (len(full) // 3, len(full) // 2):
        stop = full[start:start + 4]
        want = full[: full.find(stop)]
        status, body, _ = server.chat(stop=[stop])
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["message"]["content"] == want, (stop, choice["message"]["content"], full)
        assert choice["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] < n_full
        # streamed: the same text, and no chunk carries any of the stop string
        chunks = _stream(server, stop=[stop])
        assert "".join(c for c, _ in chunks) == want, (stop, chunks)
        assert chunks[-1][1] == "stop", chunks
    server.healthy()


def _stream(server, **fields) -> list[tuple[str, str | None]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"messages": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True, **fields}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    out = []
    for line in r.read().decode().splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            out.append((choice["delta"].get("content") or "", choice.get("finish_reason")))
    conn.close()
    return out


def test_logprobs_name_the_chosen_token_and_sort_the_top_ones(server):
    """mlx-lm 0.32.2 named ``argpartition``'s first (unordered) entry as the chosen token."""
    status, plain, _ = server.chat(max_tokens=10, logprobs=True)
    assert status == 200, plain
    chosen = [e["id"] for e in plain["choices"][0]["logprobs"]["content"]]
    for fields in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        status, body, _ = server.chat(max_tokens=10, logprobs=True, top_logprobs=5, **fields)
        assert status == 200, body
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"]
        for e in content:
            top = e["top_logprobs"]
            values = [t["logprob"] for t in top]
            assert values == sorted(values, reverse=True) and 1 <= len(top) <= 5, top
            assert {"id", "token", "logprob"} <= set(e)
            named = [t for t in top if t["id"] == e["id"]]
            if named:  # the chosen token among the top ones: the same entry
                assert named[0]["logprob"] == pytest.approx(e["logprob"]) and named[0]["token"] == e["token"]
            else:
                assert e["logprob"] <= values[-1] + 1e-6
        if fields["temperature"] == 0:  # greedy: the chosen token is the most likely one, and the plain run's
            assert [e["id"] for e in content] == chosen
            assert all(e["id"] == e["top_logprobs"][0]["id"] for e in content)
    server.healthy()


def test_models_lists_the_served_model(server):
    """mlx-lm 0.32.2 answered ``GET /v1/models`` with 200 and an empty body (headers first, then a Hugging Face
    cache scan that failed)."""
    status, body, seconds = server.request("GET", "/v1/models")
    assert status == 200 and seconds < ANSWER_S, (status, body)
    assert body["object"] == "list" and len(body["data"]) == 1, body
    model = body["data"][0]
    assert model["object"] == "model" and isinstance(model["created"], int) and model["owned_by"], model
    assert model["id"].endswith("target"), model
    status, one, _ = server.request("GET", f"/v1/models/{model['id']}")
    assert status == 200 and one == model, (status, one)
    server.refused(server.request("GET", "/v1/models/no-such-model"), 404, r"'no-such-model' does not exist")
    status, reply, _ = server.chat(model=model["id"], max_tokens=2)  # the listed id is one a request may name
    assert status == 200, reply
    server.healthy()


@pytest.mark.parametrize("lengths,status", [
    (["{n}", "{n}"], 400), (["+{n}"], 400), (["0_{n}"], 400), (["-1"], 400),
    (["0x10"], 400), (["{n}, {n}"], 400), ([], 411), (["{n}", "TE"], 400), (["TE"], 411),
], ids=["duplicate", "plus", "underscores", "negative", "hex", "list", "missing", "with-transfer-encoding",
        "transfer-encoding"])
def test_exactly_one_valid_content_length(server, lengths, status):
    """mlx-lm 0.32.2 read ``int(headers.get("Content-Length"))``: ``+10``, ``1_0`` and a second header passed."""
    body = json.dumps({"messages": PROMPT, "max_tokens": 2}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for v in lengths:
        if v == "TE":
            head += b"Transfer-Encoding: chunked\r\n"
        else:
            head += f"Content-Length: {v.format(n=len(body))}\r\n".encode()
    out, seconds = server.raw(head + b"\r\n" + body)
    assert _status(out) == status, out[:200]
    assert seconds < ANSWER_S
    reason = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
    assert re.search(r"Content-Length|Transfer-Encoding", reason), reason
    server.healthy()


def test_a_well_formed_content_length_is_served(server):
    body = json.dumps({"messages": PROMPT, "max_tokens": 2}).encode()
    out, _ = server.raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length:  " + str(len(body)).encode() + b" \r\n\r\n" + body, wait=30)
    assert _status(out) == 200, out[:300]


# ---------------------------------------------------------------------------------------------- 9. slow clients
def _drip(server, head: bytes, drip: bytes, every: float, limit: float) -> tuple[bytes, float]:
    """Send ``head``, then ``drip`` a byte every ``every`` s, until an answer comes or ``limit`` s pass."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=limit)
    t0 = time.monotonic()
    out = b""
    try:
        s.sendall(head)
        s.settimeout(every)
        for b in drip:
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
            try:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
            except socket.timeout:
                pass
            if time.monotonic() - t0 > limit:
                break
        s.settimeout(1.0)
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
    finally:
        s.close()
    return out, time.monotonic() - t0


def test_the_body_timeout_is_a_deadline(server):
    """mlx-lm 0.32.2 (and our first patch) timed each recv: one byte every 10 s got no answer in 80 s."""
    body = json.dumps({"messages": PROMPT, "max_tokens": 2}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    out, seconds = _drip(server, head, body, every=0.3, limit=BODY_S + 4)
    assert _status(out) == 408, out[:200]
    assert b"did not arrive within 1 s" in out
    assert seconds < BODY_S + 1.0, f"answered after {seconds:.2f} s"
    server.healthy()


def test_the_header_timeout_is_a_deadline(server):
    """mlx-lm 0.32.2 had no timeout on the request line and headers at all."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    out, seconds = _drip(server, b"", head, every=0.3, limit=HEADER_S + 4)
    assert _status(out) == 408, out[:200]
    assert b"headers did not arrive within 1 s" in out
    assert seconds < HEADER_S + 1.0, f"answered after {seconds:.2f} s"
    # a connection that sends nothing is closed (quietly) at the same deadline
    out, seconds = server.raw(b"", wait=HEADER_S + 4)
    assert out == b"" and seconds < HEADER_S + 1.0, (out, seconds)
    server.healthy()


def test_slow_connections_are_capped_and_all_answered(server):
    """150 slowloris connections held mlx-lm 0.32.2 for 40 s+, one thread each (11 -> 161).  Here 3x the limit
    of them: the thread count stays within the limit, every one is answered (408 at its deadline, or 503 when it
    gave its slot to a newer connection), and a health check meanwhile answers at once."""
    before = server.threads()
    socks = []
    for _ in range(3 * MAX_CONNECTIONS):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    time.sleep(0.3)
    during = server.threads()
    server.healthy()  # gets a slot at once (the longest-waiting slow connection makes room)
    answers = []
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(max(0.1, HEADER_S + 2.0 - (time.monotonic() - t0)))
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
        s.close()
        answers.append(_status(data))
    assert all(a in (408, 503) for a in answers), answers
    assert answers.count(503) >= 2 * MAX_CONNECTIONS - 1, answers
    assert during <= before + MAX_CONNECTIONS + 2, (before, during)
    time.sleep(0.3)
    assert server.threads() <= before + 2, (before, server.threads())
    server.healthy()


# ---------------------------------------------------------------------------------------------- 10. unclear errors
@pytest.mark.parametrize("raw,reason", [
    (b'"stop": ["\\ud800"]', r"stop\[0\] holds a lone surrogate"),
    (b'"stop": "a\\udfff"', r"stop holds a lone surrogate"),
    (b'"regex": "[0-9]\\ud800"', r"regex holds a lone surrogate"),
    (b'"specgrammar": {"trigger": "\\ud800"}', r"specgrammar\.trigger holds a lone surrogate"),
    (b'"chat_template_kwargs": [1]', r"chat_template_kwargs must be an object"),
    (b'"chat_template_kwargs": "x"', r"chat_template_kwargs must be an object"),
    (b'"stop": 5', r"stop must be"),
    (b'"stop": [1]', r"stop must be"),
], ids=["stop-surrogate", "stop-string-surrogate", "regex-surrogate", "trigger-surrogate", "kwargs-list",
        "kwargs-string", "stop-number", "stop-list-of-number"])
def test_malformed_fields_are_clear_400s(server, raw, reason):
    """mlx-lm 0.32.2: a lone surrogate in ``stop`` -> 404 "TextEncodeInput must be Union[...]";
    ``chat_template_kwargs: [1]`` -> 404 "cannot convert dictionary update sequence ..."."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, ' + raw + b"}"
    server.refused(server.request("POST", "/v1/chat/completions", body), 400, reason)


def test_a_lone_surrogate_in_the_prompt_is_a_clear_400(server):
    body = b'{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 4}'
    server.refused(server.request("POST", "/v1/chat/completions", body), 400,
                   r"messages\[0\]\.content holds a lone surrogate")
    body = b'{"prompt": "\\ud83d", "max_tokens": 4}'
    server.refused(server.request("POST", "/v1/completions", body), 400, r"prompt holds a lone surrogate")
    # a surrogate pair is a character: served
    status, reply, _ = server.chat(messages=[{"role": "user", "content": "hi \U0001F600"}], max_tokens=2)
    assert status == 200, reply


# ---------------------------------------------------------------------------------------------- upstream diffs
def test_each_upstream_diff_applies_to_stock_mlx_lm(tmp_path):
    """``patches/upstream/*.diff``: one fix each, against stock mlx-lm 0.32.2 (``http-deadlines.diff`` goes on top
    of the request-body handling of the plugin diff, which is not shipped apart: left out here)."""
    import importlib.util
    import shutil
    from pathlib import Path

    from specgrammar_mlx_lm import patch

    src = Path(list(importlib.util.find_spec("mlx_lm").submodule_search_locations)[0])
    shutil.copytree(src, tmp_path / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"))
    plugin = patch.parse_diff(patch.diff_path().read_text())
    if patch.state(tmp_path, plugin) == "applied":  # the venv's mlx-lm is patched: start from its stock form
        patch.apply(tmp_path, plugin, reverse=True)
    diffs = sorted((Path(__file__).resolve().parents[1] / "patches" / "upstream").glob("*.diff"))
    names = {d.stem for d in diffs}
    assert {"image-urls", "stop-strings", "logprobs", "models", "request-fields", "http-deadlines"} <= names, names
    for d in diffs:
        text = d.read_text()
        assert "mlx-lm 0.32.2" in text.split("diff --git", 1)[0], d.name  # each names the host version
        if d.stem != "http-deadlines":
            assert patch.state(tmp_path, patch.parse_diff(text)) == "clean", d.name
