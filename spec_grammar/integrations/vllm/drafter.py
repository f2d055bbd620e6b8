"""Grammar-aware n-gram drafting inside vLLM (0.32): a ``custom_class`` speculative proposer.

vLLM's own n-gram drafter proposes tokens without the grammar; the engine then cuts each draft
at its first token the grammar refuses (``validate_tokens``), so the cut part is lost, and
where the grammar forces a continuation (JSON keys of required properties, ``", "``, a closing
brace) but the text has not occurred before, nothing is drafted at all.
:class:`GrammarNgramProposer` drafts, per request with a structured-output constraint, the
part of vLLM's n-gram draft the grammar accepts, extended with the grammar-forced tokens that
follow it (jump-forward as drafts, :mod:`spec_grammar.worker.drafters.forced`), up to
``num_speculative_tokens``. Requests without a constraint get vLLM's n-gram draft unchanged.
Drafts are verified by the target as any others, so outputs do not change.

How it finds the grammar without patching vLLM. vLLM calls a ``custom_class`` proposer with
token ids per batch row only (``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)``), and the engine's grammar state lives in the scheduler. But the proposer
is built inside the model runner's constructor (``GPUModelRunner.__init__`` ->
``create_custom_proposer(vllm_config)``, the CPU runner included), so the constructor finds
that runner on its caller's stack. At each step row ``i`` is request
``runner.input_batch.req_ids[i]``, whose ``runner.requests[req_id].sampling_params
.structured_outputs`` is the constraint; this proposer compiles it with the same class the
engine runs for our backend (:class:`~.backend.SpecGrammarVllmBackend`, backend named by
``$SPEC_GRAMMAR_VLLM_BACKEND``, default xgrammar), whose backends are shared in the process
with the engine's (:mod:`.shared`: with the scheduler and the runner in one engine process, as
vLLM runs one device, a spec is compiled once for both), and
keeps one matcher per request holding exactly the committed output tokens
(``token_ids_cpu[i, num_prompt_tokens:num_tokens_no_spec[i]]``, replayed since the last step;
rejected drafts never enter it, and a history that no longer extends the replayed one is
replayed from scratch).

Enable::

    LLM(model, structured_outputs_config={"backend": "guidance"},
        speculative_config={"method": "custom_class",
                            "model": "spec_grammar.integrations.vllm.drafter.GrammarNgramProposer",
                            "num_speculative_tokens": 4})

vLLM sets ``prompt_lookup_min/max`` to 0 for ``custom_class``, so the n-gram sizes come from
``$SPEC_GRAMMAR_VLLM_NGRAM`` (``MIN:MAX``, default ``4:4``, vLLM's ``prompt_lookup_max=4``).
Under vLLM's own grammar backends the drafts follow our grammar for the same spec (for JSON,
the same whitespace rule as vLLM's by default): still legal drafts. A failure for one request (its spec does not compile
here, a committed token our matcher refuses) is logged once and that request falls back to
plain n-gram drafts; the engine never fails because of this proposer. With a reasoning parser
configured (the engine's grammar starts after the reasoning, which this proposer does not
see), every request gets plain n-gram drafts.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from typing import Any

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.structured_output.request import get_structured_output_key

from spec_grammar.protocol import SpecGrammar

from .drafting import RequestGrammar, grammar_draft

__all__ = ["NGRAM_ENV", "GrammarNgramProposer", "RequestGrammar", "find_model_runner"]

NGRAM_ENV = "SPEC_GRAMMAR_VLLM_NGRAM"
"""``MIN:MAX`` n-gram sizes of the proposer's n-gram lookup (vLLM's ``prompt_lookup_min/max``)."""
_DEFAULT_NGRAM = (4, 4)
# stack frames searched above the constructor for the model runner (create_custom_proposer is
# one frame up, the runner's __init__ two)
_RUNNER_SEARCH_DEPTH = 8

logger = logging.getLogger(__name__)


def find_model_runner(depth: int = _RUNNER_SEARCH_DEPTH) -> Any:
    """The vLLM ``GPUModelRunner`` (or subclass, e.g. ``CPUModelRunner``) whose constructor is
    on the caller's stack, or ``None``. Read-only: nothing of vLLM is changed."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, GPUModelRunner):
            return owner
        frame = frame.f_back
    return None


def _ngram_sizes() -> tuple[int, int]:
    raw = os.environ.get(NGRAM_ENV, "").strip()
    if not raw:
        return _DEFAULT_NGRAM
    try:
        lo, hi = (int(x) for x in raw.split(":"))
    except ValueError:
        raise ValueError(f"{NGRAM_ENV}={raw!r}: expected MIN:MAX, e.g. 4:4") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{NGRAM_ENV}={raw!r}: need 1 <= MIN <= MAX")
    return lo, hi


class GrammarNgramProposer:
    """vLLM ``custom_class`` proposer: grammar-legal n-gram drafts extended with
    grammar-forced tokens (see the module docstring).

    Args:
        vllm_config: the engine's ``VllmConfig`` (vLLM passes it).
        runner: the model runner whose batch this proposer drafts for; found on the
            constructor's caller stack when ``None`` (how vLLM builds it). Without one, every
            request gets plain n-gram drafts (logged once).
    """

    def __init__(self, vllm_config: Any, runner: Any = None):
        spec_cfg = vllm_config.speculative_config
        self.k = spec_cfg.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vllm_config = vllm_config
        # vLLM's NgramProposer reads prompt_lookup_min/max, which custom_class zeroes
        ngram_cfg = copy.copy(vllm_config)
        ngram_cfg.speculative_config = copy.copy(spec_cfg)
        lo, hi = _ngram_sizes()
        ngram_cfg.speculative_config.prompt_lookup_min = lo
        ngram_cfg.speculative_config.prompt_lookup_max = hi
        self.ngram = NgramProposer(ngram_cfg)
        self.runner = runner if runner is not None else find_model_runner()
        if self.runner is None:
            logger.warning(
                "spec-grammar GrammarNgramProposer: no vLLM model runner found; plain n-gram "
                "drafts for every request"
            )
        elif vllm_config.structured_outputs_config.reasoning_parser:
            # the engine starts the grammar where the reasoning ends, which the drafter does
            # not see: grammar drafting would refuse the reasoning text
            logger.warning(
                "spec-grammar GrammarNgramProposer: a reasoning parser is set; plain n-gram "
                "drafts for every request"
            )
            self.runner = None
        self._states: dict[str, RequestGrammar] = {}
        self._failed: set[str] = set()  # requests on plain n-gram after an error (logged)
        # built now (the backend's vocabulary scan takes seconds): not at the first request
        self._backend = self._grammar_backend() if self.runner is not None else None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load (vLLM calls this with the target model)."""

    # -- grammar state ---------------------------------------------------------------------
    def _grammar_backend(self) -> Any:
        """The engine's backend class for our backend, over vLLM's tokenizer of the model."""
        from vllm.tokenizers import cached_tokenizer_from_config

        from .backend import SpecGrammarVllmBackend

        model_config = self.vllm_config.model_config
        return SpecGrammarVllmBackend(
            self.vllm_config,
            tokenizer=cached_tokenizer_from_config(model_config=model_config),
            vocab_size=model_config.get_vocab_size(),
        )

    def _matcher_for(self, req_id: str, output: np.ndarray) -> SpecGrammar | None:
        """The request's matcher after its committed ``output``, or ``None`` for a request
        without a constraint, or one on plain n-gram after an error."""
        if req_id in self._failed:
            return None
        req = self.runner.requests.get(req_id)
        params = getattr(getattr(req, "sampling_params", None), "structured_outputs", None)
        if params is None:
            return None
        key = get_structured_output_key(params)
        state = self._states.get(req_id)
        if state is None or state.key != key or not state.advance(output):
            grammar = self._backend.compile_grammar(
                key[0], key[1], req.sampling_params.all_stop_token_ids
            )
            state = RequestGrammar(key, grammar.matcher, [])
            if not state.advance(output):
                raise ValueError(
                    f"our grammar refuses a token of the request's committed output "
                    f"({len(output)} tokens)"
                )
            self._states[req_id] = state
        return state.matcher

    # -- vLLM's interface ------------------------------------------------------------------
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft tokens per batch row (vLLM 0.32's ``custom_class`` call).

        Args:
            sampled_token_ids: per row, the tokens committed this step (empty for a row still
                in prefill: no draft).
            num_tokens_no_spec: ``(max_num_reqs,)`` int32, committed tokens per row (prompt
                included).
            token_ids_cpu: ``(max_num_reqs, max_model_len)`` int32, per row prompt + committed
                output tokens.
            slot_mappings: unused.

        Returns: per row, up to ``num_speculative_tokens`` draft token ids.
        """
        drafts = self.ngram.propose(self.k, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        if self.runner is None:
            return drafts
        try:
            batch = self.runner.input_batch
            req_ids = batch.req_ids
            live = self.runner.requests
        except AttributeError:  # a vLLM whose runner keeps its batch elsewhere
            logger.exception(
                "spec-grammar GrammarNgramProposer: the model runner has no input_batch / "
                "requests; plain n-gram drafts for every request"
            )
            self.runner = None
            return drafts
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled or row >= len(req_ids):
                continue
            req_id = req_ids[row]
            total = int(num_tokens_no_spec[row])
            k = min(self.k, self.max_model_len - total)
            try:
                output = token_ids_cpu[row, int(batch.num_prompt_tokens[row]) : total]
                matcher = self._matcher_for(req_id, output)
                if matcher is not None:
                    drafts[row] = grammar_draft(matcher, int(output[-1]), drafts[row], k)
            except Exception:
                # one request's failure: plain n-gram for it from now on, logged once
                self._failed.add(req_id)
                self._states.pop(req_id, None)
                logger.exception(
                    "spec-grammar drafter: request %s falls back to plain n-gram drafts", req_id
                )
        for req_id in [r for r in self._states if r not in live]:
            del self._states[req_id]
        self._failed.intersection_update(live)
        return drafts
