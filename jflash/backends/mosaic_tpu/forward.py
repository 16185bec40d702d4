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


def _kernel(r: dict, *, plan: Plan):
  """One grid step ``(b, n, i, j)``: step ``j`` of query block ``i``'s key
  block visits (refs by name, see :func:`forward`)."""
  b, n = pl.program_id(0), pl.program_id(1)
  i, j = pl.program_id(2), pl.program_id(3)
  sb = b if plan.per_batch else 0
  count = r["count"][sb, i]
  kv_block, cls = common.visit_at(r["visits"], r["count"], sb, i, j)
  pl.when(j == 0)(functools.partial(_init, r))
  common.when_visited(count, j, cls, functools.partial(
      _step, r, plan=plan, b=b, n=n, i=i, kv_block=kv_block))
  pl.when(j == plan.kv_steps - 1)(functools.partial(_finish, r))


def _init(r: dict) -> None:
  r["m"][...] = jnp.full(r["m"].shape, -jnp.inf, jnp.float32)
  r["l"][...] = jnp.zeros(r["l"].shape, jnp.float32)
  r["acc"][...] = jnp.zeros(r["acc"].shape, jnp.float32)


def _step(r: dict, masked: bool, *, plan: Plan, b, n, i, kv_block) -> None:
  """Online softmax over one tile: the element mask only when ``masked``."""
  q, k, v = r["q"][...], r["k"][...], r["v"][...]
  q_start, kv_start = i * plan.block_q, kv_block * plan.block_kv
  s, _ = common.logits(q, k, plan)
  s = common.add_alibi(s, r, b=b, n=n, q_start=q_start, kv_start=kv_start,
                       transposed=False)
  if masked:
    s, _ = common.apply_mask(
        s, plan, r, b=b, q_start=q_start, kv_start=kv_start,
        transposed=False)
    if plan.kv_tail:
      v = common.zero_rows_past(v, kv_start, plan.rules.kv_len)
  m_prev = r["m"][...]
  m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
  # A row that has seen no key yet keeps -inf; subtracting 0 instead keeps
  # exp() at 0 rather than NaN.
  m_safe = jnp.where(jnp.isneginf(m_new), jnp.float32(0), m_new)
  p = jnp.exp(s - m_safe[:, :1])
  alpha = jnp.exp(m_prev - m_safe)
  r["l"][...] = alpha * r["l"][...] + p.sum(axis=1, keepdims=True)
  pv = lax.dot_general(p.astype(v.dtype), v, common.NN_DIMS,
                       precision=common.precision_for(v.dtype),
                       preferred_element_type=jnp.float32)
  r["acc"][...] = r["acc"][...] * alpha[:, :1] + pv
  r["m"][...] = m_new


def _finish(r: dict) -> None:
  """Writes the output and the logsumexp row after the last step."""
  l, m = r["l"][...], r["m"][...]
  empty = l == 0.0  # no visible key: zeros and a logsumexp of -inf
  safe_l = jnp.where(empty, jnp.float32(1), l)
  r["out"][...] = (r["acc"][...] / safe_l[:, :1]).astype(r["out"].dtype)
  lse = jnp.where(empty, jnp.float32(-jnp.inf),
                  m + jnp.log(safe_l))  # [bq, 128]
  r["lse"][...] = jnp.transpose(lse)[:1, :]


def forward(q: Array, k: Array, v: Array, mask: masks.AttentionMask,
            slopes: Array | None, meta: Metadata, plan: Plan,
            out_dtype) -> tuple[Array, Array]:
  """Runs the forward kernel on kernel-layout operands.

  Args:
    q: ``[B, N, T, Hp]``.
    k, v: ``[B, K, S, Hp]``.
    mask: the call's mask (its lengths and segment ids reach the kernel).
    slopes: the call's ALiBi slopes ``[B|1, N]``, or None.
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

  def q_map(b, n, i, j, *_):
    return b, n, i, 0

  def kv_block(b, i, j, visits, count):
    sb = b if plan.per_batch else 0
    return common.visit_at(visits, count, sb, i, j)[0]

  def kv_map(b, n, i, j, visits, count, *_):
    block = kv_block(b, i, j, visits, count)
    return b, lax.div(n, jnp.int32(groups)), block, 0

  inputs = {"q": (q, common.block_spec((None, None, bq, hp), q_map)),
            "k": (k, common.block_spec((None, None, bkv, hp), kv_map)),
            "v": (v, common.block_spec((None, None, bkv, hp), kv_map))}
  if plan.has_segments:
    q_col, _ = common.segment_layouts(mask.q_segment_ids)
    _, kv_row = common.segment_layouts(mask.kv_segment_ids)
    inputs["q_ids"] = (q_col, common.block_spec(
        (None, bq, 1), lambda b, n, i, j, *_: (b, i, 0)))
    inputs["kv_ids"] = (kv_row, common.block_spec(
        (None, 1, bkv), lambda b, n, i, j, visits, count, *_: (
            b, 0, kv_block(b, i, j, visits, count))))
  outputs = {
      "out": (jax.ShapeDtypeStruct(q.shape, out_dtype),
              common.block_spec((None, None, bq, hp), q_map)),
      "lse": (jax.ShapeDtypeStruct((batch, heads, 1, q.shape[2]),
                                   jnp.float32),
              common.block_spec((None, None, 1, bq),
                                lambda b, n, i, j, *_: (b, n, 0, i)))}
  # Running max and sum, the row value repeated along the 128 lanes.
  scratch = {"m": pltpu.VMEM((bq, LANES), jnp.float32),
             "l": pltpu.VMEM((bq, LANES), jnp.float32),
             "acc": pltpu.VMEM((bq, hp), jnp.float32)}
  operands = common.KernelOperands(
      scalars=common.scalar_operands(meta.kv_visits, meta.kv_count, mask,
                                     slopes),
      inputs=inputs, outputs=outputs, scratch=scratch)
  out, lse = common.call_kernel(
      functools.partial(_kernel, plan=plan), operands, plan=plan,
      grid=(batch, heads, plan.num_q, plan.kv_steps),
      semantics=("parallel", "parallel", "parallel", "arbitrary"),
      name="jflash_mosaic_tpu_forward")
  return out, lse
