"""The ``mosaic_tpu`` forward kernel: online softmax over the visited tiles.

Grid ``(B, N, nq, kv_steps)``; the last axis walks the nonempty key blocks
of query block ``i`` as listed in the scalar-prefetched metadata.  The
running max and sum live in VMEM scratch as ``[block_q, 128]`` (the row
value repeated along lanes) and the output accumulator as
``[block_q, Hp]`` float32; output and logsumexp are written once, after the
last step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jflash import masks
from jflash.backends.mosaic_tpu import common
from jflash.backends.mosaic_tpu.common import Metadata, Plan
from jflash.backends.mosaic_tpu.config import LANES

Array = jax.Array


def _kernel(*refs, plan: Plan):
  n_lengths = plan.num_lengths
  visits_ref, count_ref = refs[:2]
  length_refs = refs[2:2 + n_lengths]
  refs = list(refs[2 + n_lengths:])
  q_ref, k_ref, v_ref = refs[:3]
  del refs[:3]
  q_ids_ref = kv_ids_ref = None
  if plan.has_segments:
    q_ids_ref, kv_ids_ref = refs[:2]
    del refs[:2]
  o_ref, lse_ref = refs[:2]
  del refs[:2]
  m_ref, l_ref, acc_ref = refs

  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  sb = b if plan.per_batch else 0
  count = count_ref[sb, i]
  kv_block, cls = common.visit_at(visits_ref, count_ref, sb, i, j)

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def step(masked: bool):
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s, _ = common.logits(q, k, plan)
    if masked:
      kv_start = kv_block * plan.block_kv
      s, _ = common.apply_mask(
          s, plan, q_start=i * plan.block_q, kv_start=kv_start,
          transposed=False, lengths=common.lengths_of(plan, length_refs, b),
          q_ids=None if q_ids_ref is None else q_ids_ref[...],
          kv_ids=None if kv_ids_ref is None else kv_ids_ref[...])
      if plan.kv_tail:
        v = common.zero_rows_past(v, kv_start, plan.rules.kv_len)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    # A row that has seen no key yet keeps -inf; subtracting 0 instead keeps
    # exp() at 0 rather than NaN.
    m_safe = jnp.where(jnp.isneginf(m_new), jnp.float32(0), m_new)
    p = jnp.exp(s - m_safe[:, :1])
    alpha = jnp.exp(m_prev - m_safe)
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    pv = lax.dot_general(p.astype(v.dtype), v, common.NN_DIMS,
                         precision=common.precision_for(v.dtype),
                         preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv
    m_ref[...] = m_new

  common.when_visited(count, j, cls, step)

  @pl.when(j == plan.kv_steps - 1)
  def _finish():
    l, m = l_ref[...], m_ref[...]
    empty = l == 0.0  # no visible key: zeros and a logsumexp of -inf
    safe_l = jnp.where(empty, jnp.float32(1), l)
    o_ref[...] = (acc_ref[...] / safe_l[:, :1]).astype(o_ref.dtype)
    lse = jnp.where(empty, jnp.float32(-jnp.inf),
                    m + jnp.log(safe_l))  # [bq, 128]
    lse_ref[...] = jnp.transpose(lse)[:1, :]


def forward(q: Array, k: Array, v: Array, mask: masks.AttentionMask,
            meta: Metadata, plan: Plan, out_dtype) -> tuple[Array, Array]:
  """Runs the forward kernel on kernel-layout operands.

  Args:
    q: ``[B, N, T, Hp]``.
    k, v: ``[B, K, S, Hp]``.
    mask: the call's mask (its lengths and segment ids reach the kernel).
    meta: the call's tile visits.
    plan: the static plan.
    out_dtype: dtype of the output (float32 when the backward pass will
      take ``delta`` from it).

  Returns:
    ``out [B, N, T, Hp]`` and ``lse [B, N, 1, T]`` float32.
  """
  batch, heads, _, hp = q.shape
  groups = heads // k.shape[1]
  bq, bkv = plan.block_q, plan.block_kv

  def kv_map(b, n, i, j, visits, count, *_):
    sb = b if plan.per_batch else 0
    block, _ = common.visit_at(visits, count, sb, i, j)
    return b, lax.div(n, jnp.int32(groups)), block, 0

  def kv_ids_map(b, n, i, j, visits, count, *_):
    sb = b if plan.per_batch else 0
    block, _ = common.visit_at(visits, count, sb, i, j)
    return b, 0, block

  operands = [q, k, v]
  in_specs = [
      common.block_spec((None, None, bq, hp), lambda b, n, i, j, *_: (b, n, i, 0)),
      common.block_spec((None, None, bkv, hp), kv_map),
      common.block_spec((None, None, bkv, hp), kv_map),
  ]
  if plan.has_segments:
    q_col, _ = common.segment_layouts(mask.q_segment_ids)
    _, kv_row = common.segment_layouts(mask.kv_segment_ids)
    operands += [q_col, kv_row]
    in_specs += [common.block_spec((None, bq, 1), lambda b, n, i, j, *_: (b, i, 0)),
                 common.block_spec((None, 1, bkv), kv_ids_map)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, out_dtype),
               jax.ShapeDtypeStruct((batch, heads, 1, q.shape[2]),
                                    jnp.float32)]
  out_specs = [
      common.block_spec((None, None, bq, hp), lambda b, n, i, j, *_: (b, n, i, 0)),
      common.block_spec((None, None, 1, bq), lambda b, n, i, j, *_: (b, n, 0, i)),
  ]
  scalars = [meta.kv_visits, meta.kv_count, *common.length_operands(mask)]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(scalars),
      grid=(batch, heads, plan.num_q, plan.kv_steps),
      in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, hp), jnp.float32)])
  return pl.pallas_call(
      functools.partial(_kernel, plan=plan),
      grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=plan.compiler_params(
          ("parallel", "parallel", "parallel", "arbitrary")),
      interpret=plan.interpret, name="jflash_mosaic_tpu_forward",
  )(*scalars, *operands)

