"""The speculative worker: a batched tree-attention model runner, masked sampling and tree
verification, drafters and the batch loop."""

from .api import build_prompt, build_worker, generate, schema_prompt
from .config import WorkerConfig
from .engine import SpecWorker
from .request import Request, RequestResult, StepStats

__all__ = [
    "SpecWorker",
    "WorkerConfig",
    "generate",
    "build_worker",
    "build_prompt",
    "schema_prompt",
    "Request",
    "RequestResult",
    "StepStats",
]
