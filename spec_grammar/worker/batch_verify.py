"""Greedy verification of a whole batch with one device-to-host read-back.

The per-request path (:func:`~spec_grammar.worker.sampling.process_tree_logits` then
:func:`~spec_grammar.worker.verify.verify_greedy`) copies every request's mask and reads every
request's argmax back separately: ``B`` host synchronizations per step. For requests whose
processed logits are just the masked logits (temperature 0, no penalties, no logit bias) this
module does the same decision for the batch at once:

1. every row's unmasked greedy token (:func:`~spec_grammar.kernels.row_argmax`; the runner
   computes it inside its CUDA graph) comes back with one ``.tolist()``;
2. the tree walks (:func:`~spec_grammar.worker.verify.greedy_walk`) run on the host on those
   tokens; for each grammar row a walk visited, the host reads ONE word of the step's host
   bitmask (filled while the forward ran): when the grammar allows the row's greedy token, that
   token is the row's masked argmax too (it is the first index of the row's maximum, so no
   allowed token before it ties with it), and a row whose logits are all ``-inf`` is ``-1``
   under any mask;
3. only visited rows whose grammar forbids the greedy token (the model wants a token its
   grammar forbids) are masked on the device: their bitmask rows go up,
   :func:`~spec_grammar.kernels.masked_argmax` gives their best allowed token (a second
   read-back, only in steps that have such rows) and those walks run again. Rows of rejected
   branches are never read: a step's check costs a few words per request, not its tree;
4. requests verified *lazily* have no rows at all: their walks hand the greedy tokens they
   read to the request's matcher (:class:`_LazyWalk`), and a row is filled (one row) only where
   the grammar refuses its greedy token; the masked rows of steps 3 and 4 share one round trip.

With a model that mostly agrees with its grammar, a constrained step then costs what an
unconstrained one does: no bitmask upload and no masked kernel (before, the whole bitmask went
up and a masked argmax ran over every row: two Triton launches and a stream wait, 0.1-0.2 ms of
host time that a 1.3 ms forward of a small model could not hide). The result is exactly
``verify_greedy`` over ``process_tree_logits`` (the CPU tests check it against that oracle).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import kernels
from ..bitmask import bitmask_width
from ..errors import BitmaskError, GrammarStateError, SpecGrammarError
from ..kernels import masked_argmax
from ..tree import DraftTree
from .sampling import SamplingParams
from .verify import greedy_walk, node_validity

if TYPE_CHECKING:
    from ..protocol import SpecGrammar

__all__ = [
    "GreedyBatchStats",
    "GreedyRequest",
    "batch_greedy_eligible",
    "launch_masked_rows",
    "pre_accept_first_branch",
    "verify_greedy_batch",
]

Verified = tuple[list[int], int] | GrammarStateError


def batch_greedy_eligible(params: SamplingParams) -> bool:
    """True when a request's processed logits are the masked raw logits and verification is
    greedy, i.e. :func:`verify_greedy_batch` decides exactly as the per-request path."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
        and not params.logit_bias
        and not params.logprobs
    )


@dataclass(frozen=True)
class GreedyRequest:
    """One request of :func:`verify_greedy_batch`: where its grammar rows are, if anywhere.

    Attributes:
        index: its batch index (its rows of the logits, its tree in the trees).
        offset: the first row of its tree in the step's bitmask, or None (no filled rows).
        valid: ``(N,)`` bool node validity from its tree fill, or None (all valid).
        stop_token_ids: tokens never expanded.
        matcher: for a request verified *lazily* (no bitmask rows: ``offset`` None), its
            matcher at the state after its committed tokens. Its walk asks the matcher for each
            greedy token it reads (:class:`_LazyWalk`) and leaves it advanced by exactly the
            committed run (accepted path tokens + bonus).
        pre_accepted: for a lazy request, the nodes of a path from the root (root excluded)
            whose tokens its matcher has accepted already (:func:`pre_accept_first_branch`,
            under the forward): the walk keeps what its greedy path shares with them and rolls
            the rest back.
    """

    index: int
    offset: int | None = None
    valid: torch.Tensor | None = None
    stop_token_ids: Collection[int] = ()
    matcher: SpecGrammar | None = None
    pre_accepted: Sequence[int] = ()


@dataclass
class GreedyBatchStats:
    """What a :func:`verify_greedy_batch` call met: ``forbidden_rows``, the rows its walks
    visited whose grammar forbids their greedy token (each masked on the device), and
    ``lazy_ms``, ``{batch index: milliseconds}`` of each lazy walk's grammar work (its matcher
    calls and row fills: work no forward hides)."""

    forbidden_rows: int = 0
    lazy_ms: dict[int, float] = field(default_factory=dict)


def verify_greedy_batch(
    logits: torch.Tensor,
    trees: Sequence[DraftTree],
    requests: Sequence[GreedyRequest],
    *,
    bitmask: torch.Tensor | None = None,
    row_argmax: torch.Tensor | None = None,
    masked_rows: torch.Tensor | None = None,
) -> tuple[dict[int, Verified], GreedyBatchStats]:
    """Greedy-verify ``requests`` of a verify forward (the module docstring's steps 1-4).

    Args:
        logits: ``(B, N_max, V)`` float32 from :meth:`ModelRunner.forward_trees`, any device.
        trees: the ``B`` draft trees.
        requests: the requests to verify, one :class:`GreedyRequest` each (requests for which
            :func:`batch_greedy_eligible`), distinct batch indices.
        bitmask: ``(rows, W)`` int32 host tensor holding the grammar rows of every request with
            an ``offset``, or None. Only single words are read on the host; rows the device
            needs are copied out of it before this returns.
        row_argmax: ``(B, N_max)`` int64 on the logits' device, the
            :func:`~spec_grammar.kernels.row_argmax` of ``logits`` (the runner's graph computes
            it: ``forward_trees(..., with_argmax=True)``); computed here when None.
        masked_rows: ``(rows,)`` int64 on the logits' device, the masked argmax of every
            bitmask row queued while the forward ran (:func:`launch_masked_rows`): read back
            with the greedy tokens, it replaces the device round trip of step 3.

    Returns ``{batch index: (accepted nodes root first, bonus token)}``, or the
    :class:`GrammarStateError` of a request whose root row allows no token or whose matcher
    failed (the caller ends that request alone), and the call's :class:`GreedyBatchStats`.
    Raises :class:`BitmaskError` on inputs that do not fit together (batch indices, tree sizes,
    ``valid``, ``row_argmax`` or ``masked_rows`` shapes, grammar requests without a bitmask or
    with rows outside it, a request with both bitmask rows and a lazy matcher,
    ``pre_accepted`` nodes that are not a path from the root, early rows that this bitmask
    forbids).
    """
    if not requests:
        return {}, GreedyBatchStats()
    b, n_max, vocab = _check_batch(logits, trees, [r.index for r in requests], row_argmax)
    # everything that needs no logits first: the device may still be computing them
    masked = [(r.offset, r.index) for r in requests if r.offset is not None]
    rows_of = _grammar_rows(bitmask, masked, trees, b, n_max)
    words = bitmask.numpy() if masked else None
    if masked_rows is not None:
        _check_masked_rows(masked_rows, bitmask, logits.device)
    walks = _lazy_walks(trees, requests, n_max, vocab)
    filled = {
        r.index: _FilledWalk(
            trees[r.index],
            r.index * n_max,
            node_validity(r.valid, trees[r.index].num_nodes),
            r.stop_token_ids,
        )
        for r in requests
        if r.index not in walks
    }
    top = row_argmax if row_argmax is not None else kernels.row_argmax(logits)
    best, early = _read_back(top.reshape(b * n_max), masked_rows)
    batch = _Batch(logits, n_max, bitmask, words, rows_of, best, early)
    out = batch.walk(filled, walks)
    return out, GreedyBatchStats(len(batch.resolved), {i: w.ms for i, w in walks.items()})


def _read_back(
    flat_top: torch.Tensor, masked_rows: torch.Tensor | None
) -> tuple[list[int], list[int] | None]:
    """The greedy token of every row and, if queued, every bitmask row's masked argmax: the
    step's one device-to-host synchronization."""
    if masked_rows is None:
        return flat_top.tolist(), None
    both = torch.cat([flat_top, masked_rows]).tolist()
    return both[: flat_top.shape[0]], both[flat_top.shape[0] :]


class _FilledWalk:
    """The greedy walk of one request with filled rows (or none), from flat row ``base``."""

    __slots__ = ("tree", "base", "ok", "stops")

    def __init__(self, tree: DraftTree, base: int, ok: list[bool], stops: Collection[int]):
        self.tree, self.base, self.ok, self.stops = tree, base, ok, stops


class _Batch:
    """The walks of one :func:`verify_greedy_batch` call, with rounds of device masking in
    between.

    Args:
        logits: ``(B, N_max, V)``, as given.
        n_max: ``N_max``.
        bitmask: the step's ``(rows, W)`` int32 host bitmask, or None; ``words`` its numpy view
            (None without grammar rows).
        rows_of: per flat logits row (``i * N_max + node``), its bitmask row or -1.
        best: per flat row, its greedy token (replaced by its masked argmax once resolved).
        early: per bitmask row, its masked argmax queued while the forward ran, or None.
    """

    def __init__(
        self,
        logits: torch.Tensor,
        n_max: int,
        bitmask: torch.Tensor | None,
        words: np.ndarray | None,
        rows_of: list[int],
        best: list[int],
        early: list[int] | None,
    ):
        self.logits, self.n_max, self.vocab = logits, n_max, logits.shape[2]
        self.bitmask, self.words, self.rows_of = bitmask, words, rows_of
        self.best, self.early = best, early
        self.resolved: set[int] = set()  # rows whose masked argmax replaced the greedy token

    def walk(
        self, filled: dict[int, _FilledWalk], walks: dict[int, _LazyWalk]
    ) -> dict[int, Verified]:
        """Walk every request, then again the ones that read a row whose grammar forbids its
        greedy token (filled rows) or that stopped at a row their grammar refuses (lazy), once
        those rows' masked argmax is known, until every walk is final."""
        out: dict[int, Verified] = {}
        todo, lazy = list(filled), list(walks)
        while todo or lazy:
            unknown: list[int] = []
            retry = []
            for i in todo:
                w = filled[i]
                out[i], rows = _walk_filled(
                    w.tree,
                    w.base,
                    self.best,
                    self.rows_of,
                    self.words,
                    self.resolved,
                    w.ok,
                    self.vocab,
                    w.stops,
                )
                if rows:  # the walk read a row whose grammar forbids its greedy token
                    unknown.extend(rows)
                    retry.append(i)
            if self.early is not None:  # rows masked while the forward ran: no round trip
                self._take_early(unknown)
            need = [r for r in unknown if r not in self.resolved]
            masks = (
                [self.bitmask[torch.tensor([self.rows_of[r] for r in need], dtype=torch.long)]]
                if need
                else []
            )
            blocked = []
            for i in lazy:
                r = walks[i].walk(self.best, self.resolved)
                if r is None:
                    out[i] = walks[i].result
                else:
                    blocked.append(i)
                    need.append(r)
            if blocked:  # the rows lazy walks stopped at, filled now
                masks.append(_fill_rows([walks[i] for i in blocked], bitmask_width(self.vocab)))
            if need:
                _resolve(self.logits, self.best, need, _stack(masks), self.n_max)
                self.resolved.update(need)
            todo, lazy = retry, blocked
        return out

    def _take_early(self, unknown: list[int]) -> None:
        """The early masked argmax of ``unknown`` rows (NaN / +inf rows excepted: their
        masked row decides), checked against this step's bitmask."""
        words, rows_of, best, early = self.words, self.rows_of, self.best, self.early
        for r in [r for r in unknown if best[r] != kernels.NONFINITE]:
            if not _allows(words, rows_of[r], early[rows_of[r]]):
                raise BitmaskError(
                    f"masked_rows[{rows_of[r]}] = {early[rows_of[r]]}, a token this step's bitmask "
                    "forbids: the early rows come from another bitmask"
                )
            best[r] = early[rows_of[r]]
            self.resolved.add(r)


def _walk_filled(
    tree: DraftTree,
    base: int,
    best: list[int],
    rows_of: list[int],
    words: np.ndarray | None,
    resolved: set[int],
    ok: list[bool],
    vocab: int,
    stops: Collection[int],
) -> tuple[Verified, list[int]]:
    """The greedy walk of one request with filled rows (or none) over ``best`` from flat row
    ``base``, and the flat rows it read whose greedy token its bitmask forbids (not yet
    ``resolved``): when there are any, the walk must run again once they are masked."""
    best_i = best[base : base + tree.num_nodes]
    # a NaN / +inf maximum of a grammar row is decided by its masked row: visit it
    alive = [
        t >= 0 or (t == kernels.NONFINITE and rows_of[base + k] >= 0 and base + k not in resolved)
        for k, t in enumerate(best_i)
    ]
    try:
        got: Verified = greedy_walk(tree, best_i, alive, ok, vocab, stops)
    except GrammarStateError as e:
        got = e
    visited = got[0] if isinstance(got, tuple) else [0]
    forbidden = [
        r
        for r in (base + node for node in visited)
        if rows_of[r] >= 0 and r not in resolved and not _allows(words, rows_of[r], best[r])
    ]
    return got, forbidden


class _LazyWalk:
    """The greedy walk of one request verified without a tree fill.

    The walk follows the rows' greedy tokens from the root as if the grammar allowed them all,
    then hands the tokens it read to the matcher in one ``accept_tokens`` call: a greedy token
    the grammar allows is the row's masked argmax too (the row's first maximum). Where the
    grammar refuses one, the matcher holds the tokens before it and the walk stops at that row
    until its masked argmax is known (:meth:`fill` gives the row's mask); a row whose maximum is
    NaN or +inf stops it too. A child whose row turns out dead (no allowed token with a finite
    logit) is taken back as the bonus, as :func:`~spec_grammar.worker.verify.greedy_walk`
    decides before entering it: same committed tokens, same accepted nodes. The matcher ends
    advanced by exactly the committed run (accepted path tokens + bonus)."""

    __slots__ = ("tree", "matcher", "base", "stops", "pre", "node", "accepted", "ms", "result")

    def __init__(
        self,
        tree: DraftTree,
        matcher: SpecGrammar,
        base: int,
        stops: Collection[int],
        pre: Sequence[int] = (),
    ):
        self.tree, self.matcher, self.base, self.stops = tree, matcher, base, stops
        self.pre = list(pre)  # nodes from the root whose tokens the matcher holds already
        self.node = 0
        self.accepted = [0]
        self.ms = 0.0
        self.result: Verified | None = None

    def walk(self, best: list[int], resolved: set[int]) -> int | None:
        """Walk on over ``best`` (flat greedy or, for ``resolved`` rows, masked tokens): None
        once :attr:`result` is set, else the flat row whose masked argmax it needs."""
        if self.result is not None:  # its row fill failed: the walk ends with that error
            return None
        t0 = time.perf_counter()
        try:
            return self._walk(best, resolved)
        except SpecGrammarError as e:
            self.result = e if isinstance(e, GrammarStateError) else GrammarStateError(str(e))
        except Exception as e:  # a grammar fault ends this request only
            self.result = GrammarStateError(
                f"the grammar failed during verification: {type(e).__name__}: {e}"
            )
        finally:
            self.ms += (time.perf_counter() - t0) * 1e3
        return None

    def _walk(self, best: list[int], resolved: set[int]) -> int | None:
        tokens, first, sibling = (
            self.tree.token_list,
            self.tree.first_child_list,
            self.tree.next_sibling_list,
        )
        # the greedy chain from here: the token read at each row, the node it leads to (-1: none)
        run: list[int] = []
        nodes: list[int] = []
        node, dead = self.node, False
        while True:
            g = best[self.base + node]
            if g == -1:  # no allowed token has a finite logit: the row is dead
                dead = True
                break
            if g < 0:  # NaN / +inf maximum: its masked row decides
                break
            run.append(g)
            c = -1 if g in self.stops else first[node]
            while c != -1 and tokens[c] != g:
                c = sibling[c]
            nodes.append(c)
            if c == -1:
                break
            node = c
        # tokens the matcher holds already (pre-accepted along the draft's first branch) count
        # where the greedy path took the same nodes; the others go back
        j, pre = 0, self.pre
        while j < len(pre) and j < len(nodes) and nodes[j] == pre[j]:
            j += 1
        if len(pre) > j:
            self.matcher.rollback(len(pre) - j)
        self.pre = []
        n = j + (self.matcher.accept_tokens(run[j:]) if len(run) > j else 0)
        has_bonus = bool(nodes) and nodes[-1] == -1  # the chain ended at a token no child has
        self.accepted += (nodes[:-1] if has_bonus else nodes)[:n]
        if n < len(run) or not (dead or has_bonus):
            # refused at the row of node n (or a NaN/+inf row reached): mask that row
            self.node = self.accepted[-1]
            r = self.base + self.node
            if n < len(run) and r in resolved:
                raise GrammarStateError(
                    f"the grammar refused token {run[n]}, which its own mask allows (a mask/accept mismatch)"
                )
            return r
        if dead:
            if len(self.accepted) == 1:
                raise GrammarStateError(
                    "the processed row of node 0 allows no token: nothing can be sampled"
                )
            self.result = (self.accepted[:-1], tokens[self.accepted[-1]])
        else:
            self.result = (self.accepted, run[-1])
        return None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed set of the row this walk stopped at into ``bitmask[row]`` (left as it
        is, zero, where the grammar terminated: a stop token that is not a stop of this walk)."""
        t0 = time.perf_counter()
        try:
            if not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(bitmask, row)
        finally:
            self.ms += (time.perf_counter() - t0) * 1e3


def _lazy_walks(
    trees: Sequence[DraftTree], requests: Sequence[GreedyRequest], n_max: int, vocab: int
) -> dict[int, _LazyWalk]:
    walks = {}
    for r in requests:
        i, m = r.index, r.matcher
        if m is None:
            continue
        if r.offset is not None:
            raise BitmaskError(f"request {i} has both bitmask rows and a lazy matcher")
        if m.info.vocab_size != vocab:
            raise BitmaskError(
                f"request {i}'s matcher masks {m.info.vocab_size} tokens, the logits have {vocab}"
            )
        pre = list(r.pre_accepted)
        parents = trees[i].parent_list
        if any(not 0 < c < len(parents) or parents[c] != p for p, c in zip([0] + pre, pre)):
            raise BitmaskError(
                f"pre_accepted[{i}] = {pre} is not a path from the root of request {i}'s tree"
            )
        walks[i] = _LazyWalk(trees[i], m, i * n_max, frozenset(r.stop_token_ids), pre)
    return walks


def pre_accept_first_branch(matcher: SpecGrammar, tree: DraftTree) -> list[int]:
    """Accept the tokens of ``tree``'s first branch (first child of the root, its first
    child, ...) on ``matcher``, as far as its grammar allows and at most
    ``matcher.max_rollback_tokens`` of them; returns those nodes, for
    :func:`verify_greedy_batch`'s ``pre_accepted``.

    Drafters put their best guess first, so the greedy walk mostly takes this branch: run while
    the forward computes, this leaves the walk after it one rollback and about one accept (the
    bonus token) instead of an accept per committed token. Raises what the matcher raises."""
    first, tokens = tree.first_child_list, tree.token_list
    vocab = matcher.info.vocab_size
    chain = []
    c = first[0]
    # no deeper than the matcher can roll back: the walk may have to take all of it back
    while c != -1 and 0 <= tokens[c] < vocab and len(chain) < matcher.max_rollback_tokens:
        chain.append(c)
        c = first[c]
    n = matcher.accept_tokens([tokens[c] for c in chain]) if chain else 0
    return chain[:n]


def _fill_rows(walks: Sequence[_LazyWalk], width: int) -> torch.Tensor:
    """``(len(walks), width)`` int32 host rows: the mask of the row each walk stopped at. A walk
    whose fill raises gets a zero row and its error as its result (it ends with that error)."""
    masks = torch.zeros((len(walks), width), dtype=torch.int32)
    for k, w in enumerate(walks):
        try:
            w.fill(masks, k)
        except Exception as e:  # a grammar fault ends this request only
            masks[k] = 0
            w.result = GrammarStateError(
                f"the grammar failed while filling a row: {type(e).__name__}: {e}"
            )
    return masks


def launch_masked_rows(
    logits: torch.Tensor,
    device_bitmask: torch.Tensor,
    trees: Sequence[DraftTree],
    offsets: Sequence[int | None],
) -> torch.Tensor | None:
    """Queue the masked argmax of every bitmask row on the logits' stream; no synchronization.

    Args:
        logits: ``(B, N_max, V)`` (its forward may still be running).
        device_bitmask: ``(rows, W)`` int32 on the logits' device, the step's bitmask.
        trees, offsets: as in :func:`verify_greedy_batch`.

    Returns ``(rows,)`` int64 (:func:`~spec_grammar.kernels.masked_argmax` of bitmask row ``k``
    over its logits row) for ``masked_rows``, or None when the bitmask rows are not exactly the
    trees' rows one request after another (a request whose fill failed left a gap).
    """
    b, n_max, vocab = logits.shape
    flat, per = _flat_rows(logits)
    idx: list[int] = []
    for off, i in sorted((off, i) for i, off in enumerate(offsets) if off is not None):
        if off != len(idx):
            return None
        idx.extend(range(i * per, i * per + trees[i].num_nodes))
    if len(idx) != device_bitmask.shape[0]:
        return None
    if not idx:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    if idx == list(range(flat.shape[0])):  # every row, in order (full trees, requests in order)
        return masked_argmax(flat, device_bitmask)
    rows = torch.tensor(idx, dtype=torch.long, pin_memory=flat.is_cuda).to(
        flat.device, non_blocking=True
    )
    return masked_argmax(flat, device_bitmask, rows)


def _flat_rows(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(rows, V)`` view of ``(B, N, V)`` logits and the row distance of batch indices in it.

    The runner hands out ``[:B, :N]`` of its graph's larger output: ``reshape`` would copy all
    of it (hundreds of MB at 64 x 128k); a strided view over the parent's rows copies nothing.
    """
    b, n, v = logits.shape
    s0, s1, s2 = logits.stride()
    if s2 == 1 and s1 >= v and s0 >= s1 * n and s0 % s1 == 0:
        per = s0 // s1
        return logits.as_strided(((b - 1) * per + n, v), (s1, 1)), per
    return logits.reshape(b * n, v), n


def _check_batch(
    logits: torch.Tensor,
    trees: Sequence[DraftTree],
    selected: Sequence[int],
    row_argmax: torch.Tensor | None,
) -> tuple[int, int, int]:
    """``(B, N_max, V)`` after checking that the batch's arguments fit together."""
    if logits.dim() != 3:
        raise BitmaskError(f"logits must be (B, N_max, V), got shape {tuple(logits.shape)}")
    b, n_max, vocab = logits.shape
    if len(trees) != b:
        raise BitmaskError(f"{len(trees)} draft trees for a batch of {b}")
    if len(set(selected)) != len(selected) or any(not 0 <= i < b for i in selected):
        raise BitmaskError(
            f"selected must be distinct batch indices in [0, {b}), got {list(selected)}"
        )
    for i in selected:
        if trees[i].num_nodes > n_max:
            raise BitmaskError(
                f"request {i}'s tree has {trees[i].num_nodes} nodes, the logits {n_max} rows"
            )
    if row_argmax is not None and (
        row_argmax.shape != (b, n_max)
        or row_argmax.dtype != torch.long
        or row_argmax.device != logits.device
    ):
        raise BitmaskError(
            f"row_argmax must be ({b}, {n_max}) int64 on {logits.device}, got {row_argmax.dtype} "
            f"{tuple(row_argmax.shape)} on {row_argmax.device}"
        )
    return b, n_max, vocab


def _check_masked_rows(
    masked_rows: torch.Tensor, bitmask: torch.Tensor | None, device: torch.device
) -> None:
    rows = 0 if bitmask is None else bitmask.shape[0]
    if (
        masked_rows.shape != (rows,)
        or masked_rows.dtype != torch.long
        or masked_rows.device != device
    ):
        raise BitmaskError(
            f"masked_rows must be ({rows},) int64 on {device} (one per bitmask row), got "
            f"{masked_rows.dtype} {tuple(masked_rows.shape)} on {masked_rows.device}"
        )


def _allows(words: np.ndarray, row: int, token: int) -> bool:
    """Whether ``token`` (a row's greedy token) is final under bitmask ``row``: allowed by it,
    or ``-1`` (the row's logits are all ``-inf``: ``-1`` under any mask). A
    :data:`~spec_grammar.kernels.NONFINITE` row is never final."""
    if token < 0:
        return token == -1
    return token < words.shape[1] * 32 and (int(words[row, token >> 5]) >> (token & 31)) & 1 == 1


def _grammar_rows(
    bitmask: torch.Tensor | None,
    masked: Sequence[tuple[int, int]],
    trees: Sequence[DraftTree],
    b: int,
    n_max: int,
) -> list[int]:
    """Per logits row (``B * N_max``), its bitmask row, -1 for rows without a grammar.
    ``masked``: ``(first bitmask row, batch index)`` per grammar request."""
    rows_of = [-1] * (b * n_max)
    if not masked:
        return rows_of
    if bitmask is None:
        raise BitmaskError("grammar requests need the step's bitmask")
    if bitmask.device.type != "cpu" or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise BitmaskError(
            f"the step's bitmask must be a 2-D int32 host tensor, got {bitmask.dtype} "
            f"{tuple(bitmask.shape)} on {bitmask.device}"
        )
    for off, i in masked:
        n = trees[i].num_nodes
        if off < 0 or off + n > bitmask.shape[0]:
            raise BitmaskError(
                f"request {i}'s tree of {n} nodes needs bitmask rows {off}..{off + n - 1}, "
                f"the bitmask has {bitmask.shape[0]}"
            )
        rows_of[i * n_max : i * n_max + n] = range(off, off + n)
    return rows_of


def _stack(masks: list[torch.Tensor]) -> torch.Tensor:
    """Host mask rows of different widths (a step bitmask narrower than the logits, lazily
    filled rows as wide as them) as one tensor; missing words are zero (forbidden)."""
    width = max(m.shape[1] for m in masks)
    return torch.cat(
        [
            m if m.shape[1] == width else torch.nn.functional.pad(m, (0, width - m.shape[1]))
            for m in masks
        ]
    )


def _resolve(
    logits: torch.Tensor, best: list[int], rows: list[int], masks: torch.Tensor, n_max: int
) -> None:
    """The masked argmax of flat rows ``rows`` (``i * n_max + node``) under host ``masks``
    ``(len(rows), W)`` int32, into ``best``: one upload and one read-back. Rows whose maximum
    is NaN or +inf are decided as the per-request path does: the masked float32 row's argmax,
    or ``-1`` (no token) when its maximum is not finite."""
    flat, per = _flat_rows(logits)
    dev = masks.to(flat.device, non_blocking=True)
    fast = [k for k, r in enumerate(rows) if best[r] != kernels.NONFINITE]
    exact = [k for k, r in enumerate(rows) if best[r] == kernels.NONFINITE]
    got: dict[int, int] = {}
    if fast:
        idx = torch.tensor([rows[k] // n_max * per + rows[k] % n_max for k in fast]).to(
            flat.device, non_blocking=True
        )
        sel = dev if len(fast) == len(rows) else dev[torch.tensor(fast, device=dev.device)]
        got.update(zip(fast, masked_argmax(flat, sel, idx).tolist()))
    if exact:
        i = torch.tensor([rows[k] // n_max for k in exact], device=logits.device)
        j = torch.tensor([rows[k] % n_max for k in exact], device=logits.device)
        x = logits[i, j].float()
        kernels.apply_token_bitmask_inplace(x, dev[torch.tensor(exact, device=dev.device)])
        dead = ~torch.isfinite(x.amax(dim=-1))
        got.update(zip(exact, x.argmax(dim=-1).masked_fill_(dead, -1).tolist()))
    for k, r in enumerate(rows):
        best[r] = got[k]
