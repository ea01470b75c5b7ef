"""The built-in drafters: ``forced``, ``recipe``, ``layout``, ``prompt``, ``suffix`` and ``model`` (factories of
``drafters.DraftContext``)."""

from __future__ import annotations

from ..drafters import (ForcedDrafter, LayoutDrafter, ModelDrafter, PromptLookupDrafter, RecipeDrafter, SuffixDrafter,
                        server_splits)
from ..hookspecs import hookimpl
from ..recipes import MissLog, auto_pack, load_pack, server_suffix_index


def _forced(ctx):
    """A ``ForcedDrafter`` with the process-wide memory of how the model split forced strings for this tokenizer
    (``server_splits``), where the tokenizer has its token bytes."""
    tok = ctx.tokenizer
    splits = None
    if tok is not None and getattr(tok, "token_bytes", None):
        splits = server_splits(getattr(tok, "fingerprint", None) or "default", tok.token_bytes)
    return ForcedDrafter(tok.encode if tok is not None else None,
                         byte_complete=tok is not None and tok.byte_complete, splits=splits)


def _model(ctx):
    if ctx.draft_runner is None:
        return None
    return ModelDrafter(ctx.draft_runner, ctx.params, ctx.rng, blind=ctx.blind, target_vocab_size=ctx.target_vocab_size)


def _pack(ctx):
    """The request's pack: ``ctx.recipe``, else ``ctx.options["recipe"]``, else the shipped pack marked for this
    tokenizer (``recipes.auto_pack``; ``ctx.options["auto_recipe"] = False`` turns that off)."""
    pack = ctx.recipe if ctx.recipe is not None else ctx.options.get("recipe")
    if pack is None and ctx.options.get("auto_recipe", True) and hasattr(ctx.tokenizer, "vocab_fingerprint"):
        pack = auto_pack(ctx.tokenizer)
    return pack


def _recipe(ctx):
    """A ``RecipeDrafter`` over ``ctx.recipe`` (a ``RecipePack``, a pack file, or a shipped pack's name; also
    ``ctx.options["recipe"]``); no pack, no drafter.  The pack must be for ``ctx.tokenizer``
    (fingerprint-checked).  ``ctx.options``: ``recipe_misslog`` (a ``MissLog`` or a path),
    ``recipe_unconstrained`` (draft without a grammar too)."""
    pack = _pack(ctx)
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


def _layout(ctx):
    """A ``LayoutDrafter``: the request's own output, the server's layout index for this tokenizer
    (``ctx.options["layout_index"]``, else the process-wide one) and the layout table of the request's pack (or
    of the pack shipped for this tokenizer)."""
    tok = ctx.tokenizer
    if tok is None or not getattr(tok, "token_bytes", None):
        return None
    from ..recipes.layout import LayoutIndex, server_layout_index

    server = ctx.options.get("layout_index")
    if server is None:
        server = server_layout_index(getattr(tok, "fingerprint", None) or "default", tok.token_bytes)
    table = None
    pack = _pack(ctx)
    if pack is not None:
        try:
            table = load_pack(pack, tok if hasattr(tok, "vocab_fingerprint") else None).layout
        except ValueError:  # a pack for another tokenizer: the recipe drafter reports it
            table = None
    pack_index = LayoutIndex(tok.token_bytes).load_table(table) if table else None
    return LayoutDrafter(tok.token_bytes, server, pack_index)


def _prompt(ctx):
    """A ``PromptLookupDrafter`` over the request's prompt (the tokenizer's bytes and encoder)."""
    tok = ctx.tokenizer
    if tok is None or not getattr(tok, "token_bytes", None):
        return None
    return PromptLookupDrafter(tok.token_bytes, tok.encode)


@hookimpl
def register_drafters(register):
    register("forced", _forced)
    register("recipe", _recipe)
    register("layout", _layout)
    register("prompt", _prompt)
    register("suffix", _suffix)
    register("model", _model)


