"""specgrammar-plugins: grammar-constrained, exactly verified speculative decoding for mlx-lm, vLLM and llama.cpp.

The core (this package's top-level modules) imports no host stack; adapters under ``specgrammar_plugins.adapters``
import their host lazily.
"""

from .constraint import CompiledConstraint, ConstraintSpec, Forced, Matcher, compile_constraint
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
