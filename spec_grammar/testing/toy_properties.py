"""Exact cases on the toy tokenizer (``conformance-cases.md`` T1-T4, T8-T10 and grammar U).

Every allowed set here is written out by hand from the grammar, not recorded from a backend.
Each property runs on every spelling of the grammar the backend supports (Regex, Ebnf, Lark).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..bitmask import allocate_token_bitmask
from ..errors import GrammarCompileError, GrammarStateError, InvalidTokenError, SpecGrammarError
from ..protocol import CompiledGrammar, SpecGrammar
from ..specs import Regex
from ..tree import DraftTree
from .core import (
    ConformanceFailure,
    Session,
    allowed_set,
    check,
    check_equal_sets,
    conformance_property,
)
from .fixtures import EOS, TOY_TOKEN_BYTES, TOY_WIDTH, grammar_g, grammar_u

# Allowed sets of grammar G after each prefix (token ids of the toy tokenizer).
G_ROWS: dict[tuple[int, ...], frozenset[int]] = {
    (): frozenset({1, 11}),
    (1,): frozenset({3}),
    (1, 3): frozenset({5}),
    (11,): frozenset({7, 8}),
    (11, 7): frozenset({7, 8, 6, 2}),
    (11, 7, 6): frozenset({4}),
    (11, 7, 6, 4): frozenset({5}),
    (11, 7, 6, 4, 5): frozenset({7, 8}),
    (11, 7, 6, 4, 5, 8): frozenset({7, 8, 2}),
    (11, 7, 2): frozenset({EOS}),
    (11, 7, 6, 4, 5, 8, 2): frozenset({EOS}),
}
PADDING = frozenset(range(len(TOY_TOKEN_BYTES), TOY_WIDTH))


def _text(tokens: Sequence[int]) -> str:
    raw = b"".join(TOY_TOKEN_BYTES[t] if 0 <= t < len(TOY_TOKEN_BYTES) else b"?" for t in tokens)
    return repr(raw.decode("utf-8", "replace"))


def _at(session: Session, compiled: CompiledGrammar, path: Sequence[int]) -> SpecGrammar:
    """A fresh matcher fed ``path``; a refusal is itself a failure."""
    m = session.backend("toy").matcher(compiled)
    for i, t in enumerate(path):
        if not m.accept_token(t):
            raise ConformanceFailure(
                "a token allowed by the grammar is accepted",
                f"{compiled.spec.kind}: token {t} after {list(path[:i])} ({_text(path[:i])})",
                True,
                False,
            )
    return m


def _input(compiled: CompiledGrammar, what: str) -> str:
    return f"grammar G as {compiled.spec.kind}: {what}"


def _g(session: Session):
    return [c for _, c in session.supported("toy", grammar_g())]


@conformance_property(
    "toy_token_bytes",
    "the backend reads every token as its tokenizer bytes: a grammar matching exactly a token's "
    "text allows that token at the start and can end after it",
    "toy",
)
def toy_token_bytes(session: Session) -> None:
    backend = session.backend("toy")
    for t, raw in enumerate(TOY_TOKEN_BYTES):
        if t == EOS or raw[0] >= 0x80:
            continue  # lone UTF-8 bytes are covered by grammar U
        pattern = "".join(
            "\\n" if ch == "\n" else ch if ch.isalnum() else f"[{ch}]" for ch in raw.decode()
        )
        try:
            compiled = backend.compile(Regex(pattern))
        except GrammarCompileError:
            continue  # a library may refuse grammars the vocabulary cannot spell every path of
        m = backend.matcher(compiled)
        start = allowed_set(m)
        check(
            t in start and EOS not in start,
            "token text read as its bytes",
            f"Regex {pattern!r} at the start",
            f"{t} allowed, EOS refused",
            sorted(start),
            decode=m.info.decode,
        )
        check(
            m.accept_token(t),
            "token text read as its bytes",
            f"Regex {pattern!r}: accept {t}",
            True,
            False,
        )
        after = allowed_set(m)
        check(
            EOS in after,
            "token text read as its bytes",
            f"Regex {pattern!r} after token {t}",
            f"EOS ({EOS}) allowed",
            sorted(after),
            decode=m.info.decode,
        )


@conformance_property(
    "toy_G_allowed_sets",
    "the mask after each prefix is exactly the set of tokens the grammar allows (G, hand-derived)",
    "toy",
)
def toy_g_allowed_sets(session: Session) -> None:
    for compiled in _g(session):
        for path, expected in G_ROWS.items():
            m = _at(session, compiled, path)
            check_equal_sets(
                m,
                "mask = grammar's allowed set",
                _input(compiled, f"after {list(path)} {_text(path)}"),
                expected,
                allowed_set(m),
            )


@conformance_property(
    "toy_T1_rollback_fork_roundtrip",
    "rollback(k) / discarding a fork restores the exact state, across an accepted EOS too",
    "toy",
)
def toy_t1(session: Session) -> None:
    contract = "rollback and fork round-trips restore the exact state"
    for c in _g(session):
        m = _at(session, c, [11])
        n = m.accept_tokens([7, 6, 4])
        check(n == 3, contract, _input(c, "accept_tokens([7, 6, 4]) after [11]"), 3, n)
        m.rollback(3)
        check_equal_sets(
            m, contract, _input(c, "[11] + [7, 6, 4], rollback(3)"), {7, 8}, allowed_set(m)
        )
        check(
            m.num_accepted == 1,
            contract,
            _input(c, "num_accepted after rollback(3)"),
            1,
            m.num_accepted,
        )
        check(
            not m.accept_token(2), contract, _input(c, "accept(2) after the rollback"), False, True
        )
        check(m.accept_token(8), contract, _input(c, "accept(8) after the rollback"), True, False)

        m = _at(session, c, [11])
        f = m.fork()
        check(
            f.accept_tokens([7, 6, 4]) == 3,
            contract,
            _input(c, "fork: accept_tokens([7, 6, 4])"),
            3,
            "fewer",
        )
        del f
        check_equal_sets(
            m,
            contract,
            _input(c, "[11], fork advanced by [7, 6, 4] and dropped"),
            {7, 8},
            allowed_set(m),
        )
        check(
            not m.accept_token(2) and m.accept_token(8),
            contract,
            _input(c, "accept(2) false then accept(8) true"),
            True,
            False,
        )

        m = _at(session, c, [11, 7])
        n = m.accept_tokens([2, EOS])
        check(
            n == 2 and m.is_terminated(),
            contract,
            _input(c, "[11, 7] + accept_tokens([2, 0])"),
            "2 accepted, terminated",
            f"{n} accepted, terminated={m.is_terminated()}",
        )
        m.rollback(2)
        check(
            not m.is_terminated(),
            contract,
            _input(c, "[11, 7, 2, 0], rollback(2): is_terminated()"),
            False,
            True,
        )
        check_equal_sets(
            m, contract, _input(c, "[11, 7, 2, 0], rollback(2)"), {7, 8, 6, 2}, allowed_set(m)
        )
        check(
            m.accept_tokens([2, EOS]) == 2,
            contract,
            _input(c, "re-accept [2, 0] after rollback(2)"),
            2,
            "fewer",
        )
        m.rollback(1)
        check(
            not m.is_terminated(),
            contract,
            _input(c, "[11, 7, 2, 0], rollback(1): is_terminated()"),
            False,
            True,
        )
        check_equal_sets(
            m, contract, _input(c, "[11, 7, 2, 0], rollback(1)"), {EOS}, allowed_set(m)
        )


@conformance_property(
    "toy_T2_refused_token_noop",
    "a refused token is a no-op: accept returns False and the state is unchanged",
    "toy",
)
def toy_t2(session: Session) -> None:
    contract = "a refused token leaves the state unchanged"
    for c in _g(session):
        m = _at(session, c, [11, 7])
        for bad in (10, 18, 20, 31):
            check(
                not m.accept_token(bad),
                contract,
                _input(c, f"accept({bad}) after [11, 7]"),
                False,
                True,
            )
            check(
                m.num_accepted == 2,
                contract,
                _input(c, f"num_accepted after refused {bad}"),
                2,
                m.num_accepted,
            )
            check_equal_sets(
                m,
                contract,
                _input(c, f"[11, 7] then refused {bad} ({_text([bad])})"),
                {7, 8, 6, 2},
                allowed_set(m),
            )
        n = m.accept_tokens([6, 10, 4])
        check(
            n == 1,
            contract,
            _input(c, "accept_tokens([6, 10, 4]) after [11, 7]: stops at the refusal"),
            1,
            n,
        )
        check_equal_sets(
            m, contract, _input(c, "[11, 7, 6] after the refused 10"), {4}, allowed_set(m)
        )


def _t3_tree() -> DraftTree:
    # n1=`1`{ n3=`,`{ n5=`"b"` }, n4=`}`{ n6=<eos> } }, n2=`2`{ n7=space{ n8=`}` } }
    return DraftTree.from_parents([11, 7, 8, 6, 2, 4, EOS, 9, 2], [-1, 0, 0, 1, 1, 3, 4, 2, 7])


T3_ROWS = [{7, 8}, {7, 8, 6, 2}, {7, 8, 6, 2}, {4}, {EOS}, {5}, set(), set(), set()]
T3_VALID = [True, True, True, True, True, True, True, False, False]


@conformance_property(
    "toy_T3_tree_rows",
    "each tree row equals a fresh matcher's mask after root..node; siblings are isolated; invalid "
    "nodes, their subtrees and terminated nodes get zero rows; the matcher is unchanged; rows "
    "outside the tree's range are untouched",
    "toy",
)
def toy_t3(session: Session) -> None:
    contract = "tree rows = fresh-matcher replay of root..node"
    tree = _t3_tree()
    for c in _g(session):
        m = _at(session, c, [11])
        bm = allocate_token_bitmask(tree.num_nodes + 2, TOY_WIDTH)  # all ones: stale rows show up
        valid = m.fill_tree_bitmask(tree, bm, row_offset=1)
        check(
            valid.dtype == torch.bool and valid.tolist() == T3_VALID,
            contract,
            _input(c, f"valid of {tree}"),
            T3_VALID,
            valid.tolist(),
        )
        for node, expected in enumerate(T3_ROWS):
            path = tree.path(node)
            where = _input(c, f"row of node {node}, path {path} {_text(path)}")
            check_equal_sets(m, contract, where, expected, allowed_set(m, bm, 1 + node))
        for node in range(tree.num_nodes):
            if T3_VALID[node] and tree.token_list[node] != EOS:
                replay = _at(session, c, [11] + tree.path(node))
                check_equal_sets(
                    m,
                    contract,
                    _input(c, f"node {node} vs fresh replay of {tree.path(node)}"),
                    allowed_set(replay),
                    allowed_set(m, bm, 1 + node),
                )
        check(
            bool((bm[0] == -1).all() and (bm[-1] == -1).all()),
            contract,
            _input(c, "rows outside [1, 1+N)"),
            "untouched",
            "overwritten",
        )
        check(
            m.num_accepted == 1 and not m.is_terminated(),
            contract,
            _input(c, "matcher after the fill"),
            "num_accepted 1, live",
            f"num_accepted {m.num_accepted}, terminated={m.is_terminated()}",
        )
        check_equal_sets(
            m, contract, _input(c, "live matcher after the fill"), {7, 8}, allowed_set(m)
        )


@conformance_property(
    "toy_T4_fail_closed",
    "past the first invalid draft (refused id, -1 padding, padding column, id >= width) "
    "validation stops without raising and rows are zero, never allow-all",
    "toy",
)
def toy_t4(session: Session) -> None:
    contract = "fail closed past the first invalid draft"
    for drafts in ([7, 10, -1, -1], [7, 25, 40, -1]):
        for c in _g(session):
            m = _at(session, c, [11])
            try:
                n = m.validate_tokens(drafts)
            except SpecGrammarError as e:
                raise ConformanceFailure(
                    contract,
                    _input(c, f"validate_tokens({drafts}) after [11]"),
                    "1, no exception",
                    repr(e),
                ) from None
            check(n == 1, contract, _input(c, f"validate_tokens({drafts}) after [11]"), 1, n)
            tree = DraftTree.chain(11, drafts)
            bm = allocate_token_bitmask(tree.num_nodes, TOY_WIDTH)
            valid = m.fill_tree_bitmask(tree, bm)
            check(
                valid.tolist() == [True, True, False, False, False],
                contract,
                _input(c, f"valid of chain {drafts}"),
                [True, True, False, False, False],
                valid.tolist(),
            )
            for row, expected in enumerate([{7, 8}, {7, 8, 6, 2}, set(), set(), set()]):
                check_equal_sets(
                    m,
                    contract,
                    _input(c, f"row {row} of chain {drafts} after [11]"),
                    expected,
                    allowed_set(m, bm, row),
                )
            check_equal_sets(
                m,
                contract,
                _input(c, f"live matcher after the chain {drafts}"),
                {7, 8},
                allowed_set(m),
            )
            try:
                m.accept_tokens([7, -1])
                raise ConformanceFailure(
                    contract, _input(c, "accept_tokens([7, -1])"), "InvalidTokenError", "no error"
                )
            except InvalidTokenError:
                pass
            check(
                m.num_accepted == 1,
                contract,
                _input(c, "num_accepted after accept_tokens([7, -1]) raised"),
                1,
                m.num_accepted,
            )


@conformance_property(
    "toy_T8_complete_only_eos",
    "once the grammar is complete only EOS is allowed (the mask is never released)",
    "toy",
)
def toy_t8(session: Session) -> None:
    contract = "complete grammar allows only EOS"
    for c in _g(session):
        m = _at(session, c, [11, 7, 6, 4, 5, 8])
        n = m.validate_tokens([2, 10])
        check(n == 1, contract, _input(c, 'validate_tokens([2, 10]) after {"a":1,"b":2'), 1, n)
        check(m.accept_token(2), contract, _input(c, "accept(2)"), True, False)
        check_equal_sets(m, contract, _input(c, 'after {"a":1,"b":2}'), {EOS}, allowed_set(m))
        check(
            not m.accept_token(10),
            contract,
            _input(c, "accept(10) after the closing brace"),
            False,
            True,
        )
        check(
            m.accept_token(EOS) and m.is_terminated(),
            contract,
            _input(c, "accept(EOS) after the closing brace"),
            "accepted, terminated",
            "refused or live",
        )


@conformance_property(
    "toy_T9_split_validate",
    "accepting a sequence in one call, token by token or in chunks ends in the same state; "
    "validate_tokens counts the same and changes nothing",
    "toy",
)
def toy_t9(session: Session) -> None:
    contract = "split invariance and non-mutating validate"
    seq = [11, 7, 2, EOS]
    for c in _g(session):
        backend = session.backend("toy")
        one = backend.matcher(c)
        n_one = one.accept_tokens(seq)
        by_token = backend.matcher(c)
        n_tok = sum(by_token.accept_token(t) for t in seq)
        chunks = backend.matcher(c)
        n_chunks = chunks.accept_tokens(seq[:2]) + chunks.accept_tokens(seq[2:])
        got = [
            (n_one, one.is_terminated()),
            (n_tok, by_token.is_terminated()),
            (n_chunks, chunks.is_terminated()),
        ]
        check(
            got == [(4, True)] * 3,
            contract,
            _input(c, f"{seq}: one call / token by token / [11, 7] + [2, 0]"),
            [(4, True)] * 3,
            got,
        )
        fresh = backend.matcher(c)
        n = fresh.validate_tokens(seq)
        check(n == 4, contract, _input(c, f"validate_tokens({seq})"), 4, n)
        check(
            fresh.num_accepted == 0 and not fresh.is_terminated(),
            contract,
            _input(c, "state after validate"),
            "num_accepted 0, live",
            f"num_accepted {fresh.num_accepted}, terminated={fresh.is_terminated()}",
        )
        where = _input(c, f"start state after validate_tokens({seq})")
        check_equal_sets(fresh, contract, where, {1, 11}, allowed_set(fresh))
        alt = backend.matcher(c)
        n = alt.accept_tokens([1, 3, 5, 7, 2, EOS])
        check(
            n == 6 and alt.is_terminated(),
            contract,
            _input(c, "non-canonical [1, 3, 5, 7, 2, 0]"),
            "6 accepted, terminated",
            f"{n}, terminated={alt.is_terminated()}",
        )


def _reachable(session: Session, c: CompiledGrammar, depth: int) -> list[tuple[int, ...]]:
    """Every prefix of length <= depth reachable through the backend's own masks."""
    out, frontier = [()], [()]
    for _ in range(depth):
        nxt = []
        for path in frontier:
            m = _at(session, c, path)
            if m.is_terminated():
                continue
            nxt.extend(path + (t,) for t in sorted(allowed_set(m)))
        out.extend(nxt)
        frontier = nxt
    return out


@conformance_property(
    "toy_T10_mask_accept_agree",
    "at every reachable state, mask allows id <=> accept(id) succeeds on a fork, for every id of "
    "the logits width; EOS only after the closing brace; padding ids never allowed",
    "toy",
)
def toy_t10(session: Session) -> None:
    contract = "mask and accept agree"
    for c in _g(session):
        for path in _reachable(session, c, 6):
            m = _at(session, c, path)
            if m.is_terminated():
                continue
            allowed = allowed_set(m)
            accepted = {t for t in range(TOY_WIDTH) if m.fork().accept_token(t)}
            where = _input(c, f"after {list(path)} {_text(path)}")
            check_equal_sets(m, contract, where + ": mask vs accept on a fork", accepted, allowed)
            check(
                not allowed & PADDING,
                "padding ids are never allowed",
                where,
                set(),
                set(allowed & PADDING),
            )
            can_end = bool(path) and path[-1] == 2
            check(
                (EOS in allowed) == can_end,
                "EOS allowed exactly when the grammar can end",
                where,
                can_end,
                EOS in allowed,
            )


@conformance_property(
    "toy_U_multibyte",
    "a character split over byte tokens is allowed byte by byte, and a wrong continuation byte "
    "(0xA8 after 0xC3 gives e-grave) is refused",
    "toy",
)
def toy_u(session: Session) -> None:
    contract = "multi-byte characters across tokens"
    expected = {
        (): {15, 19},
        (15,): {16},
        (19,): {15, 19, EOS},
        (15, 16): {15, 19, EOS},
        (19, 15): {16},
    }
    for _, c in session.supported("toy", grammar_u()):
        for path, rows in expected.items():
            m = _at(session, c, path)
            check_equal_sets(
                m, contract, f"grammar U as {c.spec.kind}: after {list(path)}", rows, allowed_set(m)
            )
        m = _at(session, c, [15])
        check(
            not m.accept_token(17),
            contract,
            f"grammar U as {c.spec.kind}: accept(17) after [15]",
            False,
            True,
        )
        n = session.backend("toy").matcher(c).validate_tokens([19, 15, 17])
        check(n == 2, contract, f"grammar U as {c.spec.kind}: validate_tokens([19, 15, 17])", 2, n)


@conformance_property(
    "toy_after_termination",
    "after termination accept returns False, accept/validate count 0, fills raise "
    "GrammarStateError (never a library crash), forced_tokens is empty, rollback still works",
    "toy",
)
def toy_after_termination(session: Session) -> None:
    contract = "nothing is filled or accepted after termination"
    for c in _g(session):
        m = _at(session, c, [11, 7, 2, EOS])
        check(
            m.is_terminated(), contract, _input(c, "is_terminated after [11, 7, 2, 0]"), True, False
        )
        for t in (EOS, 2, 10):
            check(
                not m.accept_token(t),
                contract,
                _input(c, f"accept({t}) after termination"),
                False,
                True,
            )
        got = (m.accept_tokens([EOS]), m.validate_tokens([EOS]), m.forced_tokens(), m.num_accepted)
        where = _input(c, "accept_tokens([0]), validate_tokens([0]), forced_tokens(), num_accepted")
        check(got == (0, 0, [], 4), contract, where, (0, 0, [], 4), got)
        bm = allocate_token_bitmask(3, TOY_WIDTH)
        for what, call in (
            ("fill_next_token_bitmask", lambda: m.fill_next_token_bitmask(bm, 0)),
            ("fill_tree_bitmask", lambda: m.fill_tree_bitmask(DraftTree.chain(EOS, [2]), bm)),
        ):
            try:
                call()
            except GrammarStateError:
                continue
            except Exception as e:  # the library's own error leaked out
                raise ConformanceFailure(
                    contract,
                    _input(c, f"{what} after termination"),
                    "GrammarStateError",
                    f"{type(e).__name__}: {e}",
                ) from None
            raise ConformanceFailure(
                contract, _input(c, f"{what} after termination"), "GrammarStateError", "no error"
            )
        m.rollback(1)
        check_equal_sets(
            m, contract, _input(c, "rollback(1) after termination"), {EOS}, allowed_set(m)
        )


@conformance_property(
    "toy_fork_independent",
    "a fork and its origin never share state, terminated forks included",
    "toy",
)
def toy_fork_independent(session: Session) -> None:
    contract = "fork is an independent copy"
    for c in _g(session):
        m = _at(session, c, [11])
        f = m.fork()
        check(f.accept_token(7), contract, _input(c, "fork.accept(7)"), True, False)
        check_equal_sets(
            m, contract, _input(c, "origin after fork.accept(7)"), {7, 8}, allowed_set(m)
        )
        check(
            m.accept_tokens([8, 6]) == 2,
            contract,
            _input(c, "origin.accept_tokens([8, 6])"),
            2,
            "fewer",
        )
        where = _input(c, "fork after origin.accept_tokens([8, 6])")
        check_equal_sets(f, contract, where, {7, 8, 6, 2}, allowed_set(f))
        f.rollback(1)
        check_equal_sets(
            m, contract, _input(c, "origin after fork.rollback(1)"), {4}, allowed_set(m)
        )
        check(
            (m.num_accepted, f.num_accepted) == (3, 1),
            contract,
            _input(c, "num_accepted of origin, fork"),
            (3, 1),
            (m.num_accepted, f.num_accepted),
        )
        done = _at(session, c, [11, 7, 2, EOS])
        g = done.fork()
        check(g.is_terminated(), contract, _input(c, "fork of a terminated matcher"), True, False)
        g.rollback(1)
        check(
            done.is_terminated(),
            contract,
            _input(c, "origin after its fork rolled back"),
            True,
            False,
        )
        check_equal_sets(
            g, contract, _input(c, "terminated fork after rollback(1)"), {EOS}, allowed_set(g)
        )


@conformance_property(
    "toy_forced_tokens",
    "forced_tokens() returns tokens spelling a prefix of the text the grammar forces, never a "
    "stop token, accepted in order, with the state unchanged",
    "toy",
)
def toy_forced_tokens(session: Session) -> None:
    contract = "forced tokens are forced and non-mutating"
    forced_text = {(): b'{"a":', (1,): b'"a":', (11, 7, 6): b'"b":', (11, 7): b"", (11, 7, 2): b""}
    for c in _g(session):
        for path, text in forced_text.items():
            m = _at(session, c, path)
            before = allowed_set(m)
            forced = m.forced_tokens()
            spelled = b"".join(TOY_TOKEN_BYTES[t] for t in forced if 0 <= t < len(TOY_TOKEN_BYTES))
            where = _input(c, f"forced_tokens() after {list(path)}")
            check(
                EOS not in forced and text.startswith(spelled),
                contract,
                where,
                f"a tokenization of a prefix of {text!r}",
                forced,
            )
            check(
                m.num_accepted == len(path) and allowed_set(m) == before,
                contract,
                _input(c, f"state after forced_tokens() at {list(path)}"),
                "unchanged",
                "changed",
            )
            check(
                m.fork().accept_tokens(forced) == len(forced),
                contract,
                _input(c, f"accept the forced tokens {forced}"),
                len(forced),
                "fewer",
            )


@conformance_property(
    "toy_root_token_ignored",
    "the tree root is the last committed token, already accepted: its id (even a stop token's, "
    "e.g. a prompt ending in EOS) does not change any row",
    "toy",
)
def toy_root_token_ignored(session: Session) -> None:
    contract = "the root's token does not affect the tree fill"
    for c in _g(session):
        m = _at(session, c, [])
        for root in (EOS, 10, 19):
            tree = DraftTree.from_parents([root, 1, 3, 11], [-1, 0, 1, 0])
            bm = allocate_token_bitmask(tree.num_nodes, TOY_WIDTH)
            valid = m.fill_tree_bitmask(tree, bm)
            check(
                valid.tolist() == [True] * 4,
                contract,
                _input(c, f"start state, {tree}"),
                [True] * 4,
                valid.tolist(),
            )
            for node, expected in enumerate([{1, 11}, {3}, {5}, {7, 8}]):
                check_equal_sets(
                    m,
                    contract,
                    _input(c, f"root token {root}: row of node {node}"),
                    expected,
                    allowed_set(m, bm, node),
                )
