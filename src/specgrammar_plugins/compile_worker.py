"""Compiling in a child process, so that a compile past the time limit is really abandoned: the process is killed.

Native engine code cannot be interrupted from Python: a compile run in a thread keeps its core busy (and its
memory) after the request has been answered with the time-limit error.  With ``LIMITS.compile_isolation ==
"process"`` the engines that have no resource limits of their own (xgrammar, outlines-core, the interegular DFA:
their ``isolate`` attribute is True) compile in a worker process instead:

- workers are plain ``python -m specgrammar_plugins.compile_worker`` processes (no re-import of the host's
  ``__main__``, safe from threaded servers), started on first use and kept warm, at most
  ``SPECGRAMMAR_COMPILE_WORKERS`` (default 2) at a time; a worker's start-up (importing xgrammar takes seconds:
  it imports torch), sending it a tokenizer and loading an engine are not timed, but a compile's limit runs from
  its call: waiting for a free worker counts (a worker started in the background by ``prestart`` loads every
  tokenizer and engine the pool has used, so a replacement is ready when a compile gets it);
- a job that outlives the limit gets its worker SIGKILLed (the compile stops at once, its memory is returned) and
  the caller a ``ConstraintError``; a fresh worker is started at once in the background (``prestart``), not by
  the next compile: its start (seconds; 20-40 s on the 2-core machine under load) would be counted against that
  request's deadline.  A compile waits for a free worker at most its own time limit (a ``ConstraintError`` naming
  the limit), never longer;
- a finished job sends back the engine's serialized result when the engine can export one (xgrammar:
  ``CompiledGrammar.serialize_json``, tens of ms for a schema on a 150k vocabulary); otherwise (outlines-core,
  dfa) the worker's compile is a probe that proved the compile finishes in time and the caller compiles again
  in-process.

llguidance stays in-process: its compile is lazy and bounded by its own fuel limits (``LLParserLimits``:
``initial_lexer_fuel`` 1M ~ 20 ms, ``step_lexer_fuel`` 200k per mask, ``max_grammar_size`` 500k symbols), so it
cannot run away.

Wire format: length-prefixed pickles over the child's stdin/stdout; the child writes nothing else there.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import struct
import subprocess
import sys
import threading

from .bounds import SLICE_S
from .errors import ConstraintError
from .heap import give_back

STARTUP_S = 120.0  # a worker's start-up and tokenizer upload are not part of the compile time limit


def _send(fh, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(struct.pack("<Q", len(data)) + data)
    fh.flush()


def _read_exact(fh, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = fh.read(n - len(buf))
        if not chunk:
            raise EOFError("the compile worker closed its pipe")
        buf += chunk
    return buf


def _recv(fh):
    (n,) = struct.unpack("<Q", _read_exact(fh, 8))
    return pickle.loads(_read_exact(fh, n))


# The address space a worker may use (``SPECGRAMMAR_COMPILE_WORKER_MAX_BYTES``, default 3 GiB; 0: no limit).  A
# worker holding xgrammar and torch maps ~0.75 GB; a compile that needs more than the rest fails in the worker
# (std::bad_alloc, MemoryError, or the worker dies) and the request gets a ConstraintError naming the limit, where
# it used to take the machine's memory (issue 33).
MAX_BYTES = int(os.environ.get("SPECGRAMMAR_COMPILE_WORKER_MAX_BYTES", 3 << 30))


def _memory_words(reason: str) -> bool:
    return any(w in reason for w in ("bad_alloc", "MemoryError", "memory allocation", "Cannot allocate memory"))


def _out_of_memory(engine, kind) -> ConstraintError:
    return ConstraintError(f"compiling needed more than {MAX_BYTES} bytes of memory (the compile worker's memory "
                           "limit, SPECGRAMMAR_COMPILE_WORKER_MAX_BYTES); abandoned", engine=engine, kind=kind)


def _dead(w) -> bool:
    try:
        w.proc.wait(1.0)
        return True
    except subprocess.TimeoutExpired:
        return False


# ---------------------------------------------------------------------------------------------- the child
def serve(inp, out) -> None:
    from .plugins import get_engine

    if MAX_BYTES > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MAX_BYTES, MAX_BYTES))

    toks: dict = {}
    _send(out, ("ready", os.getpid()))
    while True:
        try:
            msg = _recv(inp)
        except EOFError:
            return
        if msg[0] == "tok":
            toks[msg[1]] = msg[2]
            _send(out, ("ok",))
            continue
        if msg[0] == "import":  # a module to have loaded before the first request (prestart)
            try:
                __import__(msg[1])
            except ImportError:  # pragma: no cover
                pass
            _send(out, ("ok",))
            continue
        if msg[0] == "prep":  # import the engine and build its per-tokenizer tables, outside the timed compile
            try:
                from .constraint import ConstraintSpec

                get_engine(msg[1]).compile(ConstraintSpec.regex("[a-z0-9]"), toks[msg[2]], {})
            except Exception:
                pass
            _send(out, ("ok",))
            continue
        _, engine, spec, tok_key, options = msg
        try:
            eng = get_engine(engine)
            cc = eng.compile(spec, toks[tok_key], options)
            export = getattr(eng, "export", None)
            _send(out, ("done", export(cc) if export else None))
        except ConstraintError as e:
            _send(out, ("error", e.reason, e.engine, e.kind))
        except Exception as e:  # an engine's own exception: its words under our type, as in-process
            _send(out, ("error", f"{type(e).__name__}: {e}", engine, spec.kind))
        cc = None  # a costly compile's memory goes back to the system, not kept in the worker's arenas (issue 33:
        give_back()  # a 20,000-option choice left a worker at 698-1,102 MB, 330 MB after the trim)


# ---------------------------------------------------------------------------------------------- the parent
class Worker:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "specgrammar_plugins.compile_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.toks: set = set()
        if not self.wait(STARTUP_S):
            self.kill()
            raise ConstraintError(f"the compile worker did not start within {STARTUP_S:g} s")
        self.pid = _recv(self.proc.stdout)[1]

    def wait(self, timeout: float) -> bool:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return bool(r)

    def call(self, msg, timeout: float):
        _send(self.proc.stdin, msg)
        if not self.wait(timeout):
            return None
        return _recv(self.proc.stdout)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):  # pragma: no cover
            pass
        for fh in (self.proc.stdin, self.proc.stdout):
            try:
                fh.close()
            except OSError:  # pragma: no cover
                pass


class WorkerPool:
    def __init__(self, max_workers: int | None = None):
        self.max_workers = max_workers or int(os.environ.get("SPECGRAMMAR_COMPILE_WORKERS", "2"))
        self._idle: list[Worker] = []
        self._count = 0
        self._cv = threading.Condition()
        self._starting = 0  # workers prestart is starting in the background
        self._seen: dict = {}  # tokenizer key -> the tokenizer sent to workers (a replacement gets them at start)
        self._preps: set = set()  # (engine, tokenizer key) loaded in workers
        self.killed = 0  # workers killed for running past the limit (for tests and logs)
        self.last_killed_pid: int | None = None

    def _acquire(self, timeout: float | None = None, deadline=None) -> Worker | None:
        """An idle worker, or a new one while fewer than ``max_workers`` exist; None when none is free within
        ``timeout`` seconds (None: wait as long as it takes).  A compile (``timeout`` given) starts no worker
        while one is starting in the background: it waits for that one, within its time.  A new worker's start
        is left out of ``deadline`` (``Deadline.excluded``)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._idle or (self._count < self.max_workers and not (
                    timeout is not None and self._starting)), timeout):
                return None
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            if deadline is None:
                return Worker()
            with deadline.excluded():
                return Worker()
        except BaseException:
            self._drop()
            raise

    def _release(self, w: Worker) -> None:
        with self._cv:
            self._idle.append(w)
            self._cv.notify()

    def _drop(self) -> None:
        with self._cv:
            self._count -= 1
            self._cv.notify()

    def compile(self, eng, spec, tokenizer, options: dict, timeout: float, deadline=None):
        """Compile ``spec`` with ``eng`` in a worker within ``timeout`` wall-clock seconds, or, given the request's
        ``deadline`` (a ``bounds.Deadline``: its share for this compile), until that is past, the worker's CPU
        charged to it (see the module docstring)."""
        import time

        if deadline is None:
            from .bounds import Deadline

            deadline = Deadline(timeout, timeout)  # (wall-clock alone: no CPU limit past the wall-clock one)
            deadline.seconds = float("inf")
        w = self._acquire(max(0.0, deadline.wall_left()), deadline)  # the wait for a worker counts: never past
        if w is None:
            raise ConstraintError(f"compiling took longer than {deadline.wall_seconds:g} s (the compile time "
                                  "limit): no compile worker was free (others compiling, or one starting after a "
                                  "kill)", engine=eng.name, kind=spec.kind)
        keep = False
        try:
            key = (tokenizer.fingerprint, tokenizer.vocab_size)
            with deadline.excluded():  # a first tokenizer upload and engine load are not the compile's
                if key not in w.toks:
                    self._seen.setdefault(key, dataclasses.replace(tokenizer, encode=None))
                    if w.call(("tok", key, self._seen[key]), STARTUP_S) is None:
                        raise ConstraintError("the compile worker did not take the tokenizer", engine=eng.name)
                    w.toks.add(key)
                if (eng.name, key) not in w.toks:
                    if w.call(("prep", eng.name, key), STARTUP_S) is None:
                        raise ConstraintError("the compile worker did not load the engine", engine=eng.name)
                    w.toks.add((eng.name, key))
                    self._preps.add((eng.name, key))
            with deadline.charging_process(w.pid):  # the worker's CPU is this request's while it compiles for it
                _send(w.proc.stdin, ("compile", eng.name, spec, key, options))
                while not w.wait(max(0.0, min(SLICE_S, deadline.wall_left()))):
                    if deadline.expired():
                        break
                reply = _recv(w.proc.stdout) if w.wait(0) else None
            if reply is None:
                self.killed += 1
                self.last_killed_pid = w.pid
                limit = (f"{deadline.wall_seconds:g} s" if deadline.seconds == float("inf") else
                         f"{deadline.seconds:g} s of CPU or {deadline.wall_seconds:g} s of wall-clock time")
                raise ConstraintError(f"compiling took longer than {limit} (the compile time limit); abandoned: the "
                                      "compiling process was killed", engine=eng.name, kind=spec.kind)
            keep = True
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            if MAX_BYTES > 0 and _dead(w):  # died mid-compile: a native abort at the memory limit
                raise _out_of_memory(eng.name, spec.kind) from None
            raise ConstraintError(f"the compile worker died ({type(e).__name__}: {e})", engine=eng.name,
                                  kind=spec.kind) from None
        finally:
            if keep:
                self._release(w)
            else:
                w.kill()
                self._drop()
                self.prestart()  # its replacement, started now in the background
        if reply[0] == "error":
            if MAX_BYTES > 0 and _memory_words(reply[1]):
                raise _out_of_memory(reply[2], reply[3])
            raise ConstraintError(reply[1], engine=reply[2], kind=reply[3])
        importer = getattr(eng, "import_compiled", None)
        if reply[1] is not None and importer is not None:
            return importer(spec, tokenizer, options, reply[1])
        return eng.compile(spec, tokenizer, options)  # the worker proved it finishes in time

    def prestart(self) -> None:
        """Start one more worker in the background, while fewer than ``max_workers`` exist (servers call this at
        start-up, so the first request does not wait for the worker's imports; the pool calls it for a killed
        worker's replacement)."""

        def start():
            try:
                _start()
            finally:  # started (and idle) or failed: compiles waiting for it go on
                with self._cv:
                    self._starting -= 1
                    self._cv.notify_all()

        def _start():
            with self._cv:  # a new worker beside the idle ones (a spare, or a killed one's replacement), if room
                if self._count >= self.max_workers:
                    return
                self._count += 1
            try:
                w = Worker()
            except ConstraintError:  # pragma: no cover - the first compile will say it again
                self._drop()
                return
            try:
                ok = w.call(("import", "xgrammar"), STARTUP_S) is not None  # the default engine: seconds to import
                for key, tok in list(self._seen.items()):  # a replacement: the tokenizers and engines compiles
                    ok = ok and w.call(("tok", key, tok), STARTUP_S) is not None  # used so far, loaded now (the
                    w.toks.add(key)  # compile that waits for it has only its own time left)
                for name, key in list(self._preps):
                    ok = ok and w.call(("prep", name, key), STARTUP_S) is not None
                    w.toks.add((name, key))
            except (EOFError, OSError):  # pragma: no cover
                ok = False
            if ok:
                self._release(w)
            else:  # pragma: no cover
                w.kill()
                self._drop()

        with self._cv:
            self._starting += 1
        threading.Thread(target=start, name="specgrammar-compile-prestart", daemon=True).start()

    def shutdown(self) -> None:
        with self._cv:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for w in idle:
            w.kill()


POOL = WorkerPool()


if __name__ == "__main__":
    _proto = os.fdopen(os.dup(1), "wb")  # the protocol's own copy of stdout; anything printed goes to stderr
    os.dup2(2, 1)
    serve(sys.stdin.buffer, _proto)
