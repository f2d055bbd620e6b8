"""spec-grammar: grammar-constrained generation for tree speculative decoding.

One protocol (:class:`SpecGrammar`, :class:`GrammarBackend`), one token-bitmask layout and
apply path, pluggable backends (xgrammar, llguidance, outlines-core, third-party).
"""

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from .bitmask import allocate_token_bitmask, apply_token_bitmask_inplace, unpack_bitmask
    from .protocol import (
        Capabilities,
        CompiledGrammar,
        ConformanceCase,
        GrammarBackend,
        SpecGrammar,
        TokenizerInfo,
    )
    from .registry import get_backend, list_backends
    from .specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex, ToolCalls
    from .tree import DraftTree

_LAZY = {
    **dict.fromkeys(
        ("allocate_token_bitmask", "apply_token_bitmask_inplace", "unpack_bitmask"), "bitmask"
    ),
    **dict.fromkeys(
        (
            "Capabilities",
            "CompiledGrammar",
            "ConformanceCase",
            "GrammarBackend",
            "SpecGrammar",
            "TokenizerInfo",
        ),
        "protocol",
    ),
    **dict.fromkeys(("get_backend", "list_backends"), "registry"),
    **dict.fromkeys(("Ebnf", "GrammarSpec", "JsonSchema", "Lark", "Regex", "ToolCalls"), "specs"),
    "DraftTree": "tree",
}
"""Public name -> its submodule, imported on first use (PEP 562): torch and pydantic take 2-3 s
to import, which ``spec-grammar --help`` and argument errors should not pay."""


from .lazy_exports import lazy_exports  # noqa: E402 (after the name table it serves)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


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
    "ConformanceCase",
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
