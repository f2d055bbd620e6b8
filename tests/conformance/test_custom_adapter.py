"""The third-party adapter example (``examples/custom_adapter``, backend ``interegular``)
against independent oracles on the real SmolLM2 tokenizer (49,152 tokens).

Oracles: Python's ``re.fullmatch`` on the decoded text of every accepted sequence; the
``regex`` module's partial matching for whole mask rows (a token is allowed iff the text so
far plus its bytes can still become a full match; the stop token iff the text is a full
match); fresh-matcher replay for every tree row; the conformance suite itself.

Nothing is installed here: the example package is imported from its folder. CI installs it
(``pip install ./examples/custom_adapter``) and runs ``spec-grammar conformance`` on it too.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import regex
import torch

pytest.importorskip("interegular", reason="the example adapter needs `pip install interegular`")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_adapter"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from spec_grammar_interegular import InteregularBackend  # noqa: E402

from spec_grammar.bitmask import allocate_token_bitmask, allowed_token_ids  # noqa: E402
from spec_grammar.errors import GrammarCompileError, GrammarStateError, UnsupportedGrammarError  # noqa: E402
from spec_grammar.registry import load_backend_class  # noqa: E402
from spec_grammar.specs import Ebnf, JsonSchema, Regex, ToolCalls  # noqa: E402
from spec_grammar.tree import DraftTree  # noqa: E402

PAD = 45  # extra logits columns (not a multiple of 32 on purpose)
EOS = 2  # SmolLM2's <|im_end|>

PATTERNS = [
    r"[A-Z]{3}-[0-9]{4} (active|inactive|pending) [a-z]+@[a-z]+\.com [0-9]{1,3}(\.[0-9]{1,2})?",
    r'\{"name": "[^"\\]{1,20}", "age": [0-9]{1,3}\}',
    r"(é|ü|日本|🙂)+ ?[a-z]{0,5}",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
    r"(yes|no|maybe)",
    r"[a-z]*",
]
TEXTS = [
    "ABC-1234 active joe@example.com 12.5",
    '{"name": "Ann Lee", "age": 42}',
    "日本éü🙂 abc",
    "-120.75",
    "maybe",
    "",
]


@pytest.fixture(scope="module")
def backend(tok):
    return InteregularBackend(tok, vocab_size=len(tok) + PAD)


def ids_of(row: torch.Tensor) -> set[int]:
    """Ids whose bit is set in one ``(W,)`` int32 row (the layout of ``spec_grammar.bitmask``)."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def row_ids(m) -> set[int]:
    bm = allocate_token_bitmask(1, m.info.vocab_size)
    m.fill_next_token_bitmask(bm, 0)
    return ids_of(bm[0])


def replay(backend, compiled, tokens):
    m = backend.matcher(compiled)
    assert m.accept_tokens(tokens) == len(tokens)
    return m


def text_of(backend, tokens) -> bytes:
    info = backend.tokenizer_info
    return b"".join(info.token_bytes[t] for t in tokens if t not in info.stop_token_ids)


def random_walk(m, rng: random.Random, max_steps: int) -> list[int]:
    """Sample allowed tokens (favouring the stop token where it is allowed) until termination."""
    out = []
    for _ in range(max_steps):
        allowed = sorted(row_ids(m))
        assert allowed, "a live state with no allowed token"
        t = EOS if EOS in allowed and rng.random() < 0.3 else rng.choice(allowed)
        assert m.accept_token(t)
        out.append(t)
        if m.is_terminated():
            break
    return out


def partial_regex_oracle(backend, pattern: str, prefix: bytes) -> tuple[set[int], set[int]]:
    """``(allowed, checked)``: the ids the oracle allows after ``prefix`` and the ids it could
    judge (tokens ending inside a UTF-8 character are left out)."""
    info = backend.tokenizer_info
    rx = regex.compile(pattern, flags=regex.ASCII)
    text = prefix.decode("utf-8")
    allowed, checked = set(), set()
    for t, b in enumerate(info.token_bytes):
        if t in info.stop_token_ids:
            checked.add(t)
            if rx.fullmatch(text):
                allowed.add(t)
            continue
        if t in info.special_token_ids or not b:
            checked.add(t)
            continue
        try:
            cont = (prefix + b).decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data":
                continue  # ends inside a character: not judged here
            checked.add(t)  # malformed UTF-8: never allowed
            continue
        checked.add(t)
        if rx.fullmatch(cont, partial=True):
            allowed.add(t)
    return allowed, checked


def test_registered_through_entry_point_and_capabilities():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["spec_grammar.backends"]["interegular"]
    assert load_backend_class(target) is InteregularBackend
    caps = InteregularBackend.capabilities
    assert caps.regex and not (caps.json_schema or caps.ebnf or caps.lark or caps.tool_calls)
    assert InteregularBackend.name == "interegular"
    assert InteregularBackend.library_version()[0].isdigit()


@pytest.mark.parametrize(
    "spec, error",
    [
        (JsonSchema({"type": "integer"}), UnsupportedGrammarError),
        (ToolCalls([{"type": "function", "function": {"name": "f"}}]), UnsupportedGrammarError),
        (Ebnf('root ::= "a"'), UnsupportedGrammarError),
        (Regex(r"^abc$"), UnsupportedGrammarError),
        (Regex(r"a\1"), UnsupportedGrammarError),
        (Regex(r"(ab"), GrammarCompileError),
        # look-arounds: interegular 0.3 builds wrong automata for them (took "x!" for (?!ab)...)
        (Regex(r"(?![a-z]{4})[a-z]+"), UnsupportedGrammarError),
        (Regex(r"(?<=a)b"), UnsupportedGrammarError),
    ],
)
def test_bad_or_unsupported_specs_raise_typed_errors(backend, spec, error):
    with pytest.raises(error) as e:
        backend.compile(spec)
    assert "[interegular]" in str(e.value)


@pytest.mark.parametrize("pattern, text", list(zip(PATTERNS, TEXTS)))
def test_masks_match_partial_regex_oracle_along_a_real_tokenization(backend, tok, pattern, text):
    assert re.fullmatch(pattern, text, flags=re.ASCII)
    compiled = backend.compile(Regex(pattern))
    m = backend.matcher(compiled)
    ids = (tok.encode(text, add_special_tokens=False) if text else []) + [EOS]
    # The oracle reads the whole vocabulary (~0.3 s): check the start, the end and a few between.
    checked_steps = {0, len(ids) - 1, *range(0, len(ids), max(1, len(ids) // 4))}
    prefix = b""
    for i, t in enumerate(ids):
        got = row_ids(m)
        assert got <= set(range(backend.tokenizer_info.tokenizer_vocab_size))
        assert t in got
        try:
            prefix.decode("utf-8")
        except UnicodeDecodeError:
            checked_steps.add(i + 1)  # inside a character: judge the next step instead
        else:
            if i in checked_steps:
                allowed, checked = partial_regex_oracle(backend, pattern, prefix)
                assert got & checked == allowed, (pattern, prefix)
        assert m.accept_token(t), (pattern, prefix, t)
        prefix += backend.tokenizer_info.token_bytes[t] if t != EOS else b""
    assert m.is_terminated()


@pytest.mark.parametrize("pattern", PATTERNS)
def test_random_walks_produce_full_matches_and_rollback_fork_are_exact(backend, pattern):
    compiled = backend.compile(Regex(pattern))
    rng = random.Random(pattern)
    for _ in range(4):
        m = backend.matcher(compiled)
        path = random_walk(m, rng, max_steps=60)
        if m.is_terminated():
            text = text_of(backend, path).decode("utf-8")
            assert re.fullmatch(pattern, text, flags=re.ASCII), (pattern, text)
            assert m.accept_token(EOS) is False and m.forced_tokens() == []
        # Rollback to every depth (termination included) equals a fresh replay; so does a fork.
        for k in rng.sample(range(1, len(path) + 1), min(4, len(path))):
            fork = m.fork()
            fork.rollback(k)
            ref = replay(backend, compiled, path[:-k])
            assert row_ids(fork) == row_ids(ref)
        assert m.num_accepted == len(path)


def test_refused_tokens_are_no_ops_and_validate_does_not_mutate(backend, tok):
    compiled = backend.compile(Regex(PATTERNS[0]))
    m = backend.matcher(compiled)
    good = tok.encode("ABC-12", add_special_tokens=False)
    assert m.validate_tokens(good + [EOS]) == len(good)
    assert m.num_accepted == 0 and row_ids(m) == row_ids(backend.matcher(compiled))
    assert m.accept_tokens(good) == len(good)
    before = row_ids(m)
    for bad in [EOS, tok.encode("x", add_special_tokens=False)[0], 0, len(tok) + 3]:
        assert m.accept_token(bad) is False
        assert row_ids(m) == before
    assert m.validate_tokens([-1, 5]) == 0
    with pytest.raises(GrammarStateError):
        m.rollback(len(good) + 1)


def test_repeated_rollbacks_over_a_long_history_and_the_rollback_bound(tok):
    small = InteregularBackend(tok, max_rollback_tokens=3)
    compiled = small.compile(Regex(r"(ab|[0-9])*"))
    path = tok.encode("ab1ab2" * 6, add_special_tokens=False)
    m = small.matcher(compiled)
    assert m.accept_tokens(path) == len(path) > 8
    fork = m.fork()
    for matcher in (m, fork):
        matcher.rollback(3)
        matcher.rollback(3)
        assert row_ids(matcher) == row_ids(replay(small, compiled, path[:-6]))
        with pytest.raises(GrammarStateError):
            matcher.rollback(4)
    assert fork.accept_tokens(path[-6:]) == 6 and m.num_accepted == len(path) - 6


def test_stop_token_exactly_where_the_pattern_can_end(backend, tok):
    m = backend.matcher(backend.compile(Regex(r"(yes|no)!?")))
    bm = allocate_token_bitmask(1, backend.vocab_size)
    m.fill_next_token_bitmask(bm, 0)
    assert ids_of(bm[0]) == set(allowed_token_ids(bm[0])) == row_ids(m)  # the core's layout
    assert EOS not in row_ids(m)
    m.accept_tokens(tok.encode("yes", add_special_tokens=False))
    assert EOS in row_ids(m) and tok.encode("!", add_special_tokens=False)[0] in row_ids(m)
    m.accept_tokens(tok.encode("!", add_special_tokens=False))
    assert row_ids(m) == {EOS}
    assert m.forced_tokens() == []
    assert m.accept_token(EOS) and m.is_terminated()
    with pytest.raises(GrammarStateError):
        row_ids(m)
    m.rollback(1)
    assert row_ids(m) == {EOS}
    # The empty string: the stop token is allowed right away.
    assert EOS in row_ids(backend.matcher(backend.compile(Regex(r"[a-z]*"))))


def test_forced_tokens_come_from_the_core_fallback(backend, tok):
    """No native jump-forward: the core finds forced tokens by mask (one allowed token)."""
    m = backend.matcher(backend.compile(Regex(r"[0-9]!")))
    assert m.forced_tokens() == []  # ten digits allowed
    assert m.accept_tokens(tok.encode("7", add_special_tokens=False)) == 1
    assert m.forced_tokens() == tok.encode("!", add_special_tokens=False)
    assert m.num_accepted == 1 and len(row_ids(m)) == 1


def random_tree(m, rng: random.Random, n_nodes: int, vocab: int) -> DraftTree:
    """A draft tree whose children are mostly allowed tokens (chosen from a fork's masks),
    with refused tokens, stop tokens and padding ids mixed in."""
    tokens, parents, states = [0], [-1], [m.fork()]
    frontier = [0]
    while len(tokens) < n_nodes and frontier:
        p = frontier.pop(0)
        sm = states[p]
        allowed = sorted(row_ids(sm)) if sm is not None and not sm.is_terminated() else []
        for _ in range(rng.randint(1, 3)):
            if len(tokens) >= n_nodes:
                break
            r = rng.random()
            if allowed and r < 0.75:
                t = rng.choice(allowed)
            elif r < 0.85:
                t = rng.choice([-1, vocab + 2])
            else:
                t = rng.randrange(vocab)
            child = None
            if sm is not None and not sm.is_terminated():
                child = sm.fork()
                if not (0 <= t < vocab and child.accept_token(t)):
                    child = None
            tokens.append(t)
            parents.append(p)
            states.append(child)
            frontier.append(len(tokens) - 1)
    return DraftTree.from_parents(tokens, parents)


@pytest.mark.parametrize("pattern", PATTERNS[:4])
def test_tree_rows_equal_fresh_matcher_replay(backend, tok, pattern):
    compiled = backend.compile(Regex(pattern))
    rng = random.Random(7)
    vocab = backend.tokenizer_info.tokenizer_vocab_size
    root_path = tok.encode(TEXTS[PATTERNS.index(pattern)], add_special_tokens=False)[:3]
    m = replay(backend, compiled, root_path)
    before = row_ids(m)
    for n in (8, 24):
        tree = random_tree(m, rng, n, vocab)
        offset = 2
        bm = allocate_token_bitmask(n + 4, backend.vocab_size)
        valid = m.fill_tree_bitmask(tree, bm, offset)
        assert valid.dtype == torch.bool and valid.shape == (n,)
        assert row_ids(m) == before and m.num_accepted == len(root_path)
        assert (bm[:offset] == -1).all() and (bm[offset + n :] == -1).all()
        for node in range(n):
            ref = backend.matcher(compiled)
            path = root_path + tree.path(node)
            ok = all(0 <= t < vocab for t in path) and ref.accept_tokens(path) == len(path)
            assert bool(valid[node]) == ok, (node, path)
            got = ids_of(bm[offset + node])
            if ok and not ref.is_terminated():
                assert got == row_ids(ref), (node, path)
            else:
                assert got == set(), (node, path)


def test_every_state_mask_agrees_with_accept(backend):
    """For each DFA state reached by a walk, mask bit <=> accept_token on a fork, over a
    sample of ids (all allowed ones and as many refused ones)."""
    compiled = backend.compile(Regex(PATTERNS[2]))
    rng = random.Random(3)
    m = backend.matcher(compiled)
    for _ in range(12):
        allowed = row_ids(m)
        refused = rng.sample(sorted(set(range(backend.vocab_size)) - allowed), 200)
        for t in sorted(allowed) + refused:
            assert m.fork().accept_token(t) == (t in allowed), t
        choices = sorted(allowed - {EOS})
        if not choices:
            break
        m.accept_token(rng.choice(choices))


def run_suite(fixtures: tuple[str, ...]) -> None:
    testing = pytest.importorskip(
        "spec_grammar.testing", reason="the conformance suite is not in this tree yet"
    )
    results = testing.run_conformance(InteregularBackend, fixtures=fixtures)
    bad = [f"{r.name}: {r.status}\n{r.detail}" for r in results if r.status in ("FAIL", "ERROR")]
    assert not bad, "\n\n".join(bad)
    assert any(r.status == "PASS" for r in results)


def test_conformance_suite_passes_on_the_toy_tokenizer():
    run_suite(("toy",))


@pytest.mark.slow
def test_conformance_suite_passes_on_smollm2():
    run_suite(("smollm2",))


def test_mask_rows_are_cached_per_state(backend):
    compiled = backend.compile(Regex(r"[0-9]{2,3}"))
    grammar = compiled.native
    m = backend.matcher(compiled)
    row_ids(m)
    row_ids(m.fork())
    assert grammar.cached_rows == 1
    np.testing.assert_array_equal(
        grammar.mask_row(grammar.dfa.initial), grammar.mask_row(grammar.dfa.initial)
    )
