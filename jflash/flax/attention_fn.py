"""``attention_fn``: jflash attention for Flax's attention modules.

Pass :func:`attention_fn` as ``attention_fn=`` to
``flax.linen.MultiHeadDotProductAttention`` or ``flax.nnx.MultiHeadAttention``.
It accepts every keyword those modules pass and computes exact attention with
:func:`jflash.dot_product_attention`.

Differences from Flax's own attention (what is honoured, what is not):

* Inputs: any number of leading batch dims ``[batch..., T, N, H]``; they are
  flattened to one batch axis and restored.  ``mask`` / ``bias`` broadcastable
  to ``[batch..., N, T, S]`` are flattened the same way.  A non-boolean mask
  (Flax's ``make_causal_mask`` / ``make_attention_mask`` give float32) is
  visible where nonzero, as in Flax.  ``dtype`` promotes query, key and value
  as Flax does.  A value head dim other than the query/key one is supported
  (zero padding, exact).
* ``force_fp32_for_softmax``: honoured; jflash's softmax is always float32.
* A query row that sees no key at all (for example a padded query under
  ``make_attention_mask``) returns **zeros**; Flax returns the mean of the
  values there.  Rows with at least one visible key agree.
* **Fallback.**  jflash cannot apply attention-weight dropout
  (``dropout_rate > 0`` and not ``deterministic``), sow the attention weights
  (``module`` given), honour ``precision`` or custom
  ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum``.  For those the
  call falls back to Flax's own implementation with a ``UserWarning`` naming
  the argument: ``flax.linen.dot_product_attention`` when ``module`` is a
  Linen module or a Linen-only option is set (``precision``, the einsums,
  ``force_fp32_for_softmax``), else ``flax.nnx.dot_product_attention``.  The
  fallback computes exactly what Flax would (same dropout bits for the same
  ``dropout_rng``).
* The fallback cannot express jflash-only features in general, so a fallback
  combined with ``scale``, ``segment_ids``, ``query_seq_lengths``,
  ``key_value_seq_lengths``, ``local_window_size`` or ``logits_soft_cap``
  raises ``NotImplementedError`` naming both arguments; nothing is silently
  dropped.
* ``input_positions`` (NNX's RoPE hook) raises ``NotImplementedError``: apply
  RoPE to query and key before attention.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.dtypes import promote_dtype

import jflash

Array = jax.Array

JFLASH_ONLY = ("scale", "segment_ids", "query_seq_lengths",
               "key_value_seq_lengths", "local_window_size", "logits_soft_cap")
"""Keyword arguments that Flax's fallback implementation cannot express."""


def fallback_reason(*, dropout_rate: float, deterministic: bool,
                    module: Any, precision: Any,
                    qk_attn_weights_einsum: Any = None,
                    attn_weights_value_einsum: Any = None) -> str | None:
  """Why these arguments need Flax's own attention, or None if jflash serves
  them.  The first reason names the argument responsible."""
  if dropout_rate > 0.0 and not deterministic:
    return (f"dropout_rate={dropout_rate} with deterministic=False (attention "
            "weight dropout)")
  if module is not None:
    return "module (sowing attention weights, sow_weights=True)"
  if precision is not None:
    return f"precision={precision!r}"
  if (qk_attn_weights_einsum is not None
      or attn_weights_value_einsum is not None):
    return "qk_attn_weights_einsum / attn_weights_value_einsum"
  return None


def _flatten_batch(x: Array | None, name: str, batch_shape: tuple[int, ...],
                   ) -> Array | None:
  """``x`` broadcastable to ``[batch..., N, T, S]`` -> ``[B|1, N|1, T|1, S|1]``
  with the batch dims flattened consistently with the inputs."""
  if x is None:
    return None
  x = jnp.asarray(x)
  nb = len(batch_shape)
  if x.ndim > nb + 3:
    raise ValueError(f"{name} must be broadcastable to [batch..., N, T, S] "
                     f"with batch {batch_shape}, got shape {x.shape}")
  x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
  lead, tail = x.shape[:nb], x.shape[nb:]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + tail)
  if lead != batch_shape:
    x = jnp.broadcast_to(x, batch_shape + tail)
  return x.reshape((math.prod(batch_shape),) + tail)


def _flatten_ids(x: Any, name: str, batch_shape: tuple[int, ...],
                 trailing: int) -> Any:
  """``[batch..., *rest]`` -> ``[B, *rest]`` (``trailing`` = len(rest))."""
  if x is None:
    return None
  if isinstance(x, (tuple, list)):
    return tuple(_flatten_ids(e, name, batch_shape, trailing) for e in x)
  x = jnp.asarray(x)
  if x.shape[:x.ndim - trailing] != batch_shape:
    raise ValueError(f"{name} must have batch dims {batch_shape} (matching "
                     f"query), got shape {x.shape}")
  return x.reshape((math.prod(batch_shape),) + x.shape[x.ndim - trailing:])


def _flax_fallback(query, key, value, bias, mask, *, broadcast_dropout,
                   dropout_rng, dropout_rate, deterministic, dtype, precision,
                   module, force_fp32_for_softmax, qk_attn_weights_einsum,
                   attn_weights_value_einsum, is_causal) -> Array:
  """Flax's own attention for what jflash cannot do (see module docstring)."""
  einsums = (qk_attn_weights_einsum is not None
             or attn_weights_value_einsum is not None)
  fp32 = force_fp32_for_softmax and query.dtype != jnp.float32
  if isinstance(module, nnx.Module) or (
      module is None and not (einsums or fp32 or precision is not None)):
    if einsums or fp32:
      raise NotImplementedError(
          "qk_attn_weights_einsum / attn_weights_value_einsum / "
          "force_fp32_for_softmax need flax.linen.dot_product_attention, "
          "which cannot sow into an NNX module")
    return nnx.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        deterministic=deterministic, dtype=dtype, precision=precision,
        module=module, is_causal=is_causal)
  if is_causal:  # linen's function has no is_causal: fold it into the mask.
    t, s = query.shape[-3], key.shape[-3]
    causal = jnp.tril(jnp.ones((t, s), jnp.bool_))
    mask = causal if mask is None else jnp.logical_and(mask, causal)
  groups = query.shape[-2] // key.shape[-2]
  if groups > 1:  # GQA: query head n reads key/value head n // groups.
    key = jnp.repeat(key, groups, axis=-2)
    value = jnp.repeat(value, groups, axis=-2)
  return nn.dot_product_attention(
      query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
      dropout_rng=dropout_rng, dropout_rate=dropout_rate,
      deterministic=deterministic, dtype=dtype, precision=precision,
      module=module, force_fp32_for_softmax=force_fp32_for_softmax,
      qk_attn_weights_einsum=qk_attn_weights_einsum,
      attn_weights_value_einsum=attn_weights_value_einsum)


def attention_fn(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
    is_causal: bool = False,
    input_positions: Array | None = None,
    *,
    scale: float | None = None,
    segment_ids: Array | tuple[Array, Array] | None = None,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    implementation: str | Sequence[str] | None = None,
) -> Array:
  """Flax-compatible attention computed by :func:`jflash.dot_product_attention`.

  Shapes: ``query [batch..., T, N, H]``, ``key [batch..., S, K, H]``,
  ``value [batch..., S, K, Hv]`` (``N % K == 0``); ``bias`` and ``mask``
  broadcastable to ``[batch..., N, T, S]``.

  Args:
    query, key, value, bias, mask, broadcast_dropout, dropout_rng,
    dropout_rate, deterministic, dtype, precision, module,
    force_fp32_for_softmax, qk_attn_weights_einsum,
    attn_weights_value_einsum, is_causal: as in ``flax.linen`` /
      ``flax.nnx.dot_product_attention``; a mask is visible where nonzero.
      Dropout, ``module``, ``precision`` and the einsums fall back to Flax
      (module docstring).
    input_positions: must be None (apply RoPE before attention).
    scale: multiplies ``query . key``; default ``1 / sqrt(H)``.
    segment_ids: int ``[batch..., T]`` or a pair ``([batch..., T],
      [batch..., S])``.
    query_seq_lengths, key_value_seq_lengths: int ``[batch...]``.
    local_window_size, logits_soft_cap, implementation: as in
      :func:`jflash.dot_product_attention`.

  Returns:
    ``[batch..., T, N, Hv]`` in the promoted dtype.

  Raises:
    NotImplementedError: ``input_positions`` given, or a fallback is needed
      together with a jflash-only argument.
  """
  if input_positions is not None:
    raise NotImplementedError(
        "jflash.flax.attention_fn: input_positions is not supported; apply "
        "RoPE (or any position encoding) to query and key before attention")
  query, key, value = promote_dtype(query, key, value, dtype=dtype)
  reason = fallback_reason(
      dropout_rate=dropout_rate, deterministic=deterministic, module=module,
      precision=precision, qk_attn_weights_einsum=qk_attn_weights_einsum,
      attn_weights_value_einsum=attn_weights_value_einsum)
  if reason is not None:
    given = dict(scale=scale, segment_ids=segment_ids,
                 query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths,
                 local_window_size=local_window_size,
                 logits_soft_cap=logits_soft_cap)
    blocking = [name for name in JFLASH_ONLY if given[name] is not None]
    if blocking:
      raise NotImplementedError(
          f"jflash.flax.attention_fn: {reason} needs Flax's own attention, "
          f"which cannot express {', '.join(blocking)}; drop one of them")
    warnings.warn(
        f"jflash.flax.attention_fn: {reason} is not supported by jflash; "
        "falling back to Flax's dot_product_attention", stacklevel=2)
    return _flax_fallback(
        query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        deterministic=deterministic, dtype=dtype, precision=precision,
        module=module, force_fp32_for_softmax=force_fp32_for_softmax,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum,
        is_causal=is_causal)

  if query.ndim < 3 or not query.ndim == key.ndim == value.ndim:
    raise ValueError("query, key and value must be [batch..., T, N, H] with "
                     f"the same rank, got shapes {query.shape}, {key.shape}, "
                     f"{value.shape}")
  batch_shape = query.shape[:-3]
  if not key.shape[:-3] == value.shape[:-3] == batch_shape:
    raise ValueError("query, key and value batch dims must match, got shapes "
                     f"{query.shape}, {key.shape}, {value.shape}")
  b = math.prod(batch_shape)
  q, k, v = (x.reshape((b,) + x.shape[-3:]) for x in (query, key, value))
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      mask = mask.astype(jnp.bool_)  # Flax: nonzero means visible.
  head_dim, v_dim = q.shape[-1], v.shape[-1]
  if v_dim != head_dim:  # jflash wants key.shape == value.shape: pad exactly.
    if scale is None:
      scale = 1.0 / math.sqrt(head_dim)
    width = max(head_dim, v_dim)
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
    q, k, v = pad(q), pad(k), pad(v)
  out = jflash.dot_product_attention(
      q, k, v, _flatten_batch(bias, "bias", batch_shape),
      _flatten_batch(mask, "mask", batch_shape), scale=scale,
      is_causal=bool(is_causal),
      query_seq_lengths=_flatten_ids(query_seq_lengths, "query_seq_lengths",
                                     batch_shape, 0),
      key_value_seq_lengths=_flatten_ids(
          key_value_seq_lengths, "key_value_seq_lengths", batch_shape, 0),
      local_window_size=local_window_size,
      segment_ids=_flatten_ids(segment_ids, "segment_ids", batch_shape, 1),
      logits_soft_cap=logits_soft_cap, implementation=implementation)
  return out[..., :v_dim].reshape(batch_shape + out.shape[1:3] + (v_dim,))

