"""Serving engines running spec-grammar's backends through the engines' own plugin APIs.

- :mod:`spec_grammar.integrations.vllm`: vLLM's structured outputs (extra ``vllm``; see
  ``docs/serving-vllm.md``).
"""
