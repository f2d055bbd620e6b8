"""The ranking behind the ``auto`` backend, from the backends' declarations alone
(:mod:`spec_grammar.routing` has the order and :class:`~spec_grammar.routing.AutoBackend`).

Torch-free: a "backend" here is anything with the class attributes ``name``,
``capabilities``, ``json_schema_support``, ``output_limits`` and ``schema_caps`` (a
:class:`~spec_grammar.protocol.GrammarBackend` class, or the declarations
:func:`spec_grammar.backend_info.declarations` reads from the adapters' source), so the CLI
can rank and refuse before torch and the grammar libraries are imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .capabilities import Capabilities
from .errors import BackendNotFoundError, UnsupportedGrammarError
from .json_schema.strict import unenforced_keywords
from .specs import GrammarSpec, JsonSchema, ToolCalls

__all__ = [
    "AUTO",
    "Route",
    "rank",
    "user_unenforced",
    "unenforced_limits",
    "backends_taking",
    "same_everywhere",
    "registered_classes",
    "MEASURED_COST",
    "TOKENS_PER_REQUEST",
]

AUTO = "auto"

MEASURED_COST: dict[str, dict[str, tuple[float, float]]] = {
    "xgrammar": {"json_schema": (2.0, 5.1), "tool_calls": (2.8, 5.1)},
    "llguidance": {"json_schema": (1.5, 23.1), "tool_calls": (2.4, 23.1)},
    "outlines": {"json_schema": (57.0, 2.5), "tool_calls": (92.3, 2.5)},
}
"""backend -> grammar kind -> (median compile ms, mask us per visited tree node), SmolLM2's
tokenizer, on the bundled corpora: the JSONSchemaBench sample for ``json_schema``, the BFCL
tool lists for ``tool_calls`` (``docs/benchmarks.md``, "Compile time" and "Tree fill" at
N=16, from ``benchmarks/results/masks/masks.json``; ``docs/routing.md`` says how and adds a
second run). Other kinds (regex, EBNF, Lark) use the ``json_schema`` entry."""

TOKENS_PER_REQUEST = 200
"""Tokens a request is taken to run for when compile and mask costs are added: the CLI's
``--max-new-tokens`` order of magnitude (256), where a compile of a few ms equals a few
hundred masks."""


def _call_schema(spec: ToolCalls) -> Any:
    """What the user's tool list asks of one output, as a schema (the calls without limits)."""
    return spec.model_copy(update={"limits": None}).to_json_schema().json_schema


def user_unenforced(backend: Any, spec: GrammarSpec) -> list[str]:
    """Lines of what ``backend`` (a class) would leave unenforced of ``spec`` as written, by
    its declarations (empty for kinds without keyword declarations: regex, EBNF, Lark)."""
    if isinstance(spec, JsonSchema):
        return unenforced_keywords(spec.json_schema, backend.json_schema_support)
    if isinstance(spec, ToolCalls):
        return unenforced_keywords(_call_schema(spec), backend.json_schema_support)
    return []


def unenforced_limits(backend: Any, spec: GrammarSpec) -> list[str]:
    """The output limits ``spec`` sets that ``backend`` enforces neither itself
    (``output_limits``) nor by a schema rewrite (``schema_caps``)."""
    limits = getattr(spec, "limits", None)
    if limits is None:
        return []
    out = []
    for name, value in limits.model_dump().items():
        if value in (None, False) or name in backend.output_limits or name in backend.schema_caps:
            continue
        if name == "max_whitespace" and getattr(spec, "whitespace", None) != "flexible":
            continue
        out.append(name)
    return out


def _claims(cls: Any, spec: GrammarSpec) -> bool:
    caps: Capabilities = cls.capabilities
    if isinstance(spec, ToolCalls) and not caps.json_schema:
        return False
    return bool(getattr(caps, spec.kind, False))


def _cost(name: str, kind: str) -> float:
    table = MEASURED_COST.get(name)
    if table is None:
        return float("inf")
    compile_ms, mask_us = table.get(kind) or table["json_schema"]
    return compile_ms + mask_us * TOKENS_PER_REQUEST / 1000


@dataclass(frozen=True)
class Route:
    """One backend's place in a spec's ranking: ``unenforced`` (lines, the user's spec) and
    ``limits`` (output limits not enforced) by its declarations, ``cost_ms`` by
    :data:`MEASURED_COST` (inf: not measured)."""

    name: str
    unenforced: tuple[str, ...]
    limits: tuple[str, ...]
    cost_ms: float

    def reason(self, others: Sequence[Route]) -> str:
        """Why this route: one line for results and ``--json``."""
        cost = "not measured" if self.cost_ms == float("inf") else f"~{self.cost_ms:.1f} ms"
        if not self.unenforced:
            rivals = [r.name for r in others if not r.unenforced and r.name != self.name]
            why = "enforces every keyword of the spec"
            why += (
                f"; fastest of {', '.join([self.name, *rivals])} ({cost})"
                if rivals
                else f" ({cost})"
            )
        else:
            best = min((len(r.unenforced) for r in others), default=len(self.unenforced))
            why = (
                f"no backend enforces every keyword; this one leaves the fewest "
                f"({len(self.unenforced)}, best {best}): {'; '.join(self.unenforced[:3])}"
            )
        if self.limits:
            why += f"; output limits not enforced: {', '.join(self.limits)}"
        return why


def registered_classes() -> dict[str, Any | Exception]:
    """Every registered backend but ``auto``: name -> its class (imported: torch and its
    library), or the :class:`BackendNotFoundError` saying why it does not load."""
    from .registry import _entry_points, load_backend_class

    out: dict[str, Any] = {}
    for name in sorted(_entry_points()):
        if name == AUTO:
            continue
        try:
            out[name] = load_backend_class(name)
        except BackendNotFoundError as e:
            out[name] = e
    return out


def rank(spec: GrammarSpec, backends: dict[str, Any] | None = None) -> list[Route]:
    """The backends (default: every registered one that loads) that claim ``spec``'s kind,
    best first (module docstring). Empty when none claims it."""
    classes = (
        backends
        if backends is not None
        else {n: c for n, c in registered_classes().items() if isinstance(c, type)}
    )
    routes = [
        Route(
            name,
            tuple(user_unenforced(cls, spec)),
            tuple(unenforced_limits(cls, spec)),
            _cost(name, spec.kind),
        )
        for name, cls in classes.items()
        if _claims(cls, spec)
    ]
    return sorted(routes, key=lambda r: (len(r.unenforced), len(r.limits), r.cost_ms, r.name))


def backends_taking(spec: GrammarSpec, backends: dict[str, Any] | None = None) -> str:
    """One phrase for an error message: the registered backends (``backends`` as
    :func:`rank` takes them) that would take ``spec`` (claim its kind and, for a strict spec,
    enforce all of it by their declarations)."""
    routes = rank(spec, backends)
    if getattr(spec, "strict", False):
        routes = [r for r in routes if not r.unenforced]
    names = [r.name for r in routes]
    return f"backends that would take it: {', '.join(names) if names else 'none registered'}"


def same_everywhere(spec: GrammarSpec, best: Route) -> None:
    """Raise what every backend would raise, before any is tried (or built): the schema
    checks of :func:`~spec_grammar.compile.compile_spec` (an invalid schema, no finite
    document) and a strict refusal by the best route (every other leaves as much or more
    unenforced)."""
    target = spec.to_json_schema() if isinstance(spec, ToolCalls) else spec
    if not isinstance(target, JsonSchema):
        return
    from .errors import GrammarCompileError
    from .json_schema.check import check_json_schema, has_finite_document

    try:
        check_json_schema(target.json_schema)
    except GrammarCompileError as e:
        raise GrammarCompileError(str(e), backend=AUTO, reason=e.reason) from None
    if target.json_schema is False or not has_finite_document(target.json_schema):
        raise GrammarCompileError(
            "the schema accepts no finite document (a required property or item refers back "
            "to its own schema, or meets `false` / `enum: []`)",
            backend=AUTO,
        )
    if target.strict and best.unenforced:
        raise UnsupportedGrammarError(
            f"strict mode: no registered backend enforces every keyword; the best, {best.name}, "
            f"leaves {len(best.unenforced)} unenforced: " + "; ".join(best.unenforced[:5]),
            backend=AUTO,
        )
