"""``grid.png`` from ``grid.json``: grouped TFLOP/s bars per cell, one panel
for the forward pass and one for forward+backward.

    python -m benchmarks.plot path/to/grid.json [--out grid.png]

Needs matplotlib (the ``bench`` extra); the grid itself runs without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.cells import PASSES
from benchmarks.report import PASS_LABEL, _grouped


def plot(doc: dict, path: Path) -> None:
  """Render the bars to ``path`` (raises ImportError without matplotlib)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  meta = doc["meta"]
  impls = meta["impls"]
  cells = _grouped(doc["rows"])
  names = list(cells)
  x = np.arange(len(names))
  width = 0.8 / max(len(impls), 1)
  fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.75 * len(names) + 2), 8),
                           sharex=True, squeeze=False)
  for ax, p in zip(axes[:, 0], PASSES):
    for j, impl in enumerate(impls):
      values = []
      for name in names:
        e = cells[name].get(p, {}).get("impls", {}).get(impl, {})
        values.append(e.get("tflops", np.nan))
      offset = (j - (len(impls) - 1) / 2) * width
      ax.bar(x + offset, np.nan_to_num(values, nan=0.0), width, label=impl)
      for xi, v in zip(x + offset, values):
        if np.isnan(v):
          ax.text(xi, 0, "x", ha="center", va="bottom", fontsize=7,
                  color="gray")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(PASS_LABEL[p])
    ax.grid(axis="y", alpha=0.3)
  axes[0, 0].legend(ncol=len(impls), fontsize=8, loc="upper left")
  axes[-1, 0].set_xticks(x)
  axes[-1, 0].set_xticklabels(names, rotation=45, ha="right", fontsize=8)
  fig.suptitle(f"{meta['device']['kind']}, {meta['dtype']}, jax "
               f"{meta['jax']}, {str(meta['commit'])[:10]} "
               f"(x: not timed)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("json", type=Path)
  parser.add_argument("--out", type=Path, default=None,
                      help="default: grid.png next to the JSON file")
  args = parser.parse_args(argv)
  out = args.out or args.json.with_name("grid.png")
  try:
    plot(json.loads(args.json.read_text()), out)
  except ImportError as err:
    print(f"matplotlib is needed for the plot: {err}", file=sys.stderr)
    return 1
  except OSError as err:
    print(f"cannot write {out} ({err}); pass --out", file=sys.stderr)
    return 1
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
