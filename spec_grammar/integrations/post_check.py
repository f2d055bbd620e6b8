"""Valid or told inside a serving engine: strict refusal, and the post-check of a completed
output that its backend could not fully enforce (``docs/valid-or-told.md``).

A backend may compile a schema and leave keywords unenforced (``uniqueItems``, ``if`` /
``then``, ...; :attr:`CompiledGrammar.warnings <spec_grammar.compile.CompiledGrammar.warnings>`).
Inside vLLM and SGLang our grammar objects cannot change what the engine returns, so:

- with :data:`STRICT_ENV` set such a request is refused when it compiles (the engine's own
  error for a grammar that does not compile, naming the keywords);
- otherwise the grammar object checks the output when its grammar terminates
  (:func:`~spec_grammar.output_check.check_output` on the request as written, the accepted
  tokens detokenized by the engine's tokenizer) and logs one WARNING line for an invalid one.

Only such requests pay for the check: one compiled without warnings is enforced in full and
its terminated output valid by construction (what :mod:`spec_grammar.routing` assumes when it
routes to a backend that enforces every keyword).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from ..output_check import check_output
from ..protocol import GrammarBackend
from ..specs import Ebnf, GrammarSpec, Lark

__all__ = ["STRICT_ENV", "strict_from_env", "needs_check", "log_if_invalid"]

STRICT_ENV = "SPEC_GRAMMAR_STRICT"
"""Environment variable: ``1`` refuses, when it compiles, every request whose grammar the
backend would leave a keyword of unenforced (vLLM and SGLang plugins); unset or ``0``: served,
its completed output checked and a violation logged."""

logger = logging.getLogger(__name__)


def strict_from_env(*aliases: str) -> bool:
    """Whether :data:`STRICT_ENV` (or one of the older variable names ``aliases``) is ``1`` /
    ``true``. Raises ``ValueError`` naming the variable for a value other than ``0`` / ``1`` /
    ``true`` / ``false`` / empty (read at engine start: a typo stops the engine rather than
    serving unchecked)."""
    on = False
    for name in (STRICT_ENV, *aliases):
        raw = os.environ.get(name, "").strip().lower()
        if raw not in ("", "0", "1", "true", "false"):
            raise ValueError(f"{name}={raw!r}: expected 1 (strict) or 0")
        on = on or raw in ("1", "true")
    return on


def needs_check(compiled: Any) -> bool:
    """Whether a request compiled as ``compiled`` (a :class:`~spec_grammar.compile
    .CompiledGrammar`) must have its output checked: its backend declared something of it
    unenforced, and an oracle exists for its kind (not EBNF / Lark, whose grammar is their
    only definition: :func:`~spec_grammar.output_check.check_output`)."""
    return bool(compiled.warnings) and not isinstance(compiled.spec, (Ebnf, Lark))


def log_if_invalid(
    backend: GrammarBackend,
    spec: GrammarSpec,
    warnings: Sequence[str],
    tokens: Sequence[int],
    request: str,
) -> bool | None:
    """Check the completed output ``tokens`` (the grammar's accepted token ids, stop tokens
    included) against ``spec`` as the user wrote it; on a violation log one WARNING line
    naming ``request`` (the engine's request id, or a description), ``valid=false``, the
    backend, what it left unenforced (``warnings``) and each violation as ``path: message``.
    Returns ``valid`` (None: no oracle for ``spec``). Never raises on any output."""
    info = backend.tokenizer_info
    stop = frozenset(info.stop_token_ids)
    ids = [int(t) for t in tokens if int(t) not in stop]
    text = info.hf_tokenizer.decode(ids, skip_special_tokens=True)
    valid, violations = check_output(spec, text)
    if valid is False:
        logger.warning(
            "spec-grammar: request %s: valid=false under its request as written "
            "(backend %s, which does not enforce %s): %s",
            request,
            backend.name,
            "; ".join(w.split(":", 1)[0] for w in warnings) or "all of it",
            "; ".join(f"{v.path or '/'}: {v.message}" for v in violations),
        )
    return valid
