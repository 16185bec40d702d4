"""``MultiHeadAttention`` for Flax NNX, computed by jflash.

A drop-in for ``flax.nnx.MultiHeadAttention``: the same constructor
arguments (GQA through ``num_kv_heads`` included) and the same state
(``query``, ``key``, ``value``, ``out`` and, with ``normalize_qk``,
``query_ln`` / ``key_ln``; ``init_cache`` and the ``cached_key`` /
``cached_value`` / ``cache_index`` decode cache are inherited), so states
transfer either way.  Attention goes through :func:`jflash.flax.attention_fn`,
so dropout and ``sow_weights`` fall back to Flax's own attention with a
warning (see that module's docstring).

The call itself (inputs, decode cache, attention and fallback) is shared
with the other framework's module: see :mod:`jflash.flax.common`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import rnglib
from flax.nnx.module import first_from

from jflash.flax import common
from jflash.flax.attention_fn import attention_fn

Array = jax.Array


class MultiHeadAttention(nnx.MultiHeadAttention):
  """Multi-head attention with jflash kernels.

  Takes every argument of ``flax.nnx.MultiHeadAttention`` (passed through
  unchanged), plus:

  Args:
    implementation, local_window_size, logits_soft_cap: as in
      :func:`jflash.dot_product_attention` (None: best backend, no window, no
      cap).
    attention_sinks: create a parameter ``sinks [num_heads]`` (zeros, in
      ``param_dtype``) joining every row's softmax denominator
      (:func:`jflash.dot_product_attention`'s ``attention_sinks``).

  ``attention_fn`` must be left out: this module exists to run jflash.
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      *args: Any,
      implementation: str | Sequence[Any] | None = None,
      local_window_size: int | tuple[int, int] | None = None,
      logits_soft_cap: float | None = None,
      attention_sinks: bool = False,
      **kwargs: Any,
  ):
    fn = kwargs.pop("attention_fn", None)
    if fn not in (None, nnx.dot_product_attention, attention_fn):
      raise ValueError(
          "jflash.flax.nnx.MultiHeadAttention always uses jflash attention; "
          f"got attention_fn={fn!r}. Use flax.nnx.MultiHeadAttention for a "
          "custom attention_fn")
    super().__init__(num_heads, in_features, *args, attention_fn=attention_fn,
                     **kwargs)
    if isinstance(implementation, list):
      implementation = tuple(implementation)
    if isinstance(local_window_size, list):
      local_window_size = tuple(local_window_size)
    self.implementation = implementation
    self.local_window_size = local_window_size
    self.logits_soft_cap = logits_soft_cap
    self.sinks = (nnx.Param(jnp.zeros((num_heads,), self.param_dtype))
                  if attention_sinks else None)

  def __call__(  # type: ignore[override]
      self,
      inputs_q: Array,
      inputs_k: Array | None = None,
      inputs_v: Array | None = None,
      *,
      mask: Array | None = None,
      deterministic: bool | None = None,
      rngs: rnglib.Rngs | rnglib.RngStream | None = None,
      sow_weights: bool = False,
      decode: bool | None = None,
      is_causal: bool = False,
      out_sharding: Any = None,
      qkv_sharding: Any = None,
      input_positions: Array | None = None,
      segment_ids: Array | tuple[Array, Array] | None = None,
      query_seq_lengths: Array | None = None,
      key_value_seq_lengths: Array | None = None,
  ) -> Array:
    """Projects with ``nnx.LinearGeneral``, attends with jflash, projects back.

    Args:
      inputs_q: ``[batch..., T, F]``.
      inputs_k: ``[batch..., S, F_kv]``; defaults to ``inputs_q``.
      inputs_v: ``[batch..., S, F_kv]``; defaults to ``inputs_k``.
      mask: broadcastable to ``[batch..., N, T, S]``, visible where nonzero.
      deterministic, rngs, sow_weights, decode, out_sharding, qkv_sharding:
        as in ``flax.nnx.MultiHeadAttention`` (dropout and ``sow_weights``
        fall back to Flax's attention).
      is_causal: query ``t`` sees keys ``s <= t`` (ignored in decode steps,
        which are causal by construction).
      input_positions: must be None (apply RoPE before attention).
      segment_ids, query_seq_lengths, key_value_seq_lengths: as in
        :func:`jflash.flax.attention_fn` (packed documents, valid lengths).

    Returns:
      ``[batch..., T, out_features]``.
    """
    if input_positions is not None:
      raise NotImplementedError(
          "jflash.flax.nnx.MultiHeadAttention: input_positions is not "
          "supported; apply RoPE to the inputs before attention")
    if rngs is None:
      rngs = self.rngs
    elif isinstance(rngs, rnglib.Rngs):
      rngs = rngs.dropout
    inputs_k, inputs_v = common.kv_inputs(inputs_q, inputs_k, inputs_v)
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"Incompatible input dimension, got "
                       f"{inputs_q.shape[-1]} but module expects "
                       f"{self.in_features}.")

    # [batch..., T|S, N|K, H]
    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      assert self.query_ln is not None and self.key_ln is not None
      query = self.query_ln(query)
      key = self.key_ln(key)

    decode = first_from(
        decode, self.decode,
        error_msg="No `decode` argument was provided to MultiHeadAttention "
        "as either a __call__ argument, class attribute, or nnx.flag.")
    decode_index = None
    if decode:
      if (self.cached_key is None or self.cached_value is None
          or self.cache_index is None):
        raise ValueError("Autoregressive cache not initialized, call "
                         "``init_cache`` first.")
      decode_index = self.cache_index[...]
      key, value = common.write_cache(
          self.cached_key[...], self.cached_value[...], decode_index, key,
          value, checked=("key", key.shape))
      self.cached_key[...] = key
      self.cached_value[...] = value
      self.cache_index[...] = decode_index + 1

    dropout_rng = None
    if self.dropout_rate > 0.0:
      deterministic = first_from(
          deterministic, self.deterministic,
          error_msg="No `deterministic` argument was provided to "
          "MultiHeadAttention as either a __call__ argument, class "
          "attribute, or nnx.flag.")
      if not deterministic:
        if rngs is None:
          raise ValueError("'rngs' must be provided to __call__ method if "
                           "MultiHeadAttention instance is defined with "
                           "keep_rngs=False.")
        dropout_rng = rngs()
    else:
      deterministic = True
    x = common.attend(
        self, query, key, value, decode_index, mask=mask, is_causal=is_causal,
        dropout_rng=dropout_rng, deterministic=deterministic,
        sow_weights=sow_weights, segment_ids=segment_ids,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        attention_sinks=None if self.sinks is None else self.sinks[...])
    return self.out(x, out_sharding=out_sharding)
