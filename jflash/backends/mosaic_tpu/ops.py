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


def run_forward(q, k, v, mask, slopes, meta: Metadata, plan: Plan,
                out_dtype):
  """``(out [B, T, N, H] out_dtype, lse [B, T, N] float32)`` without a
  derivative."""
  kdt, hp = _kernel_dtype(q.dtype), plan.head_dim
  out, lse = forward.forward(
      common.to_kernel_layout(q.astype(kdt), hp),
      common.to_kernel_layout(k.astype(kdt), hp),
      common.to_kernel_layout(v.astype(kdt), hp), mask, slopes, meta, plan,
      out_dtype)
  return (common.from_kernel_layout(out, q.shape[3]),
          common.rows_from_kernel(lse))


def run_backward(q, k, v, mask, slopes, meta: Metadata, plan: Plan, out,
                 lse, d_out, d_lse):
  """``(dq, dk, dv)`` from the call's ``out`` and ``lse`` (float32 ``out``
  keeps ``delta`` exact) and their cotangents."""
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
          mask, slopes, meta, plan)
  dq = backward.dq(*args, out_dtype=kdt)
  dk, dv = backward.dkv(*args, out_dtype=kdt)
  h = q.shape[3]
  return (common.from_kernel_layout(dq, h).astype(q.dtype),
          common.from_kernel_layout(dk, h).astype(k.dtype),
          common.from_kernel_layout(dv, h).astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def attention(q: Array, k: Array, v: Array, mask: masks.AttentionMask,
              slopes: Array | None, plan: Plan) -> tuple[Array, Array]:
  """``(out [B, T, N, H], logsumexp [B, T, N] float32)``, both
  differentiable in ``q``, ``k`` and ``v`` (the ALiBi ``slopes [B|1, N]``
  are constants)."""
  out, lse = run_forward(q, k, v, mask, slopes, common.metadata(mask, plan),
                         plan, _kernel_dtype(q.dtype))
  return out.astype(q.dtype), lse


def _attention_fwd(q, k, v, mask, slopes, plan):
  meta = common.metadata(mask, plan)
  # The backward pass takes delta from a float32 output: one rounded to
  # bfloat16 would cost dQ and dK several times its rounding error.
  out, lse = run_forward(q, k, v, mask, slopes, meta, plan, jnp.float32)
  return (out.astype(q.dtype), lse), (q, k, v, mask, slopes, meta, out, lse)


def _attention_bwd(plan, residuals, cotangents):
  q, k, v, mask, slopes, meta, out, lse = residuals
  d_out, d_lse = cotangents
  dq, dk, dv = run_backward(q, k, v, mask, slopes, meta, plan, out, lse,
                            d_out, d_lse)
  return dq, dk, dv, None, None


attention.defvjp(_attention_fwd, _attention_bwd)

