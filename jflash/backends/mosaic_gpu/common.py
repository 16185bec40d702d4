"""Pieces shared by the Hopper forward and backward kernels: the inputs that
describe visibility, the element mask of partial tiles, and the logit
transform (scale and soft cap)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.mosaic.gpu as mgpu
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from jflash import masks
from jflash.core.call import vary_as_inputs

Array = jax.Array

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The running maximum starts finite so that a row whose keys are all masked
# so far keeps exp2(-inf - m) == 0 and a rescale factor of exactly 1 (no
# inf - inf).  Real logits are bounded far above it.
M_INIT = -1e30

# Register budget per thread after `setmaxnreg`: two consumer warpgroups and
# one producer share the 64K registers of an SM, (2 * 232 + 40) * 128 <=
# 65536.  Asking for more makes `setmaxnreg.inc` wait forever.
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40

# Shared memory a CTA may take on Hopper (227 KiB), less 1 KiB for barriers
# and alignment, for kernels that choose their buffers by size.
SMEM_LIMIT_BYTES = 227 * 1024 - 1024


def smem_bytes(*buffers: int) -> int:
  """Shared memory that buffers of these sizes take (barriers excluded),
  each rounded up to the 1 KiB that swizzled tiles align to: small
  buffers, such as segment ids, leave gaps that a plain sum misses."""
  return sum(-(-n // 1024) * 1024 for n in buffers)


# Row reductions of WGMMA-layout tiles stay inside a warp (a row lives in
# four threads of one quad), so the kernels need no shared-memory scratch
# for cross-warp reductions; its default 2 KiB is left to the tiles.
COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True,
                                       reduction_scratch_bytes=0)

# Hardware named barriers 0 (CTA-wide) and 1-3 (one per warpgroup) are
# taken by Mosaic GPU; the forward's two consumers hand the tensor cores to
# each other through barriers SCHEDULE_BARRIER + warpgroup.
SCHEDULE_BARRIER = 4


def _named_barrier(operation: str, barrier_id: Array, threads: int) -> None:
  """``bar.<operation> barrier_id, threads`` for the whole warpgroup."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def barrier(_, barrier_id):
    mgpu_utils.inline_ptx(f"bar.{operation} $0, {threads};",
                          barrier_id.registers[()], has_side_effects=True,
                          convergent=True)
  barrier(barrier_id.astype(jnp.int32))


def wait_turn(wg: Array) -> None:
  """Consumer ``wg`` (0 or 1) waits until the other consumer has passed it
  the turn (:func:`pass_turn`): a ``bar.sync`` of 256 threads on its own
  schedule barrier, which the other's 128 arriving threads complete."""
  _named_barrier("sync", SCHEDULE_BARRIER + wg, 256)


def pass_turn(wg: Array) -> None:
  """Consumer ``wg`` passes the turn to the other consumer without waiting
  (``bar.arrive`` on the other's schedule barrier)."""
  _named_barrier("arrive", SCHEDULE_BARRIER + 1 - wg, 256)


def loop_variant_zero(tile_class: Array) -> Array:
  """0, from a step's tile class (never negative), in a form the compiler
  cannot fold.

  Shared-memory refs indexed with it inside a loop body keep their wgmma
  descriptors there: with constant indices LLVM hoists every k-step's
  64-bit descriptor of a loop-invariant operand (Q and dO in the dQ pass,
  K and V in the dK/dV pass) out of the loop, and at head dims 128 and 256
  the registers they hold spill next to the accumulators.  The forward,
  whose registers leave room for them, keeps constant indices (faster
  there).  Added to a backward
  mask's first row, it likewise keeps the per-element row indices from
  being hoisted and spilled.
  """
  return jnp.minimum(tile_class, 0)


# Register layouts of a WGMMA tile's row and column vectors.
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)

TILING = plgpu.TilingTransform((8, 64))
SWIZZLE = plgpu.SwizzleTransform(128)
# Float32 tiles in shared memory that registers store and load in the
# WGMMA layout: 128-byte rows of 32 elements.
F32_TILING = plgpu.TilingTransform((8, 32))


def smem_tile(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
  """A shared-memory buffer laid out for TMA and ``wgmma`` (128-byte
  swizzle, 8 x 64 tiles)."""
  return plgpu.SMEM(shape, dtype, transforms=(TILING, SWIZZLE))


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the visibility rule that a kernel compiles in, plus
  which optional per-call arrays it receives.

  Attributes:
    q_len, kv_len: the unpadded ``T`` and ``S``.
    is_causal, window: as in :class:`jflash.masks.AttentionMask`.
    has_q_lengths, has_kv_lengths, has_segments: whether the kernel gets
      ``q_lengths [B]``, ``kv_lengths [B]`` and segment ids ``[B, T]`` /
      ``[B, S]`` (padded) as inputs.
    has_offsets: whether the kernel gets ``offsets``, int32 ``[2]``: the
      global positions of local query 0 and key 0 (the mask describes one
      block of longer sequences; see :func:`offsets_of`).
  """

  q_len: int
  kv_len: int
  is_causal: bool
  window: tuple[int, int] | None
  has_q_lengths: bool
  has_kv_lengths: bool
  has_segments: bool
  has_offsets: bool = False

  @classmethod
  def of(cls, mask: masks.AttentionMask) -> "MaskSpec":
    return cls(q_len=mask.q_len, kv_len=mask.kv_len,
               is_causal=mask.is_causal, window=mask.window,
               has_q_lengths=mask.q_lengths is not None,
               has_kv_lengths=mask.kv_lengths is not None,
               has_segments=mask.q_segment_ids is not None,
               has_offsets=mask.has_offsets)

  def rules(self) -> masks.AttentionMask:
    """The static rules as a :class:`jflash.masks.AttentionMask` (with
    offsets, its window keeps the sides that global positions need)."""
    return masks.AttentionMask(batch=1, q_len=self.q_len,
                               kv_len=self.kv_len, is_causal=self.is_causal,
                               window=self.window,
                               has_offsets=self.has_offsets)

  def tile_visibility(self, q_ids: Array, kv_ids: Array, q_length, kv_length,
                      q_seg: Array | None, kv_seg: Array | None,
                      q_offset: Array | None = None,
                      kv_offset: Array | None = None) -> Array:
    """Visibility of one tile from position arrays already in the kernel's
    register layout (``q_ids``/``kv_ids`` of the tile's full 2-D shape,
    ``q_seg``/``kv_seg`` broadcast likewise), by
    :func:`jflash.masks.visibility_at`.  ``q_offset``/``kv_offset`` are
    the call's offsets (:func:`offsets_of`), given exactly when
    ``has_offsets``."""
    if self.has_offsets != (q_offset is not None and kv_offset is not None):
      raise ValueError(
          f"MaskSpec.tile_visibility: has_offsets is {self.has_offsets}, "
          f"expected both q_offset and kv_offset exactly then; got "
          f"q_offset {'set' if q_offset is not None else 'None'} and "
          f"kv_offset {'set' if kv_offset is not None else 'None'}")
    return masks.visibility_at(self.rules(), q_ids, kv_ids,
                               q_length=q_length, kv_length=kv_length,
                               q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                               q_offset=q_offset, kv_offset=kv_offset)


  def mask_tile(self, s: Array, *, row_start, col_tile, col_block: int,
                rows_are_queries: bool, q_length, kv_length,
                q_seg: Array | None, kv_seg: Array | None,
                q_offset: Array | None = None,
                kv_offset: Array | None = None) -> Array:
    """``s`` (a WGMMA-layout tile) with invisible entries set to ``-inf``.

    Row ``r`` of the tile is position ``row_start + r`` and column ``c`` is
    position ``col_tile * col_block + c``; rows are queries and columns keys
    (``rows_are_queries``), or the transpose (the dK/dV pass).  Positions
    are local; ``q_offset``/``kv_offset`` (with ``has_offsets``) place
    them in the global sequences."""
    shape = s.shape
    rows = plgpu.broadcasted_iota(
        jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row_start
    cols = plgpu.broadcasted_iota(
        jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + (
            col_tile * col_block)
    q_ids, kv_ids = (rows, cols) if rows_are_queries else (cols, rows)
    visible = self.tile_visibility(q_ids, kv_ids, q_length, kv_length, q_seg,
                                   kv_seg, q_offset, kv_offset)
    return jnp.where(visible, s, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class LogitTransform:
  """Scaled (and optionally soft-capped) logits in base 2: the kernels
  compute ``exp2(transform(qk) - m)`` with ``m`` in the same units."""

  scale: float
  soft_cap: float | None

  def __call__(self, qk: Array) -> Array:
    """``log2(e) * cap(scale * qk)``."""
    if self.soft_cap is None:
      return qk * (self.scale * LOG2E)
    return jnp.tanh(qk * (self.scale / self.soft_cap)) * (
        self.soft_cap * LOG2E)

  @property
  def linear_factor(self) -> float | None:
    """``scale * log2(e)`` when the transform is multiplication by a
    positive factor (no soft cap, ``scale > 0``), else None.  Then the row
    maximum can be taken on the raw products and ``exp2(qk * factor - m)``
    is one fused multiply-add per element."""
    if self.soft_cap is None and self.scale > 0:
      return self.scale * LOG2E
    return None

  def derivative(self, s2: Array) -> Array | None:
    """d(natural logit)/d(scale * qk) given the base-2 logits ``s2``, or None
    when it is 1 (no cap): ``1 - tanh^2``."""
    if self.soft_cap is None:
      return None
    t = s2 * (1.0 / (self.soft_cap * LOG2E))
    return 1.0 - t * t


def rows_grew(m_old: Array, m_new: Array) -> Array:
  """int32 1 in a thread if the running maximum of any row it holds grew
  (``m_new > m_old``, WGMMA row vectors), else 0.  Thread-local: threads
  of a warpgroup may differ, so it may only choose between branches that
  hold no warpgroup-wide operation (a ``wgmma``, a barrier)."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  @plgpu.inline_mgpu(
      arg_types=(row_layout,),
      return_type=plgpu.ShapeDtypeStruct((), jnp.int32,
                                         layout=plgpu.Layout.WG_SPLAT(())))
  def any_above_zero(_, growth):
    f32 = ir.F32Type.get()
    zero = arith.constant(f32, ir.FloatAttr.get(f32, 0.0))
    grew = None
    for reg in growth.registers.flat:
      if isinstance(reg.type, ir.VectorType):
        elems = [vector.extract(reg, dynamic_position=[],
                                static_position=ir.DenseI64ArrayAttr.get([i]))
                 for i in range(ir.VectorType(reg.type).shape[0])]
      else:
        elems = [reg]
      for e in elems:
        c = arith.cmpf(arith.CmpFPredicate.OGT, e, zero)
        grew = c if grew is None else arith.ori(grew, c)
    i32 = ir.IntegerType.get_signless(32)
    return mgpu.FragmentedArray.splat(
        arith.extui(i32, grew), (), is_signed=True)
  return any_above_zero(m_new - m_old)


def broadcast_rows(x: Array, shape: tuple[int, int]) -> Array:
  return lax.broadcast_in_dim(x, shape, [0])


def broadcast_cols(x: Array, shape: tuple[int, int]) -> Array:
  return lax.broadcast_in_dim(x, shape, [1])


def i32(x):
  """``x`` as an int32 scalar for the kernels' index math.

  Under ``jax_enable_x64`` a Python int passed to a ``lax`` operation
  becomes int64, as does the index of a ``lax.fori_loop`` over Python
  bounds, and ``lax`` operations refuse mixed dtypes.  Python ints become
  int32 constants and 64-bit values are converted; int32 values pass
  unchanged (so that without x64 nothing is added to the kernel).
  """
  if isinstance(x, (int, np.integer)):
    return np.int32(x)
  if x.dtype == jnp.int32:
    return x
  return lax.convert_element_type(x, jnp.int32)


def scalar_or_none(ref, index) -> Array | None:
  return None if ref is None else ref[index]


def offsets_of(offsets_ref) -> tuple[Array | None, Array | None]:
  """``(q_offset, kv_offset)`` read from a kernel's optional ``offsets``
  input (int32 ``[2]`` in GMEM: the global positions of local query 0 and
  key 0, the same for every batch row), or ``(None, None)`` without it."""
  if offsets_ref is None:
    return None, None
  return offsets_ref[i32(0)], offsets_ref[i32(1)]


def num_sms() -> int:
  """Streaming multiprocessors of the first GPU (132 on an H100 or H200
  when no GPU is attached, e.g. lowering on a CPU for a CUDA target)."""
  try:
    return jax.devices("gpu")[0].core_count
  except RuntimeError:
    return 132


@dataclasses.dataclass(frozen=True)
class PersistentItems:
  """The work of a persistent kernel: one CTA per SM (at most one per item),
  each looping over its share of the items ``(head, batch row, block)``.

  Items go longest first: row blocks in the order of
  :func:`~jflash.backends.mosaic_gpu.schedule.heaviest_first`
  (``block_order_ref``, ``[B * blocks_per_row]``), the heads of one
  row block together.  Pass ``n`` deals ``num_ctas`` items to the CTAs,
  forwards when ``n`` is even and backwards when odd, so that every CTA
  gets a like share of long and short items.
  """

  num_heads: int
  batch: int
  blocks_per_row: int
  num_ctas: int

  @classmethod
  def over(cls, num_heads: int, batch: int,
           blocks_per_row: int) -> "PersistentItems":
    items = num_heads * batch * blocks_per_row
    return cls(num_heads, batch, blocks_per_row, min(items, num_sms()))

  @property
  def num_items(self) -> int:
    return self.num_heads * self.batch * self.blocks_per_row

  @property
  def passes(self) -> int:
    return -(-self.num_items // self.num_ctas)

  def item_at(self, block_order_ref, cta, n):
    """``(k, (head, batch row, block))`` of this CTA's item in pass ``n``;
    ``k >= num_items`` past the last item (the lookup stays in bounds and
    the caller skips it)."""
    n = i32(n)
    lane = jnp.where(lax.rem(n, i32(2)) == 0, cta, self.num_ctas - 1 - cta)
    k = n * self.num_ctas + lane
    flat = block_order_ref[lax.div(jnp.minimum(k, self.num_items - 1),
                                   i32(self.num_heads))]
    return k, (lax.rem(k, i32(self.num_heads)),
               lax.div(flat, i32(self.blocks_per_row)),
               lax.rem(flat, i32(self.blocks_per_row)))

  def for_each(self, block_order_ref, cta, work, init=None) -> None:
    """``work(head, b, block, carry, next_item) -> carry`` over this CTA's
    items, threading ``carry`` through (by default a ring position that
    starts at 0); ``next_item`` is ``(exists, (head, b, block))`` of the
    CTA's next item."""
    def one(n, carry):
      k, where = self.item_at(block_order_ref, cta, n)
      k_next, where_next = self.item_at(block_order_ref, cta, n + 1)
      return lax.cond(
          k < self.num_items,
          lambda: work(*where, carry,
                       (k_next < self.num_items, where_next)),
          lambda: carry)
    lax.fori_loop(0, self.passes, one,
                  jnp.int32(0) if init is None else init)


def warp_specialized_kernel(setup: Callable, args, *, scratch, out_type,
                            grid: tuple[int, ...],
                            grid_names: tuple[str, ...], kernel_name: str,
                            consumers: int = 2):
  """The skeleton of the Hopper kernels: ``consumers`` consumer warpgroups
  (two, or one for the decode kernel) and a producer per CTA
  (:func:`split_warpgroups`) sharing the shared-memory buffers
  ``scratch``.

  ``setup(*refs)`` gets the global-memory refs of ``args`` and the outputs
  (``out_type``, shapes and dtypes) in that order and returns
  ``body(scratch_refs)``, which runs with ``scratch`` (a pytree of
  ``plgpu.SMEM`` and ``plgpu.Barrier``, e.g. a dataclass of named buffers)
  allocated once for all warpgroups.
  """
  def kernel(*refs):
    pl.run_scoped(setup(*refs), scratch, collective_axes="wg")
  out = plgpu.kernel(
      kernel, out_type=out_type, grid=grid, grid_names=grid_names,
      num_threads=consumers + 1, thread_name="wg", kernel_name=kernel_name,
      compiler_params=COMPILER_PARAMS)(*args)
  # Mosaic GPU's output types carry no mesh axes; inside a checked
  # shard_map the outputs vary as the inputs do.
  return vary_as_inputs(out, args)


def split_warpgroups(wg: Array, consumer: Callable[[], None],
                     producer: Callable[[], None], consumers: int = 2
                     ) -> None:
  """``consumer()`` on warpgroups ``0 .. consumers - 1`` and ``producer()``
  on the last, each after moving registers to the consumers
  (``setmaxnreg``: :data:`CONSUMER_REGISTERS` and
  :data:`PRODUCER_REGISTERS`)."""
  @pl.when(wg < consumers)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    consumer()

  @pl.when(wg == consumers)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    producer()


def scratch_dataclass(cls):
  """A frozen dataclass of named kernel buffers, registered as a pytree
  (its fields, in order, are the leaves; a None field allocates
  nothing), so that :func:`warp_specialized_kernel` allocates it and the
  kernel body reads its buffers by name."""
  return jax.tree_util.register_dataclass(
      dataclasses.dataclass(frozen=True)(cls))


def schedule_row(order_ref, count_ref, batch_index, block_index):
  """(number of tiles to visit, function step -> tile index) of one row of a
  :class:`jflash.tiles.TileSchedule` kept in GMEM."""
  count = count_ref[batch_index, block_index]

  def tile_at(step):
    return order_ref[batch_index, block_index, step]
  return count, tile_at


def stream_tiles(count, tile_at, stages: int, block: int, streams, b,
                 seg_ref, seg_smem, seg_ready, first_step=0) -> None:
  """Producer loop: for step ``i`` copy tile ``tile_at(i)`` of every stream
  ``(gmem_ref [B, L, heads, H], smem_ring, ready, free, head)`` into slot
  ``(first_step + i) % stages`` with TMA, after the consumers released that
  slot; segment ids of the tile (``seg_ref [B, L]``, or None) travel with
  the first stream.  ``first_step`` counts the ring's earlier uses (a
  persistent kernel's earlier items)."""

  @pl.loop(0, count)
  def _load(i):
    slot = lax.rem(first_step + i, i32(stages))
    rows = pl.ds(tile_at(i) * block, block)
    for n, (ref, smem, ready, free, head) in enumerate(streams):
      @pl.when(first_step + i >= stages)
      def _():
        with jax.named_scope(f"free_wait_{n}"):  # a profile's span
          plgpu.barrier_wait(free.at[slot])
      plgpu.copy_gmem_to_smem(ref.at[b, rows, head], smem.at[slot],
                              ready.at[slot])
      if n == 0 and seg_ref is not None:
        plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], seg_smem.at[slot],
                                seg_ready.at[slot])


def kv_item_producer(order_ref, count_ref, *, group: int, stages: int,
                     block_kv: int, k, v, segments, v_first: bool = False):
  """The producer's ``work`` for :meth:`PersistentItems.for_each` in a
  kernel over query blocks (forward, dQ): stream an item's K/V tiles
  (its schedule row in ``order_ref``/``count_ref``) into the ring, from
  ring step ``first_step`` on, and return the next item's first step.

  ``k`` and ``v`` are ``(gmem_ref, smem_ring, ready, free)``; ``segments``
  is ``(seg_ref or None, seg_smem, seg_ready)``, travelling with the first
  stream; ``v_first`` streams V before K."""
  def produce_item(head, b, q_block, first_step, next_item):
    del next_item
    count, tile_at = schedule_row(order_ref, count_ref, b, q_block)
    kv_head = lax.div(head, i32(group))
    streams = [(*k, kv_head), (*v, kv_head)]
    if v_first:
      streams.reverse()
    stream_tiles(count, tile_at, stages, block_kv, streams, b, *segments,
                 first_step=first_step)
    return first_step + count
  return produce_item

