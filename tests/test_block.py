"""``DraftBlock``'s lazy masks (hosts that verify with masks of their own: vLLM) and the forced drafter's hint.

A lazy block fills a position's mask only when something reads it; a draft pushed where nobody did is checked by
the matcher's ``accept``.  The forced drafter asks the matcher's jump-forward string first on such a position and,
where it is empty, reads no mask: that is sound only if "one allowed token" implies "a forced byte" (a vocabulary
with every byte as a token), which ``test_one_allowed_token_means_a_forced_byte`` holds against the masks of every
engine on real constraints.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import available_engines

from specgrammar_plugins import workloads as W
from specgrammar_plugins.api import DraftBlock, SpecOptions, compile_constraint, make_drafter, mask_words
from specgrammar_plugins.errors import ConstraintError
from specgrammar_plugins.masks import allowed_ids, single_allowed
from specgrammar_plugins.models import tiny_tokenizer_info


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer_info()


def _specs():
    out = []
    for w in W.STRUCTURED:
        for e in W.examples(w, "eval", 2):
            if e.constraint is not None:
                out.append(e.constraint)
    return out


def _walks(compiled, tok, seed: int, walks: int = 3, steps: int = 60):
    """Random walks through a grammar: at each position (matcher, its packed row) before a random allowed token."""
    rng = np.random.default_rng(seed)
    row = np.zeros(mask_words(tok.vocab_size), dtype=np.int32)
    for _ in range(walks):
        m = compiled.matcher()
        for _ in range(steps):
            if m.is_terminated():
                break
            m.fill_mask(row)
            yield m, row
            ids = allowed_ids(row, tok.vocab_size)
            if not len(ids):
                break
            m.accept(int(rng.choice(ids)))


def test_the_bundled_tokenizer_is_byte_complete(tok, toy_tok):
    assert tok.byte_complete
    assert not toy_tok.byte_complete  # (128 tokens: not every byte)


@pytest.mark.parametrize("engine", available_engines())
def test_one_allowed_token_means_a_forced_byte(tok, engine):
    """Where a mask allows exactly one token (not a stop token), the matcher's jump-forward string is not empty,
    on every engine that says ``jump_forward_complete``: what lets a lazy block's forced drafter skip the mask
    where it is empty.  Every structured workload's constraint, random walks.  The engines that cannot tell
    (outlines-core and the reference always say b"") must not claim it."""
    forced = checked = 0
    for n, spec in enumerate(_specs()):
        try:
            compiled = compile_constraint(spec, tok, engine=engine)
        except ConstraintError:
            continue
        if not getattr(compiled.matcher(), "jump_forward_complete", False):
            assert engine in ("dfa", "outlines_core")
            pytest.skip(f"{engine}: jump_forward cannot tell (always b''), so lazy blocks read its masks")
        for m, row in _walks(compiled, tok, n):
            checked += 1
            t = single_allowed(row)
            if t is not None and t not in tok.stop_token_ids:
                forced += 1
                assert m.jump_forward(), (engine, spec.kind, tok.token_bytes[t])
    assert checked > 200 and forced > 20, (checked, forced)


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_a_lazy_block_drafts_what_an_eager_one_does(tok, engine):
    """The forced drafter on a lazy block (hint first, masks read only where a byte is forced) pushes the same
    drafts as on a block that fills every position, and fills fewer masks; a model draft pushed on the lazy block
    is taken or refused as the mask says, by the matcher alone."""
    drafter = make_drafter(SpecOptions(k=8, drafters=("forced",)), tok)
    rng = np.random.default_rng(3)
    lazy_fills = eager_fills = blocks = 0
    for n, spec in enumerate(_specs()):
        compiled = compile_constraint(spec, tok, engine=engine)
        for m, row in _walks(compiled, tok, 100 + n, walks=2, steps=30):
            ids = allowed_ids(row, tok.vocab_size)
            eager = DraftBlock([1], m.fork(), tok.vocab_size, 8, tok.stop_token_ids)
            lazy = DraftBlock([1], m.fork(), tok.vocab_size, 8, tok.stop_token_ids, lazy=True)
            drafter.extend(eager, 8)
            drafter.extend(lazy, 8)
            assert lazy.tokens == eager.tokens and lazy.sources == eager.sources
            if not eager.done:  # a model draft: allowed or not, the same verdict without a mask
                t = int(rng.choice(ids)) if rng.random() < 0.5 else int(rng.integers(0, tok.vocab_size))
                fills = lazy.mask_fills
                assert lazy.push(t) == eager.push(t)
                assert lazy.mask_fills == fills  # the lazy block checked it without a fill
                assert lazy.tokens == eager.tokens
            lazy_fills += lazy.mask_fills
            eager_fills += eager.mask_fills
            blocks += 1
    assert blocks > 100 and lazy_fills < eager_fills / 2, (blocks, lazy_fills, eager_fills)


def test_a_lazy_block_refuses_finish_without_its_masks(tok):
    compiled = compile_constraint(W.constraint("json_extraction"), tok, engine="xgrammar")
    block = DraftBlock([1], compiled.matcher(), tok.vocab_size, 4, tok.stop_token_ids, lazy=True)
    assert block.push(tok.encode("{")[0])
    assert block.masks == [None] and block.mask_fills == 0
    with pytest.raises(RuntimeError, match="lazy DraftBlock"):
        block.finish()
    with pytest.raises(ValueError, match="lazy"):
        DraftBlock([1], compiled.matcher(), tok.vocab_size, 4, lazy=True, tilt_fn=lambda *a: None)
