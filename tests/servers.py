"""Test helpers: start the real servers on the bundled tiny models (``launch_mlx``: ``mlx_lm.server --plugin
specgrammar`` on a patched copy of mlx-lm; ``launch_vllm``: our vLLM launcher with ``GrammarProposer``, or vLLM's
draft model made grammar-aware; ``launch_command``: any vLLM command line, e.g. the README's), each ready to serve
when returned, stopped with ``Launched.stop()``.  ``specgrammar soak --url`` runs its burst against
such a server (``specgrammar demo --serve`` starts the mlx-lm one by hand)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patched_mlx_root(dest: Path) -> Path:
    """A folder to put first on PYTHONPATH so ``mlx_lm`` is patched: the venv's own when it already is, else a
    patched copy under ``dest`` (``specgrammar patch mlx-lm --target``; the venv's mlx-lm is left alone)."""
    from specgrammar_mlx_lm.patch import patched_root

    return patched_root(dest)[0]


@dataclass
class Launched:
    """A server process we started on 127.0.0.1 (``stop()`` ends it and its process group)."""

    proc: subprocess.Popen
    port: int
    log: Path
    host: str = "127.0.0.1"
    model: str = "default_model"
    _fh: object = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self, timeout: float = 120.0):
        """An ``openai.OpenAI`` client of this server."""
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", timeout=timeout, max_retries=0)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        from specgrammar_plugins.testing import stop_server

        stop_server(self.proc)
        if self._fh:
            self._fh.close()


def _wait_ready(srv: Launched, path: str, startup_s: float) -> Launched:
    deadline = time.monotonic() + startup_s
    while True:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {srv.proc.returncode}:\n{srv.log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
            if path == "/health":
                conn.request("GET", path)
            else:
                conn.request("POST", path, body=json.dumps({"model": srv.model, "max_tokens": 1,
                                                            "messages": [{"role": "user", "content": "hi"}]}),
                             headers={"Content-Type": "application/json"})
            if conn.getresponse().status == 200:
                return srv
        except OSError:
            pass
        if time.monotonic() > deadline:
            srv.stop()
            raise RuntimeError(f"the server was not ready within {startup_s:g} s:\n{srv.log.read_text()[-3000:]}")
        time.sleep(0.5)


def _env(extra: dict | None, path_first: list[str], **defaults) -> dict:
    """The server's environment: ours, ``defaults``, then ``extra``; ``PYTHONPATH`` = ``path_first``, ``extra``'s
    PYTHONPATH, then ours."""
    extra = dict(extra or {})
    paths = [*path_first, extra.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **defaults, **extra, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def launch_mlx(workdir: Path, draft: bool = True, max_tokens: int = 64, extra: list[str] = (),
               startup_s: float = 180.0, *, plugin: bool = True, num_draft_tokens: int = 4,
               root: Path | None = None, env: dict | None = None) -> Launched:
    """``mlx_lm.server --plugin specgrammar`` (``plugin=False``: the patched server without it) on the bundled
    tiny target (and draft), ready to serve.  ``root``: a folder holding a patched ``mlx_lm`` (default: made by
    ``patched_mlx_root`` under ``workdir``).  ``env``: extra environment (``PYTHONPATH`` entries go first)."""
    from specgrammar_plugins.models import tiny_path

    workdir.mkdir(parents=True, exist_ok=True)
    root = root if root is not None else patched_mlx_root(workdir / "mlx")
    args = ["--model", str(tiny_path("target")), "--max-tokens", str(max_tokens)]
    if draft:
        args += ["--draft-model", str(tiny_path("draft")), "--num-draft-tokens", str(num_draft_tokens)]
    if plugin:
        args += ["--plugin", "specgrammar"]
    port = free_port()
    env = _env(env, [str(root)], TOKENIZERS_PARALLELISM="false")
    log = workdir / f"mlx-server-{port}.log"
    fh = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--host", "127.0.0.1", "--port", str(port),
                             *args, *extra], stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return _wait_ready(Launched(proc, port, log, _fh=fh), "/v1/chat/completions", startup_s)


def launch_vllm(workdir: Path, k: int = 4, extra: list[str] = (), startup_s: float = 300.0, *,
                served_name: str = "default_model", draft: bool = False, env: dict | None = None) -> Launched:
    """Our vLLM launcher (``specgrammar_vllm.serve``) on the tiny target, engine in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so one PID holds all request state), served as ``served_name``:
    ``--grammar-spec k`` (GrammarProposer: forced + recipe drafts), with ``draft`` also ``--grammar-draft`` (vLLM's
    draft_model method with the tiny draft, grammar-aware through the general plugin).  ``env``: extra environment
    (``PYTHONPATH`` entries go first)."""
    from specgrammar_plugins.models import tiny_path

    cmd = [sys.executable, "-m", "specgrammar_vllm.serve", str(tiny_path("target")),
           "--served-model-name", served_name, "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
           "--grammar-spec", str(k), *(["--grammar-draft", str(tiny_path("draft"))] if draft else []),
           "--uvicorn-log-level", "warning", *extra]
    env = _env(env, [], VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    return launch_command(workdir, cmd, env, startup_s, served_name=served_name)


def launch_command(workdir: Path, cmd: list[str], env: dict, startup_s: float = 300.0, *,
                   served_name: str = "default_model", cwd: Path | None = None) -> Launched:
    """A vLLM server from a command line (``--host 127.0.0.1 --port P`` appended, run in ``cwd``), ready when
    ``/health`` answers."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / f"vllm-server-{port}.log"
    fh = open(log, "w")
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT,
                            env=env, cwd=cwd, start_new_session=True)
    return _wait_ready(Launched(proc, port, log, model=served_name, _fh=fh), "/health", startup_s)


# ---------------------------------------------------------------------------------------------- command
