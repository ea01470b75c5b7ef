"""Recipe packs: deterministic continuations learnt from the target model's own verified outputs.

A *recipe* says: after this context, the target model writes these tokens.  A pack is built offline by letting the
target answer ``k`` samples per training prompt (plain constrained sampling: ``SpeculativeLoop(drafter=None)``)
and keeping the token runs on which every occurrence agrees; at run time ``RecipeDrafter`` proposes the run for the
current context as one-hot drafts that the target verifies (so a pack can make decoding faster, never different).

Two indexes, both keyed by a suffix of the context (prompt + emitted tokens), longest match first:

- ``literal``: the last n token ids, exactly.
- ``shape``: the last n *symbols* of the context after literals are abstracted: a token made only of digits is
  ``<num>``, one made only of letters (not an all-capitals keyword such as ``FROM``) is ``<alpha>``, with an optional
  leading space; consecutive tokens of one class collapse into one symbol.  ``"name": "John Smith", "`` and
  ``"name": "Li Wang", "`` share the shape ``"<alpha>": "<alpha>", "``, so one recipe serves every value.

Lookup tries the literal index, then the shape index, each as one backward walk over a reversed-key trie
(a few hundred nanoseconds; ``benchmark_lookup`` measures it).

File format (``FORMAT``/``VERSION``): one JSON object, human-inspectable, stable ordering (recipes sorted by
index, then key), content-hashed (``sha256`` of the canonical JSON of everything else, checked at load), and
bound to one tokenizer by ``TokenizerInfo.vocab_fingerprint`` (a pack for other token bytes is refused at load).  Each
recipe carries its decoded text for reading; the ids are what count.

Building: ``sample(runner, ...)`` collects verified outputs, ``build(samples, tokenizer)`` turns samples into a
pack (``--agree``: the share of occurrences that must agree on each token of a run; ``--min-count``: how many
occurrences a key needs), ``merge`` combines two packs, ``MissLog``/``observe`` record served sequences where the
pack had nothing to say, and a later ``build(..., extra=misslog.samples())`` folds them in.  ``prune`` bounds the
size, dropping the least used recipes (count x run length).

Online: ``SuffixIndex`` is a per-server, bounded (LRU by tokens) index over recently verified outputs
(SuffixDecoding-style) that learns while serving through ``observe(tokens)``; ``SuffixDrafter`` proposes from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .errors import SpecGrammarError

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
DEFAULTS = dict(max_key=8, max_shape_key=12, max_run=32, min_count=2, agree=0.8, max_recipes=4096, copy_agree=0.5)
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "recipes"


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
        runs = [len(r.run) for r in self.recipes.values() if r.run and r.run[0] != COPY]
        return {"recipes": len(self.recipes), **by_kind, "run_tokens": sum(runs),
                "mean_run": (sum(runs) / len(runs)) if runs else 0.0, "max_run": max(runs, default=0),
                "bytes": len(self.to_json_bytes()), "fingerprint": self.fingerprint, "tokenizer": self.tokenizer_name}

    # ------------------------------------------------------------------ serialization
    def _text(self, ids: Sequence[int]) -> str:
        if self._token_bytes is None:
            return ""
        if len(ids) == 2 and ids[0] == COPY:
            return f"<copy up to {ids[1]} tokens from the prompt>"
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
        body["sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
        return body

    def to_json_bytes(self) -> bytes:
        d = self.to_dict()
        recipes = d.pop("recipes")
        sha = d.pop("sha256")
        head = json.dumps(d, sort_keys=True, ensure_ascii=False, indent=1)[:-2]  # drop the closing "\n}"
        lines = [json.dumps(r, sort_keys=True, ensure_ascii=False) for r in recipes]
        text = head + ',\n "recipes": [\n  ' + ",\n  ".join(lines) + ("\n ],\n" if lines else "],\n")
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
                if run and (min(run[1:], default=0) < 0 or (run[0] < 0 and (run[0] != COPY or len(run) != 2))):
                    raise RecipePackError(f"{where}: recipe {i} has a bad run")
                recipes.append(Recipe(kind, _key_from_json(r["key"], f"{where}: recipe {i}"), run, int(r["count"]),
                                      int(r.get("seen", 0))))
            pack = cls(recipes, fingerprint=str(tok["fingerprint"]), tokenizer_name=str(tok.get("name", "?")),
                       meta=d.get("meta") or {}, source=source)
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


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A pack path from a path, or from the name of a shipped pack (``recipes/<name>.json``)."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        return p
    if p.exists() and p.is_file():
        return p
    shipped = SHIPPED_DIR / f"{name_or_path}.json"
    if shipped.exists():
        return shipped
    names = sorted(x.stem for x in SHIPPED_DIR.glob("*.json")) if SHIPPED_DIR.exists() else []
    raise RecipePackError(f"recipe pack {str(name_or_path)!r} not found (not a file; shipped packs: "
                          f"{', '.join(names) or 'none'})")


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


# ---------------------------------------------------------------------------------------------- building
@dataclass
class Sample:
    """One verified output: the prompt's token ids and what the target emitted after it."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    workload: str | None = None


def _runs(occ: list[tuple[Sequence[int], int]], *, min_count: int, agree: float, max_run: int
          ) -> tuple[tuple[int, ...], int] | None:
    """The run the occurrences agree on: at each step the majority token must hold an ``agree`` share of the
    occurrences still in play (an occurrence whose sequence ended counts against), and at least ``min_count``
    must remain.  Returns (run, supporting occurrences) or None."""
    run: list[int] = []
    live = occ
    while len(run) < max_run:
        j = len(run)
        counts: dict[int, int] = {}
        for seq, i in live:
            if i + j < len(seq):
                t = seq[i + j]
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        tok, c = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
        if c < min_count or c < agree * len(live):
            break
        run.append(tok)
        live = [(seq, i) for seq, i in live if i + j < len(seq) and seq[i + j] == tok]
    if not run:
        return None
    return tuple(run), len(live)


def build(samples: Iterable[Sample], tokenizer, *, max_key: int = DEFAULTS["max_key"],
          max_shape_key: int = DEFAULTS["max_shape_key"], max_run: int = DEFAULTS["max_run"],
          min_count: int = DEFAULTS["min_count"], agree: float = DEFAULTS["agree"],
          max_recipes: int = DEFAULTS["max_recipes"], meta: dict | None = None, extra: Iterable[Sample] = (),
          shapes: bool = True, copy: bool = True, copy_agree: float = DEFAULTS["copy_agree"],
          progress: bool = False) -> RecipePack:
    """Turn verified samples into a pack.

    Every output position of every sample is an occurrence of each of its context suffixes (the last 1..max_key
    tokens, the last 1..max_shape_key shape symbols; the context reaches back into the prompt).  A key becomes a
    recipe when its occurrences agree on a run (see ``_runs``).  A key whose one-shorter suffix already gives the
    same run is redundant and dropped (lookups take the longest match).  ``extra`` samples (e.g. a miss log) are
    added to ``samples``.

    Copy recipes (``copy``): where a shape key has no agreed run but, at ``copy_agree`` of its occurrences, the
    model went on with what follows the matching spot of the prompt (``copy_source``: values such as names, ids and
    numbers copied from the request), the recipe is ``(COPY, n)``: draft up to n tokens from the prompt."""
    classes = class_table(tokenizer.token_bytes, tokenizer.vocab_size)
    lit: dict[tuple[int, ...], list] = {}
    shp: dict[tuple[int, ...], list] = {}
    all_samples = [*samples, *extra]
    it = all_samples
    if progress:
        it = _tqdm(all_samples, desc="indexing", unit="sample")
    n_tokens = 0
    copies: dict[tuple[int, ...], list[int]] = {}  # shape key -> per occurrence, how many tokens a copy got right
    lcopies: dict[tuple[int, ...], list[int]] = {}  # the same for literal keys
    for s in it:
        seq = list(s.prompt) + list(s.output)
        start = len(s.prompt)
        n_tokens += len(s.output)
        sh = shape_of(seq[:start], classes) if shapes else []
        ppos = prompt_positions(s.prompt) if copy else {}
        for i in range(start, len(seq)):
            c = 0
            if copy:
                src = copy_source(s.prompt, ppos, seq[:i])
                if src is not None:
                    while i + c < len(seq) and src + c < start and seq[src + c] == seq[i + c] and c < max_run:
                        c += 1
            for n in range(1, min(max_key, i) + 1):
                lit.setdefault(tuple(seq[i - n:i]), []).append((seq, i))
                if copy:
                    lcopies.setdefault(tuple(seq[i - n:i]), []).append(c)
            if shapes:
                if i > start:
                    t = seq[i - 1]
                    sym = classes[t] if t < len(classes) else t
                    if not (sym < 0 and sh and sh[-1] == sym):
                        sh.append(sym)
                for n in range(1, min(max_shape_key, len(sh)) + 1):
                    shp.setdefault(tuple(sh[-n:]), []).append((seq, i))
                    if copy:
                        copies.setdefault(tuple(sh[-n:]), []).append(c)
    recipes: list[Recipe] = []
    for kind, table in (("literal", lit), ("shape", shp)):
        found: dict[tuple[int, ...], tuple[tuple[int, ...], int, int]] = {}
        for key in sorted(table, key=len):
            occ = table[key]
            if len(occ) < min_count:
                continue
            got = _runs(occ, min_count=min_count, agree=agree, max_run=max_run)
            if got is None and copy:
                cs = (copies if kind == "shape" else lcopies)[key]
                hits = [c for c in cs if c > 0]
                if len(hits) >= min_count and len(hits) >= copy_agree * len(cs):
                    got = ((COPY, max(hits)), len(hits))  # here the model copies from the prompt
            if got is None:
                if len(key) > 1 and found.get(key[1:], ((),))[0]:
                    found[key] = ((), 0, len(occ))  # a blocker: a shorter key has a run, this context disagrees
                continue
            run, support = got
            found[key] = (run, support, len(occ))
        for key, (run, support, seen) in found.items():
            shorter = found.get(key[1:]) if len(key) > 1 else None
            if shorter is not None and shorter[0] == run:
                continue  # the shorter key already says this (or a blocker under a blocker)
            if kind == "shape" and all(s >= 0 for s in key) and found is not None:
                lk = lit.get(key)
                if lk is not None:  # a shape key without classes is a literal key: literal index covers it
                    continue
            recipes.append(Recipe(kind, key, run, support, seen))
    m = {"samples": len(all_samples), "sample_tokens": n_tokens, "max_key": max_key, "max_shape_key": max_shape_key,
         "max_run": max_run, "min_count": min_count, "agree": agree, "copy": copy, "copy_agree": copy_agree}
    m.update(meta or {})
    pack = RecipePack(recipes, fingerprint=tokenizer.vocab_fingerprint, tokenizer_name=getattr(tokenizer, "name", "tokenizer"),
                      meta=m, tokenizer=tokenizer)
    dropped = pack.prune(max_recipes)
    pack.meta["pruned"] = dropped
    return pack


def _tqdm(it, **kw):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return it
    return tqdm(it, **kw)


def sample(runner, tokenizer, examples, *, k: int = 4, temperature: float = 1.0, max_tokens: int = 96,
           engine: str | None = None, seed: int = 0, prompt_fn=None, progress: bool = True, self_draft: int = 25,
           build_kw: dict | None = None) -> list[Sample]:
    """Verified labels: ``k`` outputs of the target per example, by constrained sampling through the core loop.

    With ``self_draft > 0`` the loop drafts from a pack built from the samples so far (rebuilt every
    ``self_draft``, 2 x, 4 x ... prompts, ``build_kw`` as for ``build``): the loop is lossless, so the samples have exactly the law
    of plain constrained sampling (``SpeculativeLoop(drafter=None)``); drafting only saves target passes.

    ``examples``: items with ``prompt`` (user text) and ``constraint`` (ConstraintSpec or None), e.g.
    ``workloads.examples(w, "train")``; ``prompt_fn`` maps the user text to the model's prompt text (default:
    ``workloads.chat_prompt``)."""
    import numpy as np

    from .constraint import compile_constraint
    from .distributions import SamplingParams
    from .loop import SpeculativeLoop

    if prompt_fn is None:
        from .workloads import chat_prompt as prompt_fn
    if tokenizer.encode is None:
        raise ValueError("the tokenizer has no encode function")
    params = SamplingParams(temperature=temperature)
    rng = np.random.default_rng(seed)
    out: list[Sample] = []
    from .drafters import ChainDrafter, ForcedDrafter, RecipeDrafter

    it = _tqdm(examples, desc="sampling", unit="prompt") if progress else examples
    pack = None
    next_build = self_draft
    for n_ex, ex in enumerate(it):
        if self_draft and n_ex == next_build:
            pack = build(out, tokenizer, **(build_kw or {}))
            next_build *= 2
        spec = getattr(ex, "constraint", None)
        c = None if spec is None else compile_constraint(spec, tokenizer, engine=engine)  # compiled once: cached
        prompt = tuple(tokenizer.encode(prompt_fn(ex.prompt)))
        for _ in range(k):
            drafter = None
            if pack is not None:
                drafter = ChainDrafter([ForcedDrafter(tokenizer.encode), RecipeDrafter(pack)])
            loop = SpeculativeLoop(runner, prompt, constraint=c, drafter=drafter, k=16 if drafter else 0,
                                   params=params, max_tokens=max_tokens, rng=rng)
            out.append(Sample(prompt, tuple(loop.generate()), getattr(ex, "workload", None)))
    return out


# ---------------------------------------------------------------------------------------------- merging
def merge(a: RecipePack, b: RecipePack, *, agree: float = DEFAULTS["agree"], max_recipes: int | None = None
          ) -> RecipePack:
    """Combine two packs for one tokenizer.  A key in both keeps the common prefix of the two runs (counts
    summed); runs that disagree at once keep the one holding an ``agree`` share of the counts, else the key goes."""
    if a.fingerprint != b.fingerprint:
        raise RecipePackError(f"cannot merge recipe packs for different tokenizers ({a.source or 'first'}: "
                              f"{a.fingerprint}, {b.source or 'second'}: {b.fingerprint})")
    out: dict = {}
    for key in sorted(set(a.recipes) | set(b.recipes), key=lambda k: (KINDS.index(k[0]), len(k[1]), k[1])):
        ra, rb = a.recipes.get(key), b.recipes.get(key)
        if ra is None or rb is None:
            r = ra or rb
            out[key] = Recipe(r.kind, r.key, r.run, r.count, r.seen)
            continue
        if ra.run[:1] == (COPY,) and rb.run[:1] == (COPY,):
            out[key] = Recipe(ra.kind, ra.key, (COPY, max(ra.run[1], rb.run[1])), ra.count + rb.count,
                              ra.seen + rb.seen)
            continue
        n = 0
        if ra.run[:1] != (COPY,) and rb.run[:1] != (COPY,):
            while n < min(len(ra.run), len(rb.run)) and ra.run[n] == rb.run[n]:
                n += 1
        if n:
            out[key] = Recipe(ra.kind, ra.key, ra.run[:n], ra.count + rb.count, ra.seen + rb.seen)
        else:  # disagree at once (a blocker weighs what it has seen)
            wa, wb = (ra.count if ra.run else ra.seen), (rb.count if rb.run else rb.seen)
            big, wbig = (ra, wa) if wa >= wb else (rb, wb)
            if big.run and wbig >= agree * (wa + wb):
                out[key] = Recipe(big.kind, big.key, big.run, big.count, ra.seen + rb.seen)
            else:
                out[key] = Recipe(ra.kind, ra.key, (), 0, ra.seen + rb.seen)
    meta = {"merged": [a.meta, b.meta]}
    pack = RecipePack(out.values(), fingerprint=a.fingerprint, tokenizer_name=a.tokenizer_name, meta=meta)
    pack._classes, pack._token_bytes = a._classes or b._classes, a._token_bytes or b._token_bytes
    if max_recipes is not None:
        pack.meta["pruned"] = pack.prune(max_recipes)
    return pack


# ---------------------------------------------------------------------------------------------- miss log
class MissLog:
    """Served sequences on which the pack proposed nothing for a while, kept locally (JSON lines) so that a later
    ``build(..., extra=log.samples())`` learns them.  Bounded: at most ``max_lines`` lines are kept."""

    def __init__(self, path: str | os.PathLike, *, context: int = DEFAULTS["max_key"], max_lines: int = 10000,
                 min_missed: int = 4):
        self.path = Path(path)
        self.context = context
        self.max_lines = max_lines
        self.min_missed = min_missed

    def observe(self, prompt: Sequence[int], output: Sequence[int], missed: int) -> bool:
        """Record one finished request if the pack missed at ``missed >= min_missed`` of its positions."""
        if missed < self.min_missed or not output:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"prompt": list(prompt[-self.context:]), "output": list(output), "missed": missed})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        return True

    def samples(self) -> list[Sample]:
        if not self.path.exists():
            return []
        out = []
        lines = self.path.read_text(encoding="utf-8").splitlines()[-self.max_lines:]
        for n, line in enumerate(lines):
            try:
                d = json.loads(line)
                out.append(Sample(tuple(int(t) for t in d["prompt"]), tuple(int(t) for t in d["output"])))
            except (ValueError, KeyError, TypeError):
                continue  # a torn line (the server died mid-write): skip it
        return out


# ---------------------------------------------------------------------------------------------- online suffix index
class SuffixIndex:
    """Recently verified outputs of one server, indexed by their n-grams (SuffixDecoding-style), bounded.

    ``observe(tokens, start)`` adds one finished sequence (``tokens[start:]`` is the output; the ``context``
    tokens before it are kept so keys can reach into the prompt's tail).  Lookup takes the longest key (up to
    ``max_key`` tokens, at least ``min_key``) that matches the context's suffix and has a continuation, and returns
    the majority path through its ``per_key`` latest occurrences, as long as ``min_support`` of them agree.  The oldest sequences are forgotten once more than ``max_tokens``
    are held; the key table is an LRU of ``max_keys`` entries."""

    def __init__(self, *, max_key: int = 8, min_key: int = 2, max_tokens: int = 200_000, max_keys: int = 500_000,
                 max_run: int = 16, per_key: int = 4, context: int = 8, min_support: int = 2):
        self.max_key, self.min_key, self.max_run, self.per_key, self.context = max_key, min_key, max_run, per_key, context
        self.min_support = min_support  # occurrences that must agree on each proposed token
        self.max_tokens, self.max_keys = max_tokens, max_keys
        self._seqs: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._held = 0
        self._next = 0
        self._keys: OrderedDict[tuple[int, ...], deque] = OrderedDict()
        self.observed = 0

    def __len__(self) -> int:
        return len(self._keys)

    def observe(self, tokens: Sequence[int], start: int = 0) -> None:
        start = max(0, min(start, len(tokens)))
        lo = max(0, start - self.context)
        seq = tuple(int(t) for t in tokens[lo:])
        start -= lo
        if len(seq) - start < 1:
            return
        sid = self._next
        self._next += 1
        self._seqs[sid] = seq
        self._held += len(seq)
        self.observed += 1
        for i in range(max(start, self.min_key), len(seq)):
            for n in range(self.min_key, min(self.max_key, i) + 1):
                key = seq[i - n:i]
                q = self._keys.get(key)
                if q is None:
                    q = self._keys[key] = deque(maxlen=self.per_key)
                else:
                    self._keys.move_to_end(key)
                q.append((sid, i))
        while self._held > self.max_tokens and len(self._seqs) > 1:
            _, old = self._seqs.popitem(last=False)
            self._held -= len(old)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def lookup(self, seq: Sequence[int], budget: int | None = None) -> tuple[int, ...] | None:
        budget = self.max_run if budget is None else min(budget, self.max_run)
        tail = tuple(seq[-self.max_key:])
        for n in range(min(self.max_key, len(tail)), self.min_key - 1, -1):
            q = self._keys.get(tail[len(tail) - n:])
            if not q:
                continue
            conts = []
            for sid, i in q:
                s = self._seqs.get(sid)
                if s is not None and i < len(s):
                    conts.append(s[i:i + budget])
            if not conts:
                continue
            run: list[int] = []
            while len(run) < budget:  # the majority path through the latest occurrences
                counts: dict[int, int] = {}
                for c in conts:
                    if len(run) < len(c):
                        counts[c[len(run)]] = counts.get(c[len(run)], 0) + 1
                if not counts:
                    break
                tok, c = max(counts.items(), key=lambda kv: kv[1])
                if c < self.min_support:
                    break
                run.append(tok)
                conts = [c for c in conts if len(run) <= len(c) and c[len(run) - 1] == tok]
            if run:
                return tuple(run)
        return None


_SERVER_INDEXES: dict = {}


def server_suffix_index(key: str = "default", **kw) -> SuffixIndex:
    """The process-wide suffix index for one model (``key``: e.g. the tokenizer fingerprint)."""
    idx = _SERVER_INDEXES.get(key)
    if idx is None:
        idx = _SERVER_INDEXES[key] = SuffixIndex(**kw)
    return idx


# ---------------------------------------------------------------------------------------------- measuring
def benchmark_lookup(pack, contexts: Sequence[Sequence[int]], repeat: int = 5) -> dict:
    """Median/p90 wall time of one ``pack.lookup`` call over ``contexts`` (each timed in a batch of calls)."""
    if not contexts:
        return {"calls": 0}
    per_call = []
    batch = 200
    for ctx in contexts:
        ctx = list(ctx)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter_ns()
            for _ in range(batch):
                pack.lookup(ctx)
            best = min(best, (time.perf_counter_ns() - t0) / batch)
        per_call.append(best / 1e3)
    per_call.sort()
    return {"calls": len(per_call), "median_us": statistics.median(per_call),
            "p90_us": per_call[int(0.9 * (len(per_call) - 1))], "max_us": per_call[-1]}


__all__ = ["FORMAT", "VERSION", "MissLog", "Recipe", "RecipePack", "RecipePackError", "Sample", "SuffixIndex",
           "benchmark_lookup", "build", "class_table", "load_pack", "merge", "resolve", "sample",
           "server_suffix_index", "shape_of", "token_class"]


# ---------------------------------------------------------------------------------------------- evaluating
def evaluate(runner, tokenizer, examples, *, pack=None, drafters: Sequence[str] = ("forced", "recipe"), k: int = 8,
             temperature: float = 0.0, max_tokens: int = 96, engine: str | None = None, seed: int = 0,
             prompt_fn=None, check_greedy: bool = False, suffix_index=None) -> dict:
    """Run ``examples`` through the core loop with the named drafter chain and report: coverage (share of emitted
    tokens that came from recipes), acceptance, tokens per target pass, and (``check_greedy``) whether every output
    equals plain constrained decoding's.  ``drafters`` may name "suffix" (uses ``suffix_index``, taught after each
    request)."""
    import numpy as np

    from .constraint import compile_constraint
    from .distributions import SamplingParams
    from .drafters import DraftContext, build_chain, observe
    from .loop import SpeculativeLoop, Stats

    if prompt_fn is None:
        from .workloads import chat_prompt as prompt_fn
    params = SamplingParams(temperature=temperature)
    rng = np.random.default_rng(seed)
    tot = Stats()
    same = 0
    wall = 0.0
    for ex in examples:
        spec = getattr(ex, "constraint", None)
        c = None if spec is None else compile_constraint(spec, tokenizer, engine=engine)  # compiled once: cached
        prompt = tokenizer.encode(prompt_fn(ex.prompt))
        opts = {"suffix_index": suffix_index} if suffix_index is not None else {}
        ctx = DraftContext(tokenizer=tokenizer, params=params, rng=rng, recipe=pack, options=opts)
        drafter = build_chain(list(drafters), ctx) if drafters else None
        loop = SpeculativeLoop(runner, prompt, constraint=c, drafter=drafter, k=k, params=params,
                               max_tokens=max_tokens, rng=rng)
        out = loop.generate()
        observe(drafter, [*prompt, *out], len(prompt))
        st = loop.stats
        wall += st.wall_s
        tot.emitted += st.emitted
        tot.target_passes += st.target_passes
        tot.drafted += st.drafted
        tot.accepted += st.accepted
        for src, n in st.accepted_by_source.items():
            tot.accepted_by_source[src] = tot.accepted_by_source.get(src, 0) + n
        for src, n in st.drafted_by_source.items():
            tot.drafted_by_source[src] = tot.drafted_by_source.get(src, 0) + n
        if check_greedy:
            ref = SpeculativeLoop(runner, prompt, constraint=c, drafter=None, params=params, max_tokens=max_tokens,
                                  rng=rng).generate()
            same += ref == out
    rec = tot.accepted_by_source.get("recipe", 0) + tot.accepted_by_source.get("suffix", 0)
    res = {
        "requests": len(examples), "emitted": tot.emitted, "target_passes": tot.target_passes,
        "tokens_per_pass": tot.tokens_per_pass, "acceptance": tot.acceptance,
        "coverage": rec / tot.emitted if tot.emitted else 0.0,
        "forced_share": tot.accepted_by_source.get("forced", 0) / tot.emitted if tot.emitted else 0.0,
        "drafted_by_source": dict(tot.drafted_by_source), "accepted_by_source": dict(tot.accepted_by_source),
        "wall_s": wall,
    }
    if check_greedy:
        res["greedy_equal"] = same
    return res
