"""spec-grammar inside SGLang, as an SGLang plugin (no engine edit).

:func:`register` is the entry point of group ``sglang.srt.plugins`` (``pyproject.toml``);
SGLang's ``load_plugins()`` runs it in the launcher and in every scheduler process. It

- registers one grammar backend per registered spec-grammar backend (entry-point group
  ``spec_grammar.backends``), named ``spec-grammar:<name>`` (``spec-grammar:xgrammar``,
  ``spec-grammar:llguidance``, ``spec-grammar:outlines``, third-party ones too), with SGLang's
  ``register_grammar_backend`` and admits the names to ``--grammar-backend`` with
  ``add_grammar_backend_choices``; the objects are :mod:`.grammar`'s;
- replaces ``spec_utils.generate_token_bitmask``, the draft-tree mask fill of every speculative
  worker, with :func:`.tree_fill.generate_token_bitmask` through SGLang's ``HookRegistry``
  (``HookType.REPLACE``); ``SPEC_GRAMMAR_SGLANG_TREE_FILL=0`` leaves SGLang's own walk in place.

Needs the ``sglang`` extra (``pip install -e '.[sglang,llguidance]'`` from a checkout; the
install and SGLang's pins: docs/serving-sglang.md). Registering the hook logs one INFO line
(logger ``spec_grammar.integrations.sglang``) per process.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points

from ...registry import AUTO, ENTRY_POINT_GROUP

PREFIX = "spec-grammar:"
"""Prefix of the ``--grammar-backend`` names this plugin adds."""

TREE_FILL_ENV = "SPEC_GRAMMAR_SGLANG_TREE_FILL"
"""Environment variable: ``0`` keeps SGLang's own draft-tree walk."""

__all__ = ["register", "backend_names", "PREFIX", "TREE_FILL_ENV"]

_hook_registered = False
logger = logging.getLogger(__name__)


def backend_names() -> list[str]:
    """The ``--grammar-backend`` names: ``spec-grammar:<name>`` for every registered
    spec-grammar backend and ``spec-grammar:auto`` (per request, the routing of
    :mod:`spec_grammar.routing`), sorted."""
    names = {AUTO, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))}
    return sorted(PREFIX + n for n in names)


def register() -> None:
    """Register the grammar backends and the tree-fill hook with SGLang (idempotent).

    Registration imports no grammar library: a backend's library is loaded when SGLang builds
    the backend, and a missing one fails there with the ``pip install`` to run.
    """
    from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES, add_grammar_backend_choices
    from sglang.srt.constrained.base_grammar_backend import register_grammar_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .grammar import make_backend_factory

    names = backend_names()
    add_grammar_backend_choices([n for n in names if n not in GRAMMAR_BACKEND_CHOICES])
    for name in names:
        register_grammar_backend(name, make_backend_factory(name[len(PREFIX) :]))
    global _hook_registered
    if not _hook_registered and os.environ.get(TREE_FILL_ENV, "1") != "0":
        from .tree_fill import TARGET, generate_token_bitmask

        HookRegistry.register(TARGET, generate_token_bitmask, HookType.REPLACE)
        _hook_registered = True
        # SGLang applies registered hooks after loading the plugins and logs a failure itself
        logger.info("spec-grammar's draft-tree mask fill registered to replace %s", TARGET)
