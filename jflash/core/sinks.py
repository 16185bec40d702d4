"""Attention sinks: one logit per head in every row's softmax denominator.

A sink adds ``exp(sink[n])`` to the denominator of each row of head ``n``
and carries no value, so it only scales the row's output down:
``out' = out * exp(lse - lse')`` with ``lse' = logaddexp(lse, sink)``, the
logsumexp over the keys and the sink.  Applied to a backend's ``(out,
lse)`` after the call (after the merge of a context-parallel call's
shards, so each row counts its sink once), it needs nothing of the
kernels but a differentiable logsumexp; its gradient reaches the sinks and,
through ``lse``, the kernels' backward passes.  A row that sees no key
(``lse = -inf``) gets all its weight on the sink: zeros, ``lse' = sink``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def apply_sinks(out: Array, lse: Array, sinks: Array | None
                ) -> tuple[Array, Array]:
  """``(out [B, T, N, H], lse [B, T, N])`` of the keys alone ->
  ``(out, lse)`` with each head's sink (``[N]``) in the denominator; the
  dtypes are kept."""
  if sinks is None:
    return out, lse
  lse_keys = lse.astype(sinks.dtype)
  # A row whose keys and sink are all -inf keeps zeros and -inf, with zero
  # gradients (logaddexp's own derivative is NaN there).
  empty = jnp.isneginf(lse_keys) & jnp.isneginf(sinks)
  total = jnp.where(empty, -jnp.inf, jnp.logaddexp(
      jnp.where(empty, 0.0, lse_keys), jnp.where(empty, 0.0, sinks)))
  weight = jnp.exp(lse_keys - jnp.where(empty, 0.0, total))
  out = (out.astype(weight.dtype) * weight[..., None]).astype(out.dtype)
  return out, total.astype(lse.dtype)
