"""The ``mosaic_tpu`` decode kernel: split-K decode attention in Pallas
Mosaic TPU, reading a contiguous or paged cache.

Grid ``(B, K, num_splits, steps)``.  Cell ``(b, k, s, j)`` visits chunk
``first_chunk[b] + s * steps + j`` of sequence ``b`` for key/value head
``k``: one page of a paged cache (its index looked up in the
scalar-prefetched block table inside the key/value index maps), or
``chunk_size`` slots of a contiguous one.  The ``G * T`` query rows of the
head's group (padded to a multiple of 8 sublanes) stay in VMEM for the
whole split, so each chunk is read once per key/value head.  Steps past a
sequence's key range (:func:`jflash.masks.decode_key_range`, scalar
prefetched as ``first_chunk`` and ``num_needed``) map to the previous
block, which the pipeline does not fetch again, and compute nothing.  Each
split writes its unnormalized ``(m, l, acc)``; the splits are merged
exactly, in split order, by :func:`jflash.backends.xla.decode.merge_partials`.

The cache is read as ``[P, page_size, K * H]`` (a free reshape of ``[P,
page_size, K, H]``); a cell's block is head ``k``'s ``[chunk, H]`` slab.
Verified in Pallas's interpret mode on the CPU and compiled by libtpu for
v4, v5e, v5p and v6e (``tests/test_tpu_compile.py``); not yet timed on a
TPU.  On a TPU, Mosaic's block rule asks ``H`` to be a multiple of 128
when ``K > 1`` and a contiguous chunk to be a multiple of 8 slots, and
float16 has no vector loads; other calls are declined there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jflash import masks
from jflash.core import alibi
from jflash.core.call import varying_result
from jflash.core.call import DecodeCall
from jflash.core.splits import (DecodeConfig, group_rows, make_plan,
                                 merge_partials, ungroup_rows)

Array = jax.Array

LANES = 128
"""Row statistics are kept ``[rows, 128]`` (the value repeated along the
lanes), the TPU's native vector layout."""
SUBLANES = 8
_NT_DIMS = (((1,), (1,)), ((), ()))   # [R, H] x [C, H] -> [R, C]
_NN_DIMS = (((1,), (0,)), ((), ()))   # [R, C] x [C, H] -> [R, H]
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Static facts the kernel body and index maps close over."""

  num_new: int
  groups: int
  rows: int         # G * T padded to a multiple of SUBLANES
  chunk: int        # slots per grid step
  steps: int        # grid steps per split
  capacity: int
  window: tuple[int, int] | None
  scale: float
  soft_cap: float | None
  paged: bool
  float32_products: bool  # DecodeConfig(matmul_inputs="float32")
  num_pages: int
  max_pages: int
  alibi: bool = False   # a "slopes" input: each row's slope, [rows, 128]
  mask_fn: Any = None   # the call's mask function, or None


def _chunk_of(st: _Static, r, b, s, j):
  """The chunk cell ``(b, s, j)`` reads: past the key range, the last chunk
  of the range (no new copy); 0 when the range is empty."""
  needed = r["num_needed"][b]
  idx = jnp.minimum(s * st.steps + j, jnp.maximum(needed - 1, 0))
  return r["first_chunk"][b] + idx


def _kv_index(st: _Static, b, k, s, j, *scalars):
  r = dict(zip(_SCALAR_NAMES[:len(scalars)], scalars))
  c = _chunk_of(st, r, b, s, j)
  if not st.paged:
    return b, c, k
  column = jnp.clip(c, 0, st.max_pages - 1)
  page = r["table"][b, column]
  # A range-less sequence or a bad entry reads page 0 (its slots are masked).
  page = jnp.where((r["num_needed"][b] > 0) & (page >= 0)
                   & (page < st.num_pages), page, 0)
  return page, 0, k


_SCALAR_NAMES = ("lengths", "first_chunk", "num_needed", "table")


def _kernel(*refs, st: _Static, names: tuple[str, ...]):
  r = dict(zip(names, refs, strict=True))
  b, s, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    r["m_s"][...] = jnp.full(r["m_s"].shape, -jnp.inf, jnp.float32)
    r["l_s"][...] = jnp.zeros(r["l_s"].shape, jnp.float32)
    r["acc_s"][...] = jnp.zeros(r["acc_s"].shape, jnp.float32)

  pl.when(s * st.steps + j < r["num_needed"][b])(
      functools.partial(_step, r, st, b, s, j))

  @pl.when(j == st.steps - 1)
  def _finish():
    r["m"][...] = r["m_s"][...]
    r["l"][...] = r["l_s"][...]
    r["acc"][...] = r["acc_s"][...]


def _row_visibility(st: _Static, length, slots) -> Array:
  """bool ``[rows, C]``: row ``g * T + t`` sees slot ``slots[c]``; padding
  rows see nothing.  Built from each row's interval (elementwise integer
  operations in the registers' own layout: Mosaic cannot tile or
  concatenate bool vectors)."""
  row = lax.broadcasted_iota(jnp.int32, (st.rows, 1), 0)
  lo, hi = masks.decode_row_bounds_at(lax.rem(row, st.num_new), length,
                                      st.num_new, kv_len=st.capacity,
                                      window=st.window)
  vis = (slots >= lo) & (slots < hi) & (row < st.groups * st.num_new)
  if st.mask_fn is not None:
    vis = vis & masks.apply_mask_fn(st.mask_fn, _row_positions(st, length),
                                    slots)
  return vis


def _row_positions(st: _Static, length) -> Array:
  """int32 ``[rows, 1]``: the position of row ``g * T + t``'s token,
  ``length - T + t``."""
  row = lax.broadcasted_iota(jnp.int32, (st.rows, 1), 0)
  return masks.decode_position(lax.rem(row, st.num_new), length, st.num_new)


def _step(r: dict, st: _Static, b, s, j) -> None:
  """Online softmax over one chunk."""
  c = r["first_chunk"][b] + s * st.steps + j
  slots = c * st.chunk + lax.broadcasted_iota(jnp.int32, (1, st.chunk), 1)
  vis = _row_visibility(st, r["lengths"][b], slots)
  q, k, v = r["q"][...], r["k"][...], r["v"][...]
  if st.float32_products:
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  # Values of slots no row sees are zeroed: they may hold anything.  The
  # rows see the slots of one interval, the key range, tested as a column
  # (Mosaic cannot turn a row of bools into a column).
  first, end = masks.decode_key_range(r["lengths"][b], st.num_new,
                                      kv_len=st.capacity, window=st.window)
  column = c * st.chunk + lax.broadcasted_iota(jnp.int32, (st.chunk, 1), 0)
  v = jnp.where((column >= first) & (column < end), v, jnp.zeros((), v.dtype))
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  logits = lax.dot_general(q, k, _NT_DIMS, precision=precision,
                           preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(st.scale)
  if st.soft_cap is not None:
    cap = jnp.float32(st.soft_cap)
    logits = cap * jnp.tanh(logits / cap)
  if st.alibi:
    logits = logits + alibi.penalty(
        r["slopes"][...][:, :1], _row_positions(st, r["lengths"][b]) - slots)
  logits = jnp.where(vis, logits, -jnp.inf)
  m_prev = r["m_s"][...]
  m_new = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
  m_safe = jnp.where(jnp.isneginf(m_new), jnp.float32(0), m_new)
  p = jnp.exp(logits - m_safe[:, :1])
  alpha = jnp.exp(m_prev - m_safe)
  r["l_s"][...] = alpha * r["l_s"][...] + p.sum(axis=1, keepdims=True)
  pv = lax.dot_general(p.astype(v.dtype), v, _NN_DIMS, precision=precision,
                       preferred_element_type=jnp.float32)
  r["acc_s"][...] = r["acc_s"][...] * alpha[:, :1] + pv
  r["m_s"][...] = m_new


def _run(call: DecodeCall, st: _Static, num_splits: int, scalars: dict,
         q: Array, slopes: Array | None) -> tuple[Array, Array, Array]:
  """``pallas_call`` over the grid; ``(m, l, acc)`` with a leading split
  axis."""
  batch, kv_heads = q.shape[:2]
  head_dim = q.shape[-1]
  rows = st.rows
  kv_map = functools.partial(_kv_index, st)
  # The cache viewed as [P|B, page_size|S, K * H] (a free reshape): block k
  # of the last axis is head k's [chunk, H] slab, so one grid cell copies
  # exactly one head's chunk.
  key, value = (x.reshape(x.shape[:2] + (-1,)) for x in (call.key, call.value))
  kv_block = (None, st.chunk, head_dim)
  split_map = lambda b, k, s, j, *_: (b, k, s, 0, 0)
  in_specs = [pl.BlockSpec((None, None, rows, head_dim),
                           lambda b, k, s, j, *_: (b, k, 0, 0)),
              pl.BlockSpec(kv_block, kv_map), pl.BlockSpec(kv_block, kv_map)]
  extra = ()
  if slopes is not None:
    per_batch = slopes.shape[0] > 1
    in_specs.append(pl.BlockSpec(
        (None, None, rows, LANES),
        lambda b, k, s, j, *_: (b if per_batch else 0, k, 0, 0)))
    extra = (slopes,)
  stats = (batch, kv_heads, num_splits, rows, LANES)
  arrays = (*scalars.values(), q, key, value, *extra)
  out_shape = [varying_result(stats, jnp.float32, arrays),
               varying_result(stats, jnp.float32, arrays),
               varying_result(stats[:-1] + (head_dim,), jnp.float32, arrays)]
  out_specs = [pl.BlockSpec((None, None, None, rows, LANES), split_map),
               pl.BlockSpec((None, None, None, rows, LANES), split_map),
               pl.BlockSpec((None, None, None, rows, head_dim), split_map)]
  scratch = [pltpu.VMEM((rows, LANES), jnp.float32),
             pltpu.VMEM((rows, LANES), jnp.float32),
             pltpu.VMEM((rows, head_dim), jnp.float32)]
  names = (*scalars, "q", "k", "v", *(("slopes",) if extra else ()),
           "m", "l", "acc", "m_s", "l_s", "acc_s")
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(scalars),
      grid=(batch, kv_heads, num_splits, st.steps), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch)
  m, l, acc = pl.pallas_call(
      functools.partial(_kernel, st=st, names=names), grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=(
          "parallel", "parallel", "parallel", "arbitrary")),
      interpret=call.interpret, name="jflash_mosaic_tpu_decode")(*arrays)
  split_first = lambda x: jnp.moveaxis(x, 2, 0)
  return split_first(m[..., 0]), split_first(l[..., 0]), split_first(acc)


def _row_slopes(slopes: Array | None, kv_heads: int, num_new: int,
               rows: int) -> Array | None:
  """ALiBi slopes ``[B|1, N]`` -> ``[B|1, K, rows, 128]`` float32: row ``g
  * T + t`` of key/value head ``k`` holds query head ``k * G + g``'s slope
  (repeated along the lanes, as the row statistics are); padding rows 0."""
  if slopes is None:
    return None
  per_head = slopes.astype(jnp.float32).reshape(slopes.shape[0], kv_heads, -1)
  per_row = jnp.repeat(per_head, num_new, axis=2)
  per_row = jnp.pad(per_row, ((0, 0), (0, 0), (0, rows - per_row.shape[2])))
  return jnp.broadcast_to(per_row[..., None], per_row.shape + (LANES,))


@dataclasses.dataclass(frozen=True)
class MosaicTpuDecodeBackend:
  """The Pallas Mosaic TPU decode kernel.

  Serves float32 and bfloat16 on a TPU, and float16 too anywhere with
  ``interpret=True``; declines (``NotImplementedError``) other platforms
  without ``interpret``, float64, and float16 on a TPU (Mosaic has no
  float16 vector loads there, and converting the cache first would read it
  twice: ``xla`` serves it).  One grid step reads one page of a
  paged cache, or ``config.chunk_size`` slots of a contiguous one (128
  when None);
  ``config.num_splits`` / ``parallelism`` split the key range and
  ``config.matmul_inputs`` picks the product operands as in the ``xla``
  decode backend.
  """

  config: DecodeConfig = DecodeConfig(chunk_size=128)
  name: str = "mosaic_tpu"

  @property
  def _chunk_size(self) -> int:
    """Slots per grid step of a contiguous cache: one sublane-aligned block
    the pipeline double-buffers."""
    return self.config.chunk_size or 128

  def __call__(self, call: DecodeCall) -> tuple[Array, Array]:
    if call.dtype not in _DTYPES:
      raise NotImplementedError(f"{self.name} decode serves float32, "
                                f"bfloat16 and float16, got {call.dtype}")
    if not call.interpret:
      platform = call.target().platform
      if platform != "tpu":
        raise NotImplementedError(
            f"{self.name} decode runs on a TPU (the call is traced for "
            f"{platform!r}); pass interpret=True to run it in Pallas's "
            "interpret mode")
      if call.dtype == jnp.float16:
        raise NotImplementedError(
            f"{self.name} decode on a TPU reads bfloat16 or float32 caches "
            "(Mosaic has no float16 vector loads); the 'xla' decode "
            "backend serves float16")
      self._check_tpu_blocks(call)
    chunk_size = call.page_size if call.paged else self._chunk_size
    plan = make_plan(call, dataclasses.replace(self.config,
                                               chunk_size=chunk_size))
    batch, num_new, num_heads, _ = call.query.shape
    if plan.num_chunks == 0:
      return (jnp.zeros(call.query.shape, call.dtype),
              jnp.full((batch, num_new, num_heads), -jnp.inf, jnp.float32))
    kv_heads = call.key.shape[2]
    groups = num_heads // kv_heads
    rows = -(-groups * num_new // SUBLANES) * SUBLANES
    first, end = masks.decode_key_range(call.lengths, num_new,
                                        kv_len=call.capacity,
                                        window=call.window)
    first_chunk = first // plan.chunk
    scalars = {"lengths": call.lengths, "first_chunk": first_chunk,
               "num_needed": jnp.where(
                   end > first, (end - 1) // plan.chunk - first_chunk + 1, 0)}
    if call.paged:
      scalars["table"] = call.block_table
    st = _Static(num_new=num_new, groups=groups, rows=rows, chunk=plan.chunk,
                 steps=plan.per_split, capacity=call.capacity,
                 window=call.window, scale=call.scale,
                 soft_cap=call.logits_soft_cap, paged=call.paged,
                 float32_products=self.config.matmul_inputs == "float32",
                 num_pages=call.key.shape[0],
                 max_pages=(call.block_table.shape[1] if call.paged else 0),
                 alibi=call.alibi_slopes is not None, mask_fn=call.mask_fn)
    q = group_rows(call.query, kv_heads)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - q.shape[2]), (0, 0)))
    m, l, acc = _run(call, st, plan.num_splits, scalars, q,
                     _row_slopes(call.alibi_slopes, kv_heads, num_new, rows))
    out, lse = merge_partials(m, l, acc)
    out, lse = out[:, :, :groups * num_new], lse[:, :, :groups * num_new]
    return (ungroup_rows(out, num_new).astype(call.dtype),
            ungroup_rows(lse, num_new).astype(jnp.float32))

  def _check_tpu_blocks(self, call: DecodeCall) -> None:
    """Mosaic's block rule: a block's last two dims are multiples of (8,
    128) or whole.  A head's slab of the ``K * H`` lanes is whole only for
    ``K == 1``; a contiguous chunk is whole only when it spans ``S``."""
    kv_heads, head_dim = call.key.shape[2:]
    if kv_heads > 1 and head_dim % LANES:
      raise NotImplementedError(
          f"{self.name} decode on a TPU needs the head dim to be a multiple "
          f"of {LANES} with several key/value heads, got H={head_dim}")
    chunk = min(self._chunk_size, call.capacity)
    if not call.paged and chunk % SUBLANES and chunk != call.capacity:
      raise NotImplementedError(
          f"{self.name} decode on a TPU needs chunk_size={chunk} to be a "
          f"multiple of {SUBLANES} or the whole cache S={call.capacity}")
