"""What every worker checks when vLLM builds its proposer, so that a rank that cannot serve as configured stops the
engine at start-up instead of serving every request without it.

vLLM builds a proposer in every worker (each tensor-parallel rank, pipeline stage and data-parallel engine, on
every node), and each loads the engine-wide recipe pack (``--additional-config '{"specgrammar": {"recipe": ...}}'``)
itself, from its own file system.  Before this check a pack one worker could not load (a wrong name, a path that
exists on one node only, a pack built for another tokenizer) was found at each request's first draft step: every
request logged "drafters unavailable" and was served without the pack, on that worker only.  Now the worker loads
the pack once, against the model's tokenizer, while vLLM builds the proposer, and raises ``RecipePackStartupError``
naming the option, the rank and the reason; vLLM's start-up fails with it.

A pack a *request* names (``extra_args``/``vllm_xargs``, resolved in ``recipes_dir``) stays a per-request matter:
that request is served without it (logged), the engine goes on.
"""

from __future__ import annotations

from specgrammar_plugins.api import RecipePackError, load_pack


class RecipePackStartupError(RecipePackError):
    """The engine-wide recipe pack cannot be loaded on this worker: the engine must not start."""


def _rank() -> str:
    try:
        from vllm.distributed import parallel_state as ps

        return (f"tensor-parallel rank {ps.get_tp_group().rank_in_group}, "
                f"pipeline stage {ps.get_pp_group().rank_in_group}")
    except Exception:  # (no distributed state: a bare config, a test)
        return "this worker"


def check_recipe_pack(states) -> None:
    """Load the engine-wide recipe pack of ``states`` (a ``GrammarStates``) the way a request's drafter chain does
    (``api.load_pack``: the pack file, its hash, its format, its tokenizer fingerprint); raise
    ``RecipePackStartupError`` when it cannot be.  Nothing to do without the option or the ``recipe`` drafter."""
    recipe = states.options.get("recipe")
    if not recipe or "recipe" not in states.drafter_names:
        return
    try:
        states._tokenizer_info((), None)  # the model's tokenizer, as the drafters see it (packs are fingerprinted)
        load_pack(recipe, states._tokinfo, states.vocab_size, states.k, states.options)
    except Exception as e:
        raise RecipePackStartupError(
            f"specgrammar: the recipe pack of --additional-config (specgrammar.recipe = {recipe!r}) cannot be loaded "
            f"on {_rank()}: {type(e).__name__}: {e}.  Every vLLM worker loads it from its own file system: give a "
            f"shipped pack name or a path that exists on every node, or leave the option out") from e
