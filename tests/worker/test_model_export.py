"""The model directory the loader writes for a GGUF model is a complete Hugging Face model:
``config.json`` names the architecture, the tied embedding is stored as
``model.embed_tokens.weight`` and the tokenizer is saved next to them, so a loader given the
directory alone (transformers here, vLLM in ``tests/integrations/test_vllm.py``) builds the same
causal LM as our loader.

Before: no ``architectures`` (vLLM built a pooling model) and the tied weight saved only as
``lm_head.weight`` (vLLM skipped it and generated token 0 forever)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.mark.model
def test_exported_smollm2_directory_loads_alone_with_the_gguf_logits(tmp_path, monkeypatch):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from spec_grammar import models

    # the oracle: our loader as every other test uses it (its own cache, however written)
    reference = models.load_model("smollm2")
    monkeypatch.setenv("SPEC_GRAMMAR_CACHE", str(tmp_path))
    models.load_model("smollm2")  # dequantizes the GGUF again, writing under tmp_path
    (model_dir,) = {p.parent for p in tmp_path.rglob("config.json") if p.parent.name == "model"}

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        stored_embedding = f.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in keys  # stored once, under the name loaders read

    exported = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert type(exported).__name__ == "LlamaForCausalLM"
    assert torch.equal(stored_embedding, reference.get_input_embeddings().weight)
    assert exported.get_output_embeddings().weight.data_ptr() == (
        exported.get_input_embeddings().weight.data_ptr()
    )

    # the tokenizer is in the directory too (vLLM's LLM(model_dir) reads it from there)
    from transformers import AutoTokenizer

    text = 'Hello, {"name": "Ada"}\n'
    assert AutoTokenizer.from_pretrained(str(model_dir)).encode(text) == (
        models.load_tokenizer("smollm2").encode(text)
    )

    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 2]])
    with torch.no_grad():
        want = reference(ids).logits
        got = exported(ids).logits
    assert torch.equal(got, want)
