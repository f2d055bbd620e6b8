"""Public names imported from their submodule on first use (PEP 562), for a package's
``__init__``: importing ``spec_grammar`` or ``spec_grammar.worker`` must not pay for torch and
pydantic (2-3 s) when ``spec-grammar --help`` only needs argparse."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], names: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps a public name to its
    submodule (relative to ``package``); a name is imported on first access and stored in
    ``namespace`` (the package's ``globals()``). Unknown names raise ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *names])

    return __getattr__, __dir__
