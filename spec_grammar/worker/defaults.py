"""Worker defaults chosen by measurement, in a module that imports nothing heavy (the CLI's
``--help`` shows them without importing torch), and the CPU thread policy.

- :data:`DEFAULT_FORCED_TOKENS`: ``benchmarks/bench_drafting.py``
  (``benchmarks/results/drafting.md``: n-gram + forced tokens on xgrammar, BFCL: accept
  length 3.43 vs 2.17, 5.2 vs 2.9 tok/s).
- :data:`DEFAULT_CPU_THREADS`: ``benchmarks/bench_startup.py``
  (``benchmarks/results/startup.md``): on a 2-core host, SmolLM2-135M's CPU forward with two
  threads was 20-30% faster on a quiet host and 1.8x (both cores busy) to 3-6x (other sessions'
  load) slower on a busy one (torch's threads wait on each other at every op).
"""

from __future__ import annotations

import os
import sys

__all__ = ["DEFAULT_FORCED_TOKENS", "DEFAULT_CPU_THREADS", "cpu_threads", "apply_cpu_threads"]

DEFAULT_FORCED_TOKENS = True
"""Default of ``forced_tokens`` in ``generate`` / ``build_worker`` / ``spec-grammar generate``."""

DEFAULT_CPU_THREADS = 1
"""CPU threads of the model's forward when neither ``--threads`` nor ``$OMP_NUM_THREADS`` says."""


def cpu_threads(requested: int | None = None) -> int:
    """The thread count to use: ``requested``, else ``$OMP_NUM_THREADS`` (when a positive
    int), else :data:`DEFAULT_CPU_THREADS`."""
    if requested is not None:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else DEFAULT_CPU_THREADS


def apply_cpu_threads(requested: int | None = None) -> int:
    """Set the process's CPU thread count for torch's intra-op pool and return it.

    Before torch is imported (a fresh ``spec-grammar`` process): :func:`cpu_threads`, set as
    ``$OMP_NUM_THREADS`` (OpenMP reads it once, at torch's import). Once torch is imported (a
    Python program that already chose its threads, a test run), only an explicit
    ``requested`` changes it (``torch.set_num_threads``); otherwise the count stays as it is.
    """
    torch = sys.modules.get("torch")
    if torch is not None and requested is None:
        return int(torch.get_num_threads())
    n = cpu_threads(requested)
    os.environ["OMP_NUM_THREADS"] = str(n)
    if torch is not None:
        torch.set_num_threads(n)
    return n
