"""JSON-Schema helpers shared by the core, the specs and the adapters.

- :mod:`.check`: :func:`~.check.check_json_schema`, the meta-schema check every backend's
  compile runs first (one message for a bad schema on every backend), and
  :func:`~.check.has_finite_document` (schemas whose every document is infinite are refused).
- :mod:`.pattern`: :func:`~.pattern.translate`, a ``pattern`` rewritten into a regex every
  library reads as ``jsonschema`` does (search semantics, Python's classes, JSON escapes).
- :mod:`.rewrite`: :func:`~.rewrite.map_subschemas`, a walk over every subschema, and node
  rewrites that fit a schema to what a library takes without changing its meaning.
- :mod:`.strict`: :class:`~.strict.KeywordSupport` (what a library leaves unenforced or
  refuses) and
  :func:`~.strict.unenforced_keywords` (strict mode and compile warnings).

Named ``json_schema``, not ``jsonschema``: the ``jsonschema`` library is imported next to it.
"""
