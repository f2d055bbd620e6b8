"""Rows agree with accept: every token a row allows is accepted by the same state, and refused
tokens are refused, over sampled states of real schemas (large flat objects included).

A row that allows a token its state refuses breaks the protocol's contract in the worst way:
the sampler picks the token and the request dies there (llguidance 1.9.1 past its Earley row
limit allowed ``{`` as the first token of a 500-property object, then refused it). The checker
:func:`check_rows_agree` is reusable on any backend and compiled grammar; the registered
properties run it on the suite's grammars.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..datasets import bfcl_cases, jsonschemabench_sample
from ..errors import GrammarStateError
from ..protocol import CompiledGrammar, GrammarBackend, SpecGrammar
from ..specs import GrammarSpec, JsonSchema, ToolCalls
from .core import ConformanceFailure, Session, allowed_set, conformance_property, describe_ids
from .fixtures import grammar_g, grammar_u

__all__ = ["check_rows_agree", "flat_object", "row_grammar_bank"]

REAL_SCHEMA_IDS = ("sp_408_Normalized", "o10505", "o12240", "wp_88_Normalized")
"""JSONSchemaBench schemas of the quick run: the largest flat objects of the sample (56 and 15
properties, one and three required) and two of the random properties' schemas."""

FLAT_QUICK = (120,)
FLAT_SLOW = (120, 500, 1000)
"""Optional-property counts of the synthetic flat objects. 500 and more pass llguidance 1.9.1's
default row limit (``max_items_in_row=2000``, ~4 Earley items a property); they run in the slow
mode only, because outlines-core's index-size estimate of such a schema takes ~30 s."""


def flat_object(n: int) -> dict:
    """A JSON schema: an object of ``n`` optional properties ``p0..p{n-1}``, each a string or an
    integer (the shape of wide form/config schemas)."""
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": ["string", "integer"]} for i in range(n)},
    }


def row_grammar_bank(fixture: str, slow: bool) -> list[GrammarSpec]:
    """The grammars the rows-agree property checks on ``fixture``: the toy grammars G and U on
    ``"toy"``; on ``"smollm2"`` real JSONSchemaBench schemas (every one in slow mode), BFCL tool
    calls and the flat objects."""
    if fixture == "toy":
        return grammar_g() + grammar_u()
    rows = jsonschemabench_sample()
    if not slow:
        rows = [r for r in rows if r["id"] in REAL_SCHEMA_IDS]
    cases = bfcl_cases() if slow else bfcl_cases()[:1]
    return (
        [JsonSchema(r["schema"]) for r in rows]
        + [ToolCalls(c["tools"]) for c in cases]
        + [JsonSchema(flat_object(n)) for n in (FLAT_SLOW if slow else FLAT_QUICK)]
    )


def check_rows_agree(
    backend: GrammarBackend,
    compiled: CompiledGrammar,
    *,
    seed: int = 0,
    walks: int = 2,
    steps: int = 10,
    allowed_sample: int | None = 96,
    refused_sample: int = 16,
) -> int:
    """Check that rows agree with accept on ``walks`` seeded random walks of up to ``steps``
    tokens each (each step takes a random allowed non-stop token).

    At every state reached (the start included): each checked allowed token is accepted by the
    state (on the matcher itself, then ``rollback(1)``; on a fork when the matcher keeps no
    history), and ``refused_sample`` random refused ids of the vocabulary are refused with the
    state unchanged. Checked allowed tokens: all of them when ``allowed_sample`` is None, else
    the stop tokens, the 16 shortest and ``allowed_sample`` random ones.

    Returns the number of states checked. Raises :class:`ConformanceFailure` naming the state
    (token path and text) and the tokens in disagreement.
    """
    info = backend.tokenizer_info
    rng = random.Random(seed)
    stops = frozenset(info.stop_token_ids)
    lengths = [len(b) for b in info.token_bytes]
    states = 0
    for _ in range(walks):
        m = backend.matcher(compiled)
        path: list[int] = []
        for _ in range(steps + 1):
            if m.is_terminated():
                break
            allowed = allowed_set(m)
            states += 1
            _check_state(m, path, allowed, stops, lengths, rng, allowed_sample, refused_sample)
            body = sorted(allowed - stops)
            if not body:
                break
            t = rng.choice(body)
            if not m.accept_token(t):
                raise ConformanceFailure(
                    "every token a row allows is accepted by the same state",
                    f"after {path[-12:]} {info.decode(path)!r:.160}: refused {t}",
                    True,
                    False,
                )
            path.append(t)
    return states


def _check_state(
    m: SpecGrammar,
    path: Sequence[int],
    allowed: frozenset[int],
    stops: frozenset[int],
    lengths: Sequence[int],
    rng: random.Random,
    allowed_sample: int | None,
    refused_sample: int,
) -> None:
    info = m.info
    where = f"after {list(path)[-12:]} {info.decode(list(path))!r:.160}"
    if allowed_sample is None or len(allowed) <= allowed_sample + 16:
        todo = sorted(allowed)
    else:
        ordered = sorted(allowed)
        shortest = sorted(ordered, key=lambda t: (lengths[t] if t < len(lengths) else 0, t))[:16]
        todo = sorted(set(rng.sample(ordered, allowed_sample)) | set(shortest) | (allowed & stops))
    refused = [t for t in todo if not _accepts(m, t)]
    if refused:
        raise ConformanceFailure(
            "every token a row allows is accepted by the same state",
            f"{m.num_accepted} tokens {where}: refused {describe_ids(refused, info.decode)}",
            set(todo),
            set(todo) - set(refused),
            decode=info.decode,
        )
    vocab = info.tokenizer_vocab_size
    pool = rng.sample(range(vocab), min(vocab, refused_sample * 4))
    wrong = [t for t in pool if t not in allowed][:refused_sample]
    accepted = [t for t in wrong if _accepts(m, t)]
    if accepted:
        raise ConformanceFailure(
            "a token the row refuses is refused by the same state",
            f"{m.num_accepted} tokens {where}: accepted {describe_ids(accepted, info.decode)}",
            set(),
            set(accepted),
            decode=info.decode,
        )


def _accepts(m: SpecGrammar, t: int) -> bool:
    """Whether ``m`` accepts ``t``, ``m`` left as it was. A :class:`GrammarStateError` from
    ``accept_token`` (an adapter finding its library refused what its row allowed) counts as a
    refusal, so the report names the token and the state."""
    try:
        if m.max_rollback_tokens < 1:
            return m.fork().accept_token(t)
        if not m.accept_token(t):
            return False
    except GrammarStateError:
        return False
    m.rollback(1)
    return True


def _register(fixture: str) -> None:
    @conformance_property(
        f"{fixture}_rows_agree_with_accept",
        "at sampled states of random walks (real schemas, large flat objects, the backend's own "
        "cases): every token the row allows is accepted by that state and sampled refused "
        "tokens are refused (the state left unchanged)",
        fixture,
    )
    def rows_agree_with_accept(session: Session) -> None:
        backend = session.backend(fixture)
        bank = row_grammar_bank(fixture, session.slow)
        # real schemas may be refused with a typed error (a keyword, a resource limit): left out
        compiled = session.supported(fixture, bank, must_compile=False, with_cases=True)
        for i, (spec, grammar) in enumerate(compiled):
            try:
                check_rows_agree(
                    backend,
                    grammar,
                    seed=(session.seed or 0) + i,
                    walks=4 if session.slow else 2,
                    steps=20 if session.slow else 10,
                    # a whole 48k-token row is ~1.3 s of accepts on xgrammar: sampled in both
                    allowed_sample=2048 if session.slow else 96,
                )
            except ConformanceFailure as e:
                e.input = f"{spec.kind} {spec.cache_key()[:120]}: {e.input}"
                raise ConformanceFailure(
                    e.contract, e.input, e.expected, e.actual, decode=e.decode
                ) from None


for _fixture in ("toy", "smollm2"):
    _register(_fixture)
