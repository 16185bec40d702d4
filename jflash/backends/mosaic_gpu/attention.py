"""``mosaic_gpu``: FlashAttention kernels for Hopper GPUs in Pallas Mosaic GPU.

Serves bfloat16/float16 calls on compute capability 9.x with every
visibility rule (causal, windows, lengths, segment ids, and query/key
offsets, so that context parallelism runs its blocks here), GQA/MQA, soft
cap and any sequence lengths; head dims up to 256 run at 64, 128 or 256
(zero padded).  It declines (``NotImplementedError``) float32 inputs, a dense
``bias`` or ``mask``, and interpret mode; the next backend serves those.

The forward saves the float32 logsumexp; the backward recomputes
probabilities from it (:mod:`~jflash.backends.mosaic_gpu.backward_common`)
in a dQ kernel (:mod:`~jflash.backends.mosaic_gpu.backward_dq`) and a dK/dV
kernel (:mod:`~jflash.backends.mosaic_gpu.backward_dkv`), or in one fused
kernel (:mod:`~jflash.backends.mosaic_gpu.backward_fused`), without
atomics, so reruns are bitwise identical.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jflash import masks
from jflash.core import trace_time
from jflash.core.call import AttentionCall
from jflash.core.platform import is_hopper
from jflash.core.padding import pad_axis, round_up
from jflash.parallel.partitioning import run_sharded
from jflash.backends.mosaic_gpu import (backward_dkv, backward_dq,
                                       backward_fused, forward, schedule)
from jflash.backends.mosaic_gpu.common import (LOG2E, LogitTransform,
                                               MaskSpec)
from jflash.backends.mosaic_gpu.config import MosaicGpuConfig, padded_head_dim

Array = jax.Array

__all__ = ["MosaicGpuBackend"]


def _decline(reason: str):
  raise NotImplementedError(f"mosaic_gpu: {reason}")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one call (a ``nondiff_argnums`` entry)."""

  spec: MaskSpec
  logits: LogitTransform
  config: MosaicGpuConfig  # resolved
  head_dim: int  # unpadded


@dataclasses.dataclass(frozen=True)
class MosaicGpuBackend:
  """The Hopper kernels, optionally with explicit block sizes.

  Example::

    backend = MosaicGpuBackend(MosaicGpuConfig(block_kv=64))
    jflash.dot_product_attention(q, k, v, implementation=backend)
  """

  config: MosaicGpuConfig = MosaicGpuConfig()
  name: str = "mosaic_gpu"

  def __call__(self, call: AttentionCall) -> tuple[Array, Array]:
    self._check(call)
    return run_sharded(call, self, self._run, call.context_parallel)

  def _check(self, call: AttentionCall) -> None:
    """Declines (``NotImplementedError``) what the kernels do not serve."""
    if call.interpret:
      _decline("its wgmma kernels cannot run in Pallas interpret mode on the "
               "CPU")
    tgt = call.target()
    if tgt.platform != "cuda" or not is_hopper(tgt.device_kind):
      _decline(f"needs a Hopper GPU (compute capability 9.x), the call is "
               f"traced for {tgt.platform} {tgt.device_kind!r}")
    if call.dtype not in (jnp.bfloat16, jnp.float16):
      _decline(f"computes in bfloat16/float16 only, got {call.dtype} (the "
               "xla backend serves float32 exactly)")
    head_dim = call.query.shape[-1]
    if head_dim > 256:
      _decline(f"head dim {head_dim} is above 256")
    if call.bias is not None:
      _decline("a bias is not supported (the xla backend serves it)")
    if call.mask.mask_fn is not None:
      _decline("mask_fn is not supported yet (the xla backend serves it)")
    if call.alibi_slopes is not None:
      _decline("alibi_slopes are not supported yet (the xla backend serves "
               "them)")
    if call.mask.dense is not None:
      _decline("a dense boolean mask is not supported (use segment_ids, "
               "lengths or windows; the xla backend serves dense masks)")

  def _run(self, call: AttentionCall) -> tuple[Array, Array]:
    return _attention(call.query, call.key, call.value, call.mask,
                      self._plan(call))

  def forward(self, call: AttentionCall) -> tuple[Array, Array]:
    """``(out, lse [B, T, N])`` without a derivative: one block of a
    context-parallel call."""
    self._check(call)
    out, lse = _forward(call.query, call.key, call.value, call.mask,
                        self._plan(call))
    return out, _natural_lse(lse, call.mask)

  def backward(self, call: AttentionCall, out: Array, lse: Array,
               d_out: Array, d_lse: Array) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of one block given the whole call's ``out`` and
    ``lse [B, T, N]``."""
    self._check(call)
    plan = self._plan(call)
    lse = pad_axis(jnp.swapaxes(lse, 1, 2), 2,
                   _padding(call.mask, plan).q_pad)
    return _backward(call.query, call.key, call.value, out, lse, d_out,
                     d_lse, call.mask, plan)

  def _plan(self, call: AttentionCall) -> "_Plan":
    head_dim = call.query.shape[-1]
    spec = MaskSpec.of(call.mask)
    config = self.config.resolved(
        head_dim, call.mask.kv_len,
        soft_cap=call.logits_soft_cap is not None,
        segments=spec.has_segments, causal=spec.is_causal,
        window=spec.window)
    return _Plan(spec=spec,
                 logits=LogitTransform(float(call.scale),
                                       call.logits_soft_cap),
                 config=config, head_dim=head_dim)


# ------------------------------------------------------------------ layout
@dataclasses.dataclass(frozen=True)
class _Padded:
  """Extents of a call's kernels.

  Attributes:
    q_pad, kv_pad: the tiled query and key extents, multiples of every
      pass's tiles; the schedules, tile classes and row statistics cover
      them.
    q_rows, kv_rows: the lengths of the query and key arrays the kernels
      get: the call's own rounded up to a multiple of 8, or the tiled
      extent when the call's is shorter than one tile.  Between them and
      the tiled extents TMA reads zeros and drops writes; the tail tiles
      are masked by the true lengths.
    head_pad: the head dim the kernels run at.
  """

  q_pad: int
  kv_pad: int
  q_rows: int
  kv_rows: int
  head_pad: int


def _padding(mask: masks.AttentionMask, plan: _Plan) -> _Padded:
  c = plan.config
  # Every pass tiles the same padded extent.
  # The fused backward runs no separate dQ pass.
  dq_q, dq_kv = (1, 1) if c.fuse_dq else (2 * c.block_q_dq, c.block_kv_dq)
  q_multiple = math.lcm(2 * c.block_q, dq_q, c.block_q_dkv)
  kv_multiple = math.lcm(c.block_kv, dq_kv, 2 * c.block_kv_dkv)
  q_pad = round_up(mask.q_len, q_multiple)
  kv_pad = round_up(mask.kv_len, kv_multiple)
  # A TMA copy's box may pass the end of the array but not exceed it, and
  # the array's rows come in the shared-memory tiling's groups of 8.
  q_tile = max(c.block_q, c.block_q_dkv, 1 if c.fuse_dq else c.block_q_dq)
  kv_tile = max(c.block_kv, c.block_kv_dkv,
                1 if c.fuse_dq else c.block_kv_dq)

  def rows(length, tile, extent):
    return round_up(length, _ROW_GROUP) if length >= tile else extent
  return _Padded(q_pad, kv_pad, rows(mask.q_len, q_tile, q_pad),
                 rows(mask.kv_len, kv_tile, kv_pad),
                 padded_head_dim(plan.head_dim))


# Rows of the shared-memory tiles' (8, 64) tiling.
_ROW_GROUP = 8


def _mask_inputs(mask: masks.AttentionMask, pads: _Padded) -> dict:
  """The kernels' per-call visibility inputs: lengths, padded segment ids
  and, only for a mask with offsets, ``offsets`` (int32 ``[2]``, the
  global positions of local query 0 and key 0), each None when absent."""
  segments = {}
  if mask.q_segment_ids is not None:
    segments = dict(
        q_segments=pad_axis(mask.q_segment_ids, 1, pads.q_pad),
        kv_segments=pad_axis(mask.kv_segment_ids, 1, pads.kv_pad))
  return dict(q_lengths=mask.q_lengths, kv_lengths=mask.kv_lengths,
              q_segments=segments.get("q_segments"),
              kv_segments=segments.get("kv_segments"),
              offsets=_offsets(mask))


def _offsets(mask: masks.AttentionMask) -> Array | None:
  """int32 ``[q_offset, kv_offset]`` (an absent one is 0) when the mask has
  offsets, else None."""
  if not mask.has_offsets:
    return None
  def scalar(x):
    return jnp.zeros((), jnp.int32) if x is None else jnp.asarray(
        x, jnp.int32).reshape(())
  return jnp.stack([scalar(mask.q_offset), scalar(mask.kv_offset)])


def _fused_slots(config, pads: _Padded) -> int:
  """dQ accumulators of the fused backward: as configured, but no more than
  there are key blocks (CTAs) per row."""
  return min(config.dq_slots, pads.kv_pad // (2 * config.block_kv_dkv))


def _metadata(make, mask: masks.AttentionMask, block_q: int, block_kv: int,
              pads: _Padded, *more) -> tuple[Array, ...]:
  """``make(mask, block_q, block_kv, pads, *more)``; constants built while
  tracing when the schedule depends on shapes only."""
  return trace_time.constant_if_static(make, mask, block_q, block_kv, pads,
                                       *more)


def _pad_inputs(q, k, v, pads: _Padded):
  q = pad_axis(pad_axis(q, 1, pads.q_rows), 3, pads.head_pad)
  k = pad_axis(pad_axis(k, 1, pads.kv_rows), 3, pads.head_pad)
  v = pad_axis(pad_axis(v, 1, pads.kv_rows), 3, pads.head_pad)
  return q, k, v


def _extents(pads: _Padded) -> dict:
  """The kernels' ``q_pad`` and ``kv_pad`` arguments."""
  return dict(q_pad=pads.q_pad, kv_pad=pads.kv_pad)


# ---------------------------------------------------------------- passes
def _forward(q, k, v, mask, plan: _Plan):
  """(out [B, T, N, H], lse [B, N, Tp] float32 natural log)."""
  c = plan.config
  pads = _padding(mask, plan)
  qp, kp, vp = _pad_inputs(q, k, v, pads)
  order, count, classes, block_order = _metadata(
      schedule.rows_metadata, mask, c.block_q, c.block_kv, pads)
  out, lse = forward.forward_kernel_call(
      qp, kp, vp, kv_order=order, kv_count=count, classes=classes,
      block_order=block_order,
      **_mask_inputs(mask, pads), spec=plan.spec, logits=plan.logits,
      block_q=c.block_q, block_kv=c.block_kv, stages=c.stages,
      qk_after_pv=c.qk_after_pv, **_extents(pads))
  return out[:, :mask.q_len, :, :plan.head_dim], lse


# Partial sums the first stage of :func:`_fixed_order_row_sum` leaves per
# row: neighbouring threads then read neighbouring columns.
_ROW_SUM_COLUMNS = 32


def _halve_axis(x: jax.Array, axis: int) -> jax.Array:
  """Sums a power-of-two axis by halving it: element ``i`` plus element
  ``i + n/2``, again and again, until one is left (the axis is dropped)."""
  while x.shape[axis] > 1:
    half = x.shape[axis] // 2
    x = (lax.slice_in_dim(x, 0, half, axis=axis)
         + lax.slice_in_dim(x, half, 2 * half, axis=axis))
  return lax.squeeze(x, (axis,))


def _fixed_order_row_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis as a fixed tree of elementwise additions.

  ``jnp.sum`` leaves the order of the additions to XLA, which may pick a
  different reduction strategy in another process (its autotuner), and so
  different bits; dQ and dK inherit them through ``delta``.  Halving the
  axis (padded to a power of two) until one column is left fixes every
  addition, so the backward's gradients are bitwise reproducible across
  processes.

  The same additions run in two stages: the axis is split into
  ``[width / 32, 32]`` and halved over its first part, which adds elements
  ``i`` and ``i + width / 2`` as the one-stage tree does, but with
  neighbouring threads reading neighbouring columns; the 32 partial sums
  per row are materialized, then halved.  (Halving the whole row in one
  fusion reads each row's elements from one thread: several times
  slower, for the same bits.)
  """
  width = 1
  while width < x.shape[-1]:
    width *= 2
  x = pad_axis(x, x.ndim - 1, width)
  if width > _ROW_SUM_COLUMNS:
    x = x.reshape(*x.shape[:-1], width // _ROW_SUM_COLUMNS, _ROW_SUM_COLUMNS)
    x = lax.optimization_barrier(_halve_axis(x, x.ndim - 2))
  return _halve_axis(x, x.ndim - 1)


def _row_statistics(out: jax.Array, d_out: jax.Array, lse: jax.Array,
                    d_lse: jax.Array, q_pad: int) -> jax.Array:
  """The backward kernels' per-row inputs, ``[B, N, 2, Tp]`` float32: the
  base-2 logsumexp (+inf for rows that see nothing, so that their
  recomputed probabilities are ``exp2(-inf) == 0``) and
  ``delta = rowsum(dO * O) - dlse``.

  ``out`` and ``d_out`` are ``[B, T, N, H]``, ``lse`` ``[B, N, Tp]`` (natural
  log), ``d_lse`` ``[B, T, N]``; ``delta`` is zero-padded to ``Tp = q_pad``
  rows.
  """
  delta = _fixed_order_row_sum(
      d_out.astype(jnp.float32) * out.astype(jnp.float32)
  ) - d_lse.astype(jnp.float32)
  # Computed in [B, T, N] order, kept apart from the transpose: fused
  # together, XLA reads O and dO uncoalesced.
  delta = jax.lax.optimization_barrier(delta)
  delta = pad_axis(jnp.swapaxes(delta, 1, 2), 2, q_pad)
  lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)
  return jnp.stack([lse2, delta], axis=2)


def _backward(q, k, v, out, lse, d_out, d_lse, mask, plan: _Plan):
  c = plan.config
  pads = _padding(mask, plan)
  qp, kp, vp = _pad_inputs(q, k, v, pads)
  dop = pad_axis(pad_axis(d_out.astype(q.dtype), 1, pads.q_rows), 3,
                  pads.head_pad)
  stats = _row_statistics(out, d_out, lse, d_lse, pads.q_pad)
  extras = _mask_inputs(mask, pads)
  common_args = dict(spec=plan.spec, logits=plan.logits, **extras,
                     **_extents(pads))
  t, s, h = mask.q_len, mask.kv_len, plan.head_dim
  if c.fuse_dq:
    slots = _fused_slots(c, pads)
    order, count, classes, ranks, visited = _metadata(
        schedule.fused_keys_metadata, mask, c.block_q_dkv, c.block_kv_dkv,
        pads, slots)
    dq_sums, dk, dv = backward_fused.fused_backward_call(
        qp, kp, vp, dop, stats, q_order=order, q_count=count,
        classes=classes, ranks=ranks, block_q=c.block_q_dkv,
        block_kv=c.block_kv_dkv, stages=c.stages_dkv, slots=slots,
        overlap_sdp=c.overlap_sdp, **common_args)
    dq_sums = dq_sums.reshape((slots, -1) + dq_sums.shape[1:])
    # Summed in accumulator order; query tiles that an accumulator does not
    # receive were never written.
    dq = None
    for r in range(slots):
      rows = jnp.repeat(visited[r], c.block_q_dkv, axis=1)[:, :, None, None]
      part = jnp.where(rows, dq_sums[r], 0.0)
      dq = part if dq is None else dq + part
    dq = (dq * plan.logits.scale).astype(q.dtype)
    return dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h]

  order, count, classes, block_order = _metadata(
      schedule.rows_metadata, mask, c.block_q_dq, c.block_kv_dq, pads)
  dq = backward_dq.dq_kernel_call(
      qp, kp, vp, dop, stats, kv_order=order, kv_count=count,
      classes=classes, block_order=block_order, block_q=c.block_q_dq,
      block_kv=c.block_kv_dq, stages=c.stages_dq,
      overlap_sdp=c.overlap_sdp, **common_args)
  # At head dim 256 one warpgroup cannot hold both dK and dV accumulators:
  # the two consumers then share their keys, one output each.
  split_outputs = pads.head_pad > 128
  make = (schedule.shared_keys_metadata if split_outputs
          else schedule.keys_metadata)
  order, count, classes, block_order = _metadata(
      make, mask, c.block_q_dkv, c.block_kv_dkv, pads)
  dk, dv = backward_dkv.dkv_kernel_call(
      qp, kp, vp, dop, stats, q_order=order, q_count=count, classes=classes,
      block_order=block_order,
      block_q=c.block_q_dkv, block_kv=c.block_kv_dkv, stages=c.stages_dkv,
      split_outputs=split_outputs, overlap_sdp=c.overlap_sdp, **common_args)
  return dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h]


def _natural_lse(lse, mask):
  """[B, N, Tp] -> [B, T, N]."""
  return jnp.swapaxes(lse[:, :, :mask.q_len], 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, mask, plan):
  out, lse = _forward(q, k, v, mask, plan)
  return out, _natural_lse(lse, mask)


def _attention_fwd(q, k, v, mask, plan):
  out, lse = _forward(q, k, v, mask, plan)
  return (out, _natural_lse(lse, mask)), (q, k, v, mask, out, lse)


def _attention_bwd(plan, residuals, cotangents):
  q, k, v, mask, out, lse = residuals
  d_out, d_lse = cotangents
  dq, dk, dv = _backward(q, k, v, out, lse, d_out, d_lse, mask, plan)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)
