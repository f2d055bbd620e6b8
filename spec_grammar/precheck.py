"""The refusals that the backends' declarations decide, before torch or a grammar library is
imported (the CLI's fail-fast path, ``docs/valid-or-told.md``).

Importing an adapter brings torch, transformers and its library (8-18 s on a loaded 2-core
host), and so does loading a tokenizer for a compile; but whether a backend claims a grammar's
kind, whether a schema is valid, and what a strict spec would leave unenforced depend on the
spec and the declarations only (:func:`spec_grammar.backend_info.declarations`,
:mod:`spec_grammar.ranking`). :func:`early_refusal` gives the error the compile would raise
for those, with the same message; anything else (a library's own refusal, the nesting and
size limits) is left to the compile.
"""

from __future__ import annotations

from typing import Any

from .errors import GrammarCompileError, SpecGrammarError, UnsupportedGrammarError
from .limits import DEFAULT_MAX_GRAMMAR_BYTES
from .ranking import AUTO, backends_taking, rank, same_everywhere
from .specs import GrammarSpec, JsonSchema, ToolCalls

__all__ = ["early_refusal"]


def early_refusal(spec: GrammarSpec | None, backend_name: str) -> SpecGrammarError | None:
    """The error compiling ``spec`` on ``backend_name`` (a registered name or ``auto``) would
    raise by the declarations alone: :class:`UnsupportedGrammarError` for a kind the backend
    does not claim or a strict spec it would leave a keyword of unenforced (the message
    naming the backends that would take it, as :func:`spec_grammar.worker.api.precompile`
    says), :class:`GrammarCompileError` for an invalid schema or one that accepts no finite
    document. None when the declarations say nothing against it, or cannot be read without
    importing (then the compile decides). Imports neither torch nor a grammar library."""
    if spec is None:
        return None
    try:  # the compile refuses an oversized spec first, without the slower checks below
        if len(spec.cache_key()) > DEFAULT_MAX_GRAMMAR_BYTES:
            return None
    except (RecursionError, ValueError):  # too deep to serialize: the compile's limit says it
        return None
    from .backend_info import declarations

    declared = declarations()
    if declared is None:
        return None
    try:
        if backend_name == AUTO:
            _auto(spec, declared)
        elif backend_name in declared:
            _fixed(spec, declared[backend_name])
    except UnsupportedGrammarError as e:
        told = UnsupportedGrammarError(f"{e}; {backends_taking(spec, declared)}")
        told.backend, told.reason = e.backend, e.reason
        return told
    except SpecGrammarError as e:
        return e
    except RecursionError:  # a keyword walk met the nesting: the compile's limit says it
        return None
    return None


def _auto(spec: GrammarSpec, declared: dict[str, Any]) -> None:
    routes = rank(spec, declared)
    if not routes:
        raise UnsupportedGrammarError(
            f"{spec.kind} grammars are not supported by any registered backend "
            f"({', '.join(declared) or 'none'})",
            backend=AUTO,
        )
    same_everywhere(spec, routes[0])


def _fixed(spec: GrammarSpec, backend: Any) -> None:
    """What :func:`spec_grammar.compile.compile_spec` refuses first, from ``backend``'s
    declarations; raises the refusal (precompile's message for an unclaimed kind)."""
    caps = backend.capabilities
    if not getattr(caps, spec.kind, False) or (
        isinstance(spec, ToolCalls) and not caps.json_schema
    ):
        raise UnsupportedGrammarError(f"[{backend.name}] {spec.kind} grammars are not supported")
    target = spec.to_json_schema() if isinstance(spec, ToolCalls) else spec
    if not isinstance(target, JsonSchema):
        return
    from .compile import checked_schema

    try:
        checked_schema(target, backend.json_schema_support)
    except GrammarCompileError as e:  # UnsupportedGrammarError too: named as the compile names it
        raise type(e)(str(e), backend=backend.name, reason=e.reason) from None
