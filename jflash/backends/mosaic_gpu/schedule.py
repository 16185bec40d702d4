"""Visiting orders of the Hopper kernels' persistent CTAs.

Built on :func:`jflash.masks.tile_schedule`: the order in which CTAs take
their blocks of work (longest first), and, for the fused backward, each key
block's query tiles in decreasing order with the position of its dQ
contribution in a fixed-order sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def visited_in_reverse(order: Array, count: Array) -> Array:
  """Each row's first ``count`` entries of ``order`` reversed (the visited
  tiles in decreasing order when they were increasing); the unvisited
  entries stay where they are.

  Args:
    order: int ``[..., m]``, e.g. ``q_order`` of a
      :class:`jflash.masks.TileSchedule`.
    count: int ``[...]``: how many leading entries are visited.
  """
  steps = jnp.arange(order.shape[-1])
  backwards = jnp.where(steps < count[..., None],
                        count[..., None] - 1 - steps, steps)
  return jnp.take_along_axis(order, backwards, axis=-1)


def earlier_visitors(visits: Array, order: Array, slots: int = 1) -> Array:
  """At each step of each key block's visiting order, how many key blocks
  before it visit the same query tile: the position of its contribution in
  a fixed, key-block-ordered sum over the tile.

  With ``slots > 1`` the contributions go to ``slots`` separate sums, key
  block ``j`` to sum ``j % slots``, and only key blocks of the same sum
  count.

  Args:
    visits: bool ``[B, nq, nk]``: key block ``j`` visits query tile ``i``.
    order: int ``[B, nk, m]``: each key block's query tiles, step by step.
    slots: the number of separate sums (at least 1).

  Returns:
    int32 ``[B, nk, m]``.
  """
  batch, nq, nk = visits.shape
  grouped = _by_slot(visits.astype(jnp.int32), slots)
  earlier = (jnp.cumsum(grouped, axis=2) - grouped).reshape(
      batch, nq, -1)[:, :, :nk]
  return jnp.take_along_axis(jnp.swapaxes(earlier, 1, 2), order, axis=2)


def visited_per_slot(visits: Array, slots: int) -> Array:
  """Whether any key block of sum ``r`` (key blocks ``j`` with
  ``j % slots == r``) visits each query tile.

  Args:
    visits: bool ``[B, nq, nk]``, as for :func:`earlier_visitors`.
    slots: the number of separate sums (at least 1).

  Returns:
    bool ``[slots, B, nq]``.
  """
  return jnp.moveaxis(_by_slot(visits, slots).any(axis=2), -1, 0)


def _by_slot(visits: Array, slots: int) -> Array:
  """``[B, nq, nk]`` -> ``[B, nq, ceil(nk / slots), slots]``, key block
  ``j = g * slots + r`` at ``[..., g, r]`` (padded with zeros)."""
  if slots < 1:
    raise ValueError(f"slots must be at least 1, got {slots}")
  batch, nq, nk = visits.shape
  padded = -(-nk // slots) * slots
  visits = jnp.pad(visits, ((0, 0), (0, 0), (0, padded - nk)))
  return visits.reshape(batch, nq, padded // slots, slots)


def heaviest_first(count: Array) -> Array:
  """An order in which to start independent blocks of work, longest first.

  A kernel whose CTAs each take one block (one row of a schedule) finishes
  when its slowest SM does.  Starting the blocks that visit the most tiles
  first leaves the short ones to fill the tail (longest-processing-time
  order); under a causal mask, where the work of query block ``i`` grows
  with ``i``, this is the reverse of the natural order.

  Args:
    count: int ``[B, n]``: tiles visited per block (``kv_count`` or
      ``q_count`` of a :class:`jflash.masks.TileSchedule`).

  Returns:
    int32 ``[B * n]``: the flat indices ``b * n + i`` in decreasing order of
    ``count``; equal counts keep index order.
  """
  return jnp.argsort(-count.reshape(-1), stable=True).astype(jnp.int32)
