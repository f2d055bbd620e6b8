"""vLLM's ``StructuredOutputBackend`` / ``StructuredOutputGrammar`` over any spec-grammar backend.

Interfaces: ``vllm/v1/structured_output/backend_types.py`` (vLLM 0.32 and 0.34, the same
methods). What vLLM calls, per engine step of a request (``vllm/v1/structured_output/__init__.py``):

- ``compile_grammar`` once per request, in a worker thread; an exception fails that request
  alone (finish reason ``error``, the message in the engine's log).
- with speculation: ``validate_tokens(drafts)`` cuts the draft chain at its first illegal token
  (0.34 keeps that token in the draft: the verifier rejects it);
  ``fill_bitmask`` fills one row per draft position, each followed by ``accept_tokens`` of that
  draft (on 0.34 also of the kept illegal token: refused, logged at debug level), plus the
  bonus row, then one ``rollback`` of the drafts (O(k) on our matchers); after sampling,
  ``accept_tokens`` with the accepted drafts and the bonus token.
- the bitmask is the one :meth:`SpecGrammarVllmBackend.allocate_token_bitmask` made: int32,
  shape ``(rows, ceil(vocab_size / 32))``, bit ``t % 32`` of word ``t // 32`` set = token ``t``
  allowed (xgrammar's packed layout, which vLLM's ``apply_grammar_bitmask`` applies).
"""

from __future__ import annotations

import json
import logging
import sys
from array import array
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
from spec_grammar.compose import matcher as compose_matcher
from spec_grammar.errors import GrammarSpecError, UnsupportedGrammarError
from spec_grammar.protocol import DEFAULT_MAX_ROLLBACK_TOKENS, GrammarBackend, SpecGrammar
from spec_grammar.specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex, with_strict

from ..post_check import log_if_invalid, needs_check, strict_from_env
from . import selected_backend, selected_whitespace
from .objects import close_objects, objects_closed
from .shared import forget_backends, note_grammar, shared_backend
from .structural_tag import structural_tag_to_tool_calls

__all__ = ["SpecGrammarVllmBackend", "SpecGrammarVllmGrammar", "to_spec", "validate_request"]

logger = logging.getLogger(__name__)

_PROBE_CALLER = "grammar_bitmask"
"""The ``StructuredOutputManager`` method (vLLM 0.32 and 0.34) whose ``accept_tokens`` calls try
draft tokens while filling their rows and are rolled back: a termination there is not the
output's end (the frame is read once per request, when its grammar terminates)."""

# characters with a meaning in the regex dialects of xgrammar, llguidance and outlines-core
_REGEX_META = frozenset("\\.^$|?*+()[]{}")


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def to_spec(
    request_type: StructuredOutputOptions,
    grammar_spec: str,
    *,
    whitespace: str = "flexible",
    closed_objects: bool = False,
) -> GrammarSpec:
    """Our spec for one vLLM structured-output request.

    JSON / JSON_OBJECT -> :class:`JsonSchema` (``whitespace`` as given; ``closed_objects``:
    objects closed as vLLM's xgrammar closes them, :func:`.objects.close_objects`); REGEX ->
    :class:`Regex`;
    GRAMMAR -> :class:`Lark` when vLLM's own ``grammar_is_likely_lark`` says so, else
    :class:`Ebnf` (GBNF); CHOICE (a JSON list of strings) -> a :class:`Regex` matching exactly one
    of them; STRUCTURAL_TAG (tool calls) -> a tagged :class:`~spec_grammar.specs.ToolCalls`
    (:mod:`.structural_tag`). Raises :class:`GrammarSpecError` for a malformed spec and
    :class:`UnsupportedGrammarError` for a structural tag of another shape.
    """
    if request_type is StructuredOutputOptions.JSON:
        spec = JsonSchema(grammar_spec, whitespace=whitespace)
        if closed_objects:
            closed = close_objects(spec.json_schema)
            if closed is not spec.json_schema:
                spec = JsonSchema(closed, whitespace=whitespace)
        return spec
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
    if request_type is StructuredOutputOptions.STRUCTURAL_TAG:
        return structural_tag_to_tool_calls(grammar_spec, whitespace=whitespace)
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

    One of our backends is used per distinct set of stop tokens (vLLM passes each request's
    EOS + ``stop_token_ids``), shared in the process with the drafter (:mod:`.shared`: one
    compile per spec for both). Matchers roll back at least as far as vLLM's
    ``num_speculative_tokens``. JSON whitespace: :func:`~spec_grammar.integrations.vllm
    .selected_whitespace` (vLLM's own rule unless ``$SPEC_GRAMMAR_VLLM_WHITESPACE`` says
    otherwise; an unknown value stops the engine at start); objects closed as vLLM's xgrammar
    closes them unless ``$SPEC_GRAMMAR_VLLM_OBJECTS=open`` (:mod:`.objects`).

    Keywords the backend would leave unenforced: with ``$SPEC_GRAMMAR_STRICT=1`` the request is
    refused when it compiles; otherwise it is served and its completed output checked
    (:mod:`spec_grammar.integrations.post_check`, :class:`SpecGrammarVllmGrammar`).
    """

    backend_name: str = field(init=False, default="xgrammar")

    def __post_init__(self) -> None:
        self.backend_name = selected_backend() or "xgrammar"
        cfg = self.vllm_config.structured_outputs_config
        self.whitespace = selected_whitespace(bool(cfg.disable_any_whitespace))
        self.closed_objects = objects_closed()
        self.strict = strict_from_env()
        spec_cfg = self.vllm_config.speculative_config
        num_spec = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0
        self.max_rollback_tokens = max(DEFAULT_MAX_ROLLBACK_TOKENS, (num_spec or 0) + 1)
        # built now for the usual stop set (EOS): a tokenizer the backend refuses fails at
        # engine start, and the first request does not pay for the vocabulary scan
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self._backend_for({eos} if isinstance(eos, int) else None)

    def _backend_for(self, stop_token_ids: set[int] | None) -> GrammarBackend:
        return shared_backend(
            self.backend_name,
            self.tokenizer,
            vocab_size=self.vocab_size,
            stop_token_ids=frozenset(stop_token_ids or ()),
            max_rollback_tokens=self.max_rollback_tokens,
        )

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
        failure; in strict mode (:attr:`strict`) an :class:`UnsupportedGrammarError` naming the
        keywords the backend would not enforce. Otherwise such keywords are logged as warnings,
        and the grammar checks its completed output against the request as written."""
        backend = self._backend_for(stop_token_ids)
        spec = to_spec(
            request_type,
            grammar_spec,
            whitespace=self.whitespace,
            closed_objects=self.closed_objects,
        )
        compiled = backend.compile(with_strict(spec, self.strict))
        for w in compiled.warnings:
            logger.warning("spec-grammar %s does not enforce %s", self.backend_name, w)
        check = None
        if needs_check(compiled):  # closing objects only narrows: check the schema as written
            check = to_spec(request_type, grammar_spec, whitespace=self.whitespace)
        return SpecGrammarVllmGrammar(
            backend, compiled, compose_matcher(backend, compiled), check=check
        )

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """int32 ``(max_num_seqs, ceil(vocab_size / 32))``, all tokens allowed."""
        return allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        forget_backends()


class SpecGrammarVllmGrammar(StructuredOutputGrammar):
    """One request's grammar state for vLLM, over one of our matchers
    (:class:`~spec_grammar.protocol.SpecGrammar`).

    ``check``: the request as written, when the backend left some of it unenforced. Then the
    accepted tokens are kept, and when the grammar terminates on a token vLLM committed (not on
    a draft token its bitmask pass tries, :data:`_PROBE_CALLER`, which it rolls back) the
    output is checked and a violation logged as one WARNING line
    (:func:`~spec_grammar.integrations.post_check.log_if_invalid`); :attr:`valid` holds the
    verdict (None until then, or without ``check``)."""

    def __init__(
        self,
        backend: GrammarBackend,
        compiled: Any,
        matcher: SpecGrammar,
        *,
        check: GrammarSpec | None = None,
    ):
        self._backend = backend
        self._compiled = compiled
        self.matcher = matcher
        # set by fill_bitmask, cleared by the next call: vLLM's bitmask pass is the one caller
        # that accepts a draft token right after filling its row
        self._probing = False
        self._check = check
        self._path: array | None = array("i") if check is not None else None
        self.valid: bool | None = None

    @property
    def backend(self) -> GrammarBackend:
        """Our backend that compiled this grammar."""
        return self._backend

    @property
    def compiled(self) -> Any:
        """The compiled grammar (shared with the drafter: fork matchers with
        ``compose_matcher(backend, compiled)``)."""
        return self._compiled

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by ``tokens``. True when every token was accepted, or the grammar terminated
        on a stop token and the rest were ignored (vLLM's xgrammar backend does the same);
        False when one was refused, with the state unchanged (vLLM 0.34's contract).

        A refused single token right after :meth:`fill_bitmask` is vLLM's bitmask pass
        reaching the first illegal token of a cut draft (vLLM 0.34 keeps it for the verifier
        to reject): expected, logged at debug level. Any other refusal means the engine
        committed a token outside the grammar: a warning."""
        probing, self._probing = self._probing, False
        note_grammar(request_id, self)
        if self.matcher.is_terminated():
            return True
        n = self.matcher.accept_tokens(tokens)
        done = self.matcher.is_terminated()
        if n == len(tokens) or done:
            if self._path is not None:
                self._path.extend(tokens[:n])
                if done and sys._getframe(1).f_code.co_name != _PROBE_CALLER:
                    self.valid = log_if_invalid(
                        self._backend, self._check, self._compiled.warnings, self._path, request_id
                    )
            return True
        if n:
            self.matcher.rollback(n)
        expected = probing and len(tokens) == 1
        logger.log(
            logging.DEBUG if expected else logging.WARNING,
            "request %s: spec-grammar %s refused token %d after %d accepted%s",
            request_id,
            self._backend.name,
            tokens[n],
            n,
            " (a cut draft's first illegal token)" if expected else "; state unchanged",
        )
        return False

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts (ending at a stop token or a
        ``-1`` padding id); the state is unchanged."""
        return tokens[: self.matcher.validate_tokens(tokens)]

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens, termination included; O(num_tokens)."""
        self._probing = False
        self.matcher.rollback(num_tokens)
        if self._path is not None and num_tokens:
            del self._path[-num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write the allowed next tokens into row ``batch_index`` of ``bitmask`` (the layout of
        :meth:`SpecGrammarVllmBackend.allocate_token_bitmask`)."""
        self.matcher.fill_next_token_bitmask(bitmask, batch_index)
        self._probing = True

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self._probing = False
        self.matcher = compose_matcher(self._backend, self._compiled)
        if self._path is not None:
            self._path = array("i")
        self.valid = None
