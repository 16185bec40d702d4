#!/usr/bin/env bash
# On a Hopper machine: run tools/mosaic_gpu_same.py for each staged tree
# (tools/stage_trees.sh) and configuration, then compare every run with the
# first: bitwise identity of output and gradients, and TFLOP/s.  About 100 s
# per run on an H200.
#
# Usage (from the repository root, carrying .trees):
#   bash tools/compare_trees.sh main exp-a exp-b+fuse_dq=true \
#       main+block_kv=192+stages=2
# A run is a tree name under .trees/, optionally followed by
# +field=value MosaicGpuConfig fields.  Results go to ${OUT:-out}/.
# SAME_ARGS adds arguments to every run (on a CPU, a smoke test of this
# script: SAME_ARGS="--implementation xla --shrink 64").  ONLY picks cells
# by name, alternatives separated by ";" (ONLY="h=128 s=16384;h=64";
# ONLY="window" picks the windowed cell; ONLY="softcap;segments" the
# soft-cap and packed-segment cells, which run only when named).
# PTXAS=1 also
# records each run's registers and spills (tools/ptxas_report.py) in
# ptxas.log and prints them at the end.  ROUNDS=2 runs the whole list
# twice (A B A B), to tell a difference from the clock's drift over a call.
# XLA_EXTRA_FLAGS adds XLA flags to every run.
# Files written: runs.tar.gz (one JSON per run), runs.log, compare.log and
# ptxas.log (few files, so that all come back from the GPU machine).
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_FLAGS="--xla_backend_optimization_level=3 ${XLA_EXTRA_FLAGS:-}"
PY="${PYTHON:-python3}"
files=()
only=()
if [ -n "${ONLY:-}" ]; then
  IFS=';' read -r -a only <<< "$ONLY"
  only=(--only "${only[@]}")
fi
runs_dir="$(mktemp -d)"
rounds="${ROUNDS:-1}"
for round in $(seq 1 "$rounds"); do
for run in "$@"; do
  IFS=+ read -r tree fields <<< "$run"
  label="${run//[+=]/_}"
  [ "$rounds" -gt 1 ] && label="${label}_round$round"
  config=()
  if [ -n "$fields" ]; then
    IFS=+ read -r -a config <<< "$fields"
    config=(--config "${config[@]}")
  fi
  echo "== $run (round $round)" | tee -a "$OUT/runs.log"
  PYTHONPATH=".trees/$tree" timeout "${RUN_TIMEOUT:-150}" "$PY" \
    tools/mosaic_gpu_same.py --save "$runs_dir/$label.json" "${config[@]}" \
    "${only[@]}" ${SAME_ARGS:-} > "$runs_dir/$label.log" 2>&1
  status=$?
  grep -E "^h=" "$runs_dir/$label.log" | tee -a "$OUT/runs.log"
  [ -f "$runs_dir/$label.json" ] && files+=("$runs_dir/$label.json")
  if [ "$status" != 0 ]; then
    # A failed run (an exception, a crash, or the timeout: 124): its last
    # lines, and the whole log in runs.tar.gz.
    echo "exit status $status; last lines:" | tee -a "$OUT/runs.log"
    tail -25 "$runs_dir/$label.log" | cut -c1-300 | tee -a "$OUT/runs.log"
  fi
  if [ "${PTXAS:-0}" = 1 ] && [ "$round" = 1 ]; then
    echo "== $run" >> "$OUT/ptxas.log"
    config_fields=()
    [ -n "$fields" ] && IFS=+ read -r -a config_fields <<< "$fields"
    PYTHONPATH=".trees/$tree" timeout 120 "$PY" tools/ptxas_report.py \
      --config "${config_fields[@]}" >> "$OUT/ptxas.log" 2>&1
  fi
done
done
echo "== comparisons against $1"
"$PY" tools/mosaic_gpu_same.py --compare "${files[@]}" | tee "$OUT/compare.log"
# One archive of the per-run JSON files: few files come back from a GPU
# machine.
tar -C "$runs_dir" -czf "$OUT/runs.tar.gz" . && rm -rf "$runs_dir"
if [ "${PTXAS:-0}" = 1 ]; then
  echo "== ptxas: registers and spills"
  grep -E "^==|spill stores|Used" "$OUT/ptxas.log" \
    | sed -E 's/ptxas info +: //' | cut -c1-150
fi
