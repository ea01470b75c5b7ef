"""specgrammar-plugins: grammar-constrained, exactly verified speculative decoding for mlx-lm, vLLM and llama.cpp.

The core (this package) imports no host stack.  The host adapters are packages of their own, shipped by the same
distribution (``specgrammar_mlx_lm``, ``specgrammar_llama_cpp``, ``specgrammar_vllm``: the repository's
``adapters/`` folder); they import their host lazily and the core only through ``specgrammar_plugins.api``.
See docs/ARCHITECTURE.md.
"""

from .compiler import compile_constraint
from .constraint import CompiledConstraint, ConstraintSpec, Forced, Matcher
from .distributions import GREEDY, SamplingParams, log_law
from .errors import ConstraintError, EmptyMaskError, SpecGrammarError, TokenizerMismatchError
from .hookspecs import hookimpl
from .tokenizer import TokenizerInfo
from .verify import Verdict, verify_block

__version__ = "0.1.0"

__all__ = [
    "CompiledConstraint", "ConstraintError", "ConstraintSpec", "EmptyMaskError", "Forced", "GREEDY", "Matcher",
    "SamplingParams", "SpecGrammarError", "TokenizerInfo", "TokenizerMismatchError", "Verdict", "compile_constraint",
    "hookimpl", "log_law", "verify_block",
]
