"""What a decode backend receives and the contract it follows.

A decode backend is a callable with a ``name`` that takes one
:class:`DecodeCall` (validated and canonical, from :mod:`jflash.decode`) and
returns ``(out [B, T, N, H] in the query dtype, logsumexp [B, T, N]
float32)``, or raises ``NotImplementedError`` when it cannot serve the call
(the next backend requested is then tried).  It computes exactly the
attention :func:`jflash.masks.decode_row_bounds` defines and never drops an
argument.  Decoding is inference: backends need no derivative.
"""

from __future__ import annotations

import dataclasses

import jax

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """One canonical decode call.

  Attributes:
    query: ``[B, T, N, H]``, the ``T`` new tokens' queries.
    key, value: the cache: ``[B, S, K, H]`` (contiguous), or pages
      ``[P, page_size, K, H]`` when ``block_table`` is given; same dtype as
      ``query``; ``N % K == 0``.
    lengths: int32 ``[B]`` in ``[0, capacity]``: valid cache slots of each
      sequence, the ``T`` new tokens included.
    block_table: int32 ``[B, max_pages]`` or None: slot ``s`` of sequence
      ``b`` is row ``s % page_size`` of page ``block_table[b, s //
      page_size]``.
    scale: multiplies ``query . key``.
    logits_soft_cap: ``cap * tanh(logits / cap)`` after scaling, or None.
    window: ``(left, right)`` or None: query at position ``p`` sees slots
      ``p - left .. p`` (the right side cannot reach past ``p``).
    interpret: run Pallas kernels through the Pallas interpreter (on the
      CPU); a backend without kernels (``xla``) is unaffected.
  """

  query: Array
  key: Array
  value: Array
  lengths: Array
  block_table: Array | None
  scale: float = dataclasses.field(metadata=dict(static=True))
  logits_soft_cap: float | None = dataclasses.field(
      metadata=dict(static=True))
  window: tuple[int, int] | None = dataclasses.field(
      metadata=dict(static=True))
  interpret: bool = dataclasses.field(default=False,
                                      metadata=dict(static=True))

  @property
  def paged(self) -> bool:
    return self.block_table is not None

  @property
  def page_size(self) -> int | None:
    return self.key.shape[1] if self.paged else None

  @property
  def capacity(self) -> int:
    """``S``: cache slots per sequence (``max_pages * page_size`` when
    paged)."""
    if self.paged:
      return self.block_table.shape[1] * self.key.shape[1]
    return self.key.shape[1]

  @property
  def num_new(self) -> int:
    return self.query.shape[1]

  @property
  def dtype(self):
    return self.query.dtype

  @property
  def shape_description(self) -> str:
    b, t, n, h = self.query.shape
    k = self.key.shape[2]
    layout = (f"paged P={self.key.shape[0]} page_size={self.page_size} "
              f"max_pages={self.block_table.shape[1]}" if self.paged
              else f"S={self.capacity}")
    return f"B={b} T={t} N={n} K={k} H={h} {layout} dtype={self.dtype}"
