"""Padding helpers shared by the backends (sequence tails, head dims)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def round_up(x: int, multiple: int) -> int:
  """The smallest multiple of ``multiple`` that is at least ``x``."""
  return -(-x // multiple) * multiple


def pad_axis(x: Array, axis: int, size: int) -> Array:
  """``x`` zero-padded at the end of ``axis`` to ``size`` (unchanged when
  it already has that size)."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)
