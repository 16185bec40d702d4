"""The ``mosaic_tpu`` backward kernels: dQ, then dK and dV.

Both recompute a tile's probabilities from the saved logsumexp and use
``delta = rowsum(dO * O) - dlogsumexp`` (computed outside, so the
logsumexp's own cotangent flows through the same ``dS``).  Neither needs
atomics: each output block is owned by one grid row, so results are
deterministic.

* dQ: grid ``(B, N, nq, kv_steps)``, walking the same key-block visits as
  the forward kernel; dQ accumulates in a ``[block_q, Hp]`` float32 scratch.
* dK/dV: grid ``(B, K, nk, G, q_steps)``, walking, for each key block, the
  query blocks that see it, for each of the ``G`` query heads that share the
  key/value head; the two inner axes are sequential and accumulate into
  ``[block_kv, Hp]`` float32 scratch, so GQA/MQA sums the query-head group
  without repeating K and V.  The tile is computed transposed
  (``K @ Q.T``, ``[block_kv, block_q]``) so the per-query statistics
  broadcast as lane-dense rows and every matmul is a plain or ``A @ B.T``
  product.
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

Array = jax.Array


# ---------------------------------------------------------------------- dQ
def _dq_kernel(r: dict, *, plan: Plan):
  """One grid step ``(b, n, i, j)``: step ``j`` of query block ``i``'s key
  block visits (refs by name, see :func:`dq`)."""
  b, n = pl.program_id(0), pl.program_id(1)
  i, j = pl.program_id(2), pl.program_id(3)
  sb = b if plan.per_batch else 0
  count = r["count"][sb, i]
  kv_block, cls = common.visit_at(r["visits"], r["count"], sb, i, j)
  @pl.when(j == 0)
  def _init():
    r["acc"][...] = jnp.zeros(r["acc"].shape, jnp.float32)

  common.when_visited(count, j, cls, functools.partial(
      _dq_step, r, plan=plan, b=b, n=n, i=i, kv_block=kv_block))

  @pl.when(j == plan.kv_steps - 1)
  def _finish():
    r["dq"][...] = (r["acc"][...] * jnp.float32(plan.scale)).astype(
        r["dq"].dtype)


def _dq_step(r: dict, masked: bool, *, plan: Plan, b, n, i,
             kv_block) -> None:
  """Adds one tile's ``dS @ K`` to the dQ accumulator."""
  q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
  q_start, kv_start = i * plan.block_q, kv_block * plan.block_kv
  s, tanh = common.logits(q, k, plan)
  s = common.add_alibi(s, r, b=b, n=n, q_start=q_start, kv_start=kv_start,
                       transposed=False)
  visible = None
  if masked:
    s, visible = common.apply_mask(
        s, plan, r, b=b, q_start=q_start, kv_start=kv_start,
        transposed=False)
    if plan.kv_tail:
      k = common.zero_rows_past(k, kv_start, plan.rules.kv_len)
  lse = r["lse"][0][:, None]  # [1, bq] row -> [bq, 1] column
  delta = r["delta"][0][:, None]
  p = jnp.exp(s - lse)
  dp = lax.dot_general(do, v, common.NT_DIMS,
                       precision=common.precision_for(v.dtype),
                       preferred_element_type=jnp.float32)
  ds = common.score_gradient(p, dp, delta, tanh, visible)
  r["acc"][...] += lax.dot_general(
      ds.astype(k.dtype), k, common.NN_DIMS,
      precision=common.precision_for(k.dtype),
      preferred_element_type=jnp.float32)


def dq(q: Array, k: Array, v: Array, do: Array, lse: Array, delta: Array,
       mask: masks.AttentionMask, slopes: Array | None, meta: Metadata,
       plan: Plan, out_dtype) -> Array:
  """dQ on kernel-layout operands.

  Args:
    q, do: ``[B, N, T, Hp]``.
    k, v: ``[B, K, S, Hp]``.
    lse, delta: ``[B, N, 1, T]`` float32 (``lse`` with ``-inf`` replaced
      by 0).
    mask, slopes, meta, plan: as for
      :func:`jflash.backends.mosaic_tpu.forward.forward`.
    out_dtype: dtype of dQ.

  Returns:
    ``dq [B, N, T, Hp]``.
  """
  batch, heads, _, hp = q.shape
  groups = heads // k.shape[1]
  bq, bkv = plan.block_q, plan.block_kv

  def kv_block(b, i, j, visits, count):
    sb = b if plan.per_batch else 0
    return common.visit_at(visits, count, sb, i, j)[0]

  def kv_map(b, n, i, j, visits, count, *_):
    return b, lax.div(n, jnp.int32(groups)), kv_block(b, i, j, visits,
                                                       count), 0

  def q_map(b, n, i, j, *_):
    return b, n, i, 0

  def row_map(b, n, i, j, *_):
    return b, n, 0, i

  q_spec = common.block_spec((None, None, bq, hp), q_map)
  kv_spec = common.block_spec((None, None, bkv, hp), kv_map)
  row_spec = common.block_spec((None, None, 1, bq), row_map)
  inputs = {"q": (q, q_spec), "k": (k, kv_spec), "v": (v, kv_spec),
            "do": (do, q_spec), "lse": (lse, row_spec),
            "delta": (delta, row_spec)}
  if plan.has_segments:
    q_col, _ = common.segment_layouts(mask.q_segment_ids)
    _, kv_row = common.segment_layouts(mask.kv_segment_ids)
    inputs["q_ids"] = (q_col, common.block_spec(
        (None, bq, 1), lambda b, n, i, j, *_: (b, i, 0)))
    inputs["kv_ids"] = (kv_row, common.block_spec(
        (None, 1, bkv), lambda b, n, i, j, visits, count, *_: (
            b, 0, kv_block(b, i, j, visits, count))))
  operands = common.KernelOperands(
      scalars=common.scalar_operands(meta.kv_visits, meta.kv_count, mask,
                                     slopes),
      inputs=inputs,
      outputs={"dq": (jax.ShapeDtypeStruct(q.shape, out_dtype), q_spec)},
      scratch={"acc": pltpu.VMEM((bq, hp), jnp.float32)})
  return common.call_kernel(
      functools.partial(_dq_kernel, plan=plan), operands, plan=plan,
      grid=(batch, heads, plan.num_q, plan.kv_steps),
      semantics=("parallel", "parallel", "parallel", "arbitrary"),
      name="jflash_mosaic_tpu_dq")[0]


# ------------------------------------------------------------------- dK/dV
def _dkv_kernel(r: dict, *, plan: Plan, groups: int):
  """One grid step ``(b, h, ki, g, j)``: step ``j`` of key block ``ki``'s
  query block visits, for query head ``g`` of key/value head ``h`` (refs by
  name, see :func:`dkv`)."""
  b, h, ki = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  g, j = pl.program_id(3), pl.program_id(4)
  sb = b if plan.per_batch else 0
  count = r["count"][sb, ki]
  q_block, cls = common.visit_at(r["visits"], r["count"], sb, ki, j)

  @pl.when((g == 0) & (j == 0))
  def _init():
    r["dk_acc"][...] = jnp.zeros(r["dk_acc"].shape, jnp.float32)
    r["dv_acc"][...] = jnp.zeros(r["dv_acc"].shape, jnp.float32)

  common.when_visited(count, j, cls, functools.partial(
      _dkv_step, r, plan=plan, b=b, n=h * groups + g, ki=ki,
      q_block=q_block))

  @pl.when((g == groups - 1) & (j == plan.q_steps - 1))
  def _finish():
    r["dk"][...] = (r["dk_acc"][...] * jnp.float32(plan.scale)).astype(
        r["dk"].dtype)
    r["dv"][...] = r["dv_acc"][...].astype(r["dv"].dtype)


def _dkv_step(r: dict, masked: bool, *, plan: Plan, b, n, ki,
              q_block) -> None:
  """Adds one transposed tile's ``P.T @ dO`` and ``dS.T @ Q`` to the dV and
  dK accumulators (query head ``n``)."""
  q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
  q_start, kv_start = q_block * plan.block_q, ki * plan.block_kv
  s, tanh = common.logits(k, q, plan)  # [bkv, bq]
  s = common.add_alibi(s, r, b=b, n=n, q_start=q_start, kv_start=kv_start,
                       transposed=True)
  visible = None
  if masked:
    s, visible = common.apply_mask(
        s, plan, r, b=b, q_start=q_start, kv_start=kv_start,
        transposed=True)
    if plan.q_tail:
      q = common.zero_rows_past(q, q_start, plan.rules.q_len)
      do = common.zero_rows_past(do, q_start, plan.rules.q_len)
  p = jnp.exp(s - r["lse"][...])  # lse row [1, bq]
  if visible is not None:
    # The statistics past T are unspecified.
    p = jnp.where(visible, p, jnp.float32(0))
  r["dv_acc"][...] += lax.dot_general(
      p.astype(do.dtype), do, common.NN_DIMS,
      precision=common.precision_for(do.dtype),
      preferred_element_type=jnp.float32)
  dp = lax.dot_general(v, do, common.NT_DIMS,
                       precision=common.precision_for(v.dtype),
                       preferred_element_type=jnp.float32)
  ds = common.score_gradient(p, dp, r["delta"][...], tanh, visible)
  r["dk_acc"][...] += lax.dot_general(
      ds.astype(q.dtype), q, common.NN_DIMS,
      precision=common.precision_for(q.dtype),
      preferred_element_type=jnp.float32)


def dkv(q: Array, k: Array, v: Array, do: Array, lse: Array, delta: Array,
        mask: masks.AttentionMask, slopes: Array | None, meta: Metadata,
        plan: Plan, out_dtype) -> tuple[Array, Array]:
  """dK and dV on kernel-layout operands (shapes as for :func:`dq`).

  Returns:
    ``dk``, ``dv`` ``[B, K, S, Hp]``.
  """
  batch, heads, _, hp = q.shape
  kv_heads = k.shape[1]
  groups = heads // kv_heads
  bq, bkv = plan.block_q, plan.block_kv

  def q_block(b, ki, j, visits, count):
    sb = b if plan.per_batch else 0
    return common.visit_at(visits, count, sb, ki, j)[0]

  def q_map(b, h, ki, g, j, visits, count, *_):
    return b, h * groups + g, q_block(b, ki, j, visits, count), 0

  def row_map(b, h, ki, g, j, visits, count, *_):
    return b, h * groups + g, 0, q_block(b, ki, j, visits, count)

  def kv_map(b, h, ki, g, j, *_):
    return b, h, ki, 0

  q_spec = common.block_spec((None, None, bq, hp), q_map)
  kv_spec = common.block_spec((None, None, bkv, hp), kv_map)
  row_spec = common.block_spec((None, None, 1, bq), row_map)
  inputs = {"q": (q, q_spec), "k": (k, kv_spec), "v": (v, kv_spec),
            "do": (do, q_spec), "lse": (lse, row_spec),
            "delta": (delta, row_spec)}
  if plan.has_segments:
    _, q_row = common.segment_layouts(mask.q_segment_ids)
    kv_col, _ = common.segment_layouts(mask.kv_segment_ids)
    inputs["q_ids"] = (q_row, common.block_spec(
        (None, 1, bq), lambda b, h, ki, g, j, visits, count, *_: (
            b, 0, q_block(b, ki, j, visits, count))))
    inputs["kv_ids"] = (kv_col, common.block_spec(
        (None, bkv, 1), lambda b, h, ki, g, j, *_: (b, ki, 0)))
  operands = common.KernelOperands(
      scalars=common.scalar_operands(meta.q_visits, meta.q_count, mask,
                                     slopes),
      inputs=inputs,
      outputs={"dk": (jax.ShapeDtypeStruct(k.shape, out_dtype), kv_spec),
               "dv": (jax.ShapeDtypeStruct(v.shape, out_dtype), kv_spec)},
      scratch={"dk_acc": pltpu.VMEM((bkv, hp), jnp.float32),
               "dv_acc": pltpu.VMEM((bkv, hp), jnp.float32)})
  dk, dv = common.call_kernel(
      functools.partial(_dkv_kernel, plan=plan, groups=groups), operands,
      plan=plan, grid=(batch, kv_heads, plan.num_kv, groups, plan.q_steps),
      semantics=("parallel", "parallel", "parallel", "arbitrary",
                 "arbitrary"),
      name="jflash_mosaic_tpu_dkv")
  return dk, dv
