"""Hopper backward in one pass: dK, dV and dQ from the dK/dV loop.

The two-pass backward (:mod:`~jflash.backends.mosaic_gpu.backward_dkv`) does
seven tile products per visited tile, because its dQ pass recomputes ``S``
and ``dP``.  This kernel does the five of the FlashAttention convention:
the dK/dV loop also forms each step's dQ contribution ``dS K`` and adds it
into a float32 dQ accumulator in global memory.  The adds stay
deterministic because their order is fixed: for every (batch row, head,
query tile) a global semaphore counts the adds done so far, and the CTA of
key block ``j`` adds only once the count equals its rank, the number of
key blocks before ``j`` that visit that tile.  The first contributor stores
instead of adding, so the accumulator needs no zero fill; query tiles that
no key block visits are zeroed by the caller.  With ``slots > 1`` there
are that many accumulators: key block ``j`` adds into accumulator
``j % slots`` and waits only for the earlier key blocks of that
accumulator, so that ``slots`` key blocks can add to a tile at once; the
caller sums the accumulators in a fixed order.

One CTA per (key/value head, ``2 * block_kv`` keys, batch row), three
warpgroups, as in FlashAttention-3's backward:

* two consumers, each holding dK and dV of its ``block_kv`` keys in
  registers, as in the two-pass dK/dV kernel.  Each also writes its ``dS``
  tile to shared memory; at step ``i`` consumer ``i % 2`` multiplies both
  ``dS`` tiles by both K tiles into the CTA's dQ contribution and stages it
  in shared memory;
* a third warpgroup with the producer's small register budget: its first
  warp streams Q, dO and the row statistics; its second warp is the writer
  that, for each staged contribution, waits for its turn on the tile's
  semaphore and adds it with a TMA reduction.  The writer releases the
  staging buffer as soon as the copy has read it, and signals the next
  contributor once the add has reached global memory (checked one step
  later, so that adds overlap).  Three warpgroups rather than four leave
  the consumers the same registers as in the two-pass kernels.

Where shared memory allows (head dims up to 128 without segment ids at the
default tiles), each consumer stages its contributions in its own buffer,
and waits only for the writer to have read its previous one, two steps
earlier; the other consumer does not wait at all.  With one buffer both
consumers wait every step for the writer to have read the previous step's
contribution, which ties them to the writer's semaphore wait and copy.

Ordering needs CTAs to start in grid order (key block ``j`` after every
block before it, for the same batch row and head), which is how Hopper
dispatches a grid; a CTA only ever waits for CTAs that started before it.
Each CTA visits its query tiles in decreasing order, so that under a
causal mask every key block starts on the last query tile and the
contributors to a tile arrive one right after another, rather than key
block ``j`` waiting for block 0 to reach tile ``j``.
Head dims up to 128 (dK, dV and the dQ contribution do not all fit in a
consumer's registers at 256).
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
from jflash.backends.mosaic_gpu.backward_common import (
    QueryRing, optional_inputs, query_ring_bytes, query_ring_scratch,
    score_gradient)
from jflash.backends.mosaic_gpu.common import (ROW, LogitTransform, MaskSpec,
                                               broadcast_rows)

Array = jax.Array



@common.scratch_dataclass
class _Scratch:
  """The fused backward's shared-memory buffers; None where a call needs
  none."""

  k: Any  # [2, block_kv, H]: each consumer's keys
  v: Any  # [2, block_kv, H]: their values
  kv_segments: Any  # [2, block_kv] int32
  kv_ready: Any  # 6: per consumer K, V, segment ids
  ring: QueryRing  # the streamed query tiles
  ds: Any  # [2, 2, block_kv, block_q]: dS per turn and consumer
  dq: Any  # [stagings, block_q, H] float32: dQ contributions on their way
  ds_ready: Any  # per turn, both consumers arrive
  ds_free: Any  # per turn
  dq_ready: Any  # per staging buffer
  dq_free: Any


@dataclasses.dataclass(frozen=True)
class _FusedKernel:
  """The fused backward's static parameters (see
  :func:`fused_backward_call`); :meth:`setup` is its kernel for
  :func:`common.warp_specialized_kernel`."""

  spec: MaskSpec
  logits: LogitTransform
  names: tuple[str, ...]  # the optional inputs present, in order
  block_q: int
  block_kv: int
  stages: int
  head_dim: int
  dtype: Any
  group: int  # query heads per K/V head
  batch: int
  num_heads: int
  num_q_tiles: int
  slots: int
  overlap_sdp: bool
  stagings: int  # dQ staging buffers: one per consumer, or one for both

  def staging_of(self, i):
    return lax.rem(i, common.i32(2)) if self.stagings == 2 else 0

  def products(self, smem: _Scratch, slot, *, k_smem, v_smem, full, mask,
               dk, dv, wait_ds_slot, stage_ds):
    """A step's dV and dK products from ring slot ``slot``, added to ``dv``
    and ``dk``, its dS handed to ``stage_ds`` once ``wait_ds_slot()`` has
    waited for its slot."""
    logits, dtype, tile = self.logits, self.dtype, (self.block_kv,
                                                    self.block_q)
    overlap_sdp = self.overlap_sdp
    if logits.soft_cap is not None and not overlap_sdp:
      # dV's product first, as in the two-pass dK/dV kernel.
      p, derivative = smem.ring.probabilities(
          slot, k_smem=k_smem, tile=tile, logits=logits, full=full,
          mask=mask)
      wait_ds_slot()
      dv, dk = smem.ring.dv_first_products(
          slot, p, derivative, v_smem=v_smem, tile=tile, dtype=dtype,
          dv=dv, dk=dk, ds_sink=stage_ds)
    else:
      p, derivative, dp, delta = smem.ring.scores(
          slot, k_smem=k_smem, v_smem=v_smem, tile=tile, logits=logits,
          full=full, mask=mask, want_dp=True, together=overlap_sdp)
      ds = score_gradient(p, dp, delta, derivative)
      wait_ds_slot()

      def dv_dk_products(refs):
        dv_ref, dk_ref = refs
        plgpu.wgmma(dv_ref, p.astype(dtype), smem.ring.do.at[slot])
        ds_low = ds.astype(dtype)
        stage_ds(ds_low)
        plgpu.wgmma(dk_ref, ds_low, smem.ring.q.at[slot])
      dv, dk = pl.run_state(dv_dk_products)(
          (plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
    return dk, dv

  def dq_contribution(self, smem: _Scratch, wg, turn, zero, i) -> None:
    """On the consumer whose turn it is: step ``i``'s dQ contribution, both
    dS tiles times both K tiles, staged for the writer."""
    block_q, head_dim, stagings = self.block_q, self.head_dim, self.stagings

    @pl.when(wg == turn)
    def _dq_contribution():
      plgpu.barrier_wait(smem.ds_ready.at[turn])

      def dq_product(acc_ref):
        for w in range(2):
          plgpu.wgmma(acc_ref, smem.ds.at[turn, w].transpose((1, 0)),
                      smem.k.at[w + zero])
        return acc_ref[...]
      contribution = pl.run_scoped(
          dq_product, plgpu.ACC((block_q, head_dim), jnp.float32))
      plgpu.barrier_arrive(smem.ds_free.at[turn])
      staging = self.staging_of(i)
      if stagings == 2:
        # This consumer's own buffer, last filled two steps ago: only
        # it waits for the writer to have read it.
        @pl.when(i >= 2)
        def _():
          plgpu.barrier_wait(smem.dq_free.at[staging])
      smem.dq.at[staging][...] = contribution
      plgpu.commit_smem()
      plgpu.barrier_arrive(smem.dq_ready.at[staging])

  def write_dq(self, smem: _Scratch, *, steps, count, head_and_tile, turns,
               acc_row, rank_ref, dq_ref, b, kv_block) -> None:
    """The writer: adds the staged contributions in rank order."""
    block_q, num_heads = self.block_q, self.num_heads
    num_q_tiles, staging_of = self.num_q_tiles, self.staging_of

    def turn_of(i):
      head, q_tile = head_and_tile(i)
      return turns.at[(acc_row * num_heads + head) * num_q_tiles
                      + q_tile]

    @pl.loop(0, steps)
    def _add(i):
      head, q_tile = head_and_tile(i)
      rank = rank_ref[b, kv_block, lax.rem(i, count)]
      target = dq_ref.at[acc_row, pl.ds(q_tile * block_q, block_q), head]
      staging = staging_of(i)
      plgpu.barrier_wait(smem.dq_ready.at[staging])
      plgpu.semaphore_wait(turn_of(i), rank, decrement=False,
                           memory_scope="gpu")

      @pl.when(rank == 0)
      def _():
        plgpu.copy_smem_to_gmem(smem.dq.at[staging], target)

      @pl.when(rank > 0)
      def _():
        plgpu.copy_smem_to_gmem(smem.dq.at[staging], target,
                                reduction_op="add")
      # The staging buffer is free once read; the consumers go on while
      # the add travels to global memory.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.barrier_arrive(smem.dq_free.at[staging])

      # The previous step's add is complete once at most this one is in
      # flight: only then may the next key block add to its tile.
      @pl.when(i > 0)
      def _():
        plgpu.wait_smem_to_gmem(1)
        plgpu.semaphore_signal(turn_of(i - 1), 1, memory_scope="gpu")

    @pl.when(steps > 0)
    def _():
      plgpu.wait_smem_to_gmem(0)
      plgpu.semaphore_signal(turn_of(steps - 1), 1, memory_scope="gpu")

  def setup(self, q_ref, k_ref, v_ref, do_ref, stats_ref, order_ref,
            count_ref, class_ref, rank_ref, *rest):
    """The kernel on its global-memory refs (the inputs, the optional
    inputs present, then ``dq_sums``, ``dk`` and ``dv``): returns the body
    that runs on the scratch buffers."""
    spec, logits, names = self.spec, self.logits, self.names
    block_q, block_kv, stages = self.block_q, self.block_kv, self.stages
    head_dim, dtype, group = self.head_dim, self.dtype, self.group
    batch, num_heads, slots = self.batch, self.num_heads, self.slots
    num_q_tiles, stagings = self.num_q_tiles, self.stagings
    tile = (block_kv, block_q)  # transposed: keys are the rows here
    named = dict(zip(names, rest[:len(names)]))
    dq_ref, dk_ref, dv_ref = rest[len(names):]
    b = lax.axis_index("batch")
    kv_head = lax.axis_index("heads")
    kv_block = lax.axis_index("kv_seq")
    wg = lax.axis_index("wg")
    count, tile_at = common.schedule_row(order_ref, count_ref, b, kv_block)
    steps = count * group
    q_length = common.scalar_or_none(named.get("q_lengths"), b)
    kv_length = common.scalar_or_none(named.get("kv_lengths"), b)
    q_offset, kv_offset = common.offsets_of(named.get("offsets"))
    q_seg_ref, kv_seg_ref = named.get("q_segments"), named.get("kv_segments")
    # This key block's accumulator, as a row of the flattened [slots * B].
    acc_row = lax.rem(kv_block, common.i32(slots)) * batch + b
    turns = pl.get_global(plgpu.SemaphoreType.REGULAR(
        (slots * batch * num_heads * num_q_tiles,)))

    def head_and_tile(i):
      # Step i visits query head kv_head * group + i // count, tile i % count.
      return kv_head * group + lax.div(i, count), tile_at(lax.rem(i, count))

    def body(smem: _Scratch):

      def consumer():
        kv_base = (kv_block * 2 + wg) * block_kv
        rows = pl.ds(kv_base, block_kv)
        k_smem, v_smem = smem.k.at[wg], smem.v.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head], k_smem,
                                smem.kv_ready.at[3 * wg])
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head], v_smem,
                                smem.kv_ready.at[3 * wg + 1])
        kv_seg = None
        if kv_seg_ref is not None:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, rows],
                                  smem.kv_segments.at[wg],
                                  smem.kv_ready.at[3 * wg + 2])
          plgpu.barrier_wait(smem.kv_ready.at[3 * wg + 2])
          kv_seg = broadcast_rows(
              plgpu.load(smem.kv_segments.at[wg], layout=ROW), tile)
        plgpu.barrier_wait(smem.kv_ready.at[3 * wg])
        plgpu.barrier_wait(smem.kv_ready.at[3 * wg + 1])
        # The dQ products read both consumers' K tiles.
        plgpu.barrier_wait(smem.kv_ready.at[3 * (1 - wg)])

        def step(i, carry):
          (dk, dv), step_class = carry
          # The next step's class, read a step early: its load's latency
          # would otherwise stall the step's start (the slot below depends
          # on it).
          next_class = class_ref[b, kv_block, lax.rem(i + 1, count), wg]
          full = step_class == tiles.FULL
          zero = common.loop_variant_zero(step_class)
          slot = lax.rem(i, common.i32(stages)) + zero
          k_smem, v_smem = smem.k.at[wg + zero], smem.v.at[wg + zero]
          # dS slot, and the consumer that forms this step's dQ product.
          turn = lax.rem(i, common.i32(2))

          def mask(s, q_seg):
            _, q_tile = head_and_tile(i)
            return spec.mask_tile(s, row_start=kv_base + zero, col_tile=q_tile,
                                  col_block=block_q, rows_are_queries=False,
                                  q_length=q_length, kv_length=kv_length,
                                  q_seg=q_seg, kv_seg=kv_seg,
                                  q_offset=q_offset, kv_offset=kv_offset)
          def wait_ds_slot():
            # The dS slot is free once the dQ product of step i - 2 read it.
            @pl.when(i >= 2)
            def _():
              plgpu.barrier_wait(smem.ds_free.at[turn])

          def stage_ds(ds_low):
            smem.ds.at[turn, wg][...] = ds_low

          dk, dv = self.products(
              smem, slot, k_smem=k_smem, v_smem=v_smem, full=full, mask=mask,
              dk=dk, dv=dv, wait_ds_slot=wait_ds_slot, stage_ds=stage_ds)
          plgpu.commit_smem()
          plgpu.barrier_arrive(smem.ds_ready.at[turn])
          plgpu.barrier_arrive(smem.ring.do_free.at[slot])
          plgpu.barrier_arrive(smem.ring.q_free.at[slot])

          if stagings == 1:
            # Both consumers wait for the writer to release the staging
            # buffer, so that each sees every phase of the barrier.
            @pl.when(i >= 1)
            def _():
              plgpu.barrier_wait(smem.dq_free.at[0])

          self.dq_contribution(smem, wg, turn, zero, i)
          return (dk, dv), next_class

        zeros = lambda: plgpu.layout_cast(  # noqa: E731
            jnp.zeros((block_kv, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        (dk, dv), _ = lax.fori_loop(0, steps, step, (
            (zeros(), zeros()), class_ref[b, kv_block, 0, wg]))

        # The last dQ products read both K tiles: wait for them before K's
        # buffer takes dK.
        for back in (1, 2):
          @pl.when(steps >= back)
          def _():
            plgpu.barrier_wait(
                smem.ds_free.at[lax.rem(steps - back, common.i32(2))])
        k_smem[...] = (dk * logits.scale).astype(dtype)
        v_smem[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, rows, kv_head])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, rows, kv_head])
        # Only the copies' reads of shared memory must finish before the
        # CTA leaves; their writes land by the end of the kernel.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      def write_dq():
        self.write_dq(smem, steps=steps, count=count,
                      head_and_tile=head_and_tile, turns=turns,
                      acc_row=acc_row, rank_ref=rank_ref, dq_ref=dq_ref, b=b,
                      kv_block=kv_block)

      def producer_and_writer():

        @plgpu.warp_map
        def _per_warp(warp):
          @pl.when(warp == 0)
          def _():
            smem.ring.stream(steps, head_and_tile, stages=stages,
                             block_q=block_q, b=b, q_ref=q_ref, do_ref=do_ref,
                             stats_ref=stats_ref, q_seg_ref=q_seg_ref)

          pl.when(warp == 1)(write_dq)

      common.split_warpgroups(wg, consumer, producer_and_writer)
    return body


def fused_backward_call(q: Array, k: Array, v: Array, do: Array,
                        stats: Array, *, q_order: Array, q_count: Array,
                        classes: Array, ranks: Array,
                        q_lengths: Array | None, kv_lengths: Array | None,
                        q_segments: Array | None, kv_segments: Array | None,
                        spec: MaskSpec, logits: LogitTransform, block_q: int,
                        block_kv: int, stages: int,
                        slots: int = 1,
                        overlap_sdp: bool = False,
                        q_pad: int | None = None,
                        kv_pad: int | None = None,
                        offsets: Array | None = None
                        ) -> tuple[Array, Array, Array]:
  """dQ (unscaled, float32), dK and dV on padded inputs.

  Args:
    q, do: ``[B, Tp, N, Hp]``; k, v: ``[B, Sp, K, Hp]``, ``Hp`` 64 or 128.
    stats: float32 ``[B, N, 2, Tp]``: base-2 logsumexp (``+inf`` for rows
      that see nothing) and ``delta``.
    q_order, q_count, classes: the dK/dV schedule at ``2 * block_kv`` keys
      per CTA, as for
      :func:`~jflash.backends.mosaic_gpu.backward_dkv.dkv_kernel_call`.
    ranks: int32 ``[B, Sp / (2 block_kv), Tp / block_q]``: at each step of
      ``q_order``, how many key blocks before this one and of the same
      accumulator visit the same query tile
      (:func:`~jflash.backends.mosaic_gpu.schedule.earlier_visitors` with
      ``slots``).
    slots: the number of dQ accumulators.
    q_pad, kv_pad: the tiled query and key extents (multiples of the
      tiles), when the arrays are shorter: their tail tiles are then read
      through TMA's zero fill and written only within the arrays.  Default:
      the arrays' lengths.
    offsets: int32 ``[2]`` with ``spec.has_offsets``, as for
      :func:`~jflash.backends.mosaic_gpu.forward.forward_kernel_call`.

  Returns:
    ``dq_sums [slots * B, Tp, N, Hp]`` float32, accumulator ``r`` of batch
    row ``b`` at ``r * B + b``: the sum of ``dS K`` over the visiting key
    blocks ``j`` with ``j % slots == r`` (summed over ``r`` and times
    ``scale`` it is dQ; rows of query tiles that no such key block visits
    are left unwritten), and ``dk``, ``dv`` shaped as ``k``, in the input
    dtype.
  """
  batch, q_rows, num_heads, head_dim = q.shape
  q_pad, kv_pad = q_pad or q_rows, kv_pad or k.shape[1]
  num_kv_heads = k.shape[2]
  if head_dim > 128:
    raise ValueError(f"the fused backward serves head dims up to 128, got "
                     f"{head_dim}")
  if slots < 1:
    raise ValueError(f"slots must be at least 1, got {slots}")
  group = num_heads // num_kv_heads
  num_q_tiles = q_pad // block_q
  dtype = q.dtype
  names, extras = optional_inputs(q_lengths=q_lengths, kv_lengths=kv_lengths,
                            q_segments=q_segments, kv_segments=kv_segments,
                            offsets=offsets)
  # One dQ staging buffer per consumer where they fit (step i's
  # contribution comes from consumer i % 2), else one for both.
  stagings = 2 if _fused_smem_bytes(
      block_q, block_kv, stages, head_dim, dtype, spec.has_segments,
      stagings=2) <= common.SMEM_LIMIT_BYTES else 1

  kernel = _FusedKernel(
      spec=spec, logits=logits, names=tuple(names), block_q=block_q,
      block_kv=block_kv, stages=stages, head_dim=head_dim, dtype=dtype,
      group=group, batch=batch, num_heads=num_heads, num_q_tiles=num_q_tiles,
      slots=slots, overlap_sdp=overlap_sdp, stagings=stagings)
  segments = spec.has_segments
  scratch = _Scratch(
      k=common.smem_tile((2, block_kv, head_dim), dtype),
      v=common.smem_tile((2, block_kv, head_dim), dtype),
      kv_segments=plgpu.SMEM((2, block_kv), jnp.int32) if segments else None,
      kv_ready=plgpu.Barrier(num_barriers=6),
      ring=query_ring_scratch(stages, block_q, head_dim, dtype, segments),
      ds=common.smem_tile((2, 2, block_kv, block_q), dtype),
      dq=plgpu.SMEM((stagings, block_q, head_dim), jnp.float32,
                    transforms=(common.F32_TILING, common.SWIZZLE)),
      ds_ready=plgpu.Barrier(num_arrivals=2, num_barriers=2),
      ds_free=plgpu.Barrier(num_barriers=2),
      dq_ready=plgpu.Barrier(num_barriers=stagings),
      dq_free=plgpu.Barrier(num_barriers=stagings))
  kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
  dq_type = jax.ShapeDtypeStruct((slots * batch, q_pad) + q.shape[2:],
                                 jnp.float32)
  return common.warp_specialized_kernel(
      kernel.setup,
      (q, k, v, do, stats, q_order, q_count, classes, ranks, *extras),
      scratch=scratch, out_type=(dq_type, kv_type, kv_type),
      grid=(num_kv_heads, kv_pad // (2 * block_kv), batch),
      grid_names=("heads", "kv_seq", "batch"),
      kernel_name="jflash_fused_backward")


def _fused_smem_bytes(block_q: int, block_kv: int, stages: int,
                      head_dim: int, dtype, segments: bool, *,
                      stagings: int) -> int:
  """Shared memory the fused backward's buffers take (barriers excluded)."""
  size = jnp.dtype(dtype).itemsize
  keys = 2 * block_kv * head_dim * size  # of both consumers
  return common.smem_bytes(
      keys, keys,  # K, V
      2 * block_kv * 4 if segments else 0,  # key segment ids
      *query_ring_bytes(stages, block_q, head_dim, dtype, segments),
      2 * 2 * block_kv * block_q * size,  # dS tiles
      stagings * block_q * head_dim * 4)  # dQ staging
