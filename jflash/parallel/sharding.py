"""Kernel backends on inputs sharded over batch and heads.

A Pallas kernel sees one device's arrays.  When the inputs carry explicit
shardings (``jax.sharding.AxisType.Explicit`` meshes), the batch and head
axes are independent, so :func:`per_shard` runs the backend inside
``jax.shard_map`` on each device's block, with no communication.  Inputs
whose sequence axis is sharded go to :func:`run_sequence_sharded`, which
runs context parallelism (:mod:`jflash.parallel.context`) inside a
``shard_map`` over the batch, sequence and head axes.  Under ``Auto``
sharding the shardings are not known while tracing; the partitioner splits
the kernels there (:mod:`jflash.parallel.partitioning`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jflash.core.call import AttentionCall

Array = jax.Array


def _explicit_spec(x: Array) -> tuple | None:
  """The per-dimension mesh axes of ``x`` if it is explicitly sharded."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(s is None for s in spec):
    return None
  return tuple(spec) + (None,) * (x.ndim - len(spec))


def mesh_axes(entry) -> tuple[str, ...]:
  """The mesh axis names of one entry of a ``PartitionSpec``."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def is_explicitly_sharded(call: AttentionCall) -> bool:
  """Whether any of query, key and value carries an explicit sharding
  (an ``AxisType.Explicit`` mesh axis in its type)."""
  return any(_explicit_spec(x) is not None
             for x in (call.query, call.key, call.value))


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
  batch_axes, head_axes = mesh_axes(q_spec[0]), mesh_axes(q_spec[2])
  batch_parts = shard_count(mesh, batch_axes)
  head_parts = shard_count(mesh, head_axes)
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
      ("kv_segment_ids", mask.kv_segment_ids),
      ("q_offset", mask.q_offset), ("kv_offset", mask.kv_offset))
      if x is not None}
  present_specs = {name: _mask_array_spec(name, b, None) for name in present}
  local_batch = batch // batch_parts
  slopes = call.alibi_slopes
  slopes_spec = None if slopes is None else P(
      b if slopes.shape[0] > 1 else None, h)

  def body(q, k, v, mask_arrays, slopes):
    local_mask = dataclasses.replace(mask, batch=local_batch, **mask_arrays)
    return run(dataclasses.replace(call, query=q, key=k, value=v,
                                   mask=local_mask, alibi_slopes=slopes))

  mapped = jax.shard_map(
      body, mesh=mesh,
      in_specs=(P(*q_spec), P(*k_spec), P(*v_spec), present_specs,
                slopes_spec),
      out_specs=(P(b, None, h, None), P(b, None, h)),
      axis_names=set(batch_axes + head_axes), check_vma=False)
  present = {name: reshard(x, mesh, present_specs[name])
             for name, x in present.items()}
  if slopes is not None:
    slopes = reshard(slopes, mesh, slopes_spec)
  return mapped(call.query, call.key, call.value, present, slopes)


def reshard(x: Array, mesh, spec: P) -> Array:
  """``x`` resharded to ``spec`` over ``mesh`` (the inputs' own mesh, so
  that no ``jax.set_mesh`` is needed around the call)."""
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def _mask_array_spec(name: str, batch, sequence) -> P:
  """The sharding of one of a mask's arrays: lengths per batch row, segment
  ids per token, offsets (scalars) replicated."""
  if name.endswith("offset"):
    return P()
  if name.endswith("lengths"):
    return P(batch)
  return P(batch, sequence)


def shard_count(mesh, entry) -> int:
  """How many shards a ``PartitionSpec`` entry cuts an axis into."""
  shards = 1
  for axis in mesh_axes(entry):
    shards *= mesh.shape[axis]
  return shards


def sequence_axes(call: AttentionCall) -> tuple[str, ...] | None:
  """The mesh axes the query's sequence axis is explicitly sharded over,
  or None when it is not (nothing explicit, or batch/head sharding only)."""
  spec = _explicit_spec(call.query)
  if spec is None or spec[1] is None:
    return None
  return mesh_axes(spec[1])


def run_sequence_sharded(
    call: AttentionCall, run_local: Callable[[AttentionCall, tuple[str, ...],
                                              int], tuple[Array, Array]]
) -> tuple[Array, Array]:
  """``run_local(local call, sequence axes, shards)`` inside a
  ``jax.shard_map`` over the axes the query is explicitly sharded on: batch,
  sequence and heads.  Keys and values are resharded to the query's batch,
  sequence and head axes (the head dim is never sharded); the local call's
  mask describes the device's blocks of the global sequences (its lengths
  are global, its segment ids local)."""
  q_spec = _explicit_spec(call.query)
  b, seq, h = q_spec[0], q_spec[1], q_spec[2]
  mesh = jax.typeof(call.query).sharding.mesh
  seq_axes = mesh_axes(seq)
  shards = shard_count(mesh, seq_axes)
  batch, q_len, heads, _ = call.query.shape
  kv_len, kv_heads = call.key.shape[1], call.key.shape[2]
  batch_parts, head_parts = shard_count(mesh, b), shard_count(mesh, h)
  for name, size, parts in (("query sequence T", q_len, shards),
                            ("key sequence S", kv_len, shards),
                            ("batch B", batch, batch_parts),
                            ("query heads N", heads, head_parts),
                            ("key/value heads K", kv_heads, head_parts)):
    if size % parts:
      raise ValueError(
          f"dot_product_attention: the {name} = {size} does not divide "
          f"into the {parts} shards of mesh axes {q_spec}; pad it, or shard "
          "it over fewer devices")
  mask = call.mask
  x_spec = P(b, seq, h, None)
  present = {name: x for name, x in (
      ("q_lengths", mask.q_lengths), ("kv_lengths", mask.kv_lengths),
      ("q_segment_ids", mask.q_segment_ids),
      ("kv_segment_ids", mask.kv_segment_ids)) if x is not None}
  present_specs = {name: _mask_array_spec(name, b, seq) for name in present}
  slopes = call.alibi_slopes
  slopes_spec = None if slopes is None else P(
      b if slopes.shape[0] > 1 else None, h)

  def body(q, k, v, mask_arrays, slopes):
    local_mask = dataclasses.replace(
        mask, batch=q.shape[0], q_len=q.shape[1], kv_len=k.shape[1],
        has_offsets=True, **mask_arrays)
    local = dataclasses.replace(call, query=q, key=k, value=v,
                                mask=local_mask, alibi_slopes=slopes)
    return run_local(local, seq_axes if len(seq_axes) > 1 else seq_axes[0],
                     shards)

  axes = set(mesh_axes(b) + seq_axes + mesh_axes(h))
  mapped = jax.shard_map(
      body, mesh=mesh,
      in_specs=(x_spec, x_spec, x_spec, present_specs, slopes_spec),
      out_specs=(x_spec, P(b, seq, h)), axis_names=axes, check_vma=False)
  q, k, v = (reshard(x, mesh, x_spec)
             for x in (call.query, call.key, call.value))
  present = {name: reshard(x, mesh, present_specs[name])
             for name, x in present.items()}
  if slopes is not None:
    slopes = reshard(slopes, mesh, slopes_spec)
  return mapped(q, k, v, present, slopes)
