"""Time jflash and its peers over a shape grid on the current device.

    PYTHONPATH=. python -m benchmarks.grid [--quick] [--cells H=128] \\
        [--impls jflash,jax_nn_cudnn,jax_nn_xla,tokamax] [--out DIR]

For every cell (see :mod:`benchmarks.cells`), implementation and pass
(forward; forward+backward), the jitted function is run once on fresh random
inputs and checked against a float32 reference (:mod:`benchmarks.check`);
only a correct result is timed (:mod:`benchmarks.timing`).  An
implementation that cannot serve a cell is recorded with the reason and the
run goes on.  ``grid.json`` and ``grid.md`` are rewritten after every cell,
``grid.png`` at the end (:mod:`benchmarks.report`, :mod:`benchmarks.plot`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import check, impls as impls_lib, report
from benchmarks.cells import (FULL, PASS_FLOP_FACTOR, PASSES, TINY, Cell,
                              GridSpec, dense_flops, filter_cells,
                              forward_flops, make_segment_ids, tflops,
                              visible_pairs)
from benchmarks.clocks import ClockSampler, summarize_windows
from benchmarks.impls import Impl, Unsupported
from benchmarks.timing import METHODS, TimerConfig, time_functions

BASELINE = "jax_nn_cudnn"
"""Accuracy ratios are taken against this implementation."""
SLOW = {"jax_nn_xla": 16384}
"""``--skip-slow``: implementations skipped at or above this length."""


def _summarize(err: BaseException) -> str:
  text = " ".join(str(err).split())
  return f"{type(err).__name__}: {text[:600]}"


def _free() -> None:
  gc.collect()


class CellRunner:
  """Runs cells: inputs, reference, checks and timings.

  Args:
    impls: the implementations, in column order.
    timer: how to time.
    dtype: input dtype.
    passes: subset of :data:`PASSES`.
    input_sets: random input sets rotated through the timed calls.
    check_heads: key/value heads compared against the reference.
    seed: base of every cell's random inputs.
    skip_slow: skip :data:`SLOW` implementations at long sequences.
    interleave: time the implementations of a pass with their timing groups
      interleaved (:func:`benchmarks.timing.time_functions`), so that clock
      changes during the cell fall on all of them alike; False times them
      one after another.
    progress: called with a short label after each (implementation, pass).
    clocks: a running :class:`benchmarks.clocks.ClockSampler`, or None;
      with one, each timed entry gets ``clocks``: the median over its
      timing groups of the SM clock (MHz) and board power (W).
  """

  def __init__(self, impls: list[Impl], timer: TimerConfig, *,
               dtype=jnp.bfloat16, passes=PASSES, input_sets: int = 3,
               check_heads: int = 1, seed: int = 0, skip_slow: bool = False,
               interleave: bool = True, progress=None, clocks=None):
    self.impls = impls
    self.timer = timer
    self.dtype = dtype
    self.passes = tuple(passes)
    self.input_sets = input_sets
    self.check_heads = check_heads
    self.seed = seed
    self.skip_slow = skip_slow
    self.interleave = interleave
    self.progress = progress or (lambda label: None)
    self.clocks = clocks

  def _rows(self, cell: Cell, pairs: int, seg: np.ndarray | None) -> dict:
    flops = forward_flops(cell, pairs)
    rows = {}
    for p in self.passes:
      row = dict(cell.describe(), **{"pass": p}, visible_pairs=pairs,
                 flops=flops * PASS_FLOP_FACTOR[p],
                 flops_dense_equiv=dense_flops(cell) * PASS_FLOP_FACTOR[p],
                 impls={})
      if seg is not None and seg.shape[0] <= 4:
        row["segment_lengths"] = [np.bincount(r).tolist() for r in seg]
      rows[p] = row
    return rows

  def skipped(self, cell: Cell, reason: str) -> list[dict]:
    """Rows of a cell that is not run."""
    seg = (make_segment_ids(np.random.default_rng(self.seed), cell.batch,
                            cell.seq_len, cell.segments)
           if cell.segments else None)
    rows = self._rows(cell, visible_pairs(cell, seg), seg)
    for row in rows.values():
      row["impls"] = {i.name: {"skipped": reason} for i in self.impls}
    return list(rows.values())

  def run(self, cell: Cell, index: int = 0) -> list[dict]:
    """One row per pass, with an entry per implementation."""
    start = time.perf_counter()
    rng = np.random.default_rng([self.seed, index])
    seg = (make_segment_ids(rng, cell.batch, cell.seq_len, cell.segments)
           if cell.segments else None)
    pairs = visible_pairs(cell, seg)
    rows = self._rows(cell, pairs, seg)
    seg_dev = None if seg is None else jnp.asarray(seg)
    keys = jax.random.split(jax.random.key(self.seed + 7919 * (index + 1)),
                            self.input_sets)
    sets = []
    for key in keys:
      q, k, v, ct = impls_lib.random_inputs(key, cell, self.dtype)
      sets.append((q, k, v, seg_dev, ct))
    try:
      ref = check.reference(cell, *sets[0], check_heads=self.check_heads)
      jax.block_until_ready(ref)
      ref_error = None
    except Exception as err:  # pylint: disable=broad-except
      ref, ref_error = None, f"reference failed: {_summarize(err)}"

    built = {}
    for impl in self.impls:
      try:
        built[impl.name] = ((impl.build(cell), None) if ref_error is None
                            else (None, ref_error))
      except Unsupported as err:
        built[impl.name] = (None, str(err))
    for p in self.passes:
      # Compile and check every implementation, then time those that
      # passed, their timing groups interleaved.
      checked = []
      for impl in self.impls:
        attend, build_error = built[impl.name]
        entry: dict
        if build_error is not None:
          key = "error" if ref_error else "unsupported"
          entry = {key: build_error}
        elif self.skip_slow and cell.seq_len >= SLOW.get(impl.name, 1 << 60):
          entry = {"skipped": f"--skip-slow (S >= {SLOW[impl.name]})"}
        else:
          entry, fn = self._check(cell, p, attend, sets, ref)
          if fn is not None:
            checked.append((entry, fn))
        rows[p]["impls"][impl.name] = entry
      self._time(checked, sets, rows[p])
      for impl in self.impls:
        self.progress(f"{cell.name} {impl.name} {p}")
    del sets, ref
    _free()
    for row in rows.values():
      _add_ratios(row)
      row["cell_seconds"] = round(time.perf_counter() - start, 2)
    return list(rows.values())

  def _check(self, cell: Cell, pass_name: str, attend, sets: list[tuple],
             ref: dict) -> tuple[dict, Callable | None]:
    """Compiles a pass and checks its result against the reference: the
    entry so far, and the function to time (None if it failed)."""
    entry: dict = {}
    try:
      fn = impls_lib.pass_function(attend, pass_name)
      t0 = time.perf_counter()
      outputs = jax.block_until_ready(fn(*sets[0]))
      entry["first_call_s"] = round(time.perf_counter() - t0, 3)
      errors = check.relative_errors(cell, outputs, ref, self.check_heads)
      del outputs
      entry["errors"] = errors
      failure = check.sanity_failure(errors)
      if failure:
        entry["failed_check"] = failure
        return entry, None
      return entry, fn
    except Exception as err:  # pylint: disable=broad-except
      entry["error"] = _summarize(err)
      _free()
      return entry, None

  def _time(self, checked: list[tuple[dict, Callable]], sets: list[tuple],
            row: dict) -> None:
    """Times the checked functions (interleaved unless the runner is
    sequential) and fills in their entries."""
    if self.interleave:
      timings = time_functions([fn for _, fn in checked], sets, self.timer)
    else:
      timings = [time_functions([fn], sets, self.timer)[0]
                 for _, fn in checked]
    for (entry, _), timing in zip(checked, timings):
      if "error" in timing:
        entry["error"] = _summarize(timing["error"])
        _free()
        continue
      windows = timing.pop("windows")
      entry.update(timing, tflops=tflops(row["flops"], timing["ms"]))
      if self.clocks is not None:
        seen = summarize_windows([self.clocks.window(a, b)
                                  for a, b in windows])
        if seen is not None:
          entry["clocks"] = seen
      if row["kind"] != "dense":
        entry["tflops_dense_equiv"] = tflops(row["flops_dense_equiv"],
                                             timing["ms"])


def _add_ratios(row: dict) -> None:
  base = row["impls"].get(BASELINE, {})
  base_errors = base.get("errors") if "failed_check" not in base else None
  for entry in row["impls"].values():
    if "errors" not in entry:
      continue
    r = check.ratios(entry["errors"], base_errors)
    entry["ratio_to_cudnn"] = r
    if r:
      worst = max(r.values())
      entry["max_ratio_to_cudnn"] = worst
      entry["accuracy_ok"] = worst <= check.CUDNN_RATIO_LIMIT


def cell_summary(rows: list[dict], position: str) -> str:
  """One line: TFLOP/s (or status) per implementation and pass."""
  parts = []
  for row in rows:
    items = []
    for name, e in row["impls"].items():
      if "tflops" in e:
        items.append(f"{name} {report.fmt_number(e['tflops'])}")
      else:
        status = next((k for k in report.STATUS_KEYS if k in e), "?")
        items.append(f"{name} {status}")
    parts.append(f"{report.PASS_LABEL[row['pass']]}: " + ", ".join(items))
  first = rows[0]
  return (f"[{position}] {first['name']} B={first['B']} N={first['N']} "
          f"({first['cell_seconds']:.0f} s) | " + " | ".join(parts))


def _parse_args(argv):
  p = argparse.ArgumentParser(
      description="Time attention implementations over a shape grid.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--impls", default=None,
                 help="comma-separated: jflash, jflash:<backend>, "
                 "jax_nn_cudnn, jax_nn_xla, tokamax (default: all, tokamax "
                 "if installed)")
  p.add_argument("--jflash-impl", default="mosaic_gpu",
                 help="jflash backend for 'jflash' ('default': jflash picks)")
  p.add_argument("--cells", default=None,
                 help="filter, e.g. 'H=128,S=16384' or 'kind=window'")
  p.add_argument("--quick", action="store_true",
                 help="a few cells (tiny shapes on a CPU)")
  p.add_argument("--tiny", action="store_true", help="tiny shapes")
  p.add_argument("--passes", default="fwd,fwdbwd")
  p.add_argument("--dtype", default="bfloat16",
                 choices=["bfloat16", "float16", "float32"])
  p.add_argument("--timer", default="enqueue", choices=METHODS)
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--max-timing-s", type=float, default=2.0,
                 help="per function: fewer calls per group beyond this")
  p.add_argument("--input-sets", type=int, default=3)
  p.add_argument("--sequential-timing", action="store_true",
                 help="time implementations one after another instead of "
                 "interleaving their timing groups")
  p.add_argument("--check-heads", type=int, default=1)
  p.add_argument("--skip-slow", action="store_true",
                 help="skip jax_nn_xla at S >= 16384")
  p.add_argument("--xla-max-logits-gib", type=float, default=64.0,
                 help="jax_nn_xla segment cells: largest dense mask problem")
  p.add_argument("--time-budget", type=float, default=None,
                 help="seconds; cells not started by then are skipped")
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--commit", default=None,
                 help="commit to record (default: $JFLASH_COMMIT or git)")
  p.add_argument("--out", type=Path, default=None,
                 help="default: benchmarks/results/<date>-<device>")
  p.add_argument("--no-png", action="store_true")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--clocks", action="store_true",
                 help="sample the GPU's SM clock and power (nvidia-smi) "
                 "during each timing group and record them per entry")
  return p.parse_args(argv)


def _progress_bar(total: int, disable: bool):
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return None
  interactive = sys.stderr.isatty()
  return tqdm(total=total, disable=disable, unit="run", dynamic_ncols=True,
              mininterval=0.5 if interactive else 15.0)


def main(argv: list[str] | None = None) -> int:
  args = _parse_args(argv)
  if args.clocks and not ClockSampler.available():
    print("--clocks: nvidia-smi not found", file=sys.stderr)
    return 2
  on_cpu = jax.default_backend() == "cpu"
  spec: GridSpec = TINY if args.tiny or (args.quick and on_cpu) else FULL
  cells = spec.quick_cells() if args.quick else spec.cells()
  cells = filter_cells(cells, args.cells)
  if not cells:
    print("no cell matches --cells", file=sys.stderr)
    return 2
  names = (args.impls.split(",") if args.impls
           else impls_lib.default_impl_names())
  impls = impls_lib.make_impls([n.strip() for n in names if n.strip()],
                               jflash_impl=args.jflash_impl,
                               max_logits_gib=args.xla_max_logits_gib)
  passes = [p for p in args.passes.split(",") if p]
  if not set(passes) <= set(PASSES):
    print(f"--passes must be among {PASSES}", file=sys.stderr)
    return 2
  timer = TimerConfig(args.timer, args.calls, args.repeats, args.warmup,
                      args.max_timing_s)
  seed = args.seed if args.seed is not None else int.from_bytes(
      os.urandom(4), "little") >> 1
  meta = report.run_metadata(args.commit)
  meta.update(dtype=args.dtype,
              timer=dict(timer.describe(),
                         interleaved=not args.sequential_timing),
              seed=seed,
              input_sets=args.input_sets, check_heads=args.check_heads,
              impls=[i.name for i in impls],
              impl_notes={i.name: i.note for i in impls},
              grid=dict(tokens=spec.tokens, width=spec.width,
                        quick=args.quick, cells_filter=args.cells),
              flops="forward 4*B*N*T*S*H (halved when causal), visible "
              "pairs 4*N*H*pairs for window/segment cells; fwd+bwd 3.5x",
              accuracy=dict(sanity_limit=check.SANITY_LIMIT,
                            ratio_limit=check.CUDNN_RATIO_LIMIT,
                            baseline=BASELINE),
              argv=sys.argv[1:] if argv is None else list(argv))
  out = args.out or Path("benchmarks/results") / (
      datetime.date.today().isoformat() + "-" +
      report.device_slug(meta["device"]["kind"]))
  out.mkdir(parents=True, exist_ok=True)
  log = (out / "grid.log").open("a")

  def say(line: str) -> None:
    if bar is not None:
      bar.write(line, file=sys.stdout)
    else:
      print(line)
    sys.stdout.flush()
    log.write(line + "\n")
    log.flush()

  bar = _progress_bar(len(cells) * len(impls) * len(passes),
                      args.no_progress)

  def progress(label: str) -> None:
    if bar is not None:
      bar.set_description(label[:48], refresh=False)
      bar.update(1)

  say(f"{meta['device']['kind']}: {len(cells)} cells x {len(impls)} "
      f"implementations x {len(passes)} passes, {args.dtype}, timer "
      f"{timer.method}, out {out}")
  clocks = None
  if args.clocks:
    clocks = ClockSampler().start()
    meta["clocks"] = "SM MHz and board W from nvidia-smi -lms 10, mean per "\
        "timing group, median over groups"
  runner = CellRunner(impls, timer, dtype=jnp.dtype(args.dtype),
                      passes=passes, input_sets=args.input_sets,
                      check_heads=args.check_heads, seed=seed,
                      skip_slow=args.skip_slow,
                      interleave=not args.sequential_timing,
                      progress=progress, clocks=clocks)
  doc = dict(meta=meta, rows=[], complete=False)
  start = time.perf_counter()
  try:
    for index, cell in enumerate(cells):
      if args.time_budget and time.perf_counter() - start > args.time_budget:
        rows = runner.skipped(cell, f"--time-budget {args.time_budget:g} s")
        if bar is not None:
          bar.update(len(impls) * len(passes))
      else:
        rows = runner.run(cell, index)
        say(cell_summary(rows, f"{index + 1}/{len(cells)}"))
      doc["rows"].extend(rows)
      doc["elapsed_s"] = round(time.perf_counter() - start, 1)
      report.write_outputs(doc, out, png=False)
  finally:
    # A run that stops early must not leave nvidia-smi polling.
    if clocks is not None:
      clocks.close()
  if bar is not None:
    bar.close()
  if clocks is not None:
    if not clocks.samples:
      doc["meta"]["clocks"] = "requested, but nvidia-smi gave no readings"
      say("--clocks: nvidia-smi gave no readings")
  doc["complete"] = True
  doc["meta"]["finished"] = datetime.datetime.now(
      datetime.timezone.utc).isoformat(timespec="seconds")
  for message in report.write_outputs(doc, out, png=not args.no_png):
    say(message)
  say(f"done in {time.perf_counter() - start:.0f} s: {out}/grid.json, "
      "grid.md" + ("" if args.no_png or not (out / "grid.png").exists()
                   else ", grid.png"))
  log.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
