"""What a backend supports: :class:`Capabilities`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Capabilities"]


class Capabilities(BaseModel):
    """What a backend supports and which fast paths it has natively.

    The ``native_*`` flags say whether the library does the work itself; when False the adapter
    or the core emulates it (correct, maybe slower).
    """

    model_config = ConfigDict(frozen=True)

    json_schema: bool = True
    regex: bool = True
    ebnf: bool = False
    lark: bool = False
    tool_calls: bool = True
    native_rollback: bool = False
    native_fork: bool = False
    native_validate: bool = False
    native_tree_fill: bool = False
    native_forced_tokens: bool = False
    parallel_fill: bool = False
    releases_gil: bool = False
