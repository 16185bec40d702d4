"""Results: run metadata, ``grid.json`` and the markdown table.

``grid.json`` holds ``meta`` (device, versions, commit, dtype, timer, the
implementations) and ``rows``: one per cell and pass, each with the cell's
shape and an ``impls`` mapping from implementation name to either a timed
entry (``ms``, ``tflops``, ``errors``, ``ratio_to_cudnn``, ...) or one of
``error`` / ``unsupported`` / ``failed_check`` / ``skipped`` with a reason.

    python -m benchmarks.report grid.json             # rewrite grid.md
    python -m benchmarks.report a.json b.json --out D  # merge partial runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.cells import PASSES

PASS_LABEL = {"fwd": "fwd", "fwdbwd": "fwd+bwd"}
STATUS_KEYS = ("error", "unsupported", "failed_check", "skipped")


def git_commit(override: str | None = None) -> tuple[str, bool | None]:
  """``(commit, dirty)``: ``override``, else ``$JFLASH_COMMIT``, else
  ``git rev-parse HEAD`` (``unknown`` without a repository)."""
  commit = override or os.environ.get("JFLASH_COMMIT")
  if commit:
    return commit, None
  root = Path(__file__).resolve().parent.parent
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root,
                            capture_output=True, text=True, check=True,
                            timeout=10).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain", "--", "jflash"],
                            cwd=root, capture_output=True, text=True,
                            timeout=10).stdout.strip()
    return commit, bool(status)
  except (OSError, subprocess.SubprocessError):
    return "unknown", None


def device_slug(kind: str) -> str:
  """``NVIDIA H200`` -> ``nvidia-h200``."""
  return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "device"


def run_metadata(commit_override: str | None = None) -> dict:
  """Device, versions and commit of this process."""
  import jax
  import jaxlib
  import jflash
  from benchmarks.impls import tokamax_module
  device = jax.devices()[0]
  commit, dirty = git_commit(commit_override)
  tokamax = tokamax_module()
  return dict(
      device=dict(kind=device.device_kind, platform=device.platform,
                  count=jax.device_count()),
      jax=jax.__version__, jaxlib=jaxlib.__version__,
      jflash=jflash.__version__,
      tokamax=getattr(tokamax, "__version__", "installed") if tokamax
      else None,
      python=platform.python_version(), commit=commit, jflash_dirty=dirty,
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      started=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"))


def _clean(x):
  """JSON-safe: non-finite floats become strings."""
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, dict):
    return {k: _clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_clean(v) for v in x]
  return x


def write_json(doc: dict, path: Path) -> None:
  """Atomic write, so a run killed mid-write leaves the previous file."""
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(_clean(doc), indent=1) + "\n")
  tmp.replace(path)


def fmt_number(x: float) -> str:
  """Three significant digits at most, no exponent for TFLOP/s figures."""
  return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _fmt_tflops(entry: dict) -> str:
  if "tflops" in entry:
    return fmt_number(entry["tflops"])
  if "unsupported" in entry:
    return "n/a"
  if "failed_check" in entry:
    return "WRONG"
  if "skipped" in entry:
    return "skip"
  return "err"


def _cell_label(row: dict) -> str:
  return f"`{row['name']}` B={row['B']} N={row['N']}"


def _grouped(rows: list[dict]) -> dict[str, dict[str, dict]]:
  """``{cell name: {pass: row}}`` in first-seen order."""
  cells: dict[str, dict[str, dict]] = {}
  for row in rows:
    cells.setdefault(row["name"], {})[row["pass"]] = row
  return cells


def markdown(doc: dict) -> str:
  """The results as markdown: a TFLOP/s table and an accuracy table."""
  meta, rows = doc["meta"], doc["rows"]
  impls = meta["impls"]
  timer = meta["timer"]
  dev = meta["device"]
  lines = [
      f"# Attention grid: {dev['kind']} ({dev['platform']}), {meta['dtype']}",
      "",
      f"jax {meta['jax']}, jaxlib {meta['jaxlib']}, jflash {meta['jflash']} "
      f"at `{str(meta['commit'])[:12]}`"
      + (" (+ local changes)" if meta.get("jflash_dirty") else "")
      + f", started {meta['started']}.",
      f"Timing: `{timer['method']}`, {timer['calls']} calls per group "
      f"(fewer for slow calls), median of {timer['repeats']} groups after "
      f"{timer['warmup']} warm-up calls, {meta['input_sets']} rotating "
      "random input sets"
      + ({True: "; the implementations' groups interleaved.",
          False: "; implementations timed one after another."}
         .get(timer.get("interleaved"), ".")),
      "TFLOP/s by the FlashAttention convention: forward `4*B*N*T*S*H`, "
      "halved when causal; forward+backward 3.5x forward.  Windowed and "
      "segment cells count visible pairs only (dense-equivalent figure in "
      "`grid.json`).  Best per cell and pass in bold; `n/a` unsupported, "
      "`err` error, `WRONG` failed the correctness check, `skip` skipped.",
      "",
  ]
  header = ["cell"] + [f"{i} {PASS_LABEL[p]}" for p in PASSES for i in impls]
  lines += ["| " + " | ".join(header) + " |",
            "|" + "---|" * len(header)]
  for name, by_pass in _grouped(rows).items():
    any_row = next(iter(by_pass.values()))
    cells = [_cell_label(any_row)]
    for p in PASSES:
      entries = by_pass.get(p, {}).get("impls", {})
      best = max((e["tflops"] for e in entries.values() if "tflops" in e),
                 default=None)
      for impl in impls:
        e = entries.get(impl)
        if e is None:
          cells.append("")
          continue
        text = _fmt_tflops(e)
        cells.append(f"**{text}**" if best is not None
                     and e.get("tflops") == best else text)
    lines.append("| " + " | ".join(cells) + " |")

  lines += ["", "## Accuracy", "",
            "Worst relative error `||x - ref|| / ||ref||` over out, dq, dk, "
            "dv (forward+backward; out only when that pass is absent) "
            "against a float32 reference on the first head, and its ratio "
            "to `jax_nn_cudnn` on the same inputs (target <= 1.5).", ""]
  lines += ["| cell | " + " | ".join(impls) + " |",
            "|" + "---|" * (len(impls) + 1)]
  for name, by_pass in _grouped(rows).items():
    row = by_pass.get("fwdbwd") or next(iter(by_pass.values()))
    cells = [_cell_label(row)]
    for impl in impls:
      e = row["impls"].get(impl, {})
      errs = e.get("errors")
      if not errs:
        cells.append(_fmt_tflops(e) if e else "")
        continue
      values = [float(v) for v in errs.values()]
      worst = max(values) if all(map(math.isfinite, values)) else math.nan
      text = f"{worst:.2e}"
      ratio = e.get("max_ratio_to_cudnn")
      if ratio is not None:
        text += f" ({ratio:.2f}x)"
      if "failed_check" in e:
        text += " WRONG"
      cells.append(text)
    lines.append("| " + " | ".join(cells) + " |")

  lines += _sparse_lines(rows, impls)

  if any("clocks" in e for row in rows for e in row["impls"].values()):
    lines += _clock_lines(rows, impls)

  notes: dict[tuple[str, str, str], list[str]] = {}
  for row in rows:
    for impl, e in row["impls"].items():
      for key in STATUS_KEYS:
        if key in e:
          reason = " ".join(str(e[key]).split())[:300]
          notes.setdefault((impl, key, reason), []).append(
              f"{row['name']} {PASS_LABEL[row['pass']]}")
  if notes:
    lines += ["", "## Not timed", ""]
    for (impl, key, reason), where in notes.items():
      lines.append(f"- {impl}, {key} ({len(where)}: {', '.join(where)}): "
                   f"{reason}")
  return "\n".join(lines) + "\n"


def _dense_causal_twin(row: dict, rows: list[dict]) -> dict | None:
  """The dense causal row of the same shape and pass as a windowed or
  segment row, if the run has it."""
  shape = ("B", "T", "S", "N", "K", "H", "pass")
  for other in rows:
    if (other["kind"] == "dense" and other["causal"]
        and all(other[k] == row[k] for k in shape)):
      return other
  return None


def _sparse_lines(rows: list[dict], impls: list[str]) -> list[str]:
  """Windowed and segment cells against the dense causal cell of the same
  shape: TFLOP/s over visible pairs as a share of the dense causal
  TFLOP/s of the same implementation (the target is at least 80%)."""
  pairs = [(row, twin) for row in rows if row["kind"] != "dense"
           for twin in [_dense_causal_twin(row, rows)] if twin is not None]
  if not pairs:
    return []
  lines = ["", "## Sparse cells against dense causal", "",
           "TFLOP/s of a windowed or packed-segment cell (visible pairs "
           "only) as a share of the same implementation's TFLOP/s on the "
           "dense causal cell of the same shape (target: at least 80%).",
           ""]
  lines += ["| cell | pass | " + " | ".join(impls) + " |",
            "|" + "---|" * (len(impls) + 2)]
  for row, twin in pairs:
    cells = [_cell_label(row), PASS_LABEL[row["pass"]]]
    for impl in impls:
      mine, dense = row["impls"].get(impl, {}), twin["impls"].get(impl, {})
      if "tflops" in mine and dense.get("tflops"):
        cells.append(f"{100 * mine['tflops'] / dense['tflops']:.0f}%")
      else:
        cells.append("")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _clock_lines(rows: list[dict], impls: list[str]) -> list[str]:
  """The clocks section: per cell, pass and implementation, the SM clock
  and board power while it was timed, and TFLOP/s per GHz."""
  lines = ["", "## Clocks", "",
           "SM clock (MHz) and board power (W) while each implementation "
           "was timed (`--clocks`: nvidia-smi readings, mean per timing "
           "group, median over groups), and TFLOP/s per GHz of that clock: "
           "under the power limit a kernel that draws more power runs at a "
           "lower clock.", ""]
  header = ["cell"] + [f"{i} {PASS_LABEL[p]}" for p in PASSES for i in impls]
  lines += ["| " + " | ".join(header) + " |",
            "|" + "---|" * len(header)]
  for name, by_pass in _grouped(rows).items():
    cells = [_cell_label(next(iter(by_pass.values())))]
    for p in PASSES:
      entries = by_pass.get(p, {}).get("impls", {})
      for impl in impls:
        clocks = entries.get(impl, {}).get("clocks")
        if not clocks:
          cells.append("")
          continue
        text = f"{clocks['sm_mhz']} MHz {clocks['watts']} W"
        if "tflops" in entries[impl] and clocks["sm_mhz"] > 0:
          per_ghz = entries[impl]["tflops"] / (clocks["sm_mhz"] / 1000)
          text += f", {fmt_number(per_ghz)}/GHz"
        cells.append(text)
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def write_outputs(doc: dict, out_dir: Path, *, png: bool = True) -> list[str]:
  """``grid.json``, ``grid.md`` and (optionally) ``grid.png``; returns
  messages about what could not be written."""
  out_dir.mkdir(parents=True, exist_ok=True)
  write_json(doc, out_dir / "grid.json")
  (out_dir / "grid.md").write_text(markdown(doc))
  messages = []
  if png:
    from benchmarks.plot import plot
    try:
      plot(doc, out_dir / "grid.png")
    except ImportError as err:
      messages.append(f"grid.png not written ({err}); render it elsewhere "
                      f"with: python -m benchmarks.plot "
                      f"{out_dir / 'grid.json'}")
  return messages


def merge(docs: list[dict]) -> dict:
  """Rows of several runs: a later run's entry for the same cell, pass and
  implementation replaces an earlier one unless it was skipped.  Metadata
  of the first run, with every run's start time."""
  meta = dict(docs[0]["meta"])
  impls = list(meta["impls"])
  rows: dict[tuple[str, str], dict] = {}
  for doc in docs:
    for impl in doc["meta"]["impls"]:
      if impl not in impls:
        impls.append(impl)
    for row in doc["rows"]:
      key = (row["name"], row["pass"])
      if key not in rows:
        rows[key] = row
        continue
      merged = dict(row, impls=dict(rows[key]["impls"]))
      for impl, entry in row["impls"].items():
        if "skipped" not in entry or impl not in merged["impls"]:
          merged["impls"][impl] = entry
      rows[key] = merged
  meta["impls"] = impls
  meta["merged_from"] = [d["meta"].get("started") for d in docs]
  return dict(meta=meta, rows=list(rows.values()))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description="Rewrite grid.md from grid.json, or merge several runs.")
  parser.add_argument("json", nargs="+", type=Path)
  parser.add_argument("--out", type=Path, default=None,
                      help="output folder (default: that of the first file)")
  parser.add_argument("--no-png", action="store_true")
  args = parser.parse_args(argv)
  docs = [json.loads(p.read_text()) for p in args.json]
  doc = merge(docs) if len(docs) > 1 else docs[0]
  out = args.out or args.json[0].parent
  if len(docs) > 1 and out.resolve() == args.json[0].parent.resolve():
    print("merging overwrites the first run's files; pass --out",
          file=sys.stderr)
    return 2
  messages = write_outputs(doc, out, png=not args.no_png)
  for message in messages:
    print(message)
  wrote_png = not args.no_png and not any(
      message.startswith("grid.png not written") for message in messages)
  print(f"wrote {out}/grid.json, grid.md" + (", grid.png" if wrote_png
                                             else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
