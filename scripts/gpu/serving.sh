#!/usr/bin/env bash
# One device call of issue 35's serving-size runs (carry .gpu-a with the wheels and tok.tar.gz):
# the batched tree fill vs threads at batch 128 (benchmarks/bench_tree_fill.py), then
# `bench gpu` on the 8B shape with one schema per request.
#   bash scripts/gpu/serving.sh smollm2 --batches 64,128 --nodes 16,64 --fill-threads 12
# TREE: the project tree to run (default: this one; a helper's worktree carried as a folder).
# $1: tokenizer (smollm2 | gemma3, unpacked from tok.tar.gz); the rest goes to `bench gpu`.
# TF_S / GPU_S: seconds each part may run. Files land in $OUT.
set -uo pipefail
tree=${TREE:-.}
tok=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-a/whl/*.whl
mkdir -p /tmp/sg && tar -xzf .gpu-a/tok.tar.gz -C /tmp/sg
export PYTHONPATH=/tmp/site:$PWD/$tree/benchmarks PYTHONUNBUFFERED=1 SPEC_GRAMMAR_CACHE=/tmp/sg/cache
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv; date
timeout "${TF_S:-170}" python3 $tree/benchmarks/bench_tree_fill.py --tokenizers "$tok=/tmp/sg/tok/$tok" \
  --backends xgrammar --batches 128 --nodes 16,64 --threads 1,2,4,8,16 --reps 5 \
  --out "$OUT/tree-fill-$tok" 2>&1 | tail -20
date
# from the tree's own folder: `python -m` puts the working directory first on sys.path
cd "$tree" && timeout "${GPU_S:-400}" python3 -m spec_grammar bench gpu --models llama-3.1-8b \
  --tokenizers "$tok=/tmp/sg/tok/$tok" --distinct --cases 1 --out "$OUT" --name "gpu-h200-serving-$tok" \
  "$@" 2>&1 | tee "$OUT/log-$tok.txt" | grep -v "^\s*$" | tail -40
date
