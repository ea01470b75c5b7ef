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

A run may also be a copy from the request: ``(COPY, n)``, the prompt's tokens after the spot that matches the end of
the context (names, ids, numbers copied into the answer), or ``(COPY_NUMBER, n)``, the prompt's number (its
longest digit run), where the answer opens a value with it and no context anchors a copy.

Lookup tries the literal index, then the shape index, each as one backward walk over a reversed-key trie
(a few hundred nanoseconds; ``specgrammar recipes stats`` measures it).

File format (``FORMAT``/``VERSION``): one JSON object, human-inspectable, stable ordering (recipes sorted by
index, then key), content-hashed (``sha256`` of the canonical JSON of everything else, checked at load), and
bound to one tokenizer by ``TokenizerInfo.vocab_fingerprint`` (a pack for other token bytes is refused at load).  Each
recipe carries its decoded text for reading; the ids are what count.

Building (``build.py``): ``specgrammar recipes build`` samples verified outputs through the loop, ``build(samples, tokenizer)`` turns samples into a
pack (``--agree``: the share of occurrences that must agree on each token of a run; ``--min-count``: how many
occurrences a key needs), ``merge`` combines two packs, ``MissLog``/``observe`` record served sequences where the
pack had nothing to say, and a later ``build(..., extra=misslog.samples())`` folds them in.  ``prune`` bounds the
size, dropping the least used recipes (count x run length).

Online: ``SuffixIndex`` is a per-server, bounded (LRU by tokens) index over recently verified outputs
(SuffixDecoding-style) that learns while serving through ``observe(tokens)``; ``SuffixDrafter`` proposes from it.

Modules: ``pack`` (the format, lookup and finding packs), ``build`` (build, merge, miss log), ``suffix`` (the
online index).  ``shipped`` holds the packs that ship with the project (package data: the repository's top-level
``recipes/`` folder).
"""

from .build import MissLog, Sample, build, merge
from .layout import LayoutIndex, LayoutScanner, server_layout_index
from .pack import (ALPHA, COPY, COPY_NUMBER, FORMAT, NUM, PACK_NAME, VERSION, Recipe, RecipePack, RecipePackError, auto_pack,
                   class_table, copy_source, load_pack, number_span, prompt_positions, resolve, resolve_name, shape_of,
                   shipped_pack, shipped_packs, token_class)
from .suffix import SuffixIndex, server_suffix_index

__all__ = ["LayoutIndex", "LayoutScanner", "auto_pack", "server_layout_index", "ALPHA", "COPY", "COPY_NUMBER", "FORMAT", "NUM", "PACK_NAME", "VERSION", "MissLog", "Recipe", "RecipePack",
           "RecipePackError", "Sample", "SuffixIndex", "build", "class_table", "copy_source", "load_pack", "merge", "number_span", "prompt_positions",
           "resolve", "resolve_name", "server_suffix_index", "shape_of", "shipped_pack", "shipped_packs", "token_class"]
