"""Composite grammars, built above the contract: the matcher of a request.

:class:`~spec_grammar.protocol.GrammarBackend` compiles one grammar and makes its matchers; it
knows no composite. A request may need more than one grammar's matcher: tagged tool calls
(free text, then ``<tool_call>`` + one call's JSON + ``</tool_call>``, as many times as the
request allows: :class:`~spec_grammar.tool_calls.TaggedToolCalls` over the backend's matchers
of one call) and reasoning first (free text up to a marker, then the grammar:
:class:`~spec_grammar.reasoning.ReasoningGrammar`). :func:`matcher` builds them, for any
backend, ``auto`` (:mod:`spec_grammar.routing`) included; the worker and the tests call it,
and so does any engine hook that serves those grammars.
"""

from __future__ import annotations

from collections.abc import Sequence

from .compile import CompiledGrammar
from .protocol import GrammarBackend, SpecGrammar
from .reasoning import ReasoningGrammar
from .specs import ToolCalls
from .tool_calls import TaggedToolCalls

__all__ = ["matcher"]


def matcher(
    backend: GrammarBackend,
    compiled: CompiledGrammar,
    *,
    reasoning_end: str | Sequence[int] | None = None,
    max_reasoning_tokens: int | None = None,
) -> SpecGrammar:
    """A fresh matcher of a request at its start: ``backend.matcher(compiled)``, as a
    :class:`TaggedToolCalls` over one-call matchers when ``compiled`` is a tagged
    :class:`~spec_grammar.specs.ToolCalls` grammar, behind a :class:`ReasoningGrammar` when
    ``reasoning_end`` is given (``max_reasoning_tokens``: its budget). Raises what
    :meth:`GrammarBackend.matcher` raises (a grammar another backend compiled) and what
    :class:`ReasoningGrammar` raises for a bad marker or budget."""
    spec = compiled.spec
    if isinstance(spec, ToolCalls) and spec.call_format == "tagged":
        backend.matcher(compiled)  # the checks (whose grammar it is) before anything is built
        m: SpecGrammar = TaggedToolCalls(
            lambda: backend.matcher(compiled),
            spec,
            backend.tokenizer_info,
            max_rollback_tokens=backend.max_rollback_tokens,
        )
    else:
        m = backend.matcher(compiled)
    if reasoning_end is not None:
        m = ReasoningGrammar(m, reasoning_end, max_reasoning_tokens=max_reasoning_tokens)
    return m
