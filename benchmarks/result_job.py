"""A benchmark job run in an interpreter of its own (another checkout's code, another venv's
vLLM, a fresh process per run): the job prints one ``RESULT <json>`` line, the caller reads it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

PREFIX = "RESULT "


def print_result(result: Any) -> None:
    """The job's side: ``result`` as its ``RESULT`` line (JSON)."""
    print(PREFIX + json.dumps(result), flush=True)


def run_job(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Any = None) -> Any:
    """The caller's side: run ``argv`` and return its last ``RESULT`` line's JSON. Raises
    ``RuntimeError`` with the tail of its stderr when it fails or prints none."""
    proc = subprocess.run(list(argv), env=env, capture_output=True, text=True, cwd=cwd)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(PREFIX)]
    if proc.returncode or not lines:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(lines[-1].removeprefix(PREFIX))
