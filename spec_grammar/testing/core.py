"""The property registry and what every property shares: the backend session, allowed-set
helpers and the failure type that names the contract, the input and both allowed sets.

A property is a plain function ``fn(session) -> None`` registered with
:func:`conformance_property`; it raises :class:`ConformanceFailure` when the backend breaks
the contract, :class:`PropertySkipped` when the backend cannot run it (a missing grammar kind).
Both runners (``spec-grammar conformance`` and the pytest plugin) call the same functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..bitmask import allocate_token_bitmask
from ..capabilities import ConformanceCase
from ..errors import GrammarCompileError
from ..protocol import GrammarBackend, SpecGrammar
from ..specs import GrammarSpec

__all__ = [
    "BackendFactory",
    "ConformanceFailure",
    "PropertySkipped",
    "Property",
    "PROPERTIES",
    "conformance_property",
    "Session",
    "allowed_set",
    "describe_ids",
    "check_equal_sets",
]

BackendFactory = Callable[..., GrammarBackend]
"""``factory(tokenizer, vocab_size=V) -> GrammarBackend``: a backend class or any callable
with that signature (the backend's other options at their defaults)."""


class ConformanceFailure(AssertionError):
    """A backend broke a contract.

    Attributes:
        contract: the protocol rule (one sentence).
        input: what was fed (grammar, token path, tree), as text.
        expected / actual: allowed token-id sets (or other values) for the report.
        decode: ``ids -> text`` used to show the sets as decoded text.
    """

    def __init__(
        self,
        contract: str,
        input: str,
        expected: Any = None,
        actual: Any = None,
        *,
        decode: Callable[[Sequence[int]], str] | None = None,
    ):
        self.contract = contract
        self.input = input
        self.expected = expected
        self.actual = actual
        self.decode = decode
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"contract: {self.contract}", f"input:    {self.input}"]
        if self.expected is not None or self.actual is not None:
            lines.append(f"expected: {self._show(self.expected)}")
            lines.append(f"actual:   {self._show(self.actual)}")
            if _is_id_set(self.expected) and _is_id_set(self.actual):
                missing = sorted(set(self.expected) - set(self.actual))
                extra = sorted(set(self.actual) - set(self.expected))
                lines.append(f"missing:  {self._show(missing)}")
                lines.append(f"extra:    {self._show(extra)}")
        return "\n".join(lines)

    def _show(self, value: Any) -> str:
        if _is_id_set(value) and self.decode is not None:
            return describe_ids(sorted(value), self.decode)
        return repr(value)


class PropertySkipped(Exception):
    """The backend cannot run this property (it lacks every grammar kind the property uses)."""


def _is_id_set(value: Any) -> bool:
    return isinstance(value, (set, frozenset, list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def describe_ids(
    ids: Sequence[int], decode: Callable[[Sequence[int]], str], limit: int = 24
) -> str:
    """``ids`` with each token's decoded text, e.g. ``{7 '1', 8 '2'}``; long sets are cut."""
    ids = list(ids)
    shown = ", ".join(f"{t} {decode([t])!r}" for t in ids[:limit])
    more = f", ... ({len(ids)} ids)" if len(ids) > limit else ""
    return "{" + shown + more + "}"


@dataclass(frozen=True)
class Property:
    """One registered property.

    Attributes:
        name: unique id (also the pytest test id).
        contract: the protocol rule it checks, one sentence (printed on failure).
        fixture: tokenizer it runs on, ``"toy"`` or ``"smollm2"``.
        fn: ``fn(session) -> None``.
    """

    name: str
    contract: str
    fixture: str
    fn: Callable[[Session], None]


PROPERTIES: dict[str, Property] = {}
"""Every registered property by name, in registration order."""


def conformance_property(name: str, contract: str, fixture: str) -> Callable:
    """Decorator registering ``fn(session)`` as property ``name``."""
    if fixture not in ("toy", "smollm2"):
        raise ValueError(f"unknown fixture {fixture!r}")

    def register(fn: Callable[[Session], None]) -> Callable[[Session], None]:
        if name in PROPERTIES:
            raise ValueError(f"conformance property {name!r} is registered twice")
        PROPERTIES[name] = Property(name, contract, fixture, fn)
        return fn

    return register


@dataclass
class Session:
    """One backend under test: builds it once per fixture tokenizer and caches it.

    Args:
        factory: ``factory(tokenizer, vocab_size=V)``, see :data:`BackendFactory`.
        slow: run the long mode (more hypothesis examples, every data-set entry).
        seed: hypothesis seed source; ``None`` = derandomized (same examples every run).
    """

    factory: BackendFactory
    slow: bool = False
    seed: int | None = None
    _backends: dict[str, GrammarBackend] = field(default_factory=dict)

    def backend(self, fixture: str) -> GrammarBackend:
        """The backend built on fixture tokenizer ``fixture`` (``"toy"`` or ``"smollm2"``)."""
        if fixture not in self._backends:
            from .fixtures import fixture_tokenizer

            tok, width = fixture_tokenizer(fixture)
            self._backends[fixture] = self.factory(tok, vocab_size=width)
        return self._backends[fixture]

    def supported(
        self,
        fixture: str,
        specs: Iterable[GrammarSpec],
        *,
        must_compile: bool = True,
        with_cases: bool = False,
    ) -> list[tuple[GrammarSpec, Any]]:
        """``(spec, compiled)`` for each spec of a kind the backend's capabilities claim in
        whole (a kind claimed only in part, :attr:`Capabilities.subsets
        <spec_grammar.capabilities.Capabilities.subsets>`, runs none of the suite's grammars),
        then with ``with_cases`` each of the backend's own :meth:`conformance_cases
        <spec_grammar.protocol.GrammarBackend.conformance_cases>` on ``fixture``.

        With ``must_compile`` a claimed kind that fails to compile is a
        :class:`ConformanceFailure` (the suite's own grammars are plain); without it such specs
        are left out (real schemas may use keywords a backend refuses with a typed error).
        A backend's own case always must compile. Raises :class:`PropertySkipped` (not
        applicable) when nothing is left.
        """
        backend = self.backend(fixture)
        caps = backend.capabilities
        todo = [(s, must_compile) for s in specs if caps.whole(s.kind)]
        if with_cases:
            todo += [(c.spec, True) for c in self.cases(fixture)]
        out = []
        for spec, required in todo:
            try:
                out.append((spec, backend.compile(spec)))
            except GrammarCompileError as e:
                if required:
                    raise ConformanceFailure(
                        "a grammar of a kind the capabilities claim compiles",
                        spec.cache_key()[:300],
                        "compiled",
                        str(e),
                    ) from None
        if not out:
            narrow = f"; in part only: {', '.join(caps.describe())}" if caps.subsets else ""
            cases = " and none of its conformance_cases" if with_cases else ""
            raise PropertySkipped(
                f"not applicable: {backend.name} claims none of the grammars this property "
                f"uses{cases} on the {fixture} tokenizer{narrow}"
            )
        return out

    def cases(self, fixture: str) -> list[ConformanceCase]:
        """The backend's own :class:`~spec_grammar.capabilities.ConformanceCase` list on
        ``fixture`` (``TypeError`` when it returns something else)."""
        cases = list(self.backend(fixture).conformance_cases(fixture))
        wrong = [c for c in cases if not isinstance(c, ConformanceCase)]
        if wrong:
            raise TypeError(
                f"conformance_cases must return ConformanceCase items, got {wrong[0]!r}"
            )
        return cases


def allowed_set(
    matcher: SpecGrammar, bitmask: torch.Tensor | None = None, row: int = 0
) -> frozenset[int]:
    """Allowed token ids of ``matcher``'s current state (fills a fresh row, unless ``bitmask``
    is given: then the ids set in ``bitmask[row]``)."""
    if bitmask is None:
        if matcher.is_terminated():
            raise ConformanceFailure(
                "the matcher is live here (rollback/fork restored a non-terminated state)",
                "is_terminated() before filling the next mask",
                False,
                True,
            )
        bitmask = allocate_token_bitmask(1, matcher.info.vocab_size)
        bitmask.zero_()
        matcher.fill_next_token_bitmask(bitmask, 0)
        row = 0
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[
        : matcher.info.vocab_size
    ]
    return frozenset(np.flatnonzero(bits).tolist())


def check_equal_sets(
    matcher: SpecGrammar, contract: str, input: str, expected: Iterable[int], actual: Iterable[int]
) -> None:
    """Raise :class:`ConformanceFailure` unless the two id sets are equal."""
    exp, act = frozenset(expected), frozenset(actual)
    if exp != act:
        raise ConformanceFailure(contract, input, set(exp), set(act), decode=matcher.info.decode)


def check(
    condition: bool,
    contract: str,
    input: str,
    expected: Any = None,
    actual: Any = None,
    *,
    decode=None,
) -> None:
    """Raise :class:`ConformanceFailure` unless ``condition``."""
    if not condition:
        raise ConformanceFailure(contract, input, expected, actual, decode=decode)
