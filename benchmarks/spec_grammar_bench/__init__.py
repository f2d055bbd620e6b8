"""Benchmarks of the grammar layer (``spec-grammar bench ...``).

One module per measurement; each writes a JSON result file that :mod:`.report` turns into
Markdown tables, PNG plots and the tables of ``docs/benchmarks.md``:

- :mod:`.masks`: compile time of real schemas and the cost of filling draft-tree bitmasks,
  ours (``GrammarBackend.fill_tree_bitmasks``) against the naive per-node DFS engines use.
- :mod:`.e2e` (report: :mod:`.e2e_report`): end-to-end generation on a real model, our
  speculative worker against Hugging Face ``generate`` + a grammar logits processor.
"""
