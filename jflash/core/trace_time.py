"""Tile metadata built while tracing when it depends on shapes alone.

A schedule (:func:`jflash.tiles.tile_schedule` and what kernels derive from
it) depends on per-call data only through lengths, segment ids and a dense
mask.  Without them it is a function of static shapes: computing it at trace
time turns a few hundred small XLA operations per call into constants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jflash import masks

MAX_CONSTANT_ELEMENTS = 1 << 18
"""Largest array embedded as a constant (1 MiB of int32); larger schedules
are computed per call."""

_NO_MESH = jax.sharding.AbstractMesh((), ())


def depends_on_shapes_only(mask: masks.AttentionMask) -> bool:
  """True when no per-call array takes part in visibility."""
  return (mask.q_lengths is None and mask.kv_lengths is None
          and mask.q_segment_ids is None and mask.dense is None
          and not mask.has_offsets)


def constant_if_static(build: Callable[..., Any], mask: masks.AttentionMask,
                       *static: Any):
  """``build(mask, *static)`` (a pytree of arrays), evaluated on the host
  while tracing and embedded as constants when ``mask`` depends on shapes
  only and every array is small; otherwise traced as usual.

  ``build`` should be a module-level function and ``static`` hashable: the
  schedule is compiled as one program (evaluated op by op, each of its few
  hundred operations would be compiled on its own, seconds on the first
  trace of each shape), and JAX's caches then serve every later trace of
  the same shapes.
  """
  if not depends_on_shapes_only(mask):
    return build(mask, *static)
  try:
    device = jax.devices("cpu")[0]
  except RuntimeError:  # no CPU backend in this process
    device = None
  try:
    # Under shard_map the ambient mesh is manual, and eager arrays cannot
    # take a manual sharding: evaluate outside any mesh.
    # The outputs placed on the CPU pin the program there, not on the
    # accelerator the caller traces for.
    placed = (None if device is None
              else jax.sharding.SingleDeviceSharding(device))
    with jax.default_device(device), \
        jax.sharding.use_abstract_mesh(_NO_MESH):
      compiled = jax.jit(
          build, static_argnums=tuple(range(1, 1 + len(static))),
          out_shardings=placed).lower(mask, *static).compile()
      values = jax.tree.map(np.asarray, compiled(mask))
  except ValueError:
    # Evaluation is refused under an abstract-only mesh (exporting for
    # another platform); the schedule is then traced as usual.
    return build(mask, *static)
  if max((v.size for v in jax.tree.leaves(values)), default=0) > \
      MAX_CONSTANT_ELEMENTS:
    return build(mask, *static)
  return jax.tree.map(jnp.asarray, values)
