"""The exact reference: materialized logits in float32 (float64 under x64).

This defines the numbers every backend is measured against.  It builds the
whole ``[B, N, T, S]`` logit tensor, so its memory is quadratic in sequence
length: it exists for tests and benchmarks' correctness checks and is never a
dispatch target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jflash.masks import AttentionMask

Array = jax.Array


def reference_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None,
    mask: AttentionMask,
    *,
    scale: float,
    logits_soft_cap: float | None = None,
    alibi_slopes: Array | None = None,
    attention_sinks: Array | None = None,
    compute_dtype=None,
) -> tuple[Array, Array]:
  """Attention on canonical inputs, computed the plain way.

  Args:
    query: ``[B, T, N, H]``.
    key, value: ``[B, S, K, H]`` with ``N % K == 0``.
    bias: ``[B|1, N|1, T|1, S|1]`` or None, added after scaling.
    mask: visibility (see :mod:`jflash.masks`).
    scale: multiplies ``query . key``.
    logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)`` after
      scale and bias.
    alibi_slopes: ``[N]``, ``[B|1, N]`` or None: ``-slope * |t - s|`` at
      the mask's global positions, added after the soft cap.
    attention_sinks: ``[N]`` or None: one more logit per row of head ``n``,
      always visible, whose value is zero (a column of the softmax that
      no key occupies).
    compute_dtype: defaults to float64 when x64 is enabled, else float32.

  Returns:
    ``(out [B, T, N, H], logsumexp [B, T, N])`` in ``compute_dtype``.  Rows
    that see no key give zeros and a logsumexp of ``-inf``.
  """
  if compute_dtype is None:
    compute_dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
  q, k, v = (x.astype(compute_dtype) for x in (query, key, value))
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  groups = num_heads // num_kv_heads
  q = q.reshape(batch, q_len, num_kv_heads, groups, head_dim)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k,
                      precision=lax.Precision.HIGHEST) * scale
  logits = logits.reshape(batch, num_heads, q_len, k.shape[1])
  if bias is not None:
    logits = logits + bias.astype(compute_dtype)
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if alibi_slopes is not None:
    slopes = jnp.asarray(alibi_slopes, compute_dtype).reshape(-1, num_heads)
    t = jnp.arange(q_len)[:, None] + mask.diagonal_shift()
    distance = jnp.abs(t - jnp.arange(k.shape[1])[None, :])
    logits = logits - slopes[:, :, None, None] * distance.astype(compute_dtype)
  visible = mask.visibility()
  logits = jnp.where(visible, logits, -jnp.inf)
  if attention_sinks is not None:
    sink = jnp.broadcast_to(
        attention_sinks.astype(compute_dtype)[None, :, None, None],
        logits.shape[:3] + (1,))
    logits = jnp.concatenate([logits, sink], axis=-1)
    value_pad = ((0, 0), (0, 1), (0, 0), (0, 0))
    v = jnp.pad(v, value_pad)  # the sink's value: zero
  row_max = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
  row_max = jnp.where(jnp.isneginf(row_max), 0.0, row_max)
  weights = jnp.exp(logits - row_max)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  probs = weights / jnp.where(total == 0, 1.0, total)
  # Query head n reads key/value head n // groups (jax.nn's grouping).
  out = jnp.einsum("bnts,bsnh->btnh", probs, jnp.repeat(v, groups, axis=2),
                   precision=lax.Precision.HIGHEST)
  lse = jnp.where(total[..., 0] == 0, -jnp.inf,
                  jnp.log(total[..., 0]) + row_max[..., 0])
  return out, jnp.transpose(lse, (0, 2, 1))
