"""vLLM's structural-tag requests (what its tool parsers and ``tool_choice`` send) as our
:class:`~spec_grammar.specs.ToolCalls` in the ``tagged`` format, which every backend serves
(:class:`~spec_grammar.tool_calls.TaggedToolCalls` over the backend's JSON matchers).

Both forms vLLM sends are read: the legacy one (vLLM 0.32's ``structural_tag``:
``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``) and xgrammar's
``{"type": "structural_tag", "format": ...}`` (vLLM 0.34's tool parsers) with a
``triggered_tags`` (``tool_choice="auto"``), ``tags_with_separator`` (``"required"`` / a named
function; ``stop_after_first``: one call) or single ``tag`` format. Each tag must be a tool call
in the Hermes shape, ``OPEN [ws] {"name": "NAME", "arguments": `` + the function's parameters
schema + ``} [ws] CLOSE``, one ``OPEN`` (the trigger) and one ``CLOSE`` for all tags: the shape
of vLLM's hermes, longcat and legacy tags. Anything else is refused with
:class:`~spec_grammar.errors.UnsupportedGrammarError` naming what does not fit, never served
weakened.
"""

from __future__ import annotations

import json
import re
from typing import Any

from spec_grammar.errors import GrammarSpecError, UnsupportedGrammarError
from spec_grammar.specs import ToolCalls, Whitespace

__all__ = ["structural_tag_to_tool_calls"]

_BEGIN = re.compile(
    r'(?P<open>.*?)\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"arguments"\s*:\s*', re.S
)
_END = re.compile(r"\s*\}\s*(?P<close>\S.*?)", re.S)


def _refuse(why: str) -> UnsupportedGrammarError:
    return UnsupportedGrammarError(
        f"spec-grammar's vLLM backend serves structural tags of tool calls only: {why}",
        backend="vllm",
        reason=why,
    )


def _tags_of(fmt: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str], str, bool]:
    """(tags, triggers, tool_choice, parallel) of a structural tag's ``format``."""
    kind = fmt.get("type")
    if kind == "triggered_tags":
        if fmt.get("at_least_one"):
            raise _refuse("triggered_tags with at_least_one (free text and a required call)")
        if fmt.get("excludes"):
            raise _refuse("triggered_tags with excludes")
        return fmt.get("tags", []), fmt.get("triggers", []), "auto", not fmt.get("stop_after_first")
    if kind == "tags_with_separator":
        if not fmt.get("at_least_one"):
            raise _refuse("tags_with_separator without at_least_one (an empty output allowed)")
        if str(fmt.get("separator", "")).strip():
            raise _refuse(f"separator {fmt.get('separator')!r} between calls")
        return fmt.get("tags", []), [], "required", not fmt.get("stop_after_first")
    if kind == "tag":
        return [fmt], [], "required", False
    raise _refuse(f"format type {kind!r}")


def structural_tag_to_tool_calls(text: str, *, whitespace: Whitespace) -> ToolCalls:
    """The :class:`ToolCalls` spec (``tagged``) a vLLM structural-tag request asks for; the
    call JSON gets ``whitespace``. Raises :class:`GrammarSpecError` for text that is not a
    JSON object, :class:`UnsupportedGrammarError` for a structural tag of another shape."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarSpecError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise GrammarSpecError("structural_tag must be a JSON object")
    if "structures" in tag:  # vLLM 0.32's legacy form: triggered tags
        tags = [
            {
                "begin": s.get("begin"),
                "content": {"json_schema": s.get("schema")},
                "end": s.get("end"),
            }
            for s in tag["structures"]
        ]
        triggers, choice, parallel = tag.get("triggers", []), "auto", True
    elif isinstance(tag.get("format"), dict):
        tags, triggers, choice, parallel = _tags_of(tag["format"])
    else:
        raise GrammarSpecError("structural_tag has neither 'structures' nor 'format'")
    if not tags:
        raise _refuse("no tags")
    opens, closes, tools = set(), set(), {}
    for t in tags:
        begin, end, content = t.get("begin"), t.get("end"), t.get("content") or {}
        if isinstance(end, list) and len(end) == 1:
            end = end[0]
        if not isinstance(begin, str) or not isinstance(end, str):
            raise _refuse("a tag's begin / end is not one string")
        if content.get("type", "json_schema") != "json_schema" or "json_schema" not in content:
            raise _refuse(f"tag content of type {content.get('type')!r}")
        if content.get("style", "json") != "json" or content.get("excludes"):
            raise _refuse(f"JSON content in style {content.get('style')!r} / with excludes")
        b, e = _BEGIN.fullmatch(begin), _END.fullmatch(end)
        if b is None or e is None or not b["open"]:
            raise _refuse(
                f'tag {begin!r} ... {end!r} is not OPEN {{"name": ..., "arguments": ...}} CLOSE'
            )
        opens.add(b["open"])
        closes.add(e["close"])
        schema = content["json_schema"]
        if schema is True:  # vLLM's non-strict tool: any arguments, which are an object
            schema = {"type": "object"}
        if tools.setdefault(b["name"], schema) != schema:
            raise _refuse(f"two schemas for function {b['name']!r}")
    if len(opens) != 1 or len(closes) != 1:
        raise _refuse(f"several opening / closing tags: {sorted(opens)} / {sorted(closes)}")
    (call_open,), (call_close,) = opens, closes
    if triggers and set(triggers) != {call_open}:
        raise _refuse(f"triggers {triggers} are not the opening tag {call_open!r}")
    return ToolCalls(
        [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in tools.items()],
        tool_choice=choice,
        parallel_tool_calls=parallel,
        format="tagged",
        call_open=call_open,
        call_close=call_close,
        whitespace=whitespace,
    )
