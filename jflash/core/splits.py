"""Split-K decode pieces every decode backend shares.

A decode call's ``G = N / K`` query heads per key/value head and its ``T``
new tokens become the ``G * T`` rows of one tile (:func:`group_rows`), so
each cache chunk is read once per key/value head.  The cache is cut into
chunks and the chunks into splits computed independently
(:class:`DecodeConfig`, :func:`make_plan`); the splits' partial results are
merged exactly through their logsumexps, in split order, so every run gives
the same bits (:func:`merge_partials`, :func:`merge_normalized`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jflash import tiles
from jflash.core.call import DecodeCall, check_config

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiling of the decode backends (``xla``, and ``mosaic_tpu`` where its
  grid steps read one chunk each).

  Attributes:
    chunk_size: cache slots per chunk (a paged cache rounds it down to a
      whole number of pages, at least one); None (the ``xla`` default):
      one chunk per split, as long as ``max_logits_elements`` allows, so
      that each split is a few large operations rather than a loop of
      small ones.
    num_splits: how many runs of chunks are computed independently and
      merged; None picks ``ceil(parallelism / (B * K))``, so that the
      ``B * K * num_splits`` independent tiles fill ``parallelism`` workers
      even for a batch of one (capped by the chunks to visit).
    parallelism: the workers that ``num_splits=None`` fills.
    max_logits_elements: with ``chunk_size=None``, the most elements one
      step holds: logits and the chunk's keys and values, all splits at
      once; it bounds the memory of long caches.
    matmul_inputs: ``"auto"`` (bfloat16/float16 operands with float32
      accumulation, float32 at ``Precision.HIGHEST``) or ``"float32"``.
  """

  chunk_size: int | None = None
  num_splits: int | None = None
  parallelism: int = 16
  max_logits_elements: int = 1 << 24
  matmul_inputs: str = "auto"

  def __post_init__(self):
    check_config(self, ("parallelism", "max_logits_elements"),
                 optional=("chunk_size", "num_splits"))


@dataclasses.dataclass(frozen=True)
class SplitPlan:
  """Static facts of one call."""

  chunk: int          # C, slots per chunk
  num_chunks: int     # chunks any sequence may need (static bound)
  num_splits: int
  per_split: int      # chunks per split
  compute_dtype: np.dtype
  matmul_dtype: np.dtype


def _splits(call: DecodeCall, config: DecodeConfig) -> int:
  batch, kv_heads = call.query.shape[0], call.key.shape[2]
  if config.num_splits is not None:
    return config.num_splits
  return -(-config.parallelism // max(1, batch * kv_heads))


CPU_CHUNK = 256
"""Slots per chunk on a CPU for calls with many slots (``B * span >
CPU_WHOLE_SLOTS``): a chunk's keys and values stay in the cache there, and
a loop of small steps costs the CPU little."""
CPU_WHOLE_SLOTS = 16384


def _whole_chunks(call: DecodeCall, config: DecodeConfig) -> int:
  """``chunk_size=None``: as few steps as ``max_logits_elements`` allows
  (one per split when the cache is short): on GPUs and TPUs a loop of
  small steps costs a launch each.  The step holds the logits and the
  chunk's keys and values of every split, ``B * splits * (N * T + 2 * K *
  H)`` elements a slot.  Chunks that cut the span exactly into ``splits *
  steps`` are preferred (a contiguous cache is then sliced, not gathered).
  A multiple of 8 slots, of the page size when paged."""
  batch, num_new, num_heads, head_dim = call.query.shape
  kv_heads = call.key.shape[2]
  span = max(1, tiles.decode_max_chunks(num_new, call.capacity, 1,
                                        call.window))
  unit = call.page_size if call.paged else 8
  if call.target().platform == "cpu" and batch * span > CPU_WHOLE_SLOTS:
    return max(unit, CPU_CHUNK // unit * unit)
  splits = max(1, min(_splits(call, config), -(-span // unit)))
  per_slot = batch * splits * (num_heads * num_new + 2 * kv_heads * head_dim)
  limit = max(unit, config.max_logits_elements // max(1, per_slot))
  steps = -(-span // (splits * limit))
  for exact in range(steps, 2 * steps + 1):
    cut = splits * exact
    if span % cut == 0 and (span // cut) % unit == 0:
      return span // cut
  return -(-(-(-span // (splits * steps))) // unit) * unit


def make_plan(call: DecodeCall, config: DecodeConfig) -> SplitPlan:
  """Chunking and splitting for one call's shapes."""
  num_new = call.query.shape[1]
  size = (config.chunk_size if config.chunk_size is not None
          else _whole_chunks(call, config))
  if call.paged:
    chunk = call.page_size * max(1, size // call.page_size)
  else:
    chunk = max(1, min(size, call.capacity))
  num_chunks = tiles.decode_max_chunks(num_new, call.capacity, chunk,
                                       call.window)
  splits = max(1, min(_splits(call, config), num_chunks))
  per_split = -(-num_chunks // splits) if num_chunks else 0
  splits = -(-num_chunks // per_split) if per_split else 1
  compute = np.dtype(jnp.promote_types(call.dtype, jnp.float32))
  low = call.dtype in (jnp.bfloat16, jnp.float16)
  matmul = (np.dtype(call.dtype) if low and config.matmul_inputs == "auto"
            else compute)
  return SplitPlan(chunk, num_chunks, splits, per_split, compute, matmul)


def group_rows(query: Array, kv_heads: int) -> Array:
  """``[B, T, N, H]`` -> ``[B, K, G * T, H]`` (row ``g * T + t``; query head
  ``n = k * G + g`` reads key/value head ``k``)."""
  b, t, n, h = query.shape
  q = query.reshape(b, t, kv_heads, n // kv_heads, h)
  return jnp.transpose(q, (0, 2, 3, 1, 4)).reshape(b, kv_heads, -1, h)


def ungroup_rows(x: Array, num_new: int) -> Array:
  """``[B, K, G * T, ...]`` -> ``[B, T, N, ...]``."""
  b, k, rows = x.shape[:3]
  x = x.reshape(b, k, rows // num_new, num_new, *x.shape[3:])
  x = jnp.moveaxis(x, 3, 1)  # [B, T, K, G, ...]
  return x.reshape(b, num_new, rows // num_new * k, *x.shape[4:])


def merge_partials(m: Array, l: Array, acc: Array) -> tuple[Array, Array]:
  """Exact merge of split results ``(m, l, acc)`` (row maxima, sums and
  unnormalized outputs, leading split axis); see :func:`merge_normalized`.

  Returns ``(out [..., H], lse [...])``; rows no split saw give zeros and
  ``-inf``."""
  seen = l > 0
  lse_parts = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
  out_parts = acc / jnp.where(seen, l, 1.0)[..., None]
  return merge_normalized(out_parts, lse_parts)


def merge_normalized(out_parts: Array, lse_parts: Array
                     ) -> tuple[Array, Array]:
  """Exact merge of split results given as normalized outputs ``[splits,
  ..., H]`` and natural-log logsumexps ``[splits, ...]`` (``-inf`` where a
  split saw no key), folded in split order (a fixed order: deterministic).

  Returns ``(out [..., H], lse [...])``; rows no split saw give zeros and
  ``-inf``."""
  def fold(carry, part):
    out, lse = carry
    out_p, lse_p = part
    new = jnp.logaddexp(lse, lse_p)
    safe = jnp.where(jnp.isneginf(new), 0.0, new)
    out = (out * jnp.exp(lse - safe)[..., None]
           + out_p * jnp.exp(lse_p - safe)[..., None])
    return (out, new), None

  init = (jnp.zeros_like(out_parts[0]), jnp.full_like(lse_parts[0], -jnp.inf))
  # Unrolled: the folds fuse into one pass over the splits instead of a
  # loop of small kernels.
  (out, lse), _ = lax.scan(fold, init, (out_parts, lse_parts), unroll=True)
  return out, lse
