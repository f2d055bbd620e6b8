"""Fault injection for the worker's reliability tests: subclasses of the real xgrammar backend
whose matchers raise in a fill, an accept or a state query, or whose compile never finishes,
for the grammar specs named below; requests and a clean reference run on the real SmolLM2
(float64, :func:`real_model.model_and_tokenizer`)."""

from __future__ import annotations

import functools
import threading

from real_model import model_and_tokenizer
from spec_grammar_xgrammar import XGrammarBackend, XGrammarMatcher

from spec_grammar import JsonSchema, Regex
from spec_grammar.worker import Request, SpecWorker
from spec_grammar.worker.sampling import SamplingParams

MAX_NEW = 6
FILL_FAULT = Regex(r"[a-z]+( [a-z]+)*")  # its matchers raise from their 2nd tree fill on
ACCEPT_FAULT = Regex(r"[A-Z][a-z]+( [a-z]+)*")  # its matchers raise on the 4th accepted token
BLOCKED = Regex(r"(north|south|east|west)")  # its compile never finishes
STATE_FAULT = Regex(r"[0-9]+( [0-9]+)*")  # its matchers raise when asked whether they terminated
# short raw prompts (no chat template): the CI budget is model time
GOOD = [
    (
        "Three colours as a JSON list:",
        JsonSchema({"type": "array", "items": {"type": "string"}, "maxItems": 3}),
    ),
    ("Question: 2+2=? Answer:", Regex(r"[0-9]+")),
    ("Once upon a time", None),
]


class FaultyMatcher(XGrammarMatcher):
    """A real xgrammar matcher that raises from its n-th fill on / on its n-th accepted token."""

    def __init__(
        self, backend, matcher, *, fail_fill_at=None, fail_accept_at=None, fail_state=False
    ):
        super().__init__(backend, matcher)
        self.fills = 0
        self.fail_fill_at, self.fail_accept_at, self.fail_state = (
            fail_fill_at,
            fail_accept_at,
            fail_state,
        )

    def _is_terminated(self):
        if self.fail_state:
            raise RuntimeError("injected fault in is_terminated")
        return super()._is_terminated()

    def _fill_tree_bitmask(self, tree, bitmask, row_offset):
        self.fills += 1
        if self.fail_fill_at is not None and self.fills >= self.fail_fill_at:
            raise RuntimeError("injected fault in fill_tree_bitmask")
        return super()._fill_tree_bitmask(tree, bitmask, row_offset)

    def _accept_token(self, token):
        if self.fail_accept_at is not None and self.num_accepted + 1 == self.fail_accept_at:
            raise RuntimeError("injected fault in accept_token")
        return super()._accept_token(token)


class FaultyBackend(XGrammarBackend):
    """xgrammar with faults for the specs above; ``on_fill`` runs inside every tree fill (on the
    grammar thread, under the verify forward when the worker overlaps)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.on_fill = None

    def _compile(self, spec):
        if spec == BLOCKED:
            self.release.wait(60)
        return super()._compile(spec)

    def _matcher(self, compiled):
        m = super()._matcher(compiled)
        if compiled.spec == FILL_FAULT:
            return FaultyMatcher(self, m._m, fail_fill_at=2)
        if compiled.spec == ACCEPT_FAULT:
            return FaultyMatcher(self, m._m, fail_accept_at=4)
        if compiled.spec == STATE_FAULT:
            return FaultyMatcher(self, m._m, fail_state=True)
        return m

    def fill_tree_bitmasks(self, jobs, bitmask):
        if self.on_fill is not None:
            self.on_fill()
        return super().fill_tree_bitmasks(jobs, bitmask)


def make_worker(overlap: bool = True) -> SpecWorker:
    model, tok = model_and_tokenizer()
    backend = FaultyBackend(tok, vocab_size=model.config.vocab_size, compile_timeout_s=0.5)
    return SpecWorker(
        model, tok, backend=backend, draft="ngram", num_draft_tokens=6, overlap=overlap
    )


def request(text: str, grammar, rid: str, **sampling) -> Request:
    _, tok = model_and_tokenizer()
    params = SamplingParams(**{"max_new_tokens": MAX_NEW, **sampling})
    return Request(tok.encode(text), grammar, params, rid=rid)


def good_requests() -> list[Request]:
    return [request(text, g, f"good-{i}") for i, (text, g) in enumerate(GOOD)]


@functools.cache
def reference() -> dict[str, tuple[list[int], str]]:
    """Outputs of the good requests alone."""
    with make_worker() as w:
        return {r.rid: (r.token_ids, r.finish_reason) for r in w.run(good_requests())}
