"""The implementations ``benchmarks/decode.py`` times, as one interface.

Every implementation is a jitted ``fn(query, key, value, lengths, table)``
returning the attention output ``[B, T, N, H]`` of a decode cell: ``query
[B, T, N, H]``, ``lengths [B]`` (cache slots after the append; new token
``t`` at position ``lengths - T + t``, causal within the new block),
``table [B, max_pages]`` or None.  ``key`` and ``value`` are jflash's cache
layout (``[B, S, K, H]`` contiguous, ``[P, page_size, K, H]`` paged) unless
the implementation has a ``convert``, which maps one jflash-layout cache
array to the layout it reads; the runner converts the cache once before
timing it.

Names:

* ``jflash``: ``jflash.decode_attention`` with ``implementation=None``;
  ``jflash:<backend>`` names a decode backend (``jflash:xla``,
  ``jflash:mosaic_gpu``, ...).
* ``jax_nn_xla``, ``jax_nn_cudnn``: ``jax.nn.dot_product_attention``,
  contiguous caches only.  One new token and no window: the lengths as
  ``key_value_seq_lengths``.  Otherwise the visibility as a boolean mask
  ``[B, 1, T, S]`` (cuDNN receives it as an additive bias).
* ``pallas_decode``: ``jax.experimental.pallas.ops.gpu.decode_attention.mqa``
  (the kernel its ``gqa`` runs after moving the heads ahead of the slots)
  on the cache as ``[B * K, S, H]``, ``kv_seq_len`` per sequence.
* ``pallas_paged``: ``jax.experimental.pallas.ops.gpu.paged_attention`` on
  pages ``[K, P, page_size, H]``; it has no scale argument, so the query is
  scaled by ``1 / sqrt(H)`` first.

Both Pallas ops take one length per sequence and no causal rule, so with
``T > 1`` they run once per new token (vmapped over the tokens, each with
its own length): they read the cache ``T`` times.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jflash

PEERS = ("jax_nn_xla", "jax_nn_cudnn", "pallas_decode", "pallas_paged")
DEFAULT_IMPLS = ("jflash", "jflash:mosaic_gpu") + PEERS
"""``--impls`` when none is given."""


class Skip(Exception):
  """The implementation cannot run this cell; the message says why."""


@dataclasses.dataclass(frozen=True)
class DecodeImpl:
  """One timed column of a cell.

  Attributes:
    name: the ``--impls`` entry.
    fn: jitted ``(query, key, value, lengths, table) -> [B, T, N, H]``.
    note: how the implementation expresses the cell.
    convert: None (jflash's cache layout), or a jitted map of one cache
      array from jflash's layout to the one ``fn`` reads.
    declines_off_gpu: a failure on a platform other than a GPU is recorded
      as skipped, not as an error.
  """

  name: str
  fn: Callable
  note: str = ""
  convert: Callable | None = None
  declines_off_gpu: bool = False


def check_names(names: list[str]) -> None:
  """Raises ValueError for an unknown ``--impls`` entry."""
  for name in names:
    if name == "jflash" or name in PEERS:
      continue
    if name.startswith("jflash:") and name.partition(":")[2]:
      continue
    raise ValueError(f"--impls: unknown implementation {name!r}; expected "
                     f"jflash, jflash:<backend> or one of {PEERS}")


def _backend(spec: str | None):
  """A backend name, or ``mosaic_gpu+field=value+...``: the Hopper decode
  kernel with those ``MosaicGpuDecodeConfig`` fields (integers)."""
  if spec is None or "+" not in spec:
    return spec
  name, *fields = spec.split("+")
  if name != "mosaic_gpu":
    raise ValueError(f"--impls: only mosaic_gpu takes config fields, got "
                     f"{spec!r}")
  from jflash.backends.mosaic_gpu.decode import (  # noqa: PLC0415
      MosaicGpuDecodeBackend, MosaicGpuDecodeConfig)
  config = {}
  for field in fields:
    key, _, value = field.partition("=")
    config[key] = int(value)
  return MosaicGpuDecodeBackend(MosaicGpuDecodeConfig(**config))


def _window(cell) -> tuple[int, int] | None:
  return None if cell.window is None else (cell.window, 0)


@functools.lru_cache(maxsize=None)
def jflash_fn(implementation: Any, window: tuple[int, int] | None):
  """jitted ``jflash.decode_attention`` (one function per backend and
  window, so that a column and the reference share their compilation)."""

  @jax.jit
  def fn(q, k, v, lengths, table):
    return jflash.decode_attention(q, k, v, lengths, block_table=table,
                                   local_window_size=window,
                                   implementation=implementation)
  return fn


def reference_fn(cell) -> Callable:
  """jflash's ``xla`` decode backend: what every column is checked
  against."""
  return jflash_fn("xla", _window(cell))


def make_impl(name: str, cell, *, platform: str,
              pallas_interpret: bool = False) -> DecodeImpl:
  """The implementation ``name`` for ``cell``.

  Raises:
    Skip: the implementation cannot express the cell or run here.
  """
  if name == "jflash" or name.startswith("jflash:"):
    backend = name.partition(":")[2] or None
    declines_off_gpu = backend is not None and (
        backend.split("+")[0] in ("mosaic_gpu", "cudnn"))
    return DecodeImpl(name, jflash_fn(_backend(backend), _window(cell)),
                      declines_off_gpu=declines_off_gpu)
  if name.startswith("jax_nn_"):
    return _jax_nn(name, cell, platform)
  if platform != "gpu" and not pallas_interpret:
    raise Skip("a Pallas GPU (Triton) kernel: needs a CUDA GPU "
               "(--pallas-interpret runs it in interpret mode)")
  if name == "pallas_decode":
    return _pallas_decode(cell, pallas_interpret)
  return _pallas_paged(cell, pallas_interpret)


def _visibility_mask(lengths: jax.Array, num_new: int, capacity: int,
                     window: int | None) -> jax.Array:
  """bool ``[B, 1, T, S]``: new token ``t`` at ``lengths - T + t`` sees the
  slots up to itself (and from ``position - window`` with a window)."""
  position = (lengths[:, None] - num_new
              + jnp.arange(num_new, dtype=jnp.int32))[:, :, None]
  slot = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
  visible = slot <= position
  if window is not None:
    visible &= slot >= position - window
  return visible[:, None]


def _jax_nn(name: str, cell, platform: str) -> DecodeImpl:
  implementation = name.removeprefix("jax_nn_")
  if cell.page_size is not None:
    raise Skip("contiguous caches only (jax.nn has no block table)")
  if implementation == "cudnn" and platform != "gpu":
    raise Skip("cuDNN needs a CUDA GPU")
  by_lengths = cell.num_new == 1 and cell.window is None

  @jax.jit
  def fn(q, k, v, lengths, table):
    del table
    if by_lengths:
      return jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=lengths,
          implementation=implementation)
    mask = _visibility_mask(lengths, q.shape[1], k.shape[1], cell.window)
    return jax.nn.dot_product_attention(q, k, v, mask=mask,
                                        implementation=implementation)

  note = ("key_value_seq_lengths" if by_lengths else
          "visibility (causal within the new block) as a bool mask "
          "[B, 1, T, S]" + (", a bias for cuDNN" if implementation == "cudnn"
                            else ""))
  return DecodeImpl(name, fn, note)


def _pallas_module(name: str) -> Any:
  """A module of ``jax.experimental.pallas.ops.gpu`` (some are deprecated
  and warn on import)."""
  import importlib
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


def _per_new_token(one: Callable, q: jax.Array, lengths: jax.Array,
                   window: int | None) -> jax.Array:
  """``one(q_t [B, N, H], end [B], start [B]) -> [B, N, H]`` for each new
  token (``end``: slots it sees below; ``start``: its first slot), stacked
  to ``[B, T, N, H]``."""
  num_new = q.shape[1]
  end = (lengths[None, :] - num_new + 1
         + jnp.arange(num_new, dtype=jnp.int32)[:, None])       # [T, B]
  start = (jnp.zeros_like(end) if window is None
           else jnp.maximum(end - 1 - window, 0))
  if num_new == 1:
    return one(q[:, 0], end[0], start[0])[:, None]
  return jax.vmap(one, in_axes=(1, 0, 0), out_axes=1)(q, end, start)


def _mqa_splits(capacity: int) -> int:
  """``k_splits`` for ``mqa``: the slots must split evenly into runs of at
  least 16 that its ``block_k`` (256) tiles."""
  for splits in (16, 8, 4, 2, 1):
    run = capacity // splits
    if capacity % splits == 0 and run >= 16 and run % min(256, run) == 0:
      return splits
  raise Skip(f"S={capacity} does not split into runs of a multiple of 16 "
             "slots (mqa's k_splits rule)")


def _pallas_decode(cell, interpret: bool) -> DecodeImpl:
  if cell.page_size is not None:
    raise Skip("contiguous caches only (the op has no block table)")
  module = _pallas_module("decode_attention")
  splits = _mqa_splits(cell.context)
  batch, kv_heads = cell.batch, cell.kv_heads
  group = cell.heads // kv_heads
  window = cell.window

  @jax.jit
  def convert(x):  # [B, S, K, H] -> [B * K, S, H]
    return jnp.swapaxes(x, 1, 2).reshape(batch * kv_heads, *x.shape[1:2],
                                         x.shape[3])

  @jax.jit
  def fn(q, k, v, lengths, table):
    del table

    def one(q_t, end, start):
      rows = q_t.reshape(batch * kv_heads, group, q_t.shape[-1])
      out = module.mqa(rows, k, v,
                       start_idx=None if window is None
                       else jnp.repeat(start, kv_heads),
                       kv_seq_len=jnp.repeat(end, kv_heads),
                       k_splits=splits, interpret=interpret)
      return out.reshape(q_t.shape)
    return _per_new_token(one, q, lengths, window)

  note = (f"mqa on [B*K, S, H], k_splits={splits}" +
          ("" if cell.num_new == 1 else
           f"; one call per new token (cache read T={cell.num_new} times)"))
  return DecodeImpl("pallas_decode", fn, note, convert=convert)


def _paged_blocks(pages: int, page_size: int) -> tuple[int, int]:
  """``(k_splits, pages_per_compute_block)`` for ``paged_attention``: about
  128 slots per compute block, as its defaults do with 16-slot pages."""
  per_block = max(1, 128 // page_size)
  for splits in (16, 8, 4, 2, 1):
    if pages % splits == 0:
      per_split = pages // splits
      block = min(per_block, per_split)
      if per_split % block == 0:
        return splits, block
  raise Skip(f"{pages} pages per sequence fit no k_splits")


def _pallas_paged(cell, interpret: bool) -> DecodeImpl:
  if cell.page_size is None:
    raise Skip("paged caches only")
  if cell.window is not None:
    raise Skip("no window (the op reads from slot 0)")
  if cell.context % cell.page_size:
    raise Skip(f"S={cell.context} is not a whole number of pages")
  module = _pallas_module("paged_attention")
  splits, block = _paged_blocks(cell.context // cell.page_size,
                                cell.page_size)
  scale = cell.head_dim ** -0.5

  @jax.jit
  def convert(x):  # [P, page_size, K, H] -> [K, P, page_size, H]
    return jnp.transpose(x, (2, 0, 1, 3))

  @jax.jit
  def fn(q, k, v, lengths, table):
    q = (q * scale).astype(q.dtype)

    def one(q_t, end, start):
      del start
      return module.paged_attention(q_t, k, v, table, end, k_splits=splits,
                                    pages_per_compute_block=block,
                                    interpret=interpret)
    return _per_new_token(one, q, lengths, None)

  note = (f"pages [K, P, page, H], k_splits={splits}, "
          f"pages_per_compute_block={block}, query pre-scaled" +
          ("" if cell.num_new == 1 else
           f"; one call per new token (cache read T={cell.num_new} times)"))
  return DecodeImpl("pallas_paged", fn, note, convert=convert)
