"""Differentiable attention from the three ``mosaic_tpu`` kernels.

:func:`attention` takes caller-layout arrays (``[B, T, N, H]``), puts them
in kernel layout, runs the forward kernel and, through ``jax.custom_vjp``,
the dQ and dK/dV kernels.  The tile visits are computed once per call
(:func:`jflash.backends.mosaic_tpu.common.metadata`) and saved for the
backward pass, so all three kernels walk the same schedule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jflash import masks
from jflash.backends.mosaic_tpu import backward, common, forward
from jflash.backends.mosaic_tpu.common import Metadata, Plan

Array = jax.Array


def _kernel_dtype(dtype):
  """float16 runs through the float32 kernels (the TPU has no float16
  matmul); float32 and bfloat16 run natively."""
  return jnp.float32 if dtype == jnp.float16 else dtype


def _run_forward(q, k, v, mask, meta: Metadata, plan: Plan, out_dtype):
  kdt, hp = _kernel_dtype(q.dtype), plan.head_dim
  results = forward.forward(
      common.to_kernel_layout(q.astype(kdt), hp),
      common.to_kernel_layout(k.astype(kdt), hp),
      common.to_kernel_layout(v.astype(kdt), hp), mask, meta, plan,
      out_dtype)
  out = common.from_kernel_layout(results[0], q.shape[3])
  lse = common.rows_from_kernel(results[1])
  return out, lse, results[2:]


def _run_backward(q, k, v, mask, meta: Metadata, plan: Plan, out, lse,
                  d_out, d_lse):
  kdt, hp = _kernel_dtype(q.dtype), plan.head_dim
  # delta_i = sum_h dO_ih O_ih - dlse_i: the row term of the softmax
  # derivative, including the logsumexp's own cotangent.
  delta = jnp.einsum("btnh,btnh->btn", d_out.astype(jnp.float32),
                     out.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  delta = delta - d_lse.astype(jnp.float32)
  lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
  args = (common.to_kernel_layout(q.astype(kdt), hp),
          common.to_kernel_layout(k.astype(kdt), hp),
          common.to_kernel_layout(v.astype(kdt), hp),
          common.to_kernel_layout(d_out.astype(kdt), hp),
          common.rows_to_kernel(lse), common.rows_to_kernel(delta),
          mask, meta, plan)
  dq_results = backward.dq(*args, out_dtype=kdt)
  dkv_results = backward.dkv(*args, out_dtype=kdt)
  h = q.shape[3]
  dq = common.from_kernel_layout(dq_results[0], h).astype(q.dtype)
  dk = common.from_kernel_layout(dkv_results[0], h).astype(k.dtype)
  dv = common.from_kernel_layout(dkv_results[1], h).astype(v.dtype)
  return dq, dk, dv, dq_results[1:], dkv_results[2:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention(q: Array, k: Array, v: Array, mask: masks.AttentionMask,
              plan: Plan) -> tuple[Array, Array]:
  """``(out [B, T, N, H], logsumexp [B, T, N] float32)``, both
  differentiable in ``q``, ``k`` and ``v``."""
  out, lse, _ = _run_forward(q, k, v, mask, common.metadata(mask, plan), plan,
                             _kernel_dtype(q.dtype))
  return out.astype(q.dtype), lse


def _attention_fwd(q, k, v, mask, plan):
  meta = common.metadata(mask, plan)
  # The backward pass takes delta from a float32 output: one rounded to
  # bfloat16 would cost dQ and dK several times its rounding error.
  out, lse, _ = _run_forward(q, k, v, mask, meta, plan, jnp.float32)
  return (out.astype(q.dtype), lse), (q, k, v, mask, meta, out, lse)


def _attention_bwd(plan, residuals, cotangents):
  q, k, v, mask, meta, out, lse = residuals
  d_out, d_lse = cotangents
  dq, dk, dv, _, _ = _run_backward(q, k, v, mask, meta, plan, out, lse,
                                   d_out, d_lse)
  return dq, dk, dv, None


attention.defvjp(_attention_fwd, _attention_bwd)


def tile_visits(q: Array, k: Array, v: Array, mask: masks.AttentionMask,
                plan: Plan) -> dict[str, Array]:
  """Runs the three kernels with visit counters (``plan.count_visits``
  must be set) and returns how many tiles each computed, per grid row:
  ``forward`` and ``dq`` ``[B, N, nq]``, ``dkv`` ``[B, K, nk]`` (summed over
  the query heads of each key/value head)."""
  if not plan.count_visits:
    raise ValueError("tile_visits needs a plan with count_visits=True")
  meta = common.metadata(mask, plan)
  out, lse, (fwd_count,) = _run_forward(q, k, v, mask, meta, plan,
                                        jnp.float32)
  _, _, _, (dq_count,), (dkv_count,) = _run_backward(
      q, k, v, mask, meta, plan, out, lse, jnp.ones_like(out),
      jnp.zeros_like(lse))
  return {"forward": fwd_count[..., 0, 0], "dq": dq_count[..., 0, 0],
          "dkv": dkv_count[..., 0, 0]}
