"""Test helpers: random inputs, the reference on user-level arguments, a plain
same-dtype implementation for error baselines, and error metrics.

Random inputs come from :func:`fresh_rng` (or :func:`seeded_rng` where the
seed is also wanted), seeded from the running test's node id so that a
failure replays: see ``tests/_seeds.py``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import reference
from jflash.attention import _canonicalize
from tests._seeds import current_seed, fresh_rng, next_seed, seeded_rng

MASK_ARGS = ("is_causal", "query_seq_lengths", "key_value_seq_lengths",
             "local_window_size", "segment_ids")


@dataclasses.dataclass
class Case:
  """One attention problem with user-level arguments."""

  query: jax.Array
  key: jax.Array
  value: jax.Array
  bias: jax.Array | None = None
  mask: jax.Array | None = None
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # Arguments of the same problem written another way for the reference
  # (``kwargs`` and ``mask`` when None): for inputs whose meaning the test
  # states independently, such as a window wider than the sequences given
  # to the reference as the equivalent dense mask.
  reference_kwargs: dict[str, Any] | None = None
  reference_mask: jax.Array | None = None

  @property
  def arrays(self):
    return self.query, self.key, self.value, self.bias

  def call_jflash(self, q, k, v, bias, **extra):
    return jflash.dot_product_attention(q, k, v, bias, self.mask,
                                        **self.kwargs, **extra)

  def canonical(self, q, k, v, bias):
    """The canonical call of the reference's arguments."""
    kwargs, mask = self.kwargs, self.mask
    if self.reference_kwargs is not None:
      kwargs, mask = self.reference_kwargs, self.reference_mask
    kw = {n: kwargs.get(n) for n in MASK_ARGS + ("scale", "logits_soft_cap")}
    kw["is_causal"] = kw["is_causal"] or False
    return _canonicalize(q, k, v, bias, mask, **kw)

  def call_reference(self, q, k, v, bias, compute_dtype=None, jit=True):
    """(out, lse) of the exact reference, in the input layout."""
    def run(q, k, v, bias):
      call, unbatched = self.canonical(q, k, v, bias)
      out, lse = reference.reference_attention(
          call.query, call.key, call.value, call.bias, call.mask,
          scale=call.scale, logits_soft_cap=call.logits_soft_cap,
          compute_dtype=compute_dtype)
      return (out[0], lse[0]) if unbatched else (out, lse)
    return (jax.jit(run) if jit else run)(q, k, v, bias)

  def call_plain(self, q, k, v, bias, jit=True):
    """A plain materialized implementation in the input dtype, the way
    ``jax.nn``'s ``xla`` path computes (logits in float32, probabilities
    rounded to the input dtype before the value product)."""
    def run(q, k, v, bias):
      call, unbatched = self.canonical(q, k, v, bias)
      out = plain_attention(call.query, call.key, call.value, call.bias,
                            call.mask.visibility(), call.scale,
                            call.logits_soft_cap)
      return out[0] if unbatched else out
    return (jax.jit(run) if jit else run)(q, k, v, bias)


def plain_attention(q, k, v, bias, visible, scale, cap):
  dtype = q.dtype
  groups = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, groups, axis=2)
  v = jnp.repeat(v, groups, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k,
                      preferred_element_type=jnp.float32) * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if cap is not None:
    logits = cap * jnp.tanh(logits / cap)
  logits = jnp.where(visible, logits, -jnp.inf)
  row_max = jnp.max(logits, -1, keepdims=True)
  row_max = jnp.where(jnp.isneginf(row_max), 0.0, row_max)
  w = jnp.exp(logits - row_max)
  total = w.sum(-1, keepdims=True)
  probs = (w / jnp.where(total == 0, 1.0, total)).astype(dtype)
  return jnp.einsum("bnts,bsnh->btnh", probs, v,
                    preferred_element_type=jnp.float32).astype(dtype)


def rel_err(x, ref) -> float:
  x = np.asarray(jnp.asarray(x, jnp.float64) if jax.config.jax_enable_x64
                 else jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(ref, np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(x - ref) / (denom if denom > 0 else 1.0))


def lse_err(x, ref) -> float:
  """Max abs error on finite entries; inf if the -inf pattern differs."""
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(ref, np.float64)
  if not np.array_equal(np.isneginf(x), np.isneginf(ref)):
    return float("inf")
  finite = np.isfinite(ref)
  if not finite.any():
    return 0.0
  return float(np.max(np.abs(x[finite] - ref[finite])))


def random_qkv(rng: np.random.Generator, b=2, t=12, s=12, n=4, k=2, h=16,
               dtype=jnp.float32):
  """Random ``query [b, t, n, h]``, ``key`` and ``value [b, s, k, h]``."""
  return (random_normal(rng, (b, t, n, h), dtype),
          random_normal(rng, (b, s, k, h), dtype),
          random_normal(rng, (b, s, k, h), dtype))


def random_normal(rng: np.random.Generator, shape, dtype) -> jax.Array:
  return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(
      dtype)


def random_segments(rng: np.random.Generator, batch: int, length: int,
                    max_segments: int = 4) -> np.ndarray:
  """Sorted (packed-document) segment ids ``[B, length]``."""
  ids = np.zeros((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, max(length, 2)),
                              size=min(max_segments - 1, max(length - 1, 0)),
                              replace=False)) if length > 1 else []
    for c in cuts:
      ids[b, c:] += 1
  return ids


def grads_of(fn, case: Case, cotangent, argnums=(0, 1, 2)):
  """Gradients of ``sum(fn(q, k, v, bias) * cotangent)``."""
  def loss(*arrays):
    out = fn(*arrays)
    return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))
  return jax.grad(loss, argnums=argnums)(*case.arrays)


# ------------------------------------------------------- integer arguments
INTEGER_DTYPES = tuple(np.dtype(d) for d in (
    np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64))
_INT32 = np.iinfo(np.int32)


def integer_sources() -> list[Any]:
  """pytest params ``(dtype, source, x64)``: every integer dtype given as a
  NumPy array (``"numpy"``), a JAX array (``"jax"``) and a traced argument
  of a jitted call (``"jit"``), with ``jax_enable_x64`` off and on.  JAX
  holds 64-bit arrays only under x64, so those come from NumPy without it."""
  params = []
  for x64 in (False, True):
    for dtype in INTEGER_DTYPES:
      for source in ("numpy", "jax", "jit"):
        if source != "numpy" and dtype.itemsize == 8 and not x64:
          continue
        params.append(pytest.param(
            dtype, source, x64,
            id=f"{dtype.name}-{source}" + ("-x64" if x64 else "")))
  return params


def extremes(dtype: np.dtype) -> tuple[int, int]:
  """The smallest and largest values of an integer dtype."""
  info = np.iinfo(dtype)
  return int(info.min), int(info.max)


def integer_array(values: Any, dtype: np.dtype,
                  source: str) -> np.ndarray | jax.Array:
  """``values`` (Python ints that ``dtype`` holds) in ``dtype``, on the
  host for ``"numpy"``, else on the device (call under the x64 setting
  the test runs with)."""
  host = np.array(values, dtype)
  assert np.array_equal(host.astype(object), np.array(values, object))
  if source == "numpy":
    return host
  device = jnp.asarray(host)
  assert device.dtype == dtype, (device.dtype, dtype)
  return device


def saturated_int32(values: Any) -> np.ndarray:
  """What an int32 caller passes for ``values``: each one saturated to the
  int32 range (every integer argument means the same past it)."""
  clipped = np.clip(np.array(values, object), int(_INT32.min),
                    int(_INT32.max))
  return np.asarray(clipped, np.int64).astype(np.int32)


__all__ = ["Case", "HOPPER", "INTEGER_DTYPES", "current_seed", "extremes",
           "fresh_rng", "grads_of", "integer_array", "integer_sources",
           "lowering_for_hopper", "lse_err", "next_seed", "plain_attention",
           "random_normal", "random_qkv", "random_segments", "rel_err",
           "saturated_int32", "seeded_rng"]


HOPPER = "NVIDIA H100 80GB HBM3"
"""A Hopper GPU's device kind, for lowering its kernels from any host."""


def lowering_for_hopper():
  """Calls traced inside are traced for a Hopper GPU, whatever this host
  is (the Mosaic GPU kernels then lower for CUDA on the CPU)."""
  return jflash.lowering_for("cuda", HOPPER)
