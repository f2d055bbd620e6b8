"""Checks on JSON schemas before a backend sees them, so a bad schema fails with the same clear
message on every backend."""

from __future__ import annotations

import warnings
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from ..errors import GrammarCompileError
from ..json_pointer import resolve_pointer

__all__ = ["check_json_schema", "has_finite_document"]


def check_json_schema(schema: Any) -> None:
    """Raise :class:`GrammarCompileError` unless ``schema`` is valid under its meta-schema (the
    draft its ``$schema`` names, Draft 2020-12 by default). The message gives the JSON path."""
    if isinstance(schema, bool):
        return
    try:
        cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    except Exception as e:  # an unknown $schema URI
        raise GrammarCompileError(f"invalid JSON Schema: {e}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the regex format checker warns on odd patterns
        error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise GrammarCompileError(f"invalid JSON Schema at {where}: {error.message[:300]}")


_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")


def has_finite_document(schema: Any) -> bool:
    """False when no valid document of ``schema`` is finite: every path to a valid document
    runs through a required property or a required array item whose schema refers back to
    itself (``{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}``) or through
    ``false`` / ``enum: []``. Grammar engines given such a schema compile a grammar whose
    matcher can only go on forever (or exhaust the library: llguidance 1.9 stops with "Too many
    items"), so it is refused up front.

    The productive nonterminals of a grammar (Hopcroft & Ullman, *Introduction to Automata
    Theory*, 1979, section 4.4), each subschema a nonterminal: a subschema is productive when
    every ``allOf`` branch, some ``anyOf`` / ``oneOf`` branch, its local ``$ref`` target and
    one of its allowed types are; an object type needs every required property's schema, an
    array type the schemas of its first ``minItems`` items and its ``contains``. Everything
    else (string, number and count bounds, ``not``, ``if``, remote references) is taken as
    satisfiable, so the answer is False only when no finite document exists.

    Computed as the least fixed point by counter propagation over the and/or graph of the
    subschemas (:class:`_Productive`): time and memory linear in the schema's size (each
    subschema and each distinct reference is read once), iterative, so a ``$ref`` chain of
    20,000 links or a deep schema costs its length."""
    if not isinstance(schema, dict):
        return schema is not False
    return _Productive(schema).root_productive()


class _Productive:
    """The and/or graph of a schema's productivity: node ``i`` becomes productive once
    ``_need[i]`` of its children are (an and-node needs all of them, an or-node one, the
    constant true none, the constant false one it never gets); :meth:`root_productive`
    propagates from the nodes needing nothing."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self._root = schema
        self._old = any(d in str(schema.get("$schema", "")) for d in _OLD_DRAFTS)
        self._need: list[int] = []
        self._parents: list[list[int]] = []
        self._ids: dict[int, int] = {}  # id(subschema dict) -> its node
        self._refs: dict[str, int | None] = {}  # local reference -> its target's node
        self._todo: list[tuple[dict[str, Any], int]] = []
        self._true = self._node(0)
        self._false = self._node(1)

    def _node(self, need: int, children: Any = ()) -> int:
        i = len(self._need)
        self._need.append(need)
        self._parents.append([])
        for c in children:
            self._parents[c].append(i)
        return i

    def _all(self, children: list[int]) -> int:
        return self._node(len(children), children)

    def _any(self, children: list[int]) -> int:
        return self._node(1, children)

    def _of(self, sub: Any) -> int:
        """The node of subschema ``sub`` (a dict's is built later, from the work list)."""
        if not isinstance(sub, dict):
            return self._false if sub is False else self._true
        i = self._ids.get(id(sub))
        if i is None:
            # its need is set once its parts are known; a placeholder meanwhile
            i = self._ids[id(sub)] = self._node(0)
            self._todo.append((sub, i))
        return i

    def _target(self, ref: str) -> int | None:
        if ref not in self._refs:
            target = resolve_pointer(self._root, ref)
            self._refs[ref] = None if target is None else self._of(target)
        return self._refs[ref]

    def _parts(self, node: dict[str, Any]) -> list[int]:
        """The nodes that must all be productive for ``node`` to be."""
        parts: list[int] = []
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            target = self._target(ref)
            if target is not None:
                parts.append(target)
            if self._old:  # draft 4-7: keywords next to $ref are ignored
                return parts
        if node.get("enum") == []:
            return [self._false]
        all_of = node.get("allOf")
        if isinstance(all_of, list):
            parts += [self._of(b) for b in all_of]
        for k in ("anyOf", "oneOf"):
            branches = node.get(k)
            if isinstance(branches, list):
                parts.append(self._any([self._of(b) for b in branches]))
        if "const" in node:
            return parts
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        # no type, a scalar type or a type this check does not know: nothing more is needed
        if isinstance(types, list) and all(t in ("object", "array") for t in types):
            parts.append(self._any([self._type(node, t) for t in types]))
        return parts

    def _type(self, node: dict[str, Any], t: str) -> int:
        """The node of "``node`` has a finite document of type ``t``" (object or array)."""
        if t == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            extra = node.get("additionalProperties", True)
            needed = []
            for name in node.get("required", []) if isinstance(node.get("required"), list) else []:
                if name in props:
                    needed.append(self._of(props[name]))
                elif not node.get("patternProperties"):
                    needed.append(self._of(extra))
            return self._all(needed)
        n = node.get("minItems", 0)
        n = int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else 0
        prefix = node.get("prefixItems")
        items = node.get("items", True)
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        needed = [
            self._of(prefix[i] if i < len(prefix) else items)
            for i in range(min(n, len(prefix) + 1))
        ]
        if "contains" in node and node.get("minContains", 1) != 0:
            needed.append(self._of(node["contains"]))
        return self._all(needed)

    def root_productive(self) -> bool:
        """Whether the schema given has a finite document."""
        root = self._of(self._root)
        while self._todo:
            sub, i = self._todo.pop()
            parts = self._parts(sub)
            self._need[i] = len(parts)
            for c in parts:
                self._parents[c].append(i)
        need, parents = self._need, self._parents
        ready = [i for i, n in enumerate(need) if n == 0]
        done = [False] * len(need)
        while ready:
            i = ready.pop()
            if done[i]:
                continue
            done[i] = True
            for p in parents[i]:
                need[p] -= 1
                if need[p] == 0:
                    ready.append(p)
        return done[root]
