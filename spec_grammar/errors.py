"""Typed errors raised by spec-grammar.

Every error names the problem in its message. All derive from :class:`SpecGrammarError`, so a
caller serving many requests can catch one type per request and keep the batch going.
"""

from __future__ import annotations


class SpecGrammarError(Exception):
    """Base class of every error this library raises on purpose."""


class GrammarSpecError(SpecGrammarError, ValueError):
    """A grammar spec was built from bad input (a schema string that is not JSON, a schema that
    is neither an object nor a boolean, a tool list without names, a field of the wrong type)."""


class GrammarCompileError(SpecGrammarError, ValueError):
    """A grammar spec could not be compiled (invalid JSON, invalid schema, bad regex/EBNF/Lark,
    compile limits exceeded). ``reason`` holds the backend's own message."""

    def __init__(self, message: str, *, backend: str | None = None, reason: str | None = None):
        super().__init__(message if backend is None else f"[{backend}] {message}")
        self.backend = backend
        self.reason = reason or message


class GrammarLimitError(GrammarCompileError):
    """Compiling the spec would pass one of the backend's resource limits (an estimated index
    size, the library's own parser limits): refused before it takes the process's memory. The
    message names the limit and how to raise it."""


class UnsupportedGrammarError(GrammarCompileError):
    """The spec is valid but this backend cannot represent it (grammar kind or keyword missing)."""


class GrammarStateError(SpecGrammarError, RuntimeError):
    """A matcher was used in a way its state does not allow (fill after termination, rollback
    deeper than the history, a matcher left in an error state by its library)."""


class InvalidTokenError(SpecGrammarError, ValueError):
    """A token id outside ``[0, logits width)`` reached a mutating matcher call."""


class BitmaskError(SpecGrammarError, ValueError):
    """A token bitmask or logits tensor has the wrong shape, dtype, device or layout."""


class BackendNotFoundError(SpecGrammarError, LookupError):
    """No registered backend has that name and it is not an importable ``module:Class``."""


class DraftTreeError(SpecGrammarError, ValueError):
    """Draft-tree link arrays are inconsistent (bad parents, cycles, mismatched lengths)."""
