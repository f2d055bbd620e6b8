"""What a backend supports: :class:`Capabilities`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, model_validator

if TYPE_CHECKING:
    from .specs import GrammarSpec

KINDS = ("json_schema", "regex", "ebnf", "lark", "tool_calls")
"""Every grammar kind, in the order listings show them."""

__all__ = ["Capabilities", "ConformanceCase", "KINDS"]


class Capabilities(BaseModel):
    """The grammar kinds a backend compiles, one flag per :attr:`GrammarSpec.kind
    <spec_grammar.specs.GrammarSpec.kind>`.

    :meth:`GrammarBackend.compile <spec_grammar.protocol.GrammarBackend.compile>` refuses a
    spec whose kind is False with :class:`~spec_grammar.errors.UnsupportedGrammarError` before
    the adapter sees it; the conformance suite and the benchmarks pick specs by these flags.
    ``tool_calls`` compile through ``json_schema``: claim it only with ``json_schema``.

    A *narrow* backend compiles only part of a kind (say, regexes that are alternations of
    literal strings): it claims the kind and names the part in ``subsets``. Its ``_compile``
    refuses a spec outside the part with ``UnsupportedGrammarError`` (never a weaker grammar);
    the conformance suite runs none of its own grammars of that kind on it, only the cases the
    backend supplies (:meth:`GrammarBackend.conformance_cases
    <spec_grammar.protocol.GrammarBackend.conformance_cases>`).

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
    subsets: dict[str, str] = {}
    """Claimed kinds compiled only in part: kind -> the part, in a few words (``{"regex":
    "alternations of literal strings"}``). Raises ``ValueError`` for a kind not claimed."""

    @model_validator(mode="after")
    def _subsets_of_claimed_kinds(self) -> Capabilities:
        wrong = [k for k in self.subsets if not getattr(self, k, False) or k not in KINDS]
        if wrong:
            raise ValueError(
                f"subsets names {', '.join(map(repr, wrong))}, not a claimed grammar kind "
                f"(claimed: {', '.join(self.kinds()) or 'none'})"
            )
        return self

    def kinds(self) -> list[str]:
        """The claimed grammar kinds (whole or in part)."""
        return [k for k in KINDS if getattr(self, k)]

    def whole(self, kind: str) -> bool:
        """True when ``kind`` is claimed without a subset (the suite's own grammars apply)."""
        return bool(getattr(self, kind, False)) and kind not in self.subsets

    def describe(self) -> list[str]:
        """One entry per claimed kind, a subset in parentheses: ``["regex (literal
        alternations)"]``."""
        return [f"{k} ({self.subsets[k]})" if k in self.subsets else k for k in self.kinds()]

    def __hash__(self) -> int:  # the subsets dict is not hashable; the pairs are
        return hash((*(getattr(self, k) for k in KINDS), tuple(sorted(self.subsets.items()))))


@dataclass(frozen=True)
class ConformanceCase:
    """A grammar a backend gives the conformance suite to test it on (how a narrow backend,
    one that compiles only part of a kind, gets tested on what it claims).

    Attributes:
        spec: the grammar (a :class:`~spec_grammar.specs.GrammarSpec` the backend compiles).
            The random properties draw from these next to the suite's own grammars of the
            kinds claimed in whole; the fresh-matcher replay is their oracle.
        documents: complete texts of the grammar, spelled by the fixture tokenizer the case
            is given for. The suite walks each one token by token and checks that every token
            is accepted, that EOS is allowed exactly after the prefixes the kind's own oracle
            calls complete (``re.fullmatch`` for a regex, ``json.loads`` + ``jsonschema`` for
            a JSON schema; other kinds: at the end only) and that accepting EOS terminates.
    """

    spec: GrammarSpec
    documents: tuple[str, ...] = ()
