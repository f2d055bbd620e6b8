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
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata
import importlib.util
import re

from pydantic import BaseModel

from .capabilities import Capabilities

__all__ = ["BackendInfo", "ENTRY_POINT_GROUP", "declared_backends", "release"]

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
    """The statements of class ``cls_name`` in ``module``'s source, found without running the
    module or its parent packages (``importlib.util.find_spec`` of a dotted name imports the
    parents); None when the module has no source file or no such top-level class."""
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
            return node.body
    return None


def _literal_assignments(body: list[ast.stmt]) -> dict[str, object]:
    """``name -> value`` for the class-level assignments of literals, with a
    ``Capabilities(k=literal, ...)`` call read as its keyword dict."""
    out: dict[str, object] = {}
    for stmt in body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            target, value = stmt.target, stmt.value
        else:
            continue
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
