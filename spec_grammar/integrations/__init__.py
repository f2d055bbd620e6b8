"""Serving engines running spec-grammar's backends through the engines' own plugin APIs (each
subpackage imports its engine).

- :mod:`spec_grammar.integrations.vllm`: vLLM's structured outputs (extra ``vllm``; see
  ``docs/serving-vllm.md``).
- :mod:`spec_grammar.integrations.sglang`: SGLang's grammar backends and draft-tree fill (extra
  ``sglang``; see ``docs/serving-sglang.md``).
"""
