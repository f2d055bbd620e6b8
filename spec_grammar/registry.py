"""Backend discovery through the entry-point group ``spec_grammar.backends``.

Built-in adapters register exactly as third-party ones do (see ``pyproject.toml``). A backend
can also be named directly as ``module:Class``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .backend_info import ENTRY_POINT_GROUP, BackendInfo, release
from .capabilities import Capabilities
from .errors import BackendNotFoundError

if TYPE_CHECKING:  # the protocol imports torch: a name check needs neither
    from .protocol import GrammarBackend

AUTO = "auto"
"""The routing backend's name (:class:`~spec_grammar.routing.AutoBackend`): per request, the
registered backend that enforces the most of the spec, then the fastest."""
_BUILT_IN = ("xgrammar", "llguidance", "outlines")

__all__ = [
    "get_backend",
    "load_backend_class",
    "check_backend_name",
    "list_backends",
    "BackendInfo",
    "ENTRY_POINT_GROUP",
    "AUTO",
]


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def check_backend_name(name: str) -> None:
    """Raise :class:`BackendNotFoundError` when ``name`` is neither ``auto``, a registered
    entry point nor of the ``module:Class`` form: the check a command makes first, reading
    package metadata only (no backend, library or torch import: well under a second)."""
    if not isinstance(name, str) or not name:
        raise BackendNotFoundError(f"a backend name must be a non-empty string, got {name!r}")
    eps = _entry_points()
    if name != AUTO and name not in eps and ":" not in name:
        known = ", ".join([AUTO, *sorted(eps)])
        raise BackendNotFoundError(f"unknown grammar backend {name!r}; registered: {known}")


def load_backend_class(name: str) -> type[GrammarBackend]:
    """The backend class for a registered ``name`` or a ``module:Class`` path.

    Raises :class:`BackendNotFoundError` naming the registered backends, or the import error,
    or what makes the class unusable (a required hook not implemented, ``capabilities`` that
    is not a :class:`~spec_grammar.capabilities.Capabilities`).
    """
    if not isinstance(name, str) or not name:
        raise BackendNotFoundError(f"a backend name must be a non-empty string, got {name!r}")
    if name == AUTO:  # routing over the registered backends: built in, not an entry point
        from .routing import AutoBackend

        return AutoBackend
    eps = _entry_points()
    if name in eps:
        try:
            cls = eps[name].load()
        except (ImportError, AttributeError) as e:
            adapter = eps[name].value.partition(":")[0]
            missing = getattr(e, "name", None)
            if isinstance(e, ImportError) and name in _BUILT_IN and missing != adapter:
                # the adapter's own message names the library's pip package; ours the extra
                raise BackendNotFoundError(
                    f"backend {name!r} is registered but its library is not installed; "
                    f"install it with: pip install 'spec-grammar[{name}]'"
                ) from e
            raise BackendNotFoundError(
                f"backend {name!r} is registered but cannot be loaded ({e})"
            ) from e
    elif ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise BackendNotFoundError(f"cannot load backend class {name!r}: {e}") from e
    else:
        known = ", ".join([AUTO, *sorted(eps)])
        raise BackendNotFoundError(f"unknown grammar backend {name!r}; registered: {known}")
    from .protocol import GrammarBackend

    if not (isinstance(cls, type) and issubclass(cls, GrammarBackend)):
        raise BackendNotFoundError(
            f"{name!r} does not name a GrammarBackend subclass (got {cls!r})"
        )
    # found, but unusable: said here, where the CLI checks its backend before the model loads
    # (building it failed later, with a TypeError traceback after the load)
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise BackendNotFoundError(
            f"{name!r}: {cls.__name__} does not implement the hook(s) {', '.join(missing)}"
        )
    if cls.library_requirement:
        _check_library(name, cls, cls.library_requirement)
    if not isinstance(cls.capabilities, Capabilities):
        raise BackendNotFoundError(
            f"{name!r}: {cls.__name__}.capabilities must be a Capabilities, got "
            f"{type(cls.capabilities).__name__} (every grammar would be refused as unsupported)"
        )
    return cls


def _check_library(name: str, cls: type[GrammarBackend], requirement: str) -> None:
    """Raise :class:`BackendNotFoundError` when ``cls``'s library is older than
    ``requirement`` (``"name>=X.Y.Z"``): an older release (an engine's pin) fails later with
    the library's own error, far from its cause."""
    library, _, minimum = requirement.partition(">=")
    found = cls.library_version()
    if release(found) and release(found) < release(minimum):
        raise BackendNotFoundError(
            f"backend {name!r} needs {requirement}, found {library} {found}; "
            f"install it with: pip install '{requirement}'"
        )


def get_backend(
    name: str, tokenizer: Any, *, vocab_size: int | None = None, **options: Any
) -> GrammarBackend:
    """Instantiate backend ``name`` (entry-point name or ``module:Class``) for a Hugging Face
    ``tokenizer``. ``vocab_size`` is the logits width when it differs from ``len(tokenizer)``;
    ``options`` go to the backend (``stop_token_ids``, ``max_rollback_tokens``,
    ``compile_cache_size``, backend-specific ones)."""
    return load_backend_class(name)(tokenizer, vocab_size=vocab_size, **options)


def list_backends() -> list[BackendInfo]:
    """Every registered backend, imported and checked (:func:`load_backend_class`), with its
    library version and capabilities; a backend that cannot be loaded is listed with
    ``error`` set. :func:`~spec_grammar.backend_info.declared_backends` lists them without
    importing any. ``auto`` (:data:`AUTO`) is not listed: it routes over these."""
    out = []
    for name, ep in sorted(_entry_points().items()):
        try:
            cls = load_backend_class(name)
            out.append(
                BackendInfo(
                    name=name,
                    target=ep.value,
                    version=cls.library_version(),
                    capabilities=cls.capabilities,
                    checked=True,
                )
            )
        except BackendNotFoundError as e:
            out.append(BackendInfo(name=name, target=ep.value, error=str(e), checked=True))
    return out
