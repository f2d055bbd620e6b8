"""Every direct use of the peer libraries in the benchmarks, in one module: what spec-grammar is
compared with, written against each library's own API (xgrammar, llguidance, outlines-core, the
``transformers`` logits-processor path). The rest of the bench package goes through
spec-grammar's API (``GrammarBackend``, the worker).

**Naive tree fill** (``bench masks``): the fill engines use today. SGLang's ``traverse_tree``
(``speculative/spec_utils.py``, PR #6499): a recursive DFS over first-child / next-sibling
links; a node is accepted iff its token's bit is set in its parent's row; an accepted node is
``accept_token``-ed, its row filled (unless the grammar terminated), its first child visited,
then ``rollback(1)``; siblings are visited with the same parent row. It bypasses spec-grammar
entirely (no protocol, no checks), so it is the baseline our ``fill_tree_bitmasks`` is compared
with. Links and tokens are read from Python lists, not tensors (cheaper than SGLang's own 0-d
tensor indexing: a lower bound for naive). Each walker also exposes the library's own native
tree call where one exists (xgrammar ``traverse_draft_tree``), to show how much of our cost is
the library's. The walkers reach into the adapters only for the library objects a compiled
grammar holds (xgrammar's ``CompiledGrammar``, llguidance's grammar text and ``LLTokenizer``,
outlines-core's ``Index``); everything timed is a direct library call.

**Hugging Face ``generate`` + a grammar logits processor** (``bench e2e``): :class:`HFRow`
compiles the grammar with the library's own API and runs ``generate`` with xgrammar's
``xgrammar.contrib.hf.LogitsProcessor`` or :class:`LLGuidanceLogitsProcessor`;
:func:`xgrammar_mask_row` is the reference grammar's mask where two outputs diverge.

**Scripts**: :func:`mask_apply_functions` (the other libraries' bitmask apply kernels,
``benchmarks/bench_kernels.py``), :class:`XGrammarRawCompile` (xgrammar's JSON-schema compile
options without the adapter, ``benchmarks/bench_compile.py --options``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from spec_grammar.bitmask import allocate_token_bitmask
from spec_grammar.protocol import CompiledGrammar, GrammarBackend
from spec_grammar.specs import JsonSchema, ToolCalls
from spec_grammar.tree import DraftTree

__all__ = [
    "NaiveWalker",
    "naive_walker",
    "HFRow",
    "LLGuidanceLogitsProcessor",
    "xgrammar_mask_row",
    "mask_apply_functions",
    "library_version",
    "XGrammarRawCompile",
]


# -- naive tree fill (bench masks) ------------------------------------------------------------


class NaiveWalker:
    """Library-API matcher factory plus the SGLang-pattern DFS for one compiled grammar.

    Subclasses implement :meth:`new_matcher`, :meth:`accept`, :meth:`fill`, :meth:`rollback`,
    :meth:`terminated`; ``native_tree`` is None or a callable
    ``(matcher, tree, rows) -> None`` (the library's one-call tree fill).
    """

    native_tree: Callable[[Any, DraftTree, torch.Tensor], None] | None = None
    semantics_note: str | None = None
    """Set when the library's raw masks differ from the protocol's rows by design: the naive
    walk then visits a subset of our valid nodes and rows are not compared."""

    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        self.backend = backend
        self.compiled = compiled
        self.vocab = backend.tokenizer_info.tokenizer_vocab_size

    def new_matcher(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def start(self, prefix: list[int]) -> Any:
        """A fresh library matcher that has accepted ``prefix``. Raises ``ValueError`` if the
        library refuses a prefix token."""
        m = self.new_matcher()
        for t in prefix:
            if not self.accept(m, t):
                raise ValueError(f"{self.backend.name} refused prefix token {t}")
        return m

    def ignored_ids(self) -> list[int]:
        """Token ids where the library's raw rows differ from the adapter's by design (left
        out when rows are compared)."""
        return []

    def allocate(self, rows: int) -> torch.Tensor:
        """A bitmask this library can write: ``(rows, W)`` int32 with ``W = ceil(V/32)``
        unless the library needs more words per row."""
        return allocate_token_bitmask(rows, self.backend.vocab_size)

    def walk(
        self, m: Any, tree: DraftTree, bitmask: torch.Tensor, row_offset: int
    ) -> tuple[list[bool], list[bool]]:
        """SGLang ``traverse_tree`` on rows ``row_offset..row_offset+N-1`` of ``bitmask`` (from
        :meth:`allocate`). Returns ``(accepted, filled)`` flags per node; rows not filled are
        left as they were."""
        tokens = tree.token_list
        first_child = tree.first_child_list
        next_sibling = tree.next_sibling_list
        words = bitmask.numpy()
        vocab = self.vocab
        accepted_nodes = [False] * tree.num_nodes
        filled = [False] * tree.num_nodes
        accept, fill, rollback, terminated = self.accept, self.fill, self.rollback, self.terminated

        def dfs(curr: int, parent: int) -> None:
            if curr == 0:
                accepted = True
            else:
                t = tokens[curr]
                accepted = (
                    0 <= t < vocab and (int(words[row_offset + parent, t >> 5]) >> (t & 31)) & 1
                )
            if accepted:
                if curr != 0:
                    accept(m, tokens[curr])
                accepted_nodes[curr] = True
                if not terminated(m):
                    fill(m, bitmask, row_offset + curr)
                    filled[curr] = True
                    if first_child[curr] != -1:
                        dfs(first_child[curr], curr)
                if curr != 0:
                    rollback(m)
            if next_sibling[curr] != -1:
                dfs(next_sibling[curr], parent)

        dfs(0, -1)
        return accepted_nodes, filled

    # library operations ---------------------------------------------------------------------
    def accept(self, m: Any, token: int) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def rollback(self, m: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def terminated(self, m: Any) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class _XGrammarWalker(NaiveWalker):
    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        super().__init__(backend, compiled)
        import xgrammar as xgr

        self._xgr = xgr
        self.native_tree = self._traverse

    def new_matcher(self) -> Any:
        return self._xgr.GrammarMatcher(self.compiled.native)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, m: Any) -> None:
        m.rollback(1)

    def terminated(self, m: Any) -> bool:
        return m.is_terminated()

    @staticmethod
    def _traverse(m: Any, tree: DraftTree, rows: torch.Tensor) -> None:
        m.traverse_draft_tree(
            tree.retrieve_next_token, tree.retrieve_next_sibling, tree.tokens, rows
        )


class _LLGuidanceWalker(NaiveWalker):
    """``LLMatcher`` with ``consume_token`` / ``rollback`` and the ``llguidance.torch`` fill
    wrapper, as SGLang's llguidance grammar object uses them; terminated = ``is_stopped()``."""

    semantics_note = (
        "llguidance's raw masks allow only the canonical token where the grammar forces text "
        "(the adapter completes those rows), so the naive walk rejects some valid draft tokens "
        "and visits fewer nodes"
    )

    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        super().__init__(backend, compiled)
        import llguidance
        import llguidance.torch

        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._tokenizer = backend._llg_tokenizer
        self._text = compiled.native.text

    def new_matcher(self) -> Any:
        return self._llg.LLMatcher(self._tokenizer, self._text, log_level=0)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self._fill(m, bitmask, row)

    def rollback(self, m: Any) -> None:
        m.rollback(1)

    def terminated(self, m: Any) -> bool:
        return m.is_stopped()


class _OutlinesWalker(NaiveWalker):
    """outlines-core ``Guide`` over the adapter's ``Index``: ``write_mask_into``,
    ``advance(t, return_tokens=False)``, ``rollback_state(1)``. outlines-core has no notion of
    termination (and SGLang no outlines tree path), so nothing is treated as terminated. The
    Index holds the adapter's sentinel token at id ``V``, so rows get one extra word."""

    def __init__(self, backend: GrammarBackend, compiled: CompiledGrammar):
        super().__init__(backend, compiled)
        import outlines_core

        self._oc = outlines_core
        self._index = compiled.native.index
        self._words = (backend.vocab_size + 1 + 31) // 32

    def allocate(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self._words), -1, dtype=torch.int32)

    def ignored_ids(self) -> list[int]:
        # byte tokens that spell part of the sentinel: the raw Index allows them where the
        # grammar can end, the adapter refuses them
        return [int(t) for t in self.compiled.native._spelled_ids]

    def new_matcher(self) -> Any:
        return self._oc.Guide(self._index)

    def accept(self, m: Any, token: int) -> bool:
        m.advance(token, return_tokens=False)
        return True

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.write_mask_into(bitmask.data_ptr() + row * self._words * 4, self._words, 4)

    def rollback(self, m: Any) -> None:
        m.rollback_state(1)

    def terminated(self, m: Any) -> bool:
        return False


_WALKERS: dict[str, Callable[[GrammarBackend, CompiledGrammar], NaiveWalker]] = {
    "xgrammar": _XGrammarWalker,
    "llguidance": _LLGuidanceWalker,
    "outlines": _OutlinesWalker,
}


def naive_walker(backend: GrammarBackend, compiled: CompiledGrammar) -> NaiveWalker:
    """The naive walker for ``backend``'s library. Raises ``LookupError`` naming the reason
    when there is none (unknown library, or an adapter whose compiled object the walker cannot
    use)."""
    factory = _WALKERS.get(backend.name)
    if factory is None:
        raise LookupError(f"no library-API baseline written for backend {backend.name!r}")
    try:
        return factory(backend, compiled)
    except (AttributeError, TypeError, ImportError) as e:
        raise LookupError(f"library-API baseline for {backend.name!r} unavailable: {e}") from e


# -- Hugging Face generate + grammar logits processor (bench e2e) -------------------------------


class LLGuidanceLogitsProcessor:
    """A ``transformers`` logits processor over ``llguidance.LLMatcher`` (llguidance ships the
    tokenizer bridge ``llguidance.hf.from_tokenizer`` and the mask helpers in
    ``llguidance.torch`` but no processor; this is the one a user writes from them).

    Unlike xgrammar's, it does not assume one new token per call: it keeps the tokens it has
    consumed and, on each call, goes back to the common prefix with ``input_ids`` and consumes
    the rest, so it also follows HF's assisted generation (which calls processors on candidate
    prefixes, candidates the grammar may forbid). Going back uses ``rollback`` unless the
    matcher had stopped in between: llguidance 1.9.1 rolled back from a stop accepts tokens
    the grammar forbids (seen here: ``{"a": 1}`` + EOS, ``rollback(1)``, then ``}`` is
    accepted), so it replays from a fresh copy instead. Forbidden candidates are not consumed
    (``try_consume_tokens``; the position is rejected by the verifier anyway). One sequence
    (batch 1). ``scores`` (1, V) float32 is masked in place (-inf where forbidden).
    """

    def __init__(self, ll_tokenizer: Any, grammar: str, prompt_len: int):
        import llguidance

        self._prototype = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._prototype.is_error():
            raise ValueError(self._prototype.get_error())
        self.matcher = self._prototype.deep_copy()
        self.prompt_len = prompt_len
        self.consumed: list[int] = []
        self.stop_len: int | None = None  # len(consumed) when the matcher first stopped
        self.vocab = ll_tokenizer.vocab_size

    def _consume(self, tokens: list[int]) -> bool:
        """Consume the grammar-valid prefix of ``tokens``; False if one was refused."""
        for tok in tokens:
            if self.matcher.try_consume_tokens([tok]) != 1:
                return False
            self.consumed.append(tok)
            if self.stop_len is None and self.matcher.is_stopped():
                self.stop_len = len(self.consumed)
        return True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        from llguidance.torch import (
            allocate_token_bitmask,
            apply_token_bitmask_inplace,
            fill_next_token_bitmask,
        )

        if input_ids.shape[0] != 1:
            raise ValueError("LLGuidanceLogitsProcessor handles one sequence")
        new = input_ids[0, self.prompt_len :].tolist()
        common = 0
        while common < min(len(new), len(self.consumed)) and new[common] == self.consumed[common]:
            common += 1
        if common < len(self.consumed):
            if self.stop_len is None:
                self.matcher.rollback(len(self.consumed) - common)
                del self.consumed[common:]
            else:
                self.matcher, self.consumed, self.stop_len = self._prototype.deep_copy(), [], None
                self._consume(new[:common])
        self._consume(new[len(self.consumed) :])
        mask = allocate_token_bitmask(1, self.vocab)
        fill_next_token_bitmask(self.matcher, mask)
        apply_token_bitmask_inplace(scores, mask.to(scores.device))
        return scores


class _FirstToken:
    """``streamer`` for ``generate``: records when the first output token arrives (the first
    ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.t_first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.t_first is None:
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


class HFRow:
    """Runs one HF row of ``bench e2e``: compiles the grammar with the library's own API, then
    ``generate`` with its logits processor.

    ``row``: the e2e ``RowSpec`` (``lib``: ``xgrammar`` / ``llguidance``; ``speculation``:
    ``none``, ``prompt_lookup``, ``assistant``); ``cfg``: the ``E2EBenchConfig``
    (``prompt_lookup_num_tokens``, ``assistant_layers``); the prompts given to :meth:`compile`
    and :meth:`generate` are ``E2EPrompt`` objects (``name``, ``spec``, ``prompt_ids``)."""

    def __init__(self, row: Any, cfg: Any, model: Any, tokenizer: Any, stop_ids: list[int]):
        self.row, self.cfg, self.model, self.tok = row, cfg, model, tokenizer
        self.vocab = int(model.config.vocab_size)
        self.stop_ids = stop_ids
        self.compiled: dict[str, Any] = {}
        self.assistant = None
        if row.speculation == "assistant":
            from spec_grammar.worker.drafters import truncated_model

            self.assistant = truncated_model(model, cfg.assistant_layers)
        if row.lib == "xgrammar":
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab, stop_token_ids=stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        elif row.lib == "llguidance":
            import llguidance.hf

            self._ll_tok = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=self.vocab, eos_token=stop_ids[0]
            )
        else:
            raise ValueError(f"no HF grammar processor for {row.lib!r}: use xgrammar or llguidance")

    def compile(self, p: Any) -> float:
        """Compile ``p``'s grammar (same whitespace as our adapters: ``", "`` and ``": "``);
        returns milliseconds."""
        spec = p.spec.to_json_schema() if isinstance(p.spec, ToolCalls) else p.spec
        if not isinstance(spec, JsonSchema):
            raise ValueError(f"the HF rows take JSON schemas and tool calls, got {spec.kind}")
        t0 = time.perf_counter()
        if self.row.lib == "xgrammar":
            self.compiled[p.name] = self._compiler.compile_json_schema(
                spec.schema_json(), any_whitespace=False, separators=(", ", ": "), strict_mode=False
            )
        else:
            import llguidance

            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                spec.schema_json(),
                overrides={
                    "whitespace_flexible": False,
                    "item_separator": ", ",
                    "key_separator": ": ",
                    "lenient": True,
                },
            )
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self._ll_tok
            )
            if is_error:
                raise ValueError(messages[0])
            self.compiled[p.name] = grammar
        return (time.perf_counter() - t0) * 1e3

    def processor(self, p: Any) -> Any:
        if self.row.lib == "xgrammar":
            from xgrammar.contrib.hf import LogitsProcessor

            return LogitsProcessor(self.compiled[p.name])
        return LLGuidanceLogitsProcessor(self._ll_tok, self.compiled[p.name], len(p.prompt_ids))

    def generate(self, p: Any, max_new_tokens: int) -> dict[str, Any]:
        from transformers import LogitsProcessorList

        ids = torch.tensor([p.prompt_ids])
        extra: dict[str, Any] = {}
        if self.row.speculation == "prompt_lookup":
            extra["prompt_lookup_num_tokens"] = self.cfg.prompt_lookup_num_tokens
        elif self.row.speculation == "assistant":
            extra["assistant_model"] = self.assistant
        forwards = [0]
        target = self.model

        def count(module: Any, *_: Any) -> None:
            # the assistant is a shallow copy of the target and shares its hook dict
            if module is target:
                forwards[0] += 1

        hook = self.model.register_forward_hook(count)
        streamer = _FirstToken()
        try:
            t0 = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([self.processor(p)]),
                eos_token_id=self.stop_ids,
                pad_token_id=self.stop_ids[0],
                streamer=streamer,
                **extra,
            )
            wall = time.perf_counter() - t0
        finally:
            hook.remove()
        gen = out[0, len(p.prompt_ids) :].tolist()
        stops = [i for i, t in enumerate(gen) if t in self.stop_ids]
        complete = bool(stops)
        gen = gen[: stops[0]] if stops else gen
        return {
            "token_ids": gen,
            "wall_s": wall,
            "forwards": forwards[0],
            "ttft_s": (streamer.t_first - t0) if streamer.t_first else None,
            "finish": "complete"
            if complete
            else ("length" if len(gen) >= max_new_tokens else "stopped"),
        }


def xgrammar_mask_row(compiled: Any, prefix: list[int], width: int) -> torch.Tensor:
    """The ``(ceil(width / 32),)`` int32 bitmask row of xgrammar's ``compiled`` grammar (an
    ``xgrammar.CompiledGrammar``, as :class:`HFRow` compiles it) after ``prefix``: a fresh
    ``GrammarMatcher`` fed the prefix token by token."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for t in prefix:
        matcher.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, width)
    matcher.fill_next_token_bitmask(mask)
    return mask[0]


# -- scripts ------------------------------------------------------------------------------------


def mask_apply_functions(device: str) -> dict[str, Callable[[torch.Tensor, torch.Tensor], Any]]:
    """The other libraries' in-place bitmask apply functions ``(logits, mask)`` that import
    here, by name: on CUDA xgrammar's ``cuda`` kernel (``xgrammar-cuda``; compiled with nvcc on
    first import, left out where that fails) and its ``triton`` one (``xgrammar-triton``), its
    ``cpu`` one elsewhere (``xgrammar``); ``llguidance.torch``. A library that does not import
    is reported and left out."""
    others = {}
    try:
        import xgrammar

        if device == "cuda":
            try:  # builds the CUDA extension now, not inside a timed call
                import xgrammar.kernels.apply_token_bitmask_inplace_cuda  # noqa: F401

                others["xgrammar-cuda"] = lambda l, m: xgrammar.apply_token_bitmask_inplace(
                    l, m, backend="cuda"
                )
            except Exception as e:  # noqa: BLE001 - e.g. no nvcc: benchmark without it
                print(f"xgrammar cuda kernel unavailable: {type(e).__name__}: {e}")
            others["xgrammar-triton"] = lambda l, m: xgrammar.apply_token_bitmask_inplace(
                l, m, backend="triton"
            )
        else:
            others["xgrammar"] = lambda l, m: xgrammar.apply_token_bitmask_inplace(
                l, m, backend="cpu"
            )
    except Exception as e:  # noqa: BLE001 - report, and benchmark without it
        print(f"xgrammar unavailable: {type(e).__name__}: {e}")
    try:
        import llguidance.torch as llg

        others["llguidance"] = llg.apply_token_bitmask_inplace
    except Exception as e:  # noqa: BLE001
        print(f"llguidance unavailable: {type(e).__name__}: {e}")
    return others


def library_version(name: str) -> str:
    """Installed version of the peer library ``name`` (a :func:`mask_apply_functions` name: the
    distribution is the part before any ``-``); ``"?"`` when it has no distribution metadata."""
    import importlib.metadata

    try:
        return importlib.metadata.version(name.split("-")[0])
    except importlib.metadata.PackageNotFoundError:
        return "?"


class XGrammarRawCompile:
    """xgrammar's own ``compile_json_schema`` for a Hugging Face tokenizer, without the adapter
    (its tokenizer info: ``vocab_size=len(tokenizer)``, the EOS token as stop token)."""

    def __init__(self, tokenizer: Any):
        import xgrammar as xgr

        self._xgr = xgr
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
            )

    def ebnf_chars(self, schema_json: str, **options: Any) -> int:
        """Length of the EBNF text xgrammar writes for ``schema_json`` with ``options``."""
        return len(str(self._xgr.Grammar.from_json_schema(schema_json, **options)))

    def compile_ms(self, schema_json: str, *, dynamic: bool, **options: Any) -> float:
        """Wall ms of one ``compile_json_schema`` on a fresh compiler (one thread, cache off,
        ``enable_dynamic_compilation=dynamic``); the compiler's construction is not timed."""
        c = self._xgr.GrammarCompiler(
            self.info, max_threads=1, cache_enabled=False, enable_dynamic_compilation=dynamic
        )
        t0 = time.perf_counter()
        c.compile_json_schema(schema_json, **options)
        return (time.perf_counter() - t0) * 1e3
