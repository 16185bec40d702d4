"""The part of ``MultiHeadAttention.__call__`` that Linen and NNX share.

Both modules project with their framework's layers and keep their
framework's variables; what they do in between is the same and lives here:
Flax's defaults for ``inputs_k`` / ``inputs_v``, the write of one decode
step into the key/value cache, and the attention call itself (decode
visibility, then :func:`jflash.flax.attention_fn`, which falls back to Flax's
attention where jflash cannot serve the call).

Decode steps run :func:`jflash.decode_attention` with the cache occupancy
as its lengths when nothing else shapes the call (no mask, segment ids or
query lengths, key lengths only without a window, the default, ``xla`` or
``mosaic_gpu`` implementation, equal query and value head dims); otherwise
they express
occupancy as ``key_value_seq_lengths`` (a dense mask row only for a local
window, or when Flax's fallback runs).  Both match the non-decode causal
output token by token.  A query row that sees no key
outputs zeros before the ``out`` projection (Flax: the mean of the values).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype
from jax import lax

from jflash import masks
from jflash.decode import decode_attention
from jflash.flax.attention_fn import attention_fn, fallback_reason

Array = jax.Array


def kv_inputs(inputs_q: Array, inputs_k: Array | None,
              inputs_v: Array | None) -> tuple[Array, Array]:
  """Flax's defaults: ``inputs_k`` is ``inputs_q``, ``inputs_v`` is
  ``inputs_k``; an ``inputs_v`` without an ``inputs_k`` is an error."""
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError(
          "`inputs_k` cannot be None if `inputs_v` is not None. To have both "
          "`inputs_k` and `inputs_v` be the same value, pass in the value to "
          "`inputs_k` and leave `inputs_v` as None. (Got inputs_v of shape "
          f"{inputs_v.shape} and no inputs_k.)")
    inputs_k = inputs_q
  if inputs_v is None:
    inputs_v = inputs_k
  return inputs_k, inputs_v


def write_cache(
    cached_key: Array, cached_value: Array, cache_index: Array, key: Array,
    value: Array, *, checked: tuple[str, tuple[int, ...]],
) -> tuple[Array, Array]:
  """One decode step: ``key`` / ``value`` ``[batch..., 1, K, H]`` written at
  slot ``cache_index`` of the caches ``[batch..., max_length, K, H]``.

  ``checked`` is ``(name, shape)`` of the projection Flax's module compares
  with the cache (Linen: the query, NNX: the key), so the error reads as
  Flax's.

  Returns:
    The updated ``(cached_key, cached_value)``.
  """
  *batch_dims, _, heads, depth = cached_key.shape
  expected = tuple(batch_dims) + (1, heads, depth)
  name, shape = checked
  if expected != tuple(shape):
    raise ValueError(f"Autoregressive cache shape error, expected {name} "
                     f"shape {expected} instead got {tuple(shape)}.")
  zero = jnp.array(0, dtype=lax.dtype(cache_index.dtype))
  indices = (zero,) * len(batch_dims) + (cache_index, zero, zero)
  return (lax.dynamic_update_slice(cached_key, key, indices),
          lax.dynamic_update_slice(cached_value, value, indices))


def attend(
    layer: Any, query: Array, key: Array, value: Array,
    decode_index: Array | None, *,
    mask: Array | None,
    is_causal: bool,
    dropout_rng: Array | None,
    deterministic: bool,
    sow_weights: bool,
    segment_ids: Array | tuple[Array, Array] | None,
    query_seq_lengths: Array | None,
    key_value_seq_lengths: Array | None,
    qk_attn_weights_einsum: Any = None,
    attn_weights_value_einsum: Any = None,
    attention_sinks: Array | None = None,
) -> Array:
  """The modules' attention: ``[batch..., T, N|K, H]`` projections in,
  ``[batch..., T, N, H]`` out; ``attention_sinks`` is the module's sink
  parameter ``[N]`` or None.

  ``layer`` is the calling module: its fields (``dropout_rate``,
  ``broadcast_dropout``, ``dtype``, ``precision``, ``local_window_size``,
  ``logits_soft_cap``, ``implementation`` and, in Linen,
  ``force_fp32_for_softmax``) configure the call, and it receives the
  attention weights when ``sow_weights``.  ``decode_index`` is the cache slot
  of this decode step's single query, or None outside decoding.  The other
  arguments go to :func:`jflash.flax.attention_fn`.
  """
  module = layer if sow_weights else None
  window = layer.local_window_size
  if decode_index is not None:
    dtype = (jnp.result_type(query, key, value) if layer.dtype is None
             else layer.dtype)
    reason = fallback_reason(
        dtype=dtype, dropout_rate=layer.dropout_rate,
        deterministic=deterministic, module=module, precision=layer.precision,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum)
    if reason is None:
      out = decode_step(layer, query, key, value, decode_index, mask=mask,
                        segment_ids=segment_ids,
                        query_seq_lengths=query_seq_lengths,
                        key_value_seq_lengths=key_value_seq_lengths,
                        attention_sinks=attention_sinks)
      if out is not None:
        return out
    mask, key_value_seq_lengths = decode_visibility(
        decode_index, key.shape[-3], key.shape[:-3], mask=mask,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=window, dense=reason is not None)
    window, is_causal = None, False
  return attention_fn(
      query, key, value, mask=mask, dropout_rng=dropout_rng,
      dropout_rate=layer.dropout_rate,
      broadcast_dropout=layer.broadcast_dropout,
      deterministic=deterministic, dtype=layer.dtype,
      precision=layer.precision, module=module,
      force_fp32_for_softmax=getattr(layer, "force_fp32_for_softmax", False),
      qk_attn_weights_einsum=qk_attn_weights_einsum,
      attn_weights_value_einsum=attn_weights_value_einsum,
      is_causal=is_causal, segment_ids=segment_ids,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=window,
      logits_soft_cap=layer.logits_soft_cap, attention_sinks=attention_sinks,
      implementation=layer.implementation)


def decode_step(
    layer: Any, query: Array, key: Array, value: Array, decode_index: Array,
    *, mask: Array | None, segment_ids: Any, query_seq_lengths: Any,
    key_value_seq_lengths: Any, attention_sinks: Array | None = None,
) -> Array | None:
  """One decode step through :func:`jflash.decode_attention`, or None when
  the call needs more than it expresses (the caller then runs
  :func:`jflash.flax.attention_fn` with :func:`decode_visibility`).

  The single query ``[batch..., 1, N, H]`` stands at slot ``decode_index``
  of the written cache ``[batch..., S, K, H]``: lengths ``decode_index +
  1``, or the given key lengths when smaller (without a window the two
  rules agree: the query sees ``s < min(decode_index + 1, length)``).
  """
  window = layer.local_window_size
  kv_lengths = (None if key_value_seq_lengths is None
                else np.asarray(key_value_seq_lengths)
                if not isinstance(key_value_seq_lengths, jax.Array)
                else key_value_seq_lengths)
  batch_shape = query.shape[:-3]
  if (mask is not None or segment_ids is not None
      or query_seq_lengths is not None
      or (kv_lengths is not None
          and (window is not None or kv_lengths.shape != batch_shape
               or not jnp.issubdtype(kv_lengths.dtype, jnp.integer)))
      or layer.implementation not in (None, "xla", "mosaic_gpu")
      or query.shape[-3] != 1 or value.shape[-1] != query.shape[-1]):
    return None
  query, key, value = promote_dtype(query, key, value, dtype=layer.dtype)
  b = math.prod(batch_shape)
  lengths = jnp.full((b,), decode_index + 1, jnp.int32)
  if kv_lengths is not None:
    lengths = jnp.minimum(lengths, jnp.asarray(kv_lengths).reshape(b).clip(
        0, key.shape[-3]).astype(jnp.int32))
  try:
    out = decode_attention(
        query.reshape((b,) + query.shape[-3:]),
        key.reshape((b,) + key.shape[-3:]),
        value.reshape((b,) + value.shape[-3:]), lengths,
        local_window_size=window, logits_soft_cap=layer.logits_soft_cap,
        attention_sinks=attention_sinks, implementation=layer.implementation)
  except NotImplementedError:
    # A named kernel that declines this step (e.g. mosaic_gpu at an odd head
    # dim): the attention path honours the name with its own kernels.
    if layer.implementation is None:
      raise
    return None
  return out.reshape(batch_shape + out.shape[1:])


def decode_visibility(
    cur_index: Array, max_length: int, batch_shape: tuple[int, ...], *,
    mask: Array | None, key_value_seq_lengths: Array | None,
    local_window_size: int | tuple[int, int] | None, dense: bool,
) -> tuple[Array | None, Array | None]:
  """Visibility of one autoregressive decode step, for the modules.

  The single query sits at position ``cur_index`` of a cache of
  ``max_length`` keys: it sees the written slots ``s <= cur_index`` and, with
  a window ``(left, right)``, only ``s >= cur_index - left``.  With ``dense``
  (needed when Flax's fallback will run) everything goes into the mask, as
  Flax does; otherwise occupancy becomes ``key_value_seq_lengths`` and only a
  window adds a mask row.

  Returns:
    ``(mask, key_value_seq_lengths)`` to pass with ``local_window_size=None``
    and ``is_causal=False``.
  """
  row = None
  if local_window_size is not None or dense:
    # Occupancy (s <= cur_index) is the causal rule at position cur_index.
    window = (None if local_window_size is None
              else tuple(local_window_size)
              if isinstance(local_window_size, (tuple, list))
              else (local_window_size, local_window_size))
    row = masks.key_visibility_at(cur_index, max_length, is_causal=True,
                                  window=window)
  if not dense:
    lengths = jnp.full(batch_shape, cur_index + 1, jnp.int32)
    if key_value_seq_lengths is not None:
      lengths = jnp.minimum(lengths, jnp.asarray(key_value_seq_lengths))
    key_value_seq_lengths = lengths
  if row is not None:
    mask = row if mask is None else jnp.logical_and(mask, row)
  return mask, key_value_seq_lengths
