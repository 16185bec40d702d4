"""Hopper forward kernel: FlashAttention-3 structure in Pallas Mosaic GPU.

A persistent kernel: one CTA per SM, each taking a share of the items
(head, ``2 * block_q`` query rows of a batch row), longest first and dealt
so that every CTA gets a like share of the work.  The K/V ring runs on from
one item into the next, so the producer fills it for the next item while
the consumers finish the last.  Three warpgroups:

* two consumer warpgroups, each owning ``block_q`` query rows: ``Q K^T`` on
  the tensor cores (``wgmma``), online softmax in float32 registers (base-2
  exponent, scale folded in), ``P V`` on the tensor cores.  Two hardware
  named barriers make them alternate (each waits for the turn before ``P
  V`` and passes it without waiting once the next ``Q K^T`` is issued, or
  right after ``P V`` at an item's last step), so that one's softmax
  overlaps the other's matrix products and one's epilogue (normalizing and
  storing an item's output) never holds up the other;
* one producer warpgroup that streams the nonempty K/V tiles of the CTA's
  row block (from :func:`jflash.tiles.tile_schedule`) through a ring of
  ``stages`` shared-memory buffers with TMA, waiting on "consumed" barriers
  before reusing a slot.

Empty tiles are never loaded.  Each consumer looks up its own tile class:
full tiles skip the element mask; partial tiles (and tiles empty for this
warpgroup's half of the rows only) apply it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jflash import tiles
from jflash.backends.mosaic_gpu import common
from jflash.backends.mosaic_gpu.common import (
    COL, ROW, LogitTransform, MaskSpec, broadcast_cols, broadcast_rows)

Array = jax.Array

# Named regions of the kernel: spans in a Mosaic GPU profile (compiler
# params with profile_space, as tools/forward_trace.py sets them), and
# nothing otherwise.
_region = jax.named_scope


@common.scratch_dataclass
class _Scratch:
  """The forward's shared-memory buffers; None where a call needs none."""

  q: Any  # [2, block_q, H]: each consumer's Q rows
  out: Any  # [2, block_q, H]: each consumer's output; None: through q
  k: Any  # [stages, block_kv, H]: the K ring
  v: Any  # [stages, block_kv, H]: the V ring
  lse: Any  # [2, block_q] float32: each consumer's logsumexp
  q_segments: Any  # [2, block_q] int32: each consumer's query segment ids
  kv_segments: Any  # [stages, block_kv] int32, riding in K's slot
  k_ready: Any  # per ring slot
  v_ready: Any
  q_ready: Any  # 4: each consumer's Q, then its query segment ids
  kv_segments_ready: Any
  k_free: Any  # per ring slot, both consumers arrive
  v_free: Any


@dataclasses.dataclass(frozen=True)
class _ItemSteps:
  """One consumer's steps over one item (``2 * block_q`` query rows of a
  head and batch row, this consumer's ``block_q`` of them): the loop
  bodies of the forward, and the lookups and masks they share."""

  smem: _Scratch
  spec: MaskSpec
  logits: LogitTransform
  order_ref: Any  # the schedule's key tiles, [B, blocks, steps]
  class_ref: Any  # each consumer's tile class per step
  wg: Array  # this consumer, 0 or 1
  b: Array  # the item's batch row
  q_block: Array  # the item's block of 2 * block_q rows
  count: Array  # the item's steps
  first_step: Array  # the ring step of the item's first K/V tile
  q_base: Array  # this consumer's first query row
  q_length: Array | None
  kv_length: Array | None
  q_offset: Array | None  # the call's offsets, with spec.has_offsets
  kv_offset: Array | None
  q_seg: Array | None  # query segment ids broadcast over the tile
  qo_smem: Any  # this consumer's Q buffer
  tile: tuple[int, int]  # (block_q, block_kv)
  block_kv: int
  stages: int
  head_dim: int
  dtype: Any
  # Key segment ids ride in K's slot: with them, the slot is released only
  # after the step's softmax, whose masked branch alone reads them
  # (softmax_and_turn), else right after the step's Q K^T has read K.
  segments_ride_k: bool

  def tile_at(self, step):
    return self.order_ref[self.b, self.q_block, step]

  def run(self, first_info, *, qk_after_pv: bool, after_last_scores=None):
    """The item's steps from zeroed accumulators (``first_info``: step
    0's tile class and key tile), with ``Q K^T`` issued after ``P V`` or
    right behind it (``qk_after_pv``; ``after_last_scores()`` then runs
    once the item's last ``Q K^T`` has completed).  Returns ``(O, m,
    l)``: the unnormalized output, the rows' reference maxima and sums."""
    block_q = self.tile[0]
    acc = plgpu.layout_cast(
        jnp.zeros((block_q, self.head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((block_q,), common.M_INIT, jnp.float32),
                          ROW)
    l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), ROW)

    @pl.when(self.count > 0)
    def _():
      with _region("first_k_wait"):
        plgpu.barrier_wait(self.smem.k_ready.at[
            lax.rem(self.first_step, common.i32(self.stages))])
    # The consumers alternate on the tensor cores: each waits for the turn
    # before P V and passes it after the next Q K^T of the item, or after
    # P V at the item's last step (see forward_kernel_call's consumer).
    if not qk_after_pv:
      acc, m, l, _ = lax.fori_loop(0, self.count, self.waiting_step,
                                   (acc, m, l, first_info))
      return acc, m, l
    zeros = plgpu.layout_cast(jnp.zeros(self.tile, jnp.float32),
                              plgpu.Layout.WGMMA)
    qk = lax.cond(self.count > 0, self.first_scores, lambda: zeros)
    carry = lax.fori_loop(0, self.count - 1, self.chained_step,
                          (acc, m, l, qk, first_info))
    if after_last_scores is not None:
      after_last_scores()
    acc, m, l, _, _ = lax.cond(self.count > 0, self.last_step, lambda c: c,
                               carry)
    return acc, m, l

  def masked(self, s, kv_tile, kv_seg):
    return self.spec.mask_tile(
        s, row_start=self.q_base, col_tile=kv_tile, col_block=self.block_kv,
        rows_are_queries=True, q_length=self.q_length,
        kv_length=self.kv_length, q_seg=self.q_seg, kv_seg=kv_seg,
        q_offset=self.q_offset, kv_offset=self.kv_offset)

  def step_info(self, i):
    """Step ``i``'s tile class and key tile, read a step early so
    that their loads' latency is not waited for before the step's
    softmax (the tile only matters to a masked step); step 0's come
    from schedule_head."""
    i = jnp.maximum(jnp.minimum(i, self.count - 1), 0)  # in bounds
    return self.class_ref[self.b, self.q_block, i, self.wg], self.tile_at(i)

  def slot_of(self, i):
    return lax.rem(self.first_step + i, common.i32(self.stages))

  def kv_segments_loaded(self, slot):
    """The key segment ids of ``slot`` (already waited for), broadcast
    over the tile; the plain loops call it only where a tile is
    masked."""
    return broadcast_cols(
        plgpu.load(self.smem.kv_segments.at[slot], layout=COL), self.tile)

  def release_k_after_scores(self, slot):
    """Releases K's ``slot`` once its ``Q K^T`` has been read, unless
    segment ids ride in it (then softmax_and_turn releases it)."""
    if not self.segments_ride_k:
      plgpu.barrier_arrive(self.smem.k_free.at[slot])

  def first_scores(self):
    """``S_0 = Q K_0^T``, issued outside a turn: the previous item's
    last ``P V`` passed it (see ``consumer`` in forward_kernel_call)."""
    def qk_product(s_ref):
      plgpu.wgmma(s_ref, self.qo_smem,
                  self.smem.k.at[self.slot_of(0)].transpose((1, 0)))
      return s_ref[...]
    qk = pl.run_scoped(qk_product, plgpu.ACC(self.tile, jnp.float32))
    self.release_k_after_scores(self.slot_of(0))
    return qk

  def softmax_and_turn(self, qk, acc, m, l, info, i):
    """Step ``i``'s online softmax of ``S_i``; then waits for ``V_i``
    and for the turn.  Returns the rescaled ``O``, the new maximum and
    sums, and ``P_i`` in the input dtype."""
    step_class, kv_tile = info
    slot = self.slot_of(i)
    if self.segments_ride_k:
      # Waited for every step (the barrier's phases), read only by
      # masked tiles: a full tile keeps no segment ids in registers.
      plgpu.barrier_wait(self.smem.kv_segments_ready.at[slot])

    def mask_step(s):
      kv_seg = (self.kv_segments_loaded(slot) if self.segments_ride_k
                else None)
      return self.masked(s, kv_tile, kv_seg)
    with _region("softmax"):
      p, m_new, rescale = _exponentials(
          qk, m, full=step_class == tiles.FULL, logits=self.logits,
          masked=mask_step)
      if self.segments_ride_k:
        plgpu.barrier_arrive(self.smem.k_free.at[slot])
      # O is rescaled only in threads whose rows' maximum moved
      # (rarely, once the first tiles have set it: see _exponentials).
      acc = lax.cond(common.rows_grew(m, m_new),
                     lambda a: a * broadcast_rows(rescale, a.shape),
                     lambda a: a, acc)
      l = l * rescale
      p_low = p.astype(self.dtype)
      l = l + p.sum(axis=1)
    # P, the row sums and the maximum are formed before the waits for
    # V and the turn: without the barrier the compiler sinks the
    # exponentials past the turn, where they run while the other
    # consumer waits for the tensor cores.  O's rescale is pinned too
    # up to head dim 128; at 256 its 128 registers per thread are not
    # worth it.
    if self.head_dim <= 128:
      acc, l, m_new, p_low = lax.optimization_barrier(
          (acc, l, m_new, p_low))
    else:
      l, m_new, p_low = lax.optimization_barrier((l, m_new, p_low))
    with _region("v_wait"):
      plgpu.barrier_wait(self.smem.v_ready.at[slot])
    with _region("turn_wait"):
      common.wait_turn(self.wg)
    return acc, m_new, l, p_low

  def chained_step(self, i, carry):
    """A step of the ``qk_after_pv`` loop before the item's last:
    within one turn ``O += P_i V_i``
    and then ``S_{i+1} = Q K_{i+1}^T`` are issued back to back, so
    that the tensor cores run the second while this consumer would
    otherwise wait for the first; both are waited for together
    (they complete in order)."""
    acc, m, l, qk, info = carry
    following = self.step_info(i + 1)
    acc, m, l, p_low = self.softmax_and_turn(qk, acc, m, l, info, i)
    acc, qk = self.pv_then_scores(acc, qk, p_low, self.slot_of(i),
                                  self.slot_of(i + 1))
    return acc, m, l, qk, following

  def pv_then_scores(self, acc, qk, p_low, slot, after):
    """``O += P V`` on ``slot``, then ``S = Q K^T`` on K's ``after``
    slot, the turn passed after both are issued; waits for both."""
    def products(refs):
      o_ref, qk_ref = refs
      plgpu.wgmma(o_ref, p_low, self.smem.v.at[slot])
      plgpu.barrier_wait(self.smem.k_ready.at[after])

      # S's accumulator is allocated after P V is issued: zeros
      # materialized before it make ptxas zero 64 registers per step
      # instead of starting the product without an accumulator.
      def scores(s_ref):
        plgpu.wgmma(s_ref, self.qo_smem,
                    self.smem.k.at[after].transpose((1, 0)))
        common.pass_turn(self.wg)
        qk_ref[...] = s_ref[...]
      pl.run_scoped(scores, plgpu.ACC(self.tile, jnp.float32))
    with _region("pv_qk"):
      acc, qk = pl.run_state(products)((plgpu.ACC.init(acc), qk))
    plgpu.barrier_arrive(self.smem.v_free.at[slot])
    self.release_k_after_scores(after)
    return acc, qk

  def last_step(self, carry):
    """The item's last step: ``O += P V`` alone, and the turn passed
    at once, so that the other consumer's products queue behind it
    and neither consumer's epilogue holds up the other."""
    acc, m, l, qk, info = carry
    slot = self.slot_of(self.count - 1)
    acc, m, l, p_low = self.softmax_and_turn(qk, acc, m, l, info,
                                             self.count - 1)

    def pv_product(o_ref):
      plgpu.wgmma(o_ref, p_low, self.smem.v.at[slot])
      common.pass_turn(self.wg)
    with _region("last_pv"):
      acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(self.smem.v_free.at[slot])
    return acc, m, l, qk, info

  def waiting_step(self, i, carry):
    """A step of the loop without ``qk_after_pv``: ``Q K^T`` is issued
    once the previous step's ``P V`` has finished, and the turn passed
    after it."""
    acc, m, l, info = carry
    following = self.step_info(i + 1)
    slot = self.slot_of(i)

    def qk_product(s_ref):
      # K of this step was waited for during the previous step's P V.
      plgpu.wgmma(s_ref, self.qo_smem,
                  self.smem.k.at[slot].transpose((1, 0)))
      # An item's first Q K^T is issued outside a turn: the previous
      # item's last P V passed it (see ``consumer``).
      pl.when(i > 0)(lambda: common.pass_turn(self.wg))
      return s_ref[...]
    with _region("qk"):
      qk = pl.run_scoped(qk_product, plgpu.ACC(self.tile, jnp.float32))
    self.release_k_after_scores(slot)
    acc, m, l, p_low = self.softmax_and_turn(qk, acc, m, l, info, i)

    def pv_product(o_ref):
      plgpu.wgmma(o_ref, p_low, self.smem.v.at[slot])
      # The last P V of an item passes the turn at once (as in
      # last_step).
      pl.when(i + 1 == self.count)(lambda: common.pass_turn(self.wg))
      # Wait for the next K while the tensor cores work.
      @pl.when(i + 1 < self.count)
      def _():
        plgpu.barrier_wait(self.smem.k_ready.at[self.slot_of(i + 1)])
    with _region("pv"):
      acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(self.smem.v_free.at[slot])
    return acc, m, l, following


def _forward_scratch(block_q: int, block_kv: int, stages: int, head_dim: int,
                     dtype, *, segments: bool, output_buffer: bool
                     ) -> _Scratch:
  """The forward's buffers: segment ids only with ``segments``, and an
  output buffer apart from Q only with ``output_buffer``."""
  return _Scratch(
      q=common.smem_tile((2, block_q, head_dim), dtype),
      out=common.smem_tile((2, block_q, head_dim), dtype)
      if output_buffer else None,
      k=common.smem_tile((stages, block_kv, head_dim), dtype),
      v=common.smem_tile((stages, block_kv, head_dim), dtype),
      lse=plgpu.SMEM((2, block_q), jnp.float32),
      q_segments=plgpu.SMEM((2, block_q), jnp.int32) if segments else None,
      kv_segments=plgpu.SMEM((stages, block_kv), jnp.int32)
      if segments else None,
      k_ready=plgpu.Barrier(num_barriers=stages),
      v_ready=plgpu.Barrier(num_barriers=stages),
      q_ready=plgpu.Barrier(num_barriers=4),
      kv_segments_ready=plgpu.Barrier(num_barriers=stages)
      if segments else None,
      k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages))


def _write_output(acc: Array, m: Array, l: Array, o_smem, lse_smem, out_gmem,
                  lse_gmem) -> None:
  """An item's epilogue: ``O / l`` (zero for rows that see no key) and the
  natural-log logsumexp (``-inf`` there) through shared memory to their
  places in global memory."""
  seen = l > 0
  inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
  o_smem[...] = (acc * broadcast_rows(inv, acc.shape)).astype(o_smem.dtype)
  lse_smem[...] = jnp.where(
      seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * common.LN2, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, out_gmem)
  plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)


@dataclasses.dataclass(frozen=True)
class _ForwardKernel:
  """The forward kernel's static parameters (see
  :func:`forward_kernel_call`); :meth:`setup` is its kernel for
  :func:`common.warp_specialized_kernel`."""

  spec: MaskSpec
  logits: LogitTransform
  items: common.PersistentItems
  optional_names: tuple[str, ...]  # the optional inputs present, in order
  block_q: int
  block_kv: int
  stages: int
  head_dim: int
  dtype: Any
  group: int  # query heads per K/V head
  prefetch_q: bool  # an output buffer apart from Q: the next Q loads early
  qk_after_pv: bool

  def setup(self, q_ref, k_ref, v_ref, order_ref, count_ref, class_ref,
            block_order_ref, *rest):
    """The kernel on its global-memory refs (the inputs, the optional
    inputs present, then ``out`` and ``lse``): returns the body that runs
    on the scratch buffers."""
    spec, logits, items = self.spec, self.logits, self.items
    block_q, block_kv, stages = self.block_q, self.block_kv, self.stages
    head_dim, dtype, group = self.head_dim, self.dtype, self.group
    prefetch_q, qk_after_pv = self.prefetch_q, self.qk_after_pv
    optional_names, tile = self.optional_names, (block_q, block_kv)
    named = dict(zip(optional_names, rest[:len(optional_names)]))
    out_ref, lse_ref = rest[len(optional_names):]
    cta = lax.axis_index("ctas")
    wg = lax.axis_index("wg")
    q_seg_ref, kv_seg_ref = named.get("q_segments"), named.get("kv_segments")

    def item_at(n):
      return items.item_at(block_order_ref, cta, n)

    def for_each_item(work, init=None):
      items.for_each(block_order_ref, cta, work, init)

    def body(smem: _Scratch):

      def load_q(head, b, q_block):
        """Starts the copies of this consumer's Q rows (and their segment
        ids) of an item into its buffer."""
        q_base = (q_block * 2 + wg) * block_q
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, block_q), head],
                                smem.q.at[wg], smem.q_ready.at[wg])
        if q_seg_ref is not None:
          plgpu.copy_gmem_to_smem(q_seg_ref.at[b, pl.ds(q_base, block_q)],
                                  smem.q_segments.at[wg],
                                  smem.q_ready.at[2 + wg])

      def schedule_head(b, q_block):
        """An item's number of steps and its first step's tile class and
        key tile (see step_info), read from GMEM one item early."""
        return (count_ref[b, q_block], class_ref[b, q_block, 0, wg],
                order_ref[b, q_block, 0])

      def consume_item(head, b, q_block, carry, next_item):
        """One consumer's work on an item whose first K/V tile sits at
        ring step ``first_step``, its schedule_head read by the item
        before; returns the next item's first step and schedule_head."""
        first_step, (count, *first_info) = carry
        # The next item's schedule is read now, so that its latency is
        # not waited for between this item's output and the next's first
        # products.
        _, next_b, next_block = next_item[1]
        next_head = schedule_head(next_b, next_block)

        q_length = common.scalar_or_none(named.get("q_lengths"), b)
        kv_length = common.scalar_or_none(named.get("kv_lengths"), b)
        q_offset, kv_offset = common.offsets_of(named.get("offsets"))
        qo_smem = smem.q.at[wg]
        # Without an output buffer the output leaves through Q's.
        o_smem = (smem.q if smem.out is None else smem.out).at[wg]
        next_exists, next_where = next_item
        my_block = q_block * 2 + wg
        q_base = my_block * block_q
        if not prefetch_q:
          # The previous item's output and logsumexp leave through Q's
          # buffer: reuse it once the copies have read it.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          load_q(head, b, q_block)
        q_seg = None
        if q_seg_ref is not None:
          plgpu.barrier_wait(smem.q_ready.at[2 + wg])
          q_seg = broadcast_rows(plgpu.load(smem.q_segments.at[wg], layout=ROW),
                                 tile)
        with _region("q_wait"):
          plgpu.barrier_wait(smem.q_ready.at[wg])

        # In the qk_after_pv loop the next item's Q is loaded once the
        # chained steps are done (the item's last Q K^T has then completed
        # and its buffer is free), so that the load overlaps the last
        # softmax, P V and the output instead of being waited for before the
        # next item.  In the waiting loop, loading it inside the step loop
        # spills registers every step (head dim 128 with segment ids), so Q
        # loads once the item's products are done.
        early_q = prefetch_q and qk_after_pv

        def load_next_q(when=True):
          pl.when(jnp.logical_and(when, next_exists))(
              lambda: load_q(*next_where))

        steps = _ItemSteps(
            smem=smem, spec=spec, logits=logits, order_ref=order_ref,
            class_ref=class_ref, wg=wg, b=b, q_block=q_block, count=count,
            first_step=first_step, q_base=q_base, q_length=q_length,
            kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            q_seg=q_seg, qo_smem=qo_smem, tile=tile,
            block_kv=block_kv, stages=stages, head_dim=head_dim, dtype=dtype,
            segments_ride_k=kv_seg_ref is not None)

        acc, m, l = steps.run(tuple(first_info), qk_after_pv=qk_after_pv,
                              after_last_scores=load_next_q if early_q
                              else None)

        if prefetch_q:
          if not early_q:
            # Every Q K^T of this item has completed: the next item's Q may
            # take the buffer while this one's output is written.
            load_next_q()
          # The previous item's output and logsumexp copies must have read
          # their buffers.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        with _region("epilogue"):
          rows = pl.ds(q_base, block_q)
          _write_output(acc, m, l, o_smem, smem.lse.at[wg],
                        out_ref.at[b, rows, head], lse_ref.at[b, head, rows])
        return first_step + count, next_head

      def consumer():
        if prefetch_q:
          first_k, first_where = item_at(0)
          pl.when(first_k < items.num_items)(lambda: load_q(*first_where))
        # Both consumers take the same items and, per step of an item,
        # wait for the turn once and then pass it once.  The first passes
        # once before its first item and the second waits once after its
        # last, so that every wait has its pass and each consumer arrives
        # and waits strictly alternately: a consumer's next arrival always
        # follows the other's completed wait.  (Two arrivals of one
        # consumer before the other's wait would complete the 256-thread
        # barrier without it, and the consumers would deadlock.)
        pl.when(wg == 0)(lambda: common.pass_turn(wg))
        _, (_, first_b, first_block) = item_at(0)
        for_each_item(consume_item,
                      (jnp.int32(0), schedule_head(first_b, first_block)))
        pl.when(wg == 1)(lambda: common.wait_turn(wg))
        plgpu.wait_smem_to_gmem(0)

      def producer():
        produce_item = common.kv_item_producer(
            order_ref, count_ref, group=group, stages=stages,
            block_kv=block_kv, k=(k_ref, smem.k, smem.k_ready, smem.k_free),
            v=(v_ref, smem.v, smem.v_ready, smem.v_free),
            segments=(kv_seg_ref, smem.kv_segments, smem.kv_segments_ready))
        for_each_item(produce_item)

      common.split_warpgroups(wg, consumer, producer)
    return body


def forward_kernel_call(q: Array, k: Array, v: Array, *, kv_order: Array,
                        kv_count: Array, classes: Array, block_order: Array,
                        q_lengths: Array | None, kv_lengths: Array | None,
                        q_segments: Array | None, kv_segments: Array | None,
                        spec: MaskSpec, logits: LogitTransform, block_q: int,
                        block_kv: int, stages: int,
                        qk_after_pv: bool = False,
                        q_pad: int | None = None,
                        kv_pad: int | None = None,
                        offsets: Array | None = None) -> tuple[Array, Array]:
  """Runs the forward kernel on padded inputs.

  Args:
    q: ``[B, Tp, N, Hp]`` with ``Tp`` a multiple of ``2 * block_q`` and
      ``Hp`` in (64, 128, 256).
    k, v: ``[B, Sp, K, Hp]`` with ``Sp`` a multiple of ``block_kv``.
    kv_order, kv_count: the tile schedule at ``2 * block_q`` rows per query
      block, ``[B, Tp / (2 block_q), Sp / block_kv]`` and ``[B, Tp / (2
      block_q)]``.
    classes: int32 ``[B, Tp / (2 block_q), Sp / block_kv, 2]``: the class of
      the tile visited at each step of ``kv_order`` for each consumer's
      ``block_q`` rows (read once per step, with no dependent lookup).
    block_order: int32 ``[B * Tp / (2 block_q)]``, the order in which CTAs
      take query blocks
      (:func:`~jflash.backends.mosaic_gpu.schedule.heaviest_first` of
      ``kv_count``).
    q_lengths, kv_lengths: int32 ``[B]`` or None.
    q_segments, kv_segments: int32 ``[B, Tp]`` / ``[B, Sp]`` or None.
    offsets: int32 ``[2]``, the global positions of local query 0 and key
      0, exactly when ``spec.has_offsets``; else None.
    qk_after_pv: issue each step's next ``Q K^T``
      right behind its ``P V`` within the turn and wait for both together,
      instead of after ``P V`` has finished.
    q_pad, kv_pad: the tiled query and key extents (multiples of the
      tiles), when the arrays are shorter: their tail tiles are then read
      through TMA's zero fill and written only within the arrays.  Default:
      the arrays' lengths.

  Returns:
    ``out`` shaped as ``q`` and the natural-log logsumexp ``[B, N, Tp]``
    float32 (``-inf`` for rows that see no key; their output is zero).
  """
  batch, q_rows, num_heads, head_dim = q.shape
  q_pad = q_pad or q_rows
  del kv_pad  # the schedule's tiles cover the keys
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  dtype = q.dtype
  num_q_blocks = q_pad // (2 * block_q)

  optional = dict(q_lengths=q_lengths, kv_lengths=kv_lengths,
                  q_segments=q_segments, kv_segments=kv_segments,
                  offsets=offsets)
  optional_names = [n for n, x in optional.items() if x is not None]

  items = common.PersistentItems.over(num_heads, batch, num_q_blocks)
  # With room for an output buffer apart from Q, the next item's Q is
  # loaded while this item's output is normalized and stored; without (head
  # dim 256), the output leaves through Q's buffer.
  segments = spec.has_segments
  with_output_buffer = _forward_smem_bytes(
      block_q, block_kv, stages, head_dim, dtype, segments,
      output_columns=head_dim)
  prefetch_q = with_output_buffer <= common.SMEM_LIMIT_BYTES

  kernel = _ForwardKernel(
      spec=spec, logits=logits, items=items,
      optional_names=tuple(optional_names), block_q=block_q,
      block_kv=block_kv, stages=stages, head_dim=head_dim, dtype=dtype,
      group=group, prefetch_q=prefetch_q, qk_after_pv=qk_after_pv)
  out, lse = common.warp_specialized_kernel(
      kernel.setup,
      (q, k, v, kv_order, kv_count, classes, block_order,
       *(optional[n] for n in optional_names)),
      scratch=_forward_scratch(block_q, block_kv, stages, head_dim, dtype,
                               segments=segments, output_buffer=prefetch_q),
      out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                jax.ShapeDtypeStruct((batch, num_heads, q_pad), jnp.float32)),
      grid=(items.num_ctas,), grid_names=("ctas",),
      kernel_name="jflash_forward")
  return out, lse


def _forward_smem_bytes(block_q: int, block_kv: int, stages: int,
                        head_dim: int, dtype, segments: bool, *,
                        output_columns: int) -> int:
  """Shared memory the forward's buffers take (barriers excluded), with
  ``output_columns`` of an output buffer apart from Q per consumer (0: the
  output leaves through Q's buffer)."""
  size = jnp.dtype(dtype).itemsize
  q_tiles = 2 * block_q * head_dim * size
  ring = stages * block_kv * head_dim * size
  return common.smem_bytes(
      q_tiles, 2 * block_q * output_columns * size,  # Q, and O apart
      ring, ring,  # K, V
      2 * block_q * 4,  # logsumexp
      2 * block_q * 4 if segments else 0,  # query segment ids
      stages * block_kv * 4 if segments else 0)  # key segment ids


# How far (base 2) a row's maximum may rise above the reference it was
# exponentiated against before the forward moves the reference and
# rescales O and the row sums: probabilities stay below 2 ** 8, and most
# steps after the first few leave O alone.
RESCALE_SLACK = 8.0


def _exponentials(qk: Array, m: Array, *, full, masked,
                  logits: LogitTransform) -> tuple[Array, Array, Array]:
  """One online-softmax step from the raw products ``qk`` (``masked``
  applied unless ``full``): the float32 probabilities relative to the new
  row reference maximum (:func:`_reference`), that reference, and the
  factor rescaling earlier sums to it."""
  tile = qk.shape
  factor = logits.linear_factor
  if factor is None:
    s = lax.cond(full, lambda s: s, masked, logits(qk))
    m_new = _reference(m, s.max(axis=1))
    p = jnp.exp2(s - broadcast_rows(m_new, tile))
  else:  # the maximum of the raw products; one FMA per exponent
    qk = lax.cond(full, lambda s: s, masked, qk)
    m_new = _reference(m, qk.max(axis=1) * factor)
    p = jnp.exp2(qk * factor - broadcast_rows(m_new, tile))
  rescale = jnp.exp2(m - m_new)
  # Exactly 1 where the reference stayed: O is then left alone, and the
  # row sums must not drift from it by the exponential's rounding.
  rescale = jnp.where(m_new > m, rescale, 1.0)
  return p, m_new, rescale


def _reference(m: Array, tile_max: Array) -> Array:
  """The rows' new reference maximum: the current reference, moved to the
  tile's maximum only when that exceeds it by more than
  :data:`RESCALE_SLACK`."""
  return jnp.where(tile_max > m + RESCALE_SLACK, tile_max, m)
