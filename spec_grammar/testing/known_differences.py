"""JSON-Schema-Test-Suite groups where a library is known to accept instances ``jsonschema``
rejects: the library's own JSON-Schema semantics, not an adapter bug.

Measured with ``spec-grammar conformance --compare ... --slow`` (draft 2020-12 suite,
``spaced`` whitespace, SmolLM2 tokenizer) on xgrammar 0.2.9 and llguidance 1.9.1.
An acceptance of an invalid instance OUTSIDE these groups fails the property
``smollm2_json_suite_sound``; a group that becomes sound is simply no longer used.
"""

from __future__ import annotations

_TYPELESS = (
    "type-specific keyword in a schema without `type`: xgrammar compiles such a schema to any "
    "JSON value and drops the keyword"
)
_IGNORED = "keyword not enforced by xgrammar 0.2.9 (dropped in non-strict mode)"

# backend -> file -> (reason, group indices)
KNOWN_UNSOUND: dict[str, dict[str, tuple[str, frozenset[int]]]] = {
    "xgrammar": {
        "additionalProperties.json": (
            "additionalProperties next to allOf: allOf branches are not intersected",
            frozenset({5}),
        ),
        "allOf.json": (
            "allOf branches are not intersected (only the outer schema is kept)",
            frozenset({0, 1, 2, 8, 9, 11}),
        ),
        "anchor.json": ("$anchor references are not resolved", frozenset({0})),
        "anyOf.json": (_TYPELESS, frozenset({0, 1})),
        "contains.json": (_IGNORED, frozenset({0, 1, 2, 3, 4, 5})),
        "defs.json": (
            "$ref to the draft 2020-12 meta-schema compiles to any JSON value",
            frozenset({0}),
        ),
        "dependentRequired.json": (_IGNORED, frozenset({0, 2, 3})),
        "dependentSchemas.json": (_IGNORED, frozenset({0, 1, 2, 3})),
        "dynamicRef.json": (
            "$dynamicRef is not resolved",
            frozenset({0, 1, 2, 3, 4, 5, 9, 11, 12, 18, 19, 20}),
        ),
        "exclusiveMaximum.json": (_TYPELESS, frozenset({0})),
        "exclusiveMinimum.json": (_TYPELESS, frozenset({0})),
        "if-then-else.json": (_IGNORED, frozenset({3, 4, 5, 7, 8, 9, 10, 11})),
        "infinite-loop-detection.json": ("$ref inside allOf is not intersected", frozenset({0})),
        "items.json": (
            "items combined with allOf/prefixItems in $defs: allOf not intersected",
            frozenset({3, 6}),
        ),
        "maxContains.json": (_IGNORED, frozenset({1, 2, 3, 4})),
        "maxItems.json": (_TYPELESS, frozenset({0, 1})),
        "maxLength.json": (_TYPELESS, frozenset({0, 1})),
        "maxProperties.json": (_TYPELESS, frozenset({0, 1, 2})),
        "maximum.json": (_TYPELESS, frozenset({0, 1})),
        "minContains.json": (_IGNORED, frozenset({1, 2, 3, 4, 5, 7})),
        "minItems.json": (_TYPELESS, frozenset({0, 1})),
        "minLength.json": (_TYPELESS, frozenset({0, 1})),
        "minProperties.json": (_TYPELESS, frozenset({0, 1})),
        "minimum.json": (_TYPELESS, frozenset({0, 1})),
        "multipleOf.json": (_TYPELESS, frozenset({0, 1, 2})),
        "not.json": (_IGNORED, frozenset({0, 1, 2, 3, 4, 5, 8})),
        "oneOf.json": (
            "oneOf compiled as anyOf (exclusivity is not enforced)",
            frozenset({0, 1, 2, 6, 7, 8, 9}),
        ),
        "pattern.json": (_TYPELESS, frozenset({0})),
        "patternProperties.json": (_IGNORED, frozenset({0, 1, 2, 3})),
        "properties.json": (
            'property names with escapes (\\n, \\", \\\\) are not matched to their schema; '
            "group 1: properties without `type: object`",
            frozenset({1, 3}),
        ),
        "propertyNames.json": (_IGNORED, frozenset({0, 1, 3, 4, 5})),
        "ref.json": (
            "$ref forms xgrammar does not resolve (compiled to any value)",
            frozenset({5, 6, 12, 13, 15, 16, 17, 18, 19, 20, 21, 26, 27, 28, 29, 30, 31, 32}),
        ),
        "required.json": (
            "required without `type: object`, or with escaped names, is not enforced",
            frozenset({3, 4}),
        ),
        "unevaluatedItems.json": (_IGNORED, frozenset({8, 15, 18, 22})),
        "unevaluatedProperties.json": (
            _IGNORED,
            frozenset(
                {
                    2,
                    3,
                    8,
                    13,
                    14,
                    15,
                    16,
                    17,
                    18,
                    21,
                    22,
                    23,
                    26,
                    27,
                    28,
                    29,
                    31,
                    32,
                    33,
                    34,
                    35,
                    39,
                    40,
                    41,
                    42,
                    43,
                }
            ),
        ),
        "uniqueItems.json": (_IGNORED, frozenset({0, 1, 2})),
    },
    "llguidance": {
        "oneOf.json": ("llguidance compiles oneOf as anyOf", frozenset({0, 1, 2, 4, 6, 7, 8, 9})),
        "uniqueItems.json": ("llguidance does not enforce uniqueItems", frozenset({0, 1, 2})),
        "defs.json": ("$ref to the draft 2020-12 meta-schema is approximated", frozenset({0})),
    },
}


def known_unsound(backend: str, file: str, group: int) -> str | None:
    """The documented reason when ``backend`` is known to accept invalid instances of that
    test-suite group, else None."""
    reason, groups = KNOWN_UNSOUND.get(backend, {}).get(file, ("", frozenset()))
    return reason if group in groups else None
