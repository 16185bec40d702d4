#!/usr/bin/env bash
# Hardware counters of the mosaic_gpu kernels (Nsight Compute) for one
# forward+backward per run, on an H200 whose runtime lets ncu read them
# (Firecracker).  Clocks are left alone (--clock-control none).
#
# Usage (from the repository root, on the GPU):
#   CELL=128:16384:0 bash tools/ncu_profile.sh "" "fuse_dq=true"
# Each argument is a run: MosaicGpuConfig fields separated by '+' (empty:
# the default).  Per run, ${OUT:-out}/ncu_<label>.csv holds ncu's raw page
# (every metric, one row per kernel); the summary (tools/ncu_summary.py)
# is printed and written to ncu_summary.log.  Kernels of the second call
# only (the first compiles).
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
CELL="${CELL:-128:16384:0}"
METRICS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
METRICS+=",regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active"
METRICS+=",regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active"
files=()
for run in "$@"; do
  label="${run//[+=]/_}"
  label="${label:-default}"
  config=()
  [ -n "$run" ] && IFS=+ read -r -a config <<< "$run"
  kernels=3
  [[ "$run" == *fuse_dq=true* ]] && kernels=2
  echo "== $label (cell $CELL)"
  # The per-pipe and per-stall metrics by pattern; if ncu rejects the
  # patterns, the sections alone.
  for metrics in "$METRICS" ""; do
    timeout "${RUN_TIMEOUT:-240}" ncu --clock-control none \
      --target-processes all --kernel-name regex:jflash_ \
      --launch-skip "$kernels" --launch-count "$kernels" \
      --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section LaunchStats --section Occupancy \
      ${metrics:+--metrics "$metrics"} --csv --page raw \
      "$PY" tools/ncu_target.py --cell "$CELL" --config "${config[@]}" \
      > "$OUT/ncu_$label.csv" 2> "$OUT/ncu_$label.err"
    status=$?
    echo "exit $status${metrics:+ (with metric patterns)}"
    tail -3 "$OUT/ncu_$label.err"
    grep -q '"jflash_' "$OUT/ncu_$label.csv" && break
  done
  files+=("$OUT/ncu_$label.csv")
done
"$PY" tools/ncu_summary.py "${files[@]}" | tee "$OUT/ncu_summary.log"
