#!/usr/bin/env bash
# Copies the library and its tests (jflash/, benchmarks/, tests/) of each
# git ref into .trees/<name>/ (ignored by git), so that one call on the GPU
# machine can run several versions side by side, e.g. with
# tools/mosaic_gpu_same.py, or a tree's own GPU tests (cd .trees/<name> &&
# PYTHONPATH=. python3 -m pytest -m gpu tests/test_gpu.py):
#
#   bash tools/stage_trees.sh main exp/some-change
#   # on the GPU, carrying .trees:
#   for t in .trees/*; do PYTHONPATH=$t python3 tools/mosaic_gpu_same.py \
#     --save out/$(basename $t).json; done
#   python3 tools/mosaic_gpu_same.py --compare out/main.json out/*.json
#
# A ref's name has '/' replaced by '-'.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.trees/' .git/info/exclude 2>/dev/null \
  || echo '/.trees/' >> .git/info/exclude
rm -rf .trees
for ref in "$@"; do
  dir=".trees/${ref//\//-}"
  mkdir -p "$dir"
  git archive "$ref" jflash benchmarks tests | tar -x -C "$dir"
  echo "$dir <- $(git rev-parse --short "$ref") ($ref)"
done
