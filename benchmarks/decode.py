"""Decode benchmark: ``jflash.decode_attention`` against its peers.

Decoding reads the key/value cache once and does little arithmetic per
byte, so its speed is a bandwidth: the bytes of the key and value slots the
new tokens see (``2 * K * H * itemsize`` per slot of every sequence, below
its length and inside the window), divided by the time.  Each (cell,
implementation) reports its time, that bandwidth and its share of the
device's copy bandwidth, measured once at the start of the same run as
``y = x + 1`` over a 2 GiB buffer (read and written: twice its bytes).

The grid: ``B`` in {1, 8, 64}, ``S`` in {4096, 32768, 131072} cache slots,
every slot valid (``lengths = S``) or, from ``B=8``, ragged (each length
drawn uniformly from ``[S/8, S]``, a serving batch; bytes counted over the
valid slots only), ``N=32``, ``K=8``, ``H=128``, bfloat16, one new token
(``T=1``) and a speculative draft (``T=8``, causal within the new block),
contiguous ``[B, S, K, H]`` and paged caches (64-slot pages in a random
order).  ``T=1`` cells come first so that a run cut short by
``--time-budget`` has them all.

Implementations (``--impls``, see ``benchmarks/decode_impls.py``):
``jflash`` (its default choice), ``jflash:<backend>`` (``jflash:xla``,
``jflash:mosaic_gpu``, ...), ``jax_nn_xla`` and ``jax_nn_cudnn``
(``jax.nn.dot_product_attention``; contiguous caches), ``pallas_decode``
and ``pallas_paged`` (JAX's Pallas GPU ops).  Every one is first checked
against jflash's ``xla`` decode backend on the cell's inputs (max abs error
printed and recorded); one that fails (``error``) or disagrees (``wrong``)
is not timed.  One that cannot run the cell (a shape or platform it does
not take, a backend that declines with ``NotImplementedError``) is
``skipped`` with the reason.  The implementations that read jflash's cache
layout are timed with their timing groups interleaved; one that needs
another layout gets its own copy of the cache afterwards (jflash's is freed
as it is converted) and is timed alone.

Inputs are drawn on the device with ``jax.random``, one cell at a time,
and freed before the next.  Small caches get several input sets (up to 8,
about 1 GiB of cache in all) so that consecutive calls do not find the
cache in L2; the largest cell (``B=64, S=131072``: 34 GB of keys and
values) gets one.  A cell whose inputs do not fit in the free device memory
is skipped.

    python -m benchmarks.decode --out DIR            # the grid, this device
    python -m benchmarks.decode --small --out DIR    # a CPU smoke run

``--cells B=1,S=4096`` filters (keys ``B S T N K H page layout``; terms on
one key are alternatives, different keys must all match).  ``--time-budget
SECONDS``: cells not started by then are recorded as ``not_run``.  Outputs:
``DIR/decode.jsonl`` (one JSON object per cell and implementation, written
as the run goes), ``DIR/table.md`` and ``DIR/meta.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import decode_impls
from benchmarks.decode_impls import DecodeImpl, Skip
from benchmarks.report import git_commit
from benchmarks.timing import METHODS, TimerConfig, time_functions

ROTATION_BYTES = 1 << 30
"""Input sets per cell: enough for this many cache bytes, ..."""
MAX_INPUT_SETS = 8
"""... and at most this many."""
COPY_BYTES = 2 << 30
SMALL_COPY_BYTES = 32 << 20
TOLERANCE = {"float32": 5e-3, "float64": 5e-3, "bfloat16": 5e-2,
             "float16": 5e-2}
"""Largest ``max |out - ref| / max |ref|`` that agrees with the reference
(float32 allows for TF32 products on a GPU)."""
FREE_MEMORY_SHARE = 0.85
"""A cell runs when its inputs take at most this share of the free
device memory (the rest is for outputs and work space)."""


@dataclasses.dataclass(frozen=True)
class Cell:
  """One decode problem: ``B`` sequences in a cache of ``S`` slots each,
  ``T`` new tokens, ``N`` query and ``K`` key/value heads of dim ``H``;
  every slot valid, or (``ragged``) each sequence's length drawn
  uniformly from ``[S / 8, S]``, as in a serving batch."""

  batch: int
  context: int        # S: cache slots per sequence
  num_new: int        # T
  heads: int = 32     # N
  kv_heads: int = 8   # K
  head_dim: int = 128
  page_size: int | None = None  # None: a contiguous cache
  window: int | None = None     # left window; jflash columns only
  dtype: str = "bfloat16"
  ragged: bool = False

  @property
  def layout(self) -> str:
    return "contig" if self.page_size is None else f"paged{self.page_size}"

  @property
  def label(self) -> str:
    text = f"B={self.batch} S={self.context} T={self.num_new} {self.layout}"
    if self.ragged:
      text += " ragged"
    return text if self.window is None else f"{text} w={self.window}"

  def lengths(self) -> np.ndarray:
    """int32 ``[B]``: valid slots per sequence after the append (the same
    draw for a cell every time)."""
    if not self.ragged:
      return np.full((self.batch,), self.context, np.int32)
    rng = np.random.default_rng(
        [self.batch, self.context, self.num_new, self.heads, self.kv_heads])
    low = max(self.num_new, self.context // 8)
    return rng.integers(low, self.context + 1, self.batch).astype(np.int32)

  @property
  def slots_read(self) -> int:
    """Valid cache slots whose keys some new token sees, over the batch."""
    lengths = self.lengths().astype(np.int64)
    if self.window is not None:
      lengths = np.minimum(lengths, self.window + self.num_new)
    return int(lengths.sum())

  @property
  def bytes_read(self) -> int:
    """Bytes of the keys and values the new tokens see."""
    itemsize = np.dtype(self.dtype).itemsize
    return 2 * self.slots_read * self.kv_heads * self.head_dim * itemsize

  @property
  def cache_bytes(self) -> int:
    """Bytes of one input set's key and value caches."""
    slots = self.batch * self.context
    if self.page_size is not None:
      slots = self.batch * -(-self.context // self.page_size) * self.page_size
    itemsize = np.dtype(self.dtype).itemsize
    return 2 * slots * self.kv_heads * self.head_dim * itemsize


def grid(small: bool) -> list[Cell]:
  """The cells, ``T=1`` first; ``small``: tiny float32 cells for the CPU."""
  if small:
    return [Cell(batch=b, context=64, num_new=t, heads=4, kv_heads=2,
                 head_dim=32, page_size=p, dtype="float32")
            for t, b, p in itertools.product((1, 4), (1, 2), (None, 16))]
  return [Cell(batch=b, context=s, num_new=t, page_size=p, ragged=r)
          for t, r, b, s, p in itertools.product(
              (1, 8), (False, True), (1, 8, 64), (4096, 32768, 131072),
              (None, 64))
          if not (r and b == 1)]  # one sequence is never ragged


_FILTER_KEYS = {"B": "batch", "S": "context", "T": "num_new", "N": "heads",
                "K": "kv_heads", "H": "head_dim", "page": "page_size"}


def _filter_value(cell: Cell, key: str) -> str:
  if key == "layout":
    return "contig" if cell.page_size is None else "paged"
  if key == "lengths":
    return "ragged" if cell.ragged else "full"
  return str(getattr(cell, _FILTER_KEYS[key]))


def filter_cells(cells: list[Cell], expr: str | None) -> list[Cell]:
  """Cells matching ``expr``: comma-separated ``key=value`` terms (keys B,
  S, T, N, K, H, page, layout = contig|paged, lengths = full|ragged).  Terms on one key are
  alternatives, different keys must all match: ``B=1,B=8,S=4096``."""
  if not expr:
    return list(cells)
  wanted: dict[str, set[str]] = {}
  for term in filter(None, (t.strip() for t in expr.split(","))):
    key, sep, value = term.partition("=")
    if not sep or (key not in _FILTER_KEYS
                   and key not in ("layout", "lengths")):
      raise ValueError(f"--cells: expected key=value terms with keys "
                       f"{sorted(_FILTER_KEYS) + ['layout', 'lengths']}, "
                       f"got {term!r}")
    wanted.setdefault(key, set()).add(value.strip())
  return [c for c in cells
          if all(_filter_value(c, k) in v for k, v in wanted.items())]


# ------------------------------------------------------------------ inputs
def input_set_count(cell: Cell) -> int:
  """Input sets to rotate through: about :data:`ROTATION_BYTES` of cache,
  1 to :data:`MAX_INPUT_SETS`."""
  return max(1, min(MAX_INPUT_SETS, -(-ROTATION_BYTES // cell.cache_bytes)))


def free_bytes() -> int | None:
  """Free memory of the first device (None where it is not reported)."""
  stats = jax.devices()[0].memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


CHUNK_BYTES = 64 << 20
"""Random inputs are drawn in pieces of at most this many bytes: one draw
of a whole array holds about 12 times its bytes in temporaries."""


def _chunking(shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
  """``(axis, size)``: pieces span ``size`` entries of ``axis`` and every
  later axis, at most :data:`CHUNK_BYTES` each (the largest such piece)."""
  for axis in range(len(shape)):
    inner = math.prod(shape[axis + 1:]) * itemsize
    for size in range(shape[axis], 0, -1):
      if shape[axis] % size == 0 and size * inner <= CHUNK_BYTES:
        return axis, size
  return len(shape) - 1, 1


@functools.partial(jax.jit, static_argnums=(2, 3), donate_argnums=(1,))
def _fill_normal(key: jax.Array, out: jax.Array, axis: int,
                 size: int) -> jax.Array:
  """``out`` filled with standard normal values, one piece at a time (in
  place: ``out`` is donated)."""
  lead = out.shape[:axis] + (out.shape[axis] // size,)
  piece = (1,) * axis + (size,) + out.shape[axis + 1:]

  def body(i, out):
    index = jnp.unravel_index(i, lead)
    start = (*index[:-1], index[-1] * size) + (0,) * (out.ndim - axis - 1)
    values = jax.random.normal(jax.random.fold_in(key, i), piece, out.dtype)
    return jax.lax.dynamic_update_slice(out, values, start)
  return jax.lax.fori_loop(0, math.prod(lead), body, out)


def _normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
  """Standard normal values of ``shape`` drawn on the device."""
  axis, size = _chunking(shape, jnp.dtype(dtype).itemsize)
  return _fill_normal(key, jnp.zeros(shape, dtype), axis, size)


def make_inputs(cell: Cell, key: jax.Array, count: int) -> list[tuple]:
  """``count`` tuples ``(query, key, value, lengths, table)`` drawn on the
  device in jflash's layout; ``lengths`` and ``table`` are shared.  A paged
  cache's pool holds ``B * max_pages`` pages, in a random order."""
  dtype = jnp.dtype(cell.dtype)
  q_shape = (cell.batch, cell.num_new, cell.heads, cell.head_dim)
  lengths = jnp.asarray(cell.lengths())
  table, table_key = None, jax.random.fold_in(key, count)
  if cell.page_size is None:
    cache_shape = (cell.batch, cell.context, cell.kv_heads, cell.head_dim)
  else:
    max_pages = -(-cell.context // cell.page_size)
    pool = cell.batch * max_pages
    table = jax.random.permutation(table_key, pool)
    table = table.reshape(cell.batch, max_pages).astype(jnp.int32)
    cache_shape = (pool, cell.page_size, cell.kv_heads, cell.head_dim)
  sets = []
  for i in range(count):
    kq, kk, kv = jax.random.split(jax.random.fold_in(key, i), 3)
    sets.append((_normal(kq, q_shape, dtype),
                 _normal(kk, cache_shape, dtype),
                 _normal(kv, cache_shape, dtype), lengths, table))
    jax.block_until_ready(sets[-1])
  return sets


def free_arrays(tree: Any) -> None:
  """Deletes every device array of ``tree`` now (not when collected)."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.delete()


def convert_sets(sets: list[tuple], convert, consume: bool) -> list[tuple]:
  """The input sets with their caches in another layout; ``consume``
  deletes each source cache once its copy exists (peak: one extra cache
  array)."""
  converted = []
  for q, k, v, lengths, table in sets:
    new = []
    for x in (k, v):
      new.append(jax.block_until_ready(convert(x)))
      if consume:
        x.delete()
    converted.append((q, *new, lengths, table))
  return converted


def copy_bandwidth(nbytes: int, dtype: str, timer: TimerConfig) -> dict:
  """GB/s of ``y = x + 1`` over ``nbytes`` (read and written)."""
  elements = nbytes // np.dtype(dtype).itemsize
  buffers = [(jnp.full((elements,), i, dtype),) for i in range(2)]
  result, = time_functions([jax.jit(lambda x: x + 1)], buffers, timer)
  free_arrays(buffers)
  if "error" in result:
    raise result["error"]
  return dict(copy_bytes=nbytes, copy_ms=result["ms"],
              copy_gb_s=2 * nbytes / result["ms"] / 1e6)


# ------------------------------------------------------------------ runner
@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What every cell of a run shares."""

  timer: TimerConfig
  platform: str           # jax.default_backend()
  device: str             # the device kind
  copy_gb_s: float
  pallas_interpret: bool = False


def _message(err: BaseException) -> str:
  text = " ".join(str(err).split())
  return f"{type(err).__name__}: {text[:400]}"


def _row(cell: Cell, impl: str, status: str, config: RunConfig,
         **fields: Any) -> dict:
  row = dict(cell=cell.label, **dataclasses.asdict(cell), layout=cell.layout,
             impl=impl, status=status, device=config.device,
             bytes_read=cell.bytes_read, copy_gb_s=config.copy_gb_s)
  row.update(fields)
  return row


def _check(impl: DecodeImpl, inputs: tuple, reference: jax.Array,
           cell: Cell, config: RunConfig) -> dict:
  """``status`` ``ok`` and the max abs error against ``reference``, or the
  status and reason of a failure."""
  try:
    out = jax.block_until_ready(impl.fn(*inputs))
  except NotImplementedError as err:
    return dict(status="skipped", reason=_message(err))
  except Exception as err:  # noqa: BLE001 (recorded per implementation)
    declined = impl.declines_off_gpu and config.platform != "gpu"
    return dict(status="skipped" if declined else "error",
                reason=_message(err))
  if out.shape != reference.shape:
    return dict(status="wrong", reason=f"output shape {out.shape}, "
                f"expected {reference.shape}")
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                              - reference.astype(jnp.float32))))
  scale = float(jnp.max(jnp.abs(reference.astype(jnp.float32))))
  free_arrays(out)
  tolerance = TOLERANCE[cell.dtype]
  fields = dict(status="ok", max_abs_err=err, max_abs_ref=scale)
  if not (math.isfinite(err) and err <= tolerance * scale):
    fields.update(status="wrong", reason=f"max abs error {err:.3g} exceeds "
                  f"{tolerance} x max |reference| = {tolerance * scale:.3g}")
  return fields


def _check_and_time(impls: list[DecodeImpl], sets: list[tuple],
                    reference: jax.Array, cell: Cell,
                    config: RunConfig) -> dict[str, dict]:
  """Row fields per implementation: each is checked on the first input
  set, then those that agree are timed with their groups interleaved."""
  results = {impl.name: _check(impl, sets[0], reference, cell, config)
             for impl in impls}
  passed = [impl for impl in impls if results[impl.name]["status"] == "ok"]
  timings = time_functions([impl.fn for impl in passed], sets, config.timer)
  for impl, timing in zip(passed, timings):
    fields = results[impl.name]
    if "error" in timing:
      fields.update(status="error", reason=_message(timing["error"]))
      continue
    gb_s = cell.bytes_read / (timing["ms"] * 1e-3) / 1e9
    fields.update(us=timing["ms"] * 1e3, gb_s=gb_s,
                  share_of_copy=gb_s / config.copy_gb_s,
                  calls=timing["calls"], repeats=timing["repeats"],
                  timed_with=[i.name for i in passed if i is not impl])
  return results


def _input_sets_that_fit(cell: Cell) -> tuple[int, str | None]:
  """``(count, None)``, or ``(0, reason)`` when one set does not fit."""
  count = input_set_count(cell)
  free = free_bytes()
  if free is None:
    return count, None
  fit = int(FREE_MEMORY_SHARE * free // cell.cache_bytes)
  if fit < 1:
    return 0, (f"does not fit: the cache takes {cell.cache_bytes / 1e9:.1f} "
               f"GB, {free / 1e9:.1f} GB free")
  return min(count, fit), None


def _run_impls(cell: Cell, impls: list[DecodeImpl], count: int,
               config: RunConfig, key: jax.Array) -> dict[str, dict]:
  """Draws the inputs, computes the reference, checks and times ``impls``
  (those reading jflash's layout first, together); frees the inputs."""
  sets: list[tuple] = []
  try:
    try:
      sets = make_inputs(cell, key, count)
      reference = jax.block_until_ready(
          decode_impls.reference_fn(cell)(*sets[0]))
    except Exception as err:  # noqa: BLE001 (recorded for the cell)
      return {impl.name: dict(status="error", reason="inputs or reference: "
                              + _message(err)) for impl in impls}
    results = _check_and_time([i for i in impls if i.convert is None], sets,
                              reference, cell, config)
    moved = [i for i in impls if i.convert is not None]
    for j, impl in enumerate(moved):
      own: list[tuple] = []
      try:
        own = convert_sets(sets, impl.convert, consume=j == len(moved) - 1)
        results.update(_check_and_time([impl], own, reference, cell, config))
      except Exception as err:  # noqa: BLE001 (recorded per implementation)
        results[impl.name] = dict(status="error", reason="converting the "
                                  "cache: " + _message(err))
      finally:
        free_arrays([s[1:3] for s in own])
    return results
  finally:
    free_arrays(sets)
    gc.collect()


def run_cell(cell: Cell, names: list[str], config: RunConfig,
             key: jax.Array) -> list[dict]:
  """One row per implementation of ``names``, in that order."""
  impls, rows = [], {}
  for name in names:
    try:
      impls.append(decode_impls.make_impl(
          name, cell, platform=config.platform,
          pallas_interpret=config.pallas_interpret))
    except Skip as why:
      rows[name] = _row(cell, name, "skipped", config, reason=str(why))
  count, no_fit = _input_sets_that_fit(cell) if impls else (0, None)
  if no_fit is not None:
    results = {i.name: dict(status="skipped", reason=no_fit) for i in impls}
  elif impls:
    results = _run_impls(cell, impls, count, config, key)
  for impl in impls:
    fields = dict(results[impl.name])
    rows[impl.name] = _row(cell, impl.name, fields.pop("status"), config,
                           note=impl.note, input_sets=count, **fields)
  base = rows.get("jflash", {}).get("us")
  for row in rows.values():
    if base and "us" in row:
      row["vs_jflash"] = row["us"] / base
  return [rows[name] for name in names]


# ----------------------------------------------------------------- outputs
def _fmt(value: Any, spec: str) -> str:
  return "" if value is None else format(value, spec)


def row_line(row: dict) -> str:
  """One progress line for a row."""
  if row["status"] != "ok":
    return f"{row['impl']:<18} {row['status']}: {row.get('reason', '')}"
  ratio = _fmt(row.get("vs_jflash"), ".2f")
  return (f"{row['impl']:<18} {row['us']:>10.1f} us {row['gb_s']:>8.1f} GB/s "
          f"{row['share_of_copy']:>5.2f} of copy  x{ratio:<5} "
          f"err {row['max_abs_err']:.2g}")


def write_table(rows: list[dict], meta: dict, path: Path) -> None:
  """``table.md``: one line per cell and implementation, then how each
  implementation expressed the cells."""
  lines = [f"# Decode benchmark: {meta['device']}", "",
           f"Commit {meta['commit']}, jax {meta['jax']}, "
           f"{meta['started']}. Copy bandwidth {meta['copy_gb_s']:.1f} GB/s "
           f"(`y = x + 1` over {meta['copy_bytes'] / 2**30:g} GiB, read and "
           "written). GB/s: bytes of the keys and values the new tokens see "
           "/ time; share: of the copy bandwidth; time / jflash: the "
           "implementation's time over jflash's default in the same cell "
           "(above 1: slower); error: max abs difference from jflash's xla "
           "decode backend.", "",
           "| cell | impl | µs | GB/s | share of copy | time / jflash "
           "| max abs err | status |",
           "|---|---|--:|--:|--:|--:|--:|---|"]
  for row in rows:
    status = row["status"]
    if row.get("reason"):
      status += ": " + row["reason"][:200].replace("|", "/")
    lines.append(
        f"| {row['cell']} | {row['impl']} | {_fmt(row.get('us'), '.1f')} "
        f"| {_fmt(row.get('gb_s'), '.1f')} "
        f"| {_fmt(row.get('share_of_copy'), '.2f')} "
        f"| {_fmt(row.get('vs_jflash'), '.2f')} "
        f"| {_fmt(row.get('max_abs_err'), '.2g')} | {status} |")
  notes = sorted({(r["impl"], r["note"]) for r in rows if r.get("note")})
  if notes:
    lines += ["", "How the implementations expressed the cells:", ""]
    lines += [f"- `{impl}`: {note}" for impl, note in notes]
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--impls", default=",".join(decode_impls.DEFAULT_IMPLS),
                 help="comma-separated: jflash, jflash:<backend>, "
                 + ", ".join(decode_impls.PEERS))
  p.add_argument("--cells", default=None,
                 help="filter, e.g. B=1,S=4096 (keys B S T N K H page "
                 "layout)")
  p.add_argument("--time-budget", type=float, default=None,
                 help="seconds; cells not started by then are not run")
  p.add_argument("--small", action="store_true",
                 help="tiny float32 cells (a smoke run on the CPU)")
  p.add_argument("--pallas-interpret", action="store_true",
                 help="run the Pallas peers in interpret mode (on the CPU: "
                 "checks their wiring; the times mean nothing)")
  p.add_argument("--out", type=Path, required=True,
                 help="folder for decode.jsonl, table.md, meta.json")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--timer", default="enqueue", choices=METHODS,
                 help="enqueue: calls back to back, host clock (the "
                 "device's throughput, launch gaps included); profiler: "
                 "the summed kernel time per call (GPU only)")
  return p.parse_args(argv)


def _metadata(args: argparse.Namespace, names: list[str], timer: TimerConfig,
              copy: dict, argv: list[str] | None) -> dict:
  import jflash
  commit, dirty = git_commit()
  device = jax.devices()[0]
  return dict(device=device.device_kind, platform=device.platform,
              commit=commit, jflash_dirty=dirty, jax=jax.__version__,
              jflash=jflash.__version__, impls=names, cells=args.cells,
              time_budget=args.time_budget, small=args.small, seed=args.seed,
              timer=timer.describe(), **copy,
              started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              argv=sys.argv[1:] if argv is None else list(argv))


def main(argv: list[str] | None = None) -> int:
  args = _parse_args(argv)
  names = [n.strip() for n in args.impls.split(",") if n.strip()]
  try:
    decode_impls.check_names(names)
    cells = filter_cells(grid(args.small), args.cells)
  except ValueError as err:
    print(err, file=sys.stderr)
    return 2
  if not cells:
    print("no cell matches --cells", file=sys.stderr)
    return 2
  timer = (TimerConfig(args.timer, calls=2, repeats=2, warmup=1)
           if args.small else
           TimerConfig(args.timer, calls=10, repeats=5, warmup=2,
                       max_seconds=1.0))
  copy = copy_bandwidth(SMALL_COPY_BYTES if args.small else COPY_BYTES,
                        cells[0].dtype, timer)
  meta = _metadata(args, names, timer, copy, argv)
  config = RunConfig(timer, jax.default_backend(), meta["device"],
                     copy["copy_gb_s"], args.pallas_interpret)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
  print(f"{meta['device']}: {len(cells)} cells x {len(names)} "
        f"implementations, copy {copy['copy_gb_s']:.1f} GB/s, out "
        f"{args.out}", flush=True)
  key, start, rows = jax.random.key(args.seed), time.perf_counter(), []
  with open(args.out / "decode.jsonl", "w", encoding="utf-8") as jsonl:
    for index, cell in enumerate(cells):
      elapsed = time.perf_counter() - start
      if args.time_budget is not None and elapsed > args.time_budget:
        cell_rows = [_row(cell, name, "not_run", config,
                          reason=f"--time-budget {args.time_budget:g} s "
                          "reached") for name in names]
      else:
        print(f"[{index + 1}/{len(cells)}] {cell.label} ({elapsed:.0f} s)",
              flush=True)
        cell_rows = run_cell(cell, names, config,
                             jax.random.fold_in(key, index))
        for row in cell_rows:
          print("  " + row_line(row), flush=True)
      for row in cell_rows:
        jsonl.write(json.dumps(row) + "\n")
      jsonl.flush()
      rows += cell_rows
      write_table(rows, meta, args.out / "table.md")
  print(f"done in {time.perf_counter() - start:.0f} s: "
        f"{args.out / 'decode.jsonl'}, {args.out / 'table.md'}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
