"""What a backend supports: :class:`Capabilities`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Capabilities"]


class Capabilities(BaseModel):
    """The grammar kinds a backend compiles, one flag per :attr:`GrammarSpec.kind
    <spec_grammar.specs.GrammarSpec.kind>`.

    :meth:`GrammarBackend.compile <spec_grammar.protocol.GrammarBackend.compile>` refuses a
    spec whose kind is False with :class:`~spec_grammar.errors.UnsupportedGrammarError` before
    the adapter sees it; the conformance suite and the benchmarks pick specs by these flags.
    ``tool_calls`` compile through ``json_schema``: claim it only with ``json_schema``.

    Unknown fields are ignored, so adapters written for earlier versions, which also declared
    fast-path flags (``native_rollback``, ``native_fork``, ``native_validate``,
    ``native_tree_fill``, ``native_forced_tokens``, ``parallel_fill``, ``releases_gil``) that
    no code read, still load.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    json_schema: bool = True
    regex: bool = True
    ebnf: bool = False
    lark: bool = False
    tool_calls: bool = True
