"""Cheap bounds on what a constraint may cost, checked before any engine or walker runs, and the one deadline per
request over all preparation (issue 33).

A request whose constraint is small in bytes can still be unbounded in work: ``a{0,4294967295}``, ``(a{1000}){1000}``,
40 doubling GBNF rules whose only string is 2^40 bytes long, ``"minItems": 1000000000``.  The engines (and our DFA
and budget walkers) expand such counts, so each is bounded here by arithmetic on the constraint's text, in time
linear in its size and without recursion (``check_cost``: absolute limits, every host, in ``compile_constraint``;
``check_fit``: what cannot fit in the request's budget, in the gate).  Each refusal is a ``ConstraintError`` naming
the limit and its variable.  The limits (``bounds.BOUNDS``, environment variables in brackets):

- ``max_repeat`` (10,000; ``SPECGRAMMAR_MAX_REPEAT``): any ``{m}`` / ``{m,n}`` count in a regex, a JSON Schema
  ``pattern``, a GBNF / Lark / EBNF grammar;
- ``max_expansion`` (100,000; ``SPECGRAMMAR_MAX_EXPANSION``): a count times the length of what it repeats times
  the counts of the groups around it (``(a{1000}){1000}``: 10^6 characters of expansion), and for a JSON Schema an
  item count times the size of the item schema;
- ``max_choices`` (50,000; ``SPECGRAMMAR_MAX_CHOICES``): options of a ``choice``, values of an ``enum``;
- ``max_rules`` (1,000; ``SPECGRAMMAR_MAX_RULES``): rules of a GBNF grammar;
- ``max_properties`` (1,000; ``SPECGRAMMAR_MAX_PROPERTIES``): properties of one JSON Schema object;
- ``max_items`` (10,000; ``SPECGRAMMAR_MAX_ITEMS``): ``minItems`` / ``maxItems`` / ``minContains`` / ``maxContains``
  (llguidance 1.7.6 aborts the process allocating 4-8 GB at ``maxItems`` 10^9, and panics at 10^5);
- ``max_forced_bytes`` (1 MiB; ``SPECGRAMMAR_MAX_FORCED_BYTES``): the sum over a GBNF grammar's rules of the
  shortest string of each rule's longest alternative.  A forced string (jump-forward) is a prefix of every
  completion, and in a grammar where no rule reaches itself each rule is on the stack at most once, so no
  forced string is longer than this sum; it is also the cap every ``jump_forward`` call is cut at;
- ``prepare_timeout_s`` (5 s; ``SPECGRAMMAR_PREPARE_TIMEOUT_S``): the CPU time a request's preparation may use
  (``Deadline``), and ``prepare_wall_s`` (``SPECGRAMMAR_PREPARE_WALL_S``; default 6 x the CPU limit, 30 s): its
  wall-clock backstop.

``Deadline``: one per request (``prepare_deadline()`` opens it on the current thread, and the compile, the exact
budget's DFA, the certified budget's walk read it); a piece of preparation called outside one gets a deadline of
its own of the same length.  It charges the request the CPU time of its own work: the preparing thread, and a
compile thread or compile worker process while it compiles for it (``/proc/<pid>/stat``), so that waiting for a
core on a loaded machine does not count, and the wall-clock backstop bounds what waits without burning CPU.  An
overrun is a ``ConstraintError`` naming the limit and the part that overran.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from .errors import ConstraintError
from .heap import give_back

_local = threading.local()


@dataclass
class CostLimits:
    """The bounds of this module (the module docstring), each set by its environment variable or by assigning
    ``bounds.BOUNDS.<name>`` (beside ``compiler.LIMITS``, which holds the size and compile-time limits: this
    module sits below the compiler and the engines, which all read it)."""

    max_repeat: int = int(os.environ.get("SPECGRAMMAR_MAX_REPEAT", 10_000))
    max_expansion: int = int(os.environ.get("SPECGRAMMAR_MAX_EXPANSION", 100_000))
    max_choices: int = int(os.environ.get("SPECGRAMMAR_MAX_CHOICES", 50_000))
    max_rules: int = int(os.environ.get("SPECGRAMMAR_MAX_RULES", 1_000))
    max_properties: int = int(os.environ.get("SPECGRAMMAR_MAX_PROPERTIES", 1_000))
    max_items: int = int(os.environ.get("SPECGRAMMAR_MAX_ITEMS", 10_000))
    max_forced_bytes: int = int(os.environ.get("SPECGRAMMAR_MAX_FORCED_BYTES", 1 << 20))
    prepare_timeout_s: float = float(os.environ.get("SPECGRAMMAR_PREPARE_TIMEOUT_S", 5.0))
    prepare_wall_s: float = float(os.environ.get("SPECGRAMMAR_PREPARE_WALL_S", 0.0))  # 0: WALL_FACTOR x the CPU limit
    allow_client_chat_template: bool = os.environ.get("SPECGRAMMAR_ALLOW_CLIENT_CHAT_TEMPLATE", "0") == "1"
    max_chat_template_bytes: int = int(os.environ.get("SPECGRAMMAR_MAX_CHAT_TEMPLATE_BYTES", 64 << 10))


    def wall_s(self) -> float:
        """The preparation's wall-clock backstop: ``prepare_wall_s``, else ``WALL_FACTOR`` x the CPU limit."""
        return self.prepare_wall_s if self.prepare_wall_s > 0 else WALL_FACTOR * self.prepare_timeout_s

    def wall_factor(self) -> float:
        return self.wall_s() / self.prepare_timeout_s if self.prepare_timeout_s > 0 else WALL_FACTOR


WALL_FACTOR = 6.0
BOUNDS = CostLimits()


def _limits() -> CostLimits:
    return BOUNDS


# ------------------------------------------------------------------------------------------- the deadline
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SLICE_S = 0.05  # how often a wait on another thread or process looks at the deadline


def thread_cpu():
    """A reader of the current thread's CPU seconds that any thread may call (None once the thread has ended): the
    clock id is taken now, on the thread itself, so a later read never touches a finished thread's handle."""
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
    except AttributeError:  # pragma: no cover - a platform without per-thread clocks: this thread's time only
        return time.thread_time

    def read() -> float | None:
        try:
            return time.clock_gettime(clock)
        except OSError:  # the thread has ended
            return None

    return read


def process_cpu(pid: int) -> float | None:
    """The CPU seconds (user + system, all threads) process ``pid`` has used, from ``/proc/<pid>/stat``; None when it
    cannot be read (gone, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of proc(5))
    except (OSError, ValueError, IndexError):
        return None


class _Meter:
    """One source of CPU time charged to a request: a thread or a process, from its reading when it was attached."""

    __slots__ = ("read", "base", "last")

    def __init__(self, read):
        self.read = read
        self.base = self.last = read() or 0.0

    def used(self) -> float:
        now = self.read()
        if now is not None:
            self.last = now
        return self.last - self.base


class Deadline:
    """The limits on one request's preparation: ``seconds`` of CPU time (``SPECGRAMMAR_PREPARE_TIMEOUT_S``, 5 s)
    and a wall-clock backstop ``wall_seconds`` (``SPECGRAMMAR_PREPARE_WALL_S``; default 6 x the CPU limit, 30 s).

    A request is charged the CPU its own preparation uses: the thread that opened the deadline, a compile thread
    while it compiles for it (``charging``), a compile worker process while it compiles for it
    (``charging_process``); not the CPU other requests and other jobs take from the machine.  So an ordinary
    request on a loaded machine is not refused for waiting for a core (the wall-clock deadline refused 16 of 40
    dev-split schemas at load ~28), while one that burns CPU is refused as on an idle machine.  The backstop bounds
    a request that waits without burning CPU (for a free compile worker, for a starved core), so nothing takes
    unbounded time under load.  ``part(s)`` is a share of it (a compile's own limit, the exact budget's half):
    the same meters, its own smaller limits."""

    def __init__(self, seconds: float | None = None, wall_seconds: float | None = None, *,
                 _parent: "Deadline | None" = None):
        lim = _limits()
        self.seconds = float(lim.prepare_timeout_s if seconds is None else seconds)
        if wall_seconds is None:
            wall_seconds = lim.wall_s() if seconds is None else self.seconds * lim.wall_factor()
        self.wall_seconds = float(wall_seconds)
        self.end = time.monotonic() + self.wall_seconds  # the wall-clock backstop (moved on by ``excluded``)
        self._parent = _parent
        self._root: Deadline = _parent._root if _parent is not None else self
        if _parent is None:
            self._lock = threading.Lock()
            self._meters: tuple[_Meter, ...] = ()  # replaced, never changed in place: read without the lock
            self._done = 0.0  # CPU of meters detached
            self._excluded = 0.0  # CPU spent in ``excluded`` sections
            self._attach(_Meter(thread_cpu()))  # the thread that opened it
            self._base = 0.0
        else:
            self._base = self._root.cpu_used()

    # -- the meters (kept on the root: a part shares them)
    def _attach(self, meter: _Meter) -> _Meter:
        root = self._root
        with root._lock:
            root._meters = (*root._meters, meter)
        return meter

    def _detach(self, meter: _Meter) -> None:
        root = self._root
        with root._lock:
            if meter in root._meters:
                root._meters = tuple(m for m in root._meters if m is not meter)
                root._done += meter.used()

    @contextlib.contextmanager
    def charging(self) -> Iterator[None]:
        """The current thread's CPU counts against this deadline while inside (a compile thread working for it)."""
        key = self._attach(_Meter(thread_cpu()))
        try:
            yield
        finally:
            self._detach(key)

    @contextlib.contextmanager
    def charging_process(self, pid: int) -> Iterator[None]:
        """Process ``pid``'s CPU counts against this deadline while inside (a compile worker working for it)."""
        key = self._attach(_Meter(lambda: process_cpu(pid)))
        try:
            yield
        finally:
            self._detach(key)

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Neither the CPU nor the wall-clock time spent inside counts (a process's one-time set-up: an engine's
        import, a compile worker's start, a server's warm-up)."""
        root = self._root
        cpu0, t0 = root.cpu_used(), time.monotonic()
        try:
            yield
        finally:
            wall = time.monotonic() - t0
            cpu = root.cpu_used() - cpu0
            with root._lock:
                root._excluded += cpu
            d: Deadline | None = self
            while d is not None:  # the backstops of this part and of the parts it is in
                d.end += wall
                d = d._parent

    # -- reading it
    def cpu_used(self) -> float:
        """CPU seconds charged to this deadline (a part: since it was made)."""
        root = self._root
        total = root._done - root._excluded
        for m in root._meters:
            total += m.used()
        return total - self._base

    def cpu_left(self) -> float:
        return self.seconds - self.cpu_used()

    def wall_left(self) -> float:
        return self.end - time.monotonic()

    def remaining(self) -> float:
        """The smaller of the CPU and the wall-clock time left (a lower bound of how long the work may go on)."""
        return min(self.cpu_left(), self.wall_left())

    def expired(self) -> str | None:
        """None while in time; else which limit is past: ``"cpu"`` or ``"wall"`` (this deadline's or a parent's)."""
        now = time.monotonic()
        d: Deadline | None = self
        while d is not None:
            if now > d.end:
                return "wall"
            d = d._parent
        used = self._root.cpu_used()  # (the root's: each part's own is this less its base)
        d = self
        while d is not None:
            if used - d._base > d.seconds:
                return "cpu"
            d = d._parent
        return None

    def overrun(self, part: str, *, engine: str | None = None, kind: str | None = None,
                which: str | None = None) -> ConstraintError:
        """The error for an overrun of ``part`` (``which``: the limit that was past; default: the one now past)."""
        which = which or self.expired() or "cpu"
        d = self._root
        if which == "wall":
            return ConstraintError(f"preparing this request took longer than {d.wall_seconds:g} s of wall-clock time "
                                   "(the preparation time limit's wall-clock backstop, SPECGRAMMAR_PREPARE_WALL_S); "
                                   f"the part that overran: {part}", engine=engine, kind=kind)
        return overrun(d.seconds, part, engine=engine, kind=kind)

    def check(self, part: str, *, engine: str | None = None, kind: str | None = None) -> None:
        which = self.expired()
        if which is not None:
            raise self.overrun(part, engine=engine, kind=kind, which=which)

    def part(self, cpu_seconds: float) -> "Deadline":
        """A share of this deadline: at most ``cpu_seconds`` more CPU, and a wall-clock backstop in the same ratio,
        both within this one's (a compile's own time limit, the exact budget's half)."""
        cpu = max(0.0, min(cpu_seconds, self.cpu_left()))
        factor = self.wall_seconds / self.seconds if self.seconds > 0 else 1.0
        child = Deadline(cpu, min(self.wall_left(), cpu * factor), _parent=self)
        return child


class Stopped(BaseException):
    """Raised inside a ``run_stoppable`` thread to end it (a ``BaseException``: no ``except Exception`` in the
    code it runs swallows it)."""


class _Stoppable(threading.Thread):
    def __init__(self, fn, deadline: Deadline):
        super().__init__(name="specgrammar-stoppable", daemon=True)
        self._fn, self._deadline = fn, deadline
        self._lock = threading.Lock()
        self._running = True
        self.result = self.error = None
        self.done = threading.Event()

    def run(self) -> None:
        import ctypes

        try:
            try:
                with self._deadline.charging():
                    self.result = self._fn()
            except BaseException as e:  # (Stopped included: nobody waits for it any more)
                self.error = e
        except Stopped:  # delivered in the handler above
            pass
        while True:  # the flag down (no more sent) and none pending, whatever arrives meanwhile
            try:
                with self._lock:
                    self._running = False
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), None)  # (clears)
                break
            except Stopped:
                continue
        self._fn = None
        self.done.set()

    def stop(self) -> None:
        import ctypes

        with self._lock:
            if self._running and self.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(Stopped))

    def halt(self, seconds: float = 30.0) -> None:
        """``stop`` until the thread has ended (or ``seconds`` pass): an exception raised inside a gc callback that
        runs in the thread (hypothesis installs one) is reported as unraisable and lost, and the work went on."""
        end = time.monotonic() + seconds
        while not self.done.is_set() and time.monotonic() < end:
            self.stop()
            self.done.wait(0.01)


def run_stoppable(fn, deadline: Deadline) -> tuple[bool, object]:
    """Run ``fn`` (pure Python: interegular's subset construction) in a thread of its own, its CPU charged to
    ``deadline``; ``(True, its result)``, or ``(False, None)`` once the deadline is past, the thread then stopped at
    its next bytecode (``PyThreadState_SetAsyncExc``) instead of running on with the caller gone.  What ``fn``
    raises is raised here.  Native code is not stopped before it returns to Python: for engines in C++ or Rust the
    compile worker process (``compile_isolation="process"``) is the way."""
    job = _Stoppable(fn, deadline)
    job.start()
    while not job.done.wait(SLICE_S):
        if deadline.expired():
            job.stop()
            if not job.done.wait(0.01):  # (the exception may have been lost: stopped again until it ends)
                threading.Thread(target=job.halt, name="specgrammar-stopping", daemon=True).start()
            return False, None
    if job.error is not None:
        raise job.error
    return True, job.result


def overrun(seconds: float, part: str, *, engine: str | None = None, kind: str | None = None) -> ConstraintError:
    return ConstraintError(f"preparing this request used more than {seconds:g} s of CPU time (the preparation time "
                           f"limit, SPECGRAMMAR_PREPARE_TIMEOUT_S); the part that overran: {part}", engine=engine,
                           kind=kind)


def current() -> Deadline | None:
    """The deadline ``prepare_deadline`` opened on this thread, if any."""
    return getattr(_local, "deadline", None)


def deadline() -> Deadline:
    """The current request's deadline, or a fresh one for a piece called on its own."""
    return current() or Deadline()


@contextlib.contextmanager
def prepare_deadline(seconds: float | None = None) -> Iterator[Deadline]:
    """Open the request's deadline on this thread (nested calls share the outer one)."""
    outer = current()
    if outer is not None:
        yield outer
        return
    d = Deadline(seconds)
    _local.deadline = d
    try:
        yield d
    finally:
        _local.deadline = None
        give_back()  # what a costly preparation freed stays in glibc's arenas otherwise (heap; issue 33)


# ------------------------------------------------------------------------------------------- counts in text
_COUNT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_COUNT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def _refuse(msg: str, var: str, kind: str | None) -> ConstraintError:
    return ConstraintError(f"{msg} ({var})", kind=kind)


def _counts(text: str, where: str, kind: str | None, grammar: bool = False) -> None:
    """Every ``{m,n}`` count in a regex or grammar text against ``max_repeat``, and count x repeated length x the
    counts of the enclosing groups against ``max_expansion``.  One pass, no recursion: a stack of the groups'
    starts; a group's own count is known only at its ``)``, so its content is charged then."""
    lim = _limits()
    stack: list[int] = []  # start index of each open group
    inner_max = [1]  # per level: the largest expansion of something inside the current group
    last_start = None  # start of the last atom (for a count after it)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            last_start = i
            i += 2
            continue
        if c == "[" or (grammar and c == '"'):
            close = "]" if c == "[" else '"'
            j = i + 1
            while j < n and text[j] != close:
                j += 2 if text[j] == "\\" else 1
            last_start = i
            i = j + 1
            continue
        if c == "(":
            stack.append(i)
            inner_max.append(1)
            i += 1
            continue
        if c == ")" and stack:
            start = stack.pop()
            inside = inner_max.pop()
            last_start = start
            m = _COUNT.match(text, i + 1)
            count = _count_of(m, where, kind) if m else 1
            size = count * max(inside, i - start)
            if size > lim.max_expansion:
                raise _refuse(f"{where} repeats {text[start:i + 1][:40]!r} {count} times: an expansion of about "
                              f"{size} characters; the limit is {lim.max_expansion}", "SPECGRAMMAR_MAX_EXPANSION",
                              kind)
            inner_max[-1] = max(inner_max[-1], size)
            i = m.end() if m else i + 1
            continue
        if c == "{":
            m = _COUNT.match(text, i)
            if m:
                count = _count_of(m, where, kind)
                seg = max(1, i - (last_start if last_start is not None else i - 1))
                size = count * seg
                if size > lim.max_expansion:
                    raise _refuse(f"{where} repeats {text[max(0, i - seg):i][:40]!r} {count} times: an expansion of "
                                  f"about {size} characters; the limit is "
                                  f"{lim.max_expansion}", "SPECGRAMMAR_MAX_EXPANSION", kind)
                inner_max[-1] = max(inner_max[-1], size)
                i = m.end()
                continue
        last_start = i
        i += 1
    if grammar:
        for m in _LARK_COUNT.finditer(text):
            _count_of(m, where, kind)


def _count_of(m, where: str, kind: str | None) -> int:
    lim = _limits()
    nums = [int(x) for x in m.groups() if x]
    top = max(nums, default=1)
    if top > lim.max_repeat:
        raise _refuse(f"{where} has the repetition count {top}; the limit is {lim.max_repeat}",
                      "SPECGRAMMAR_MAX_REPEAT", kind)
    return max(top, 1)


# ------------------------------------------------------------------------------------------- GBNF lengths
def gbnf_parse(text: str) -> dict[str, list[list[tuple]]] | None:
    """A GBNF grammar as rule -> alternatives of parts ``(what, lo, hi)``: ``what`` a literal's text (str), a class
    (``("class", text)``), a rule name (``("ref", name)``) or a group (a list of alternatives); ``lo`` / ``hi`` the
    repetition (hi None: unbounded).  None when this reader cannot read it (the engine reports the error)."""
    from .gbnf import _NAME, _literal_text, _match_paren, _skip_literal, split_rules

    def parts(body: str) -> list[list[tuple]]:
        # groups are parsed with an explicit stack (no recursion)
        root: list[list] = [[]]
        stack = [root]
        ends = [len(body)]
        i = 0
        while True:
            alts = stack[-1]
            if i >= ends[-1]:
                if len(stack) == 1:
                    return root
                stack.pop()
                i = ends.pop() + 1
                continue
            c = body[i]
            if c.isspace():
                i += 1
            elif c == "|":
                alts.append([])
                i += 1
            elif c in "*?+" or c == "{":
                if c == "{":
                    j = body.index("}", i)
                    nums = body[i + 1:j].split(",")
                    lo = int(nums[0].strip() or 0)
                    hi = lo if len(nums) == 1 else (int(nums[1]) if nums[1].strip() else None)
                    i = j + 1
                else:
                    lo, hi = {"*": (0, None), "?": (0, 1), "+": (1, None)}[c]
                    i += 1
                if alts[-1]:
                    what, a, b = alts[-1][-1]
                    alts[-1][-1] = (what, a * lo, None if hi is None or b is None else b * hi)
            elif c == '"':
                j = _skip_literal(body, i)
                alts[-1].append((_literal_text(body[i + 1:j - 1]), 1, 1))
                i = j
            elif c == "[":
                j = _skip_literal(body, i)
                alts[-1].append((("class", body[i:j]), 1, 1))
                i = j
            elif c == ".":
                alts[-1].append((("class", "[^\n]"), 1, 1))
                i += 1
            elif c == "(":
                j = _match_paren(body, i)
                group: list[list] = [[]]
                alts[-1].append((group, 1, 1))
                stack.append(group)
                ends.append(j)
                i += 1
            else:
                m = _NAME.match(body, i)
                if not m:
                    raise ValueError(c)
                alts[-1].append((("ref", m.group()), 1, 1))
                i = m.end()

    try:
        return {name: parts(body) for name, body in split_rules(text).items()}
    except (ValueError, IndexError, KeyError):
        return None


_LARK_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*:(?!:)", re.M)


def lark_as_gbnf(text: str) -> str | None:
    """A Lark grammar's rules and terminals written as GBNF rules, for lengths only: ``[x]`` -> ``(x)?``,
    ``x ~ n..m`` -> ``x{n,m}``, a ``/regex/`` terminal -> a one-byte literal (its counts are checked on the text
    itself), aliases and directives dropped.  None when it cannot be read that way."""
    out = []
    starts = list(_LARK_RULE.finditer(text))
    for m, nxt in zip(starts, starts[1:] + [None]):
        body = text[m.end(): nxt.start() if nxt else len(text)]
        body = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith(("%", "//")))
        conv, i, n = [], 0, len(body)
        while i < n:
            c = body[i]
            if c == '"':
                j = i + 1
                while j < n and body[j] != '"':
                    j += 2 if body[j] == "\\" else 1
                conv.append(body[i:j + 1])
                i = j + 1
                while i < n and body[i] == "i":  # a case-insensitive flag
                    i += 1
            elif c == "/":
                j = i + 1
                while j < n and body[j] != "/":
                    j += 2 if body[j] == "\\" else 1
                conv.append('"r"')
                i = j + 1
                while i < n and body[i].isalpha():  # flags
                    i += 1
            elif c == "[":
                conv.append("(")
                i += 1
            elif c == "]":
                conv.append(")?")
                i += 1
            elif c == "~":
                mm = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?").match(body, i)
                if not mm:
                    return None
                conv.append("{%s}" % (mm.group(1) if mm.group(2) is None else f"{mm.group(1)},{mm.group(2)}"))
                i = mm.end()
            elif body.startswith("->", i):
                mm = re.compile(r"->\s*[A-Za-z_][A-Za-z0-9_]*").match(body, i)
                i = mm.end() if mm else i + 2
            elif c == "." and body.startswith("..", i):
                return None  # a character range ("a".."z"): one byte
            else:
                conv.append(c)
                i += 1
        out.append(f"{m.group(1)} ::= {''.join(conv)}")
    return "\n".join(out) if out else None


def _class_char(cls: str) -> str:
    from .gbnf import class_items

    try:
        negated, items = class_items(cls)
    except ValueError:
        return "a"
    if not negated:
        return next((ch for ch in items if ch is not None), "a")
    banned = {ch for ch in items if ch is not None}
    return next((ch for ch in "a0 xA_.-" if ch not in banned), "a")


def gbnf_lengths(rules: dict[str, list[list[tuple]]], cap: int) -> tuple[dict[str, int], dict[str, int]]:
    """Per rule: the byte length of its shortest string, and of the shortest string of its longest alternative
    (lengths saturate at ``cap + 1``; a rule with no finite string is absent).  A fixpoint, no recursion."""
    sat = cap + 1
    best: dict[str, int] = {}

    def seq_len(seq) -> int | None:
        total = 0
        for what, lo, _hi in seq:
            if lo == 0:
                continue
            one = part_len(what)
            if one is None:
                return None
            total = min(sat, total + one * lo)
        return total

    def part_len(what) -> int | None:
        if isinstance(what, str):
            return len(what.encode("utf-8", "surrogatepass"))
        if isinstance(what, list):  # a group: the shortest alternative (groups nest at most 128 deep)
            lens = [seq_len(a) for a in what]
            lens = [x for x in lens if x is not None]
            return min(lens) if lens else None
        if what[0] == "class":
            return 1
        return best.get(what[1], None if what[1] in rules else 0)

    users = _users(rules)
    todo = list(rules)
    queued = set(todo)
    while todo:  # a worklist: a rule is looked at again only when a rule it names got shorter
        name = todo.pop()
        queued.discard(name)
        lens = [x for x in (seq_len(a) for a in rules[name]) if x is not None]
        if lens and (name not in best or min(lens) < best[name]):
            best[name] = min(lens)
            for u in users.get(name, ()):
                if u not in queued:
                    queued.add(u)
                    todo.append(u)
    longest_alt = {}
    for name, alts in rules.items():
        lens = [x for x in (seq_len(a) for a in alts) if x is not None]
        if lens:
            longest_alt[name] = max(lens)
    return best, longest_alt


def _users(rules: dict) -> dict[str, set]:
    """rule -> the rules whose bodies name it."""
    users: dict[str, set] = {}
    for name, alts in rules.items():
        stack = list(alts)
        while stack:
            seq = stack.pop()
            for what, _lo, _hi in seq:
                if isinstance(what, list):
                    stack.extend(what)
                elif isinstance(what, tuple) and what[0] == "ref":
                    users.setdefault(what[1], set()).add(name)
    return users


def gbnf_shortest(text: str, cap: int = 4096) -> str | None:
    """A shortest string of a GBNF grammar (bytes <= ``cap``), built from ``gbnf_lengths``; None when there is
    none that short or the grammar cannot be read.  (A witness: the engine certifies it before it is used.)"""
    rules = gbnf_parse(text)
    if rules is None or "root" not in rules:
        return None
    best, _ = gbnf_lengths(rules, cap)
    if best.get("root", cap + 1) > cap:
        return None
    out: list[str] = []
    todo: list = [("ref", "root")]  # an explicit stack of parts still to spell, last first
    steps = 0
    while todo:
        steps += 1
        if steps > 64 * cap + 1024:
            return None
        what = todo.pop()
        if isinstance(what, str):
            out.append(what)
        elif isinstance(what, tuple) and what[0] == "class":
            out.append(_class_char(what[1]))
        else:
            alts = rules.get(what[1]) if isinstance(what, tuple) else what
            if alts is None:
                return None
            target = best.get(what[1]) if isinstance(what, tuple) else None
            chosen = None
            for a in alts:
                n = _seq_len_of(a, rules, best)
                if n is not None and (target is None or n == target):
                    if chosen is None or n < chosen[0]:
                        chosen = (n, a)
            if chosen is None:
                return None
            for part, lo, _hi in reversed(chosen[1]):
                todo.extend([part] * lo)
    s = "".join(out)
    return s if len(s.encode("utf-8", "surrogatepass")) <= cap else None


def _seq_len_of(seq, rules, best) -> int | None:
    total = 0
    for what, lo, _hi in seq:
        if lo == 0:
            continue
        if isinstance(what, str):
            one = len(what.encode("utf-8", "surrogatepass"))
        elif isinstance(what, list):
            lens = [x for x in (_seq_len_of(a, rules, best) for a in what) if x is not None]
            one = min(lens) if lens else None
        elif what[0] == "class":
            one = 1
        else:
            one = best.get(what[1])
        if one is None:
            return None
        total += one * lo
    return total


# ------------------------------------------------------------------------------------------- per kind
_COUNT_KEYS = ("minItems", "maxItems", "minContains", "maxContains")


def _schema_nodes(schema):
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_schema(schema, kind: str) -> None:
    lim = _limits()
    for node in _schema_nodes(schema):
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > lim.max_choices:
            raise _refuse(f"an enum has {len(enum)} values; the limit is {lim.max_choices}", "SPECGRAMMAR_MAX_CHOICES",
                          kind)
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > lim.max_properties:
            raise _refuse(f"an object schema has {len(props)} properties; the limit is {lim.max_properties}",
                          "SPECGRAMMAR_MAX_PROPERTIES", kind)
        for key in _COUNT_KEYS:
            v = node.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > lim.max_items:
                raise _refuse(f"{key} is {v:g}; the limit is {lim.max_items}", "SPECGRAMMAR_MAX_ITEMS", kind)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1:
                items = node.get("items", node.get("contains"))
                size = len(json.dumps(items, separators=(",", ":"))) if isinstance(items, (dict, list)) else 1
                if v * size > lim.max_expansion:
                    raise _refuse(f"{key} {v:g} times an item schema of {size} bytes is an expansion of "
                                  f"{int(v * size)}; the limit is {lim.max_expansion}", "SPECGRAMMAR_MAX_EXPANSION",
                                  kind)
        pat = node.get("pattern")
        if isinstance(pat, str):
            _counts(pat, "a pattern", kind)


def check_cost(spec) -> None:
    """The absolute bounds (module docstring) on ``spec``; raises ``ConstraintError`` naming the limit."""
    lim = _limits()
    kind = spec.kind
    if kind == "choice":
        n = len(spec.value)
        if n > lim.max_choices:
            raise _refuse(f"the choice has {n} options; the limit is {lim.max_choices}", "SPECGRAMMAR_MAX_CHOICES",
                          kind)
        return
    if kind == "regex":
        _counts(spec.value, "the regex", kind)
        return
    if kind == "json_schema":
        schema = spec.schema
        _check_schema(schema, kind)
        return
    if kind == "grammar":
        text = spec.value
        _counts(text, "the grammar", kind, grammar=True)
        if spec.syntax in ("gbnf", "ebnf", "lark"):  # (xgrammar's EBNF is written as GBNF is)
            from .gbnf import split_rules

            text = text if spec.syntax != "lark" else (lark_as_gbnf(text) or "")
            n = len(split_rules(text))  # counted before any body is read
            if n > lim.max_rules:
                raise _refuse(f"the grammar has {n} rules; the limit is {lim.max_rules}", "SPECGRAMMAR_MAX_RULES", kind)
            rules = gbnf_parse(text)
            if rules is None:
                return
            if len(rules) > lim.max_rules:
                raise _refuse(f"the grammar has {len(rules)} rules; the limit is {lim.max_rules}",
                              "SPECGRAMMAR_MAX_RULES", kind)
            cap = lim.max_forced_bytes
            _, longest = gbnf_lengths(rules, cap)
            total = 0
            for name, n in longest.items():
                total += n
                if total > cap:
                    raise _refuse(f"a string of this grammar can be forced to more than {cap} bytes (the forced-string "
                                  f"limit): its rules' shortest strings add up past it (rule {name!r}: "
                                  f"{'more than ' + str(cap) if n > cap else n} bytes)", "SPECGRAMMAR_MAX_FORCED_BYTES",
                                  kind)


def check_text(value, where: str) -> None:
    """A string a constraint or request option carries must be encodable as UTF-8 (a lone surrogate is not)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ConstraintError(f"{where} holds a lone surrogate (not a Unicode character: no UTF-8 text "
                                      "spells it)") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


__all__ = ["Deadline", "check_cost", "check_text", "current", "deadline", "gbnf_lengths", "gbnf_parse",
           "gbnf_shortest", "overrun", "prepare_deadline", "process_cpu", "run_stoppable", "thread_cpu"]


# ------------------------------------------------------------------------------------------- against the budget
def check_fit(spec, options, max_tokens: int | None, max_token_bytes: int | None) -> None:
    """What cannot fit in the request's budget, refused before any compile (``BudgetError``): a JSON Schema
    ``minItems`` / ``minLength`` / ``minProperties`` or a GBNF grammar's shortest string that needs more bytes than
    ``budget`` tokens of at most ``max_token_bytes`` bytes each can spell (an item takes at least 2 bytes with its
    comma, a property 5: ``"":0,``; the schema's top level only, where its ``type`` makes the keyword bind).  Off where the budget is (``budget_mask: false``, no ``max_tokens``)."""
    from .errors import BudgetError

    if options is not None and getattr(options, "budget_mask", None) is False:
        return
    budget = max_tokens
    if options is not None and getattr(options, "budget", None) is not None:
        budget = options.budget if budget is None else min(budget, options.budget)
    if budget is None or not max_token_bytes or budget >= 1 << 20:
        return
    room = budget * max_token_bytes

    def refuse(what: str, need: int):
        raise BudgetError(f"{what} needs at least {need} bytes, and {budget} tokens (max_tokens or specgrammar.budget) "
                          f"spell at most {room} bytes on this model: raise it, or send \"specgrammar\": "
                          "{\"budget_mask\": false} to allow an output cut off at the limit", shortest=None,
                          budget=budget, kind=spec.kind)

    if spec.kind == "json_schema":
        node = spec.schema  # only the top level, and only where its type makes the keyword bind (a keyword under
        if isinstance(node, dict):  # anyOf, or on a value that may be of another type, does not)
            for key, typ, per in (("minItems", "array", 2), ("minLength", "string", 1), ("minProperties", "object", 5)):
                v = node.get(key)
                if (node.get("type") == typ and isinstance(v, (int, float)) and not isinstance(v, bool)
                        and v * per > room):
                    refuse(f"{key} {v:g}", int(v * per))
    elif spec.kind == "grammar" and spec.syntax == "gbnf":
        rules = gbnf_parse(spec.value)
        if rules is not None and "root" in rules:
            best, _ = gbnf_lengths(rules, room)
            if best.get("root", 0) > room:
                refuse("the grammar's shortest string", best["root"])
