#!/usr/bin/env bash
# Proves the base install works alone: a fresh venv (./.venv-base, or $BASE_VENV) gets torch, then
# this checkout's `[llguidance]` and `tokenizers` (non-editable): no transformers, gguf, accelerate,
# rich, hypothesis or matplotlib. scripts/check_base_install.py then checks those are absent and
# runs the protocol, specs, draft tree, kernels and the llguidance backend on a
# tokenizers.Tokenizer built in code (llguidance has no dependencies; xgrammar needs
# transformers). Torch: as scripts/install.sh (pinned; TORCH_INDEX_URL for a CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${BASE_VENV:-.venv-base}
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# built from a copy of the package's files: an in-tree build would leave build/ and
# *.egg-info here, which importlib.metadata then finds next to the dev install's
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
cp -r pyproject.toml README.md spec_grammar adapters "$SRC"/
"$VENV/bin/pip" install -q "$SRC[llguidance]" tokenizers
# without PYTHONPATH: the check must import the installed package, not a checkout
env -u PYTHONPATH "$VENV/bin/python" scripts/check_base_install.py
