"""Decode benchmark grid: ``jflash.decode_attention`` time and bandwidth.

Decoding reads the cache once per key/value head and does little
arithmetic per byte, so its speed is a bandwidth: the bytes of the key and
value slots the new tokens see (``K * H * 2`` values per slot of every
sequence, below its length and inside the window), divided by the time.
Each cell reports that bandwidth and its share of the device's copy
bandwidth, measured in the same run as ``y = x + 1`` over a buffer of the
same size (which reads and writes it: ``2 x bytes`` moved).

    python -m benchmarks.decode                       # the grid, this device
    python -m benchmarks.decode --small --out /tmp/decode.jsonl  # smoke

One JSON object per cell goes to ``--out`` (and a table to stdout).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from benchmarks.timing import TimerConfig, time_function


@dataclasses.dataclass(frozen=True)
class Cell:
  """One decode problem."""

  batch: int
  context: int        # valid slots per sequence after the append (S)
  num_new: int        # T
  heads: int = 32     # N
  kv_heads: int = 8   # K
  head_dim: int = 128
  page_size: int | None = 16   # None: a contiguous cache
  window: int | None = None
  dtype: str = "bfloat16"

  @property
  def slots_read(self) -> int:
    """Cache slots whose keys some new token sees, over the batch."""
    per_sequence = self.context
    if self.window is not None:
      per_sequence = min(self.context, self.window + self.num_new)
    return self.batch * per_sequence

  @property
  def bytes_read(self) -> int:
    itemsize = np.dtype(self.dtype).itemsize
    return 2 * self.slots_read * self.kv_heads * self.head_dim * itemsize


def make_inputs(cell: Cell, rng: np.random.Generator):
  """``(query, key, value, lengths, block_table)``; pages of a paged cache
  in a random order."""
  dtype = jnp.dtype(cell.dtype)
  normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32),
                                     dtype)
  q = normal((cell.batch, cell.num_new, cell.heads, cell.head_dim))
  lengths = jnp.full((cell.batch,), cell.context, jnp.int32)
  if cell.page_size is None:
    shape = (cell.batch, cell.context, cell.kv_heads, cell.head_dim)
    return q, normal(shape), normal(shape), lengths, None
  max_pages = -(-cell.context // cell.page_size)
  pool = cell.batch * max_pages
  table = rng.permutation(pool).reshape(cell.batch, max_pages)
  shape = (pool, cell.page_size, cell.kv_heads, cell.head_dim)
  return (q, normal(shape), normal(shape), lengths,
          jnp.asarray(table, jnp.int32))


def measure(cell: Cell, implementation: str | None, timer: TimerConfig,
            rng: np.random.Generator) -> dict:
  """The cell's decode time, bandwidth and share of copy bandwidth."""
  inputs = [make_inputs(cell, rng) for _ in range(2)]
  window = None if cell.window is None else (cell.window, 0)

  @jax.jit
  def decode(q, k, v, lengths, table):
    return jflash.decode_attention(q, k, v, lengths, block_table=table,
                                   local_window_size=window,
                                   implementation=implementation)

  decoded = time_function(decode, inputs, timer)
  # The copy baseline over as many bytes as the decode reads.
  elements = cell.bytes_read // np.dtype(cell.dtype).itemsize
  buffers = [(jnp.ones((elements,), cell.dtype),) for _ in range(2)]
  copied = time_function(jax.jit(lambda x: x + 1), buffers, timer)
  decode_gbs = cell.bytes_read / decoded["ms"] / 1e6
  copy_gbs = 2 * cell.bytes_read / copied["ms"] / 1e6
  return dict(dataclasses.asdict(cell), implementation=implementation,
              device=jax.devices()[0].device_kind, ms=decoded["ms"],
              bytes_read=cell.bytes_read, decode_gb_s=decode_gbs,
              copy_gb_s=copy_gbs, share_of_copy=decode_gbs / copy_gbs)


def grid(small: bool) -> list[Cell]:
  if small:  # a CPU smoke run
    return [Cell(batch=b, context=s, num_new=t, heads=4, kv_heads=2,
                 head_dim=32, page_size=p, dtype="float32")
            for b, s, t, p in itertools.product((1, 2), (64,), (1, 4),
                                                (None, 16))]
  cells = [Cell(batch=b, context=s, num_new=t, page_size=p)
           for b, s, t, p in itertools.product(
               (1, 8, 32), (1024, 8192, 32768), (1, 4, 16), (None, 16))]
  cells += [Cell(batch=8, context=32768, num_new=1, window=4096)]
  return cells


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--implementation", default=None,
                 help="decode backend name (default: jflash's choice)")
  p.add_argument("--small", action="store_true",
                 help="a few tiny float32 cells (a smoke run on the CPU)")
  p.add_argument("--out", default=None, help="JSON lines file")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  timer = TimerConfig(calls=3, repeats=3, warmup=1) if args.small else \
      TimerConfig()
  rng = np.random.default_rng(args.seed)
  out = open(args.out, "w", encoding="utf-8") if args.out else None
  print(f"{'B':>3} {'S':>6} {'T':>3} {'layout':>8} {'ms':>9} {'GB/s':>8} "
        f"{'copy GB/s':>9} {'share':>6}")
  for cell in grid(args.small):
    row = measure(cell, args.implementation, timer, rng)
    layout = "contig" if cell.page_size is None else f"paged{cell.page_size}"
    if cell.window is not None:
      layout += f"/w{cell.window}"
    print(f"{cell.batch:>3} {cell.context:>6} {cell.num_new:>3} "
          f"{layout:>8} {row['ms']:>9.4f} {row['decode_gb_s']:>8.1f} "
          f"{row['copy_gb_s']:>9.1f} {row['share_of_copy']:>6.2f}")
    if out is not None:
      out.write(json.dumps(row) + "\n")
      out.flush()
  if out is not None:
    out.close()


if __name__ == "__main__":
  main(sys.argv[1:])
