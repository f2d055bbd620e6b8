"""vLLM's ``StructuredOutputBackend`` / ``StructuredOutputGrammar`` over any spec-grammar backend.

Interfaces: ``vllm/v1/structured_output/backend_types.py`` (vLLM 0.32). What vLLM calls, per
engine step of a request (``vllm/v1/structured_output/__init__.py``):

- ``compile_grammar`` once per request, in a worker thread; an exception fails that request
  alone (finish reason ``error``, the message in the engine's log).
- with speculation: ``validate_tokens(drafts)`` cuts the draft chain at its first illegal token;
  ``fill_bitmask`` fills one row per draft position, each followed by ``accept_tokens`` of that
  draft, plus the bonus row, then one ``rollback`` of the drafts (O(k) on our matchers);
  after sampling, ``accept_tokens`` with the accepted drafts and the bonus token.
- the bitmask is the one :meth:`SpecGrammarVllmBackend.allocate_token_bitmask` made: int32,
  shape ``(rows, ceil(vocab_size / 32))``, bit ``t % 32`` of word ``t // 32`` set = token ``t``
  allowed (xgrammar's packed layout, which vLLM's ``apply_grammar_bitmask`` applies).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from vllm.v1.structured_output.request import get_structured_output_key
from vllm.v1.structured_output.utils import grammar_is_likely_lark

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.errors import GrammarSpecError, UnsupportedGrammarError
from spec_grammar.protocol import DEFAULT_MAX_ROLLBACK_TOKENS, GrammarBackend, SpecGrammar
from spec_grammar.registry import get_backend
from spec_grammar.specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex

from . import selected_backend

__all__ = ["SpecGrammarVllmBackend", "SpecGrammarVllmGrammar", "to_spec", "validate_request"]

logger = logging.getLogger(__name__)

# characters with a meaning in the regex dialects of xgrammar, llguidance and outlines-core
_REGEX_META = frozenset("\\.^$|?*+()[]{}")
# backends kept per distinct set of stop tokens (requests with their own stop_token_ids)
_MAX_BACKENDS = 4


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def to_spec(
    request_type: StructuredOutputOptions, grammar_spec: str, *, whitespace: str = "spaced"
) -> GrammarSpec:
    """Our spec for one vLLM structured-output request.

    JSON / JSON_OBJECT -> :class:`JsonSchema` (``whitespace`` as given); REGEX -> :class:`Regex`;
    GRAMMAR -> :class:`Lark` when vLLM's own ``grammar_is_likely_lark`` says so, else
    :class:`Ebnf` (GBNF); CHOICE (a JSON list of strings) -> a :class:`Regex` matching exactly one
    of them. Raises :class:`GrammarSpecError` for a malformed spec and
    :class:`UnsupportedGrammarError` for STRUCTURAL_TAG.
    """
    if request_type is StructuredOutputOptions.JSON:
        return JsonSchema(grammar_spec, whitespace=whitespace)
    if request_type is StructuredOutputOptions.JSON_OBJECT:
        return JsonSchema({"type": "object"}, whitespace=whitespace)
    if request_type is StructuredOutputOptions.REGEX:
        return Regex(grammar_spec)
    if request_type is StructuredOutputOptions.GRAMMAR:
        return Lark(grammar_spec) if grammar_is_likely_lark(grammar_spec) else Ebnf(grammar_spec)
    if request_type is StructuredOutputOptions.CHOICE:
        try:
            choices = json.loads(grammar_spec)
        except json.JSONDecodeError as e:
            raise GrammarSpecError(f"choice is not a JSON list of strings: {e}") from None
        if not isinstance(choices, list) or not choices:
            raise GrammarSpecError(f"choice must be a non-empty list, got {grammar_spec!r}")
        return Regex("(" + "|".join(_regex_literal(str(c)) for c in choices) + ")")
    raise UnsupportedGrammarError(
        f"spec-grammar's vLLM backend does not serve {request_type.name} requests",
        backend="vllm",
        reason=f"{request_type.name} is not supported",
    )


def validate_request(sampling_params: Any, tokenizer: Any = None) -> None:
    """The front end's check for requests to our backend (replaces vLLM's
    ``validate_guidance_grammar``): the cheap checks that need no tokenizer (the spec parses,
    the request type is one we serve). Everything else is decided when the engine compiles, so a
    schema our backend refuses fails that request alone, not the whole ``LLM.generate`` call
    (a front-end error aborts every request of the call). Raises ``VLLMValidationError``."""
    params = sampling_params.structured_outputs
    if params is None:
        return
    request_type, grammar_spec = get_structured_output_key(params)
    try:
        to_spec(request_type, grammar_spec)
    except (GrammarSpecError, UnsupportedGrammarError) as e:
        raise VLLMValidationError(f"spec-grammar: {e}") from e


@dataclass
class SpecGrammarVllmBackend(StructuredOutputBackend):
    """vLLM engine-level backend running the spec-grammar backend named by
    ``$SPEC_GRAMMAR_VLLM_BACKEND`` (default ``xgrammar``) for vLLM's tokenizer and logits width
    ``vocab_size``.

    One of our backends is built per distinct set of stop tokens (vLLM passes each request's
    EOS + ``stop_token_ids``); each keeps its compile cache. Matchers roll back at least as
    far as vLLM's ``num_speculative_tokens``.
    """

    backend_name: str = field(init=False, default="xgrammar")

    def __post_init__(self) -> None:
        self.backend_name = selected_backend() or "xgrammar"
        cfg = self.vllm_config.structured_outputs_config
        self.whitespace = "compact" if cfg.disable_any_whitespace else "spaced"
        spec_cfg = self.vllm_config.speculative_config
        num_spec = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0
        self.max_rollback_tokens = max(DEFAULT_MAX_ROLLBACK_TOKENS, num_spec + 1)
        self._backends: dict[frozenset[int], GrammarBackend] = {}
        self._lock = threading.Lock()  # vLLM compiles in a thread pool
        # built now for the usual stop set (EOS): a tokenizer the backend refuses fails at
        # engine start, and the first request does not pay for the vocabulary scan
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self._backend_for({eos} if isinstance(eos, int) else None)

    def _backend_for(self, stop_token_ids: set[int] | None) -> GrammarBackend:
        key = frozenset(stop_token_ids or ())
        with self._lock:
            backend = self._backends.get(key)
            if backend is None:
                if len(self._backends) >= _MAX_BACKENDS:
                    self._backends.pop(next(k for k in self._backends if k))
                backend = get_backend(
                    self.backend_name,
                    self.tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=sorted(key) if key else None,
                    max_rollback_tokens=self.max_rollback_tokens,
                )
                self._backends[key] = backend
            return backend

    def compile_grammar(
        self,
        request_type: StructuredOutputOptions,
        grammar_spec: str,
        stop_token_ids: set[int] | None = None,
    ) -> SpecGrammarVllmGrammar:
        """Compile one request's constraint. Raises our typed errors
        (:class:`~spec_grammar.errors.GrammarCompileError`,
        :class:`~spec_grammar.errors.UnsupportedGrammarError`,
        :class:`~spec_grammar.errors.GrammarSpecError`), which vLLM turns into that request's
        failure. Keywords the backend compiles but does not enforce are logged as warnings."""
        backend = self._backend_for(stop_token_ids)
        spec = to_spec(request_type, grammar_spec, whitespace=self.whitespace)
        compiled = backend.compile(spec)
        for w in compiled.warnings:
            logger.warning("spec-grammar %s does not enforce %s", self.backend_name, w)
        return SpecGrammarVllmGrammar(backend, compiled, backend.matcher(compiled))

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """int32 ``(max_num_seqs, ceil(vocab_size / 32))``, all tokens allowed."""
        return allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        with self._lock:
            self._backends.clear()


class SpecGrammarVllmGrammar(StructuredOutputGrammar):
    """One request's grammar state for vLLM, over one of our matchers
    (:class:`~spec_grammar.protocol.SpecGrammar`)."""

    def __init__(self, backend: GrammarBackend, compiled: Any, matcher: SpecGrammar):
        self._backend = backend
        self._compiled = compiled
        self.matcher = matcher

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by ``tokens``. True when every token was accepted, or the grammar terminated
        on a stop token and the rest were ignored (vLLM's xgrammar backend does the same);
        False, with the state advanced over the accepted prefix, when one was refused."""
        if self.matcher.is_terminated():
            return True
        n = self.matcher.accept_tokens(tokens)
        if n == len(tokens) or self.matcher.is_terminated():
            return True
        logger.error(
            "request %s: spec-grammar %s refused token %d after %d accepted",
            request_id,
            self._backend.name,
            tokens[n],
            n,
        )
        return False

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts (ending at a stop token or a
        ``-1`` padding id); the state is unchanged."""
        return tokens[: self.matcher.validate_tokens(tokens)]

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens, termination included; O(num_tokens)."""
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write the allowed next tokens into row ``batch_index`` of ``bitmask`` (the layout of
        :meth:`SpecGrammarVllmBackend.allocate_token_bitmask`)."""
        self.matcher.fill_next_token_bitmask(bitmask, batch_index)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher = self._backend.matcher(self._compiled)
