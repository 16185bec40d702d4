"""Argument checks shared by the public functions
(:func:`jflash.dot_product_attention`, :func:`jflash.decode_attention`,
:func:`jflash.append_to_cache` and :func:`jflash.append_to_pages`).

Every check raises ``ValueError`` with a message that names the argument,
what was received and what was expected.

Integer arrays (lengths, block tables) may have any integer dtype, signed
or unsigned, of any width, and come as NumPy arrays (or anything
``np.asarray`` reads) on the host or as JAX arrays on the device, traced or
not.  They become int32 by one rule, :func:`to_int32`: a dtype int32 holds
is converted as is; a wider one is first clamped, in its own dtype, to
bounds past which every value means the same to the caller.  So every
dtype gives the result of the int32 call on the same values saturated to
the int32 range.  A NumPy array is clamped on the host: without
``jax_enable_x64``, ``jnp.asarray`` would narrow 64-bit values (with a
warning) before any check could see them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jflash.core import alibi

Array = jax.Array

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
"""The dtypes of queries, keys, values, caches and biases."""

INT32 = np.iinfo(np.int32)


def describe(x: Any) -> str:
  """What the caller passed, for error messages: shape and dtype of an
  array, else type and value."""
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None:
    return f"{type(x).__name__} {x!r}"
  return f"shape {tuple(shape)} dtype {dtype}"


def is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


# ------------------------------------------------------------------ arrays
def as_array(x: Any, name: str) -> Array:
  """``x`` as a JAX array."""
  try:
    return jnp.asarray(x)
  except TypeError as err:
    raise ValueError(f"{name} must be an array, got {describe(x)}") from err


def as_host_or_device(x: Any, name: str) -> Array | np.ndarray:
  """A JAX array stays one (it may be traced); anything else becomes a
  NumPy array, so that 64-bit integers keep their values whatever
  ``jax_enable_x64`` says."""
  if isinstance(x, jax.Array):
    return x
  try:
    return np.asarray(x)
  except (TypeError, ValueError) as err:
    raise ValueError(f"{name} must be an array, got {describe(x)}") from err


def check_floating(x: Array, name: str) -> None:
  if x.dtype not in FLOAT_DTYPES:
    raise ValueError(f"{name} must have a floating dtype (float16, bfloat16, "
                     f"float32 or float64), got {describe(x)}")


def check_integer(x: Array | np.ndarray, name: str) -> None:
  if not np.issubdtype(x.dtype, np.integer):
    raise ValueError(f"{name} must have an integer dtype, got {describe(x)}")


def integers(x: Any, name: str) -> Array | np.ndarray:
  """An integer array of any dtype, on the host or the device
  (:func:`as_host_or_device`)."""
  x = as_host_or_device(x, name)
  check_integer(x, name)
  return x


# ----------------------------------------------------------- int32 values
def fits_int32(dtype: Any) -> bool:
  """Every value of ``dtype`` is an int32 value."""
  return np.can_cast(dtype, np.int32, casting="safe")


def host_fits_int32(x: np.ndarray) -> bool:
  """Every value of the host array ``x`` is an int32 value."""
  return x.size == 0 or (int(x.min()) >= INT32.min
                         and int(x.max()) <= INT32.max)


def to_int32(x: Array | np.ndarray, lower: int, upper: int) -> Array:
  """Integers ``x`` (host or device, any dtype) as an int32 JAX array.

  A dtype int32 holds is converted as is.  A wider one (uint32, int64,
  uint64) is clamped to ``[lower, upper]`` first, in its own dtype: on the
  host for a NumPy array, on the device otherwise.  The caller picks bounds
  below and above which every value means the same to it, so the result
  means what the values saturated to int32 mean.
  """
  if fits_int32(x.dtype):
    return jnp.asarray(x).astype(jnp.int32)
  # Bounds that both int32 and the dtype hold: -1 must not wrap around to
  # the largest value of an unsigned dtype.
  info = np.iinfo(x.dtype)
  lower = max(lower, int(INT32.min), int(info.min))
  upper = min(upper, int(INT32.max), int(info.max))
  if isinstance(x, np.ndarray):
    return jnp.asarray(np.clip(x, lower, upper).astype(np.int32))
  return jnp.clip(x, lower, upper).astype(jnp.int32)


def canonical_lengths(x: Any, name: str, batch: int,
                      bound: int) -> Array | None:
  """Sequence lengths as int32 ``[B]`` (None stays None).

  ``bound`` is the sequence length: every length at or past it means the
  same, as does every length at or below 0, so lengths of a wider dtype are
  clamped to ``[0, bound]`` (:func:`to_int32`).
  """
  if x is None:
    return None
  x = integers(x, name)
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},), got "
                     f"{describe(x)}")
  return to_int32(x, 0, bound)


# --------------------------------------------------------- concrete values
def concrete_scalar(x: Any, name: str, expected: str) -> Any:
  """A Python or NumPy scalar, or a concrete 0-d array, as a NumPy
  scalar."""
  if is_traced(x):
    raise ValueError(f"{name} must be {expected} known at trace time (it "
                     f"selects the computation), got a traced value "
                     f"{describe(x)}")
  if isinstance(x, (bool, int, float, np.generic)):
    return np.asarray(x)[()]
  if isinstance(x, (np.ndarray, jax.Array)) and x.shape == ():
    return np.asarray(x)[()]
  raise ValueError(f"{name} must be {expected}, got {describe(x)}")


def bool_flag(x: Any, name: str) -> bool:
  """A concrete bool-like value: a bool, 0 or 1, or a 0-d bool or integer
  array (of any integer dtype) holding one of those."""
  value = concrete_scalar(x, name, "a bool")
  if (isinstance(value, (np.bool_, np.integer))
      and int(value) in (0, 1)):
    return bool(value)
  raise ValueError(f"{name} must be a bool (or 0 or 1), got {x!r}")


def _window_side(x: Any) -> int:
  if isinstance(x, int) and not isinstance(x, bool):
    return x  # any size
  value = concrete_scalar(x, "local_window_size", "an int or a pair of ints")
  if not isinstance(value, np.integer):
    raise ValueError("local_window_size must be an int or a pair of ints "
                     f"(left, right), got {x!r}")
  return int(value)


def canonical_window(local_window_size: Any) -> tuple[int, int] | None:
  """``(left, right)`` as Python ints of any size, from one int for both
  sides or a pair: Python ints, NumPy scalars or concrete 0-d arrays of any
  integer dtype, or an array of two."""
  if local_window_size is None:
    return None
  if is_traced(local_window_size):
    raise ValueError("local_window_size must be known at trace time (it "
                     "shapes the computation), got a traced value "
                     f"{describe(local_window_size)}")
  if isinstance(local_window_size, (bool, np.bool_)):
    raise ValueError("local_window_size must be an int or a pair of ints "
                     f"(left, right), got {local_window_size!r}")
  sides = local_window_size
  if isinstance(sides, (np.ndarray, jax.Array)):
    if sides.shape == ():
      sides = (sides, sides)
    elif sides.shape == (2,):
      sides = tuple(np.asarray(sides))
    else:
      raise ValueError("local_window_size must be an int or a pair of ints "
                       f"(left, right), got {describe(local_window_size)}")
  elif isinstance(sides, (tuple, list)):
    if len(sides) != 2:
      raise ValueError("local_window_size must be an int or a pair of ints "
                       f"(left, right), got {local_window_size!r}")
  else:
    sides = (sides, sides)
  if any(isinstance(w, (bool, np.bool_)) for w in sides):
    raise ValueError("local_window_size must be an int or a pair of ints "
                     f"(left, right), got {local_window_size!r}")
  left, right = (_window_side(w) for w in sides)
  if min(left, right) < 0:
    raise ValueError("local_window_size must be non-negative, got "
                     f"{local_window_size!r}")
  return left, right


def concrete_float(x: Any, name: str, dtype: Any) -> float:
  """A Python number for a constant of the computation in ``dtype``: finite
  there, with room for the constants backends derive from it (such as
  ``scale * log2(e)``)."""
  try:
    value = float(x)
  except (TypeError, jax.errors.ConcretizationTypeError) as err:
    raise ValueError(f"{name} must be a Python number (it is a constant of "
                     f"the compiled computation), got {describe(x)}") from err
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}")
  limit = float(np.finfo(dtype).max) / 2
  if abs(value) > limit:
    raise ValueError(f"{name} must be at most {limit:.3g} in magnitude (half "
                     f"the largest {np.dtype(dtype).name}, the dtype the "
                     f"attention computes in), got {value!r}")
  return value


def compute_dtype(dtype: Any) -> np.dtype:
  """The dtype the softmax runs in for inputs of ``dtype``."""
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


def canonical_scale(scale: Any, head_dim: int, dtype: np.dtype) -> float:
  """``scale`` as a Python float (default ``1 / sqrt(H)``); ``dtype`` is
  the compute dtype."""
  if scale is not None:
    return concrete_float(scale, "scale", dtype)
  # With H == 0 every logit is 0 (plus bias) whatever the scale.
  return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def canonical_soft_cap(logits_soft_cap: Any, scale: float,
                       dtype: np.dtype) -> float | None:
  """``logits_soft_cap`` as a Python float, or None; ``dtype`` is the
  compute dtype."""
  if logits_soft_cap is None:
    return None
  cap = concrete_float(logits_soft_cap, "logits_soft_cap", dtype)
  smallest = float(np.finfo(dtype).tiny)
  if cap < smallest:
    raise ValueError(f"logits_soft_cap must be positive and at least "
                     f"{smallest:.3g} (the smallest normal "
                     f"{dtype.name}), got {cap!r}")
  if abs(scale) / cap > float(np.finfo(dtype).max) / 2:
    # Backends fold scale / cap into one constant.
    raise ValueError(f"scale / logits_soft_cap = {scale!r} / {cap!r} "
                     f"overflows {dtype.name}; raise logits_soft_cap or "
                     "lower scale")
  return cap


def canonical_sinks(x: Any, num_heads: int, dtype: Any) -> Array | None:
  """``attention_sinks``: floating ``[N]``, one logit per query head, as
  an array of the softmax's dtype (float32, float64 for float64 inputs);
  None stays None."""
  if x is None:
    return None
  sinks = as_array(x, "attention_sinks")
  check_floating(sinks, "attention_sinks")
  if sinks.shape != (num_heads,):
    raise ValueError(f"attention_sinks must have shape [N] = ({num_heads},) "
                     f"(one logit per query head), got {describe(x)}")
  return sinks.astype(compute_dtype(dtype))


def canonical_alibi_slopes(x: Any, batch: int, num_heads: int, dtype: Any,
                           unbatched: bool = False) -> Array | None:
  """``alibi_slopes``: floating ``[N]`` (every batch row) or ``[B, N]``, as
  a ``[B|1, N]`` array of the softmax's dtype (float32, float64 for
  float64 inputs), held constant (:func:`jflash.core.alibi.constant`);
  None stays None.  ``unbatched``: the call's inputs were ``[T, N, H]``,
  so only ``[N]`` fits."""
  if x is None:
    return None
  slopes = as_array(x, "alibi_slopes")
  check_floating(slopes, "alibi_slopes")
  shapes = [(num_heads,)] + ([] if unbatched else [(batch, num_heads)])
  if slopes.shape not in shapes:
    wanted = " or ".join(
        f"[{'B, ' if len(s) == 2 else ''}N] = {s}" for s in shapes)
    raise ValueError(f"alibi_slopes must have shape {wanted} (one slope per "
                     f"query head), got {describe(x)}")
  slopes = alibi.constant(slopes.astype(compute_dtype(dtype)))
  return slopes.reshape((-1, num_heads))


def canonical_mask_fn(fn: Any) -> Any:
  """``mask_fn``: None, or a callable of two int32 position arrays that
  returns booleans of their broadcast shape (checked on a small probe
  while tracing)."""
  if fn is None:
    return None
  if not callable(fn):
    raise ValueError(f"mask_fn must be a callable (q_pos, kv_pos) -> bool "
                     f"array, got {fn!r}")
  q = jax.ShapeDtypeStruct((3, 1), jnp.int32)
  k = jax.ShapeDtypeStruct((1, 4), jnp.int32)
  try:
    result = jax.eval_shape(fn, q, k)
  except Exception as err:  # the user's function, any error
    raise ValueError(f"mask_fn {fn!r} failed on int32 positions of shapes "
                     f"(3, 1) and (1, 4): {type(err).__name__}: {err}"
                     ) from err
  shape = getattr(result, "shape", None)
  dtype = getattr(result, "dtype", None)
  try:
    fits = shape is not None and len(shape) <= 2 and \
        jnp.broadcast_shapes(shape, (3, 4)) == (3, 4)
  except ValueError:
    fits = False
  if dtype != jnp.bool_ or not fits:
    raise ValueError(
        f"mask_fn must return a bool array of the broadcast shape of its "
        f"arguments; on int32 positions of shapes (3, 1) and (1, 4) "
        f"{fn!r} returned {result!r}")
  return fn
