"""spec-grammar's benchmarks (``spec-grammar bench ...`` and the scripts in ``benchmarks/``).

Not part of the core library: this package lives in the source tree's ``benchmarks/`` folder
(installed with the distribution; its plots need the ``bench`` extra, matplotlib). It uses
spec-grammar through its API; every direct call into a peer library (xgrammar, llguidance,
outlines-core, the ``transformers`` logits-processor path) is in :mod:`.peers`.

- :mod:`.masks` (report: :mod:`.masks_report`): compile time of real schemas and the cost of
  filling draft-tree bitmasks, ours (``GrammarBackend.fill_tree_bitmasks``) against the naive
  per-node DFS engines use (:mod:`.peers`), on trees grown by :mod:`.trees`.
- :mod:`.e2e` (report: :mod:`.e2e_report`): end-to-end generation on a real model, our
  speculative worker against Hugging Face ``generate`` + a grammar logits processor.
- :mod:`.gpu` (report: :mod:`.gpu_report`): what grammar constraints cost a GPU speculative step.
- :mod:`.inputs`: the real inputs (bundled JSONSchemaBench / BFCL cases, their chat prompts and
  worker requests, valid instances), shared by the benchmarks and the scripts.
- :mod:`.report`: the one writer of a run's JSON + Markdown + plots, and ``docs/benchmarks.md``.

Random-weight model shapes (``build_model``, ``MODEL_SHAPES``) are test fixtures of the core
library: :mod:`spec_grammar.testing.model_shapes`.
"""
