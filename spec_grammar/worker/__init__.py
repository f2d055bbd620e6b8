"""The speculative worker: a batched tree-attention model runner, masked sampling and tree
verification, drafters and the batch loop."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .api import build_prompt, build_worker, generate, schema_prompt, stream
    from .config import WorkerConfig
    from .engine import SpecWorker
    from .request import Request, RequestResult, StepStats
    from .streaming import StreamChunk

__all__ = [
    "SpecWorker",
    "WorkerConfig",
    "generate",
    "stream",
    "StreamChunk",
    "build_worker",
    "build_prompt",
    "schema_prompt",
    "Request",
    "RequestResult",
    "StepStats",
]

_LAZY = {
    **dict.fromkeys(("build_prompt", "build_worker", "generate", "schema_prompt", "stream"), "api"),
    "StreamChunk": "streaming",
    "WorkerConfig": "config",
    "SpecWorker": "engine",
    **dict.fromkeys(("Request", "RequestResult", "StepStats"), "request"),
}
"""Public name -> its submodule, imported on first use (PEP 562): a submodule such as
``worker.sampling`` or ``worker.config`` imported alone need not load the engine."""


from ..lazy_exports import lazy_exports  # noqa: E402 (after the name table it serves)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
