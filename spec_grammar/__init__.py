"""spec-grammar: grammar-constrained generation for tree speculative decoding.

One protocol (:class:`SpecGrammar`, :class:`GrammarBackend`), one token-bitmask layout and
apply path, pluggable backends (xgrammar, llguidance, outlines-core, third-party).
"""

from .bitmask import allocate_token_bitmask, apply_token_bitmask_inplace, unpack_bitmask
from .errors import (
    BackendNotFoundError,
    BitmaskError,
    DraftTreeError,
    GrammarCompileError,
    GrammarLimitError,
    GrammarSpecError,
    GrammarStateError,
    InvalidTokenError,
    SpecGrammarError,
    UnsupportedGrammarError,
)
from .protocol import Capabilities, CompiledGrammar, GrammarBackend, SpecGrammar, TokenizerInfo
from .registry import get_backend, list_backends
from .specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex, ToolCalls
from .tree import DraftTree

__version__ = "0.1.0"

__all__ = [
    "allocate_token_bitmask",
    "apply_token_bitmask_inplace",
    "unpack_bitmask",
    "BackendNotFoundError",
    "BitmaskError",
    "DraftTreeError",
    "GrammarCompileError",
    "GrammarLimitError",
    "GrammarSpecError",
    "GrammarStateError",
    "InvalidTokenError",
    "SpecGrammarError",
    "UnsupportedGrammarError",
    "Capabilities",
    "CompiledGrammar",
    "GrammarBackend",
    "SpecGrammar",
    "TokenizerInfo",
    "get_backend",
    "list_backends",
    "Ebnf",
    "GrammarSpec",
    "JsonSchema",
    "Lark",
    "Regex",
    "ToolCalls",
    "DraftTree",
]
