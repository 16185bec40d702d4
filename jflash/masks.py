"""Attention visibility: the one place that defines which query sees which key.

Every backend, forward and backward, asks this module which key ``s`` is
visible to query ``t`` in batch row ``b`` (and head ``n``, when a dense mask
is given): :meth:`AttentionMask.block_visibility` for tiles of elements,
:func:`visibility_at` inside kernels, :func:`decode_row_bounds` for decode.
Which tiles of the score matrix a kernel visits follows from these rules in
:mod:`jflash.tiles`.

Semantics (identical to ``jax.nn.dot_product_attention`` where it has the
feature; positions count from 0 at the start of the query and key sequences,
so causal masking is aligned top-left when ``T != S``)::

    visible(b, n, t, s) =
        t < T and s < S
        and (not is_causal or s <= t)
        and (window is None or t - left <= s <= t + right)
        and (q_lengths is None or t < q_lengths[b])
        and (kv_lengths is None or s < kv_lengths[b])
        and (segment_ids is None or q_segment_ids[b, t] == kv_segment_ids[b, s])
        and (dense is None or dense[b, n, t, s])
        and (mask_fn is None or mask_fn(t, s))

``mask_fn`` is visibility as a function of positions (global positions
under context parallelism; see :class:`AttentionMask`), written with
``jnp`` operations; the ready-made ones below (:class:`PrefixLM`,
:class:`ChunkedCausal`, :class:`GlobalAndWindow`, :class:`Dilated`) show
how to write one.  Tiles are classified from it once per call
(:mod:`jflash.tiles`), so kernels skip the tiles it hides and mask
elements only where it hides part of a tile.

The structural part (causal, window, lengths) gives every query row one
contiguous interval of visible keys whose two ends never decrease as ``t``
grows (:meth:`AttentionMask.bounds_at`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

MAX_POSITION = 2**30
"""Bound on the global positions of masks with offsets, so that every
backend's position arithmetic stays within int32."""



def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def row_bounds(q_idx: Array, *, q_len: int, kv_len: int, is_causal: bool,
               window: tuple[int, int] | None, q_length: Array | int | None = None,
               kv_length: Array | int | None = None,
               q_offset: Array | int | None = None,
               kv_offset: Array | int | None = None) -> tuple[Array, Array]:
  """The structural rule for query positions ``q_idx`` (any shape): the
  visible keys are ``lo <= s < hi``, and rows that see nothing get
  ``hi == lo``.

  Positions are local: query ``t`` and key ``s`` stand at the global
  positions ``t + q_offset`` and ``s + kv_offset`` (offsets default to 0),
  and causal, window and lengths apply to global positions, while ``q_len``
  and ``kv_len`` bound the local ones (a shard of a longer sequence).

  Elementwise integer operations only (``maximum``, ``minimum``, ``where``
  and comparisons against scalars), so that kernels can apply the same rule
  to position arrays in their own register layouts.  ``q_length`` and
  ``kv_length`` are this batch row's lengths (scalars or arrays that
  broadcast against ``q_idx``), or None; the offsets are scalars, arrays
  that broadcast against ``q_idx`` (one offset per batch row, as decoding
  needs: see :func:`decode_row_bounds`), or None.
  """
  # The query's global position in local key coordinates; the arithmetic
  # below never leaves int32 for positions and window sides below 2**30.
  diag = shifted(q_idx, q_offset, kv_offset)
  lo = jnp.zeros_like(q_idx)
  if window is not None and diag is q_idx:
    lo = jnp.maximum(q_idx - window[0], 0)
  elif window is not None:
    lo = jnp.maximum(diag, window[0]) - window[0]
  hi = jnp.full_like(q_idx, kv_len)
  if kv_length is not None:
    hi = jnp.minimum(hi, shifted(kv_length, None, kv_offset))
  right = right_offset(is_causal, window)
  if right is not None:
    hi = jnp.minimum(hi, diag + (right + 1))
  q_valid = q_idx < q_len
  if q_length is not None:
    q_valid = q_valid & (q_idx < shifted(q_length, None, q_offset))
  return lo, jnp.where(q_valid, hi, lo)


def shifted(x, plus, minus):
  """``x + plus - minus`` with absent terms left out."""
  if plus is not None:
    x = x + plus
  if minus is not None:
    x = x - minus
  return x


def right_offset(is_causal: bool,
                 window: tuple[int, int] | None) -> int | None:
  """Largest visible ``s - t``, or None when unbounded."""
  offsets = []
  if is_causal:
    offsets.append(0)
  if window is not None:
    offsets.append(window[1])
  return min(offsets) if offsets else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """Everything that decides visibility, in canonical batched form.

  Static fields (Python values, part of the trace):
    batch: ``B``.
    q_len: ``T``, the query sequence length.
    kv_len: ``S``, the key/value sequence length.
    is_causal: keys after the query position are hidden (top-left aligned).
    window: ``(left, right)``: query ``t`` sees keys ``t - left .. t + right``;
      ``None`` for no window.  Any non-negative ints; a side past the
      sequence it reaches is stored as ``T`` (left) or ``S`` (right), which
      hides the same keys.

  Array fields (``None`` when absent):
    q_lengths: ``[B]`` int32, queries at or past it see nothing.
    kv_lengths: ``[B]`` int32, keys at or past it are hidden.
    q_segment_ids: ``[B, T]`` int32.
    kv_segment_ids: ``[B, S]`` int32; a query sees only keys of its segment.
    dense: ``[B|1, N|1, T|1, S|1]`` bool, True means visible.
    q_offset, kv_offset: int32 scalars, the global positions of the first
      query and key when this mask covers a block of longer sequences (one
      device's shard, one step of a ring); causal, window and lengths then
      apply to global positions ``t + q_offset`` and ``s + kv_offset``,
      which must be below ``2**30``, while ``q_len``, ``kv_len``, segment
      ids and the dense mask stay local.  None means 0.
    has_offsets: static, True when the mask describes a block of longer
      sequences: set whenever an offset is given, and kept by the static
      rules a kernel compiles in (see :meth:`static_rules`).
    mask_fn: static, ``mask_fn(q_pos, kv_pos) -> bool`` of int32 global
      positions (any shapes that broadcast), or None; compared by
      equality, so a hashable callable with value equality (such as the
      dataclasses below) keeps compiled programs cached across calls.
  """

  batch: int = dataclasses.field(metadata=dict(static=True))
  q_len: int = dataclasses.field(metadata=dict(static=True))
  kv_len: int = dataclasses.field(metadata=dict(static=True))
  is_causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
  window: tuple[int, int] | None = dataclasses.field(
      default=None, metadata=dict(static=True))
  q_lengths: Array | None = None
  kv_lengths: Array | None = None
  q_segment_ids: Array | None = None
  kv_segment_ids: Array | None = None
  dense: Array | None = None
  q_offset: Array | None = None
  kv_offset: Array | None = None
  has_offsets: bool = dataclasses.field(default=False,
                                        metadata=dict(static=True))
  mask_fn: Any = dataclasses.field(default=None, metadata=dict(static=True))

  def __post_init__(self):
    if self.q_offset is not None or self.kv_offset is not None:
      object.__setattr__(self, "has_offsets", True)
    if self.window is not None:
      left, right = self.window
      if left < 0 or right < 0:
        raise ValueError(f"window must be non-negative, got {self.window}")
      # A side at or beyond the sequence it reaches hides nothing on that
      # side (t - left < 0 <= s, s < S <= t + right); storing T or S keeps
      # the same mask within every backend's int32 position arithmetic.
      # With offsets the reach is not static: a side of MAX_POSITION or
      # more hides nothing among global positions below it.
      if self.has_offsets:
        window = (min(int(left), MAX_POSITION), min(int(right), MAX_POSITION))
      else:
        window = (min(int(left), self.q_len), min(int(right), self.kv_len))
      if window != self.window:
        object.__setattr__(self, "window", window)
    if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
      raise ValueError("q_segment_ids and kv_segment_ids go together")

  def static_rules(self) -> "AttentionMask":
    """The static part of the rule (no array fields), for a kernel that
    receives the arrays separately and passes them to
    :func:`visibility_at`."""
    return AttentionMask(batch=self.batch, q_len=self.q_len,
                         kv_len=self.kv_len, is_causal=self.is_causal,
                         window=self.window, has_offsets=self.has_offsets,
                         mask_fn=self.mask_fn)

  def diagonal_shift(self) -> Array | int:
    """``q_offset - kv_offset``: query ``t`` stands at key position
    ``t + diagonal_shift()`` (0 without offsets)."""
    return shifted(0, self.q_offset, self.kv_offset)

  # ------------------------------------------------------------------ rows
  def right_offset(self) -> int | None:
    """Largest ``s - t`` that is visible, or None when unbounded."""
    return right_offset(self.is_causal, self.window)

  def per_row(self, x: Array | None, ndim: int) -> Array | None:
    """``[B]`` -> ``[B, 1, ...]`` with ``ndim`` dims (None stays None)."""
    return None if x is None else x.reshape((-1,) + (1,) * (ndim - 1))

  def bounds_at(self, q_idx: Array) -> tuple[Array, Array]:
    """Visible key interval ``[lo, hi)`` of query rows from the structural
    part (causal, window, lengths, sequence bounds).

    ``q_idx`` has a leading batch axis of size 1 or ``B``; the result
    broadcasts it against the lengths.  Empty rows get ``lo >= hi``.
    """
    q_idx = jnp.asarray(q_idx, jnp.int32)
    lo, hi = row_bounds(
        q_idx, q_len=self.q_len, kv_len=self.kv_len,
        is_causal=self.is_causal, window=self.window,
        q_length=self.per_row(self.q_lengths, q_idx.ndim),
        kv_length=self.per_row(self.kv_lengths, q_idx.ndim),
        q_offset=self.q_offset, kv_offset=self.kv_offset)
    return jnp.broadcast_arrays(lo, hi)

  def has_structural_part_only(self) -> bool:
    """True when only causal/window/lengths are set (no segments, dense
    mask or mask function)."""
    return (self.q_segment_ids is None and self.dense is None
            and self.mask_fn is None)

  def may_have_empty_rows(self) -> bool:
    """Static: False when every query row is sure to see a key (no lengths,
    segments or dense mask, and no window that can slide past the keys)."""
    if not self.has_structural_part_only() or self.q_lengths is not None:
      return True
    if self.kv_lengths is not None:
      return True
    if self.has_offsets:
      # A block of queries may lie wholly before (causal) or beside
      # (window) a block of keys.
      return self.is_causal or self.window is not None
    # Causal rows see key 0 at least; a window's row t sees key min(t, S-1)
    # unless t - left >= S.
    return self.window is not None and self.q_len - 1 - self.window[0] >= \
        self.kv_len

  def rows_with_visible_keys(self) -> Array:
    """``[B, T]`` bool: rows that see at least one key.

    Exact only for the structural part; raises if segment ids or a dense mask
    are present (those would need the full ``[T, S]`` product).
    """
    if not self.has_structural_part_only():
      raise ValueError("rows_with_visible_keys covers causal, window and "
                       "lengths only")
    lo, hi = self.bounds_at(jnp.arange(self.q_len, dtype=jnp.int32)[None])
    return jnp.broadcast_to(lo < hi, (self.batch, self.q_len))

  def padded(self, q_size: int, kv_size: int) -> "AttentionMask":
    """The same mask with its per-position arrays padded to ``q_size`` query
    and ``kv_size`` key positions, so that :meth:`block_visibility` can cut
    any tile of a tiling that covers them.  Padded positions stay hidden
    (they lie past ``T`` / ``S``)."""
    def pad(x, axis, size):
      if x is None or x.shape[axis] in (1, size):
        return x
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, size - x.shape[axis])
      return jnp.pad(x, widths)
    return dataclasses.replace(
        self, q_segment_ids=pad(self.q_segment_ids, 1, q_size),
        kv_segment_ids=pad(self.kv_segment_ids, 1, kv_size),
        dense=pad(pad(self.dense, 2, q_size), 3, kv_size))

  # -------------------------------------------------------------- elements
  def block_visibility(self, q_start: Array | int, block_q: int,
                       kv_start: Array | int, block_kv: int) -> Array:
    """Visibility of one tile, for every batch row.

    Args:
      q_start, kv_start: first query / key position of the tile (may be
        traced).  Positions past ``T`` / ``S`` are hidden; the mask's arrays
        must cover the tile (see :meth:`padded`).
      block_q, block_kv: static tile sizes.

    Returns:
      bool ``[B|1, N|1, block_q, block_kv]``: the batch axis is 1 when no
      rule depends on the batch row, the head axis is ``N`` only for a dense
      mask with a head axis.  Only slices along the sequence axes are taken,
      so arrays sharded over batch or heads stay sharded.
    """
    q_idx = q_start + jnp.arange(block_q, dtype=jnp.int32)
    k_idx = kv_start + jnp.arange(block_kv, dtype=jnp.int32)
    lo, hi = self.bounds_at(q_idx[None])  # [B|1, bq]
    vis = ((k_idx[None, None, :] >= lo[..., None])
           & (k_idx[None, None, :] < hi[..., None]))
    if self.q_segment_ids is not None:
      q_seg = lax.dynamic_slice_in_dim(self.q_segment_ids, q_start, block_q, 1)
      k_seg = lax.dynamic_slice_in_dim(self.kv_segment_ids, kv_start,
                                       block_kv, 1)
      vis = vis & (q_seg[:, :, None] == k_seg[:, None, :])
    if self.mask_fn is not None:
      vis = vis & self.function_visibility(q_idx[:, None], k_idx[None, :])[
          None]
    vis = vis[:, None]
    if self.dense is not None:
      dense = self.dense
      if dense.shape[2] > 1:
        dense = lax.dynamic_slice_in_dim(dense, q_start, block_q, 2)
      if dense.shape[3] > 1:
        dense = lax.dynamic_slice_in_dim(dense, kv_start, block_kv, 3)
      vis = vis & dense
    return vis

  def function_visibility(self, q_idx: Array, kv_idx: Array) -> Array:
    """``mask_fn`` at local positions ``q_idx``, ``kv_idx`` (int32, any
    shapes that broadcast), given the global positions; True without a
    function."""
    return apply_mask_fn(self.mask_fn, q_idx, kv_idx, self.q_offset,
                         self.kv_offset)

  def visibility(self) -> Array:
    """The whole mask, ``[B, N|1, T, S]`` bool.  Quadratic: reference only."""
    vis = self.block_visibility(0, self.q_len, 0, self.kv_len)
    return jnp.broadcast_to(vis, (self.batch,) + vis.shape[1:])


def key_visibility_at(position: Array | int, kv_len: int, *,
                      is_causal: bool,
                      window: tuple[int, int] | None) -> Array:
  """``[S]`` bool: which keys a single query at absolute ``position`` (may
  be traced) sees under causal/window rules, e.g. one decode step against a
  cache of ``kv_len`` slots.  Same rule as :class:`AttentionMask`."""
  mask = AttentionMask(batch=1, q_len=kv_len, kv_len=kv_len,
                       is_causal=is_causal, window=window)
  return mask.block_visibility(position, 1, 0, kv_len)[0, 0, 0]


# ------------------------------------------------------------------ decode
def decode_position(t: Array, lengths: Array, num_new: int) -> Array:
  """The position of new token ``t`` (int32, any shape broadcasting with
  ``lengths``) of a sequence holding ``lengths`` tokens, the ``num_new``
  new ones included: ``lengths - num_new + t``."""
  return lengths - num_new + t


def decode_row_bounds_at(t: Array, lengths: Array, num_new: int, *,
                         kv_len: int,
                         window: tuple[int, int] | None
                         ) -> tuple[Array, Array]:
  """The visible cache interval ``lo <= s < hi`` of new query ``t`` of a
  sequence with ``lengths`` valid slots (``t`` and ``lengths`` int32
  arrays or scalars that broadcast; the rule of :func:`decode_row_bounds`).

  Elementwise integer operations only, so that a decode kernel applies it
  to row vectors in its own register layout, or to scalars.
  """
  if window is not None:
    # A side at least kv_len hides nothing; clamping keeps int32 sums.
    window = (min(int(window[0]), kv_len), min(int(window[1]), kv_len))
  return row_bounds(t, q_len=num_new, kv_len=kv_len, is_causal=True,
                    window=window, kv_length=lengths,
                    q_offset=lengths - num_new)  # decode_position(0, ...)


def decode_row_bounds(lengths: Array, num_new: int, *, kv_len: int,
                      window: tuple[int, int] | None
                      ) -> tuple[Array, Array]:
  """Visible cache intervals of ``num_new`` new queries per sequence.

  Decoding appends ``T = num_new`` tokens to a cache of ``kv_len`` slots;
  ``lengths[b]`` counts the valid slots of sequence ``b`` *including* the
  ``T`` new ones, so new query ``t`` stands at position
  ``p = lengths[b] - T + t`` and sees slots ``s`` with
  ``max(p - left, 0) <= s <= p`` (causal within the new block; the right
  side of ``window`` never reaches past ``p``).  A query whose position is
  negative (``lengths[b] < T - t``) sees nothing.  This is the causal rule
  of :func:`row_bounds` with a per-row query offset ``lengths - T`` and key
  lengths ``lengths``.

  Args:
    lengths: int ``[B]``, each in ``[0, kv_len]``.
    num_new: ``T``, static.
    kv_len: cache capacity ``S``, static.
    window: ``(left, right)`` or None.

  Returns:
    int32 ``(lo, hi)`` ``[B, T]``: query ``t`` sees ``lo <= s < hi``;
    ``hi <= lo`` for a query that sees nothing.
  """
  lengths = jnp.asarray(lengths, jnp.int32)[:, None]
  t = jnp.arange(num_new, dtype=jnp.int32)[None, :]
  lo, hi = decode_row_bounds_at(t, lengths, num_new, kv_len=kv_len,
                                window=window)
  return jnp.broadcast_arrays(lo, hi)


def decode_visibility(lengths: Array, num_new: int, key_positions: Array, *,
                      kv_len: int, window: tuple[int, int] | None,
                      mask_fn: Callable[[Array, Array], Array] | None = None
                      ) -> Array:
  """bool ``[B, T, C]``: whether new query ``t`` of sequence ``b`` sees the
  cache slot at ``key_positions[b, c]`` (int32 ``[B, C]``, any slots, e.g.
  one chunk or the pages of a block table); the rule of
  :func:`decode_row_bounds`, ANDed with ``mask_fn`` at the query's
  position ``lengths[b] - T + t`` and the slot."""
  lo, hi = decode_row_bounds(lengths, num_new, kv_len=kv_len, window=window)
  pos = key_positions[:, None, :]
  vis = (pos >= lo[..., None]) & (pos < hi[..., None])
  if mask_fn is not None:
    q_pos = decode_position(jnp.arange(num_new, dtype=jnp.int32),
                            jnp.asarray(lengths, jnp.int32)[:, None], num_new)
    vis = vis & apply_mask_fn(mask_fn, q_pos[..., None], pos)
  return vis


@dataclasses.dataclass(frozen=True)
class DecodeBounds:
  """What the new queries of a sequence see, in a few values shaped as its
  lengths (``[B]``, or scalars in a kernel): computed once per sequence,
  then :func:`decode_chunk_class` classifies each chunk from it.

  Attributes:
    first, end: the key range of :func:`decode_key_range`.
    common_lo, common_hi: every new query sees every slot ``common_lo <= s
      < common_hi`` (the last query's ``lo`` and the first query's ``hi``;
      none when ``common_hi <= common_lo``).
  """

  first: Array
  end: Array
  common_lo: Array
  common_hi: Array


def decode_bounds(lengths: Array, num_new: int, *, kv_len: int,
                  window: tuple[int, int] | None) -> DecodeBounds:
  """The :class:`DecodeBounds` of sequences with these lengths (elementwise:
  ``[B]``, or scalars in a kernel)."""
  lengths = jnp.asarray(lengths, jnp.int32)
  bounds = functools.partial(decode_row_bounds_at, lengths=lengths,
                             num_new=num_new, kv_len=kv_len, window=window)
  # Both ends of a query's interval are nondecreasing in t, so the hull
  # runs from the first query that sees anything (the first whose position
  # lengths - T + t is not negative) to the last query's end, and the
  # slots all queries see from the last query's lo to the first one's hi.
  first_seeing = jnp.clip(num_new - lengths, 0, num_new - 1)
  first, first_seeing_hi = bounds(first_seeing)
  last_lo, end = bounds(jnp.full_like(lengths, num_new - 1))
  _, first_hi = bounds(jnp.zeros_like(lengths))
  seen = first_seeing_hi > first
  return DecodeBounds(first=jnp.where(seen, first, 0),
                      end=jnp.where(seen, end, 0),
                      common_lo=last_lo, common_hi=first_hi)


def decode_key_range(lengths: Array, num_new: int, *, kv_len: int,
                     window: tuple[int, int] | None) -> tuple[Array, Array]:
  """int32 ``(first, end)`` shaped as ``lengths`` (``[B]``, or a scalar in
  a kernel): the slots ``first <= s < end`` hold every key some new query
  of the sequence sees (``first == end == 0`` when none sees any).  A
  decode kernel reads only these slots (with a window, only the window's
  pages).
  """
  bounds = decode_bounds(lengths, num_new, kv_len=kv_len, window=window)
  return bounds.first, bounds.end


# ------------------------------------------------------ kernel-side helpers
def visibility_at(mask: AttentionMask, q_idx: Array, kv_idx: Array, *,
                  q_length: Array | None = None,
                  kv_length: Array | None = None,
                  q_segment_ids: Array | None = None,
                  kv_segment_ids: Array | None = None,
                  q_offset: Array | None = None,
                  kv_offset: Array | None = None) -> Array:
  """Element visibility for one batch row, from data a kernel holds.

  The same rule as :meth:`AttentionMask.block_visibility` (through
  :func:`row_bounds`), for code that has already cut one batch row's
  per-position data to a tile (a Pallas kernel step) and works with explicit
  position arrays in any orientation.

  Args:
    mask: supplies the static rules (``q_len``, ``kv_len``, ``is_causal``,
      ``window``); its array fields are ignored.
    q_idx, kv_idx: int32 absolute query / key positions; they broadcast
      against each other (e.g. ``[bq, bk]`` iotas, or ``[bk, bq]`` for a
      transposed tile).
    q_length, kv_length: this row's sequence lengths (int32 scalars), or
      None when the call has none.
    q_segment_ids, kv_segment_ids: this row's segment ids at ``q_idx`` /
      ``kv_idx`` (broadcastable to the result), or None when the call has
      none; both or neither.
    q_offset, kv_offset: the global positions of local query and key 0
      (int32 scalars; see :class:`AttentionMask`), or None for 0.

  Returns:
    bool array of the broadcast shape of ``q_idx`` and ``kv_idx``.
  """
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids go together")
  lo, hi = row_bounds(q_idx, q_len=mask.q_len, kv_len=mask.kv_len,
                      is_causal=mask.is_causal, window=mask.window,
                      q_length=q_length, kv_length=kv_length,
                      q_offset=q_offset, kv_offset=kv_offset)
  vis = (kv_idx >= lo) & (kv_idx < hi)
  if q_segment_ids is not None:
    vis = vis & (q_segment_ids == kv_segment_ids)
  if mask.mask_fn is not None:
    vis = vis & apply_mask_fn(mask.mask_fn, q_idx, kv_idx, q_offset,
                              kv_offset)
  return vis


# ---------------------------------------------------------- mask functions
def apply_mask_fn(mask_fn: Callable[[Array, Array], Array] | None,
                  q_idx: Array, kv_idx: Array,
                  q_offset: Array | int | None = None,
                  kv_offset: Array | int | None = None) -> Array:
  """``mask_fn`` at the global positions of local ``q_idx`` and ``kv_idx``
  (int32, broadcasting), as a bool array of their broadcast shape; True
  where there is no function."""
  shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx))
  if mask_fn is None:
    return jnp.ones(shape, jnp.bool_)
  vis = mask_fn(shifted(q_idx, q_offset, None), shifted(kv_idx, kv_offset,
                                                          None))
  return jnp.broadcast_to(jnp.asarray(vis, jnp.bool_), shape)


@dataclasses.dataclass(frozen=True)
class PrefixLM:
  """Prefix-LM (T5, PaLI, UL2): the first ``prefix`` positions see each
  other both ways; every later query sees the prefix and the keys up to
  its own position.  Pass without ``is_causal`` (the prefix is not
  causal)."""

  prefix: int

  def __call__(self, q: Array, k: Array) -> Array:
    return (k < self.prefix) | (k <= q)


@dataclasses.dataclass(frozen=True)
class ChunkedCausal:
  """Chunked local attention (Llama 4's local layers): the sequence is cut
  into chunks of ``chunk`` positions, and a query sees the keys of its own
  chunk up to its own position."""

  chunk: int

  def __call__(self, q: Array, k: Array) -> Array:
    # Positions are non-negative: truncating division is floor division,
    # without the sign fix-up of ``//``.
    chunk = jnp.int32(self.chunk)
    return (lax.div(q, chunk) == lax.div(k, chunk)) & (k <= q)


@dataclasses.dataclass(frozen=True)
class GlobalAndWindow:
  """Global tokens plus a sliding window (Longformer, BigBird): the first
  ``num_global`` positions see and are seen by every position; the others
  see keys ``q - left .. q + right``."""

  num_global: int
  left: int
  right: int

  def __call__(self, q: Array, k: Array) -> Array:
    return ((q < self.num_global) | (k < self.num_global)
            | ((k >= q - self.left) & (k <= q + self.right)))


@dataclasses.dataclass(frozen=True)
class Dilated:
  """A dilated causal window (Sparse Transformer's strided pattern,
  LongNet): a query sees the ``span`` keys ``q, q - dilation, q - 2
  dilation, ...`` before it."""

  span: int
  dilation: int

  def __call__(self, q: Array, k: Array) -> Array:
    distance = q - k
    # lax.rem: ``%``'s sign fix-up is not needed where distance >= 0.
    return ((distance >= 0) & (distance < self.span * self.dilation)
            & (lax.rem(distance, jnp.int32(self.dilation)) == 0))
