"""Randomized properties (hypothesis) on real grammars: draft trees, rollback, fork, split
invariance, mask/accept agreement.

The oracle is the backend itself used in the simplest way: a fresh matcher fed one path token
by token. Every property runs twice: on the toy tokenizer with grammars G and U (fast, exact
grammar), and on the SmolLM2 tokenizer with real JSON schemas (JSONSchemaBench sample), BFCL
tool calls, a regex and an EBNF/Lark grammar. Tokens are drawn mostly from the allowed sets
(so walks reach deep states), otherwise invalid: ``-1`` padding, padding columns
``[len(tokenizer), V)``, ids ``>= V``, or any token of the vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from ..bitmask import allocate_token_bitmask
from ..datasets import bfcl_cases, jsonschemabench_sample
from ..protocol import CompiledGrammar, GrammarBackend, SpecGrammar
from ..specs import Ebnf, GrammarSpec, JsonSchema, Lark, Regex, ToolCalls
from ..tree import DraftTree
from .core import (
    ConformanceFailure,
    PropertySkipped,
    Session,
    allowed_set,
    check,
    check_equal_sets,
    conformance_property,
)
from .fixtures import grammar_g, grammar_u

QUICK_SCHEMA_IDS = ("o12240", "calculate_area_98abd231", "wp_88_Normalized")
REGEX = r"[A-Z]{3}-[0-9]{4} (active|inactive|pending) [a-z]+@[a-z]+\.com \d{1,3}(\.\d{1,2})?"
ARITH_EBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
ARITH_LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


def grammar_bank(fixture: str, slow: bool) -> list[GrammarSpec]:
    """Grammars the random properties draw from on ``fixture``."""
    if fixture == "toy":
        return grammar_g() + grammar_u()
    rows = jsonschemabench_sample()
    if not slow:
        rows = [r for r in rows if r["id"] in QUICK_SCHEMA_IDS]
    cases = bfcl_cases() if slow else bfcl_cases()[:2]
    return (
        [JsonSchema(r["schema"]) for r in rows]
        + [ToolCalls(c["tools"]) for c in cases]
        + [Regex(REGEX), Ebnf(ARITH_EBNF), Lark(ARITH_LARK)]
    )


class Oracle:
    """Allowed sets by fresh-matcher replay of a path, memoized per path. Every set it reads
    is also checked for padding ids and, for JSON grammars, EOS only where the text parses."""

    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        self.backend = backend
        self.compiled = compiled
        self.info = backend.tokenizer_info
        self.is_json = isinstance(compiled.spec, (JsonSchema, ToolCalls))
        self._memo: dict[tuple[int, ...], tuple[frozenset[int], bool]] = {}

    def describe(self, path: Sequence[int]) -> str:
        spec = self.compiled.spec
        return (
            f"{spec.kind} {spec.cache_key()[:120]}... after {list(path)} {self.info.decode(path)!r}"
        )

    def fresh(self, path: Sequence[int]) -> SpecGrammar:
        m = self.backend.matcher(self.compiled)
        for i, t in enumerate(path):
            if not m.accept_token(t):
                raise ConformanceFailure(
                    "a token the mask allowed is accepted",
                    self.describe(path[:i]) + f", token {t}",
                    True,
                    False,
                )
        return m

    def state(self, path: Sequence[int]) -> tuple[frozenset[int], bool]:
        """``(allowed set, terminated)`` after ``path`` (the empty set once terminated)."""
        key = tuple(path)
        if key not in self._memo:
            m = self.fresh(key)
            done = m.is_terminated()
            allowed = frozenset() if done else allowed_set(m)
            self._check_row(key, allowed)
            self._memo[key] = (allowed, done)
        return self._memo[key]

    def _check_row(self, path: tuple[int, ...], allowed: frozenset[int]) -> None:
        padding = {t for t in allowed if t >= self.info.tokenizer_vocab_size}
        check(
            not padding,
            "ids in [tokenizer vocab, logits width) are never allowed",
            self.describe(path),
            set(),
            padding,
        )
        stops = set(self.info.stop_token_ids) & allowed
        if self.is_json and stops:
            text = self.info.decode(path)
            try:
                json.loads(text)
                parses = True
            except ValueError:
                parses = False
            check(
                parses,
                "EOS is allowed only where the grammar can end (the JSON text is complete)",
                self.describe(path),
                "EOS refused",
                "EOS allowed",
            )


def _settings(session: Session, fixture: str) -> Callable:
    examples = {"toy": 60, "smollm2": 25}[fixture] * (8 if session.slow else 1)
    cfg = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=session.seed is None,
        phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if session.slow else []),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
    )

    def apply(fn: Callable) -> Callable:
        fn = cfg(fn)
        return fn if session.seed is None else seed(session.seed)(fn)

    return apply


def _compiled_bank(session: Session, fixture: str) -> list[tuple[GrammarSpec, CompiledGrammar]]:
    # Real schemas may use keywords a backend refuses with a typed error: those are left out.
    return session.supported(
        fixture, grammar_bank(fixture, session.slow), must_compile=False, with_cases=True
    )


def _draw_token(data: Any, oracle: Oracle, allowed: frozenset[int], *, invalid_rate: int) -> int:
    """A token: from ``allowed`` (stop tokens only sometimes), otherwise an invalid or arbitrary id."""
    info = oracle.info
    kind = data.draw(st.integers(0, 9))
    body = sorted(allowed - set(info.stop_token_ids))
    if kind >= invalid_rate and allowed:
        if body and (kind < 9 or len(body) == len(allowed)):
            return data.draw(st.sampled_from(body))
        return data.draw(st.sampled_from(sorted(allowed)))
    junk = [
        -1,
        info.tokenizer_vocab_size,
        info.vocab_size - 1,
        info.vocab_size,
        info.vocab_size + 1000,
    ]
    if kind % 2:
        return data.draw(st.sampled_from([t for t in junk if t >= -1]))
    return data.draw(st.integers(0, info.tokenizer_vocab_size - 1))


def _draw_walk(data: Any, oracle: Oracle, max_len: int, *, may_end: bool) -> list[int]:
    """A path of accepted tokens drawn from the allowed sets (ending with EOS sometimes)."""
    path: list[int] = []
    for _ in range(data.draw(st.integers(0, max_len))):
        allowed, done = oracle.state(path)
        if done or not allowed:
            break
        body = sorted(allowed - set(oracle.info.stop_token_ids))
        stops = sorted(allowed & set(oracle.info.stop_token_ids))
        if stops and (not body or (may_end and data.draw(st.integers(0, 3)) == 0)):
            path.append(stops[0])
            break
        if not body:
            break
        path.append(data.draw(st.sampled_from(body)))
    return path


def _walk_len(fixture: str) -> int:
    return 8 if fixture == "toy" else 30


def _register_for_both(name: str, contract: str) -> Callable:
    def wrap(body: Callable[[Session, str], None]) -> Callable:
        for fixture in ("toy", "smollm2"):
            conformance_property(f"{fixture}_{name}", contract, fixture)(
                lambda session, _f=fixture: body(session, _f)
            )
        return body

    return wrap


@_register_for_both(
    "random_tree_rows",
    "random draft trees: each row equals fresh-matcher replay of root..node, siblings isolated, "
    "valid = token in parent's row (ancestors valid), invalid/terminated/below-invalid rows zero, "
    "rows outside the tree untouched, the matcher (mask, num_accepted, termination) unchanged, "
    "validate_tokens of each root-to-leaf chain = its leading valid nodes, state unchanged",
)
def random_tree_rows(session: Session, fixture: str) -> None:
    backend = session.backend(fixture)
    bank = _compiled_bank(session, fixture)
    max_nodes = 10 if fixture == "toy" else 14
    contract = "tree rows = fresh-matcher replay; fill leaves the matcher unchanged"

    @_settings(session, fixture)
    @given(st.data())
    def run(data: Any) -> None:
        spec, compiled = data.draw(st.sampled_from(bank))
        oracle = Oracle(backend, compiled)
        prefix = _draw_walk(data, oracle, _walk_len(fixture), may_end=False)
        if oracle.state(prefix)[1]:
            return
        # The root is the last committed token; with no prefix, any non-stop token (a prompt's).
        root = prefix[-1] if prefix else min(set(range(3)) - set(oracle.info.stop_token_ids))
        tokens, parents = [root], [-1]
        paths: list[list[int] | None] = [list(prefix)]  # grammar path per node, None = invalid
        for i in range(1, data.draw(st.integers(1, max_nodes))):
            p = data.draw(st.integers(0, i - 1))
            ppath = paths[p]
            if ppath is None or oracle.state(ppath)[1]:
                t = _draw_token(data, oracle, frozenset(), invalid_rate=10)
                path = None
            else:
                allowed = oracle.state(ppath)[0]
                t = _draw_token(data, oracle, allowed, invalid_rate=2)
                path = ppath + [t] if t in allowed else None
            tokens.append(t)
            parents.append(p)
            paths.append(path)
        tree = DraftTree.from_parents(tokens, parents)
        where = f"{oracle.describe(prefix)}; tree {tree}"

        m = oracle.fresh(prefix)
        before = (allowed_set(m), m.num_accepted, m.is_terminated())
        bm = allocate_token_bitmask(
            tree.num_nodes + 2, backend.vocab_size
        )  # all ones: stale rows show
        valid = m.fill_tree_bitmask(tree, bm, row_offset=1)
        expected_valid = [pth is not None for pth in paths]
        check(
            valid.tolist() == expected_valid,
            contract,
            where + ": valid",
            expected_valid,
            valid.tolist(),
        )
        for node, pth in enumerate(paths):
            live = pth is not None and not oracle.state(pth)[1]
            expected = oracle.state(pth)[0] if live else frozenset()
            check_equal_sets(
                m,
                contract,
                f"{where}: row of node {node} (path {tree.path(node)})",
                expected,
                allowed_set(m, bm, 1 + node),
            )
        check(
            bool((bm[0] == -1).all() and (bm[-1] == -1).all()),
            contract,
            where + ": rows outside the tree",
            "untouched",
            "overwritten",
        )
        # zero_dead_rows=False: same validity and live rows; dead rows may keep what was there
        kept = allocate_token_bitmask(tree.num_nodes + 2, backend.vocab_size)
        valid_kept = m.fill_tree_bitmask(tree, kept, row_offset=1, zero_dead_rows=False)
        check(
            valid_kept.tolist() == expected_valid,
            contract,
            where + ": valid (zero_dead_rows=False)",
            expected_valid,
            valid_kept.tolist(),
        )
        live_rows = [
            1 + node
            for node, pth in enumerate(paths)
            if pth is not None and not oracle.state(pth)[1]
        ]
        check(
            bool(torch.equal(kept[live_rows], bm[live_rows]))
            and bool((kept[0] == -1).all() and (kept[-1] == -1).all()),
            contract,
            where + ": live rows and rows outside the tree (zero_dead_rows=False)",
            "as with zero_dead_rows=True",
            "different",
        )
        after = (allowed_set(m), m.num_accepted, m.is_terminated())
        check(
            after == before,
            contract,
            where + ": matcher after the fill",
            _state(before),
            _state(after),
        )

        for leaf in range(tree.num_nodes):
            if tree.first_child_list[leaf] != -1:
                continue
            chain = tree.path(leaf)
            below_root = tree.path_nodes(leaf)[1:]
            n_valid = next(
                (i for i, node in enumerate(below_root) if not expected_valid[node]), len(chain)
            )
            n = m.validate_tokens(chain)
            check(
                n == n_valid,
                "validate_tokens counts the leading valid drafts",
                f"{where}: validate_tokens({chain})",
                n_valid,
                n,
            )
        after = (allowed_set(m), m.num_accepted, m.is_terminated())
        check(
            after == before,
            "validate_tokens leaves the state unchanged",
            where + ": after validate_tokens",
            _state(before),
            _state(after),
        )

    run()


def _state(s: tuple[frozenset[int], int, bool]) -> str:
    return f"{len(s[0])} allowed ids (hash {hash(s[0]) & 0xFFFF:04x}), num_accepted {s[1]}, terminated {s[2]}"


@_register_for_both(
    "random_rollback_fork",
    "after random walks (EOS included): rollback(k) equals a fresh replay of the shorter path "
    "(mask, termination, num_accepted); a fork advanced independently leaves its origin intact; "
    "a refused token is a no-op; after termination accept is False and fills raise GrammarStateError",
)
def random_rollback_fork(session: Session, fixture: str) -> None:
    backend = session.backend(fixture)
    bank = _compiled_bank(session, fixture)

    @_settings(session, fixture)
    @given(st.data())
    def run(data: Any) -> None:
        spec, compiled = data.draw(st.sampled_from(bank))
        oracle = Oracle(backend, compiled)
        path = _draw_walk(data, oracle, _walk_len(fixture), may_end=True)
        m = oracle.fresh(path)
        _same_as(m, oracle, path, "accept token by token")
        k = data.draw(st.integers(0, len(path)))
        m.rollback(k)
        short = path[: len(path) - k]
        _same_as(m, oracle, short, f"{path} then rollback({k})")

        f = m.fork()
        more = _draw_walk_from(data, oracle, short, 6)
        n = f.accept_tokens(more)
        check(
            n == len(more),
            "fork accepts what the grammar allows",
            oracle.describe(short + more),
            len(more),
            n,
        )
        _same_as(m, oracle, short, f"origin after its fork accepted {more}")
        _same_as(f, oracle, short + more, "the fork itself")

        allowed, done = oracle.state(short)
        if not done:
            near = _near_misses(oracle, allowed)
            if near and data.draw(st.booleans()):
                bad = data.draw(st.sampled_from(near))
            else:
                bad = _draw_token(data, oracle, frozenset(), invalid_rate=10)
            if 0 <= bad < backend.vocab_size and bad not in allowed:
                check(
                    not m.accept_token(bad),
                    "a refused token is refused",
                    oracle.describe(short) + f", token {bad}",
                    False,
                    True,
                )
                _same_as(m, oracle, short, f"after the refused token {bad}")

    run()


def _near_misses(oracle: Oracle, allowed: frozenset[int], limit: int = 256) -> list[int]:
    """Refused tokens whose first byte is a legal next byte (a partial accept would show)."""
    table = oracle.info.token_bytes
    firsts = {table[t][:1] for t in allowed if table[t]}
    out = []
    for t, raw in enumerate(table):
        if raw[:1] in firsts and t not in allowed and t not in oracle.info.special_token_ids:
            out.append(t)
            if len(out) == limit:
                break
    return out


def _draw_walk_from(data: Any, oracle: Oracle, start: list[int], max_len: int) -> list[int]:
    path = list(start)
    for _ in range(data.draw(st.integers(0, max_len))):
        allowed, done = oracle.state(path)
        if done or not allowed:
            break
        path.append(data.draw(st.sampled_from(sorted(allowed))))
    return path[len(start) :]


def _same_as(m: SpecGrammar, oracle: Oracle, path: Sequence[int], how: str) -> None:
    allowed, done = oracle.state(path)
    where = f"{oracle.describe(path)} ({how})"
    got = (m.is_terminated(), m.num_accepted)
    check(
        got == (done, len(path)),
        "the state equals a fresh replay of the path",
        where + ": terminated, num_accepted",
        (done, len(path)),
        got,
    )
    if done:
        from ..errors import GrammarStateError

        check(
            not m.accept_token(oracle.info.stop_token_ids[0]),
            "nothing is accepted after termination",
            where,
            False,
            True,
        )
        try:
            m.fill_next_token_bitmask(allocate_token_bitmask(1, oracle.info.vocab_size), 0)
        except GrammarStateError:
            return
        except Exception as e:
            raise ConformanceFailure(
                "a fill after termination raises GrammarStateError",
                where,
                "GrammarStateError",
                f"{type(e).__name__}: {e}",
            ) from None
        raise ConformanceFailure(
            "a fill after termination raises GrammarStateError",
            where,
            "GrammarStateError",
            "no error",
        )
    check_equal_sets(
        m, "the state equals a fresh replay of the path", where, allowed, allowed_set(m)
    )


@_register_for_both(
    "random_split_validate",
    "a random accepted sequence gives the same state accepted in one call, token by token or in "
    "random chunks; validate_tokens returns its length and changes nothing",
)
def random_split_validate(session: Session, fixture: str) -> None:
    backend = session.backend(fixture)
    bank = _compiled_bank(session, fixture)
    contract = "split invariance and non-mutating validate"

    @_settings(session, fixture)
    @given(st.data())
    def run(data: Any) -> None:
        spec, compiled = data.draw(st.sampled_from(bank))
        oracle = Oracle(backend, compiled)
        path = _draw_walk(data, oracle, _walk_len(fixture), may_end=True)
        cuts = sorted(set(data.draw(st.lists(st.integers(0, len(path)), max_size=4))))
        one = backend.matcher(compiled)
        v = one.validate_tokens(path)
        check(
            v == len(path),
            contract,
            oracle.describe(path) + ": validate_tokens on a fresh matcher",
            len(path),
            v,
        )
        _same_as(one, oracle, [], "after validate_tokens")
        n = one.accept_tokens(path)
        check(
            n == len(path),
            contract,
            oracle.describe(path) + ": accept_tokens in one call",
            len(path),
            n,
        )
        _same_as(one, oracle, path, "one call")
        chunked = backend.matcher(compiled)
        bounds = [0] + cuts + [len(path)]
        for a, b in zip(bounds, bounds[1:]):
            chunked.accept_tokens(path[a:b])
        _same_as(chunked, oracle, path, f"chunks cut at {cuts}")

    run()


@_register_for_both(
    "random_mask_accept_agree",
    "at random reachable states, for sampled ids (allowed, refused, stop, padding columns): the "
    "mask allows the id <=> accept_token succeeds on a fork",
)
def random_mask_accept_agree(session: Session, fixture: str) -> None:
    backend = session.backend(fixture)
    bank = _compiled_bank(session, fixture)
    info = backend.tokenizer_info

    @_settings(session, fixture)
    @given(st.data())
    def run(data: Any) -> None:
        spec, compiled = data.draw(st.sampled_from(bank))
        oracle = Oracle(backend, compiled)
        path = _draw_walk(data, oracle, _walk_len(fixture), may_end=False)
        allowed, done = oracle.state(path)
        if done:
            return
        m = oracle.fresh(path)
        padding = list(range(info.tokenizer_vocab_size, info.vocab_size))
        pool = sorted(allowed)[:64] + list(info.stop_token_ids) + padding
        ids = set(data.draw(st.lists(st.integers(0, info.vocab_size - 1), min_size=8, max_size=32)))
        ids |= set(
            pool if len(pool) <= 96 else data.draw(st.lists(st.sampled_from(pool), max_size=48))
        )
        accepted = {t for t in ids if m.fork().accept_token(t)}
        where = oracle.describe(path) + f" over {len(ids)} sampled ids"
        check_equal_sets(
            m, "mask allows id <=> accept(id) on a fork", where, allowed & ids, accepted
        )

    run()


REGEX_SAMPLES = ("ABC-1234 active foo@bar.com 12.5", "XYZ-0000 pending a@b.com 7")


@conformance_property(
    "smollm2_eos_exactly_at_end",
    "along real documents (BFCL tool calls, regex samples): EOS is allowed exactly where the text "
    "is a complete document (json.loads / re.fullmatch), only EOS once nothing can follow, and "
    "accepting EOS terminates",
    "smollm2",
)
def eos_exactly_at_end(session: Session) -> None:
    import re

    backend = session.backend("smollm2")
    info = backend.tokenizer_info
    tok = info.hf_tokenizer
    stops = frozenset(info.stop_token_ids)
    docs: list[tuple[GrammarSpec, str, Callable[[str], bool]]] = []
    for case in bfcl_cases() if session.slow else bfcl_cases()[:3]:
        if case["example_output_valid"]:
            docs.append(
                (ToolCalls(case["tools"]), json.dumps(case["example_output"]), _parses_as_json)
            )
    docs += [
        (Regex(REGEX), text, lambda t: re.fullmatch(REGEX, t) is not None) for text in REGEX_SAMPLES
    ]
    contract = "EOS allowed exactly where the document can end"
    for spec, compiled in session.supported("smollm2", [d[0] for d in docs], must_compile=False):
        for dspec, text, complete in docs:
            if dspec != spec:
                continue
            ids = tok.encode(text, add_special_tokens=False)
            m = backend.matcher(compiled)
            for i in range(len(ids) + 1):
                prefix = info.decode(ids[:i])
                allowed = allowed_set(m)
                where = f"{spec.kind} after {prefix!r}"
                can_end = complete(prefix)
                check(
                    bool(allowed & stops) == can_end,
                    contract,
                    where,
                    can_end,
                    bool(allowed & stops),
                )
                if i == len(ids):
                    break
                check(
                    m.accept_token(ids[i]),
                    "a valid document's tokens are accepted",
                    where + f", token {ids[i]}",
                    True,
                    False,
                )
            if isinstance(spec, ToolCalls):
                check_equal_sets(
                    m,
                    "only EOS once the document is complete",
                    f"{spec.kind} after {text!r}",
                    stops,
                    allowed_set(m),
                )
            where = f"{spec.kind} after {text!r}"
            check(
                m.accept_token(min(stops)) and m.is_terminated(),
                "accepting EOS terminates",
                where,
                True,
                False,
            )


def _parses_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@_register_for_both(
    "case_documents",
    "along the complete documents of the backend's own conformance cases: every token is "
    "accepted, EOS is allowed exactly where the kind's oracle (re.fullmatch, json.loads + "
    "jsonschema; other kinds: the end only) calls the prefix complete, and accepting EOS terminates",
)
def case_documents(session: Session, fixture: str) -> None:
    cases = [c for c in session.cases(fixture) if c.documents]
    if not cases:
        raise PropertySkipped(
            f"not applicable: {session.backend(fixture).name} gives no conformance case with "
            f"documents on the {fixture} tokenizer"
        )
    backend = session.backend(fixture)
    info = backend.tokenizer_info
    stops = frozenset(info.stop_token_ids)
    compiled = {s.cache_key(): c for s, c in session.supported(fixture, [], with_cases=True)}
    for case in cases:
        complete = _completeness_oracle(case.spec)
        for text in case.documents:
            ids = _spell(info, text)
            check(
                info.decode(ids) == text,
                "a case document is spelled by the fixture tokenizer",
                f"{case.spec.kind} document {text!r} on {fixture}",
                text,
                info.decode(ids),
            )
            m = backend.matcher(compiled[case.spec.cache_key()])
            for i in range(len(ids) + 1):
                prefix = info.decode(ids[:i])
                where = f"{case.spec.kind} {case.spec.cache_key()[:80]} after {prefix!r}"
                ends = bool(allowed_set(m) & stops)
                if complete is not None or i == len(ids):
                    can_end = complete(prefix) if complete is not None else True
                    check(
                        ends == can_end,
                        "EOS allowed exactly where the document can end",
                        where,
                        can_end,
                        ends,
                    )
                if i == len(ids):
                    break
                check(
                    m.accept_token(ids[i]),
                    "a valid document's tokens are accepted",
                    where + f", token {ids[i]}",
                    True,
                    False,
                )
            check(
                m.accept_token(min(stops)) and m.is_terminated(),
                "accepting EOS terminates",
                f"{case.spec.kind} after {text!r}",
                True,
                False,
            )


def _spell(info: Any, text: str) -> list[int]:
    """``text`` as token ids: the tokenizer's own encoding when it decodes back to ``text``,
    else the greedy longest match over the vocabulary's bytes (the toy tokenizer has no merges,
    so its encoding drops what no single byte token spells)."""
    ids = info.hf_tokenizer.encode(text, add_special_tokens=False)
    if info.decode(ids) == text:
        return ids
    skip = set(info.special_token_ids) | set(info.stop_token_ids)
    by_bytes = {b: t for t, b in enumerate(info.token_bytes) if b and t not in skip}
    longest = max(map(len, by_bytes), default=0)
    data, out, i = text.encode(), [], 0
    while i < len(data):
        k = next(
            (k for k in range(min(longest, len(data) - i), 0, -1) if data[i : i + k] in by_bytes), 0
        )
        if not k:
            break  # not spelled: the caller's check names the document
        out.append(by_bytes[data[i : i + k]])
        i += k
    return out


def _completeness_oracle(spec: GrammarSpec) -> Callable[[str], bool] | None:
    """``text -> complete?`` from the kind's own library, or None where there is none here."""
    import re

    if isinstance(spec, Regex):
        pattern = re.compile(spec.pattern)
        return lambda text: pattern.fullmatch(text) is not None
    if isinstance(spec, JsonSchema):
        import jsonschema

        schema = spec.json_schema
        validator = jsonschema.validators.validator_for(schema)(schema)

        def complete(text: str) -> bool:
            try:
                value = json.loads(text)
            except ValueError:
                return False
            return validator.is_valid(value)

        return complete
    return None
