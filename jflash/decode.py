"""``jflash.decode_attention`` and the cache writes that go with it.

Decoding appends ``T`` new tokens (one, a speculative draft, a small chunk)
to each sequence's key/value cache and attends from their queries to the
cache.  One integer array ``lengths [B]`` describes the cache *after* the
append, for the writes and for the attention alike: sequence ``b`` holds
``lengths[b]`` valid slots, the last ``T`` of them the new tokens, so new
token ``t`` stands at position ``lengths[b] - T + t``.  A generation step
is therefore::

    lengths = lengths + T
    k_pages, v_pages = jflash.append_to_pages(k_pages, v_pages, block_table,
                                              lengths, new_k, new_v)
    out = jflash.decode_attention(q, k_pages, v_pages, lengths,
                                  block_table=block_table)

The visibility rule is :func:`jflash.masks.decode_row_bounds`.  See
``docs/decode.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jflash.core import dispatch
from jflash.core.call import DecodeCall
from jflash.core.sinks import apply_sinks
from jflash.core.checks import (as_array, bool_flag, canonical_lengths,
                                canonical_scale, canonical_sinks,
                                canonical_alibi_slopes, canonical_mask_fn,
                                canonical_soft_cap,
                                canonical_window, check_floating,
                                compute_dtype, describe, integers, to_int32)

Array = jax.Array
ArrayLike = jax.typing.ArrayLike

MAX_NEW_TOKENS = 16
"""The most new tokens per sequence a decode call takes.  The decode
kernels hold the ``G * T`` rows of one key/value head (``G`` query heads
per key/value head) in one tile and read the cache once for all of them;
past 16 tokens a call is a prefill chunk, which
:func:`jflash.dot_product_attention`'s tiled kernels serve better."""


# --------------------------------------------------------------- validation
def _floating(x: Any, name: str, layout: str | None = None) -> Array:
  """A floating array; 4-D (``layout``) when a layout is given."""
  x = as_array(x, name)
  check_floating(x, name)
  if layout is not None and x.ndim != 4:
    raise ValueError(f"{name} must be {layout}, got {describe(x)}")
  return x


def _lengths(lengths: Any, batch: int, capacity: int) -> Array:
  """int32 ``[B]`` clipped to ``[0, capacity]``: the lengths the writes and
  the attention use alike, whatever the dtype given."""
  lengths = canonical_lengths(lengths, "lengths", batch, capacity)
  return jnp.clip(lengths, 0, capacity)


def _block_table(block_table: Any, batch: int | None,
                 num_pages: int) -> Array:
  """int32 ``[B, max_pages]`` (any ``B`` when ``batch`` is None).  Entries
  outside ``[0, P)`` of a wider dtype become -1 or ``P``: outside it
  still."""
  table = integers(block_table, "block_table")
  if table.ndim != 2 or batch not in (None, table.shape[0]):
    expected = "[B, max_pages]" + ("" if batch is None else f" with B={batch}")
    raise ValueError(f"block_table must have shape {expected}, got "
                     f"{describe(table)}")
  return to_int32(table, -1, num_pages)


def _check_cache(query: Array, key: Array, value: Array,
                 paged: bool) -> None:
  layout = ("[P, page_size, K, H] (pages; block_table is given)" if paged
            else "[B, S, K, H]")
  for x, name in ((key, "key_cache"), (value, "value_cache")):
    if x.ndim != 4:
      raise ValueError(f"{name} must be {layout}, got {describe(x)}")
    if x.dtype != query.dtype:
      raise ValueError(f"{name} must have the query's dtype {query.dtype}, "
                       f"got {describe(x)}")
  if key.shape != value.shape:
    raise ValueError("key_cache and value_cache must have the same shape "
                     f"{layout}, got {describe(key)} and {describe(value)}")
  batch, _, num_heads, head_dim = query.shape
  if not paged and key.shape[0] != batch:
    raise ValueError(f"key_cache batch {key.shape[0]} must match the query "
                     f"batch {batch} (query {describe(query)})")
  if paged and 0 in key.shape[:2]:
    raise ValueError("key_cache must hold at least one page of at least one "
                     f"slot [P, page_size, K, H], got {describe(key)}")
  if key.shape[3] != head_dim:
    raise ValueError(f"key_cache head dim {key.shape[3]} must match the "
                     f"query head dim {head_dim}")
  kv_heads = key.shape[2]
  if kv_heads == 0 or num_heads % kv_heads:
    raise ValueError(f"query heads N={num_heads} must be a positive multiple "
                     f"of key/value heads K={kv_heads}")


def _canonical_call(query, key_cache, value_cache, lengths, block_table,
                    scale, local_window_size, logits_soft_cap,
                    alibi_slopes=None, mask_fn=None) -> DecodeCall:
  """Validates every argument of :func:`decode_attention`."""
  query = _floating(query, "query", "[B, T, N, H]")
  batch, num_new, _, head_dim = query.shape
  if not 1 <= num_new <= MAX_NEW_TOKENS:
    raise ValueError(f"query must hold 1 to {MAX_NEW_TOKENS} new tokens per "
                     f"sequence (T), got T={num_new} ({describe(query)}); "
                     "longer blocks are prefill: use "
                     "jflash.dot_product_attention")
  if head_dim == 0:
    raise ValueError(f"query head dim H must be positive, got "
                     f"{describe(query)}")
  key_cache = _floating(key_cache, "key_cache")
  value_cache = _floating(value_cache, "value_cache")
  paged = block_table is not None
  _check_cache(query, key_cache, value_cache, paged)
  if paged:
    num_pages = key_cache.shape[0]
    table = _block_table(block_table, batch, num_pages)
    capacity = table.shape[1] * key_cache.shape[1]
  else:
    table, capacity = None, key_cache.shape[1]
  lengths = _lengths(lengths, batch, capacity)
  dtype = compute_dtype(query.dtype)
  scale_value = canonical_scale(scale, head_dim, dtype)
  return DecodeCall(query, key_cache, value_cache, lengths, table,
                    scale=scale_value,
                    logits_soft_cap=canonical_soft_cap(logits_soft_cap,
                                                       scale_value, dtype),
                    window=canonical_window(local_window_size),
                    alibi_slopes=canonical_alibi_slopes(
                        alibi_slopes, batch, query.shape[2], query.dtype),
                    mask_fn=canonical_mask_fn(mask_fn))


# ------------------------------------------------------------------- public
def decode_attention(
    query: ArrayLike,
    key_cache: ArrayLike,
    value_cache: ArrayLike,
    lengths: ArrayLike,
    *,
    block_table: ArrayLike | None = None,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    mask_fn: Callable[[Array, Array], Array] | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: ArrayLike | None = None,
    attention_sinks: ArrayLike | None = None,
    implementation: str | Sequence[str] | Any | None = None,
    return_residual: bool = False,
    interpret: bool = False,
) -> Array | tuple[Array, Array]:
  """Attention of ``T`` new tokens per sequence against a key/value cache.

  Shapes: ``B`` sequences, ``T`` new tokens each (1 to
  :data:`MAX_NEW_TOKENS`), ``N`` query heads, ``K`` key/value heads
  (``N % K == 0``: GQA, MQA when ``K == 1``), ``H`` head dim, ``S`` cache
  slots per sequence.

  Args:
    query: ``[B, T, N, H]``, the new tokens' queries.
    key_cache, value_cache: ``[B, S, K, H]``, or with ``block_table`` pages
      ``[P, page_size, K, H]`` (``S = max_pages * page_size``); same dtype
      as ``query``.  The new tokens' keys and values must already be
      written (:func:`append_to_pages`, :func:`append_to_cache`).
    lengths: int ``[B]``: valid cache slots of each sequence, the ``T`` new
      tokens included.  New token ``t`` stands at position
      ``lengths[b] - T + t`` and sees the slots from ``0`` (or its window's
      left edge) up to its own position: causal within the new block.
      Slots at or past ``lengths[b]`` are never seen and may hold anything.
      Values are clipped to ``[0, S]``; a token whose position is negative
      (``lengths[b] < T``, e.g. 0) sees nothing: zeros, logsumexp ``-inf``.
      Integer arguments may have any integer dtype (NumPy or JAX arrays,
      with or without ``jax_enable_x64``): values past the int32 range
      mean what the nearest int32 value means.
    block_table: int ``[B, max_pages]`` or None: slot ``s`` of sequence
      ``b`` lives in row ``s % page_size`` of page ``block_table[b, s //
      page_size]``.  Entries of pages that hold no slot a new token sees
      are never dereferenced and may hold anything (-1, stale ids); the
      others must be in ``[0, P)``.
    scale: multiplies ``query . key``; default ``1 / sqrt(H)``.
    local_window_size: ``left`` or ``(left, right)``: the token at position
      ``p`` sees slots ``p - left .. p`` (the right side cannot reach past
      ``p``: the cache holds no later tokens).  Only the window's pages are
      read.
    mask_fn: ``mask_fn(position, slot) -> bool`` of int32 arrays, ANDed
      with the rules above (as in :func:`jflash.dot_product_attention`,
      with the new token's position ``lengths[b] - T + t``).
    logits_soft_cap: logits become ``cap * tanh(logits / cap)`` after
      scaling.
    alibi_slopes: floating ``[N]`` or ``[B, N]``: ALiBi's ``-slope[n] * (p
      - s)`` added to head ``n``'s logit of the token at position ``p`` for
      slot ``s``, after the soft cap (as in
      :func:`jflash.dot_product_attention`).
    attention_sinks: floating ``[N]``: one logit per query head in every
      row's softmax denominator, with no value (as in
      :func:`jflash.dot_product_attention`); the logsumexp returned
      includes it.
    implementation: None (the ``"mosaic_gpu"`` kernel on a Hopper GPU and
      the ``"mosaic_tpu"`` kernel on a TPU where they serve the call, else
      ``"xla"``), a backend name, a decode backend
      object (such as ``jflash.backends.XlaDecodeBackend(
      DecodeConfig(...))``), a sequence of those tried in order, or a
      mapping from lowering platforms to any of these, as for
      :func:`jflash.dot_product_attention`.
      ``"mosaic_gpu"`` is the Hopper kernel (bfloat16/float16, head dims
      64/128/256); ``"mosaic_tpu"`` the Pallas TPU kernel (on a TPU, or
      anywhere with ``interpret=True``); ``"cudnn"`` has no decode kernel
      and declines.
    return_residual: also return the logsumexp.
    interpret: run Pallas kernels in Pallas's interpret mode, which works on
      the CPU (slow; for verification): ``mosaic_tpu`` serves it, ``xla``
      has no Pallas kernels and runs as usual.

  Returns:
    ``out [B, T, N, H]`` in the query dtype, or ``(out, logsumexp [B, T,
    N] float32)`` with ``return_residual`` (float32 whatever the inputs, so
    that results over several caches can be merged exactly).

  Decoding is inference: any derivative (``jax.grad``, ``jax.jvp``)
  raises ``NotImplementedError``.

  Raises:
    ValueError: an argument is invalid; the message names it.
    NotImplementedError: no requested backend serves the call.
  """
  call = _canonical_call(query, key_cache, value_cache, lengths, block_table,
                         scale, local_window_size, logits_soft_cap,
                         alibi_slopes, mask_fn)
  request = dispatch.parse_request(implementation, decode=True)
  return_residual = bool_flag(return_residual, "return_residual")
  call = dataclasses.replace(call, interpret=bool_flag(interpret, "interpret"))
  batch, num_new, num_heads, _ = call.query.shape
  sinks = canonical_sinks(attention_sinks, num_heads, call.dtype)
  if batch == 0 or num_heads == 0:
    out = jnp.zeros(call.query.shape, call.dtype)
    lse = jnp.full((batch, num_new, num_heads), -jnp.inf, jnp.float32)
  else:
    out, lse, _ = dispatch.decode(call, request)
  out, lse = apply_sinks(out, lse, sinks)
  return (out, lse) if return_residual else out


def _new_tokens(new_key: Any, new_value: Any, cache: Array,
                batch: int) -> tuple[Array, Array]:
  """Validated ``new_key`` / ``new_value`` ``[B, T, K, H]``."""
  new_key = _floating(new_key, "new_key", "[B, T, K, H]")
  new_value = _floating(new_value, "new_value", "[B, T, K, H]")
  if new_key.shape != new_value.shape:
    raise ValueError("new_key and new_value must have the same shape [B, T, "
                     f"K, H], got {describe(new_key)} and "
                     f"{describe(new_value)}")
  want = (batch, new_key.shape[1]) + tuple(cache.shape[2:])
  if new_key.shape != want:
    raise ValueError(f"new_key must have shape [B, T, K, H] = [{batch}, T, "
                     f"{cache.shape[2]}, {cache.shape[3]}] (the cache's heads "
                     f"and head dim), got {describe(new_key)}")
  for x, name in ((new_key, "new_key"), (new_value, "new_value")):
    if x.dtype != cache.dtype:
      raise ValueError(f"{name} must have the cache's dtype {cache.dtype}, "
                       f"got {describe(x)}")
  return new_key, new_value


def _caches(key: Any, value: Any, layout: str) -> tuple[Array, Array]:
  key = _floating(key, "key_cache" if "S" in layout else "key_pages", layout)
  value = _floating(value, "value_cache" if "S" in layout else "value_pages",
                    layout)
  if key.shape != value.shape or key.dtype != value.dtype:
    raise ValueError(f"the key and value caches must have the same shape "
                     f"{layout} and dtype, got {describe(key)} and "
                     f"{describe(value)}")
  return key, value


def append_to_pages(key_pages: ArrayLike, value_pages: ArrayLike,
                    block_table: ArrayLike, lengths: ArrayLike,
                    new_key: ArrayLike,
                    new_value: ArrayLike) -> tuple[Array, Array]:
  """Writes ``T`` new tokens' keys and values into a paged cache.

  Args:
    key_pages, value_pages: ``[P, page_size, K, H]``.
    block_table: int ``[B, max_pages]`` (see :func:`decode_attention`).
    lengths: int ``[B]``: each sequence's length *after* the append (the
      array :func:`decode_attention` then takes), clipped to ``[0,
      max_pages * page_size]`` as it clips them: new token ``t`` goes to
      position ``lengths[b] - T + t``.  A length past the capacity thus
      puts the new tokens in the last ``T`` slots, where
      :func:`decode_attention` reads them.
    new_key, new_value: ``[B, T, K, H]``, the pages' dtype.

  Returns:
    The updated ``(key_pages, value_pages)``.  Pure: under ``jax.jit`` with
    the pages donated (``donate_argnums``) XLA updates them in place.
    Tokens whose position is negative (``lengths[b] < T``), or whose
    table entry is outside ``[0, P)``, are not written.  Two
    sequences whose tables share a page must not write the same slot (which
    write lands is unspecified).
  """
  key_pages, value_pages = _caches(key_pages, value_pages,
                                   "[P, page_size, K, H]")
  if 0 in key_pages.shape[:2]:
    raise ValueError("key_pages must hold at least one page of at least one "
                     f"slot [P, page_size, K, H], got {describe(key_pages)}")
  num_pages, page_size = key_pages.shape[:2]
  table = _block_table(block_table, None, num_pages)
  batch, capacity = table.shape[0], table.shape[1] * page_size
  lengths = _lengths(lengths, batch, capacity)
  new_key, new_value = _new_tokens(new_key, new_value, key_pages, batch)
  num_new = new_key.shape[1]
  position = lengths[:, None] - num_new + jnp.arange(num_new, dtype=jnp.int32)
  valid = position >= 0  # and below the capacity: lengths are clipped
  column = jnp.clip(position // page_size, 0, table.shape[1] - 1)
  page = jnp.take_along_axis(table, column, axis=1)
  valid = valid & (page >= 0) & (page < num_pages)
  # An out-of-range page index makes the scatter drop that write.
  page = jnp.where(valid, page, num_pages)
  slot = jnp.where(valid, position % page_size, 0)
  return (key_pages.at[page, slot].set(new_key, mode="drop"),
          value_pages.at[page, slot].set(new_value, mode="drop"))


def append_to_cache(key_cache: ArrayLike, value_cache: ArrayLike,
                    lengths: ArrayLike, new_key: ArrayLike,
                    new_value: ArrayLike) -> tuple[Array, Array]:
  """:func:`append_to_pages` for a contiguous cache ``[B, S, K, H]``: new
  token ``t`` of sequence ``b`` goes to slot ``lengths[b] - T + t``
  (``lengths`` after the append, clipped to ``[0, S]`` as
  :func:`decode_attention` clips them); tokens at negative positions are
  not written."""
  key_cache, value_cache = _caches(key_cache, value_cache, "[B, S, K, H]")
  batch, capacity = key_cache.shape[:2]
  lengths = _lengths(lengths, batch, capacity)
  new_key, new_value = _new_tokens(new_key, new_value, key_cache, batch)
  num_new = new_key.shape[1]
  position = lengths[:, None] - num_new + jnp.arange(num_new, dtype=jnp.int32)
  # Lengths are clipped, so positions lie below the capacity; a negative
  # one becomes the capacity, which the scatter drops.
  position = jnp.where(position >= 0, position, capacity)
  rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
  return (key_cache.at[rows, position].set(new_key, mode="drop"),
          value_cache.at[rows, position].set(new_value, mode="drop"))
