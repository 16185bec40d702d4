"""Hopper dK/dV kernel of the two-pass backward, with no atomics.

A persistent kernel, one CTA per SM looping over items (key/value head,
``2 * block_kv`` keys, batch row) dealt as
:class:`~jflash.backends.mosaic_gpu.common.PersistentItems` says; two
consumer warpgroups keep ``dK`` and ``dV`` of their keys in registers while
the producer streams Q, dO and the row statistics of every query head of
the GQA group over the key block's nonempty query tiles
(:class:`~jflash.backends.mosaic_gpu.backward_common.QueryRing`).  The
query ring runs on from one item into the next, and where shared memory
allows separate output buffers the next item's keys load while this item's
outputs are written.  Summing the group inside one CTA, in a fixed order,
makes the result deterministic without materializing repeated K/V.  At head
dim 256 the two accumulators do not fit in one warpgroup's registers; both
warpgroups then take the same keys, one accumulating dV and the other dK.
The dV warpgroup forms ``P`` and hands it to the dK warpgroup through
shared memory, so that each warpgroup does two of a step's four products.
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
    QueryRing, optional_inputs, query_ring_bytes, query_ring_scratch,
    score_gradient)
from jflash.backends.mosaic_gpu.common import (ROW, LogitTransform, MaskSpec,
                                               broadcast_rows)

Array = jax.Array

# Named regions of the dK/dV kernel: spans in a Mosaic GPU profile (compiler
# params with profile_space, as tools/forward_trace.py --backward sets
# them), and nothing otherwise.
_region = jax.named_scope


@common.scratch_dataclass
class _Scratch:
  """The dK/dV kernel's shared-memory buffers; None where a call needs
  none."""

  k: Any  # [key_buffers, block_kv, H]: each consumer's keys
  v: Any  # [key_buffers, block_kv, H]: their values
  dk: Any  # [key_buffers, block_kv, H]: dK on its way out; None: through k
  dv: Any  # [key_buffers, block_kv, H]: dV on its way out; None: through v
  kv_segments: Any  # [key_buffers, block_kv] int32
  kv_ready: Any  # 6: per key buffer K, V, segment ids
  ring: QueryRing  # the streamed query tiles
  consumers_done: Any  # both consumers arrive (split outputs)
  p: Any  # [block_kv, block_q] float32: P^T from the dV to the dK consumer
  p_ready: Any
  p_free: Any


@dataclasses.dataclass(frozen=True)
class _DkvKernel:
  """The dK/dV kernel's static parameters (see :func:`dkv_kernel_call`);
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
  split_outputs: bool
  overlap_sdp: bool
  separate_outputs: bool  # output buffers apart from K and V

  def item_schedule(self, order_ref, count_ref, kv_head, b, kv_block):
    """Steps of an item and step -> (query head, query tile): step ``i``
    visits query head ``kv_head * group + i // count``, tile
    ``i % count``."""
    count, tile_at = common.schedule_row(order_ref, count_ref, b, kv_block)

    def head_and_tile(i):
      return (kv_head * self.group + lax.div(i, count),
              tile_at(lax.rem(i, count)))
    return count, count * self.group, head_and_tile

  def load_keys(self, smem: _Scratch, k_ref, v_ref, kv_seg_ref, kv_head, b,
                kv_block, buffer) -> None:
    """Starts the copies of keys ``buffer`` of an item (K, V and their
    segment ids)."""
    block_kv = self.block_kv
    keys_per_cta = (1 if self.split_outputs else 2) * block_kv
    rows = pl.ds(kv_block * keys_per_cta + buffer * block_kv, block_kv)
    plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kv_head],
                            smem.k.at[buffer], smem.kv_ready.at[3 * buffer])
    plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kv_head],
                            smem.v.at[buffer],
                            smem.kv_ready.at[3 * buffer + 1])
    if kv_seg_ref is not None:
      plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, rows],
                              smem.kv_segments.at[buffer],
                              smem.kv_ready.at[3 * buffer + 2])

  def step_products(self, smem: _Scratch, slot, *, want_dk: bool,
                    want_dv: bool, k_smem, v_smem, full, mask, dk, dv,
                    first_step, i):
    """One consumer's products of step ``i`` (ring slot ``slot``) for its
    wanted outputs, added to ``dk`` and ``dv``: both in one warpgroup, or
    (``split_outputs``) dV with ``P^T`` handed over in ``smem.p``, or dK
    from the handed-over ``P^T``."""
    logits, dtype, tile = self.logits, self.dtype, (self.block_kv,
                                                    self.block_q)
    overlap_sdp = self.overlap_sdp
    if want_dv and want_dk and logits.soft_cap is not None and not (
        overlap_sdp):
      # With a soft cap, dV's product goes first: the cap's
      # derivative is folded into P while the tensor cores compute
      # dV, so that P and the derivative are no longer both live
      # next to dP's tile (offline ptxas at head dim 128: 136 bytes
      # of spill stores with dP first).
      p, derivative = smem.ring.probabilities(
          slot, k_smem=k_smem, tile=tile, logits=logits, full=full,
          mask=mask)
      dv, dk = smem.ring.dv_first_products(
          slot, p, derivative, v_smem=v_smem, tile=tile, dtype=dtype,
          dv=dv, dk=dk)
    elif want_dv and want_dk:
      p, derivative, dp, delta = smem.ring.scores(
          slot, k_smem=k_smem, v_smem=v_smem, tile=tile, logits=logits,
          full=full, mask=mask, want_dp=True, together=overlap_sdp)

      def dv_dk_products(refs):
        dv_ref, dk_ref = refs
        plgpu.wgmma(dv_ref, p.astype(dtype), smem.ring.do.at[slot])
        # dS while the tensor cores compute dV.
        with _region("ds"):
          ds = score_gradient(p, dp, delta, derivative)
          ds = ds.astype(dtype)
        plgpu.wgmma(dk_ref, ds, smem.ring.q.at[slot])
      with _region("dv_dk"):
        dv, dk = pl.run_state(dv_dk_products)(
            (plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
    elif want_dv:
      p, derivative = smem.ring.probabilities(
          slot, k_smem=k_smem, tile=tile, logits=logits, full=full,
          mask=mask)

      # smem.p is free once the dK warpgroup read the previous step's
      # P^T (of this item or an earlier one).
      @pl.when(first_step + i >= 1)
      def _():
        plgpu.barrier_wait(smem.p_free)
      smem.p[...] = p if derivative is None else p * derivative
      plgpu.barrier_arrive(smem.p_ready)
      plgpu.barrier_wait(smem.ring.do_ready.at[slot])

      def dv_product(acc_ref):
        plgpu.wgmma(acc_ref, p.astype(dtype), smem.ring.do.at[slot])
      dv = pl.run_state(dv_product)(plgpu.ACC.init(dv))
    else:
      plgpu.barrier_wait(smem.ring.stats_ready.at[slot])
      delta = smem.ring.delta(slot, tile)
      plgpu.barrier_wait(smem.ring.do_ready.at[slot])
      dp = smem.ring.dp_product(slot, v_smem=v_smem, tile=tile)
      plgpu.barrier_wait(smem.p_ready)
      # P^T from the dV warpgroup, times the cap's derivative if any.
      p_scaled = smem.p[...]
      plgpu.barrier_arrive(smem.p_free)
      ds = score_gradient(p_scaled, dp, delta, None)
      plgpu.barrier_wait(smem.ring.q_ready.at[slot])

      def dk_product(acc_ref):
        plgpu.wgmma(acc_ref, ds.astype(dtype), smem.ring.q.at[slot])
      dk = pl.run_state(dk_product)(plgpu.ACC.init(dk))
    return dk, dv

  def write_outputs(self, smem: _Scratch, buffer, dk, dv, *, want_dk: bool,
                    want_dv: bool, dk_ref, dv_ref, at) -> None:
    """An item's write-back of the wanted outputs of keys ``buffer``
    (dK scaled back by the logit scale) to ``dk_ref.at[at]`` and
    ``dv_ref.at[at]``."""
    logits, dtype = self.logits, self.dtype
    # Without output buffers the outputs leave through K's and V's.
    dk_out = (smem.k if smem.dk is None else smem.dk).at[buffer]
    dv_out = (smem.v if smem.dv is None else smem.dv).at[buffer]
    written = []
    if want_dk:
      dk_out[...] = (dk * logits.scale).astype(dtype)
      written.append((dk_out, dk_ref))
    if want_dv:
      dv_out[...] = dv.astype(dtype)
      written.append((dv_out, dv_ref))
    plgpu.commit_smem()
    for out_smem, out_ref in written:
      plgpu.copy_smem_to_gmem(out_smem, out_ref.at[at])

  def setup(self, q_ref, k_ref, v_ref, do_ref, stats_ref, order_ref,
            count_ref, class_ref, block_order_ref, *rest):
    """The kernel on its global-memory refs (the inputs, the optional
    inputs present, then ``dk`` and ``dv``): returns the body that runs on
    the scratch buffers."""
    spec, items, names = self.spec, self.items, self.names
    block_q, block_kv, stages = self.block_q, self.block_kv, self.stages
    head_dim, split_outputs = self.head_dim, self.split_outputs
    separate_outputs = self.separate_outputs
    tile = (block_kv, block_q)  # transposed: keys are the rows here
    keys_per_cta = (1 if split_outputs else 2) * block_kv
    named = dict(zip(names, rest[:len(names)]))
    dk_ref, dv_ref = rest[len(names):]
    cta = lax.axis_index("ctas")
    wg = lax.axis_index("wg")
    q_seg_ref, kv_seg_ref = named.get("q_segments"), named.get("kv_segments")

    item_schedule = functools.partial(self.item_schedule, order_ref,
                                      count_ref)

    def body(smem: _Scratch):

      load_keys = functools.partial(self.load_keys, smem, k_ref, v_ref,
                                    kv_seg_ref)

      def both_consumers_meet():
        plgpu.barrier_arrive(smem.consumers_done)
        plgpu.barrier_wait(smem.consumers_done)

      def consume(want_dk: bool, want_dv: bool, buffer, kv_head, b, kv_block,
                  first_step, next_item):
        """One consumer's loop over an item's steps (the first on ring step
        ``first_step``), accumulating the wanted outputs for keys
        ``buffer`` of the item, then their write-back.  Returns the next
        item's first ring step.

        With one output each (``split_outputs``), the dV warpgroup forms
        ``P^T`` (times the soft cap's derivative) and hands it to the dK
        warpgroup through ``p_smem``, so that each step's four products
        are split two and two rather than the dK warpgroup forming
        ``P^T`` again."""
        count, steps, head_and_tile = item_schedule(kv_head, b, kv_block)
        q_length = common.scalar_or_none(named.get("q_lengths"), b)
        kv_length = common.scalar_or_none(named.get("kv_lengths"), b)
        q_offset, kv_offset = common.offsets_of(named.get("offsets"))
        kv_base = kv_block * keys_per_cta + buffer * block_kv
        rows = pl.ds(kv_base, block_kv)
        loads_keys = want_dv  # the dV warpgroup, or each one unsplit
        if not separate_outputs:
          # The previous item's outputs left through the K/V buffers: reuse
          # them once the copies have read them (both consumers' copies,
          # when they share the buffers).
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if split_outputs:
            both_consumers_meet()
          if loads_keys:
            load_keys(kv_head, b, kv_block, buffer)
        kv_seg = None
        if kv_seg_ref is not None and want_dv:
          plgpu.barrier_wait(smem.kv_ready.at[3 * buffer + 2])
          kv_seg = broadcast_rows(
              plgpu.load(smem.kv_segments.at[buffer], layout=ROW), tile)
        with _region("k_wait"):
          plgpu.barrier_wait(smem.kv_ready.at[3 * buffer])
          plgpu.barrier_wait(smem.kv_ready.at[3 * buffer + 1])

        def step(i, carry):
          (dk, dv), step_class = carry
          # The next step's class, read a step early: its load's latency
          # would otherwise stall the step's start (the slot below depends
          # on it).
          next_class = class_ref[b, kv_block, lax.rem(i + 1, count), wg]
          full = step_class == tiles.FULL
          zero = common.loop_variant_zero(step_class)
          slot = lax.rem(first_step + i, common.i32(stages)) + zero
          k_smem = smem.k.at[buffer + zero]
          v_smem = smem.v.at[buffer + zero]

          def mask(s, q_seg):
            _, q_tile = head_and_tile(i)
            return spec.mask_tile(s, row_start=kv_base + zero, col_tile=q_tile,
                                  col_block=block_q, rows_are_queries=False,
                                  q_length=q_length, kv_length=kv_length,
                                  q_seg=q_seg, kv_seg=kv_seg,
                                  q_offset=q_offset, kv_offset=kv_offset)

          dk, dv = self.step_products(
              smem, slot, want_dk=want_dk, want_dv=want_dv, k_smem=k_smem,
              v_smem=v_smem, full=full, mask=mask, dk=dk, dv=dv,
              first_step=first_step, i=i)
          plgpu.barrier_arrive(smem.ring.do_free.at[slot])
          plgpu.barrier_arrive(smem.ring.q_free.at[slot])
          return (dk, dv), next_class

        zeros = lambda: plgpu.layout_cast(  # noqa: E731
            jnp.zeros((block_kv, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        (dk, dv), _ = lax.fori_loop(0, steps, step, (
            (zeros() if want_dk else None, zeros() if want_dv else None),
            class_ref[b, kv_block, 0, wg]))
        if split_outputs:
          # Neither K nor V is read any more once both are done.
          both_consumers_meet()
        with _region("epilogue"):
          if separate_outputs:
            if loads_keys:
              next_exists, next_where = next_item
              pl.when(next_exists)(lambda: load_keys(*next_where, buffer))
            # The previous item's output copies must have read their
            # buffers.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          self.write_outputs(smem, buffer, dk, dv, want_dk=want_dk,
                             want_dv=want_dv, dk_ref=dk_ref, dv_ref=dv_ref,
                             at=(b, rows, kv_head))
        return first_step + steps

      def consumer():
        def run(want_dk: bool, want_dv: bool, buffer):
          if separate_outputs and want_dv:
            first_k, first_where = items.item_at(block_order_ref, cta, 0)
            pl.when(first_k < items.num_items)(
                lambda: load_keys(*first_where, buffer))
          items.for_each(
              block_order_ref, cta,
              lambda *item: consume(want_dk, want_dv, buffer, *item))

        if split_outputs:  # one set of keys, loaded once, read by both
          pl.when(wg == 0)(lambda: run(False, True, 0))
          pl.when(wg == 1)(lambda: run(True, False, 0))
        else:
          run(True, True, wg)
        # The output copies' reads of shared memory must finish before the
        # CTA leaves; their writes land by the end of the kernel.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      def producer():
        def produce(kv_head, b, kv_block, first_step, next_item):
          del next_item
          _, steps, head_and_tile = item_schedule(kv_head, b, kv_block)
          smem.ring.stream(steps, head_and_tile, stages=stages,
                           block_q=block_q, b=b, q_ref=q_ref, do_ref=do_ref,
                           stats_ref=stats_ref, q_seg_ref=q_seg_ref,
                           first_step=first_step)
          return first_step + steps
        items.for_each(block_order_ref, cta, produce)

      common.split_warpgroups(wg, consumer, producer)
    return body


def dkv_kernel_call(q: Array, k: Array, v: Array, do: Array, stats: Array, *,
                    q_order: Array, q_count: Array, classes: Array,
                    block_order: Array, q_lengths: Array | None,
                    kv_lengths: Array | None, q_segments: Array | None,
                    kv_segments: Array | None, spec: MaskSpec,
                    logits: LogitTransform, block_q: int, block_kv: int,
                    stages: int,
                    split_outputs: bool = False,
                    overlap_sdp: bool = False,
                    q_pad: int | None = None,
                    kv_pad: int | None = None,
                    offsets: Array | None = None) -> tuple[Array, Array]:
  """dK and dV on padded inputs.

  Args:
    q_order, q_count: the tile schedule at ``keys`` keys per key block,
      ``[B, Sp / keys, Tp / block_q]`` and ``[B, Sp / keys]``, where
      ``keys`` is ``2 * block_kv``, or ``block_kv`` with ``split_outputs``.
    classes: int32 ``[B, Sp / keys, Tp / block_q, 2]``: the class of the
      tile visited at each step of ``q_order`` for each consumer's
      ``block_kv`` keys.
    block_order: int32 ``[B * Sp / keys]``, the order in which CTAs take
      key blocks (:func:`~jflash.backends.mosaic_gpu.schedule.heaviest_first`).
    split_outputs: both consumer warpgroups take the same ``block_kv`` keys;
      the first accumulates dV, the second dK.  For head dims whose two
      accumulators do not fit in one warpgroup's registers (256): the CTA
      still reads Q and dO once for both outputs, and forms ``P`` once (in
      the dV warpgroup, which hands it over through shared memory).

    q_pad, kv_pad: the tiled query and key extents (multiples of the
      tiles), when the arrays are shorter: their tail tiles are then read
      through TMA's zero fill and written only within the arrays.  Default:
      the arrays' lengths.
    offsets: int32 ``[2]`` with ``spec.has_offsets``, as for
      :func:`~jflash.backends.mosaic_gpu.forward.forward_kernel_call`.

  Returns:
    ``(dk, dv)``, each shaped as ``k``, in the input dtype.
  """
  batch, _, num_heads, head_dim = q.shape
  kv_pad = kv_pad or k.shape[1]
  del q_pad  # the schedule's tiles cover the queries
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  dtype = q.dtype
  key_buffers = 1 if split_outputs else 2
  keys_per_cta = key_buffers * block_kv
  names, extras = optional_inputs(q_lengths=q_lengths, kv_lengths=kv_lengths,
                            q_segments=q_segments, kv_segments=kv_segments,
                            offsets=offsets)

  num_kv_blocks = kv_pad // keys_per_cta
  items = common.PersistentItems.over(num_kv_heads, batch, num_kv_blocks)
  segments = spec.has_segments
  # With room for separate output buffers, the next item's keys are loaded
  # as soon as this item's loop ends, while its dK and dV are written.
  separate_outputs = _dkv_smem_bytes(
      key_buffers, block_q, block_kv, stages, head_dim, dtype, segments,
      split_outputs, separate_outputs=True) <= common.SMEM_LIMIT_BYTES

  kernel = _DkvKernel(
      spec=spec, logits=logits, items=items, names=tuple(names),
      block_q=block_q, block_kv=block_kv, stages=stages, head_dim=head_dim,
      dtype=dtype, group=group, split_outputs=split_outputs,
      overlap_sdp=overlap_sdp, separate_outputs=separate_outputs)
  key_tile = common.smem_tile((key_buffers, block_kv, head_dim), dtype)
  scratch = _Scratch(
      k=key_tile, v=key_tile,
      dk=key_tile if separate_outputs else None,
      dv=key_tile if separate_outputs else None,
      kv_segments=plgpu.SMEM((key_buffers, block_kv), jnp.int32)
      if segments else None,
      kv_ready=plgpu.Barrier(num_barriers=6),
      ring=query_ring_scratch(stages, block_q, head_dim, dtype, segments),
      consumers_done=plgpu.Barrier(num_arrivals=2),
      # One buffer, as a second does not fit next to a segment-id ring.
      p=plgpu.SMEM((block_kv, block_q), jnp.float32,
                   transforms=(common.F32_TILING, common.SWIZZLE))
      if split_outputs else None,
      p_ready=plgpu.Barrier() if split_outputs else None,
      p_free=plgpu.Barrier() if split_outputs else None)
  kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
  dk, dv = common.warp_specialized_kernel(
      kernel.setup,
      (q, k, v, do, stats, q_order, q_count, classes, block_order, *extras),
      scratch=scratch, out_type=(kv_type, kv_type),
      grid=(items.num_ctas,), grid_names=("ctas",), kernel_name="jflash_dkv")
  return dk, dv


def _dkv_smem_bytes(key_buffers: int, block_q: int, block_kv: int,
                    stages: int, head_dim: int, dtype, segments: bool,
                    split_outputs: bool, *, separate_outputs: bool) -> int:
  """Shared memory the dK/dV kernel's buffers take (barriers excluded)."""
  keys = key_buffers * block_kv * head_dim * jnp.dtype(dtype).itemsize
  return common.smem_bytes(
      keys, keys,  # K, V
      keys if separate_outputs else 0, keys if separate_outputs else 0,
      key_buffers * block_kv * 4 if segments else 0,  # key segment ids
      *query_ring_bytes(stages, block_q, head_dim, dtype, segments),
      block_kv * block_q * 4 if split_outputs else 0)  # P^T handover
