"""``MultiHeadAttention`` for Flax Linen, computed by jflash.

A drop-in for ``flax.linen.MultiHeadDotProductAttention``: the same
constructor fields and the same parameter tree (``query``, ``key``,
``value``, ``out`` and, with ``normalize_qk``, ``query_ln`` / ``key_ln``), so
checkpoints load either way; the same ``decode`` cache variables
(``cached_key``, ``cached_value``, ``cache_index``).  Attention goes through
:func:`jflash.flax.attention_fn`, so dropout and ``sow_weights`` fall back to
Flax's own attention with a warning (see that module's docstring).

The call itself (inputs, decode cache, attention and fallback) is shared
with the other framework's module: see :mod:`jflash.flax.common`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jflash.flax import common
from jflash.flax.attention_fn import attention_fn, warn_at_caller

Array = jax.Array

_DISCUSSION = "https://github.com/google/flax/discussions/3389"


def _kv_inputs(inputs_q: Array, inputs_k: Array | None,
               inputs_v: Array | None, inputs_kv: Array | None,
               ) -> tuple[Array, Array]:
  """Flax Linen's reading of ``inputs_k`` / ``inputs_v`` / ``inputs_kv``:
  the same errors, and the same ``DeprecationWarning``s for ``inputs_kv`` and
  for a square ``[..., S, S]`` array passed positionally where a mask may
  have been meant."""
  if inputs_kv is not None:
    if inputs_k is not None or inputs_v is not None:
      given = [n for n, x in (("inputs_k", inputs_k), ("inputs_v", inputs_v))
               if x is not None]
      raise ValueError(
          "If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must "
          "be None. If `inputs_kv` is not None, both `inputs_k` and "
          "`inputs_v` must be None. We recommend using `inputs_k` and "
          "`inputs_v` args, since `inputs_kv` will be deprecated soon. See "
          f"{_DISCUSSION} for more information. (Got inputs_kv together "
          f"with {' and '.join(given)}.)")
    warn_at_caller(
        "The inputs_kv arg will be deprecated soon. Use inputs_k and "
        f"inputs_v instead. See {_DISCUSSION} for more information.",
        DeprecationWarning)
    inputs_k = inputs_v = inputs_kv
  elif (inputs_k is not None and inputs_v is not None
        and inputs_v.shape[-1] == inputs_v.shape[-2]):
    warn_at_caller(
        f"You are passing an array of shape {inputs_v.shape} to the "
        "`inputs_v` arg, when you may have intended to pass it to the "
        "`mask` arg. As in Flax, the function signature of "
        "MultiHeadDotProductAttention's `__call__` method has changed to "
        "`__call__(inputs_q, inputs_k=None, inputs_v=None, *, "
        "inputs_kv=None, mask=None, deterministic=None)`. Use the kwarg "
        f"`mask` instead. See {_DISCUSSION} and read the docstring for more "
        "information.", DeprecationWarning)
  return common.kv_inputs(inputs_q, inputs_k, inputs_v)


class MultiHeadAttention(nn.MultiHeadDotProductAttention):
  """Multi-head attention with jflash kernels.

  Every field of ``flax.linen.MultiHeadDotProductAttention``, plus:

  Attributes:
    implementation, local_window_size, logits_soft_cap: as in
      :func:`jflash.dot_product_attention` (None: best backend, no window, no
      cap).
    attention_sinks: create a parameter ``sinks [num_heads]`` (initialized
      by ``sinks_init``, zeros by default) joining every row's softmax
      denominator (:func:`jflash.dot_product_attention`'s
      ``attention_sinks``).
    sinks_init: initializer of the sinks.

  ``attention_fn`` must stay the default: this module exists to run jflash.
  """

  implementation: str | Sequence[Any] | None = None
  local_window_size: int | tuple[int, int] | None = None
  logits_soft_cap: float | None = None
  attention_sinks: bool = False
  sinks_init: Any = nn.initializers.zeros_init()

  @nn.compact
  def __call__(  # type: ignore[override]
      self,
      inputs_q: Array,
      inputs_k: Array | None = None,
      inputs_v: Array | None = None,
      *,
      inputs_kv: Array | None = None,
      mask: Array | None = None,
      deterministic: bool | None = None,
      dropout_rng: Array | None = None,
      sow_weights: bool = False,
      is_causal: bool = False,
      segment_ids: Array | tuple[Array, Array] | None = None,
      query_seq_lengths: Array | None = None,
      key_value_seq_lengths: Array | None = None,
  ) -> Array:
    """Projects with ``nn.DenseGeneral``, attends with jflash, projects back.

    Args:
      inputs_q: ``[batch..., T, F]``.
      inputs_k: ``[batch..., S, F]``; defaults to ``inputs_q``.
      inputs_v: ``[batch..., S, F]``; defaults to ``inputs_k``.
      inputs_kv: deprecated alias for ``inputs_k = inputs_v``.
      mask: broadcastable to ``[batch..., N, T, S]``, visible where nonzero.
      deterministic: disables dropout (merged with the field).
      dropout_rng: dropout key; default ``self.make_rng('dropout')``.
      sow_weights: sow the attention weights into ``intermediates`` (falls
        back to Flax's attention).
      is_causal: query ``t`` sees keys ``s <= t`` (ignored in decode steps,
        which are causal by construction).
      segment_ids, query_seq_lengths, key_value_seq_lengths: as in
        :func:`jflash.flax.attention_fn` (packed documents, valid lengths).

    Returns:
      ``[batch..., T, out_features]``.
    """
    if self.attention_fn not in (nn.dot_product_attention, attention_fn):
      raise ValueError(
          "jflash.flax.linen.MultiHeadAttention always uses jflash attention; "
          f"got attention_fn={self.attention_fn!r}. Use "
          "flax.linen.MultiHeadDotProductAttention for a custom attention_fn")
    inputs_k, inputs_v = _kv_inputs(inputs_q, inputs_k, inputs_v, inputs_kv)

    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(
          f"Memory dimension ({qkv_features}) must be divisible by number of "
          f"heads ({self.num_heads}). (qkv_features={self.qkv_features}, "
          f"num_heads={self.num_heads}, inputs_q shape {inputs_q.shape})")
    head_dim = qkv_features // self.num_heads
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype,
        param_dtype=self.param_dtype, features=(self.num_heads, head_dim),
        kernel_init=self.kernel_init, bias_init=self.bias_init,
        use_bias=self.use_bias, precision=self.precision,
        dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls)
    # [batch..., T|S, N, H]
    query = dense(name="query")(inputs_q)
    key = dense(name="key")(inputs_k)
    value = dense(name="value")(inputs_v)
    if self.normalize_qk:
      layer_norm = functools.partial(nn.LayerNorm, use_bias=False,
                                     dtype=self.dtype,
                                     param_dtype=self.param_dtype)
      query = layer_norm(name="query_ln")(query)
      key = layer_norm(name="key_ln")(key)

    decode_index = None
    if self.decode:
      is_initialized = self.has_variable("cache", "cached_key")
      cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape,
                                 key.dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                   value.shape, value.dtype)
      cache_index = self.variable("cache", "cache_index",
                                  lambda: jnp.array(0, dtype=jnp.int32))
      if is_initialized:
        decode_index = cache_index.value
        key, value = common.write_cache(
            cached_key.value, cached_value.value, decode_index, key, value,
            checked=("query", query.shape))
        cached_key.value = key
        cached_value.value = value
        cache_index.value = decode_index + 1

    if self.dropout_rate > 0.0:
      m_deterministic = nn.merge_param("deterministic", self.deterministic,
                                       deterministic)
      if not m_deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      m_deterministic = True
    qk_einsum = (self.qk_attn_weights_einsum_cls()
                 if self.qk_attn_weights_einsum_cls else None)
    av_einsum = (self.attn_weights_value_einsum_cls()
                 if self.attn_weights_value_einsum_cls else None)
    sinks = (self.param("sinks", self.sinks_init, (self.num_heads,),
                        self.param_dtype) if self.attention_sinks else None)
    x = common.attend(
        self, query, key, value, decode_index, mask=mask, is_causal=is_causal,
        dropout_rng=dropout_rng, deterministic=m_deterministic,
        sow_weights=sow_weights, segment_ids=segment_ids,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        qk_attn_weights_einsum=qk_einsum, attn_weights_value_einsum=av_einsum,
        attention_sinks=sinks)
    return nn.DenseGeneral(
        features=features, axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init,
        use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)
