"""Grammar-aware n-gram drafting inside vLLM 0.34: a ``BaseSpeculator`` registered through
vLLM's speculator registry (:mod:`.v0_34`, ``speculative_config.method="spec_grammar"``).

vLLM's own n-gram speculator (``NgramGPUSpeculator``, Triton) proposes ``k`` tokens per request
without the grammar; the scheduler then cuts each draft after its first token the grammar
refuses. :class:`GrammarNgramSpeculator` runs that speculator and, for each request with a
grammar of ours, replaces its row by the legal prefix of the n-gram draft extended with the
grammar-forced tokens after it (:mod:`.drafting`), ``-1`` padded (vLLM's padding id for
drafts). Drafts are verified by the target as any others, so outputs do not change.

Where the constraint comes from, without the call stack: vLLM 0.34 hands a speculator token
ids only (``req_states``: ``all_token_ids``, ``prompt_len``, ``total_len``; the batch's
``req_ids``). The structured-output manager builds each request's grammar through our backend
(vLLM's name ``guidance`` with ``$SPEC_GRAMMAR_VLLM_BACKEND`` set), and the grammar object
records its request id when the manager first advances it (:func:`.shared.note_grammar`). With
one GPU, vLLM 0.34 runs the scheduler and the model runner in the engine process, so the
speculator finds the engine's grammar by request id (:func:`.shared.live_grammar`) and forks
its own matcher from the engine's compiled grammar: no second compile. A request whose grammar
is not ours (vLLM's own backends), not yet advanced (its first step after prefill), or not in
this process (several worker processes) gets vLLM's n-gram draft unchanged; a failure for one
request is logged once and that request gets n-gram drafts from then on.

Cost: one device-to-host copy of the batch's drafts and token counts per step with grammar
rows (the matchers run on the CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from spec_grammar.compose import matcher as compose_matcher

from . import selected_backend
from .drafting import RequestGrammar, grammar_draft
from .shared import live_grammar

__all__ = ["GrammarDrafts", "GrammarNgramSpeculator"]

logger = logging.getLogger(__name__)


class GrammarDrafts:
    """The per-request bookkeeping of the speculator, apart from vLLM's tensors.

    Args:
        k: ``num_speculative_tokens``.
        grammar_of: request id -> the engine's grammar object (``.backend``, ``.compiled``:
            :class:`~.backend.SpecGrammarVllmGrammar`) or ``None``.
    """

    def __init__(self, k: int, grammar_of: Callable[[str], Any] = live_grammar):
        self.k = k
        self._grammar_of = grammar_of
        self._states: dict[str, RequestGrammar] = {}
        self._failed: set[str] = set()  # on n-gram drafts after an error (logged once)

    def rows_with_grammar(self, req_ids: Sequence[str]) -> list[int]:
        """Batch rows whose request has a grammar of ours in this process."""
        return [
            i
            for i, r in enumerate(req_ids)
            if r not in self._failed and self._grammar_of(r) is not None
        ]

    def _matcher(self, req_id: str, output: np.ndarray) -> Any:
        grammar = self._grammar_of(req_id)
        state = self._states.get(req_id)
        if state is None or state.key is not grammar.compiled or not state.advance(output):
            state = RequestGrammar(
                grammar.compiled, compose_matcher(grammar.backend, grammar.compiled), []
            )
            if not state.advance(output):
                raise ValueError(
                    f"our grammar refuses a token of the request's committed output "
                    f"({len(output)} tokens)"
                )
            self._states[req_id] = state
        return state.matcher

    def refine(
        self,
        drafts: np.ndarray,
        req_ids: Sequence[str],
        rows: Sequence[int],
        outputs: Sequence[np.ndarray],
        k: int | None = None,
    ) -> np.ndarray:
        """Grammar drafts for ``rows``: ``drafts`` (``(num_reqs, K)`` int64, vLLM's n-gram
        drafts, rows in ``req_ids`` order) with row ``rows[j]`` replaced by the grammar draft
        after the committed output ``outputs[j]`` (``(n,)`` int, ``n >= 1``), ``-1`` padded;
        at most ``k`` (default :attr:`k`) tokens. A request that failed before keeps its
        n-gram row. Returns a new array."""
        out = drafts.copy()
        k = self.k if k is None else min(k, self.k)
        for row, output in zip(rows, outputs):
            req_id = req_ids[row]
            if req_id in self._failed:
                continue
            try:
                matcher = self._matcher(req_id, output)
                draft = grammar_draft(matcher, int(output[-1]), out[row, :k].tolist(), k)
            except Exception:
                self._failed.add(req_id)
                self._states.pop(req_id, None)
                logger.exception(
                    "spec-grammar drafter: request %s falls back to n-gram drafts", req_id
                )
                continue
            out[row] = -1
            out[row, : len(draft)] = draft
        return out

    def forget(self, req_ids: set[str]) -> None:
        """Drop finished requests."""
        for r in req_ids:
            self._states.pop(r, None)
        self._failed.difference_update(req_ids)


class GrammarNgramSpeculator(BaseSpeculator):
    """vLLM 0.34 speculator: vLLM's n-gram drafts, grammar-cut and extended with forced tokens
    for requests on our backend (see the module docstring).

    Args:
        vllm_config, device, req_states: what vLLM's ``init_speculator`` passes.
        ngram: the n-gram speculator whose drafts are refined; vLLM's ``NgramGPUSpeculator``
            for the same arguments when ``None`` (needs Triton).
    """

    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any, ngram: Any = None):
        if ngram is None:
            from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

            ngram = NgramGPUSpeculator(vllm_config, device, req_states)
        self.ngram = ngram
        self.req_states = req_states
        self.device = device
        self.grammar = GrammarDrafts(vllm_config.speculative_config.num_speculative_tokens)
        self.enabled = True
        if vllm_config.structured_outputs_config.reasoning_parser:
            # the engine's grammar starts after the reasoning, which the drafter does not see
            logger.warning(
                "spec-grammar drafter: a reasoning parser is set; n-gram drafts for every request"
            )
            self.enabled = False
        elif selected_backend() is None:
            logger.warning(
                "spec-grammar drafter: SPEC_GRAMMAR_VLLM_BACKEND is unset, so no request runs "
                "on our backend; n-gram drafts for every request"
            )
            self.enabled = False

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        self.ngram.init_cudagraph_manager(cudagraph_mode)

    def capture(self) -> None:
        self.ngram.capture()

    def add_request(self, req_index: int) -> None:
        self.ngram.add_request(req_index)

    def on_requests_finished(self, finished_req_ids: set[str]) -> None:
        self.grammar.forget(finished_req_ids)
        self.ngram.on_requests_finished(finished_req_ids)

    def reset_state(self) -> None:
        self.ngram.reset_state()

    def update_max_model_len(self, max_model_len: int) -> None:
        self.ngram.update_max_model_len(max_model_len)

    def committed_outputs(self, req_ids: Sequence[str], rows: Sequence[int]) -> list[np.ndarray]:
        """Each row's committed output tokens, read from ``req_states`` (prompt excluded)."""
        rs = self.req_states
        idx = [rs.req_id_to_index[req_ids[r]] for r in rows]
        totals = rs.total_len.gpu[idx].cpu().numpy()
        outputs = []
        for i, total in zip(idx, totals):
            start = int(rs.prompt_len.np[i])
            outputs.append(rs.all_token_ids.gpu[i, start : int(total)].cpu().numpy())
        return outputs

    def propose(
        self,
        input_batch: Any,
        attn_metadata: Any,
        slot_mappings: Any,
        last_hidden_states: torch.Tensor,
        aux_hidden_states: Any,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state: Any = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: Any = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        """vLLM's n-gram drafts (``(num_reqs, k)`` int64 on the device), the rows of requests
        on our backend replaced by grammar drafts. Arguments: ``BaseSpeculator.propose``'s
        (``num_sampled``: ``(num_reqs,)`` tokens committed this step, 0 while in prefill)."""
        drafts = self.ngram.propose(
            input_batch,
            attn_metadata,
            slot_mappings,
            last_hidden_states,
            aux_hidden_states,
            num_sampled,
            num_rejected,
            last_sampled,
            next_prefill_tokens,
            temperature,
            seeds,
            dp_sync_state=dp_sync_state,
            dummy_run=dummy_run,
            skip_attn_for_dummy_run=skip_attn_for_dummy_run,
            mm_inputs=mm_inputs,
            is_profile=is_profile,
            num_speculative_tokens=num_speculative_tokens,
        )
        if not self.enabled or dummy_run or is_profile:
            return drafts
        req_ids = input_batch.req_ids
        rows = self.grammar.rows_with_grammar(req_ids)
        if rows:
            sampled = num_sampled.cpu().numpy()
            rows = [r for r in rows if sampled[r] > 0]  # rows in prefill draft nothing
        if not rows:
            return drafts
        outputs = self.committed_outputs(req_ids, rows)
        keep = [j for j, o in enumerate(outputs) if len(o)]
        refined = self.grammar.refine(
            drafts.cpu().numpy(),
            req_ids,
            [rows[j] for j in keep],
            [outputs[j] for j in keep],
            num_speculative_tokens,
        )
        return torch.from_numpy(refined).to(drafts.device)
