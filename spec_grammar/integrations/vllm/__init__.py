"""spec-grammar's backends serving vLLM's structured outputs (tested with vLLM 0.32).

vLLM has no registry for structured-output backends: its backend names are a fixed list and the
engine builds the backend in ``vllm.v1.structured_output.StructuredOutputManager.grammar_init``
from the module globals ``XgrammarBackend`` / ``GuidanceBackend``, read at call time. This
package's :func:`register` (entry point ``spec_grammar`` in the group ``vllm.general_plugins``,
which vLLM runs in every process it starts) rebinds ``GuidanceBackend`` to
:class:`~spec_grammar.integrations.vllm.backend.SpecGrammarVllmBackend`, so requests that vLLM
routes to its backend name ``"guidance"`` run on one of our registered backends.

Opt-in: nothing is rebound unless ``SPEC_GRAMMAR_VLLM_BACKEND`` is set (installing spec-grammar
next to vLLM changes nothing by itself). Usage::

    SPEC_GRAMMAR_VLLM_BACKEND=llguidance  # or xgrammar, outlines, a plugin, module:Class
    LLM(model_dir, structured_outputs_config={"backend": "guidance"})
    # server: python -m vllm.entrypoints.openai.api_server --structured-outputs-config.backend guidance

``"auto"`` keeps vLLM's own choice (xgrammar first), so it does not reach our backend.
"""

from __future__ import annotations

import logging
import os

__all__ = ["BACKEND_ENV", "HOST_BACKEND_NAME", "register", "selected_backend"]

BACKEND_ENV = "SPEC_GRAMMAR_VLLM_BACKEND"
"""Environment variable naming our backend (a registry name or ``module:Class``)."""
HOST_BACKEND_NAME = "guidance"
"""The vLLM backend name our backend runs under (``structured_outputs_config.backend``)."""

logger = logging.getLogger(__name__)


def selected_backend() -> str | None:
    """The backend named by :data:`BACKEND_ENV`, or ``None`` when unset or empty."""
    return os.environ.get(BACKEND_ENV, "").strip() or None


def register() -> None:
    """vLLM general-plugin entry point: with :data:`BACKEND_ENV` set, serve vLLM's
    ``"guidance"`` backend name with our backend. Safe to call more than once (vLLM calls it in
    every process). Raises :class:`~spec_grammar.errors.BackendNotFoundError` when the named
    backend cannot be loaded, so a typo stops the server at start instead of at the first
    request."""
    name = selected_backend()
    if name is None:
        return
    from spec_grammar.registry import load_backend_class

    load_backend_class(name)  # fail now, naming the backend, not at the first request

    import vllm.v1.structured_output as manager
    import vllm.v1.structured_output.backend_guidance as guidance

    from .backend import SpecGrammarVllmBackend, validate_request

    manager.GuidanceBackend = SpecGrammarVllmBackend
    # the front end's check for the "guidance" name (sampling_params.py imports it inside the
    # function, so the module attribute is what it reads)
    guidance.validate_guidance_grammar = validate_request
    logger.info("spec-grammar backend %r serves vLLM's %r backend name", name, HOST_BACKEND_NAME)
