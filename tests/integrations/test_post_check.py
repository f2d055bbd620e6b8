"""The engines' strict switch (``SPEC_GRAMMAR_STRICT``, SGLang's older name too): read at engine
start, a typo refused rather than served unchecked. No engine needed."""

from __future__ import annotations

import pytest

from spec_grammar.integrations.post_check import STRICT_ENV, strict_from_env

pytestmark = pytest.mark.unit
OLD = "SPEC_GRAMMAR_SGLANG_STRICT"


@pytest.mark.parametrize(
    ("new", "old", "want"),
    [
        (None, None, False),
        ("1", None, True),
        ("0", "1", True),
        ("true", None, True),
        ("0", "0", False),
    ],
)
def test_either_name_turns_strict_on(monkeypatch, new, old, want):
    for name, value in ((STRICT_ENV, new), (OLD, old)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert strict_from_env(OLD) is want


def test_a_typo_names_the_variable(monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "yes")
    with pytest.raises(ValueError, match="SPEC_GRAMMAR_STRICT='yes'"):
        strict_from_env()
