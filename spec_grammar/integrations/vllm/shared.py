"""What the engine's backend and the drafter share inside one process: our backends (so a spec
is compiled once, in the first of the two to ask, and the other hits the compile cache) and the
grammar of each live request (vLLM 0.34's drafter reads the engine's compiled grammar instead
of compiling the spec again).

With one GPU vLLM runs the scheduler (our backend's caller) and the model runner (the
drafter's) in one engine process, so both halves meet here; with several worker processes each
worker has its own (the drafter then compiles in its process, once per spec).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from spec_grammar.protocol import GrammarBackend
from spec_grammar.registry import get_backend

__all__ = ["forget_backends", "live_grammar", "note_grammar", "shared_backend"]

# our backends kept per (name, tokenizer, vocab size, stop set, rollback depth); a few distinct
# stop sets at most (requests with their own stop_token_ids)
_MAX_BACKENDS = 8
_backends: OrderedDict[tuple, tuple[Any, GrammarBackend]] = OrderedDict()
_lock = threading.Lock()  # vLLM compiles in a thread pool
# request id -> the engine's grammar object of that request (dropped with the request)
_grammars: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def shared_backend(
    name: str,
    tokenizer: Any,
    *,
    vocab_size: int,
    stop_token_ids: frozenset[int],
    max_rollback_tokens: int,
) -> GrammarBackend:
    """This process's backend ``name`` for ``tokenizer``, built on first use. Tokenizers are
    the same when class, ``name_or_path`` and length agree (the scheduler's and the model
    runner's copies of one model's tokenizer); one without a name is compared by identity.
    Raises what :func:`~spec_grammar.registry.get_backend` raises."""
    path = getattr(tokenizer, "name_or_path", None)
    tok_key = (type(tokenizer).__qualname__, path, len(tokenizer)) if path else id(tokenizer)
    key = (name, tok_key, vocab_size, stop_token_ids, max_rollback_tokens)
    with _lock:
        hit = _backends.get(key)
        if hit is not None:
            _backends.move_to_end(key)
            return hit[1]
        backend = get_backend(
            name,
            tokenizer,
            vocab_size=vocab_size,
            stop_token_ids=sorted(stop_token_ids) if stop_token_ids else None,
            max_rollback_tokens=max_rollback_tokens,
        )
        # the tokenizer is kept so its id is not reused by another object
        _backends[key] = (tokenizer, backend)
        if len(_backends) > _MAX_BACKENDS:
            _backends.popitem(last=False)
        return backend


def forget_backends() -> None:
    """Drop every shared backend (the engine's ``destroy``)."""
    with _lock:
        _backends.clear()


def note_grammar(request_id: str, grammar: Any) -> None:
    """Record ``grammar`` as the engine's grammar of ``request_id`` (weakly: it goes with the
    request)."""
    if _grammars.get(request_id) is not grammar:
        _grammars[request_id] = grammar


def live_grammar(request_id: str) -> Any:
    """The engine's grammar of ``request_id`` in this process, or ``None``."""
    return _grammars.get(request_id)
