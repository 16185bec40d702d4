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
  (zero padding, exact); query and key head dims must match.
* Shape errors are ``ValueError`` starting with Flax's own words
  (``flax.nnx.dot_product_attention``: "k, v lengths must match, but got
  ...", "q, k depths must match, ...") followed by the shapes received.
* ``segment_ids`` is one int array ``[batch..., T]`` or a pair ``(q_ids
  [batch..., T], kv_ids [batch..., S])``.  A pair is a tuple, or a list of
  two arrays; any other list (nested Python numbers) is one array of ids, read
  as ``np.asarray`` reads it.  Lengths accept lists as arrays.
* ``force_fp32_for_softmax``: honoured; jflash's softmax is always float32.
* A query row that sees no key at all (for example a padded query under
  ``make_attention_mask``) returns **zeros**; Flax returns the mean of the
  values there.  Rows with at least one visible key agree.
* **Fallback.**  jflash cannot compute complex inputs, apply
  attention-weight dropout (``dropout_rate > 0`` and not ``deterministic``),
  sow the attention weights (``module`` given), honour ``precision`` or
  custom ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum``.  For
  those the call falls back to Flax's own implementation with a
  ``UserWarning`` naming the argument, attributed to the caller's line:
  ``flax.linen.dot_product_attention`` when ``module`` is a Linen module, the
  inputs are complex or a Linen-only option is set (``precision``, the
  einsums, ``force_fp32_for_softmax``), else
  ``flax.nnx.dot_product_attention``.  The fallback computes exactly what
  Flax would (same dropout bits for the same ``dropout_rng``).
* The fallback cannot express jflash-only features in general, so a fallback
  combined with ``scale``, ``segment_ids``, ``query_seq_lengths``,
  ``key_value_seq_lengths``, ``local_window_size``, ``mask_fn``,
  ``logits_soft_cap``, ``alibi_slopes`` or ``attention_sinks`` raises ``NotImplementedError`` naming both arguments;
  nothing is silently dropped.
* ``input_positions`` (NNX's RoPE hook) raises ``NotImplementedError``: apply
  RoPE to query and key before attention.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen.dtypes import promote_dtype

import jflash
from jflash.attention import is_segment_pair

Array = jax.Array

JFLASH_ONLY = ("scale", "segment_ids", "query_seq_lengths",
               "key_value_seq_lengths", "local_window_size", "mask_fn",
               "logits_soft_cap", "alibi_slopes", "attention_sinks")
"""Keyword arguments that Flax's fallback implementation cannot express."""

_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep
                   for m in (jflash, flax, jax))


def warn_at_caller(message: str, category: type[Warning]) -> None:
  """``warnings.warn`` attributed to the first frame outside jflash, Flax
  and JAX: the user's line, however many library frames lie between."""
  warnings.warn(message, category, skip_file_prefixes=_LIBRARIES)


def fallback_reason(*, dtype: Any, dropout_rate: float, deterministic: bool,
                    module: Any, precision: Any,
                    qk_attn_weights_einsum: Any = None,
                    attn_weights_value_einsum: Any = None) -> str | None:
  """Why these arguments need Flax's own attention, or None if jflash serves
  them (``dtype``: the promoted dtype of query, key and value).  The first
  reason names the argument responsible."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return f"dtype {jnp.dtype(dtype).name} (complex inputs)"
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


def _check_shapes(query: Array, key: Array, value: Array) -> None:
  """Flax's shape rules, in Flax's words (``flax.nnx.dot_product_attention``)
  followed by what jflash expects."""
  shapes = f"{query.shape}, {key.shape}, {value.shape}"
  layout = (" (jflash.flax.attention_fn takes query [batch..., T, N, H], key "
            "[batch..., S, K, H] and value [batch..., S, K, Hv] with N % K == "
            f"0; got shapes {shapes})")
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError("q, k, v must have same rank, but got "
                     f"{query.ndim}, {key.ndim}, {value.ndim}.{layout}")
  if query.ndim < 3:
    raise ValueError(f"q, k, v must have at least 3 dims.{layout}")
  if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
    raise ValueError(f"q, k, v batch dims must match, but got shapes "
                     f"{shapes}.{layout}")
  if key.shape[-3] != value.shape[-3]:
    raise ValueError(f"k, v lengths must match, but got {key.shape[-3]} and "
                     f"{value.shape[-3]}.{layout}")
  if key.shape[-2] != value.shape[-2]:
    raise ValueError(f"k, v num_heads must match, but got {key.shape[-2]} and "
                     f"{value.shape[-2]}.{layout}")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"q, k depths must match, but got {query.shape[-1]} and "
                     f"{key.shape[-1]}.{layout[:-1]}: only the value's head "
                     "dim Hv may differ from H)")


def _check_broadcastable(x: Any, name: str, target: tuple[int, ...]) -> None:
  """``x`` broadcastable to ``target = [batch..., N, T, S]``."""
  if x is None:
    return
  shape = tuple(np.shape(x))
  padded = (1,) * (len(target) - len(shape)) + shape
  if len(shape) > len(target) or any(
      d not in (1, want) for d, want in zip(padded, target)):
    added = (" (missing leading axes count as size 1)"
             if len(shape) < len(target) else "")
    raise ValueError(f"{name} must be broadcastable to [batch..., N, T, S] = "
                     f"{target}{added}, got shape {shape}")


def _flatten_batch(x: Any, batch_shape: tuple[int, ...]) -> Array | None:
  """``x`` broadcastable to ``[batch..., N, T, S]`` (checked) ->
  ``[B|1, N|1, T|1, S|1]`` with the batch dims flattened like the inputs."""
  if x is None:
    return None
  x = jnp.asarray(x)
  nb = len(batch_shape)
  x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
  lead, tail = x.shape[:nb], x.shape[nb:]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + tail)
  if lead != batch_shape:
    x = jnp.broadcast_to(x, batch_shape + tail)
  return x.reshape((math.prod(batch_shape),) + tail)


def _host_or_device(x: Any) -> Any:
  """JAX arrays stay; anything else becomes a NumPy array with its own
  integer width (``jnp.asarray`` would narrow int64 without x64)."""
  return x if isinstance(x, jax.Array) else np.asarray(x)


def _flatten_ids(x: Any, name: str, layout: str,
                 expected: tuple[int, ...], batch_shape: tuple[int, ...]):
  """``x`` of shape ``expected = batch_shape + rest`` -> ``[B, *rest]``."""
  x = _host_or_device(x)
  if tuple(x.shape) != expected:
    raise ValueError(f"{name} must have shape {layout} = {expected} (the "
                     f"query's batch dims {batch_shape}), got shape "
                     f"{tuple(x.shape)}")
  return x.reshape((math.prod(batch_shape),) + expected[len(batch_shape):])


def _flatten_segment_ids(segment_ids: Any, batch_shape: tuple[int, ...],
                         q_len: int, kv_len: int) -> Any:
  """``[batch..., T]`` or a pair ``([batch..., T], [batch..., S])`` -> the
  same with one flattened batch axis (a pair comes back as a tuple)."""
  if segment_ids is None:
    return None
  if not is_segment_pair(segment_ids):
    if q_len != kv_len:
      raise ValueError(
          "segment_ids as one array [batch..., T] needs T == S (self-"
          f"attention), got T={q_len}, S={kv_len}; pass a tuple "
          "(q_segment_ids [batch..., T], kv_segment_ids [batch..., S])")
    return _flatten_ids(segment_ids, "segment_ids", "[batch..., T]",
                        batch_shape + (q_len,), batch_shape)
  if len(segment_ids) != 2:
    raise ValueError("segment_ids must be one array [batch..., T] or a pair "
                     "(q_segment_ids [batch..., T], kv_segment_ids "
                     f"[batch..., S]), got a tuple of {len(segment_ids)}")
  q_ids, kv_ids = segment_ids
  return (_flatten_ids(q_ids, "segment_ids[0] (q_segment_ids)",
                       "[batch..., T]", batch_shape + (q_len,), batch_shape),
          _flatten_ids(kv_ids, "segment_ids[1] (kv_segment_ids)",
                       "[batch..., S]", batch_shape + (kv_len,), batch_shape))


def _flatten_slopes(slopes: Any, batch_shape: tuple[int, ...],
                    heads: int) -> Any:
  """ALiBi slopes ``[N]`` as given; ``[batch..., N]`` -> ``[b, N]``."""
  if slopes is None or np.ndim(slopes) <= 1:
    return slopes
  slopes = jnp.asarray(slopes)
  if slopes.shape != batch_shape + (heads,):
    raise ValueError(f"alibi_slopes must have shape [N] = ({heads},) or "
                     f"[batch..., N] = {batch_shape + (heads,)}, got "
                     f"{slopes.shape}")
  return slopes.reshape(-1, heads)


def _flatten_lengths(x: Any, name: str, batch_shape: tuple[int, ...]) -> Any:
  if x is None:
    return None
  return _flatten_ids(x, name, "[batch...]", batch_shape, batch_shape)


def _flax_fallback(query, key, value, bias, mask, *, broadcast_dropout,
                   dropout_rng, dropout_rate, deterministic, dtype, precision,
                   module, force_fp32_for_softmax, qk_attn_weights_einsum,
                   attn_weights_value_einsum, is_causal) -> Array:
  """Flax's own attention for what jflash cannot do (see module docstring)."""
  einsums = (qk_attn_weights_einsum is not None
             or attn_weights_value_einsum is not None)
  fp32 = force_fp32_for_softmax and query.dtype != jnp.float32
  # jax.nn, under nnx's function without a module, computes no complex math.
  linen_only = (einsums or fp32 or precision is not None
                or jnp.issubdtype(query.dtype, jnp.complexfloating))
  if isinstance(module, nnx.Module) or (module is None and not linen_only):
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
    mask_fn: Callable[[Array, Array], Array] | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Array | None = None,
    attention_sinks: Array | None = None,
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
      Complex inputs, dropout, ``module``, ``precision`` and the einsums fall
      back to Flax (module docstring).
    input_positions: must be None (apply RoPE before attention).
    scale: multiplies ``query . key``; default ``1 / sqrt(H)``.
    segment_ids: int ``[batch..., T]`` or a pair ``([batch..., T],
      [batch..., S])`` given as a tuple (or a list of two arrays).
    query_seq_lengths, key_value_seq_lengths: int ``[batch...]``.
    local_window_size, mask_fn, logits_soft_cap, attention_sinks,
      implementation: as in :func:`jflash.dot_product_attention` (sinks
      ``[N]``).
    alibi_slopes: ``[N]`` or ``[batch..., N]``, as in
      :func:`jflash.dot_product_attention`.

  Returns:
    ``[batch..., T, N, Hv]`` in the promoted dtype.

  Raises:
    ValueError: shapes that do not fit (Flax's message, then the shapes).
    NotImplementedError: ``input_positions`` given, or a fallback is needed
      together with a jflash-only argument.
  """
  if input_positions is not None:
    raise NotImplementedError(
        "jflash.flax.attention_fn: input_positions is not supported; apply "
        "RoPE (or any position encoding) to query and key before attention")
  query, key, value = promote_dtype(query, key, value, dtype=dtype)
  _check_shapes(query, key, value)
  batch_shape = query.shape[:-3]
  (t, n), s = query.shape[-3:-1], key.shape[-3]
  for x, name in ((bias, "bias"), (mask, "mask")):
    _check_broadcastable(x, name, batch_shape + (n, t, s))
  reason = fallback_reason(
      dtype=query.dtype, dropout_rate=dropout_rate,
      deterministic=deterministic, module=module, precision=precision,
      qk_attn_weights_einsum=qk_attn_weights_einsum,
      attn_weights_value_einsum=attn_weights_value_einsum)
  if reason is not None:
    given = dict(scale=scale, segment_ids=segment_ids,
                 query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths,
                 local_window_size=local_window_size, mask_fn=mask_fn,
                 logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                 attention_sinks=attention_sinks)
    blocking = [name for name in JFLASH_ONLY if given[name] is not None]
    if blocking:
      raise NotImplementedError(
          f"jflash.flax.attention_fn: {reason} needs Flax's own attention, "
          f"which cannot express {', '.join(blocking)}; drop one of them")
    warn_at_caller(
        f"jflash.flax.attention_fn: {reason} is not supported by jflash; "
        "falling back to Flax's dot_product_attention", UserWarning)
    return _flax_fallback(
        query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        deterministic=deterministic, dtype=dtype, precision=precision,
        module=module, force_fp32_for_softmax=force_fp32_for_softmax,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum,
        is_causal=is_causal)

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
      q, k, v, _flatten_batch(bias, batch_shape),
      _flatten_batch(mask, batch_shape), scale=scale,
      is_causal=bool(is_causal),
      query_seq_lengths=_flatten_lengths(query_seq_lengths,
                                         "query_seq_lengths", batch_shape),
      key_value_seq_lengths=_flatten_lengths(
          key_value_seq_lengths, "key_value_seq_lengths", batch_shape),
      local_window_size=local_window_size,
      segment_ids=_flatten_segment_ids(segment_ids, batch_shape, t, s),
      mask_fn=mask_fn, logits_soft_cap=logits_soft_cap,
      alibi_slopes=_flatten_slopes(alibi_slopes, batch_shape, n),
      attention_sinks=attention_sinks, implementation=implementation)
  return out[..., :v_dim].reshape(batch_shape + out.shape[1:3] + (v_dim,))

