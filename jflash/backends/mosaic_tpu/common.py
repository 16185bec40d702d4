"""What the three ``mosaic_tpu`` kernels share: the static plan of a call,
the kernel layout of the operands, the tile-visit metadata passed by scalar
prefetch, the named-operand ``pallas_call``, and the per-tile logits and
element mask.

Kernel layout: ``[B, N, T, Hp]`` for query-side arrays and
``[B, K, S, Hp]`` for keys and values, head dims padded to 128 lanes with
zeros.  Sequences are not padded: a tile that hangs over a sequence end is
always PARTIAL (never FULL), and PARTIAL tiles mask what lies past the end.
Per-row statistics (logsumexp, delta) live as lane-dense rows
``[B, N, 1, T]``.  Segment ids come in both orientations, ``[B, L, 1]``
columns and ``[B, 1, L]`` rows, so that every kernel broadcasts them along
the axis it needs without a transpose.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jflash import masks, tiles
from jflash.core import alibi, trace_time
from jflash.core.call import varying_result

Array = jax.Array

NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static facts of one call (hashable: a ``nondiff_argnums`` entry).

  Attributes:
    scale, soft_cap: the logit transform.
    rules: the call's :meth:`~jflash.masks.AttentionMask.static_rules`
      (no arrays; ``has_offsets`` kept, so a window clamps as the call's
      mask clamps it).
    block_q, block_kv: the tiling shared by all three kernels.
    num_q, num_kv: blocks along ``T`` and ``S``.
    kv_steps: grid extent over the visited key blocks of a query block
      (forward, dQ), from :func:`jflash.tiles.max_visited_blocks`.
    q_steps: grid extent over the visited query blocks of a key block
      (dK/dV).
    head_dim: ``H`` padded to 128 lanes.
    per_batch: the schedule has one entry per batch row (lengths or segment
      ids are present and the per-row schedule fits SMEM); otherwise one
      entry serves every row.
    has_segments: the kernels receive segment ids (lengths and offsets
      reach them by scalar prefetch, see :func:`scalar_operands`).
    interpret: ``pallas_call``'s ``interpret`` argument.
    vmem_limit_bytes: scoped VMEM per kernel.
  """

  scale: float
  soft_cap: float | None
  rules: masks.AttentionMask
  block_q: int
  block_kv: int
  num_q: int
  num_kv: int
  kv_steps: int
  q_steps: int
  head_dim: int
  per_batch: bool
  has_segments: bool
  interpret: Any
  vmem_limit_bytes: int

  @property
  def q_tail(self) -> bool:
    """The last query block hangs over the end of the queries."""
    return self.rules.q_len % self.block_q != 0

  @property
  def kv_tail(self) -> bool:
    """The last key block hangs over the end of the keys."""
    return self.rules.kv_len % self.block_kv != 0

  def compiler_params(self, semantics: tuple[str, ...]):
    """Mosaic parameters of a kernel with grid axes ``semantics``."""
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=self.vmem_limit_bytes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Metadata:
  """Tile visits of one call, computed once (outside the kernels) and passed
  to every kernel by scalar prefetch.

  Each entry of a visit list packs a block index and its tile class:
  ``block * 4 + class`` (class :data:`jflash.tiles.PARTIAL` or
  :data:`~jflash.tiles.FULL` for the first ``count`` entries).

  Attributes:
    kv_visits: int32 ``[Bs, nq, kv_steps]``: per query block, its nonempty
      key blocks in increasing order, then empty ones.
    kv_count: int32 ``[Bs, nq]``.
    q_visits: int32 ``[Bs, nk, q_steps]``: per key block, its nonempty
      query blocks.
    q_count: int32 ``[Bs, nk]``.
  """

  kv_visits: Array
  kv_count: Array
  q_visits: Array
  q_count: Array


def metadata(mask: masks.AttentionMask, plan: Plan) -> Metadata:
  """Tile visits from :func:`jflash.tiles.tile_schedule`, cut to the static
  step counts of ``plan`` (never fewer than the nonempty tiles); constants
  built while tracing when they depend on shapes only."""
  return trace_time.constant_if_static(_metadata, mask, plan)


def _metadata(mask: masks.AttentionMask, plan: Plan) -> Metadata:
  sched = tiles.tile_schedule(mask, plan.block_q, plan.block_kv,
                              merge_batch=not plan.per_batch)
  classes = sched.classes.astype(jnp.int32)
  kv_order = sched.kv_order[:, :, :plan.kv_steps]
  kv_class = jnp.take_along_axis(classes, kv_order, axis=2)
  q_order = sched.q_order[:, :, :plan.q_steps]
  q_class = jnp.take_along_axis(jnp.swapaxes(classes, 1, 2), q_order, axis=2)
  return Metadata(kv_visits=kv_order * 4 + kv_class, kv_count=sched.kv_count,
                  q_visits=q_order * 4 + q_class, q_count=sched.q_count)


def visit_at(visits, count, sb, row, j):
  """``(block, class)`` at step ``j`` of a visit list.

  Past the count the last visited block is repeated: an unchanged block
  index makes Pallas skip the copy, so tiles that are not visited are never
  transferred (and the kernel skips their compute on the count).  Works on
  scalar-prefetch refs inside index maps and kernels, and on NumPy arrays.
  """
  last = jnp.maximum(count[sb, row] - 1, 0)
  entry = visits[sb, row, jnp.minimum(j, last)]
  # lax's bit operations take no weakly typed Python ints: int32 operands,
  # also under jax_enable_x64.
  return (lax.shift_right_logical(entry, jnp.int32(2)),
          lax.bitwise_and(entry, jnp.int32(3)))


# ------------------------------------------------------------------ layout
def to_kernel_layout(x: Array, head_dim: int) -> Array:
  """``[B, L, N, H]`` -> ``[B, N, L, head_dim]``, the head dim zero padded.

  Sequences are not padded: the last block of a sequence may hang over its
  end, where Pallas reads unspecified values and drops writes; the kernels
  mask those rows (see :func:`zero_rows_past`)."""
  if x.shape[3] != head_dim:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, head_dim - x.shape[3])))
  return jnp.transpose(x, (0, 2, 1, 3))


def from_kernel_layout(x: Array, head_dim: int) -> Array:
  """``[B, N, L, Hp]`` -> ``[B, L, N, head_dim]``."""
  return jnp.transpose(x[..., :head_dim], (0, 2, 1, 3))


def rows_to_kernel(x: Array) -> Array:
  """Per-row statistics ``[B, T, N]`` -> ``[B, N, 1, T]`` float32."""
  return jnp.transpose(x.astype(jnp.float32), (0, 2, 1))[:, :, None, :]


def rows_from_kernel(x: Array) -> Array:
  """``[B, N, 1, T]`` -> ``[B, T, N]``."""
  return jnp.transpose(x[:, :, 0, :], (0, 2, 1))


def segment_layouts(ids: Array) -> tuple[Array, Array]:
  """Segment ids ``[B, L]`` -> (column ``[B, L, 1]``, row ``[B, 1, L]``)."""
  ids = ids.astype(jnp.int32)
  return ids[:, :, None], ids[:, None, :]


def scalar_operands(visits: Array, count: Array,
                    mask: masks.AttentionMask,
                    slopes: Array | None) -> dict[str, Array]:
  """What a kernel reads from SMEM by scalar prefetch: its visit list and
  counts, then the per-row lengths the call has (``q_lengths``,
  ``kv_lengths``), then, for a mask with offsets (one block of longer
  sequences), ``offsets``: int32 ``[2]``, the global positions of local
  query 0 and key 0 (0 for an offset the mask leaves out), then the ALiBi
  ``slopes`` (float32 ``[B|1, N]``) where the call has them.  A call
  without offsets or slopes passes none, so its kernels are unchanged."""
  scalars = {"visits": visits, "count": count}
  for name in ("q_lengths", "kv_lengths"):
    lengths = getattr(mask, name)
    if lengths is not None:
      scalars[name] = lengths.astype(jnp.int32)
  if mask.has_offsets:
    scalars["offsets"] = jnp.stack([
        jnp.asarray(0 if x is None else x, jnp.int32).reshape(())
        for x in (mask.q_offset, mask.kv_offset)])
  if slopes is not None:
    scalars["slopes"] = slopes.astype(jnp.float32)
  return scalars


def block_spec(block_shape: tuple, index_map) -> pl.BlockSpec:
  """``pl.BlockSpec(block_shape, index_map)`` with the block indices cast
  to int32: a literal ``0`` in an index map is int64 under
  ``jax_enable_x64``, and the kernels' index math is int32 throughout."""
  def int32_map(*args):
    return tuple(jnp.asarray(x, jnp.int32) for x in index_map(*args))
  return pl.BlockSpec(block_shape, int32_map)


@dataclasses.dataclass(frozen=True)
class KernelOperands:
  """One kernel's operands by name, in the order ``pallas_call`` hands
  their refs to the kernel: scalar prefetch, blocked inputs, outputs,
  scratch.  The kernel body receives them as one ``{name: ref}`` dict.

  Attributes:
    scalars: SMEM arrays (:func:`scalar_operands`).
    inputs: ``{name: (array, block spec)}``.
    outputs: ``{name: (jax.ShapeDtypeStruct, block spec)}``.
    scratch: ``{name: pltpu.VMEM(...)}``.
  """

  scalars: dict[str, Array]
  inputs: dict[str, tuple[Array, pl.BlockSpec]]
  outputs: dict[str, tuple[jax.ShapeDtypeStruct, pl.BlockSpec]]
  scratch: dict[str, Any]


def call_kernel(body, operands: KernelOperands, *, plan: Plan,
                grid: tuple[int, ...], semantics: tuple[str, ...],
                name: str) -> list[Array]:
  """``pallas_call`` of ``body(refs)`` (``refs`` the ``{name: ref}`` dict of
  ``operands``) over ``grid``; returns the outputs in the order of
  ``operands.outputs``."""
  names = [*operands.scalars, *operands.inputs, *operands.outputs,
           *operands.scratch]

  def kernel(*refs):
    body(dict(zip(names, refs, strict=True)))

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(operands.scalars), grid=grid,
      in_specs=[spec for _, spec in operands.inputs.values()],
      out_specs=[spec for _, spec in operands.outputs.values()],
      scratch_shapes=list(operands.scratch.values()))
  arrays = (*operands.scalars.values(),
            *(array for array, _ in operands.inputs.values()))
  return pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[varying_result(shape.shape, shape.dtype, arrays)
                 for shape, _ in operands.outputs.values()],
      compiler_params=plan.compiler_params(semantics),
      interpret=plan.interpret, name=name,
  )(*arrays)


# ------------------------------------------------------------ kernel side
def precision_for(dtype) -> lax.Precision | None:
  """float32 inputs multiply in full float32 on the MXU; bfloat16 inputs
  use the native bfloat16 path with float32 accumulation."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def lengths_of(refs: dict[str, Any], b) -> tuple[Array | None, Array | None]:
  """This batch row's ``(q_length, kv_length)`` scalars from SMEM (None for
  a length the call does not have)."""
  q_length = refs["q_lengths"][b] if "q_lengths" in refs else None
  kv_length = refs["kv_lengths"][b] if "kv_lengths" in refs else None
  return q_length, kv_length


def offsets_of(refs: dict[str, Any]) -> tuple[Array | None, Array | None]:
  """The call's ``(q_offset, kv_offset)`` int32 scalars from SMEM, or
  ``(None, None)`` for a mask without offsets."""
  if "offsets" not in refs:
    return None, None
  return refs["offsets"][0], refs["offsets"][1]


def logits(a: Array, b: Array, plan: Plan) -> tuple[Array, Array | None]:
  """``scale * a @ b.T`` in float32, soft-capped; also ``tanh(raw / cap)``
  for the cap's derivative (None without a cap)."""
  s = lax.dot_general(a, b, NT_DIMS, precision=precision_for(a.dtype),
                      preferred_element_type=jnp.float32)
  s = s * jnp.float32(plan.scale)
  tanh = None
  if plan.soft_cap is not None:
    cap = jnp.float32(plan.soft_cap)
    tanh = jnp.tanh(s / cap)
    s = cap * tanh
  return s, tanh


def add_alibi(s: Array, refs: dict[str, Any], *, b, n, q_start, kv_start,
              transposed: bool) -> Array:
  """``s`` plus query head ``n``'s ALiBi penalty (:mod:`jflash.core.alibi`)
  at the tile's global positions, where the call has slopes (SMEM
  ``slopes [B|1, N]``); ``s`` unchanged otherwise.  Arguments as for
  :func:`apply_mask`."""
  if "slopes" not in refs:
    return s
  q_offset, kv_offset = offsets_of(refs)
  q_axis, kv_axis = (1, 0) if transposed else (0, 1)
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, s.shape, q_axis)
  kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, s.shape, kv_axis)
  row = b if refs["slopes"].shape[0] > 1 else 0
  return s + alibi.penalty(refs["slopes"][row, n],
                           masks.shifted(q_idx, q_offset, kv_offset) - kv_idx)


def apply_mask(s: Array, plan: Plan, refs: dict[str, Any], *, b, q_start,
               kv_start, transposed: bool) -> tuple[Array, Array]:
  """``s`` with hidden pairs set to ``-inf``, and the visibility; the rule
  is :func:`jflash.masks.visibility_at`.  Positions past the sequence ends
  are hidden, whatever the (unspecified) data there.

  Args:
    s: ``[bq, bk]`` logits, or ``[bk, bq]`` when ``transposed``.
    refs: the kernel's refs by name: the lengths (SMEM, read at batch row
      ``b``), the offsets (SMEM) and the tile's segment ids (``q_ids``,
      ``kv_ids``, shaped to broadcast along ``s``) where the call has them.
    q_start, kv_start: first local query / key position of the tile.
  """
  lengths = lengths_of(refs, b)
  q_offset, kv_offset = offsets_of(refs)
  q_ids = refs["q_ids"][...] if plan.has_segments else None
  kv_ids = refs["kv_ids"][...] if plan.has_segments else None
  q_axis, kv_axis = (1, 0) if transposed else (0, 1)
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, s.shape, q_axis)
  kv_idx = kv_start + lax.broadcasted_iota(jnp.int32, s.shape, kv_axis)
  if q_ids is not None:
    q_ids = jnp.broadcast_to(q_ids, s.shape)
    kv_ids = jnp.broadcast_to(kv_ids, s.shape)
  visible = masks.visibility_at(plan.rules, q_idx, kv_idx,
                                q_length=lengths[0], kv_length=lengths[1],
                                q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                q_offset=q_offset, kv_offset=kv_offset)
  return jnp.where(visible, s, jnp.float32(-jnp.inf)), visible


def score_gradient(p: Array, dp: Array, delta: Array, tanh: Array | None,
                   visible: Array | None) -> Array:
  """``dS = P * (dP - delta)``, through the soft cap's derivative where
  there is one; exactly 0 at hidden pairs, whatever lies past the sequence
  ends (rows of dO, the statistics and V there are unspecified)."""
  ds = p * (dp - delta)
  if tanh is not None:
    ds = ds * (1.0 - tanh * tanh)
  if visible is not None:
    ds = jnp.where(visible, ds, jnp.float32(0))
  return ds


def zero_rows_past(x: Array, start, length: int) -> Array:
  """``x [rows, H]`` (rows ``start ..``) with the rows at or past
  ``length`` set to 0: a block that hangs over a sequence end holds
  unspecified values there, and a zero probability times a NaN is NaN."""
  rows = start + lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where(rows < length, x, jnp.zeros((), x.dtype))


def when_visited(count, j, cls, step) -> None:
  """Runs ``step(masked)`` for a visited tile: unmasked for a FULL tile,
  with the element mask for a PARTIAL one; nothing past the count."""
  visited = j < count

  @pl.when(visited & (cls == tiles.FULL))
  def _full():
    step(False)

  @pl.when(visited & (cls != tiles.FULL))
  def _partial():
    step(True)
