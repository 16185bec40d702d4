"""Pieces shared by the Hopper backward kernels (dQ, dK/dV and the fused
backward).

All recompute the probabilities from the saved logsumexp.  With ``s`` the
base-2 logits of :class:`~jflash.backends.mosaic_gpu.common.LogitTransform`
and ``lse2`` the base-2 logsumexp, ``P = exp2(s - lse2)``,
``dS = P * (dO V^T - delta)`` (times the soft cap's derivative), where
``delta = rowsum(dO * O) - dlse`` folds in the logsumexp's own cotangent.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jflash.backends.mosaic_gpu import common
from jflash.backends.mosaic_gpu.common import (COL, LogitTransform,
                                               broadcast_cols)

Array = jax.Array
# Named regions: spans in a Mosaic GPU profile, nothing otherwise.
_region = jax.named_scope


def optional_inputs(**arrays):
  """The names and values of the arrays that are not None, in order."""
  names = [n for n, x in arrays.items() if x is not None]
  return names, [arrays[n] for n in names]


def probabilities(qk: Array, logits: LogitTransform, full: Array, masked,
                   lse2: Array) -> tuple[Array, Array | None]:
  """``P = exp2(s - lse2)`` of the raw products ``qk`` (``masked`` applied
  unless ``full``), and the soft cap's derivative (None without a cap)."""
  factor = logits.linear_factor
  if factor is not None:  # mask the raw products; one FMA per exponent
    qk = lax.cond(full, lambda s: s, masked, qk)
    return jnp.exp2(qk * factor - lse2), None
  s = logits(qk)
  p = jnp.exp2(lax.cond(full, lambda s: s, masked, s) - lse2)
  return p, logits.derivative(s)


def score_gradient(p: Array, dp: Array, delta: Array,
                    derivative: Array | None) -> Array:
  """``dS = P * (dP - delta)``, times the soft cap's derivative if any."""
  ds = p * (dp - delta)
  return ds if derivative is None else ds * derivative


@common.scratch_dataclass
class QueryRing:
  """The shared-memory ring through which a producer streams query tiles
  (Q, dO, the row statistics and optionally segment ids) to the consumers
  of a key-block kernel, with its ready/free barriers (each indexed by
  slot).  Part of a kernel's scratch (:func:`query_ring_scratch`)."""

  q: Any
  do: Any
  stats: Any
  segments: Any  # None without segment ids
  q_ready: Any
  do_ready: Any
  stats_ready: Any
  segments_ready: Any
  q_free: Any
  do_free: Any

  def stream(self, steps, head_and_tile, *, stages: int, block_q: int, b,
             q_ref, do_ref, stats_ref, q_seg_ref, first_step=0) -> None:
    """Producer loop: step ``i`` copies query tile ``head_and_tile(i)`` into
    slot ``(first_step + i) % stages`` once the consumers freed it
    (``first_step`` counts the ring's earlier uses, by a persistent
    kernel's earlier items)."""

    @pl.loop(0, steps)
    def _load(i):
      used = first_step + i
      slot = lax.rem(used, common.i32(stages))
      head, q_tile = head_and_tile(i)
      rows = pl.ds(q_tile * block_q, block_q)

      @pl.when(used >= stages)
      def _():
        with _region("q_free_wait"):
          plgpu.barrier_wait(self.q_free.at[slot])
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], self.q.at[slot],
                              self.q_ready.at[slot])
      plgpu.copy_gmem_to_smem(stats_ref.at[b, head, :, rows],
                              self.stats.at[slot], self.stats_ready.at[slot])
      if q_seg_ref is not None:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], self.segments.at[slot],
                                self.segments_ready.at[slot])

      @pl.when(used >= stages)
      def _():
        with _region("do_free_wait"):
          plgpu.barrier_wait(self.do_free.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, head], self.do.at[slot],
                              self.do_ready.at[slot])

  def probabilities(self, slot, *, k_smem, tile: tuple[int, int],
                    logits: LogitTransform, full, mask, v_smem=None):
    """The transposed probabilities ``P^T = exp2(K Q^T (scaled) - lse2)``
    of the step on slot ``slot`` (``mask(s, q_seg)`` applied unless
    ``full``) and the soft cap's derivative (or None).  Waits for Q, the
    row statistics and the segment ids.

    With ``v_smem``, ``dP^T = V dO^T`` is issued right after ``K Q^T``
    and returned third: ``P`` is formed while the tensor cores compute it
    (dO is waited for first)."""
    with _region("q_wait"):
      plgpu.barrier_wait(self.q_ready.at[slot])
      plgpu.barrier_wait(self.stats_ready.at[slot])
    q_seg = None
    if self.segments is not None:
      plgpu.barrier_wait(self.segments_ready.at[slot])
      q_seg = broadcast_cols(
          plgpu.load(self.segments.at[slot], layout=COL), tile)
    lse2 = broadcast_cols(
        plgpu.load(self.stats.at[slot, 0], layout=COL), tile)

    if v_smem is not None:
      with _region("do_wait"):
        plgpu.barrier_wait(self.do_ready.at[slot])

      def products(s_ref, dp_ref):
        with _region("s_wait"):
          plgpu.wgmma(s_ref, k_smem, self.q.at[slot].transpose((1, 0)))
          plgpu.wgmma(dp_ref, v_smem, self.do.at[slot].transpose((1, 0)))
          s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
        with _region("p"):
          p, derivative = probabilities(s, logits, full,
                                         lambda s: mask(s, q_seg), lse2)
        with _region("dp_wait"):
          dp = dp_ref[...]
        return p, derivative, dp
      return pl.run_scoped(products, plgpu.ACC(tile, jnp.float32),
                           plgpu.ACC(tile, jnp.float32))

    def kq_product(acc_ref):
      plgpu.wgmma(acc_ref, k_smem, self.q.at[slot].transpose((1, 0)))
      return acc_ref[...]
    qk = pl.run_scoped(kq_product, plgpu.ACC(tile, jnp.float32))
    return probabilities(qk, logits, full, lambda s: mask(s, q_seg), lse2)

  def delta(self, slot, tile: tuple[int, int]) -> Array:
    """``delta`` of the step's queries, broadcast over the tile (the row
    statistics must have been waited for)."""
    return broadcast_cols(
        plgpu.load(self.stats.at[slot, 1], layout=COL), tile)

  def dp_product(self, slot, *, v_smem, tile: tuple[int, int]) -> Array:
    """``dP^T = V dO^T`` of the step (dO must have been waited for)."""
    def product(acc_ref):
      plgpu.wgmma(acc_ref, v_smem, self.do.at[slot].transpose((1, 0)))
      return acc_ref[...]
    return pl.run_scoped(product, plgpu.ACC(tile, jnp.float32))

  def dv_first_products(self, slot, p: Array, derivative: Array, *,
                        v_smem, tile: tuple[int, int], dtype, dv: Array,
                        dk: Array, ds_sink=None) -> tuple[Array, Array]:
    """The products of a step with a soft cap, dV's first: ``dV += P^T
    dO`` is issued, the cap's derivative folded into ``P`` while it runs
    (only ``dS`` reads the product), then ``dP^T = V dO^T``, ``dS`` (with
    ``delta`` loaded only then) and ``dK += dS Q``.  ``P`` and the
    derivative are thus never both live next to ``dP``'s tile.
    ``ds_sink(ds)``, if given, receives ``dS`` in ``dtype`` before dK's
    product is issued.  Waits for dO; Q and the row statistics must have
    been waited for (:meth:`probabilities`).  Returns the new
    ``(dv, dk)``."""
    plgpu.barrier_wait(self.do_ready.at[slot])

    def products(refs):
      dv_ref, dk_ref = refs
      plgpu.wgmma(dv_ref, p.astype(dtype), self.do.at[slot])
      p_scaled = p * derivative
      dp = self.dp_product(slot, v_smem=v_smem, tile=tile)
      ds = score_gradient(p_scaled, dp, self.delta(slot, tile),
                           None).astype(dtype)
      if ds_sink is not None:
        ds_sink(ds)
      plgpu.wgmma(dk_ref, ds, self.q.at[slot])
    return pl.run_state(products)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))

  def scores(self, slot, *, k_smem, v_smem, tile: tuple[int, int],
             logits: LogitTransform, full, mask, want_dp: bool,
             together: bool = False):
    """A consumer's first half of a step on slot ``slot``:
    :meth:`probabilities`, ``dP^T`` (None unless ``want_dp``; issued with
    ``K Q^T`` when ``together``) and ``delta`` broadcast over the tile.
    Leaves dO waited for; frees nothing."""
    if want_dp and together:
      p, derivative, dp = self.probabilities(
          slot, k_smem=k_smem, tile=tile, logits=logits, full=full,
          mask=mask, v_smem=v_smem)
      return p, derivative, dp, self.delta(slot, tile)
    p, derivative = self.probabilities(slot, k_smem=k_smem, tile=tile,
                                       logits=logits, full=full, mask=mask)
    plgpu.barrier_wait(self.do_ready.at[slot])
    dp = self.dp_product(slot, v_smem=v_smem, tile=tile) if want_dp else None
    return p, derivative, dp, self.delta(slot, tile)


def query_ring_bytes(stages: int, block_q: int, head_dim: int, dtype,
                     segments: bool) -> tuple[int, ...]:
  """Sizes of :func:`query_ring_scratch`'s shared-memory buffers."""
  tiles = stages * block_q * head_dim * jnp.dtype(dtype).itemsize
  return (tiles, tiles, stages * 2 * block_q * 4,
          stages * block_q * 4 if segments else 0)


def query_ring_scratch(stages: int, block_q: int, head_dim: int, dtype,
                       segments: bool) -> QueryRing:
  """The buffers of a :class:`QueryRing` of ``stages`` slots."""
  return QueryRing(
      q=common.smem_tile((stages, block_q, head_dim), dtype),
      do=common.smem_tile((stages, block_q, head_dim), dtype),
      stats=plgpu.SMEM((stages, 2, block_q), jnp.float32),
      segments=plgpu.SMEM((stages, block_q), jnp.int32) if segments else None,
      q_ready=plgpu.Barrier(num_barriers=stages),
      do_ready=plgpu.Barrier(num_barriers=stages),
      stats_ready=plgpu.Barrier(num_barriers=stages),
      segments_ready=plgpu.Barrier(num_barriers=stages) if segments else None,
      q_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      do_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages))
