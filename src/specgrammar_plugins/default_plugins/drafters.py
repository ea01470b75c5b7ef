"""The built-in drafters: ``forced``, ``recipe``, ``suffix`` and ``model`` (factories of ``drafters.DraftContext``)."""

from __future__ import annotations

from ..drafters import ForcedDrafter, ModelDrafter, RecipeDrafter, SuffixDrafter
from ..hookspecs import hookimpl
from ..recipes import MissLog, load_pack, server_suffix_index


def _forced(ctx):
    tok = ctx.tokenizer
    return ForcedDrafter(tok.encode if tok is not None else None,
                         byte_complete=tok is not None and tok.byte_complete)


def _model(ctx):
    if ctx.draft_runner is None:
        return None
    return ModelDrafter(ctx.draft_runner, ctx.params, ctx.rng, blind=ctx.blind, target_vocab_size=ctx.target_vocab_size)


def _recipe(ctx):
    """A ``RecipeDrafter`` over ``ctx.recipe`` (a ``RecipePack``, a pack file, or a shipped pack's name; also
    ``ctx.options["recipe"]``); no pack, no drafter.  The pack must be for ``ctx.tokenizer``
    (fingerprint-checked).  ``ctx.options``: ``recipe_misslog`` (a ``MissLog`` or a path),
    ``recipe_unconstrained`` (draft without a grammar too)."""
    pack = ctx.recipe if ctx.recipe is not None else ctx.options.get("recipe")
    if pack is None:
        return None
    tok = ctx.tokenizer if hasattr(ctx.tokenizer, "vocab_fingerprint") else None
    pack = load_pack(pack, tok)
    if tok is not None and tok.vocab_fingerprint != pack.fingerprint:
        pack.bind(tok)  # raises RecipePackError naming the pack and both tokenizers
    log = ctx.options.get("recipe_misslog")
    if log is not None and not isinstance(log, MissLog):
        log = MissLog(log)
    return RecipeDrafter(pack, unconstrained=bool(ctx.options.get("recipe_unconstrained", False)), misslog=log)


def _suffix(ctx):
    """A ``SuffixDrafter`` over the server's online suffix index (``ctx.options["suffix_index"]``, else the
    process-wide one for this tokenizer)."""
    index = ctx.options.get("suffix_index")
    if index is None:
        index = server_suffix_index(getattr(ctx.tokenizer, "fingerprint", None) or "default")
    return SuffixDrafter(index)


@hookimpl
def register_drafters(register):
    register("forced", _forced)
    register("recipe", _recipe)
    register("suffix", _suffix)
    register("model", _model)


