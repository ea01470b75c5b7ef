"""Building recipe packs from verified samples (``build``), combining two packs (``merge``), and the miss log
(``MissLog``) that records served sequences where a pack had nothing to say, for a later build to fold in."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .pack import (COPIES, COPY, COPY_NUMBER, DEFAULTS, KINDS, NUM, Recipe, RecipePack, RecipePackError, class_table,
                   copy_source, number_span, prompt_positions, shape_of)

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
    numbers copied from the request), the recipe is ``(COPY, n)``: draft up to n tokens from the prompt.

    Number copies (with ``copy``): where a number starts in the answer, whether it copies the prompt's number
    (``number_span``: its longest run of digit tokens).  A key at whose occurrences that copy holds at least
    ``min_count`` times, at ``copy_agree`` of them, and at least as often as the key's agreed run (if it has one), is
    ``(COPY_NUMBER, n)``: the value comes from the request, not the training answers' digits."""
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
    ncopies: dict[tuple[str, tuple[int, ...]], list[int]] = {}  # (kind, key) -> the same for the prompt's number
    for s in it:
        seq = list(s.prompt) + list(s.output)
        start = len(s.prompt)
        n_tokens += len(s.output)
        sh = shape_of(seq[:start], classes) if shapes else []
        ppos = prompt_positions(s.prompt) if copy else {}
        number = number_span(s.prompt, classes) if copy else None
        for i in range(start, len(seq)):
            c = cn = 0
            if copy:
                c = _copied(seq, i, copy_source(s.prompt, ppos, seq[:i]), start, max_run)
                if number is not None and classes[seq[i]] == NUM and (i == start or classes[seq[i - 1]] != NUM):
                    cn = _copied(seq, i, number[0], start, max_run)
            for n in range(1, min(max_key, i) + 1):
                lit.setdefault(tuple(seq[i - n:i]), []).append((seq, i))
                if copy:
                    lcopies.setdefault(tuple(seq[i - n:i]), []).append(c)
                    ncopies.setdefault(("literal", tuple(seq[i - n:i])), []).append(cn)
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
                        ncopies.setdefault(("shape", tuple(sh[-n:])), []).append(cn)
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
            if copy:
                ns = ncopies[(kind, key)]
                hits = [c for c in ns if c > 0]
                if len(hits) >= min_count and len(hits) >= copy_agree * len(ns) and len(hits) >= (got[1] if got else 0):
                    got = ((COPY_NUMBER, max(hits)), len(hits))  # the value is the prompt's number
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


def _copied(seq: Sequence[int], i: int, src: int | None, start: int, max_run: int) -> int:
    """How many tokens of ``seq`` from ``i`` on equal the prompt's (``seq[:start]``) from ``src`` on (0 for None)."""
    c = 0
    if src is not None:
        while i + c < len(seq) and src + c < start and seq[src + c] == seq[i + c] and c < max_run:
            c += 1
    return c


def _tqdm(it, **kw):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return it
    return tqdm(it, **kw)


# ---------------------------------------------------------------------------------------------- merging
def _is_copy(run: Sequence[int]) -> bool:
    return bool(run) and run[0] in COPIES


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
        if _is_copy(ra.run) and ra.run[:1] == rb.run[:1]:
            out[key] = Recipe(ra.kind, ra.key, (ra.run[0], max(ra.run[1], rb.run[1])), ra.count + rb.count,
                              ra.seen + rb.seen)
            continue
        n = 0
        if not _is_copy(ra.run) and not _is_copy(rb.run):
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
