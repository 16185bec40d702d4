"""Tile schedules: which tiles of the ``[T, S]`` score matrix a kernel visits.

For a tiling of the score matrix into ``block_q x block_kv`` tiles, each
tile is empty (nothing visible: skip it), full (everything visible: no
element mask) or partial (mask per element), as :mod:`jflash.masks`
defines visibility.  The structural rules (causal, window, lengths) give
every query row one contiguous interval of visible keys whose ends never
decrease as ``t`` grows, so emptiness is decided exactly with a handful of
integer operations per tile; segment ids and dense masks are classified
from per-tile minima/maxima and any/all reductions.  :func:`tile_schedule`
turns the classes into the visiting order every pass of a kernel shares;
:func:`max_visited_blocks` bounds the visits statically; decode kernels
classify cache chunks with :func:`decode_chunk_class`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jflash import masks

Array = jax.Array

EMPTY = 0
"""Tile class: no query in the tile sees any key in the tile."""
PARTIAL = 1
"""Tile class: some pairs are visible; the kernel must mask per element."""
FULL = 2
"""Tile class: every pair in the tile is visible; no per-element mask needed."""

_INT_MAX = np.iinfo(np.int32).max
_INT_MIN = np.iinfo(np.int32).min


def _structural_classes(mask: masks.AttentionMask, block_q: int, block_kv: int,
                        num_q: int, num_kv: int) -> tuple[Array, Array]:
  """Nonempty and full flags ``[B|1, nq, nk]`` from causal/window/lengths.

  The visible width of a row inside a tile, ``f(t) = min(hi(t), k1) -
  max(lo(t), k0)``, is concave and piecewise linear in ``t`` (both interval
  ends are nondecreasing with slope 0 or 1), so its maximum over the tile's
  rows is attained at a tile end or at one of the breakpoints below.
  """
  q0 = (jnp.arange(num_q, dtype=jnp.int32) * block_q)[None, :, None]
  k0 = (jnp.arange(num_kv, dtype=jnp.int32) * block_kv)[None, None, :]
  k1 = k0 + block_kv
  q_last = q0 + block_q - 1
  right = mask.right_offset()
  # Breakpoints are in local positions: with offsets, query t stands at key
  # position t + d.
  d = mask.diagonal_shift()
  q_limit = jnp.full((1, 1, 1), mask.q_len, jnp.int32)
  if mask.q_lengths is not None:
    q_limit = jnp.minimum(q_limit, masks.shifted(
        mask.per_row(mask.q_lengths, 3), None, mask.q_offset))
  kv_limit = jnp.full((1, 1, 1), mask.kv_len, jnp.int32)
  if mask.kv_lengths is not None:
    kv_limit = jnp.minimum(kv_limit, masks.shifted(
        mask.per_row(mask.kv_lengths, 3), None, mask.kv_offset))
  valid_last = jnp.minimum(q_last, q_limit - 1)  # last valid row per tile
  candidates = [q0, valid_last]
  if right is not None:
    # Rows where hi(t) = t + d + right + 1 meets k1 or the key limit.
    to_hi = _clamp_position(-(right + 1) - d)
    candidates += [k1 + to_hi, kv_limit + to_hi]
  if mask.window is not None:
    # Rows where lo(t) = t + d - left meets k0 or 0.
    to_lo = _clamp_position(mask.window[0] - d)
    candidates += [k0 + to_lo, jnp.full_like(q0, to_lo)]
  width = jnp.full((1, num_q, num_kv), -1, jnp.int32)
  for cand in candidates:
    t = jnp.clip(cand, q0, jnp.maximum(valid_last, q0))
    lo, hi = mask.bounds_at(t)
    width = jnp.maximum(width, jnp.minimum(hi, k1) - jnp.maximum(lo, k0))
  nonempty = (width > 0) & (valid_last >= q0)
  lo_last, _ = mask.bounds_at(q_last)
  _, hi_first = mask.bounds_at(q0)
  full = (q_last < q_limit) & (lo_last <= k0) & (hi_first >= k1)
  return nonempty, full


def _clamp_position(x: Array | int) -> Array | int:
  """``x`` limited to ``+-masks.MAX_POSITION``: a breakpoint that far away lies
  outside every block, and the sums that use it stay within int32."""
  if isinstance(x, int):
    return x
  return jnp.clip(x, -masks.MAX_POSITION, masks.MAX_POSITION)


def _block_min_max(ids: Array, block: int, num: int) -> tuple[Array, Array]:
  """Per-block min and max of ``ids [B, L]`` over real (unpadded) positions."""
  pad = num * block - ids.shape[1]
  lo = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=_INT_MAX)
  hi = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=_INT_MIN)
  return (lo.reshape(ids.shape[0], num, block).min(-1),
          hi.reshape(ids.shape[0], num, block).max(-1))


def _segment_classes(mask: masks.AttentionMask, block_q: int, block_kv: int,
                     num_q: int, num_kv: int) -> tuple[Array, Array]:
  qmin, qmax = _block_min_max(mask.q_segment_ids, block_q, num_q)
  kmin, kmax = _block_min_max(mask.kv_segment_ids, block_kv, num_kv)
  qmin, qmax = qmin[:, :, None], qmax[:, :, None]
  kmin, kmax = kmin[:, None, :], kmax[:, None, :]
  nonempty = (qmin <= kmax) & (kmin <= qmax)
  full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
  return nonempty, full


def _function_classes(mask: masks.AttentionMask, block_q: int,
                      block_kv: int, num_q: int, num_kv: int
                      ) -> tuple[Array, Array]:
  """Nonempty and full flags ``[1, nq, nk]`` of the mask function, from
  its values on every position of each tile, one row of tiles at a time
  (memory ``block_q * S``); positions past the sequence ends are hidden."""
  k_idx = jnp.arange(num_kv * block_kv, dtype=jnp.int32)[None, :]

  def tile_row(qi):
    q_idx = qi * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None]
    vis = (mask.function_visibility(q_idx, k_idx) & (q_idx < mask.q_len)
           & (k_idx < mask.kv_len)).reshape(block_q, num_kv, block_kv)
    return vis.any(axis=(0, 2)), vis.all(axis=(0, 2))

  nonempty, full = lax.map(tile_row, jnp.arange(num_q, dtype=jnp.int32))
  return nonempty[None], full[None]


def _dense_classes(mask: masks.AttentionMask, block_q: int, block_kv: int,
                   num_q: int, num_kv: int) -> tuple[Array, Array]:
  dense = mask.dense
  nb, _, tq, sk = dense.shape
  # Reduce the query and key axes to blocks (or keep a broadcast axis of 1).
  pad_q = num_q * block_q - tq if tq > 1 else 0
  pad_k = num_kv * block_kv - sk if sk > 1 else 0
  padded = jnp.pad(dense, ((0, 0), (0, 0), (0, pad_q), (0, pad_k)))
  shape = (nb, dense.shape[1], num_q if tq > 1 else 1, block_q if tq > 1 else 1,
           num_kv if sk > 1 else 1, block_kv if sk > 1 else 1)
  blocks = padded.reshape(shape)
  nonempty = blocks.any(axis=(1, 3, 5))
  full = blocks.all(axis=(1, 3, 5))
  # Padded positions count as hidden for `full`; the structural part already
  # marks tiles that hang over the sequence end as not full.
  target = (mask.batch, num_q, num_kv)
  return jnp.broadcast_to(nonempty, target), jnp.broadcast_to(full, target)


def tile_classes(mask: masks.AttentionMask, block_q: int, block_kv: int) -> Array:
  """Classify every tile of the ``[T, S]`` score matrix.

  Args:
    mask: the visibility description.
    block_q, block_kv: tile sizes; the last tile of each axis may hang over
      the sequence end (those positions are invisible).

  Returns:
    int8 ``[B, ceil(T / block_q), ceil(S / block_kv)]`` with values
    :data:`EMPTY`, :data:`PARTIAL` or :data:`FULL`.  The classification is
    exact for causal, window and lengths, and conservative (never calls a
    tile empty that holds a visible pair) for segment ids, dense masks and
    mask functions (each rule is reduced over the tile on its own);
    for a dense mask with a head axis, a tile is nonempty if any head sees a
    pair in it and full only if every head sees every pair.
  """
  if block_q < 1 or block_kv < 1:
    raise ValueError(f"block sizes must be positive, got {block_q}, {block_kv}")
  num_q, num_kv = masks.cdiv(mask.q_len, block_q), masks.cdiv(mask.kv_len, block_kv)
  nonempty, full = _structural_classes(mask, block_q, block_kv, num_q, num_kv)
  parts = []
  if mask.q_segment_ids is not None:
    parts.append(_segment_classes(mask, block_q, block_kv, num_q, num_kv))
  if mask.dense is not None:
    parts.append(_dense_classes(mask, block_q, block_kv, num_q, num_kv))
  if mask.mask_fn is not None:
    parts.append(_function_classes(mask, block_q, block_kv, num_q, num_kv))
  for part_nonempty, part_full in parts:
    nonempty &= part_nonempty
    full &= part_full
  shape = (mask.batch, num_q, num_kv)
  nonempty = jnp.broadcast_to(nonempty, shape)
  full = jnp.broadcast_to(full, shape)
  return jnp.where(nonempty, jnp.where(full, FULL, PARTIAL), EMPTY).astype(
      jnp.int8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileSchedule:
  """Which tiles to visit, computed once per call and shared by the forward,
  dQ and dK/dV passes.

  Attributes:
    classes: int8 ``[B, nq, nk]`` tile classes.
    kv_order: int32 ``[B, nq, nk]``: for each query block, the indices of its
      nonempty key blocks in increasing order, followed by the empty ones.
    kv_count: int32 ``[B, nq]``: how many leading entries of ``kv_order`` to
      visit.
    q_order: int32 ``[B, nk, nq]``: for each key block, its nonempty query
      blocks first, in increasing order.
    q_count: int32 ``[B, nk]``.
    block_q, block_kv: the tiling (static).
  """

  classes: Array
  kv_order: Array
  kv_count: Array
  q_order: Array
  q_count: Array
  block_q: int = dataclasses.field(metadata=dict(static=True))
  block_kv: int = dataclasses.field(metadata=dict(static=True))

  @property
  def visited_tiles(self) -> Array:
    """Number of tiles a pass visits (int32 scalar)."""
    return self.kv_count.sum()


def _nonempty_first(nonempty: Array) -> tuple[Array, Array]:
  order = jnp.argsort(~nonempty, axis=-1, stable=True).astype(jnp.int32)
  return order, nonempty.sum(-1, dtype=jnp.int32)


def merge_batch_classes(classes: Array) -> Array:
  """``[B, nq, nk]`` -> ``[1, nq, nk]``: a tile is empty only if it is empty
  for every batch row, and full only if it is full for every row."""
  nonempty = (classes != EMPTY).any(0, keepdims=True)
  full = (classes == FULL).all(0, keepdims=True)
  return jnp.where(nonempty, jnp.where(full, FULL, PARTIAL), EMPTY).astype(
      jnp.int8)


def tile_schedule(mask: masks.AttentionMask, block_q: int, block_kv: int, *,
                  merge_batch: bool = False) -> TileSchedule:
  """Tile classes plus visiting orders for both loop nests (see
  :class:`TileSchedule`).  With ``merge_batch`` the batch axis has size 1
  and covers every row (see :func:`merge_batch_classes`)."""
  classes = tile_classes(mask, block_q, block_kv)
  if merge_batch:
    classes = merge_batch_classes(classes)
  nonempty = classes != EMPTY
  kv_order, kv_count = _nonempty_first(nonempty)
  q_order, q_count = _nonempty_first(jnp.swapaxes(nonempty, 1, 2))
  return TileSchedule(classes, kv_order, kv_count, q_order, q_count,
                      block_q, block_kv)


def max_visited_blocks(mask: masks.AttentionMask, block_q: int,
                       block_kv: int) -> tuple[int, int]:
  """Static upper bounds on the nonempty tiles of one tile row and column.

  Returns ``(per_q_block, per_kv_block)``: no query block has more than
  ``per_q_block`` nonempty key blocks in :func:`tile_classes`, and no key
  block more than ``per_kv_block`` nonempty query blocks, whatever the
  array fields hold.  Only a window bounds them below the full
  ``ceil(S / block_kv)`` and ``ceil(T / block_q)``: query ``t`` sees keys in
  ``[t - left, t + right']`` (``right'`` the window's right side, or 0 with
  ``is_causal``), so a query block spans ``block_q + left + right'`` key
  positions, which touch at most ``(span - 2) // block_kv + 2`` key blocks
  (and symmetrically for a key block).  A kernel can size its loop over
  visited tiles with these instead of the full tile counts.
  """
  if block_q < 1 or block_kv < 1:
    raise ValueError(f"block sizes must be positive, got {block_q}, {block_kv}")
  num_q, num_kv = masks.cdiv(mask.q_len, block_q), masks.cdiv(mask.kv_len, block_kv)
  right = mask.right_offset()
  if mask.window is None or right is None:
    return num_kv, num_q
  width = mask.window[0] + right  # visible offsets s - t span width + 1
  per_q = (block_q + width - 2) // block_kv + 2
  per_kv = (block_kv + width - 2) // block_q + 2
  return min(per_q, num_kv), min(per_kv, num_q)


def ranges_may_see(q_start: int, q_len: int, kv_start: int, kv_len: int, *,
                   is_causal: bool, window: tuple[int, int] | None) -> bool:
  """Static: whether some query at global positions ``[q_start, q_start +
  q_len)`` may see some key at ``[kv_start, kv_start + kv_len)`` under the
  causal and window rules (lengths, segment ids and dense masks can only
  hide more).  A context-parallel ring uses it to skip, for every device,
  the steps whose blocks see nothing."""
  if q_len <= 0 or kv_len <= 0:
    return False
  # t - s over the pair spans [lowest, highest]; visible offsets are
  # [-right, left] (either side unbounded when absent).
  lowest = q_start - (kv_start + kv_len - 1)
  highest = q_start + q_len - 1 - kv_start
  right = masks.right_offset(is_causal, window)
  if right is not None and highest < -right:
    return False
  return window is None or lowest <= window[0]


# ------------------------------------------------------------------ decode
def decode_chunk_class(bounds: masks.DecodeBounds, start: Array, chunk: int
                       ) -> tuple[Array, Array]:
  """What a decode kernel must do with the cache slots ``start .. start +
  chunk - 1`` of a sequence with these :func:`decode_bounds`
  (elementwise; scalars in a kernel).

  Returns bool ``(full, unseen)``: ``full`` when every new query sees every
  slot (the element mask can be skipped); ``unseen`` when some slot is
  outside :func:`decode_key_range` (no query sees it: its value may hold
  anything, NaN included, and must not reach the value product).
  """
  full = (start >= bounds.common_lo) & (start + chunk <= bounds.common_hi)
  unseen = (start < bounds.first) | (start + chunk > bounds.end)
  return full, unseen


def decode_max_chunks(num_new: int, kv_len: int, chunk: int,
                      window: tuple[int, int] | None) -> int:
  """Static bound on the ``chunk``-slot chunks (chunk ``c`` holds slots
  ``[c * chunk, (c + 1) * chunk)``) that :func:`decode_key_range` can
  touch, whatever the lengths: all ``ceil(kv_len / chunk)`` without a
  window; with one, ``T`` consecutive queries see at most ``T + left``
  consecutive slots (see :func:`max_visited_blocks`)."""
  if num_new < 1 or chunk < 1:
    raise ValueError(f"num_new and chunk must be positive, got {num_new}, "
                     f"{chunk}")
  if kv_len == 0:
    return 0
  # The query block's position is per row, so the mask describes a block
  # of a longer sequence (offsets): the window is not clamped to T.
  mask = masks.AttentionMask(batch=1, q_len=num_new, kv_len=kv_len, is_causal=True,
                       window=window, has_offsets=True)
  return max_visited_blocks(mask, num_new, chunk)[0]
