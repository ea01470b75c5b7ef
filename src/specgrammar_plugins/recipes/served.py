"""Verified outputs a server has served, kept (opt-in) for a later recipe-pack build.

An operator names a folder (``SPECGRAMMAR_SERVED_DIR``, or ``SpecOptions.extra["served_dir"]`` from the host's own
code; never a request field: a client does not choose where a server writes).  Every request the core loop
decodes to its end under a constraint (finish ``stop``: the grammar's matcher accepted every token and the output
ended where the grammar or a stop token ended it) is appended as one JSON line to
``<folder>/<tokenizer fingerprint>.jsonl``: the prompt's and the output's token ids and the constraint
(``{"kind", "value", "syntax"}``).  ``specgrammar recipes build --served <folder>`` folds them into a pack for that
tokenizer.  Lines are appended whole (one ``write`` of a line under a process-wide lock); a torn last line (the
server died mid-write) is skipped when read.  ``max_bytes`` bounds a file: past it nothing more is appended.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Iterator

ENV = "SPECGRAMMAR_SERVED_DIR"
_LOCK = threading.Lock()


class ServedLog:
    def __init__(self, folder: str | os.PathLike, *, max_bytes: int = 256 << 20):
        self.folder = Path(folder)
        self.max_bytes = max_bytes

    def path_for(self, fingerprint: str) -> Path:
        return self.folder / f"{fingerprint}.jsonl"

    def record(self, loop) -> bool:
        """The loop's ``on_finish``: append its request if it ended under a constraint with finish ``stop``."""
        c = loop.constraint
        if c is None or loop.finish_reason != "stop" or not loop.emitted:
            return False
        tok = c.tokenizer
        fp = getattr(tok, "vocab_fingerprint", None) or "unknown"
        spec = c.spec
        line = json.dumps({"prompt": [int(t) for t in loop.prompt], "output": [int(t) for t in loop.emitted],
                           "constraint": {"kind": spec.kind, "value": spec.value if isinstance(spec.value, str)
                                          else json.dumps(spec.value, sort_keys=True), "syntax": spec.syntax}},
                          separators=(",", ":")) + "\n"
        p = self.path_for(fp)
        with _LOCK:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                if p.exists() and p.stat().st_size > self.max_bytes:
                    return False
                with open(p, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError:
                return False  # serving goes on: the log is a convenience
        return True

    def samples(self, fingerprint: str | None = None) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(prompt, output) of every whole line, of one tokenizer's file (or of all of them)."""
        files = [self.path_for(fingerprint)] if fingerprint else sorted(self.folder.glob("*.jsonl"))
        for f in files:
            if not f.exists():
                continue
            for line in f.read_text(encoding="utf-8").splitlines():
                try:
                    d = json.loads(line)
                    yield tuple(int(t) for t in d["prompt"]), tuple(int(t) for t in d["output"])
                except (ValueError, KeyError, TypeError):
                    continue


def served_log(extra: dict | None = None) -> ServedLog | None:
    """The operator's served-output log: ``extra["served_dir"]``, else ``$SPECGRAMMAR_SERVED_DIR``; None when
    neither names a folder."""
    folder = (extra or {}).get("served_dir") or os.environ.get(ENV)
    return ServedLog(folder) if folder else None
