"""The real SmolLM2 model and JSON-schema backends shared by the model-running test files.

One cached float64 copy per test session: float64 keeps speculative vs non-speculative greedy
comparisons free of near-tie argmax flips caused by different matmul shapes.
"""

from __future__ import annotations

import functools

import torch

from spec_grammar import get_backend, list_backends

# JSON-schema backends: regex-only adapters (the interegular example) have their own tests.
JSON_BACKENDS = [
    b.name
    for b in list_backends()
    if b.error is None and b.capabilities.json_schema and b.capabilities.tool_calls
]


@functools.cache
def model_and_tokenizer():
    from spec_grammar.models import load_model, load_tokenizer

    return load_model("smollm2", dtype=torch.float64), load_tokenizer("smollm2")


@functools.cache
def vocab_size() -> int:
    """The model's logits width, read from its config: the tests that only compile and match
    grammars need no weights (they run in the ``-m "not model"`` lane, which loading the
    float64 model here made ~15 s slower)."""
    from spec_grammar.worker.api import _config_vocab_size

    width = _config_vocab_size("smollm2")
    return width if width is not None else model_and_tokenizer()[0].config.vocab_size


@functools.cache
@functools.cache
def backend(name: str):
    """One backend per name for the session: its compile cache is shared by every test (a
    fresh one per worker run and per replay recompiled the same schemas: outlines-core's
    index builds were most of the model lane's time)."""
    from spec_grammar.models import load_tokenizer

    # no compile time limit: an outlines-core index build took 25 s on a loaded 2-core host, and
    # a timed-out compile fails the request these tests compare (the limit has its own tests)
    return get_backend(
        name, load_tokenizer("smollm2"), vocab_size=vocab_size(), compile_timeout_s=None
    )


def replays(name: str, spec, token_ids: list[int], finished: bool) -> bool:
    """Oracle: a fresh matcher of backend ``name`` accepts the output (and the stop token when
    the grammar finished)."""
    from spec_grammar.compose import matcher

    b = backend(name)
    m = matcher(b, b.compile(spec))
    ids = token_ids + ([b.tokenizer_info.stop_token_ids[0]] if finished else [])
    return m.accept_tokens(ids) == len(ids) and (m.is_terminated() or not finished)


def draft_steps(drafter, states, steps: int) -> list[list]:
    """``steps`` proposals of ``drafter`` over request ``states``; after each, the first-child
    path of every tree is committed (fed to the request's matcher when it has one; a refused
    path commits nothing). Returns every step's trees as ``(tokens, parents)`` lists."""
    for s in states:
        drafter.add(s)
    out = []
    for _ in range(steps):
        trees = drafter.propose(states)
        out.append([(t.token_list, t.parent_list) for t in trees])
        for s, t in zip(states, trees):
            node, path = 0, []
            while node in t.parent_list[1:]:
                node = t.parent_list.index(node, 1)
                path.append(t.token_list[node])
            path = path or [t.token_list[0]]
            if s.matcher is not None and s.matcher.accept_tokens(path) != len(path):
                path = []
            s.output_ids.extend(path)
    return out
