"""``jflash.dot_product_attention``: validation, canonical form and dispatch."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jflash.core import dispatch, registry
from jflash.core.call import AttentionCall
from jflash.core.checks import (as_array, bool_flag, canonical_lengths,
                                canonical_alibi_slopes, canonical_mask_fn,
                                canonical_scale,
                                canonical_sinks,
                                canonical_soft_cap,
                                canonical_window, check_floating,
                                compute_dtype, describe, fits_int32,
                                host_fits_int32, integers, is_traced)
from jflash.core.platform import PLATFORMS, host_target, lowering_for
from jflash.core.sinks import apply_sinks
from jflash.masks import AttentionMask
from jflash.parallel import ContextParallel, sharding

Array = jax.Array
ArrayLike = jax.typing.ArrayLike


def _to_4d(x: Array, name: str) -> Array:
  if x.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dims (broadcastable to "
                     f"[B, N, T, S]), got {describe(x)}")
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_broadcastable(x: Array, given: Array, name: str,
                         target: tuple[int, ...]) -> None:
  """``x`` is ``given`` with leading axes of size 1 added; the message shows
  what the caller passed."""
  for size, want in zip(x.shape, target):
    if size not in (1, want):
      raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = "
                       f"{list(target)} (missing leading axes count as size "
                       f"1), got {describe(given)}")


def _dense_ranks(q_ids: Array, kv_ids: Array) -> tuple[Array, Array]:
  """Each batch row's ids replaced by their rank among that row's distinct
  query and key ids: int32, equal exactly where the inputs are equal (and
  in the same order)."""
  q_len = q_ids.shape[1]
  # Ranking sorts along the sequence: explicitly sharded ids are gathered
  # along it (they are a small [B, T + S] int array) and their ranks
  # resharded as the ids came.
  shardings = [_whole_rows(x) for x in (q_ids, kv_ids)]
  q_ids, kv_ids = (x if spec is None else sharding.reshard(x, *spec[1:])
                   for x, spec in zip((q_ids, kv_ids), shardings))
  ids = jnp.concatenate([q_ids, kv_ids], axis=1)
  position = lax.broadcasted_iota(jnp.int32, ids.shape, 1)
  ordered, perm = lax.sort((ids, position), dimension=1, num_keys=1)
  steps = (ordered[:, 1:] != ordered[:, :-1]).astype(jnp.int32)
  rank = jnp.concatenate([jnp.zeros_like(steps[:, :1]),
                          jnp.cumsum(steps, axis=1)], axis=1)
  _, rank = lax.sort((perm, rank), dimension=1, num_keys=1)
  ranks = (rank[:, :q_len], rank[:, q_len:])
  return tuple(x if spec is None else sharding.reshard(x, spec[1], spec[0])
               for x, spec in zip(ranks, shardings))


def _whole_rows(ids: Array) -> tuple[Any, Any, Any] | None:
  """``(sharding spec, mesh, the spec with whole rows)`` of ids explicitly
  sharded along the sequence axis, else None."""
  named = getattr(jax.typeof(ids), "sharding", None)
  spec = getattr(named, "spec", None)
  if spec is None or len(spec) < 2 or spec[1] is None:
    return None
  return spec, named.mesh, jax.P(spec[0], None)


def _host_ranks(q_ids: np.ndarray,
                kv_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Host version of :func:`_dense_ranks` over all rows at once."""
  if np.result_type(q_ids, kv_ids).kind == "f":  # int64 with uint64
    q_ids, kv_ids = q_ids.astype(object), kv_ids.astype(object)
  _, rank = np.unique(np.concatenate([q_ids.ravel(), kv_ids.ravel()]),
                      return_inverse=True)
  rank = rank.astype(np.int32)
  return (rank[:q_ids.size].reshape(q_ids.shape),
          rank[q_ids.size:].reshape(kv_ids.shape))


def _int32_segment_ids(q_ids, kv_ids, batch: int) -> tuple[Array, Array]:
  """Segment ids as int32 with exactly the same equalities between query and
  key ids of each batch row (the only thing segment ids mean).

  int32 and narrower ids are converted as before.  Wider ids are renumbered:
  on the host when both are NumPy arrays (or a NumPy array and a concrete
  JAX array), else by ranking each row's ids on the device.
  """
  host = [isinstance(x, np.ndarray) for x in (q_ids, kv_ids)]
  if all(host):
    if host_fits_int32(q_ids) and host_fits_int32(kv_ids):
      return (jnp.asarray(q_ids.astype(np.int32)),
              jnp.asarray(kv_ids.astype(np.int32)))
    q_ids, kv_ids = _host_ranks(q_ids, kv_ids)
    return jnp.asarray(q_ids), jnp.asarray(kv_ids)
  if any(host):
    device = kv_ids if host[0] else q_ids
    given = q_ids if host[0] else kv_ids
    if host_fits_int32(given):
      given = jnp.asarray(given.astype(np.int32))
    elif jax.config.jax_enable_x64:
      given = jnp.asarray(given)
    elif not is_traced(device):
      return _int32_segment_ids(*(np.asarray(x) if isinstance(x, jax.Array)
                                  else x for x in (q_ids, kv_ids)), batch)
    else:
      raise ValueError(
          "segment_ids: NumPy ids beyond the int32 range cannot be compared "
          "exactly with traced ids without jax_enable_x64; pass both as "
          f"NumPy arrays or both as JAX arrays (got {describe(q_ids)} and "
          f"{describe(kv_ids)})")
    q_ids, kv_ids = (given, device) if host[0] else (device, given)
  if fits_int32(q_ids.dtype) and fits_int32(kv_ids.dtype):
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
  if q_ids.dtype == kv_ids.dtype == jnp.uint32:
    # A bijection of uint32 onto int32 keeps every equality.
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
  common = jnp.promote_types(q_ids.dtype, kv_ids.dtype)
  if (not jnp.issubdtype(common, jnp.integer)
      or (common.itemsize == 8 and not jax.config.jax_enable_x64)):
    raise ValueError(
        f"segment_ids: query ids of dtype {q_ids.dtype} and key ids of dtype "
        f"{kv_ids.dtype} have no common integer dtype to compare them in; "
        "pass both with one dtype")
  if q_ids.shape[1] == 0 or kv_ids.shape[1] == 0:
    return (jnp.zeros(q_ids.shape, jnp.int32),
            jnp.zeros(kv_ids.shape, jnp.int32))
  return _dense_ranks(q_ids.astype(common), kv_ids.astype(common))


def is_segment_pair(segment_ids: Any) -> bool:
  """Whether ``segment_ids`` is a pair ``(q_segment_ids, kv_segment_ids)``:
  a tuple, or a list of two arrays.  Any other list (nested Python numbers)
  is one array of ids, read as ``np.asarray`` reads it."""
  return isinstance(segment_ids, tuple) or (
      isinstance(segment_ids, list) and len(segment_ids) == 2
      and all(hasattr(e, "shape") for e in segment_ids))


def _canonical_segment_ids(segment_ids: Any, batch: int, q_len: int,
                           kv_len: int, unbatched: bool):
  if segment_ids is None:
    return None, None
  if is_segment_pair(segment_ids):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be one array [B, T] or a pair "
                       "(q_segment_ids [B, T], kv_segment_ids [B, S]), got a "
                       f"sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    q_ids = kv_ids = segment_ids
    if q_len != kv_len:
      raise ValueError("a single segment_ids array needs T == S; pass a pair "
                       "(q_segment_ids [B, T], kv_segment_ids [B, S]) for "
                       f"T={q_len}, S={kv_len}")
  result = []
  for ids, name, length in ((q_ids, "q_segment_ids", q_len),
                            (kv_ids, "kv_segment_ids", kv_len)):
    label = f"segment_ids ({name})"
    ids = integers(ids, label)
    want = (length,) if unbatched else (batch, length)
    if unbatched and ids.shape == (1, length):
      ids = ids[0]
    if ids.shape != want:
      layout = "[T]" if name.startswith("q") else "[S]"
      layout = layout if unbatched else layout.replace("[", "[B, ")
      raise ValueError(f"{label} must have shape {layout} = {want}, got "
                       f"{describe(ids)}")
    result.append(ids.reshape(batch, length))
  return _int32_segment_ids(*result, batch)


def _check_shard_segment_ids(segment_ids: Any) -> None:
  """Ids wider than int32 are renumbered per call, which a shard cannot do
  for the whole sequence."""
  pair = segment_ids if is_segment_pair(segment_ids) else (segment_ids,)
  for ids in pair:
    dtype = getattr(ids, "dtype", None)
    if dtype is None:
      dtype = np.asarray(ids).dtype
    if np.issubdtype(dtype, np.integer) and not fits_int32(dtype):
      raise ValueError(
          "segment_ids: with context_parallel.axis_name each call holds one "
          "shard of the sequence, and ids wider than int32 cannot be "
          f"renumbered consistently across shards; got dtype {dtype}; pass "
          "int32 ids")


def _check_parallel(parallel: Any) -> ContextParallel | None:
  if parallel is None or isinstance(parallel, ContextParallel):
    return parallel
  raise ValueError("context_parallel must be None or a "
                   f"jflash.ContextParallel, got {parallel!r}")


def _shards(parallel: ContextParallel | None) -> int:
  """How many shards the local arrays are of (1 unless inside a
  ``shard_map`` with ``axis_name``)."""
  if parallel is None or parallel.axis_name is None:
    return 1
  return parallel.axis_size()


def _canonicalize(query, key, value, bias, mask, *, scale, is_causal,
                  query_seq_lengths, key_value_seq_lengths, local_window_size,
                  segment_ids, logits_soft_cap, alibi_slopes=None,
                  mask_fn=None,
                  return_residual=False,
                  interpret=False,
                  shards: int = 1) -> tuple[AttentionCall, bool]:
  """Validates every argument; returns the canonical call and whether the
  inputs were unbatched ``[T, N, H]``.  ``shards > 1``: the arrays are one
  shard of sequences split over that many devices (lengths are global)."""
  query = as_array(query, "query")
  key = as_array(key, "key")
  value = as_array(value, "value")
  for x, name in ((query, "query"), (key, "key"), (value, "value")):
    check_floating(x, name)
    if x.ndim not in (3, 4):
      raise ValueError(f"{name} must be [B, T, N, H] or [T, N, H] (key and "
                       f"value [B, S, K, H] or [S, K, H]), got {describe(x)}")
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError("query, key and value must have the same rank, got "
                     f"query {describe(query)}, key {describe(key)}, value "
                     f"{describe(value)}")
  if not query.dtype == key.dtype == value.dtype:
    raise ValueError("query, key and value must have the same dtype, got "
                     f"{query.dtype}, {key.dtype}, {value.dtype}")
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  batch, q_len, num_heads, head_dim = query.shape
  if key.shape != value.shape:
    raise ValueError("key and value must have the same shape [B, S, K, H], "
                     f"got key {describe(key)} and value {describe(value)}")
  if key.shape[0] != batch:
    raise ValueError(f"key batch {key.shape[0]} must match query batch "
                     f"{batch} (query {describe(query)}, key {describe(key)})")
  if key.shape[3] != head_dim:
    raise ValueError(f"query head dim {head_dim} must match key head dim "
                     f"{key.shape[3]} (query {describe(query)}, key "
                     f"{describe(key)})")
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  if (num_kv_heads == 0 and num_heads) or (num_kv_heads
                                            and num_heads % num_kv_heads):
    raise ValueError(f"query heads N={num_heads} must be a multiple of key/"
                     f"value heads K={num_kv_heads}")
  target = (batch, num_heads, q_len, kv_len)

  if bias is not None:
    given = as_array(bias, "bias")
    bias = _to_4d(given, "bias")
    check_floating(bias, "bias")
    _check_broadcastable(bias, given, "bias", target)
  if mask is not None:
    given = as_array(mask, "mask")
    mask = _to_4d(given, "mask")
    if mask.dtype != jnp.bool_:
      raise ValueError("mask must be boolean (True = attend); pass an additive "
                       f"mask as bias, or use mask.astype(bool); got "
                       f"{describe(given)}")
    _check_broadcastable(mask, given, "mask", target)
  is_causal = bool_flag(is_causal, "is_causal")
  # The dtype the softmax runs in: scale and cap must be finite there.
  dtype = compute_dtype(query.dtype)
  scale_value = canonical_scale(scale, head_dim, dtype)
  cap = canonical_soft_cap(logits_soft_cap, scale_value, dtype)
  if shards > 1:
    _check_shard_segment_ids(segment_ids)
  q_ids, kv_ids = _canonical_segment_ids(segment_ids, batch, q_len, kv_len,
                                         unbatched)
  attention_mask = AttentionMask(
      batch=batch, q_len=q_len, kv_len=kv_len, is_causal=is_causal,
      window=canonical_window(local_window_size),
      q_lengths=canonical_lengths(query_seq_lengths, "query_seq_lengths",
                                  batch, q_len * shards),
      kv_lengths=canonical_lengths(key_value_seq_lengths,
                                   "key_value_seq_lengths", batch,
                                   kv_len * shards),
      q_segment_ids=q_ids, kv_segment_ids=kv_ids, dense=mask,
      has_offsets=shards > 1, mask_fn=canonical_mask_fn(mask_fn))
  return_residual = bool_flag(return_residual, "return_residual")
  interpret = bool_flag(interpret, "interpret")
  slopes = canonical_alibi_slopes(alibi_slopes, batch, num_heads,
                                  query.dtype, unbatched)
  call = AttentionCall(query, key, value, bias, attention_mask,
                       scale=scale_value, logits_soft_cap=cap,
                       alibi_slopes=slopes,
                       returns_residual=bool(return_residual),
                       interpret=bool(interpret))
  return call, unbatched


def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    mask_fn: Callable[[Array, Array], Array] | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: ArrayLike | None = None,
    attention_sinks: ArrayLike | None = None,
    implementation: str | Sequence[str] | None = None,
    return_residual: bool = False,
    interpret: bool = False,
    context_parallel: ContextParallel | None = None,
) -> Array | tuple[Array, Array]:
  """Exact scaled dot-product attention, a superset of
  ``jax.nn.dot_product_attention``.

  Shapes: ``B`` batch, ``T`` query length, ``S`` key length, ``N`` query
  heads, ``K`` key/value heads (``N % K == 0``: GQA, MQA when ``K == 1``),
  ``H`` head dim.  Every array may also be given without its batch axis
  (``[T, N, H]``), as in ``jax.nn``.

  Args:
    query: ``[B, T, N, H]``.
    key: ``[B, S, K, H]``, same dtype as ``query``.
    value: ``[B, S, K, H]``.
    bias: floating, broadcastable to ``[B, N, T, S]`` (at most 4 dims), added
      to the scaled logits.
    mask: boolean, broadcastable to ``[B, N, T, S]``; True means attend.
    scale: multiplies ``query . key``; default ``1 / sqrt(H)``.
    is_causal: query ``t`` sees keys ``s <= t`` (positions counted from the
      start of each sequence, as in ``jax.nn``).
    query_seq_lengths: int ``[B]``; queries at or past the length see nothing
      (their output is zero).
    key_value_seq_lengths: int ``[B]``; keys at or past the length are hidden.
    local_window_size: ``(left, right)`` or one int for both: query ``t``
      sees keys ``t - left .. t + right``.  Any non-negative ints (a side
      past the sequence hides nothing on that side).
    segment_ids: packed documents: int ``[B, T]`` for self-attention, or a
      pair ``(q_segment_ids [B, T], kv_segment_ids [B, S])``; a query sees
      only keys with the same id.  Any integer dtype; ids are compared
      exactly (64-bit ids are renumbered, never truncated).
    mask_fn: visibility as a function of positions: ``mask_fn(q_pos,
      kv_pos)`` of int32 arrays that broadcast (global positions under
      context parallelism), returning bools, True = attend; written with
      ``jnp`` operations and ANDed with the other rules.  Tiles it hides
      are skipped, and elements are masked only in tiles it hides in part
      (computed while tracing when nothing else depends on the data).
      Ready-made: ``jflash.masks.PrefixLM``, ``ChunkedCausal``,
      ``GlobalAndWindow``, ``Dilated``.  A hashable callable with value
      equality (a frozen dataclass) lets compiled programs be reused.
    logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)`` after
      scale and bias.
    alibi_slopes: floating ``[N]`` or ``[B, N]``: ALiBi (BLOOM, MPT), a
      penalty ``-slope[n] * |t - s|`` added to head ``n``'s logits after
      the soft cap, at the positions ``is_causal`` uses (top-left aligned
      when ``T != S``; global positions under context parallelism).
      :func:`jflash.alibi_slopes` gives the standard slopes.  Constants:
      no derivative is taken with respect to them.
    attention_sinks: floating ``[N]``, one logit per query head that joins
      every row's softmax denominator and carries no value (gpt-oss,
      streaming LLMs): a row's weights are ``exp(l_s) / (sum_s exp(l_s) +
      exp(sink[n]))``.  Differentiable; the logsumexp returned includes it.
      With context parallelism each row counts it once.
    implementation: ``None`` (the best backend for the platform the call is
      traced for; always succeeds), a backend name (``"xla"``,
      ``"cudnn"``, ``"mosaic_gpu"``, ``"mosaic_tpu"``), a configured
      backend object (for example
      ``jflash.backends.XlaBackend(XlaConfig(block_q=256))``), or a
      sequence of those tried in order; a backend that cannot serve the
      call declines and the next is tried.  A mapping from lowering
      platforms to any of these (``{"cpu": None, "tpu": "mosaic_tpu"}``)
      traces the call once per platform named, for a program lowered for
      several platforms.  The platform a call is traced for is the device
      platform of the inputs' mesh or of the ambient mesh, else this
      host's (``jflash.lowering_for`` names another; see
      ``docs/backends.md``).
    return_residual: also return the logsumexp.
    interpret: run the Pallas kernels in Pallas's interpret mode, which works
      on the CPU (slow; for verification and debugging).  ``mosaic_tpu``
      supports it; ``mosaic_gpu`` and ``cudnn`` decline
      (``NotImplementedError``: their kernels cannot be interpreted on the
      CPU); ``xla`` has no Pallas kernels and runs as usual.
    context_parallel: how a call whose sequences are sharded over devices
      is computed (a :class:`jflash.ContextParallel`: ring or all-gather,
      the sequence layout, and inside a ``jax.shard_map`` the mesh axis the
      local arrays are shards along).  Inputs with a sharded sequence axis
      run context parallelism with its defaults when None.  See
      ``docs/scaling.md``.

  All visibility rules combine with logical AND.  A query row that sees no
  key returns zeros and a logsumexp of ``-inf`` (``jax.nn``'s ``xla`` path
  returns an average of the values there instead).

  Returns:
    ``out [B, T, N, H]`` in the query dtype, or ``(out, logsumexp [B, T, N])``
    with ``return_residual=True``.  The logsumexp is of the scaled, biased,
    capped and masked logits, in the query dtype as in ``jax.nn``; unlike
    ``jax.nn`` it is differentiable.  It includes the ALiBi penalty and
    the sinks.

  Raises:
    ValueError: an argument is invalid; the message names it.
    NotImplementedError: no backend among those requested can serve the call
      (only possible with an explicit ``implementation``).
  """
  parallel = _check_parallel(context_parallel)
  call, unbatched = _canonicalize(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
      mask_fn=mask_fn, return_residual=return_residual, interpret=interpret,
      shards=_shards(parallel))
  call, sinks = _with_sinks(call, attention_sinks)
  request = dispatch.parse_request(implementation)
  if _is_empty(call):
    out, lse = _empty_result(call)
  else:
    out, lse, _ = dispatch.attention(call, request, parallel)
  out, lse = apply_sinks(out, lse, sinks)
  if unbatched:
    out, lse = out[0], lse[0]
  if return_residual:
    return out, lse.astype(out.dtype)
  return out


def _with_sinks(call: AttentionCall, attention_sinks: Any
                ) -> tuple[AttentionCall, Array | None]:
  """The call and the canonical sinks; a call with sinks needs the
  backend's logsumexp to be differentiable (:mod:`jflash.core.sinks`)."""
  sinks = canonical_sinks(attention_sinks, call.query.shape[2], call.dtype)
  if sinks is not None:
    call = dataclasses.replace(call, returns_residual=True)
  return call, sinks


def _is_empty(call: AttentionCall) -> bool:
  """Whether any axis of the call is empty (``B, T, S, N`` or ``H`` is 0).

  Such calls are answered by :func:`_empty_result`, not by a backend."""
  return 0 in call.query.shape or call.key.shape[1] == 0


_EMPTY_RESULT_BACKEND = "xla"
"""The name :func:`selected_implementation` gives for calls with an empty
axis (they are computed by plain XLA operations)."""


def _empty_result(call: AttentionCall) -> tuple[Array, Array]:
  """The result of a call with an empty axis, as the reference defines it.

  With ``B``, ``T``, ``S`` or ``N`` empty, no query sees a key (or there is
  no query): zeros and a logsumexp of ``-inf``.  With only ``H == 0`` every
  logit is ``0 + bias``: the output is empty but the logsumexp (and the
  bias gradient through it) is not; the ``xla`` backend computes it with
  one zero column added to the query, key and value (exact: it adds 0 to
  every logit).
  """
  q = call.query
  if 0 in q.shape[:3] or call.key.shape[1] == 0:
    return jnp.zeros_like(q), jnp.full(q.shape[:-1], -jnp.inf,
                                       compute_dtype(q.dtype))
  widths = ((0, 0), (0, 0), (0, 0), (0, 1))
  padded = dataclasses.replace(
      call, query=jnp.pad(q, widths), key=jnp.pad(call.key, widths),
      value=jnp.pad(call.value, widths))
  out, lse = registry.BACKENDS[_EMPTY_RESULT_BACKEND](padded)
  return out[..., :0], lse


def selected_implementation(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    mask_fn: Callable[[Array, Array], Array] | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: ArrayLike | None = None,
    attention_sinks: ArrayLike | None = None,
    implementation: str | Sequence[str] | None = None,
    return_residual: bool = False,
    interpret: bool = False,
    context_parallel: ContextParallel | None = None,
    platform: str | None = None,
    for_training: bool = False,
) -> str:
  """The name of the backend that :func:`dot_product_attention` would use
  for these arguments (same signature).  Traces abstractly; computes
  nothing.

  Args:
    platform: the lowering platform to report the choice for (``"cpu"``,
      ``"cuda"``, ``"rocm"``, ``"tpu"``, or ``"gpu"`` for ``"cuda"``),
      as if traced inside :func:`jflash.lowering_for`; default: the
      platform the call is traced for here.
    for_training: with ``implementation=None``, the backend of a call whose
      derivative is taken (on Hopper GPUs it may differ from the backend of
      a forward-only call; see ``docs/backends.md``).
  """
  if not isinstance(for_training, (bool, np.bool_)):
    raise ValueError(f"for_training must be a bool, got {for_training!r}")
  parallel = _check_parallel(context_parallel)
  request = dispatch.parse_request(implementation)
  scope = contextlib.nullcontext()
  if platform is not None:
    platform = "cuda" if platform == "gpu" else platform
    if platform not in PLATFORMS:
      raise ValueError(f"selected_implementation: unknown platform "
                       f"{platform!r}; known: {list(PLATFORMS) + ['gpu']}")
    host = host_target()
    scope = lowering_for(platform, host.device_kind
                         if host.platform == platform else "")
  chosen = []

  def trace(query, key, value, bias, mask, query_seq_lengths,
            key_value_seq_lengths, segment_ids):
    call, _ = _canonicalize(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
        mask_fn=mask_fn, return_residual=return_residual,
        interpret=interpret, shards=_shards(parallel))
    call, _ = _with_sinks(call, attention_sinks)
    if _is_empty(call):
      chosen.append(_EMPTY_RESULT_BACKEND)
      return 0
    chosen.append(dispatch.attention(call, request, parallel,
                                     for_training=bool(for_training))[2])
    return 0

  with scope:
    jax.eval_shape(trace, query, key, value, bias, mask, query_seq_lengths,
                   key_value_seq_lengths, segment_ids)
  return chosen[0]
