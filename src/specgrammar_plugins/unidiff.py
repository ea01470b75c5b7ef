"""Unified diffs, applied with exact context (no fuzz), reversibly: what ``specgrammar patch HOST`` applies.

Moved out of ``adapters/specgrammar_mlx_lm/patch.py`` (issue 34): nothing here needs the host.  ``parse_diff``
reads ``-p1`` unified-diff text into ``FilePatch`` / ``Hunk``; ``state`` says whether a folder is clean, applied
or in conflict; ``apply`` writes every file (or none: each file is checked to apply first), ``reverse=True`` takes
the diff back out.  ``PatchError``: a malformed diff, or one that does not apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


class PatchError(RuntimeError):
    pass


@dataclass
class Hunk:
    old_start: int
    old: list[str] = field(default_factory=list)  # lines (with newline) the hunk replaces (context + removed)
    new: list[str] = field(default_factory=list)  # lines it puts there (context + added)


@dataclass
class FilePatch:
    old_path: str | None  # None = new file
    new_path: str | None  # None = deleted file
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path


def _strip(p: str) -> str | None:
    p = p.split("\t")[0].strip()
    if p == "/dev/null":
        return None
    return p.split("/", 1)[1] if "/" in p else p  # -p1


def parse_diff(text: str) -> list[FilePatch]:
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    cur: FilePatch | None = None
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            cur = FilePatch(_strip(ln[4:]), _strip(lines[i + 1][4:]))
            files.append(cur)
            i += 2
            continue
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", ln)
        if m and cur is not None:
            n_old = int(m.group(2)) if m.group(2) is not None else 1
            n_new = int(m.group(4)) if m.group(4) is not None else 1
            h = Hunk(int(m.group(1)))
            i += 1
            while i < len(lines) and (len(h.old) < n_old or len(h.new) < n_new):
                body = lines[i]
                tag, rest = body[:1], body[1:]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                if tag == " " or body in ("\n",):
                    rest = rest if tag == " " else "\n"
                    h.old.append(rest)
                    h.new.append(rest)
                elif tag == "-":
                    h.old.append(rest)
                elif tag == "+":
                    h.new.append(rest)
                else:
                    raise PatchError(f"malformed hunk line {i + 1}: {body!r}")
                i += 1
            cur.hunks.append(h)
            continue
        i += 1
    return files


def _apply_hunks(lines: list[str], hunks: list[Hunk], reverse: bool) -> list[str] | None:
    """Apply hunks with exact context (searching near the stated line); None if any does not match."""
    out = list(lines)
    delta = 0
    for h in hunks:
        old, new = (h.new, h.old) if reverse else (h.old, h.new)
        want = h.old_start - 1 + delta
        found = None
        for off in sorted(range(-len(out) - 1, len(out) + 1), key=abs):
            pos = want + off
            if 0 <= pos <= len(out) - len(old) and out[pos:pos + len(old)] == old:
                found = pos
                break
        if found is None:
            return None
        out[found:found + len(old)] = new
        delta += len(new) - len(old)
    return out


def state(root: Path, patches: list[FilePatch]) -> str:
    """'clean' (the diff applies), 'applied' (its reverse applies) or 'conflict'."""
    fwd = rev = True
    for fp in patches:
        p = root / fp.path
        if fp.old_path is None:  # new file
            new = "".join(h for hk in fp.hunks for h in hk.new)
            exists = p.exists()
            fwd &= not exists
            rev &= exists and p.read_text() == new
            continue
        if not p.exists():
            return "conflict"
        lines = p.read_text().splitlines(keepends=True)
        fwd &= _apply_hunks(lines, fp.hunks, False) is not None
        rev &= _apply_hunks(lines, fp.hunks, True) is not None
    if rev and not fwd:
        return "applied"
    if fwd and not rev:
        return "clean"
    return "conflict"


def apply(root: Path, patches: list[FilePatch], reverse: bool = False) -> list[str]:
    written = []
    results: dict[Path, str | None] = {}
    for fp in patches:
        p = root / fp.path
        if fp.old_path is None:
            results[p] = None if reverse else "".join(h for hk in fp.hunks for h in hk.new)
            continue
        out = _apply_hunks(p.read_text().splitlines(keepends=True), fp.hunks, reverse)
        if out is None:
            raise PatchError(f"{p}: the diff does not apply (was the file modified?)")
        results[p] = "".join(out)
    for p, text in results.items():  # write only once every file is known to apply
        if text is None:
            if p.exists():
                p.unlink()
        else:
            p.write_text(text)
        written.append(str(p))
    return written
