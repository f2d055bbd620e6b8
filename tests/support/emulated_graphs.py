"""CUDA-graph replay emulated on CPU, for the tests of the graph paths where CUDA is absent."""

from __future__ import annotations

from spec_grammar.worker.runner import ModelRunner


class ReplayEagerly:
    """Stands in for :class:`~spec_grammar.worker.cuda_graphs.ForwardGraphs`: runs the very
    function a graph would capture, on the bucket-padded inputs, so the padding of the graph
    path (idle rows, self-attending nodes, kv buckets) is checked on CPU; ``before_launch`` is
    called where a replay would start, as the real one does."""

    captures = 0
    last_events = None

    def __init__(self):
        self.keys = set()
        self.launches = 0

    def clear(self):
        pass

    def run(self, key, inputs, forward, *, before_launch=None):
        self.keys.add(key)
        if before_launch is not None:
            before_launch()
        self.launches += 1
        return forward(**inputs)


def make_runner(m, graphs, **kw) -> ModelRunner:
    """A runner with CUDA graphs ``True`` / ``False`` / None (auto) or ``"emulated"``."""
    if graphs != "emulated":
        return ModelRunner(m, cuda_graphs=graphs, **kw)
    return ModelRunner(m, graphs=ReplayEagerly(), **kw)
