#!/usr/bin/env bash
# Device call 2 (carry .gpu-b), right after stage.sh: reassemble the SmolLM2 GGUF, check it, run
# `spec-grammar bench gpu` into $OUT (json, md, 2 png, log). Extra arguments go to the bench.
# Without .gpu-b (one call: `bash scripts/gpu/stage.sh && bash scripts/gpu/bench.sh --models
# llama-3.1-8b,smollm2-135m` carrying .gpu-a) only the random-weight models can run.
set -uo pipefail
if [[ ! -f /tmp/sg/smollm2.gguf.part1 || ! -d /tmp/site ]]; then
  echo "stage.sh's files are gone (the machine went cold): run call 1 and call 2 again, back to back" >&2
  exit 3
fi
weights=()
if [[ -f .gpu-b/smollm2.gguf.part2 ]]; then
  cat /tmp/sg/smollm2.gguf.part1 .gpu-b/smollm2.gguf.part2 > /tmp/sg/smollm2.gguf
  sha256sum -c .gpu-b/smollm2.gguf.sha256 || exit 4
  weights=(--weights /tmp/sg/smollm2.gguf)
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 SPEC_GRAMMAR_CACHE=/tmp/sg/cache
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -m spec_grammar bench gpu "${weights[@]}" \
  --tokenizers smollm2=/tmp/sg/tok/smollm2,gemma3=/tmp/sg/tok/gemma3 \
  --budget 380 --out "${OUT:-benchmarks/results}" --name gpu-h200 "$@" 2>&1 | tee "${OUT:-/tmp}/log.txt"
