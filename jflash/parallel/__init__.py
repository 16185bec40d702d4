"""Context parallelism options and the load-balanced sequence layout.

Attention over a sequence sharded along a mesh axis needs every shard's
keys.  :func:`jflash.dot_product_attention` computes it exactly, with no
``shard_map`` written by the user:

* inputs whose sequence axis is sharded (explicit shardings, or under
  ``jax.jit`` with ``NamedSharding`` in ``Auto`` mode) run context
  parallelism over the axis they are sharded on;
* inside a user's own ``jax.shard_map``, ``context_parallel=
  ContextParallel(axis_name="context")`` says that the local arrays are
  shards of sequences split over that mesh axis.

With causal masking, the first shards of a contiguously sharded sequence
have little to compute and the last ones much; :func:`load_balance` puts a
sequence in the zigzag order (shard ``i`` of ``n`` holds chunks ``i`` and
``2n - 1 - i`` of ``2n``) that evens the work out.  A data pipeline applies
it once to tokens, positions, segment ids and targets, and passes
``ContextParallel(layout="zigzag")``; :func:`restore_order` undoes it.
See ``docs/scaling.md``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jflash.parallel import context

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """How a sequence-sharded call is computed.

  Attributes:
    strategy: ``"ring"`` (K/V blocks passed around the axis, overlapped
      with compute; memory per device flat in the number of shards),
      ``"all_gather"`` (K/V gathered once; cheap under GQA), or ``"auto"``:
      ``all_gather`` when there are at least 4 query heads per K/V head,
      else ``ring``.
    layout: where each shard's positions lie: ``"contiguous"`` (shard ``i``
      holds positions ``[i L, (i + 1) L)``) or ``"zigzag"`` (as
      :func:`load_balance` arranges them).
    axis_name: inside a ``jax.shard_map``, the mesh axis name (or a tuple
      of names, major first) the query and key/value sequences are sharded
      over; the arrays passed are then each device's shard.  None outside
      ``shard_map``, where the inputs' shardings say it.
  """

  strategy: str = "auto"
  layout: str = "contiguous"
  axis_name: str | tuple[str, ...] | None = None

  def __post_init__(self):
    if self.strategy not in ("auto",) + context.STRATEGIES:
      raise ValueError(f"ContextParallel.strategy must be one of "
                       f"{('auto',) + context.STRATEGIES}, got "
                       f"{self.strategy!r}")
    if self.layout not in context.LAYOUTS:
      raise ValueError(f"ContextParallel.layout must be one of "
                       f"{context.LAYOUTS}, got {self.layout!r}")
    name = self.axis_name
    if isinstance(name, list):
      name = tuple(name)
      object.__setattr__(self, "axis_name", name)
    names = name if isinstance(name, tuple) else (name,)
    if name is not None and (not names or not all(
        isinstance(n, str) for n in names)):
      raise ValueError("ContextParallel.axis_name must be None, a mesh axis "
                       f"name or a tuple of names, got {self.axis_name!r}")

  def axis_size(self) -> int:
    """How many shards the local arrays are of, inside a ``shard_map``
    over :attr:`axis_name`."""
    try:
      return lax.axis_size(self.axis_name)
    except NameError as err:
      raise ValueError(
          f"context_parallel.axis_name={self.axis_name!r} names no mesh axis "
          "bound here; pass it inside a jax.shard_map over that axis "
          "(outside one, shard the inputs' sequence axis and leave "
          "axis_name None)") from err

  def plan(self, axis: str | tuple[str, ...], size: int, num_heads: int,
           num_kv_heads: int) -> context.Plan:
    """The static plan over mesh axis ``axis`` of ``size`` shards."""
    strategy = self.strategy
    if strategy == "auto":
      strategy = context.default_strategy(num_heads, num_kv_heads)
    return context.Plan(axis=axis, size=size, strategy=strategy,
                        layout=self.layout)


def _chunks(x: Array, num_shards: int, axis: int) -> list[Array]:
  length = x.shape[axis]
  if num_shards < 1 or length % (2 * num_shards):
    raise ValueError(f"the zigzag layout cuts the sequence into 2 * "
                     f"num_shards = {2 * num_shards} equal chunks; axis "
                     f"{axis} has length {length}")
  size = length // (2 * num_shards)
  return [lax.slice_in_dim(x, c * size, (c + 1) * size, axis=axis)
          for c in range(2 * num_shards)]


def _check_shards(num_shards) -> int:
  if (isinstance(num_shards, bool)
      or not isinstance(num_shards, (int, np.integer)) or num_shards < 1):
    raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
  return int(num_shards)


def load_balance(x: jax.typing.ArrayLike, num_shards: int,
                 axis: int = 1) -> Array:
  """``x`` with its sequence ``axis`` in zigzag order for ``num_shards``
  shards: cut into ``2 n`` equal chunks, shard ``i`` (the ``i``-th
  contiguous block of the result) gets chunks ``i`` and ``2 n - 1 - i``.

  Apply it to every per-token array of a batch (tokens ``[B, T]``,
  positions, segment ids, targets), then shard the sequence axis
  contiguously and pass ``ContextParallel(layout="zigzag")``.  Under
  causal masking each shard then has the same work to within a chunk.

  Raises:
    ValueError: the axis length is not a multiple of ``2 * num_shards``.
  """
  num_shards = _check_shards(num_shards)
  x = jnp.asarray(x)
  chunks = _chunks(x, num_shards, axis)
  order = []
  for i in range(num_shards):
    order += [chunks[i], chunks[2 * num_shards - 1 - i]]
  return jnp.concatenate(order, axis=axis)


def restore_order(x: jax.typing.ArrayLike, num_shards: int,
                  axis: int = 1) -> Array:
  """The inverse of :func:`load_balance`: positions back in sequence
  order."""
  num_shards = _check_shards(num_shards)
  x = jnp.asarray(x)
  chunks = _chunks(x, num_shards, axis)
  ordered: list[Array | None] = [None] * (2 * num_shards)
  for i in range(num_shards):
    ordered[i] = chunks[2 * i]
    ordered[2 * num_shards - 1 - i] = chunks[2 * i + 1]
  return jnp.concatenate(ordered, axis=axis)
