"""CUDA graphs of the tree-attention forward, one per shape bucket.

An eager Hugging Face forward launches hundreds of kernels from Python (a Llama-3.1-8B verify
forward at batch 1: ~22 ms of launches against ~4 ms of weight reads on an H200), and while the
host thread launches, the grammar thread waits for the GIL. A captured graph launches the whole
forward with one ``replay`` call, so the GPU runs at its own speed and the host is free for the
grammar work (vLLM and SGLang capture their decode and verify forwards the same way).

A graph fixes every shape and every device address, so :class:`ForwardGraphs` keeps one graph
per bucket ``(batch, nodes, kv_len)`` (each a power of two, see :func:`bucket`): the runner pads
its inputs to the bucket, copies them into the graph's static input tensors and replays. Graphs
read and write the KV buffers in place, so growing those buffers invalidates every graph
(:meth:`ForwardGraphs.clear`); capture is lazy, on the first forward of a bucket, and replays
after it cost one input copy and one launch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

__all__ = ["ForwardGraphs", "bucket"]


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two ``>= max(n, minimum)``."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


Output = torch.Tensor | tuple[torch.Tensor, ...]


class _Captured:
    """One graph: its static device inputs, a pinned host copy of them, and its output."""

    __slots__ = ("graph", "inputs", "staging", "copied", "output", "output_bytes")

    def __init__(
        self, graph: torch.cuda.CUDAGraph, inputs: dict[str, torch.Tensor], output: Output
    ):
        self.graph, self.inputs, self.output = graph, inputs, output
        outputs = output if isinstance(output, tuple) else (output,)
        self.output_bytes = sum(t.numel() * t.element_size() for t in outputs)
        self.staging = {
            k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in inputs.items()
        }
        self.copied = torch.cuda.Event()  # the staging buffers may be rewritten after this
        self.copied.record()


class ForwardGraphs:
    """Lazily captured CUDA graphs of ``forward(**inputs) -> outputs``, one per bucket key.

    Args:
        device: the CUDA device.
        max_output_bytes: the graphs' output tensors (a ``(B, N, V)`` float32 logits tensor
            each, 2 GiB at 64 x 64 x 128k, and what else the forward returns) stay allocated
            while a graph is kept; beyond this total the least recently replayed graphs are
            dropped (a server whose contexts grow leaves old KV-length buckets behind) and
            captured again if needed.

    All graphs share one memory pool (they never run at the same time). Capture uses
    ``capture_error_mode="thread_local"``, so the grammar thread may allocate pinned memory
    while a capture runs. A bucket whose capture fails is remembered and runs eagerly.
    """

    def __init__(self, device: torch.device, *, max_output_bytes: int = 8 << 30):
        self.device = device
        self.max_output_bytes = int(max_output_bytes)
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._failed: set[tuple] = set()
        self._pool = None
        self.captures = 0  # graphs captured so far (tests and benchmarks read it)
        # timing events around the last replay: the GPU time of the forward, read after the
        # step's own synchronization (reading it costs no extra wait)
        self.last_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (after the buffers they address were reallocated)."""
        self._graphs.clear()
        self._failed.clear()
        self._pool = None

    def run(
        self,
        key: tuple,
        inputs: dict[str, torch.Tensor],
        forward: Callable[..., Output],
        *,
        before_launch: Callable[[], None] | None = None,
    ) -> Output | None:
        """Replay the graph of ``key`` on host ``inputs`` (CPU tensors of the bucket's shapes);
        ``before_launch`` is called right before the replay (after a capture, if any).

        ``forward(**device_inputs)`` (a tensor or a tuple of tensors) is captured on the first
        call of a key: it must
        run the same kernels for every input of those shapes, never synchronize with the host,
        and only touch memory that outlives the graph (the KV buffers) besides what it
        allocates. Returns the graph's output (what ``forward`` returned), valid until the next
        replay of the same graph, or None when this bucket cannot be captured."""
        if key in self._failed:
            return None
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(key, inputs, forward)
            if g is None:
                return None
            self._evict()  # only a capture adds output memory
        self._graphs.move_to_end(key)
        g.copied.synchronize()  # the previous upload from the staging buffers is done
        for name, host in inputs.items():
            g.staging[name].copy_(host)
            g.inputs[name].copy_(g.staging[name], non_blocking=True)
        g.copied.record()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if before_launch is not None:
            before_launch()
        g.graph.replay()
        end.record()
        self.last_events = (start, end)
        return g.output

    def _evict(self) -> None:
        """Drop least recently replayed graphs (never the one just captured: it is the most
        recent) while their outputs exceed the budget."""
        while (
            len(self._graphs) > 1
            and sum(g.output_bytes for g in self._graphs.values()) > self.max_output_bytes
        ):
            self._graphs.popitem(last=False)

    def _capture(
        self, key: tuple, inputs: dict[str, torch.Tensor], forward: Callable[..., Output]
    ) -> _Captured | None:
        static = {k: v.to(self.device) for k, v in inputs.items()}
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        try:
            # warm-up on a side stream, as torch.cuda.graphs recommends: lazy initialisations
            # (cuBLAS workspaces, autotuning) must not happen inside the capture. The forward
            # rewrites the same scratch KV each time, so repeating it is harmless.
            with torch.cuda.stream(side):
                forward(**static)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = forward(**static)
        except RuntimeError:
            # e.g. a model whose forward synchronizes with the host; it still runs eagerly
            current.wait_stream(side)
            self._failed.add(key)
            return None
        if self._pool is None:
            self._pool = graph.pool()
        self.captures += 1
        captured = self._graphs[key] = _Captured(graph, static, output)
        return captured
