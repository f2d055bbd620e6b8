"""Soak (long mode): requests through one worker with resident memory flat after warm-up.
The full run (2,000 requests) is ``benchmarks/soak.py``; this test runs 300 and bounds the
growth after warm-up."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_soak_memory_is_flat(tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    batch = tmp_path / "batch.jsonl"
    soak.make_batch(batch, 300)
    res = soak.soak(
        batch, backend_name="xgrammar", chunk=50, max_new_tokens=3, cache_size=16, warmup=0.34
    )
    assert sum(res["finish_reasons"].values()) == 300
    assert (
        res["finish_reasons"].get("error", 0) + res["finish_reasons"].get("bad line", 0) > 0
    )  # bad lines ran too
    assert (
        res["compile_cache_entries"] <= 16 < res["compiles"]
    )  # the cache evicted and stayed bounded
    assert res["growth_mib_after_warmup"] < 40, res["samples"]
