"""Summarize Nsight Compute raw CSV pages (``tools/ncu_profile.sh``): per
kernel, its duration, the speed-of-light throughputs, registers, the busiest
pipes and the largest issue-stall reasons.

Usage: python3 tools/ncu_summary.py out/ncu_default.csv [more.csv ...]
"""

from __future__ import annotations

import csv
import re
import sys

_FIELDS = (
    ("time", "gpu__time_duration.sum"),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_"
                 "elapsed"),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L1/shared %", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("registers", "launch__registers_per_thread"),
    ("issued IPC", "sm__inst_issued.avg.per_cycle_active"),
)
_PIPE = re.compile(r"^sm__(?:pipe_(.*)_cycles_active|inst_executed_pipe_(.*))"
                   r"\.avg\.pct_of_peak_sustained_active$")
_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(.*)_per_issue_"
                    r"active\.ratio$")


def read_rows(path: str) -> tuple[dict[str, str], list[dict[str, str]]]:
  """(units by metric, one dict per profiled kernel) of a raw CSV page;
  ncu's own log lines (``==PROF==`` ...) and the program's output are
  skipped."""
  with open(path, newline="") as f:
    lines = [line for line in f if line.startswith('"')]
  rows = list(csv.DictReader(lines))
  if not rows:
    return {}, []
  return rows[0], rows[1:]


def _number(text: str) -> float | None:
  try:
    return float(text.replace(",", ""))
  except (AttributeError, ValueError):
    return None


def summarize(path: str, top: int = 6) -> list[str]:
  units, kernels = read_rows(path)
  out = [f"== {path}: {len(kernels)} kernels"]
  for row in kernels:
    name = row.get("Kernel Name", "?")
    name = re.sub(r"_mosaic_gpu_kernel.*", "", name)
    parts = []
    for label, metric in _FIELDS:
      if row.get(metric):
        unit = units.get(metric, "")
        parts.append(f"{label} {row[metric]}"
                     + (f" {unit}" if unit and unit != "%" else ""))
    out.append(f"{name}: " + ", ".join(parts))
    for title, pattern in (("pipes %", _PIPE), ("stalls", _STALL)):
      found = []
      for metric, value in row.items():
        match = pattern.match(metric or "")
        number = _number(value)
        if match and number is not None:
          found.append((number, next(g for g in match.groups() if g)))
      found.sort(reverse=True)
      if found:
        out.append(f"  {title}: " + ", ".join(
            f"{what} {value:.3g}" for value, what in found[:top]))
  return out


def main() -> None:
  for path in sys.argv[1:]:
    for line in summarize(path):
      print(line, flush=True)


if __name__ == "__main__":
  main()
