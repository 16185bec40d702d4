"""Sweep ``MosaicGpuConfig`` candidates on the current Hopper GPU and print
the per-head-dim table for ``jflash/backends/mosaic_gpu/config.py``.

The search starts from the current tuned table (``tuned_config``, before
the measured rules of ``default_config``) and changes one group of fields
at a time: the forward tiling (block_q, block_kv, stages), then the
forward's loop (``qk_after_pv``), timing the forward alone; then the backward's groups (dQ tiles, dK/dV tiles, ring
depths, ``fuse_dq`` where the head dim allows it), timing
forward+backward.

Every candidate is timed against the incumbent (the best configuration so
far) with their timing groups interleaved, on every mask asked for
(``--masks``, by default both without and with a causal mask), so that
both see the same clock.  A candidate replaces the incumbent only when it
is faster by at least ``--min-gain`` (geometric mean over the masks) and
no mask is slower by more than that: a default table serves both masks,
and a difference inside the run-to-run noise is no reason to change it.
Each candidate's output is first compared with the default
configuration's; candidates that do not fit in shared memory or fail to
compile are reported and skipped.

Usage (from the repository root, on the GPU; about 8 minutes for one head
dim at S=16384)::

  PYTHONPATH=. python3 -m benchmarks.tune_mosaic_gpu --head-dims 128 \\
      --seqs 16384 --out tune.json

With several lengths (``--seqs 1024,16384``) the head dim's row comes from
the longest; for each other length the fields in which its best differs
from that row are printed (:func:`length_differences`), for a rule in
``default_config`` if they are worth one.

The feature rules of ``default_config`` (tiles and loops for segment ids
and soft caps) are tuned with a feature mask alone: ``--masks segments``
(8 packed segments of random lengths per row, no causal mask) or
``--masks softcap`` (a soft cap of 30 under a causal mask).  The search
then starts from the configuration such a call gets by default, resolves
every candidate with the feature, and prints the fields in which the
winner differs from that default, for the feature's rule.

The shapes follow the benchmark grid: ``B*S = 16384`` tokens and
``N*H = 2048``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from benchmarks.cells import (Cell, forward_flops, make_segment_ids,
                              visible_pairs)
from benchmarks.timing import TimerConfig, time_functions
from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
from jflash.backends.mosaic_gpu.config import default_config, tuned_config

_SMEM_BYTES = 227 * 1024
TABLE_MASKS = ("dense", "causal")
# Tuned alone, each for its rule in default_config.
FEATURE_MASKS = ("segments", "softcap")
MASKS = TABLE_MASKS + FEATURE_MASKS
SEGMENTS = 8       # packed segments per row of the segments mask
SOFT_CAP = 30.0    # the softcap mask's logits_soft_cap (with is_causal)
# default_config's feature arguments per feature mask.
FEATURES = {"segments": dict(segments=True),
            "softcap": dict(soft_cap=True, causal=True)}


def parse_masks(text: str) -> tuple[str, ...]:
  """``--masks``: names from ``MASKS``; a feature mask only alone.

  Raises:
    ValueError: an unknown name, none, or a feature mask with others.
  """
  masks = tuple(m for m in text.split(",") if m)
  if not masks or any(m not in MASKS for m in masks):
    raise ValueError(f"--masks: expected comma-separated names from "
                     f"{MASKS}, got {text!r}")
  if len(masks) > 1 and any(m in FEATURE_MASKS for m in masks):
    raise ValueError(f"--masks: a feature mask {FEATURE_MASKS} is tuned "
                     f"alone (its rule serves only calls with the feature), "
                     f"got {text!r}")
  return masks


def mask_features(masks: tuple[str, ...]) -> dict:
  """The ``default_config`` feature arguments of a mask list (none for
  the table's masks)."""
  return FEATURES.get(masks[0], {}) if len(masks) == 1 else {}


def mask_cell(mask: str, batch: int, seq: int, heads: int,
              head_dim: int) -> Cell:
  """The benchmark grid's cell for a tuner mask, whose flops
  (:func:`benchmarks.cells.forward_flops`) the tuner credits: the
  convention for dense and causal masks, visible pairs only for packed
  segments."""
  return Cell(batch=batch, seq_len=seq, num_heads=heads, head_dim=head_dim,
              causal=mask in ("causal", "softcap"),
              segments=SEGMENTS if mask == "segments" else 0)


def make_backend(config: MosaicGpuConfig):
  """The implementation a configuration is timed with."""
  return MosaicGpuBackend(config)


def forward_candidates(head_dim: int) -> list[MosaicGpuConfig]:
  """Forward tilings whose shared memory fits (Q for two warpgroups plus a
  K/V ring, bfloat16) and whose per-thread accumulators can fit in the
  registers a consumer gets."""
  found = []
  for block_q, block_kv, stages in itertools.product(
      (64, 128), (64, 128, 192, 256), (2, 3, 4)):
    smem = 2 * (2 * block_q * head_dim + 2 * stages * block_kv * head_dim)
    # Output accumulator (float32) plus the score tile (float32) and its
    # bfloat16 copy, per thread of a warpgroup; the compiler decides the
    # rest, and spills show up in the timing.
    registers = (block_q * head_dim + 1.5 * block_q * block_kv) / 128
    # A loose filter: compiling reports the exact shared-memory overflow.
    if smem <= _SMEM_BYTES and registers <= 256:
      found.append(MosaicGpuConfig(block_q=block_q, block_kv=block_kv,
                                   stages=stages))
  return found


def forward_switches() -> list[dict]:
  """Tried on the best forward tiling: the loop with ``Q K^T`` issued
  after ``P V`` has finished or right behind it."""
  return [dict(qk_after_pv=False), dict(qk_after_pv=True)]


def backward_groups(head_dim: int) -> list[list[dict]]:
  """Field groups varied one after another for the backward."""
  blocks = (64, 128)
  dq = [dict(block_q_dq=a, block_kv_dq=b) for a, b in
        itertools.product(blocks, blocks)]
  dkv = [dict(block_q_dkv=a, block_kv_dkv=b) for a, b in
         itertools.product(blocks, blocks)
         if head_dim <= 128 or b == 64]
  # A one-buffer dQ pass cannot issue S and dP together (overlap_sdp).
  stages = [dict(stages_dq=a, stages_dkv=b,
                 **(dict(overlap_sdp=False) if a == 1 else {}))
            for a, b in itertools.product((1, 2, 3), (1, 2, 3))]
  groups = [dq, dkv, stages]
  if head_dim <= 128:  # overlap_sdp's and the one-pass backward's range
    groups.append([dict(overlap_sdp=False), dict(overlap_sdp=True)])
    # The fused backward replaces the dQ pass, whose fields it rejects.
    no_dq_pass = dict(block_q_dq=None, block_kv_dq=None, stages_dq=None)
    groups.append([dict(fuse_dq=False)] + [
        dict(fuse_dq=True, dq_slots=n, **no_dq_pass) for n in (1, 2, 4, 8)])
  return groups


def search_groups(head_dim: int) -> list[tuple[str, list[dict]]]:
  """The groups of field changes tried in order, each with the pass it is
  timed on (``fwd`` or ``fwdbwd``)."""
  tilings = [dict(block_q=c.block_q, block_kv=c.block_kv, stages=c.stages)
             for c in forward_candidates(head_dim)]
  return ([("fwd", tilings), ("fwd", forward_switches())] +
          [("fwdbwd", group) for group in backward_groups(head_dim)])


def speedup(ratios: dict[str, float]) -> float:
  """Geometric mean of per-mask speed ratios (candidate over incumbent)."""
  return math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))


def accepted(ratios: dict[str, float], min_gain: float) -> bool:
  """Whether a candidate with these per-mask speed ratios over the
  incumbent replaces it: faster by ``min_gain`` on the geometric mean, and
  slower by no more than ``min_gain`` on any mask."""
  return (speedup(ratios) >= 1 + min_gain and
          min(ratios.values()) >= 1 - min_gain)


# (candidate, incumbent, pass name) -> a row: "ratio" {mask: candidate
# speed / incumbent speed}, with "tflops" and "incumbent_tflops"; or
# "error".
Measure = Callable[[MosaicGpuConfig, MosaicGpuConfig, str], dict]


def start_config(head_dim: int, seq: int, features: dict | None = None
                 ) -> MosaicGpuConfig:
  """Where a search starts: the tuned table (:func:`tuned_config`), or
  with ``features`` (:data:`FEATURES`) the configuration such a call gets
  by default, feature rules included."""
  if features:
    return default_config(head_dim, seq, **features)
  return tuned_config(head_dim, seq)


def tune(measure: Measure, head_dim: int, seq: int,
         log: Callable[[dict], None],
         min_gain: float, features: dict | None = None
         ) -> tuple[MosaicGpuConfig, list[dict]]:
  """Greedy search from :func:`start_config`, one group of fields at a
  time (:func:`search_groups`); with ``features`` every candidate is
  resolved with them.

  In each group the accepted candidate (:func:`accepted`) with the largest
  speedup over the group's starting configuration wins; when none is
  accepted the starting configuration stays.

  Returns:
    The final configuration (fully resolved) and every measured row.
  """
  features = features or {}
  incumbent = start_config(head_dim, seq, features)
  rows = []
  for pass_name, group in search_groups(head_dim):
    winner, winner_speedup = incumbent, 1.0
    for fields in group:
      row = dict(pass_=pass_name, fields=fields)
      try:
        candidate = dataclasses.replace(incumbent, **fields).resolved(
            head_dim, seq, **features)
      except ValueError as err:
        row["error"] = f"ValueError: {err}"
      else:
        if candidate == incumbent:
          continue
        row["config"] = dataclasses.asdict(candidate)
        row.update(measure(candidate, incumbent, pass_name))
        if "ratio" in row and accepted(row["ratio"], min_gain):
          row["accepted"] = True
          if speedup(row["ratio"]) > winner_speedup:
            winner, winner_speedup = candidate, speedup(row["ratio"])
      rows.append(row)
      log(row)
    incumbent = winner
  return incumbent, rows


def _rel(x, y) -> float:
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


@dataclasses.dataclass
class Tuner:
  """Times configurations of one shape on the current GPU."""

  head_dim: int
  seq: int
  masks: tuple[str, ...]
  timer: TimerConfig
  tokens: int = 16384  # B * S
  width: int = 2048    # N * H
  seed: int | None = None  # of the inputs; None: the current time

  def __post_init__(self):
    heads = max(1, self.width // self.head_dim)
    batch = max(1, self.tokens // self.seq)
    shape = (batch, self.seq, heads, self.head_dim)
    seed = int(time.time()) if self.seed is None else self.seed
    keys = jax.random.split(jax.random.key(seed), 8)
    make = lambda key: jax.random.normal(key, shape, jnp.bfloat16)  # noqa
    rng = np.random.default_rng(seed)
    # Each input set: Q, K, V, the output cotangent and segment ids (read
    # only by the segments mask).
    segments = [make_segment_ids(rng, batch, self.seq, SEGMENTS)
                for _ in range(2)]
    self.inputs = [tuple(make(k) for k in keys[4 * i:4 * i + 4])
                   + (jnp.asarray(segments[i]),) for i in range(2)]
    # Forward flops credited per mask, averaged over the input sets.
    cells = {mask: mask_cell(mask, batch, self.seq, heads, self.head_dim)
             for mask in self.masks}
    self.flops = {mask: float(np.mean(
        [forward_flops(cell, visible_pairs(cell, ids)) for ids in segments]))
                  for mask, cell in cells.items()}
    self.functions: dict[tuple, Callable] = {}
    self.baseline: dict[tuple, tuple] = {}

  def _function(self, config: MosaicGpuConfig, mask: str, pass_name: str):
    key = (config, mask, pass_name)
    if key not in self.functions:
      backend = make_backend(config)

      def attend(q, k, v, segment_ids):
        return jflash.dot_product_attention(
            q, k, v, is_causal=mask in ("causal", "softcap"),
            segment_ids=segment_ids if mask == "segments" else None,
            logits_soft_cap=SOFT_CAP if mask == "softcap" else None,
            implementation=backend)

      def forward(q, k, v, cot, segment_ids):
        del cot
        return (attend(q, k, v, segment_ids),)

      def both(q, k, v, cot, segment_ids):
        out, vjp = jax.vjp(lambda *a: attend(*a, segment_ids), q, k, v)
        return out, *vjp(cot)
      self.functions[key] = jax.jit(forward if pass_name == "fwd" else both)
    return self.functions[key]

  def _check(self, config: MosaicGpuConfig, mask: str,
             pass_name: str) -> float:
    """Largest relative difference from the default configuration."""
    result = jax.block_until_ready(
        self._function(config, mask, pass_name)(*self.inputs[0]))
    if (mask, pass_name) not in self.baseline:
      default = MosaicGpuConfig()
      self.baseline[mask, pass_name] = self._function(
          default, mask, pass_name)(*self.inputs[0])
    return max(_rel(a, b) for a, b in
               zip(result, self.baseline[mask, pass_name]))

  def measure(self, candidate: MosaicGpuConfig, incumbent: MosaicGpuConfig,
              pass_name: str) -> dict:
    """Speed of ``candidate`` over ``incumbent`` per mask, timed
    interleaved, after checking the candidate's result."""
    row = dict(ratio={}, tflops={}, incumbent_tflops={})
    factor = 3.5 if pass_name == "fwdbwd" else 1.0
    for mask in self.masks:
      try:
        diff = self._check(candidate, mask, pass_name)
      except Exception as err:  # noqa: BLE001 (compile failures are data)
        return dict(error=f"{type(err).__name__}: {str(err)[:200]}")
      if not np.isfinite(diff) or diff > 1e-2:
        return dict(error=f"{mask}: differs from the default configuration "
                    f"by {diff:.2e}")
      timings = time_functions(
          [self._function(incumbent, mask, pass_name),
           self._function(candidate, mask, pass_name)],
          self.inputs, self.timer)
      for timing in timings:
        if "error" in timing:
          return dict(error=f"{mask}: {timing['error']!r}"[:200])
      flops = factor * self.flops[mask]
      old, new = (t["ms"] * 1e-3 for t in timings)
      row["ratio"][mask] = old / new
      row["tflops"][mask] = flops / new / 1e12
      row["incumbent_tflops"][mask] = flops / old / 1e12
    return row


def _show(row: dict) -> str:
  if "error" in row:
    value = row["error"]
  else:
    value = "  ".join(
        f"{mask} {row['tflops'][mask]:6.1f} (incumbent "
        f"{row['incumbent_tflops'][mask]:6.1f})" for mask in row["ratio"])
    value += f"  x{speedup(row['ratio']):.3f}"
    value += "  accepted" if row.get("accepted") else ""
  return f"  {row['pass_']:6s} {row['fields']}: {value}"


def length_differences(best_by_seq: dict[int, MosaicGpuConfig]
                       ) -> tuple[MosaicGpuConfig, dict[int, dict]]:
  """The head dim's row (the best at the longest tuned length) and, for
  each shorter length whose best differs from it, the differing fields."""
  seqs = sorted(best_by_seq)
  row = best_by_seq[seqs[-1]]
  differences = {}
  for seq in seqs[:-1]:
    best = best_by_seq[seq]
    fields = {f.name: getattr(best, f.name)
              for f in dataclasses.fields(best)
              if getattr(best, f.name) != getattr(row, f.name)}
    if fields:
      differences[seq] = fields
  return row, differences


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--head-dims", default="64,128,256")
  parser.add_argument("--seqs", "--seq", dest="seqs", default="4096",
                      help="comma-separated sequence lengths; with several, "
                      "the row comes from the longest and the others' "
                      "differences from it are printed")
  parser.add_argument("--masks", default=",".join(TABLE_MASKS),
                      help=f"comma-separated, from {TABLE_MASKS}, or one of "
                      f"{FEATURE_MASKS} alone (tunes that feature's rule)")
  parser.add_argument("--min-gain", type=float, default=0.02,
                      help="speedup a candidate needs to replace the "
                      "incumbent (0.02: 2%%)")
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None, help="JSON file for all rows")
  parser.add_argument("--combine", nargs="+", metavar="JSON", default=None,
                      help="print the table from earlier runs' --out files "
                      "(e.g. one length per device call); runs nothing")
  args = parser.parse_args()
  if args.combine:
    _print_table(_combined(args.combine))
    return
  try:
    masks = parse_masks(args.masks)
  except ValueError as err:
    parser.error(str(err))
  features = mask_features(masks)
  seqs = sorted(int(x) for x in str(args.seqs).split(","))
  timer = TimerConfig(calls=args.calls, repeats=args.repeats, warmup=2)
  results, table = [], {}

  for head_dim in (int(h) for h in args.head_dims.split(",")):
    best_by_seq = {}
    for seq in seqs:
      default = start_config(head_dim, seq, features)
      print(f"head dim {head_dim}, S={seq}, masks {masks} "
            f"(default {default})", flush=True)
      tuner = Tuner(head_dim, seq, masks, timer)
      best, rows = tune(tuner.measure, head_dim, seq,
                        lambda row: print(_show(row), flush=True),
                        args.min_gain, features)
      best_by_seq[seq] = best
      results.append(dict(head_dim=head_dim, seq=seq, masks=masks,
                          features=features,
                          min_gain=args.min_gain,
                          default=dataclasses.asdict(default),
                          best=dataclasses.asdict(best), rows=rows))
      if args.out:
        with open(args.out, "w") as f:
          json.dump(dict(device=jax.devices()[0].device_kind,
                         jax=jax.__version__, results=results), f, indent=1)
    table[head_dim] = best_by_seq
  if features:
    _print_feature_fields(masks[0], table)
  else:
    _print_table(table)


def feature_fields(head_dim: int, seq: int, mask: str,
                   best: MosaicGpuConfig) -> dict:
  """The fields in which a feature mask's winner differs from the
  configuration such a call gets by default: what the feature's rule in
  ``default_config`` would set (empty: keep the rule)."""
  default = start_config(head_dim, seq, FEATURES[mask])
  return {f.name: getattr(best, f.name) for f in dataclasses.fields(best)
          if getattr(best, f.name) != getattr(default, f.name)}


def _print_feature_fields(
    mask: str, table: dict[int, dict[int, MosaicGpuConfig]]) -> None:
  print(f"\nFor the {mask} rules of default_config "
        f"(jflash/backends/mosaic_gpu/config.py), fields to change:")
  for head_dim, by_seq in table.items():
    for seq, best in sorted(by_seq.items()):
      fields = feature_fields(head_dim, seq, mask, best)
      print(f"    head dim {head_dim}, S={seq}: "
            + (", ".join(f"{k}={v}" for k, v in fields.items())
               if fields else "none (the rule's configuration is kept)"))


def _combined(paths: list[str]) -> dict[int, dict[int, MosaicGpuConfig]]:
  """``{head_dim: {seq: best}}`` from ``--out`` files (a later file's
  result for the same head dim and length wins)."""
  table: dict[int, dict[int, MosaicGpuConfig]] = {}
  for path in paths:
    with open(path) as f:
      for result in json.load(f)["results"]:
        if result.get("features"):
          continue  # a feature rule's search, not the table's
        table.setdefault(result["head_dim"], {})[result["seq"]] = (
            MosaicGpuConfig(**result["best"]))
  return table


def _print_table(table: dict[int, dict[int, MosaicGpuConfig]]) -> None:
  """The rows for ``_DEFAULTS``, ready to paste, and where several
  lengths were tuned, each shorter length's differences from its row."""
  print("\nPaste into jflash/backends/mosaic_gpu/config.py (_DEFAULTS):")
  differences_by_head = {}
  for head_dim, by_seq in table.items():
    row, differences_by_head[head_dim] = length_differences(by_seq)
    fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(
        row).items())
    same = row == tuned_config(head_dim, max(by_seq))
    print(f"    {head_dim}: MosaicGpuConfig({fields}),"
          + ("  # the default, kept" if same else ""))
  for head_dim, differences in differences_by_head.items():
    for seq, fields in differences.items():
      print(f"    head dim {head_dim}, S={seq} differs from the row in: "
            + ", ".join(f"{k}={v}" for k, v in fields.items()))


if __name__ == "__main__":
  main()
