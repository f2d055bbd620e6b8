"""Grammar specs: what a request asks the output to follow.

Specs are immutable pydantic models. A backend compiles them; :meth:`GrammarSpec.cache_key` is
the key of the compile cache (key order inside a JSON schema is kept: engines generate
properties in definition order, so two schemas that differ only in order are different
grammars).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import GrammarSpecError
from .json_schema.limits import OutputLimits
from .json_schema.rewrite import map_subschemas

Whitespace = Literal["spaced", "compact", "flexible"]
"""JSON whitespace policy.

- ``spaced``: exactly the separators of Python's ``json.dumps`` (``", "`` and ``": "``), no
  other whitespace. What small models write naturally; the default.
- ``compact``: ``","`` and ``":"``, no whitespace at all.
- ``flexible``: any JSON whitespace between tokens (each backend's own bound applies).
"""


class GrammarSpec(BaseModel):
    """Base of every grammar spec."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: str

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'spec'}: {err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()
            )
            raise GrammarSpecError(f"bad {type(self).__name__} spec: {problems}") from None
        except RecursionError:  # json.loads or a schema walk of a validator met the nesting
            raise GrammarSpecError(
                f"bad {type(self).__name__} spec: nested too deeply to read (Python's recursion "
                "limit): flatten it"
            ) from None

    def cache_key(self) -> str:
        """A string that identifies the grammar exactly (used as the compile-cache key)."""
        return json.dumps(self.model_dump(mode="json"), separators=(",", ":"), ensure_ascii=False)


_NOT_GIVEN: Any = object()  # JsonSchema(None) is a null schema (refused), not a missing one


class JsonSchema(GrammarSpec):
    """Output is a JSON document valid under ``schema``.

    ``schema`` may be a dict, a JSON string, or a pydantic model class (its
    ``model_json_schema()``). ``strict=True`` makes a backend reject keywords it would
    otherwise ignore (:class:`~spec_grammar.errors.UnsupportedGrammarError`). ``limits``
    (:class:`~spec_grammar.json_schema.limits.OutputLimits`, a dict of its fields, or None =
    the schema as written) bounds whitespace runs, digits, and the strings and arrays the
    schema leaves unbounded.

    Raises :class:`~spec_grammar.errors.GrammarSpecError` (a ``ValueError``) when the string is
    not JSON or the schema is neither an object nor a boolean.
    """

    kind: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    whitespace: Whitespace = "spaced"
    strict: bool = False
    limits: OutputLimits | None = None

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def __init__(self, schema: Any = _NOT_GIVEN, /, **data: Any):
        if schema is not _NOT_GIVEN:
            data["schema"] = schema
        super().__init__(**data)

    @field_validator("json_schema", mode="before")
    @classmethod
    def _normalize(cls, value: Any) -> Any:
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value.model_json_schema()
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"schema is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            got = "null" if value is None else type(value).__name__
            raise ValueError(f"a JSON schema must be an object or a boolean, got {got}")
        return value

    @property
    def schema_dict(self) -> dict[str, Any] | bool:
        return self.json_schema

    def schema_json(self) -> str:
        """The schema as a JSON string, key order kept."""
        return json.dumps(self.json_schema, ensure_ascii=False)


class Regex(GrammarSpec):
    """Output matches the regular expression ``pattern`` in full."""

    kind: Literal["regex"] = "regex"
    pattern: str

    def __init__(self, pattern: Any = None, /, **data: Any):
        if pattern is not None:
            data["pattern"] = pattern
        super().__init__(**data)


class Ebnf(GrammarSpec):
    """A context-free grammar in GBNF (llama.cpp / xgrammar EBNF); ``root`` names the start rule.
    ``strict=True``: a backend that would refuse valid text of the grammar (a compile warning)
    refuses the grammar instead (:class:`~spec_grammar.errors.UnsupportedGrammarError`)."""

    kind: Literal["ebnf"] = "ebnf"
    text: str
    root: str = "root"
    strict: bool = Field(False, strict=True)

    def __init__(self, text: Any = None, /, **data: Any):
        if text is not None:
            data["text"] = text
        super().__init__(**data)


class Lark(GrammarSpec):
    """A context-free grammar in Lark syntax with a ``start`` rule. ``strict=True``: as
    :attr:`Ebnf.strict`."""

    kind: Literal["lark"] = "lark"
    text: str
    strict: bool = Field(False, strict=True)

    def __init__(self, text: Any = None, /, **data: Any):
        if text is not None:
            data["text"] = text
        super().__init__(**data)


ToolCallFormat = Literal["json_array", "tagged"]
"""How tool calls are written.

- ``json_array``: the whole output is ``[{"name": ..., "arguments": {...}}, ...]``.
- ``tagged``: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
  Hermes / Qwen convention; tags configurable), with free text around the calls under
  ``tool_choice="auto"`` (:class:`~spec_grammar.tool_calls.TaggedToolCalls`).
"""


class ToolCalls(GrammarSpec):
    """Tool calls for an OpenAI-style tool list
    ``[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]``.

    Fields (OpenAI chat-completions semantics):

    - ``tool_choice``: ``"required"`` (at least one call; the default), ``"auto"`` (free text
      or calls: needs the ``tagged`` format), a function name or
      ``{"type": "function", "function": {"name": ...}}`` (that function only, at least once).
    - ``parallel_tool_calls``: False = at most one call.
    - ``max_tool_calls``: a bound on the number of calls (None: no bound).
    - ``format``: ``json_array`` (default) or ``tagged`` (default under ``"auto"``), with
      ``call_open`` / ``call_close`` as the tags.
    - a function with ``"strict": true`` gets OpenAI's strict schema: every object of its
      parameters takes no keys beyond its ``properties`` and requires all of them.

    - ``limits``: output limits (:class:`~spec_grammar.json_schema.limits.OutputLimits`) for
      the call JSON; ``max_items`` caps the number of calls where neither
      ``parallel_tool_calls`` nor ``max_tool_calls`` bounds it.

    Backends compile :meth:`to_json_schema` (the whole array, or one call for ``tagged``).
    Raises :class:`~spec_grammar.errors.GrammarSpecError` for no tools, a tool without a name,
    ``tool_choice="none"`` or an unknown function, ``"auto"`` with the ``json_array`` format.
    """

    kind: Literal["tool_calls"] = "tool_calls"
    tools: list[dict[str, Any]]
    whitespace: Whitespace = "spaced"
    parallel_tool_calls: bool = Field(True, strict=True)
    limits: OutputLimits | None = None
    tool_choice: str = "required"
    max_tool_calls: int | None = Field(None, ge=1, strict=True)
    format: ToolCallFormat | None = None
    call_open: str = Field("<tool_call>", min_length=1)
    call_close: str = Field("</tool_call>", min_length=1)
    strict: bool = Field(False, strict=True)
    """As :attr:`JsonSchema.strict`: a backend refuses the tool list when it would leave a
    keyword of a function's parameters unenforced (not OpenAI's per-function ``strict``, which
    changes the schema: :func:`openai_strict`)."""

    def __init__(self, tools: Any = None, /, **data: Any):
        if tools is not None:
            data["tools"] = tools
        super().__init__(**data)

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not tools:
            raise ValueError("tools must list at least one tool")
        first: dict[str, int] = {}
        for i, tool in enumerate(tools):
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tools[{i}] has no function name")
            # a call names its function: two of one name leave its arguments' schema ambiguous
            if fn["name"] in first:
                raise ValueError(
                    f"tools[{i}] and tools[{first[fn['name']]}] are both named {fn['name']!r}: "
                    "function names must be unique"
                )
            first[fn["name"]] = i
            params = fn.get("parameters", {"type": "object"})
            if not isinstance(params, (dict, bool)):
                raise ValueError(f"tools[{i}] ({fn['name']}): parameters must be a JSON schema")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _named_choice(cls, value: Any) -> Any:
        if isinstance(value, dict):  # {"type": "function", "function": {"name": "f"}}
            if value.get("type", "function") != "function":
                raise ValueError(
                    f"a named tool_choice has type 'function', got {value.get('type')!r}"
                )
            name = (value.get("function") or {}).get("name")
            if not isinstance(name, str):
                raise ValueError("a named tool_choice needs function.name")
            if name in ("auto", "required", "none"):
                raise ValueError(
                    f"a function named {name!r} cannot be chosen by name (the word is a "
                    "tool_choice mode): rename it"
                )
            return name
        return value

    @model_validator(mode="after")
    def _check_choice(self) -> ToolCalls:
        if self.tool_choice == "none":
            raise ValueError(
                'tool_choice="none" asks for no tool call: send the request without a '
                "ToolCalls grammar"
            )
        names = [t.get("function", t)["name"] for t in self.tools]
        if self.tool_choice not in ("required", "auto") and self.tool_choice not in names:
            raise ValueError(
                f"tool_choice names {self.tool_choice!r}, which is not in tools {names}"
            )
        if self.tool_choice == "auto" and self.format == "json_array":
            raise ValueError(
                'tool_choice="auto" needs the tagged format (free text around the calls)'
            )
        return self

    @property
    def call_format(self) -> ToolCallFormat:
        """The format in effect: ``format``, else ``tagged`` under ``"auto"``, else
        ``json_array``."""
        return self.format or ("tagged" if self.tool_choice == "auto" else "json_array")

    @property
    def max_calls(self) -> int | None:
        """The most calls allowed: 1 without parallel calls, else ``max_tool_calls``, else the
        output limits' ``max_items`` (at least 1), else None (no bound)."""
        if not self.parallel_tool_calls:
            return 1
        if self.max_tool_calls is not None:
            return self.max_tool_calls
        if self.limits is not None and self.limits.max_items is not None:
            return max(self.limits.max_items, 1)
        return None

    def functions(self) -> list[dict[str, Any]]:
        """The function dicts a call may name (one under a named ``tool_choice``)."""
        fns = [t.get("function", t) for t in self.tools]
        if self.tool_choice in ("required", "auto"):
            return fns
        return [f for f in fns if f["name"] == self.tool_choice]

    def call_schema(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(schema of one call, ``$defs`` it needs): ``{"name": const, "arguments": params}``
        per selected function, ``anyOf`` when several.

        Parameters with local references (``#``, ``#/$defs/X``: what pydantic writes for
        nested models) move to ``#/$defs/tool<i>`` with their refs rebased there, so they still
        resolve (outlines-core follows pointers through object keys only)."""
        variants, defs = [], {}
        for i, fn in enumerate(self.functions()):
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if fn.get("strict") is True:
                params = openai_strict(params)
            rebased = _rebase_refs(params, f"#/$defs/tool{i}")
            if rebased != params:
                defs[f"tool{i}"], params = rebased, {"$ref": f"#/$defs/tool{i}"}
            variants.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": fn["name"]},
                        "arguments": params,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        return (variants[0] if len(variants) == 1 else {"anyOf": variants}), defs

    def to_json_schema(self) -> JsonSchema:
        """The :class:`JsonSchema` a backend compiles: the array of calls (``json_array``) or
        one call (``tagged``: the tags and the text around calls are
        :class:`~spec_grammar.tool_calls.TaggedToolCalls`' work)."""
        call, defs = self.call_schema()
        if self.call_format == "tagged":
            schema: dict[str, Any] = dict(call)
        else:
            schema = {"type": "array", "items": call, "minItems": 1}
            if self.max_calls is not None:
                schema["maxItems"] = self.max_calls
        if defs:
            schema["$defs"] = defs
        return JsonSchema(
            schema, whitespace=self.whitespace, limits=self.limits, strict=self.strict
        )


def openai_strict(schema: Any) -> Any:
    """``schema`` as OpenAI's strict mode reads a function's parameters: every object schema
    (``type: object`` or with ``properties``) takes only its ``properties``
    (``additionalProperties: false``) and requires every one of them."""

    def strict(node: dict[str, Any], _where: str) -> dict[str, Any]:
        if node.get("type") == "object" or "properties" in node:
            props = node.get("properties", {})
            return {**node, "required": list(props), "additionalProperties": False}
        return node

    return map_subschemas(schema, strict)


def _rebase_refs(schema: Any, at: str) -> Any:
    """``schema`` with every local JSON-pointer ``$ref`` (``#`` or ``#/...``) prefixed by the
    pointer ``at`` of the place the schema is embedded in. Literal values (``const``, ``enum``,
    ``default``, ``examples``) are kept as they are; a schema with its own ``$id`` (its refs
    resolve against it) is returned unchanged."""
    if not isinstance(schema, dict) or "$id" in schema:
        return schema

    def rebase(node: dict[str, Any], _where: str) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            return {**node, "$ref": at + ref[1:]}
        return node

    return map_subschemas(schema, rebase)


AnyGrammarSpec = JsonSchema | Regex | Ebnf | Lark | ToolCalls


def with_limits(spec: GrammarSpec | None, limits: OutputLimits | None) -> GrammarSpec | None:
    """``spec`` carrying ``limits`` when it is a :class:`JsonSchema` or :class:`ToolCalls`
    without limits of its own (``limits=None`` on the spec); any other spec, one whose limits
    are set (``OutputLimits()`` = explicitly none), and ``limits=None`` give ``spec`` back."""
    if limits is not None and isinstance(spec, (JsonSchema, ToolCalls)) and spec.limits is None:
        return spec.model_copy(update={"limits": limits})
    return spec


def with_strict(spec: GrammarSpec | None, strict: bool) -> GrammarSpec | None:
    """``spec`` in strict mode when ``strict`` and it has one (:class:`JsonSchema`,
    :class:`ToolCalls`, :class:`Ebnf`, :class:`Lark`); any other spec, and ``strict=False``,
    give ``spec`` back (a spec's own ``strict=True`` is kept)."""
    if strict and isinstance(spec, (JsonSchema, ToolCalls, Ebnf, Lark)) and not spec.strict:
        return spec.model_copy(update={"strict": True})
    return spec


def as_grammar_spec(grammar: Any) -> GrammarSpec | None:
    """``grammar`` as a spec: a :class:`GrammarSpec` or None as given; a JSON-schema dict or
    bool, or a pydantic model class (its ``model_json_schema()``), as a :class:`JsonSchema`.
    Raises ``TypeError`` naming the type for anything else, and
    :class:`~spec_grammar.errors.GrammarSpecError` for a schema that is not one."""
    if grammar is None or isinstance(grammar, GrammarSpec):
        return grammar
    if isinstance(grammar, (dict, bool)) or (
        isinstance(grammar, type) and issubclass(grammar, BaseModel)
    ):
        return JsonSchema(grammar)
    raise TypeError(
        "a grammar must be a spec (JsonSchema, Regex, Ebnf, Lark, ToolCalls), a JSON-schema dict "
        f"or a pydantic model class, got {type(grammar).__name__}"
    )
