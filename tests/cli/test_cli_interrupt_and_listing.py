"""``spec-grammar backends`` lists without importing any backend, and Ctrl-C during
``generate`` ends at once, saying so with the stats so far (issue 36).

Oracles: the backends' own classes (imported here) for what the listing declares; for the
listing's footprint the fresh interpreter's ``sys.modules``, not wall time."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spec_grammar.registry import list_backends

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "xgrammar", "llguidance", "outlines_core", "interegular", "numpy")


def _env() -> dict[str, str]:
    paths = [str(ROOT), str(ROOT / "adapters"), str(ROOT / "benchmarks")]
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([rest] if rest else []))}


def test_backends_lists_what_the_classes_declare_without_importing_them():
    code = (
        "import contextlib, io, json, sys\nfrom spec_grammar.cli import main\n"
        "out = io.StringIO()\nwith contextlib.redirect_stdout(out):\n"
        "    main(['backends', '--json'])\n    main(['backends'])\n"
        "print(json.dumps({'listing': out.getvalue(), 'modules': sorted(sys.modules)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    loaded = {m.partition(".")[0] for m in report["modules"]}
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert not any(m.startswith("spec_grammar_") for m in loaded), sorted(loaded)
    listing = report["listing"]
    declared = {b["name"]: b for b in json.loads(listing[: listing.rindex("]") + 1])}
    checked = {b.name: b for b in list_backends()}
    assert {"xgrammar", "llguidance", "outlines"} <= set(declared)
    for name, info in checked.items():
        if info.error is not None:
            continue
        got = declared[name]
        assert got["checked"] is False and got["error"] is None, got
        assert got["capabilities"] == info.capabilities.model_dump(mode="json"), name
        if name in ("xgrammar", "llguidance", "outlines"):
            assert got["version"] == info.version, name


def _ctrl_c_as_on_a_terminal() -> None:
    """A job started in the background of a non-interactive shell (as CI starts this run)
    inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the
    generation ran to its end. The child gets the terminal's default back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.model
def test_ctrl_c_ends_at_once_with_the_stats_so_far():
    """Ctrl-C took 2-7 s (the interpreter's teardown of torch and the model) and said nothing."""
    cmd = [sys.executable, "-m", "spec_grammar", "generate", "Write a long story about a dragon."]
    cmd += ["--regex", "[a-zA-Z ,.]+", "--max-new-tokens", "4000"]
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        preexec_fn=_ctrl_c_as_on_a_terminal,
    )
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    streamed = b""
    deadline = time.monotonic() + 240
    while len(streamed) < 20 and time.monotonic() < deadline:  # some steps have run
        if sel.select(timeout=5):
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                break
            streamed += chunk
    assert len(streamed) >= 20, p.stderr.read().decode()[-2000:]
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
    err = err.decode()
    assert p.returncode == 130, err[-2000:]
    assert took < 1.5, f"{took:.2f} s from SIGINT to exit"
    line = next(x for x in err.splitlines() if "interrupted" in x)
    assert line.startswith("spec-grammar generate: interrupted after "), line
    tokens = int(line.split(": ")[2].split()[0])
    assert tokens > 0 and "tok/s" in line and "accept length" in line, line
    assert (streamed + rest).endswith(b"\n")  # the partial text is ended before the message
