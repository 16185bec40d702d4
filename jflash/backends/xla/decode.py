"""The ``xla`` decode backend: split-K attention of a few new queries against
a contiguous or paged cache, in pure JAX (the reference path everywhere).

The work is laid out as the decode kernels lay it out:

* **GQA grouping**: the ``G = N / K`` query heads of one key/value head and
  the ``T`` new tokens become the ``G * T`` rows of one tile, so each cache
  chunk is read once per key/value head, not once per query head.
* **Split-K**: the cache is cut into chunks of ``C`` slots (a whole number
  of pages when paged).  Only the chunks holding
  :func:`jflash.masks.decode_key_range` (the slots some new query sees:
  below the length, inside the window) are visited; their list is cut into
  ``num_splits`` contiguous runs, each run an online softmax of its own
  (vectorized over splits: on a GPU or TPU, independent workers), and the
  partial results are merged exactly through their logsumexp, one split
  after another in index order, so every run gives the same bits.
* **Paged reads**: a chunk's pages are gathered through the block table;
  table entries of pages outside the key range are never dereferenced
  (page 0 is read in their place and masked), so they may hold anything.

Cache slots outside the key range may hold anything, NaN included: their
logits are masked and their values zeroed before the value product.
Softmax and accumulation are float32 (float64 for float64 inputs);
bfloat16/float16 tile products take operands in that dtype with float32
accumulation, as the ``xla`` attention backend does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jflash import masks
from jflash.core import alibi
from jflash.core.call import DecodeCall
from jflash.core.splits import (DecodeConfig, SplitPlan, group_rows, make_plan,
                                 merge_partials, ungroup_rows)

Array = jax.Array
_HIGHEST = lax.Precision.HIGHEST


def _mm(plan: SplitPlan, subscripts: str, a: Array, b: Array) -> Array:
  if plan.matmul_dtype == plan.compute_dtype:
    return jnp.einsum(subscripts, a.astype(plan.compute_dtype),
                      b.astype(plan.compute_dtype), precision=_HIGHEST)
  return jnp.einsum(subscripts, a.astype(plan.matmul_dtype),
                    b.astype(plan.matmul_dtype),
                    preferred_element_type=plan.compute_dtype)


class _ChunkReader:
  """Reads chunk ``c[b]`` of every sequence ``b`` of the cache."""

  def __init__(self, call: DecodeCall, chunk: int, first: Array,
               end: Array):
    self.call, self.chunk = call, chunk
    self.first, self.end = first, end

  def read(self, c: Array) -> tuple[Array, Array, Array]:
    """``c`` int32 ``[B]`` -> ``(key, value [B, C, K, H], slots [B, C])``;
    slots past the capacity are read from in-range ones (and hidden by
    the mask)."""
    slots = c[:, None] * self.chunk + jnp.arange(self.chunk, dtype=jnp.int32)
    if self.call.paged:
      return (*self._paged(c), slots)
    batch_rows = jnp.arange(slots.shape[0], dtype=jnp.int32)[:, None]
    index = jnp.clip(slots, 0, self.call.capacity - 1)
    return (self.call.key[batch_rows, index],
            self.call.value[batch_rows, index], slots)

  def _paged(self, c: Array) -> tuple[Array, Array]:
    call = self.call
    page_size = call.page_size
    num_pages, max_pages = call.key.shape[0], call.block_table.shape[1]
    per_chunk = self.chunk // page_size
    column = c[:, None] * per_chunk + jnp.arange(per_chunk, dtype=jnp.int32)
    start = column * page_size
    # Only pages that hold part of [first, end) are looked up; the others
    # (and out-of-range entries) read page 0, whose slots the mask hides.
    needed = ((column < max_pages) & (start < self.end[:, None])
              & (start + page_size > self.first[:, None]))
    ids = jnp.take_along_axis(call.block_table,
                              jnp.clip(column, 0, max_pages - 1), axis=1)
    ids = jnp.where(needed & (ids >= 0) & (ids < num_pages), ids, 0)
    shape = (c.shape[0], self.chunk) + call.key.shape[2:]
    return call.key[ids].reshape(shape), call.value[ids].reshape(shape)


def _update(call: DecodeCall, plan: SplitPlan, q_rows: Array, carry,
            k: Array, v: Array, slots: Array):
  """One chunk's step of the online softmax: ``carry = (m, l, acc)`` with
  ``m, l [B, K, R]`` and ``acc [B, K, R, H]`` (unnormalized), the chunk's
  ``k, v [B, C, K, H]`` at cache ``slots [B, C]``."""
  m, l, acc = carry
  num_new = call.num_new
  groups = q_rows.shape[2] // num_new
  vis = masks.decode_visibility(call.lengths, num_new, slots,
                                kv_len=call.capacity, window=call.window,
                                mask_fn=call.mask_fn)
  # Values of slots no query sees are zeroed: they may hold anything.
  used = vis.any(1)[:, :, None, None]
  v = jnp.where(used, v, jnp.zeros((), v.dtype))
  s = _mm(plan, "bkrh,bckh->bkrc", q_rows, k) * jnp.asarray(
      call.scale, plan.compute_dtype)
  if call.logits_soft_cap is not None:
    cap = jnp.asarray(call.logits_soft_cap, s.dtype)
    s = cap * jnp.tanh(s / cap)
  if call.alibi_slopes is not None:
    # Row g * T + t is new token t of query head k * G + g, at position
    # lengths - T + t.
    batch, kv_heads = s.shape[:2]
    slopes = call.alibi_slopes.reshape(-1, kv_heads, groups).astype(s.dtype)
    slopes = jnp.repeat(slopes, num_new, axis=2)[..., None]
    positions = masks.decode_position(jnp.arange(num_new, dtype=jnp.int32),
                                      call.lengths[:, None], num_new)
    positions = jnp.tile(positions, (1, groups))  # [B, G*T]
    s = s + alibi.penalty(
        slopes, positions[:, None, :, None] - slots[:, None, None, :])
  rows_vis = jnp.tile(vis, (1, groups, 1))[:, None]  # [B, 1, G*T, C]
  s = jnp.where(rows_vis, s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(-1))
  m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
  p = jnp.exp(s - m_safe[..., None])
  alpha = jnp.exp(m - m_safe)
  l = alpha * l + p.sum(-1)
  acc = alpha[..., None] * acc + _mm(plan, "bkrc,bckh->bkrh", p, v)
  return m_new, l, acc


def _initial(plan: SplitPlan, q_rows: Array):
  """``(m, l, acc)`` before any chunk."""
  # From the queries: inside a shard_map that checks how values vary over
  # mesh axes, the carry varies as the loop's results do.
  acc0 = jnp.zeros_like(q_rows, plan.compute_dtype)
  return (jnp.full_like(acc0[..., 0], -jnp.inf), jnp.zeros_like(acc0[..., 0]),
          acc0)


def _split_partial(call: DecodeCall, plan: SplitPlan, q_rows: Array,
                   reader: _ChunkReader, first_chunk: Array,
                   num_needed: Array, split: Array):
  """Online softmax over the chunks of one split, each gathered per
  sequence (windows, pages): ``(m, l, acc)``."""
  def body(j, carry):
    k, v, slots = reader.read(first_chunk + split * plan.per_split + j)
    return _update(call, plan, q_rows, carry, k, v, slots)

  # Chunks past every sequence's key range are not visited at all.
  trip = jnp.clip(num_needed.max() - split * plan.per_split, 0,
                  plan.per_split)
  return lax.fori_loop(0, trip, body, _initial(plan, q_rows))


def _sliced_partials(call: DecodeCall, plan: SplitPlan, q_rows: Array):
  """``(m, l, acc)`` with a leading split axis for a contiguous cache whose
  key ranges all start at slot 0 (no window) and which the splits' chunks
  cut exactly: every split takes its chunk of step ``j`` as one slice of
  the cache viewed ``[B, splits, per_split * C, K, H]``, so a step is a few
  large operations over all splits, with no gather."""
  batch, capacity, kv_heads, head_dim = call.key.shape
  splits, per_split, chunk = plan.num_splits, plan.per_split, plan.chunk
  view = lambda x: x.reshape(batch, splits, per_split * chunk, kv_heads,
                             head_dim)
  keys, values = view(call.key), view(call.value)
  step = jax.vmap(functools.partial(_update, call, plan, q_rows),
                  in_axes=(0, 1, 1, 0))

  def body(j, carry):
    k = lax.dynamic_slice_in_dim(keys, j * chunk, chunk, 2)
    v = lax.dynamic_slice_in_dim(values, j * chunk, chunk, 2)
    first = (jnp.arange(splits, dtype=jnp.int32) * per_split + j) * chunk
    slots = first[:, None] + jnp.arange(chunk, dtype=jnp.int32)
    slots = jnp.broadcast_to(slots[:, None], (splits, batch, chunk))
    return step(carry, k, v, slots)

  init = jax.tree.map(
      lambda x: jnp.broadcast_to(x, (splits,) + x.shape),
      _initial(plan, q_rows))
  return lax.fori_loop(0, per_split, body, init)


def decode_forward(call: DecodeCall, plan: SplitPlan) -> tuple[Array, Array]:
  """``(out [B, T, N, H] in the query dtype, lse [B, T, N] float32)``."""
  batch, num_new, num_heads, head_dim = call.query.shape
  if plan.num_chunks == 0:
    return (jnp.zeros(call.query.shape, call.dtype),
            jnp.full((batch, num_new, num_heads), -jnp.inf, jnp.float32))
  q_rows = group_rows(call.query, call.key.shape[2])
  # Slices rather than gathers where the chunks cut the cache exactly; on
  # a CPU a loop of small gathered chunks measured faster (cache-sized).
  if (not call.paged and call.window is None
      and call.capacity == plan.num_splits * plan.per_split * plan.chunk
      and (plan.per_split == 1 or call.target().platform != "cpu")):
    m, l, acc = _sliced_partials(call, plan, q_rows)
  else:
    first, end = masks.decode_key_range(call.lengths, num_new,
                                        kv_len=call.capacity,
                                        window=call.window)
    first_chunk = first // plan.chunk
    num_needed = jnp.where(end > first,
                           (end - 1) // plan.chunk - first_chunk + 1, 0)
    reader = _ChunkReader(call, plan.chunk, first, end)
    partial = functools.partial(_split_partial, call, plan, q_rows, reader,
                                first_chunk, num_needed)
    m, l, acc = jax.vmap(partial)(jnp.arange(plan.num_splits,
                                             dtype=jnp.int32))
  out, lse = merge_partials(m, l, acc)
  return (ungroup_rows(out, num_new).astype(call.dtype),
          ungroup_rows(lse, num_new).astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class XlaDecodeBackend:
  """Serves every valid decode call on every platform."""

  config: DecodeConfig = DecodeConfig()
  name: str = "xla"

  def __call__(self, call: DecodeCall) -> tuple[Array, Array]:
    return decode_forward(call, make_plan(call, self.config))
