"""The default output limits as plain values: ``spec-grammar generate --help`` shows them
without importing pydantic (:data:`~spec_grammar.json_schema.limits.DEFAULT_OUTPUT_LIMITS` is
built from them)."""

DEFAULT_LIMIT_VALUES: dict[str, int | bool | None] = {
    "max_whitespace": 4,
    "max_digits": 16,
    "max_string_length": None,
    "max_items": 8,
    "closed_objects": True,
}
