"""What a registered backend declares, read without importing it.

``spec-grammar backends`` lists names, library versions and capabilities in well under a
second: importing an adapter brings torch, transformers and its grammar library (6 s here,
14 s on a loaded host). The entry point (``importlib.metadata``) gives the name and the
``module:Class`` target; the adapter's source, parsed with :mod:`ast` and never executed, gives
the class's literal ``capabilities = Capabilities(...)`` and ``library_requirement = "lib>=X"``
(the way setuptools reads a literal ``attr:`` version without importing the package); the
library's installed version comes from its distribution's metadata. A declaration that is
not a literal (computed, or inherited from a base class) is reported as unknown, and
:func:`spec_grammar.registry.list_backends` (``spec-grammar backends --check``) imports each
backend and reads the class itself.

:func:`declarations` reads what the ranking needs (:mod:`spec_grammar.ranking`:
``json_schema_support``, ``output_limits``, ``schema_caps``) the same way, so the CLI refuses a
strict or unsupported grammar before torch loads. ``json_schema_support`` is a
``KeywordSupport(...)`` expression over constants of :mod:`spec_grammar.json_schema.strict`
(``dict.fromkeys(NOT_CONTEXT_FREE_KEYWORDS, ...)``): it is evaluated with no builtins but
``dict`` / ``frozenset`` and only the names the module imports from that module.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel

from .capabilities import Capabilities
from .json_schema.strict import KeywordSupport

__all__ = [
    "BackendInfo",
    "Declarations",
    "ENTRY_POINT_GROUP",
    "declarations",
    "declared_backends",
    "release",
]

_CONSTANTS_MODULE = "spec_grammar.json_schema.strict"
"""The one module whose names a ``json_schema_support`` expression may use."""

ENTRY_POINT_GROUP = "spec_grammar.backends"


class BackendInfo(BaseModel):
    """One registered backend as :func:`declared_backends` or
    :func:`~spec_grammar.registry.list_backends` reports it.

    ``checked``: the backend was imported and its class checked (``list_backends``); False:
    read from its source and metadata only, where ``capabilities`` None means not declared
    as a literal. ``error``: why the backend cannot be used (its library missing or too old,
    or, when checked, any load error)."""

    name: str
    target: str
    version: str | None = None
    capabilities: Capabilities | None = None
    error: str | None = None
    checked: bool = False


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string (``"0.2.9.post1"`` -> ``(0, 2, 9)``)."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in m.group().split(".")) if m else ()


def declared_backends() -> list[BackendInfo]:
    """Every backend of the entry-point group, sorted by name, without importing any of them
    (only their source files are read)."""
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return [_declared(name, ep.value) for name, ep in sorted(eps.items())]


@dataclass(frozen=True)
class Declarations:
    """A backend class's declarations as :func:`spec_grammar.ranking.rank` reads them, from its
    source (a stand-in for the class: the same attribute names)."""

    name: str
    capabilities: Capabilities
    json_schema_support: KeywordSupport
    output_limits: frozenset[str]
    schema_caps: frozenset[str]


_DEFAULT_SCHEMA_CAPS = frozenset({"max_string_length", "max_items", "closed_objects"})
"""``GrammarBackend.schema_caps`` (:mod:`spec_grammar.protocol`, which imports torch)."""


def declarations() -> dict[str, Declarations] | None:
    """name -> :class:`Declarations` of every registered backend that can be used (its library
    installed), read without importing any; None when one of them declares something that is
    not read this way (a computed value, a base class other than ``GrammarBackend``): then
    only importing the classes tells (:func:`spec_grammar.ranking.registered_classes`)."""
    out: dict[str, Declarations] = {}
    for info in declared_backends():
        if info.error is not None:
            if info.capabilities is None:  # unreadable, not merely uninstalled
                return None
            continue  # its library is missing: the import would exclude it too
        module, _, cls_name = info.target.partition(":")
        try:
            found = _class_node(module, cls_name)
        except (ImportError, OSError, SyntaxError, ValueError):
            return None
        if found is None or info.capabilities is None:
            return None
        tree, cls = found
        if [getattr(b, "id", None) for b in cls.bases] != ["GrammarBackend"]:
            return None  # inherits declarations from a class not read here
        try:
            values = _evaluated(tree, cls.body)
        except (ValueError, TypeError, NameError, ImportError, AttributeError):
            return None
        support = values.get("json_schema_support", KeywordSupport())
        limits = values.get("output_limits", frozenset())
        caps = values.get("schema_caps", _DEFAULT_SCHEMA_CAPS)
        if not (
            isinstance(support, KeywordSupport)
            and isinstance(limits, frozenset)
            and isinstance(caps, frozenset)
        ):
            return None
        out[info.name] = Declarations(info.name, info.capabilities, support, limits, caps)
    return out


def _assignments(body: list[ast.stmt]) -> Iterator[tuple[ast.expr, ast.expr]]:
    """``(target, value)`` of each single-target assignment (plain or annotated) in ``body``."""
    for stmt in body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            yield stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            yield stmt.target, stmt.value


def _evaluated(tree: ast.Module, body: list[ast.stmt]) -> dict[str, object]:
    """The class-level ``json_schema_support`` / ``output_limits`` / ``schema_caps``
    expressions evaluated (module docstring). Raises ``NameError`` for a name not allowed."""
    allowed: dict[str, object] = {"dict": dict, "frozenset": frozenset}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == _CONSTANTS_MODULE:
            constants = importlib.import_module(_CONSTANTS_MODULE)
            for alias in node.names:
                allowed[alias.asname or alias.name] = getattr(constants, alias.name)
    out: dict[str, object] = {}
    for target, value in _assignments(body):
        name = getattr(target, "id", None)
        if name not in ("json_schema_support", "output_limits", "schema_caps"):
            continue
        used = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
        if used - allowed.keys() or any(
            isinstance(n, ast.Attribute) and n.attr.startswith("_") for n in ast.walk(value)
        ):
            raise NameError(f"{name} uses {sorted(used - allowed.keys())}")
        code = compile(ast.Expression(value), "<declaration>", "eval")
        out[name] = eval(code, {"__builtins__": {}}, allowed)  # noqa: S307 (names checked above)
    return out


def _declared(name: str, target: str) -> BackendInfo:
    info = BackendInfo(name=name, target=target)
    module, _, cls_name = target.partition(":")
    try:
        body = _class_body(module, cls_name)
    except (ImportError, OSError, SyntaxError, ValueError) as e:
        info.error = f"cannot read {target}: {e}"
        return info
    if body is None:
        info.error = f"{target}: no module {module!r} or no class {cls_name!r} in it"
        return info
    literals = _literal_assignments(body)
    capabilities = literals.get("capabilities")
    if isinstance(capabilities, dict):
        try:
            info.capabilities = Capabilities(**capabilities)
        except ValueError as e:
            info.error = f"{target}: capabilities: {e}"
    requirement = literals.get("library_requirement")
    if isinstance(requirement, str):
        library, _, minimum = requirement.partition(">=")
        try:
            info.version = importlib.metadata.version(library.strip())
        except importlib.metadata.PackageNotFoundError:
            info.error = (
                f"its library is not installed; install it with: pip install '{requirement}'"
            )
        else:
            if release(info.version) and release(info.version) < release(minimum):
                info.error = f"needs {requirement}, found {info.version}"
    return info


def _class_body(module: str, cls_name: str) -> list[ast.stmt] | None:
    """The statements of class ``cls_name`` in ``module``'s source (:func:`_class_node`)."""
    found = _class_node(module, cls_name)
    return None if found is None else found[1].body


def _class_node(module: str, cls_name: str) -> tuple[ast.Module, ast.ClassDef] | None:
    """``module``'s parsed source and its top-level class ``cls_name``, found without running
    the module or its parent packages (``importlib.util.find_spec`` of a dotted name imports
    the parents); None when the module has no source file or no such class."""
    top, *rest = module.split(".")
    spec, name = importlib.util.find_spec(top), top
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return None
        name = f"{name}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return tree, node
    return None


def _literal_assignments(body: list[ast.stmt]) -> dict[str, object]:
    """``name -> value`` for the class-level assignments of literals, with a
    ``Capabilities(k=literal, ...)`` call read as its keyword dict."""
    out: dict[str, object] = {}
    for target, value in _assignments(body):
        if not isinstance(target, ast.Name):
            continue
        try:
            out[target.id] = _literal(value)
        except ValueError:
            continue
    return out


def _literal(node: ast.expr) -> object:
    if isinstance(node, ast.Call) and not node.args:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called == "Capabilities" and all(k.arg for k in node.keywords):
            return {k.arg: _literal(k.value) for k in node.keywords}
    try:
        return ast.literal_eval(node)
    except (TypeError, SyntaxError, RecursionError) as e:
        raise ValueError(str(e)) from None
