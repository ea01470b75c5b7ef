"""The recipe-pack format and its lookup: ``RecipePack`` (two reversed-key tries: literal token suffixes and shape
suffixes), the shape classes, copy recipes (``copy_source``, ``number_span``), and finding packs (a path or a shipped pack's name).
See the package docstring for what a recipe is."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import SpecGrammarError

FORMAT = "specgrammar-recipes"
VERSION = 1
SHAPE_RULE = 1  # version of the token -> shape-class rule below (a pack records the rule it was built with)
KINDS = ("literal", "shape")
NUM, ALPHA = -1, -2
CLASS_NAMES = {NUM: "<num>", ALPHA: "<alpha>"}
CLASS_IDS = {v: k for k, v in CLASS_NAMES.items()}
_NUM_RE = re.compile(rb"^ ?[0-9]+$")
_ALPHA_RE = re.compile(rb"^ ?[A-Za-z]+$")
_CAPS_RE = re.compile(rb"^ ?[A-Z]{2,}$")

COPY = -100  # a run (COPY, n): copy up to n tokens from the prompt (see ``copy_source``)
COPY_NUMBER = -101  # a run (COPY_NUMBER, n): copy up to n tokens of the prompt's number (see ``number_span``)
COPIES = (COPY, COPY_NUMBER)
DEFAULTS = dict(max_key=8, max_shape_key=12, max_run=32, min_count=2, agree=0.8, max_recipes=4096, copy_agree=0.5)



class RecipePackError(SpecGrammarError, ValueError):
    """A recipe pack cannot be used: unreadable, corrupted (hash mismatch), another format version, or built for
    another tokenizer.  The message names the file."""


# ---------------------------------------------------------------------------------------------- shapes
def token_class(data: bytes) -> int | None:
    """The shape class of a token's bytes (``NUM``/``ALPHA``), or None when the token stays literal."""
    if _NUM_RE.match(data):
        return NUM
    if _ALPHA_RE.match(data) and not _CAPS_RE.match(data):
        return ALPHA
    return None


def class_table(token_bytes: Sequence[bytes], vocab_size: int | None = None) -> list[int]:
    """Token id -> shape symbol (the id itself, or a negative class id); ids past the tokenizer stay literal."""
    n = max(len(token_bytes), vocab_size or 0)
    out = list(range(n))
    for i, b in enumerate(token_bytes):
        c = token_class(b) if b else None
        if c is not None:
            out[i] = c
    return out


def shape_of(tokens: Sequence[int], classes: Sequence[int]) -> list[int]:
    """The collapsed shape of a token sequence (for building; lookups compute it backwards on the fly)."""
    out: list[int] = []
    for t in tokens:
        s = classes[t] if 0 <= t < len(classes) else t
        if s < 0 and out and out[-1] == s:
            continue
        out.append(s)
    return out


# ---------------------------------------------------------------------------------------------- copying
def prompt_positions(prompt: Sequence[int]) -> dict[int, list[int]]:
    """Token id -> its positions in the prompt (for ``copy_source``)."""
    pos: dict[int, list[int]] = {}
    for j, t in enumerate(prompt):
        pos.setdefault(t, []).append(j)
    return pos


def copy_source(prompt: Sequence[int], positions: dict[int, list[int]], seq: Sequence[int], max_match: int = 4
                ) -> int | None:
    """Where in the prompt a copy of ``seq``'s continuation would start: after the prompt occurrence of seq's last
    token whose preceding tokens match seq's longest (latest occurrence on ties); None when there is none."""
    if not seq:
        return None
    cands = positions.get(seq[-1])
    if not cands:
        return None
    n = len(prompt)
    best, best_len = -1, 0
    for p in reversed(cands):
        if p + 1 >= n:
            continue  # the prompt's own last token: nothing after it to copy
        m = 1
        while m < max_match and p - m >= 0 and m < len(seq) and prompt[p - m] == seq[-1 - m]:
            m += 1
        if m > best_len:
            best, best_len = p, m
            if m == max_match:
                break
    return best + 1 if best >= 0 else None


def number_span(prompt: Sequence[int], classes: Sequence[int]) -> tuple[int, int] | None:
    """Where the prompt's number is: (start, end) of its longest run of number-class tokens (``NUM``; the latest on
    ties), None when it has none.  A copy anchored on the context (``copy_source``) cannot start a value
    the answer opens with (``Find the year: ... in 2005.`` answered ``2005``: the context before it is the chat
    template's), and a literal recipe learns the training answers' digits there (``1`` for 11 of 12 years)."""
    ncls = len(classes)
    best = None
    i = -1  # the start of the run of digits being walked (-1: none)
    for j, t in enumerate([*prompt, -1]):  # (-1 ends a run at the prompt's end)
        if 0 <= t < ncls and classes[t] == NUM:
            i = j if i < 0 else i
        elif i >= 0:
            if best is None or j - i >= best[1] - best[0]:
                best = (i, j)
            i = -1
    return best


# ---------------------------------------------------------------------------------------------- the pack
@dataclass
class Recipe:
    kind: str  # "literal" | "shape"
    key: tuple[int, ...]  # token ids (literal) or shape symbols (negative = class), oldest first
    run: tuple[int, ...]  # the continuation: token ids
    count: int  # occurrences that agreed on the run (support)
    seen: int = 0  # occurrences of the key

    def sort_key(self):
        return (KINDS.index(self.kind), len(self.key), self.key)


def _key_to_json(key: Sequence[int]) -> list:
    return [CLASS_NAMES.get(s, s) if s < 0 else s for s in key]


def _key_from_json(key: list, where: str) -> tuple[int, ...]:
    out = []
    for s in key:
        if isinstance(s, str):
            if s not in CLASS_IDS:
                raise RecipePackError(f"{where}: unknown shape class {s!r}")
            out.append(CLASS_IDS[s])
        elif isinstance(s, int) and s >= 0:
            out.append(s)
        else:
            raise RecipePackError(f"{where}: bad key symbol {s!r}")
    return tuple(out)


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class RecipePack:
    """A set of recipes for one tokenizer, with its two lookup indexes."""

    def __init__(self, recipes: Iterable[Recipe], *, fingerprint: str, tokenizer_name: str = "tokenizer",
                 meta: dict | None = None, tokenizer=None, source: str | None = None):
        self.fingerprint = fingerprint
        self.tokenizer_name = tokenizer_name
        self.meta = dict(meta or {})
        self.source = source  # the file it was loaded from, if any
        self.recipes: dict[tuple[str, tuple[int, ...]], Recipe] = {}
        # the model's layout (``layout.LayoutIndex.table``): layout key -> run; saved only when non-empty
        self.layout: dict[tuple[int, ...], tuple[int, ...]] = {}
        for r in recipes:
            self.recipes[(r.kind, r.key)] = r
        self._classes: list[int] | None = None
        self._token_bytes: Sequence[bytes] | None = None
        self._lit: dict = {}
        self._shape: dict = {}
        self._dirty = True
        if tokenizer is not None:
            self.bind(tokenizer)

    # ------------------------------------------------------------------ tokenizer
    def bind(self, tokenizer) -> "RecipePack":
        """Check the tokenizer (fingerprint) and enable the shape index, which needs each token's bytes."""
        if tokenizer.vocab_fingerprint != self.fingerprint:
            where = f"recipe pack {self.source}" if self.source else "recipe pack"
            raise RecipePackError(
                f"{where} was built for tokenizer {self.tokenizer_name!r} (fingerprint {self.fingerprint}); this model's "
                f"tokenizer {getattr(tokenizer, 'name', '?')!r} has fingerprint {tokenizer.vocab_fingerprint}: rebuild the pack "
                "for this model (specgrammar recipes build)")
        self._token_bytes = tokenizer.token_bytes
        self._classes = class_table(tokenizer.token_bytes, tokenizer.vocab_size)
        self._dirty = True
        return self

    @property
    def bound(self) -> bool:
        return self._classes is not None

    # ------------------------------------------------------------------ indexes
    def _index(self) -> None:
        lit: dict = {}
        shape: dict = {}
        for (kind, key), r in self.recipes.items():
            root = lit if kind == "literal" else shape
            node = root
            for s in reversed(key):
                node = node.setdefault(s, {})
            node[None] = r.run
        self._lit, self._shape = lit, shape
        self._dirty = False

    def lookup(self, seq: Sequence[int]) -> tuple[int, ...] | None:
        """The run for the longest literal match of ``seq``'s suffix, else for the longest shape match, else None."""
        if self._dirty:
            self._index()
        best = None
        node = self._lit
        i = len(seq) - 1
        while i >= 0:
            node = node.get(seq[i])
            if node is None:
                break
            r = node.get(None)
            if r is not None:
                best = r
            i -= 1
        if best is not None:
            return best or None  # () marks a context where the model is known not to be deterministic
        classes = self._classes
        if classes is None or not self._shape:
            return None
        node = self._shape
        ncls = len(classes)
        prev = 0
        i = len(seq) - 1
        while i >= 0:
            t = seq[i]
            i -= 1
            s = classes[t] if t < ncls else t
            if s < 0 and s == prev:
                continue
            prev = s
            node = node.get(s)
            if node is None:
                break
            r = node.get(None)
            if r is not None:
                best = r
        return best or None

    def match(self, seq: Sequence[int]) -> Recipe | None:
        """Like ``lookup`` but returns the Recipe (slow path, for inspection and tests)."""
        run = self.lookup(seq)
        if run is None:
            return None
        for n in range(min(len(seq), DEFAULTS["max_key"] * 4), 0, -1):
            r = self.recipes.get(("literal", tuple(seq[-n:])))
            if r is not None and r.run == run:
                return r
        if self._classes is not None:
            sh = shape_of(seq[-64:], self._classes)
            for n in range(min(len(sh), 64), 0, -1):
                r = self.recipes.get(("shape", tuple(sh[-n:])))
                if r is not None and r.run == run:
                    return r
        return None

    # ------------------------------------------------------------------ size
    def __len__(self) -> int:
        return len(self.recipes)

    def prune(self, max_recipes: int) -> int:
        """Keep the ``max_recipes`` most used recipes (count x run length, then shorter keys); returns how many went."""
        if len(self.recipes) <= max_recipes:
            return 0
        ranked = sorted(self.recipes.values(), key=lambda r: (-max(r.count * len(r.run), r.seen if not r.run else 0),
                                                              len(r.key), r.sort_key()))
        keep = ranked[:max_recipes]
        dropped = len(self.recipes) - len(keep)
        self.recipes = {(r.kind, r.key): r for r in keep}
        self._dirty = True
        return dropped

    def stats(self) -> dict:
        by_kind = {k: sum(1 for r in self.recipes.values() if r.kind == k and r.run) for k in KINDS}
        by_kind["blockers"] = sum(1 for r in self.recipes.values() if not r.run)
        by_kind["copy"] = sum(1 for r in self.recipes.values() if r.run[:1] == (COPY,))
        by_kind["copy_number"] = sum(1 for r in self.recipes.values() if r.run[:1] == (COPY_NUMBER,))
        runs = [len(r.run) for r in self.recipes.values() if r.run and r.run[0] not in COPIES]
        return {"recipes": len(self.recipes), **by_kind, "run_tokens": sum(runs),
                "mean_run": (sum(runs) / len(runs)) if runs else 0.0, "max_run": max(runs, default=0),
                "bytes": len(self.to_json_bytes()), "fingerprint": self.fingerprint, "tokenizer": self.tokenizer_name}

    # ------------------------------------------------------------------ serialization
    def _text(self, ids: Sequence[int]) -> str:
        if self._token_bytes is None:
            return ""
        if len(ids) == 2 and ids[0] == COPY:
            return f"<copy up to {ids[1]} tokens from the prompt>"
        if len(ids) == 2 and ids[0] == COPY_NUMBER:
            return f"<copy up to {ids[1]} tokens of the prompt's number>"
        n = len(self._token_bytes)
        return b"".join(self._token_bytes[i] if 0 <= i < n else b"" for i in ids).decode("utf-8", "replace")

    def _key_text(self, r: Recipe) -> str:
        if r.kind == "literal":
            return self._text(r.key)
        return "".join(CLASS_NAMES[s] if s < 0 else self._text([s]) for s in r.key)

    def to_dict(self) -> dict:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "shape_rule": SHAPE_RULE,
            "tokenizer": {"fingerprint": self.fingerprint, "name": self.tokenizer_name},
            "meta": self.meta,
            "recipes": [
                {"kind": r.kind, "key": _key_to_json(r.key), "run": list(r.run), "count": r.count, "seen": r.seen,
                 **({"text": [self._key_text(r), self._text(r.run)]} if self._token_bytes is not None else {})}
                for r in sorted(self.recipes.values(), key=Recipe.sort_key)
            ],
        }
        if self.layout:
            from .layout import table_to_json

            body["layout"] = table_to_json(self.layout)
        body["sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
        return body

    def to_json_bytes(self) -> bytes:
        d = self.to_dict()
        recipes = d.pop("recipes")
        sha = d.pop("sha256")
        layout = d.pop("layout", None)
        head = json.dumps(d, sort_keys=True, ensure_ascii=False, indent=1)[:-2]  # drop the closing "\n}"
        lines = [json.dumps(r, sort_keys=True, ensure_ascii=False) for r in recipes]
        text = head + ',\n "recipes": [\n  ' + ",\n  ".join(lines) + ("\n ],\n" if lines else "],\n")
        if layout is not None:
            text += ' "layout": [\n  ' + ",\n  ".join(json.dumps(r) for r in layout) + "\n ],\n"
        text += f' "sha256": "{sha}"\n}}\n'
        return text.encode("utf-8")

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_bytes(self.to_json_bytes())
        os.replace(tmp, p)
        self.source = str(p)
        return p

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "<dict>", tokenizer=None) -> "RecipePack":
        where = f"recipe pack {source}"
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise RecipePackError(f"{where} is not a recipe pack (format {d.get('format') if isinstance(d, dict) else None!r},"
                                  f" expected {FORMAT!r})")
        if d.get("version") != VERSION:
            raise RecipePackError(f"{where} has format version {d.get('version')!r}; this build reads version "
                                  f"{VERSION}: rebuild it with specgrammar recipes build")
        if d.get("shape_rule") != SHAPE_RULE:
            raise RecipePackError(f"{where} uses shape rule {d.get('shape_rule')!r}; this build uses {SHAPE_RULE}: rebuild it")
        body = {k: v for k, v in d.items() if k != "sha256"}
        sha = hashlib.sha256(_canonical(body)).hexdigest()
        if d.get("sha256") != sha:
            raise RecipePackError(f"{where} is corrupted: content hash {sha[:16]}... does not match the recorded "
                                  f"{str(d.get('sha256'))[:16]}...")
        try:
            tok = d["tokenizer"]
            recipes = []
            for i, r in enumerate(d["recipes"]):
                kind = r["kind"]
                if kind not in KINDS:
                    raise RecipePackError(f"{where}: recipe {i} has unknown kind {kind!r}")
                run = tuple(int(t) for t in r["run"])
                if run and (min(run[1:], default=0) < 0 or (run[0] < 0 and (run[0] not in COPIES or len(run) != 2))):
                    raise RecipePackError(f"{where}: recipe {i} has a bad run")
                recipes.append(Recipe(kind, _key_from_json(r["key"], f"{where}: recipe {i}"), run, int(r["count"]),
                                      int(r.get("seen", 0))))
            pack = cls(recipes, fingerprint=str(tok["fingerprint"]), tokenizer_name=str(tok.get("name", "?")),
                       meta=d.get("meta") or {}, source=source)
            if d.get("layout"):
                from .layout import table_from_json

                pack.layout = table_from_json(d["layout"], f"{where}: layout")
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, RecipePackError):
                raise
            raise RecipePackError(f"{where} is malformed: {type(e).__name__}: {e}") from None
        if tokenizer is not None:
            pack.bind(tokenizer)
        return pack

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer=None) -> "RecipePack":
        """Read a pack file; with ``tokenizer``, check its fingerprint and enable the shape index."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise RecipePackError(f"recipe pack {p}: cannot read it ({e.strerror or e})") from None
        try:
            d = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RecipePackError(f"recipe pack {p} is corrupted: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(p), tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------- finding packs
_LOADED: dict = {}
# The shipped packs: the repository's top-level ``recipes/`` folder, installed as this package's data
SHIPPED_PACKAGE = "specgrammar_plugins.recipes.shipped"


def shipped_packs() -> dict[str, Path]:
    """Name -> file of every shipped pack (``recipes/<name>.json`` in a checkout; package data in a wheel)."""
    from importlib.resources import files

    try:
        root = files(SHIPPED_PACKAGE)
    except ModuleNotFoundError:  # a build without the shipped packs
        return {}
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".json")}


def shipped_pack(name: str) -> Path | None:
    """The file of the shipped pack ``name`` (e.g. a workload's name), or None."""
    return shipped_packs().get(name)


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A pack file from a path, or from the name of a shipped pack."""
    p = Path(name_or_path)
    if p.exists() and p.is_file():
        return p
    shipped = shipped_pack(str(name_or_path))
    if shipped is not None:
        return shipped
    names = sorted(shipped_packs())
    raise RecipePackError(f"recipe pack {str(name_or_path)!r} not found (not a file; shipped packs: "
                          f"{', '.join(names) or 'none'})")


# A pack a request names: a name, never a path (no separators, no leading dot: "..", ".hidden" and "/etc/passwd"
# are not names).
PACK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def resolve_name(name: str, pack_dir: str | os.PathLike | None = None) -> Path:
    """The file of the pack a *request* names (``specgrammar.recipe``): ``<pack_dir>/<name>.json`` when the host
    was started with a pack directory and holds it, else the shipped pack ``name``.  Never a path: the name is
    checked against ``PACK_NAME`` and then looked up in the directory's listing, so no file outside the pack
    directory (or the shipped packs) is ever opened, or even stat'ed, on a client's say.  ``resolve`` (paths
    too) is for the operator's own options."""
    if not isinstance(name, str) or PACK_NAME.fullmatch(name) is None:
        raise RecipePackError(f"recipe pack {name!r} is not a pack name (letters, digits, '_', '-', '.'; a request "
                              "names a pack, never a path)")
    available: dict[str, Path] = {}
    if pack_dir is not None:
        try:
            available = {p.stem: p for p in Path(pack_dir).iterdir() if p.suffix == ".json" and p.is_file()}
        except OSError as e:
            raise RecipePackError(f"the server's recipe pack directory cannot be read ({e.strerror})") from None
    shipped = shipped_packs()
    found = available.get(name) or shipped.get(name)
    if found is None:
        names = sorted({*available, *shipped})
        raise RecipePackError(f"recipe pack {name!r} not found (available: {', '.join(names) or 'none'})")
    return found


_FINGERPRINTS: dict = {}


def auto_pack(tokenizer) -> Path | None:
    """The shipped pack chosen for a tokenizer when a request names none: the one whose ``meta.auto`` is true and
    whose fingerprint is the tokenizer's (e.g. ``recipes/smollm2-135m.json`` for SmolLM2's vocabulary); None when
    no shipped pack is marked for it."""
    fp = getattr(tokenizer, "vocab_fingerprint", None)
    if fp is None:
        return None
    for name, p in sorted(shipped_packs().items()):
        try:
            key = (str(p), p.stat().st_mtime_ns)
        except OSError:
            continue
        got = _FINGERPRINTS.get(key)
        if got is None:
            try:
                head = p.read_bytes()[:4096].decode("utf-8", "replace")
            except OSError:
                continue
            m = re.search(r'"fingerprint": "([0-9a-f]+)"', head)
            got = _FINGERPRINTS[key] = ((m.group(1) if m else ""), '"auto": true' in head)
        if got[0] == fp and got[1]:
            return p
    return None


def load_pack(name_or_path, tokenizer=None) -> RecipePack:
    """Load (and cache, by path, mtime and tokenizer) a pack by path or shipped name."""
    if isinstance(name_or_path, RecipePack):
        if tokenizer is not None and not name_or_path.bound:
            name_or_path.bind(tokenizer)
        return name_or_path
    p = resolve(name_or_path)
    key = (str(p.resolve()), p.stat().st_mtime_ns, getattr(tokenizer, "fingerprint", None))
    pack = _LOADED.get(key)
    if pack is None:
        pack = RecipePack.load(p, tokenizer)
        if len(_LOADED) > 32:
            _LOADED.clear()
        _LOADED[key] = pack
    return pack
