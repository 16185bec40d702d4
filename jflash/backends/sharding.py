"""Kernel backends on inputs sharded over batch and heads.

A Pallas kernel sees one device's arrays.  When the inputs carry explicit
shardings (``jax.sharding.AxisType.Explicit`` meshes), the batch and head
axes are independent, so :func:`per_shard` runs the backend inside
``jax.shard_map`` on each device's block, with no communication.  Inputs
sharded along a sequence or head-dim axis are declined
(``NotImplementedError``): attention would need the other devices' keys.
Under ``Auto`` sharding the shardings are not known while tracing, and the
kernel runs on whole arrays as XLA places them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jflash.backends.base import AttentionCall

Array = jax.Array


def _explicit_spec(x: Array) -> tuple | None:
  """The per-dimension mesh axes of ``x`` if it is explicitly sharded."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(s is None for s in spec):
    return None
  return tuple(spec) + (None,) * (x.ndim - len(spec))


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def per_shard(call: AttentionCall, run: Callable[[AttentionCall],
                                                 tuple[Array, Array]],
              name: str) -> tuple[Array, Array]:
  """``run(call)`` on each device's batch/head block of explicitly sharded
  inputs, or on the whole call when nothing is explicitly sharded."""
  specs = [_explicit_spec(x) for x in (call.query, call.key, call.value)]
  if all(s is None for s in specs):
    return run(call)
  specs = [s if s is not None else (None,) * 4 for s in specs]
  q_spec, k_spec, v_spec = specs
  if k_spec != v_spec or q_spec[0] != k_spec[0] or q_spec[2] != k_spec[2]:
    raise NotImplementedError(
        f"{name}: query, key and value must be sharded alike over batch and "
        f"heads, got {q_spec}, {k_spec}, {v_spec}")
  for spec in specs:
    if spec[1] is not None or spec[3] is not None:
      raise NotImplementedError(
          f"{name}: inputs sharded along a sequence or head-dim axis ({spec})"
          " need the other devices' keys; shard batch or heads only")
  mesh = jax.typeof(call.query).sharding.mesh
  batch_axes, head_axes = _axes(q_spec[0]), _axes(q_spec[2])
  batch_parts = _size(mesh, batch_axes)
  head_parts = _size(mesh, head_axes)
  batch, _, heads, _ = call.query.shape
  kv_heads = call.key.shape[2]
  if batch % batch_parts or heads % head_parts or kv_heads % head_parts:
    raise NotImplementedError(
        f"{name}: B={batch}, N={heads}, K={kv_heads} do not divide into "
        f"{batch_parts} x {head_parts} shards")
  b, h = q_spec[0], q_spec[2]
  mask = call.mask
  present = {name: x for name, x in (
      ("q_lengths", mask.q_lengths), ("kv_lengths", mask.kv_lengths),
      ("q_segment_ids", mask.q_segment_ids),
      ("kv_segment_ids", mask.kv_segment_ids)) if x is not None}
  present_specs = {name: P(b) if name.endswith("lengths") else P(b, None)
                   for name in present}
  local_batch = batch // batch_parts

  def body(q, k, v, mask_arrays):
    local_mask = dataclasses.replace(mask, batch=local_batch, **mask_arrays)
    return run(dataclasses.replace(call, query=q, key=k, value=v,
                                   mask=local_mask))

  mapped = jax.shard_map(
      body, mesh=mesh,
      in_specs=(P(*q_spec), P(*k_spec), P(*v_spec), present_specs),
      out_specs=(P(b, None, h, None), P(b, None, h)),
      axis_names=set(batch_axes + head_axes), check_vma=False)
  present = {name: jax.sharding.reshard(x, present_specs[name])
             for name, x in present.items()}
  return mapped(call.query, call.key, call.value, present)


def _size(mesh, axes: tuple[str, ...]) -> int:
  size = 1
  for axis in axes:
    size *= mesh.shape[axis]
  return size
