"""``spec-grammar generate``'s output-limit flags and batch field ``limits``: the defaults,
flags over them, ``--no-output-limits``, a line's own limits; bad values are one line naming
them, before the model loads. The compiled spec is read where the CLI hands it over
(``precompile``)."""

from __future__ import annotations

import json

import pytest

from spec_grammar.cli import build_parser, main
from spec_grammar.cli.generate import _line_limits, _output_limits
from spec_grammar.json_schema.limits import DEFAULT_OUTPUT_LIMITS, OutputLimits
from spec_grammar.worker import api


def _limits(*flags: str) -> OutputLimits:
    return _output_limits(build_parser().parse_args(["generate", *flags, "x"]))


def test_flags_over_the_defaults():
    assert _limits() == DEFAULT_OUTPUT_LIMITS
    assert _limits("--max-items", "3") == DEFAULT_OUTPUT_LIMITS.model_copy(update={"max_items": 3})
    assert _limits("--no-output-limits").is_empty()
    assert _limits("--no-output-limits", "--max-digits", "5") == OutputLimits(max_digits=5)


def test_batch_line_limits():
    base = OutputLimits(max_items=4, max_digits=6)
    assert _line_limits(None, base).is_empty()
    assert _line_limits({"max_items": 2}, base) == OutputLimits(max_items=2, max_digits=6)
    with pytest.raises(ValueError, match="max_digits"):
        _line_limits({"max_digits": 0}, base)
    with pytest.raises(ValueError, match="max_itemz"):
        _line_limits({"max_itemz": 2}, base)
    with pytest.raises(ValueError, match="must be an object or null, got an array"):
        _line_limits([1], base)


@pytest.mark.parametrize(
    "flag,value", [("--max-digits", "0"), ("--max-whitespace", "-1"), ("--max-items", "x")]
)
def test_bad_flag_is_one_line_before_the_model(capsys, monkeypatch, flag, value):
    monkeypatch.setattr(api, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(["generate", flag, value, "hi"])
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert flag in err[-1]


class _Stop(Exception):
    pass


def test_cli_schema_carries_the_limits(monkeypatch, tmp_path):
    """The CLI's JSON schema reaches the compile with the flags' limits."""
    seen = []

    def precompile(spec, **_kw):
        seen.append(spec)
        raise _Stop

    monkeypatch.setattr(api, "precompile", precompile)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "array"}))
    with pytest.raises(_Stop):
        main(["generate", "--json-schema", str(schema), "--max-string-length", "9", "hi"])
    assert seen[0].limits == DEFAULT_OUTPUT_LIMITS.model_copy(update={"max_string_length": 9})
    with pytest.raises(_Stop):
        main(["generate", "--json-schema", str(schema), "--no-output-limits", "hi"])
    assert seen[1].limits.is_empty()
    with pytest.raises(_Stop):  # a regex has no output limits
        main(["generate", "--regex", "a+", "hi"])
    assert not hasattr(seen[2], "limits")
