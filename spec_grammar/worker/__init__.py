"""The speculative worker: a batched tree-attention model runner, masked sampling and tree
verification, drafters and the batch loop."""
