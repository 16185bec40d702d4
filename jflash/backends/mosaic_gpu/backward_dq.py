"""Hopper dQ kernel: the backward pass over query rows, with no atomics.

A persistent kernel like the forward: one CTA per SM loops over items
(head, ``2 * block_q`` query rows of a batch row) dealt as
:class:`~jflash.backends.mosaic_gpu.common.PersistentItems` says.  Two
consumer warpgroups keep ``dQ`` of their rows in registers while a producer
streams the row block's nonempty K/V tiles through a ring that runs on from
one item into the next; each step recomputes ``P`` from the saved
logsumexp, forms ``dS = P * (dO V^T - delta)`` and adds ``dS K`` (see
:mod:`~jflash.backends.mosaic_gpu.backward_common`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jflash import tiles
from jflash.backends.mosaic_gpu import common
from jflash.backends.mosaic_gpu.backward_common import (
    optional_inputs, probabilities, score_gradient)
from jflash.backends.mosaic_gpu.common import (
    COL, ROW, LogitTransform, MaskSpec, broadcast_cols, broadcast_rows)

Array = jax.Array


@common.scratch_dataclass
class _Scratch:
  """The dQ kernel's shared-memory buffers; None where a call needs none."""

  q: Any  # [2, block_q, H]: each consumer's Q rows
  do: Any  # [2, block_q, H]: each consumer's dO rows
  out: Any  # [2, block_q, H]: each consumer's dQ; None: through q
  stats: Any  # [2, 2, block_q] float32: base-2 logsumexp and delta
  q_segments: Any  # [2, block_q] int32
  k: Any  # [stages, block_kv, H]: the K ring
  v: Any  # [stages, block_kv, H]: the V ring
  kv_segments: Any  # [stages, block_kv] int32
  q_ready: Any  # 8: per consumer Q, dO, statistics, segment ids
  k_ready: Any  # per ring slot
  v_ready: Any
  kv_segments_ready: Any
  k_free: Any  # per ring slot, both consumers arrive
  v_free: Any


@dataclasses.dataclass(frozen=True)
class _DqKernel:
  """The dQ kernel's static parameters (see :func:`dq_kernel_call`);
  :meth:`setup` is its kernel for :func:`common.warp_specialized_kernel`."""

  spec: MaskSpec
  logits: LogitTransform
  items: common.PersistentItems
  names: tuple[str, ...]  # the optional inputs present, in order
  block_q: int
  block_kv: int
  stages: int
  head_dim: int
  dtype: Any
  group: int  # query heads per K/V head
  overlap_sdp: bool
  dp_first: bool  # V streams first and dP is formed before S
  separate_output: bool  # an output buffer apart from Q

  def load_rows(self, smem: _Scratch, wg, q_ref, do_ref, stats_ref,
                q_seg_ref, head, b, q_block) -> None:
    """Starts the copies of this consumer's rows of an item: Q, dO, the
    row statistics and the segment ids."""
    block_q = self.block_q
    rows = pl.ds((q_block * 2 + wg) * block_q, block_q)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], smem.q.at[wg],
                            smem.q_ready.at[4 * wg])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, head], smem.do.at[wg],
                            smem.q_ready.at[4 * wg + 1])
    plgpu.copy_gmem_to_smem(stats_ref.at[b, head, :, rows],
                            smem.stats.at[wg], smem.q_ready.at[4 * wg + 2])
    if q_seg_ref is not None:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], smem.q_segments.at[wg],
                              smem.q_ready.at[4 * wg + 3])

  def scores(self, smem: _Scratch, slot, *, q_smem, do_smem, full, masked,
             lse2, dp_then_free_v, dp):
    """A step's ``P`` (and the soft cap's derivative, unless folded into
    ``P``) from ``Q K^T`` at ring slot ``slot``, and ``dP = dO V^T`` (given
    as ``dp`` when it came first)."""
    logits, tile = self.logits, (self.block_q, self.block_kv)
    overlap_sdp, dp_first = self.overlap_sdp, self.dp_first

    def s_product(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, smem.k.at[slot].transpose((1, 0)))

    if overlap_sdp and not dp_first:
      # Both products issued at once; P is formed while dP is
      # computed.  (With one K/V buffer dP already comes first.)
      plgpu.barrier_wait(smem.v_ready.at[slot])

      def products(s_ref, dp_ref):
        s_product(s_ref)
        plgpu.wgmma(dp_ref, do_smem, smem.v.at[slot].transpose((1, 0)))
        p, derivative = probabilities(
            plgpu.wgmma_accumulator_load(s_ref, wait_n=1), logits,
            full, masked, lse2)
        return p, derivative, dp_ref[...]
      p, derivative, dp = pl.run_scoped(
          products, plgpu.ACC(tile, jnp.float32),
          plgpu.ACC(tile, jnp.float32))
      plgpu.barrier_arrive(smem.v_free.at[slot])
    else:
      def qk_product(acc_ref):
        s_product(acc_ref)
        return acc_ref[...]
      qk = pl.run_scoped(qk_product, plgpu.ACC(tile, jnp.float32))
      p, derivative = probabilities(qk, logits, full, masked, lse2)
      if derivative is not None:
        # Only dS reads P here: fold the soft cap's derivative in
        # before dP's tile becomes live (offline ptxas: 96 bytes of
        # spill stores at head dim 64 otherwise).
        p, derivative = p * derivative, None
      if not dp_first:
        dp = dp_then_free_v()
    return p, derivative, dp

  def setup(self, q_ref, k_ref, v_ref, do_ref, stats_ref, order_ref,
            count_ref, class_ref, block_order_ref, *rest):
    """The kernel on its global-memory refs (the inputs, the optional
    inputs present, then ``dq``): returns the body that runs on the scratch
    buffers."""
    spec, logits, items, names = self.spec, self.logits, self.items, self.names
    block_q, block_kv, stages = self.block_q, self.block_kv, self.stages
    head_dim, dtype, group = self.head_dim, self.dtype, self.group
    dp_first, separate_output = self.dp_first, self.separate_output
    tile = (block_q, block_kv)
    named = dict(zip(names, rest[:len(names)]))
    (dq_ref,) = rest[len(names):]
    cta = lax.axis_index("ctas")
    wg = lax.axis_index("wg")
    q_seg_ref, kv_seg_ref = named.get("q_segments"), named.get("kv_segments")

    def body(smem: _Scratch):

      load_rows = functools.partial(self.load_rows, smem, wg, q_ref, do_ref,
                                    stats_ref, q_seg_ref)

      def consume_item(head, b, q_block, first_step, next_item):
        """One consumer's dQ rows of an item whose first K/V tile sits at
        ring step ``first_step``; returns the next item's first step."""
        count, tile_at = common.schedule_row(order_ref, count_ref, b, q_block)
        q_length = common.scalar_or_none(named.get("q_lengths"), b)
        kv_length = common.scalar_or_none(named.get("kv_lengths"), b)
        q_offset, kv_offset = common.offsets_of(named.get("offsets"))
        q_base = (q_block * 2 + wg) * block_q
        rows = pl.ds(q_base, block_q)
        if not separate_output:
          # The previous item's dQ left through Q's buffer: reuse it once
          # the copy has read it.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          load_rows(head, b, q_block)
        q_seg = None
        if q_seg_ref is not None:
          plgpu.barrier_wait(smem.q_ready.at[4 * wg + 3])
          q_seg = broadcast_rows(plgpu.load(smem.q_segments.at[wg], layout=ROW),
                                 tile)
        for j in range(3):
          plgpu.barrier_wait(smem.q_ready.at[4 * wg + j])
        lse2 = broadcast_rows(
            plgpu.load(smem.stats.at[wg, 0], layout=ROW), tile)
        delta = broadcast_rows(
            plgpu.load(smem.stats.at[wg, 1], layout=ROW), tile)

        def step_info(i):
          """Step ``i``'s tile class and key tile, read a step early: the
          class's load would otherwise stall the step's start (the slot
          below depends on it), the tile's a masked step's softmax."""
          i = jnp.maximum(jnp.minimum(i, count - 1), 0)  # in bounds
          return class_ref[b, q_block, i, wg], tile_at(i)

        def step(i, carry):
          dq, (step_class, kv_tile) = carry
          following = step_info(i + 1)
          full = step_class == tiles.FULL
          zero = common.loop_variant_zero(step_class)
          slot = lax.rem(first_step + i, common.i32(stages)) + zero
          q_smem, do_smem = smem.q.at[wg + zero], smem.do.at[wg + zero]

          def dp_product(acc_ref):
            plgpu.wgmma(acc_ref, do_smem, smem.v.at[slot].transpose((1, 0)))
            return acc_ref[...]

          def dp_then_free_v():
            plgpu.barrier_wait(smem.v_ready.at[slot])
            dp = pl.run_scoped(dp_product, plgpu.ACC(tile, jnp.float32))
            plgpu.barrier_arrive(smem.v_free.at[slot])
            return dp

          # Key segment ids ride with the first stream (V when dP comes
          # first, else K) and must be read before that slot is released,
          # or the producer may overwrite them with the next round's.  K's
          # slot is released at the end of the step, so with K only a
          # masked tile reads them; V's is released after dP, before the
          # softmax, so with V every step reads them first.
          kv_seg_cols = None
          if kv_seg_ref is not None:
            plgpu.barrier_wait(smem.kv_segments_ready.at[slot])
            if dp_first:
              kv_seg_cols = plgpu.load(smem.kv_segments.at[slot], layout=COL)
          dp = None
          if dp_first:
            dp = dp_then_free_v()
          plgpu.barrier_wait(smem.k_ready.at[slot])

          def masked(s):
            kv_seg = None
            if kv_seg_ref is not None:
              cols = kv_seg_cols if dp_first else plgpu.load(
                  smem.kv_segments.at[slot], layout=COL)
              kv_seg = broadcast_cols(cols, tile)
            return spec.mask_tile(s, row_start=q_base + zero,
                                  col_tile=kv_tile,
                                  col_block=block_kv, rows_are_queries=True,
                                  q_length=q_length, kv_length=kv_length,
                                  q_seg=q_seg, kv_seg=kv_seg,
                                  q_offset=q_offset, kv_offset=kv_offset)

          p, derivative, dp = self.scores(
              smem, slot, q_smem=q_smem, do_smem=do_smem, full=full,
              masked=masked, lse2=lse2, dp_then_free_v=dp_then_free_v, dp=dp)
          ds = score_gradient(p, dp, delta, derivative)

          def dq_product(acc_ref):
            plgpu.wgmma(acc_ref, ds.astype(dtype), smem.k.at[slot])
          dq = pl.run_state(dq_product)(plgpu.ACC.init(dq))
          plgpu.barrier_arrive(smem.k_free.at[slot])
          return dq, following

        dq = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32),
                               plgpu.Layout.WGMMA)
        dq, _ = lax.fori_loop(0, count, step, (dq, step_info(0)))
        if separate_output:
          # Q, dO and the statistics are no longer read: the next item's
          # take their buffers while this dQ is written.
          next_exists, next_where = next_item
          pl.when(next_exists)(lambda: load_rows(*next_where))
          # The previous item's dQ copy must have read its buffer.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        # Without an output buffer dQ leaves through Q's.
        out_smem = (smem.q if smem.out is None else smem.out).at[wg]
        out_smem[...] = (dq * logits.scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, dq_ref.at[b, rows, head])
        return first_step + count

      def consumer():
        if separate_output:
          first_k, first_where = items.item_at(block_order_ref, cta, 0)
          pl.when(first_k < items.num_items)(lambda: load_rows(*first_where))
        items.for_each(block_order_ref, cta, consume_item)
        # The copies' reads of shared memory must finish before the CTA
        # leaves; their writes land by the end of the kernel.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      def producer():
        produce_item = common.kv_item_producer(
            order_ref, count_ref, group=group, stages=stages,
            block_kv=block_kv, k=(k_ref, smem.k, smem.k_ready, smem.k_free),
            v=(v_ref, smem.v, smem.v_ready, smem.v_free),
            segments=(kv_seg_ref, smem.kv_segments, smem.kv_segments_ready),
            v_first=dp_first)
        items.for_each(block_order_ref, cta, produce_item)

      common.split_warpgroups(wg, consumer, producer)
    return body


def dq_kernel_call(q: Array, k: Array, v: Array, do: Array, stats: Array, *,
                   kv_order: Array, kv_count: Array, classes: Array,
                   block_order: Array,
                   q_lengths: Array | None, kv_lengths: Array | None,
                   q_segments: Array | None, kv_segments: Array | None,
                   spec: MaskSpec, logits: LogitTransform, block_q: int,
                   block_kv: int, stages: int,
                   overlap_sdp: bool = False,
                   q_pad: int | None = None,
                   kv_pad: int | None = None,
                   offsets: Array | None = None) -> Array:
  """dQ on padded inputs (layouts as in
  :func:`~jflash.backends.mosaic_gpu.forward.forward_kernel_call`).

  Args:
    stats: float32 ``[B, N, 2, Tp]``: the base-2 logsumexp (``+inf`` for
      rows that see nothing) and ``delta``.
    kv_order, kv_count: the tile schedule at ``2 * block_q`` rows per query
      block.
    classes: int32 ``[B, Tp / (2 block_q), Sp / block_kv, 2]``: the class of
      the tile visited at each step for each consumer's ``block_q`` rows.
    block_order: int32 ``[B * Tp / (2 block_q)]``, the order in which CTAs
      take query blocks
      (:func:`~jflash.backends.mosaic_gpu.schedule.heaviest_first`).

    q_pad, kv_pad: the tiled query and key extents (multiples of the
      tiles), when the arrays are shorter: their tail tiles are then read
      through TMA's zero fill and written only within the arrays.  Default:
      the arrays' lengths.

  Returns:
    ``dq`` shaped as ``q``, in the input dtype.
  """
  batch, q_rows, num_heads, head_dim = q.shape
  q_pad = q_pad or q_rows
  del kv_pad  # the schedule's tiles cover the keys
  group = num_heads // k.shape[2]
  dtype = q.dtype
  names, extras = optional_inputs(q_lengths=q_lengths, kv_lengths=kv_lengths,
                            q_segments=q_segments, kv_segments=kv_segments,
                            offsets=offsets)

  num_q_blocks = q_pad // (2 * block_q)
  # With one K/V buffer (head dim 256), V is loaded and used first: its next
  # tile then streams in while this step still works on K (S, dS, dQ), and
  # the next K while the next step forms dP, instead of both arriving only
  # after the step has released K.
  dp_first = stages == 1

  items = common.PersistentItems.over(num_heads, batch, num_q_blocks)
  segments = spec.has_segments
  # With room for a separate output buffer, the next item's Q, dO and row
  # statistics load as soon as this item's loop ends, while its dQ is
  # written.
  separate_output = _dq_smem_bytes(
      block_q, block_kv, stages, head_dim, dtype, segments,
      separate_output=True) <= common.SMEM_LIMIT_BYTES

  kernel = _DqKernel(
      spec=spec, logits=logits, items=items, names=tuple(names),
      block_q=block_q, block_kv=block_kv, stages=stages, head_dim=head_dim,
      dtype=dtype, group=group, overlap_sdp=overlap_sdp, dp_first=dp_first,
      separate_output=separate_output)
  rows_tile = common.smem_tile((2, block_q, head_dim), dtype)
  scratch = _Scratch(
      q=rows_tile, do=rows_tile,
      out=rows_tile if separate_output else None,
      stats=plgpu.SMEM((2, 2, block_q), jnp.float32),
      q_segments=plgpu.SMEM((2, block_q), jnp.int32) if segments else None,
      k=common.smem_tile((stages, block_kv, head_dim), dtype),
      v=common.smem_tile((stages, block_kv, head_dim), dtype),
      kv_segments=plgpu.SMEM((stages, block_kv), jnp.int32)
      if segments else None,
      q_ready=plgpu.Barrier(num_barriers=8),
      k_ready=plgpu.Barrier(num_barriers=stages),
      v_ready=plgpu.Barrier(num_barriers=stages),
      kv_segments_ready=plgpu.Barrier(num_barriers=stages)
      if segments else None,
      k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages))
  return common.warp_specialized_kernel(
      kernel.setup,
      (q, k, v, do, stats, kv_order, kv_count, classes, block_order, *extras),
      scratch=scratch, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      grid=(items.num_ctas,), grid_names=("ctas",), kernel_name="jflash_dq")


def _dq_smem_bytes(block_q: int, block_kv: int, stages: int, head_dim: int,
                   dtype, segments: bool, *, separate_output: bool) -> int:
  """Shared memory the dQ kernel's buffers take (barriers excluded)."""
  size = jnp.dtype(dtype).itemsize
  rows = 2 * block_q * head_dim * size
  ring = stages * block_kv * head_dim * size
  return common.smem_bytes(
      rows, rows, rows if separate_output else 0,  # Q, dO, and dQ apart
      2 * 2 * block_q * 4,  # row statistics
      2 * block_q * 4 if segments else 0,  # query segment ids
      ring, ring,  # K, V
      stages * block_kv * 4 if segments else 0)  # key segment ids
