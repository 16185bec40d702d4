"""``jflash.dot_product_attention``: validation, canonical form and dispatch."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jflash.backends import BACKENDS, default_order, dispatch
from jflash.backends.base import AttentionCall, Backend
from jflash.masks import AttentionMask

Array = jax.Array
ArrayLike = jax.typing.ArrayLike

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def _describe(x: Any) -> str:
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None:
    return f"{type(x).__name__} {x!r}"
  return f"shape {tuple(shape)} dtype {dtype}"


def _as_array(x: Any, name: str) -> Array:
  try:
    return jnp.asarray(x)
  except TypeError as err:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}") from err


def _check_floating(x: Array, name: str) -> None:
  if x.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"{name} must have a floating dtype (float16, bfloat16, "
                     f"float32 or float64), got {_describe(x)}")


def _check_integer(x: Array, name: str) -> None:
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must have an integer dtype, got {_describe(x)}")


def _to_4d(x: Array, name: str) -> Array:
  if x.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dims (broadcastable to "
                     f"[B, N, T, S]), got {_describe(x)}")
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_broadcastable(x: Array, name: str, target: tuple[int, ...]) -> None:
  for size, want in zip(x.shape, target):
    if size not in (1, want):
      raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = "
                       f"{list(target)}, got {_describe(x)}")


def _canonical_lengths(x: Any, name: str, batch: int) -> Array | None:
  if x is None:
    return None
  x = _as_array(x, name)
  _check_integer(x, name)
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},), got "
                     f"{_describe(x)}")
  return x.astype(jnp.int32)


def _canonical_segment_ids(segment_ids: Any, batch: int, q_len: int,
                           kv_len: int, unbatched: bool):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
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
    ids = _as_array(ids, label)
    _check_integer(ids, label)
    want = (length,) if unbatched else (batch, length)
    if unbatched and ids.shape == (1, length):
      ids = ids[0]
    if ids.shape != want:
      layout = "[T]" if name.startswith("q") else "[S]"
      layout = layout if unbatched else layout.replace("[", "[B, ")
      raise ValueError(f"{label} must have shape {layout} = {want}, got "
                       f"{_describe(ids)}")
    result.append(ids.reshape(batch, length).astype(jnp.int32))
  return tuple(result)


def _canonical_window(local_window_size: Any) -> tuple[int, int] | None:
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(
      local_window_size, bool):
    window = (int(local_window_size), int(local_window_size))
  elif (isinstance(local_window_size, (tuple, list))
        and len(local_window_size) == 2
        and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                for w in local_window_size)):
    window = (int(local_window_size[0]), int(local_window_size[1]))
  else:
    raise ValueError("local_window_size must be an int or a pair of ints "
                     f"(left, right), got {local_window_size!r}")
  if min(window) < 0:
    raise ValueError("local_window_size must be non-negative, got "
                     f"{local_window_size!r}")
  return window


def _concrete_float(x: Any, name: str) -> float:
  try:
    value = float(x)
  except (TypeError, jax.errors.ConcretizationTypeError) as err:
    raise ValueError(f"{name} must be a Python number (it is part of the "
                     f"compiled kernel), got {_describe(x)}") from err
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}")
  return value


def _is_backend(x: Any) -> bool:
  return (not isinstance(x, str) and callable(x)
          and isinstance(getattr(x, "name", None), str))


def _requested_backends(implementation: Any) -> tuple[Backend, ...] | None:
  """The backends to try, in order; None for the default order of each
  lowering platform."""
  if implementation is None:
    return None
  if isinstance(implementation, str) or _is_backend(implementation):
    entries = (implementation,)
  elif isinstance(implementation, Sequence):
    entries = tuple(implementation)
  else:
    entries = ()
  if not entries or not all(isinstance(e, str) or _is_backend(e)
                            for e in entries):
    raise ValueError("implementation must be None, a backend name, a backend "
                     "object (such as jflash.backends.XlaBackend(config)) or a "
                     f"non-empty sequence of those, got {implementation!r}")
  unknown = [e for e in entries if isinstance(e, str) and e not in BACKENDS]
  if unknown:
    raise ValueError(f"implementation: unknown backend name(s) {unknown}; "
                     f"known: {sorted(BACKENDS)}")
  return tuple(BACKENDS[e] if isinstance(e, str) else e for e in entries)


def _canonicalize(query, key, value, bias, mask, *, scale, is_causal,
                  query_seq_lengths, key_value_seq_lengths, local_window_size,
                  segment_ids, logits_soft_cap,
                  return_residual=False,
                  interpret=False) -> tuple[AttentionCall, bool]:
  """Validates every argument; returns the canonical call and whether the
  inputs were unbatched ``[T, N, H]``."""
  query = _as_array(query, "query")
  key = _as_array(key, "key")
  value = _as_array(value, "value")
  for x, name in ((query, "query"), (key, "key"), (value, "value")):
    _check_floating(x, name)
    if x.ndim not in (3, 4):
      raise ValueError(f"{name} must be [B, T, N, H] or [T, N, H] (key and "
                       f"value [B, S, K, H] or [S, K, H]), got {_describe(x)}")
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError("query, key and value must have the same rank, got "
                     f"query {_describe(query)}, key {_describe(key)}, value "
                     f"{_describe(value)}")
  if not query.dtype == key.dtype == value.dtype:
    raise ValueError("query, key and value must have the same dtype, got "
                     f"{query.dtype}, {key.dtype}, {value.dtype}")
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  batch, q_len, num_heads, head_dim = query.shape
  if key.shape != value.shape:
    raise ValueError("key and value must have the same shape [B, S, K, H], "
                     f"got key {_describe(key)} and value {_describe(value)}")
  if key.shape[0] != batch:
    raise ValueError(f"key batch {key.shape[0]} must match query batch "
                     f"{batch} (query {_describe(query)}, key {_describe(key)})")
  if key.shape[3] != head_dim:
    raise ValueError(f"query head dim {head_dim} must match key head dim "
                     f"{key.shape[3]} (query {_describe(query)}, key "
                     f"{_describe(key)})")
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  if num_kv_heads == 0 or num_heads % num_kv_heads:
    raise ValueError(f"query heads N={num_heads} must be a multiple of key/"
                     f"value heads K={num_kv_heads}")
  target = (batch, num_heads, q_len, kv_len)

  if bias is not None:
    bias = _to_4d(_as_array(bias, "bias"), "bias")
    _check_floating(bias, "bias")
    _check_broadcastable(bias, "bias", target)
  if mask is not None:
    mask = _to_4d(_as_array(mask, "mask"), "mask")
    if mask.dtype != jnp.bool_:
      raise ValueError("mask must be boolean (True = attend); pass an additive "
                       f"mask as bias, or use mask.astype(bool); got "
                       f"{_describe(mask)}")
    _check_broadcastable(mask, "mask", target)
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
  scale_value = (1.0 / math.sqrt(head_dim) if scale is None
                 else _concrete_float(scale, "scale"))
  cap = None
  if logits_soft_cap is not None:
    cap = _concrete_float(logits_soft_cap, "logits_soft_cap")
    if cap <= 0:
      raise ValueError(f"logits_soft_cap must be positive, got {cap}")
  q_ids, kv_ids = _canonical_segment_ids(segment_ids, batch, q_len, kv_len,
                                         unbatched)
  attention_mask = AttentionMask(
      batch=batch, q_len=q_len, kv_len=kv_len, is_causal=bool(is_causal),
      window=_canonical_window(local_window_size),
      q_lengths=_canonical_lengths(query_seq_lengths, "query_seq_lengths",
                                   batch),
      kv_lengths=_canonical_lengths(key_value_seq_lengths,
                                    "key_value_seq_lengths", batch),
      q_segment_ids=q_ids, kv_segment_ids=kv_ids, dense=mask)
  if not isinstance(return_residual, (bool, np.bool_)):
    raise ValueError(f"return_residual must be a bool, got {return_residual!r}")
  if not isinstance(interpret, (bool, np.bool_)):
    raise ValueError(f"interpret must be a bool, got {interpret!r}")
  call = AttentionCall(query, key, value, bias, attention_mask,
                       scale=scale_value, logits_soft_cap=cap,
                       returns_residual=bool(return_residual),
                       interpret=bool(interpret))
  return call, unbatched


def _dispatch(call: AttentionCall, backends: tuple[Backend, ...] | None,
              platform: str | None = None,
              for_training: bool = False) -> tuple[Array, Array, str]:
  """``(out, lse, name of the backend chosen for platform)``.

  ``backends=None`` (``implementation=None``): each lowering platform's
  default orders (:func:`jflash.backends.call_orders`), the branches joined
  in one per-platform call; the name reported is the host's choice.
  With ``platform``, only that platform's order is traced, its training
  order with ``for_training``.
  """
  if platform is not None:
    call = dataclasses.replace(call, platform=platform)
  if dispatch.needs_jax_derivatives(call):
    return dispatch.run_differentiable(call, backends)
  if backends is not None:
    return dispatch.run(call, backends)
  if platform is not None:
    inference, training = dispatch.default_orders(call, platform)
    return dispatch.run(call, training if for_training else inference)
  orders = {p: dispatch.default_orders(call, p) for p in dispatch.PLATFORMS}
  out, lse, names = dispatch.run_per_platform(call, orders)
  host = dispatch.host_platform()
  return out, lse, names.get(host, names.get("cpu"))


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
    logits_soft_cap: float | None = None,
    implementation: str | Sequence[str] | None = None,
    return_residual: bool = False,
    interpret: bool = False,
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
      sees keys ``t - left .. t + right``.
    segment_ids: packed documents: int ``[B, T]`` for self-attention, or a
      pair ``(q_segment_ids [B, T], kv_segment_ids [B, S])``; a query sees
      only keys with the same id.
    logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)`` after
      scale and bias.
    implementation: ``None`` (the best backend for the platform; always
      succeeds), a backend name (``"xla"``, ``"cudnn"``, ``"mosaic_gpu"``,
      ``"mosaic_tpu"``), a configured backend object (for example
      ``jflash.backends.XlaBackend(XlaConfig(block_q=256))``), or a sequence
      of those tried in order; a backend that cannot serve the call declines
      and the next is tried.
    return_residual: also return the logsumexp.
    interpret: run the Pallas kernels in Pallas's interpret mode, which works
      on the CPU (slow; for verification and debugging).  ``mosaic_tpu``
      supports it; ``mosaic_gpu`` and ``cudnn`` decline
      (``NotImplementedError``: their kernels cannot be interpreted on the
      CPU); ``xla`` has no Pallas kernels and runs as usual.

  All visibility rules combine with logical AND.  A query row that sees no
  key returns zeros and a logsumexp of ``-inf`` (``jax.nn``'s ``xla`` path
  returns an average of the values there instead).

  Returns:
    ``out [B, T, N, H]`` in the query dtype, or ``(out, logsumexp [B, T, N])``
    with ``return_residual=True``.  The logsumexp is of the scaled, biased,
    capped and masked logits, in the query dtype as in ``jax.nn``; unlike
    ``jax.nn`` it is differentiable.

  Raises:
    ValueError: an argument is invalid; the message names it.
    NotImplementedError: no backend among those requested can serve the call
      (only possible with an explicit ``implementation``).
  """
  call, unbatched = _canonicalize(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      logits_soft_cap=logits_soft_cap, return_residual=return_residual,
      interpret=interpret)
  backends = _requested_backends(implementation)
  if call.mask.q_len == 0 or call.mask.kv_len == 0:
    out, lse = _empty_result(call)
  else:
    out, lse, _ = _dispatch(call, backends)
  if unbatched:
    out, lse = out[0], lse[0]
  if return_residual:
    return out, lse.astype(out.dtype)
  return out


def _empty_result(call: AttentionCall) -> tuple[Array, Array]:
  """T == 0 or S == 0: nothing to attend to."""
  q = call.query
  return jnp.zeros_like(q), jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)


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
    logits_soft_cap: float | None = None,
    implementation: str | Sequence[str] | None = None,
    return_residual: bool = False,
    interpret: bool = False,
    platform: str | None = None,
    for_training: bool = False,
) -> str:
  """The name of the backend that :func:`dot_product_attention` would use
  for these arguments (same signature).  Traces abstractly; computes
  nothing.

  Args:
    platform: with ``implementation=None``, the lowering platform to report
      the choice for (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``; default:
      this host's).  A jitted call holds one branch per platform and runs
      the lowered platform's.
    for_training: with ``implementation=None``, the backend of a call whose
      derivative is taken (on Hopper GPUs it may differ from the backend of
      a forward-only call; see ``docs/backends.md``).
  """
  if not isinstance(for_training, (bool, np.bool_)):
    raise ValueError(f"for_training must be a bool, got {for_training!r}")
  if platform is not None:
    default_order(platform)  # validates the name
    if platform == "gpu":
      platform = "cuda"
  elif implementation is None:
    platform = dispatch.host_platform()
    if platform not in dispatch.PLATFORMS:
      platform = "cpu"
  chosen = []

  def trace(query, key, value, bias, mask, query_seq_lengths,
            key_value_seq_lengths, segment_ids):
    call, _ = _canonicalize(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, return_residual=return_residual,
        interpret=interpret)
    chosen.append(_dispatch(call, _requested_backends(implementation),
                            platform, bool(for_training))[2])
    return 0

  jax.eval_shape(trace, query, key, value, bias, mask, query_seq_lengths,
                 key_value_seq_lengths, segment_ids)
  return chosen[0]
