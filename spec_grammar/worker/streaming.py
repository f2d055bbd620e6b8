"""Streaming: a run's committed text as chunks, one per request per step (a whole accepted
path at a time), in the shape of OpenAI's streamed chat-completion deltas.

:class:`TextStream` is an ``on_step`` callback for :meth:`SpecWorker.run
<spec_grammar.worker.engine.SpecWorker.run>`: after each step it decodes each request's
committed output and hands the text not sent yet to ``on_chunk``; a request's last chunk
carries its ``finish_reason`` and ``valid`` (the output checked against its request, as in
its :class:`RequestResult`, where a ``result_of`` is given). Text that could still change is
held back: an incomplete UTF-8 sequence at the end (decoded as U+FFFD) and, with stop strings,
the last ``max(len(stop)) - 1`` characters (a stop string may still complete there; the output
is cut before it). The chunks of a request join to its :attr:`RequestResult.text`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .request import FinishReason, RequestResult, RequestState, finish_reason_of

__all__ = ["StreamChunk", "TextStream", "committed_text"]


@dataclass(frozen=True)
class StreamChunk:
    """One request's newly committed text (OpenAI's ``delta.content``); ``finish_reason`` and
    ``valid`` are set on its last chunk only (None before). ``valid``: as
    :attr:`RequestResult.valid` (False: the output breaks its request; None: no check applies
    or the output did not complete)."""

    rid: str
    text: str
    finish_reason: FinishReason | None = None
    valid: bool | None = None


def committed_text(tokenizer: Any, st: RequestState) -> str:
    """``st``'s output text as its result reports it: cut before the first stop string when a
    stop string ended it."""
    text = tokenizer.decode(st.output_ids)
    if st.finish_reason == "stop_string":
        cuts = [text.find(s) for s in st.sampling.stop if s and s in text]
        if cuts:
            text = text[: min(cuts)]
    return text


class TextStream:
    """An ``on_step`` callback sending each request's new committed text to ``on_chunk``.

    Call :meth:`close` with the run's results afterwards: requests that ended before any step
    (a grammar that failed to compile, a prompt at its token budget) get their one chunk there.
    ``result_of``: a finished state's :class:`RequestResult`
    (:meth:`~spec_grammar.worker.engine.SpecWorker.result`), for the last chunk's ``valid``
    and ``finish_reason``; without it ``valid`` stays None until :meth:`close`.
    """

    def __init__(
        self,
        tokenizer: Any,
        on_chunk: Callable[[StreamChunk], None],
        result_of: Callable[[RequestState], RequestResult] | None = None,
    ):
        self.tokenizer = tokenizer
        self.on_chunk = on_chunk
        self.result_of = result_of
        self._sent: dict[str, int] = {}  # characters sent per request
        self._done: set[str] = set()

    def __call__(self, _stats: Any, states: Sequence[RequestState]) -> None:
        for st in states:
            rid = st.rid
            # a bad id (unhashable even) ends its request: close() sends its chunk
            if not isinstance(rid, str) or rid in self._done:
                continue
            sent = self._sent.get(rid, 0)
            text = committed_text(self.tokenizer, st) if st.output_ids else ""
            if st.finished:
                self._done.add(rid)
                if self.result_of is not None:
                    result = self.result_of(st)
                    reason, valid = result.finish_reason, result.valid
                else:
                    detail = st.finish_reason or "error"
                    reason, valid = finish_reason_of(detail, st.request.grammar, text), None
                self.on_chunk(StreamChunk(rid, text[sent:], reason, valid))
                continue
            stops = st.sampling.stop if st.sampling is not None else ()
            end = len(text) - (max(map(len, stops), default=1) - 1 if stops else 0)
            while end > sent and text[end - 1] == "\ufffd":
                end -= 1
            if end > sent:
                self._sent[rid] = end
                self.on_chunk(StreamChunk(rid, text[sent:end]))

    def close(self, results: Sequence[RequestResult]) -> None:
        """Send the last chunk of every request that has not had it (from its result)."""
        for r in results:
            if r.rid not in self._done:
                self._done.add(r.rid)
                self.on_chunk(
                    StreamChunk(r.rid, r.text[self._sent.get(r.rid, 0) :], r.finish_reason, r.valid)
                )
