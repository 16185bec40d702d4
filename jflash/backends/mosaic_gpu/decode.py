"""Hopper decode kernel: split-K attention of a few new queries against a
contiguous or paged key/value cache, in Pallas Mosaic GPU.

A work item is ``(batch row b, key/value head k, row tile r, split s)``:
the rows of head ``k``'s group (its ``G`` query heads times the ``T`` new
tokens, row ``g * T + t``), 64 per row tile (the rows of one ``wgmma``),
against the ``s``-th of ``num_splits`` equal runs of ``block_kv``-slot
chunks of the sequence's key range (:func:`jflash.masks.decode_key_range`:
a window's pages only).  Each chunk is read once for all the group's rows.
The grid is persistent: one CTA per SM (at most one per item), CTA ``c``
taking items ``c, c + num_ctas, ...``.  Per CTA two warpgroups:

* a producer streams each item's Q rows (two buffers where they fit: the
  next item's load while this one runs) and its K/V chunks through a ring of
  ``stages`` shared-memory slots with TMA, waiting on "free" barriers
  before reusing a slot; a paged cache's chunk is looked up in the block
  table page by page (one copy per page, or per part of a page);
* a consumer: ``Q K^T`` on the tensor cores, online softmax in float32
  registers (base-2 exponent), ``P V``.  Chunks at the edges of the key
  range take the element mask (:func:`jflash.tiles.decode_chunk_class`),
  and the ones holding slots outside it have those rows of V zeroed in
  shared memory before ``P V``: such slots may hold anything, NaN
  included, and ``0 * NaN`` would reach the output.

Each item writes its rows' normalized output and natural-log logsumexp in
float32 (only the rows that hold queries, rounded up to 8, leave shared
memory); the splits are merged exactly, in split order, by
:func:`jflash.backends.xla.decode.merge_normalized`: reruns give the same
bits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jflash import masks, tiles
from jflash.core.call import check_config
from jflash.core.call import DecodeCall
from jflash.core.platform import is_hopper
from jflash.core.splits import group_rows, merge_normalized, ungroup_rows
from jflash.backends.mosaic_gpu import common
from jflash.backends.mosaic_gpu.common import (
    COL, ROW, LogitTransform, broadcast_cols, broadcast_rows, i32)

Array = jax.Array

ROWS = 64
"""Query rows per item: the rows of one ``wgmma`` (its ``M``)."""
HEAD_DIMS = (64, 128, 256)
"""Head dims the kernel serves: whole 128-byte swizzled tiles of
bfloat16/float16 (a cache cannot be padded without copying it)."""


@dataclasses.dataclass(frozen=True)
class MosaicGpuDecodeConfig:
  """Tiling of the Hopper decode kernel.

  Attributes:
    block_kv: cache slots per chunk (64 or 128); None: 128 at head dim 64,
      else 64 (16 KiB of keys per chunk at head dims 64 and 128).  A paged
      cache's page size must divide it or be a multiple of it.
    stages: K/V chunks in flight per CTA (the ring's slots), at most as
      many as fit in shared memory.  Decoding is bound by memory
      bandwidth: enough bytes must be in flight per SM.
    num_splits: runs of chunks per sequence computed by separate items and
      merged; None fills the SMs: ``num_sms // (B * K * row_tiles)``
      (at least 1), capped by the chunks a sequence can need.
  """

  block_kv: int | None = None
  stages: int = 4
  num_splits: int | None = None

  def __post_init__(self):
    check_config(self, ("stages",), optional=("block_kv", "num_splits"))
    if self.block_kv not in (None, 64, 128):
      raise ValueError("MosaicGpuDecodeConfig.block_kv must be None, 64 or "
                       f"128, got {self.block_kv!r}")
    if self.stages < 2:
      raise ValueError("MosaicGpuDecodeConfig.stages must be at least 2, got "
                       f"{self.stages!r}")

  def chunk(self, head_dim: int) -> int:
    """``block_kv`` at this head dim."""
    if self.block_kv is not None:
      return self.block_kv
    return 128 if head_dim <= 64 else 64

  def buffers(self, head_dim: int) -> tuple[int, int]:
    """``(q_buffers, stages)``: two Q buffers (the next item's rows load
    during this one) where the ring keeps at least two slots beside them,
    else one; ``stages`` less where the ring would not fit in shared
    memory (head dim 256)."""
    stage = 2 * common.smem_bytes(self.chunk(head_dim) * head_dim * 2)
    for q_buffers in (2, 1):
      fixed = common.smem_bytes(q_buffers * ROWS * head_dim * 2,  # Q
                                ROWS * head_dim * 4, ROWS * 4)  # out, lse
      fit = (common.SMEM_LIMIT_BYTES - fixed) // stage
      if fit >= 2:
        return q_buffers, min(self.stages, fit)
    raise AssertionError(f"no ring fits at head dim {head_dim}")


@common.scratch_dataclass
class _Scratch:
  """The decode kernel's shared-memory buffers."""

  q: Any  # [q_buffers, ROWS, H]: this item's (and the next item's) Q rows
  k: Any  # [stages, block_kv, H]: the K ring
  v: Any  # [stages, block_kv, H]: the V ring
  out: Any  # [ROWS, H] float32: the item's normalized output rows
  lse: Any  # [ROWS] float32: their logsumexp
  q_ready: Any  # per Q buffer
  q_free: Any
  k_ready: Any  # per ring slot; one arrival per page copy
  v_ready: Any
  k_free: Any  # per ring slot
  v_free: Any


@dataclasses.dataclass(frozen=True)
class _Static:
  """Static facts of one call that the kernel closes over."""

  num_new: int  # T
  rows: int  # G * T, the group's query rows
  out_rows: int  # rows rounded up to 8: the rows written per item
  row_tiles: int
  kv_heads: int
  batch: int
  num_splits: int
  num_ctas: int
  capacity: int  # S
  window: tuple[int, int] | None
  logits: LogitTransform
  block_kv: int
  stages: int
  q_buffers: int  # 2: the next item's Q loads during this one
  head_dim: int
  dtype: Any
  page_size: int | None  # None: a contiguous cache
  num_pages: int
  max_pages: int

  @property
  def num_items(self) -> int:
    return self.batch * self.kv_heads * self.row_tiles * self.num_splits

  @property
  def passes(self) -> int:
    return -(-self.num_items // self.num_ctas)

  @property
  def copies_per_chunk(self) -> int:
    """TMA copies per K (or V) chunk: one per page when pages are shorter
    than a chunk, else one."""
    if self.page_size is None or self.page_size >= self.block_kv:
      return 1
    return self.block_kv // self.page_size


@dataclasses.dataclass(frozen=True)
class _Item:
  """One work item as both warpgroups see it (scalars)."""

  exists: Array
  b: Array
  kv_head: Array
  row_tile: Array
  split: Array
  length: Array  # the sequence's valid slots
  bounds: masks.DecodeBounds  # what its new queries see
  first_chunk: Array  # the run's first chunk
  count: Array  # chunks in the run


def _item_at(st: _Static, lengths_ref, cta, n) -> _Item:
  """This CTA's item in pass ``n``; past the last item ``exists`` is false
  (and the rest stays in bounds)."""
  index = i32(n) * st.num_ctas + cta
  exists = index < st.num_items
  index = jnp.minimum(index, st.num_items - 1)
  split = lax.rem(index, i32(st.num_splits))
  rest = lax.div(index, i32(st.num_splits))
  row_tile = lax.rem(rest, i32(st.row_tiles))
  rest = lax.div(rest, i32(st.row_tiles))
  kv_head = lax.rem(rest, i32(st.kv_heads))
  b = lax.div(rest, i32(st.kv_heads))
  length = lengths_ref[b]
  bounds = masks.decode_bounds(length, st.num_new, kv_len=st.capacity,
                               window=st.window)
  first, end = bounds.first, bounds.end
  block = i32(st.block_kv)
  chunk0 = lax.div(first, block)
  needed = jnp.where(end > first, lax.div(end - 1, block) - chunk0 + 1, 0)
  # Equal runs of this sequence's own chunks: ragged lengths split evenly.
  per_split = lax.div(needed + (st.num_splits - 1), i32(st.num_splits))
  start = split * per_split
  count = jnp.clip(needed - start, 0, per_split)
  return _Item(exists=exists, b=b, kv_head=kv_head, row_tile=row_tile,
               split=split, length=length, bounds=bounds,
               first_chunk=chunk0 + start,
               count=count)


def _for_each_item(st: _Static, lengths_ref, cta, work) -> None:
  """``work(n, item, step) -> step`` over this CTA's items; ``step``
  counts the ring's uses so far."""
  def one(n, step):
    item = _item_at(st, lengths_ref, cta, n)
    return lax.cond(item.exists, lambda: work(n, item, step), lambda: step)
  lax.fori_loop(i32(0), i32(st.passes), one, jnp.int32(0))


def _produce(st: _Static, refs: dict, smem: _Scratch, cta) -> None:
  """The producer: each item's Q rows, then its chunks into the ring."""
  q_ref, k_ref, v_ref = refs["q"], refs["k"], refs["v"]
  table_ref = refs.get("table")

  rows = st.block_kv if table_ref is None else min(st.page_size,
                                                    st.block_kv)

  def pages_of(item: _Item, chunk) -> tuple:
    """The pages of a chunk's copies (none for a contiguous cache)."""
    if table_ref is None:
      return ()
    start = chunk * st.block_kv
    return tuple(_page_of(st, table_ref, item, start + part * rows)
                 for part in range(st.copies_per_chunk))

  def copy_chunk(item: _Item, chunk, slot, pages: tuple) -> None:
    start = chunk * st.block_kv
    for src, dst, ready in ((k_ref, smem.k, smem.k_ready),
                            (v_ref, smem.v, smem.v_ready)):
      if table_ref is None:
        plgpu.copy_gmem_to_smem(
            src.at[item.b, pl.ds(start, st.block_kv), item.kv_head],
            dst.at[slot], ready.at[slot])
        continue
      for part, page in enumerate(pages):
        within = lax.rem(start + part * rows, i32(st.page_size))
        plgpu.copy_gmem_to_smem(
            src.at[page, pl.ds(within, rows), item.kv_head],
            dst.at[slot, pl.ds(part * rows, rows)], ready.at[slot])

  def produce_item(n, item: _Item, step):
    q_slot = lax.rem(i32(n), i32(st.q_buffers))
    pl.when(n >= st.q_buffers)(
        lambda: plgpu.barrier_wait(smem.q_free.at[q_slot]))
    plgpu.copy_gmem_to_smem(
        q_ref.at[item.b, item.kv_head, pl.ds(item.row_tile * ROWS, ROWS)],
        smem.q.at[q_slot], smem.q_ready.at[q_slot])

    def chunk_step(j, pages):
      # The next chunk's table entries are read before this chunk waits
      # for its slot, so that their latency is not waited for in turn.
      following = pages_of(item, item.first_chunk + j + 1)
      slot = lax.rem(step + j, i32(st.stages))

      @pl.when(step + j >= st.stages)
      def _():
        plgpu.barrier_wait(smem.k_free.at[slot])
        plgpu.barrier_wait(smem.v_free.at[slot])
      copy_chunk(item, item.first_chunk + j, slot, pages)
      return following
    lax.fori_loop(i32(0), item.count, chunk_step,
                  pages_of(item, item.first_chunk))
    return step + item.count

  _for_each_item(st, refs["lengths"], cta, produce_item)


def _page_of(st: _Static, table_ref, item: _Item, slot):
  """The page holding cache slot ``slot`` of the item's sequence.  A page
  outside the table, or a bad entry, reads page 0: the key range never
  reaches such slots (they are masked and their values zeroed)."""
  column = lax.div(slot, i32(st.page_size))
  page = table_ref[item.b, jnp.minimum(column, st.max_pages - 1)]
  ok = (column < st.max_pages) & (page >= 0) & (page < st.num_pages)
  return jnp.where(ok, page, 0)


@dataclasses.dataclass(frozen=True)
class _Consumer:
  """The consumer's steps over one item."""

  st: _Static
  smem: _Scratch
  item: _Item
  first_step: Array  # the ring step of the item's first chunk
  q_slot: Array

  def slot_of(self, j):
    return lax.rem(self.first_step + j, i32(self.st.stages))

  def row_bounds(self):
    """Each row's visible slots ``[lo, hi)`` (WGMMA row vectors); rows
    past the group's ``G * T`` see nothing."""
    st = self.st
    row = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=ROW) + (
        self.item.row_tile * ROWS)
    t = lax.rem(row, i32(st.num_new))
    lo, hi = masks.decode_row_bounds_at(t, self.item.length, st.num_new,
                                        kv_len=st.capacity, window=st.window)
    return lo, jnp.where(row < st.rows, hi, lo)

  def run(self):
    """``(O, m, l)`` over the item's chunks: the unnormalized output and
    the rows' base-2 maxima and sums."""
    st = self.st
    acc = plgpu.layout_cast(jnp.zeros((ROWS, st.head_dim), jnp.float32),
                            plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((ROWS,), common.M_INIT, jnp.float32), ROW)
    l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), ROW)
    plgpu.barrier_wait(self.smem.q_ready.at[self.q_slot])
    bounds = self.row_bounds()
    acc, m, l = lax.fori_loop(0, self.item.count,
                              lambda j, c: self.step(j, c, bounds),
                              (acc, m, l))
    plgpu.barrier_arrive(self.smem.q_free.at[self.q_slot])
    return acc, m, l

  def step(self, j, carry, bounds):
    """One chunk: ``S = Q K^T``, the online softmax, ``O += P V``."""
    st, smem = self.st, self.smem
    acc, m, l = carry
    slot = self.slot_of(j)
    start = (self.item.first_chunk + j) * st.block_kv
    full, unseen = tiles.decode_chunk_class(self.item.bounds, start,
                                            st.block_kv)
    tile = (ROWS, st.block_kv)
    plgpu.barrier_wait(smem.k_ready.at[slot])

    def qk_product(s_ref):
      plgpu.wgmma(s_ref, smem.q.at[self.q_slot],
                  smem.k.at[slot].transpose((1, 0)))
      return s_ref[...]
    qk = pl.run_scoped(qk_product, plgpu.ACC(tile, jnp.float32))
    plgpu.barrier_arrive(smem.k_free.at[slot])

    def masked(s):
      lo, hi = bounds
      cols = plgpu.broadcasted_iota(jnp.int32, (st.block_kv,), 0,
                                    layout=COL) + start
      cols = broadcast_cols(cols, tile)
      visible = ((cols >= broadcast_rows(lo, tile))
                 & (cols < broadcast_rows(hi, tile)))
      return jnp.where(visible, s, -jnp.inf)
    s = lax.cond(full, lambda s: s, masked, st.logits(qk))
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp2(s - broadcast_rows(m_new, tile))
    rescale = jnp.exp2(m - m_new)
    l = l * rescale + p.sum(axis=1)
    acc = acc * broadcast_rows(rescale, acc.shape)
    p_low = p.astype(st.dtype)

    plgpu.barrier_wait(smem.v_ready.at[slot])
    pl.when(unseen)(lambda: self.zero_unseen_values(slot, start))

    def pv_product(o_ref):
      plgpu.wgmma(o_ref, p_low, smem.v.at[slot])
    acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(smem.v_free.at[slot])
    return acc, m_new, l

  def zero_unseen_values(self, slot, start) -> None:
    """Zeroes the rows of V's ``slot`` (the chunk from cache slot
    ``start``) outside the sequence's key range, for the tensor cores."""
    st = self.st
    first, end = self.item.bounds.first, self.item.bounds.end
    shape = (st.block_kv, st.head_dim)
    ref = self.smem.v.at[slot]
    values = plgpu.load(ref, layout=plgpu.Layout.WGMMA)
    slots = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                   layout=plgpu.Layout.WGMMA) + start
    ref[...] = jnp.where((slots >= first) & (slots < end), values,
                         jnp.zeros((), values.dtype))
    plgpu.commit_smem()

  def write(self, acc, m, l, out_ref, lse_ref) -> None:
    """The item's rows: ``O / l`` (zero where a row saw no key) and the
    natural-log logsumexp (``-inf`` there), through shared memory."""
    st, smem, item = self.st, self.smem, self.item
    seen = l > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    # The previous item's copies must have read the buffers.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    smem.out[...] = acc * broadcast_rows(inv, acc.shape)
    smem.lse[...] = jnp.where(
        seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * common.LN2, -jnp.inf)
    plgpu.commit_smem()

    def store(rows: int) -> None:
      where = (item.split, item.b, item.kv_head,
               pl.ds(item.row_tile * ROWS, rows))
      plgpu.copy_smem_to_gmem(smem.out.at[pl.ds(0, rows)], out_ref.at[where])
      plgpu.copy_smem_to_gmem(smem.lse.at[pl.ds(0, rows)], lse_ref.at[where])
    last_rows = st.out_rows - (st.row_tiles - 1) * ROWS
    if st.row_tiles == 1:
      store(last_rows)
    else:
      last = item.row_tile == st.row_tiles - 1
      pl.when(last)(lambda: store(last_rows))
      pl.when(jnp.logical_not(last))(lambda: store(ROWS))


def _consume(st: _Static, refs: dict, smem: _Scratch, cta) -> None:
  def consume_item(n, item: _Item, step):
    consumer = _Consumer(st=st, smem=smem, item=item, first_step=step,
                         q_slot=lax.rem(i32(n), i32(st.q_buffers)))
    acc, m, l = consumer.run()
    consumer.write(acc, m, l, refs["out"], refs["lse"])
    return step + item.count

  _for_each_item(st, refs["lengths"], cta, consume_item)
  plgpu.wait_smem_to_gmem(0)


def _scratch(st: _Static) -> _Scratch:
  ring = common.smem_tile((st.stages, st.block_kv, st.head_dim), st.dtype)
  return _Scratch(
      q=common.smem_tile((st.q_buffers, ROWS, st.head_dim), st.dtype),
      k=ring, v=ring,
      out=plgpu.SMEM((ROWS, st.head_dim), jnp.float32,
                     transforms=(common.F32_TILING, common.SWIZZLE)),
      lse=plgpu.SMEM((ROWS,), jnp.float32),
      q_ready=plgpu.Barrier(num_barriers=st.q_buffers),
      q_free=plgpu.Barrier(num_barriers=st.q_buffers),
      k_ready=plgpu.Barrier(num_arrivals=st.copies_per_chunk,
                            num_barriers=st.stages),
      v_ready=plgpu.Barrier(num_arrivals=st.copies_per_chunk,
                            num_barriers=st.stages),
      k_free=plgpu.Barrier(num_barriers=st.stages),
      v_free=plgpu.Barrier(num_barriers=st.stages))


def decode_kernel_call(st: _Static, q: Array, key: Array, value: Array,
                       lengths: Array, table: Array | None
                       ) -> tuple[Array, Array]:
  """Runs the kernel: ``q [B, K, row_tiles * 64, H]`` (grouped rows, zero
  padded), the cache as given.  Returns each split's normalized output
  ``[splits, B, K, out_rows, H]`` and logsumexp ``[splits, B, K,
  out_rows]``, float32."""
  names = ("q", "k", "v", "lengths") + (("table",) if table is not None
                                        else ()) + ("out", "lse")

  def setup(*refs):
    named = dict(zip(names, refs, strict=True))

    def body(smem: _Scratch):
      cta = lax.axis_index("ctas")
      wg = lax.axis_index("wg")
      common.split_warpgroups(
          wg, lambda: _consume(st, named, smem, cta),
          lambda: _produce(st, named, smem, cta), consumers=1)
    return body

  stats = (st.num_splits, st.batch, st.kv_heads, st.out_rows)
  args = (q, key, value, lengths) + ((table,) if table is not None else ())
  return common.warp_specialized_kernel(
      setup, args, scratch=_scratch(st),
      out_type=(jax.ShapeDtypeStruct(stats + (st.head_dim,), jnp.float32),
                jax.ShapeDtypeStruct(stats, jnp.float32)),
      grid=(st.num_ctas,), grid_names=("ctas",),
      kernel_name="jflash_decode", consumers=1)


@dataclasses.dataclass(frozen=True)
class MosaicGpuDecodeBackend:
  """The Hopper decode kernel.

  Serves bfloat16/float16 calls with head dim 64, 128 or 256 on compute
  capability 9.x, contiguous caches and paged ones whose page size is a
  multiple of 8 that divides ``config.block_kv`` or is a multiple of it;
  declines (``NotImplementedError``) the rest, which the ``xla`` decode
  backend serves.
  """

  config: MosaicGpuDecodeConfig = MosaicGpuDecodeConfig()
  name: str = "mosaic_gpu"

  def __call__(self, call: DecodeCall) -> tuple[Array, Array]:
    self._check(call)
    st = self._static(call)
    batch, num_new, num_heads, _ = call.query.shape
    q = group_rows(call.query, st.kv_heads)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, st.row_tiles * ROWS - st.rows),
                    (0, 0)))
    key, value = call.key, call.value
    if not call.paged and call.capacity < st.block_kv:
      # A chunk's copy must fit inside the cache array.
      pad = ((0, 0), (0, st.block_kv - call.capacity), (0, 0), (0, 0))
      key, value = jnp.pad(key, pad), jnp.pad(value, pad)
    out, lse = decode_kernel_call(st, q, key, value, call.lengths,
                                  call.block_table)
    out, lse = merge_normalized(out[:, :, :, :st.rows],
                                lse[:, :, :, :st.rows])
    return (ungroup_rows(out, num_new).astype(call.dtype),
            ungroup_rows(lse, num_new).astype(jnp.float32))

  def _check(self, call: DecodeCall) -> None:
    def decline(reason: str):
      raise NotImplementedError(f"Hopper decode kernel: {reason}")
    if call.interpret:
      decline("it uses wgmma, which Pallas interpret mode cannot run")
    tgt = call.target()
    if tgt.platform != "cuda" or not is_hopper(tgt.device_kind):
      decline(f"it needs a Hopper GPU (compute capability 9.x), the call "
              f"is traced for {tgt.platform} {tgt.device_kind!r}")
    if call.dtype not in (jnp.bfloat16, jnp.float16):
      decline(f"it computes in bfloat16/float16 only, got {call.dtype}")
    for name in ("alibi_slopes", "mask_fn"):
      if getattr(call, name) is not None:
        decline(f"{name} is not supported yet (the xla decode backend "
                "serves it)")
    head_dim = call.query.shape[-1]
    if head_dim not in HEAD_DIMS:
      decline(f"it serves head dims {HEAD_DIMS}, got {head_dim}")
    block = self.config.chunk(head_dim)
    if not call.paged and call.capacity % 8 and call.capacity >= block:
      decline(f"a contiguous cache's length S={call.capacity} must be a "
              "multiple of 8 (TMA reads rows in groups of 8)")
    if call.paged:
      size = call.page_size
      if size % 8 or (block % size and size % block):
        decline(f"page size {size} must be a multiple of 8 that divides "
                f"block_kv={block} or is a multiple of it")

  def _static(self, call: DecodeCall) -> _Static:
    batch, num_new, num_heads, head_dim = call.query.shape
    kv_heads = call.key.shape[2]
    rows = num_heads // kv_heads * num_new
    row_tiles = -(-rows // ROWS)
    block_kv = self.config.chunk(head_dim)
    max_chunks = max(1, tiles.decode_max_chunks(
        num_new, call.capacity, block_kv, call.window))
    base = batch * kv_heads * row_tiles
    splits = self.config.num_splits
    if splits is None:
      splits = max(1, common.num_sms() // base)
    splits = min(splits, max_chunks)
    items = base * splits
    q_buffers, stages = self.config.buffers(head_dim)
    return _Static(
        num_new=num_new, rows=rows, out_rows=-(-rows // 8) * 8,
        row_tiles=row_tiles, kv_heads=kv_heads, batch=batch,
        num_splits=splits, num_ctas=min(items, common.num_sms()),
        capacity=call.capacity, window=call.window,
        logits=LogitTransform(float(call.scale), call.logits_soft_cap),
        block_kv=block_kv, stages=stages, q_buffers=q_buffers,
        head_dim=head_dim,
        dtype=call.dtype, page_size=call.page_size,
        num_pages=call.key.shape[0] if call.paged else 0,
        max_pages=call.block_table.shape[1] if call.paged else 0)
