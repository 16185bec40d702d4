"""ALiBi: a per-head linear penalty on the distance between query and key.

The one definition every backend applies::

    logits[b, n, t, s] += -slopes[b, n] * |(t + q_offset) - (s + kv_offset)|

added to the logits after the scale, the bias and the soft cap, as
FlashAttention's ``alibi_slopes`` does: the cap bounds the content score,
while the penalty keeps growing with distance (capped, every far key would
get the same ``-cap``, and the penalty would stop telling near from far).
Positions are those of :mod:`jflash.masks` (top-left aligned, global under
context parallelism), so a causal call sees ``slope * (s - t) <= 0``.

The slopes are constants (as in every ALiBi model and in FlashAttention):
:func:`constant` raises if a derivative is asked of them, rather than
returning a zero gradient a user could mistake for a real one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

Array = jax.Array


def penalty(slopes: Array, distance: Array) -> Array:
  """``-slopes * |distance|`` in the slopes' dtype; ``distance`` is the
  query's position minus the key's (integers, any layout that broadcasts
  against ``slopes``)."""
  return -slopes * jnp.abs(distance).astype(slopes.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """The standard ALiBi slopes of ``num_heads`` heads, float32 ``[N]``
  (Press et al., 2022, as BLOOM, MPT and FlashAttention's tests compute
  them): for ``N`` a power of two, ``2 ** (-8 (n + 1) / N)``; otherwise
  the slopes of the next lower power of two followed by every other slope
  of twice that many heads.

  Args:
    num_heads: ``N >= 1``.
  """
  if not isinstance(num_heads, int) or isinstance(num_heads, bool) \
      or num_heads < 1:
    raise ValueError(f"alibi_slopes: num_heads must be a positive int, got "
                     f"{num_heads!r}")

  def powers(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  lower = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = powers(lower)
  if lower < num_heads:
    slopes += powers(2 * lower)[0::2][:num_heads - lower]
  return np.asarray(slopes, np.float32)


@jax.custom_jvp
def constant(slopes: Array) -> Array:
  """``slopes`` unchanged; taking a derivative with respect to them raises
  ``ValueError``."""
  return slopes


def _no_slope_derivative(primals, tangents):
  (slopes,), (tangent,) = primals, tangents
  if not isinstance(tangent, SymbolicZero):
    raise ValueError(
        "alibi_slopes are constants: jflash computes no derivative with "
        "respect to them (the query, key, value and bias are "
        "differentiated); pass them through jax.lax.stop_gradient if they "
        "come from differentiated parameters")
  return slopes, tangent


constant.defjvp(_no_slope_derivative, symbolic_zeros=True)
