"""Our own decoder forward for model families where Hugging Face's forward is kernel-bound on a
GPU (:mod:`.llama`), with its fused operations (:mod:`.ops`, Triton kernels in
:mod:`.triton_ops`). :class:`~spec_grammar.worker.runner.ModelRunner` uses it through
``fused_forward``."""

from .llama import FusedLlama, unsupported_reason

__all__ = ["FusedLlama", "unsupported_reason"]
