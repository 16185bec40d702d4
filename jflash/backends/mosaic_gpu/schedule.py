"""Visiting orders of the Hopper kernels' persistent CTAs.

Built on :func:`jflash.tiles.tile_schedule`: the order in which CTAs take
their blocks of work (longest first), and, for the fused backward, each key
block's query tiles in decreasing order with the position of its dQ
contribution in a fixed-order sum; and the metadata each kernel gets
(:func:`rows_metadata`, :func:`keys_metadata`, :func:`shared_keys_metadata`,
:func:`fused_keys_metadata`), built over the padded extents ``pads.q_pad``
and ``pads.kv_pad``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jflash import masks, tiles
from jflash.core.padding import pad_axis

Array = jax.Array


def visited_in_reverse(order: Array, count: Array) -> Array:
  """Each row's first ``count`` entries of ``order`` reversed (the visited
  tiles in decreasing order when they were increasing); the unvisited
  entries stay where they are.

  Args:
    order: int ``[..., m]``, e.g. ``q_order`` of a
      :class:`jflash.tiles.TileSchedule`.
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
      ``q_count`` of a :class:`jflash.tiles.TileSchedule`).

  Returns:
    int32 ``[B * n]``: the flat indices ``b * n + i`` in decreasing order of
    ``count``; equal counts keep index order.
  """
  return jnp.argsort(-count.reshape(-1), stable=True).astype(jnp.int32)


def _classes(mask: masks.AttentionMask, block_q: int, block_kv: int,
             pads) -> Array:
  """int32 tile classes covering the padded extent (extra tiles EMPTY),
  ``[B, Tp / block_q, Sp / block_kv]``."""
  classes = tiles.tile_classes(mask, block_q, block_kv).astype(jnp.int32)
  classes = pad_axis(classes, 1, pads.q_pad // block_q)
  return pad_axis(classes, 2, pads.kv_pad // block_kv)


def classes_per_step(classes: Array, order: Array) -> Array:
  """The class each of a CTA's two consumers meets at each step.

  Args:
    classes: ``[B, 2 * n, m]``: tile classes at one consumer's block along
      the CTA's axis (rows ``2 i`` and ``2 i + 1`` belong to CTA ``i``).
    order: ``[B, n, m]``: the CTA's visiting order along the other axis.

  Returns:
    ``[B, n, m, 2]``: ``classes[b, 2 i + w, order[b, i, s]]`` at ``[b, i, s,
    w]``.
  """
  batch, rows, cols = classes.shape
  pairs = classes.reshape(batch, rows // 2, 2, cols)
  picked = jnp.take_along_axis(pairs, order[:, :, None, :], axis=3)
  return jnp.swapaxes(picked, 2, 3)


def _kv_schedule(mask, block_q, block_kv, pads):
  """Per ``block_q`` query rows: nonempty key tiles first, and their count."""
  sched = tiles.tile_schedule(mask, block_q, block_kv)
  order = pad_axis(pad_axis(sched.kv_order, 1, pads.q_pad // block_q), 2,
                    pads.kv_pad // block_kv)
  return order, pad_axis(sched.kv_count, 1, pads.q_pad // block_q)


def _q_schedule(mask, block_q, block_kv, pads):
  """Per ``block_kv`` keys: nonempty query tiles first, and their count."""
  sched = tiles.tile_schedule(mask, block_q, block_kv)
  order = pad_axis(pad_axis(sched.q_order, 1, pads.kv_pad // block_kv), 2,
                    pads.q_pad // block_q)
  return order, pad_axis(sched.q_count, 1, pads.kv_pad // block_kv)


def rows_metadata(mask, block_q, block_kv, pads):
  """Forward/dQ: per CTA of ``2 * block_q`` query rows, the key tiles to
  visit, their count, each consumer's class at each step, and the order in
  which CTAs take the row blocks (longest first)."""
  order, count = _kv_schedule(mask, 2 * block_q, block_kv, pads)
  classes = _classes(mask, block_q, block_kv, pads)
  return (order, count, classes_per_step(classes, order),
          heaviest_first(count))


def keys_metadata(mask, block_q, block_kv, pads):
  """dK/dV: per CTA of ``2 * block_kv`` keys, the query tiles to visit,
  their count, each consumer's class at each step, and the order in which
  CTAs take the key blocks (longest first)."""
  order, count = _q_schedule(mask, block_q, 2 * block_kv, pads)
  classes = jnp.swapaxes(_classes(mask, block_q, block_kv, pads), 1, 2)
  return (order, count, classes_per_step(classes, order),
          heaviest_first(count))


def shared_keys_metadata(mask, block_q, block_kv, pads):
  """dK/dV with split outputs: per CTA of ``block_kv`` keys (both consumers
  take the same keys), the query tiles to visit, their count, the class at
  each step (the same for both consumers), and the order in which CTAs
  take the key blocks."""
  order, count = _q_schedule(mask, block_q, block_kv, pads)
  classes = jnp.swapaxes(_classes(mask, block_q, block_kv, pads), 1, 2)
  per_step = jnp.take_along_axis(classes, order, axis=2)
  return (order, count, jnp.stack([per_step, per_step], axis=-1),
          heaviest_first(count))


def fused_keys_metadata(mask, block_q, block_kv, pads, slots: int = 1):
  """The fused backward's metadata: the dK/dV schedule with each key
  block's query tiles in decreasing order, the rank of each step's query
  tile among the key blocks of the same accumulator visiting it (``[B,
  Sp / (2 block_kv), Tp / block_q]``), and which query tiles each
  accumulator receives (``[slots, B, Tp / block_q]``)."""
  order, count = _q_schedule(mask, block_q, 2 * block_kv, pads)
  # Nonempty query tiles in decreasing order: under a causal mask every key
  # block then starts on the last tile, and a tile's contributors come one
  # right after another.
  order = visited_in_reverse(order, count)
  classes = jnp.swapaxes(_classes(mask, block_q, block_kv, pads), 1, 2)
  classes = classes_per_step(classes, order)
  visits = tiles.tile_classes(mask, block_q, 2 * block_kv) != tiles.EMPTY
  visits = pad_axis(pad_axis(visits, 1, pads.q_pad // block_q), 2,
                    pads.kv_pad // (2 * block_kv))
  ranks = earlier_visitors(visits, order, slots)
  return order, count, classes, ranks, visited_per_slot(visits, slots)
