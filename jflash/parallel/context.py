"""Context parallelism: attention over sequences sharded along mesh axes.

The functions here run inside a manual SPMD region (the body of a
``jax.shard_map``, or a partitioned function) in which each device holds
one shard of the query and key/value sequences along the mesh axes
``Plan.axis``; batch and heads may be sharded too (each device then holds
its own block of them).  Two strategies compute the exact result:

* ``all_gather``: gather the keys and values (and key segment ids) along
  the axis and attend from the local queries at their global positions;
  the backward pass reduce-scatters dK and dV.  It sends the whole K/V once
  and holds it on every device: cheap when K/V are small (GQA).
* ``ring``: pass K/V blocks around the axis (``ppermute``), each step
  attending to the block in hand while the next one travels, and merge the
  partial results exactly through their logsumexps in a fixed order
  (reruns are bitwise equal).  The backward pass sends dK/dV accumulators
  around the ring with their blocks.  Memory per device stays that of one
  block; steps whose blocks no device can see (outside a window) are
  neither sent nor computed.

Each device's positions follow a layout: ``contiguous`` (shard ``i`` holds
positions ``[i L, (i + 1) L)``) or ``zigzag`` (the sequence cut into
``2 n`` chunks, shard ``i`` holding chunks ``i`` and ``2 n - 1 - i``, which
evens out causal work; :func:`jflash.load_balance` puts a sequence in that
order).  Every block of work is an :class:`AttentionCall` whose mask
carries the global offsets of its queries and keys
(:class:`jflash.masks.AttentionMask`), served by a backend's block methods
``forward(call)`` and ``backward(call, out, lse, d_out, d_lse)``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jflash import tiles
from jflash.core.call import AttentionCall, Backend

Array = jax.Array

STRATEGIES = ("ring", "all_gather")
LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one call is spread over a mesh axis (static).

  Attributes:
    axis: the mesh axis name (or names, major first) the sequence axes of
      query and key/value are sharded over.
    size: the number of shards along ``axis``.
    strategy: ``"ring"`` or ``"all_gather"``.
    layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).
  """

  axis: str | tuple[str, ...]
  size: int
  strategy: str
  layout: str

  def chunks(self, index: int | Array, length: int
             ) -> tuple[tuple[int, int, int | Array], ...]:
    """``(local start, length, global start)`` of each contiguous run of
    positions that shard ``index`` holds, of a sequence whose shards have
    ``length`` positions each."""
    if self.layout == "contiguous":
      return ((0, length, index * length),)
    half = length // 2
    return ((0, half, index * half),
            (half, half, (2 * self.size - 1 - index) * half))

  def validate(self, q_len: int, kv_len: int) -> None:
    """``ValueError`` unless local lengths suit the layout."""
    if self.layout == "zigzag":
      for name, length in (("query", q_len), ("key", kv_len)):
        if length % 2:
          raise ValueError(
              f"context_parallel: the zigzag layout cuts each shard into two "
              f"chunks, so the {name} sequence per shard must be even, got "
              f"{length} (global {length * self.size} over {self.size} "
              "shards)")


def default_strategy(num_heads: int, num_kv_heads: int) -> str:
  """``all_gather`` when K/V are at most a quarter of the queries' size
  (GQA groups of 4 or more), where gathering them costs little memory and
  sends no more than a ring; ``ring`` otherwise (memory flat in the number
  of shards, transfers overlapped with compute)."""
  return "all_gather" if num_heads >= 4 * num_kv_heads else "ring"


# ------------------------------------------------------------------ blocks
def _block_call(call: AttentionCall, q_part: tuple, kv_part: tuple,
                keys: tuple[Array, Array, Array | None]) -> AttentionCall:
  """The call of local query chunk ``q_part`` against key chunk
  ``kv_part`` of the K/V block ``keys`` (``(k, v, kv segment ids)``)."""
  q_start, q_len, q_offset = q_part
  kv_start, kv_len, kv_offset = kv_part
  k, v, kv_ids = keys
  mask = call.mask
  q_ids = mask.q_segment_ids
  block_mask = dataclasses.replace(
      mask, q_len=q_len, kv_len=kv_len,
      q_segment_ids=None if q_ids is None else lax.slice_in_dim(
          q_ids, q_start, q_start + q_len, axis=1),
      kv_segment_ids=None if kv_ids is None else lax.slice_in_dim(
          kv_ids, kv_start, kv_start + kv_len, axis=1),
      q_offset=jnp.asarray(q_offset, jnp.int32),
      kv_offset=jnp.asarray(kv_offset, jnp.int32))
  return dataclasses.replace(
      call, mask=block_mask, returns_residual=True,
      query=lax.slice_in_dim(call.query, q_start, q_start + q_len, axis=1),
      key=lax.slice_in_dim(k, kv_start, kv_start + kv_len, axis=1),
      value=lax.slice_in_dim(v, kv_start, kv_start + kv_len, axis=1))


def _merge(acc, part):
  """Two partial results over disjoint keys -> their exact union: weights
  ``exp(lse_i - lse)`` with ``lse = logaddexp(lse_1, lse_2)``; rows that
  see no key stay ``(0, -inf)``."""
  if acc is None:
    return part
  (o1, l1), (o2, l2) = acc, part
  top = jnp.maximum(l1, l2)
  top = jnp.where(jnp.isneginf(top), 0.0, top)
  w1, w2 = jnp.exp(l1 - top), jnp.exp(l2 - top)
  total = w1 + w2
  empty = total == 0
  lse = jnp.where(empty, -jnp.inf, top + jnp.log(jnp.where(empty, 1.0, total)))
  scale = 1.0 / jnp.where(empty, 1.0, total)
  out = o1 * (w1 * scale)[..., None] + o2 * (w2 * scale)[..., None]
  return out, lse


def _rows(x: Array, part: tuple) -> Array:
  start, length, _ = part
  return lax.slice_in_dim(x, start, start + length, axis=1)


def _concat(parts: list[Array]) -> Array:
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _attend_block(call: AttentionCall, backend: Backend, q_parts, kv_parts,
                  keys) -> list:
  """Per local query chunk, the merged ``(out float32, lse)`` over the key
  chunks of ``keys``."""
  results = []
  for q_part in q_parts:
    acc = None
    for kv_part in kv_parts:
      out, lse = backend.forward(_block_call(call, q_part, kv_part, keys))
      acc = _merge(acc, (out.astype(jnp.float32), lse))
    results.append(acc)
  return results


def _backward_block(call: AttentionCall, backend: Backend, q_parts, kv_parts,
                    keys, stats) -> tuple[list, list]:
  """dQ per query chunk and (dK, dV) per key chunk of one K/V block, from
  the whole call's row statistics ``stats = (out, lse, d_out, d_lse)``."""
  dq_parts, dkv_parts = [None] * len(q_parts), [None] * len(kv_parts)
  for i, q_part in enumerate(q_parts):
    out, lse, d_out, d_lse = (_rows(x, q_part) for x in stats)
    for j, kv_part in enumerate(kv_parts):
      dq, dk, dv = backend.backward(_block_call(call, q_part, kv_part, keys),
                                    out, lse, d_out, d_lse)
      dq, dk, dv = (x.astype(jnp.float32) for x in (dq, dk, dv))
      dq_parts[i] = dq if dq_parts[i] is None else dq_parts[i] + dq
      dkv_parts[j] = ((dk, dv) if dkv_parts[j] is None else
                      (dkv_parts[j][0] + dk, dkv_parts[j][1] + dv))
  return dq_parts, dkv_parts


# -------------------------------------------------------------- collectives
def _shift(x, plan: Plan, distance: int):
  """Sends shard ``i``'s ``x`` to shard ``i + distance`` (mod size)."""
  n = plan.size
  perm = [(i, (i + distance) % n) for i in range(n)]
  return jax.tree.map(lambda a: lax.ppermute(a, plan.axis, perm), x)


def _ring_reach(call: AttentionCall, plan: Plan) -> tuple[int, int]:
  """``(ahead, behind)``: a ring visits the K/V blocks of shards ``i - 1 ..
  i - ahead`` (passing blocks forward) and ``i + 1 .. i + behind``
  (passing them backward), the fewest steps that cover every block some
  query of some shard may see."""
  n, mask = plan.size, call.mask
  t, s = call.query.shape[1], call.key.shape[1]

  def needed(distance: int) -> bool:
    for i in range(n):
      src = (i - distance) % n
      for _, q_len, q_off in plan.chunks(i, t):
        for _, kv_len, kv_off in plan.chunks(src, s):
          if tiles.ranges_may_see(q_off, q_len, kv_off, kv_len,
                                  is_causal=mask.is_causal,
                                  window=mask.window):
            return True
    return False

  distances = [d for d in range(1, n) if needed(d)]
  best = None
  for ahead in range(n):
    behind = max([n - d for d in distances if d > ahead], default=0)
    if best is None or ahead + behind < sum(best):
      best = (ahead, behind)
  return best


# ---------------------------------------------------------------- forward
def forward(call: AttentionCall, backend: Backend, plan: Plan
            ) -> tuple[Array, Array]:
  """``(out [B, T, N, H] float32, lse [B, T, N])`` of the local queries
  against every shard's keys, without a derivative."""
  index = lax.axis_index(plan.axis)
  t, s = call.query.shape[1], call.key.shape[1]
  q_parts = plan.chunks(index, t)
  keys = (call.key, call.value, call.mask.kv_segment_ids)
  if plan.strategy == "all_gather":
    keys, kv_parts = _gathered(keys, plan, s)
    results = _attend_block(call, backend, q_parts, kv_parts, keys)
  else:
    ahead, behind = _ring_reach(call, plan)
    results = _attend_block(call, backend, q_parts, plan.chunks(index, s),
                            keys)
    for direction, steps in ((1, ahead), (-1, behind)):
      results = _ring_forward(call, backend, plan, q_parts, keys, results,
                              direction, steps)
  out = _concat([o for o, _ in results])
  lse = _concat([l for _, l in results])
  return out, lse


def _ring_forward(call: AttentionCall, backend: Backend, plan: Plan,
                  q_parts, keys, results: list, direction: int,
                  steps: int) -> list:
  """``results`` merged with the blocks of shards ``i - direction``, ...,
  ``i - direction * steps``.  A loop (not unrolled) so that one block is
  live at a time; each iteration sends the block in hand on while
  attending to it."""
  if steps == 0:
    return results
  index = lax.axis_index(plan.axis)
  s = call.key.shape[1]

  def attend(step, block, results):
    src = (index - direction * step) % plan.size
    parts = _attend_block(call, backend, q_parts, plan.chunks(src, s), block)
    return tuple(_merge(a, p) for a, p in zip(results, parts))

  def body(step, carry):
    block, results = carry
    return _shift(block, plan, direction), attend(step, block, results)

  block = _shift(keys, plan, direction)
  block, results = lax.fori_loop(1, steps, body, (block, tuple(results)))
  return list(attend(steps, block, results))


def _gathered(keys, plan: Plan, s: int):
  """K, V and key segment ids of every shard, in global position order,
  and their one chunk ``(0, n s, 0)``."""
  def gather(x):
    if x is None:
      return None
    x = lax.all_gather(x, plan.axis, axis=1, tiled=True)
    if plan.layout == "zigzag":
      # Shard i holds chunks i and 2n-1-i; put the 2n chunks in order.
      n, half = plan.size, s // 2
      chunks = [lax.slice_in_dim(x, c * half, (c + 1) * half, axis=1)
                for c in range(2 * n)]
      where = {}
      for i in range(n):
        where[i], where[2 * n - 1 - i] = 2 * i, 2 * i + 1
      x = jnp.concatenate([chunks[where[c]] for c in range(2 * n)], axis=1)
    return x
  return (tuple(gather(x) for x in keys),
          ((0, plan.size * s, 0),))


def _scatter_gathered(x: Array, plan: Plan, s: int) -> Array:
  """The transpose of :func:`_gathered` for one array: each shard receives
  the sum over shards of its own positions."""
  if plan.layout == "zigzag":
    n, half = plan.size, s // 2
    chunks = [lax.slice_in_dim(x, c * half, (c + 1) * half, axis=1)
              for c in range(2 * n)]
    order = []
    for i in range(n):
      order += [chunks[i], chunks[2 * n - 1 - i]]
    x = jnp.concatenate(order, axis=1)
  return lax.psum_scatter(x, plan.axis, scatter_dimension=1, tiled=True)


# --------------------------------------------------------------- backward
def backward(call: AttentionCall, backend: Backend, plan: Plan, out: Array,
             lse: Array, d_out: Array, d_lse: Array
             ) -> tuple[Array, Array, Array]:
  """``(dq, dk, dv)`` of the local shards, from the whole call's ``out``
  and ``lse`` (as :func:`forward` returned them) and their cotangents."""
  index = lax.axis_index(plan.axis)
  t, s = call.query.shape[1], call.key.shape[1]
  q_parts = plan.chunks(index, t)
  stats = (out, lse, d_out, d_lse)
  keys = (call.key, call.value, call.mask.kv_segment_ids)
  dq = [None] * len(q_parts)

  def add_dq(parts):
    for i, part in enumerate(parts):
      dq[i] = part if dq[i] is None else dq[i] + part

  if plan.strategy == "all_gather":
    gathered, kv_parts = _gathered(keys, plan, s)
    dq_parts, ((dk, dv),) = _backward_block(call, backend, q_parts, kv_parts,
                                            gathered, stats)
    add_dq(dq_parts)
    dk, dv = (_scatter_gathered(x, plan, s) for x in (dk, dv))
  else:
    dk = dv = None
    ahead, behind = _ring_reach(call, plan)
    for direction, steps, first in ((1, ahead, 0), (-1, behind, 1)):
      if steps < first:
        continue
      dq_parts, (dk_part, dv_part) = _ring_backward(
          call, backend, plan, q_parts, keys, stats, direction, steps, first)
      add_dq(dq_parts)
      dk = dk_part if dk is None else dk + dk_part
      dv = dv_part if dv is None else dv + dv_part
  return (_concat(dq).astype(call.query.dtype), dk.astype(call.key.dtype),
          dv.astype(call.value.dtype))


def _ring_backward(call: AttentionCall, backend: Backend, plan: Plan,
                   q_parts, keys, stats, direction: int, steps: int,
                   first: int) -> tuple[list, tuple[Array, Array]]:
  """dQ from the blocks of shards ``i - direction * first``, ...,
  ``i - direction * steps``, and the dK/dV this shard's own block gathers
  from the shards it visits: each block travels with its accumulator,
  which returns to its owner at the end."""
  index = lax.axis_index(plan.axis)
  s = call.key.shape[1]

  def grads(step, block, sums=None):
    src = (index - direction * step) % plan.size
    dq_parts, dkv_parts = _backward_block(
        call, backend, q_parts, plan.chunks(src, s), block, stats)
    dkv = (_concat([a for a, _ in dkv_parts]),
           _concat([b for _, b in dkv_parts]))
    fresh = (dkv, tuple(dq_parts))
    return fresh if sums is None else jax.tree.map(jnp.add, sums, fresh)

  def body(step, carry):
    block, sums = carry
    # The block goes on while it is worked on; its accumulator follows it
    # once this shard's share is added.
    moved = _shift(block, plan, direction)
    acc, dq = grads(step, block, sums)
    return moved, (_shift(acc, plan, direction), dq)

  block = keys if first == 0 else _shift(keys, plan, direction)
  sums = grads(first, block)
  if steps > first:
    block = _shift(block, plan, direction)
    sums = (_shift(sums[0], plan, direction), sums[1])
    block, sums = lax.fori_loop(first + 1, steps, body, (block, sums))
    sums = grads(steps, block, sums)
  acc, dq = sums
  if steps > 0:
    acc = _shift(acc, plan, -direction * steps)
  return list(dq), acc


# ----------------------------------------------------------- differentiable
def attend(call: AttentionCall, backend: Backend, plan: Plan
           ) -> tuple[Array, Array]:
  """``(out [B, T, N, H], lse [B, T, N])`` of the local shards,
  differentiable in query, key and value: :func:`forward` with
  :func:`backward` as its derivative."""
  plan.validate(call.query.shape[1], call.key.shape[1])
  mask = call.mask
  arrays = (mask.q_lengths, mask.kv_lengths, mask.q_segment_ids,
            mask.kv_segment_ids, call.alibi_slopes)
  static = dataclasses.replace(call, query=None, key=None, value=None,
                               alibi_slopes=None, mask=dataclasses.replace(
                                   mask, q_lengths=None, kv_lengths=None,
                                   q_segment_ids=None, kv_segment_ids=None))
  return _attend(call.query, call.key, call.value, arrays,
                 _Static(static, backend, plan))


@dataclasses.dataclass(frozen=True)
class _Static:
  """The static part of a context-parallel call (hashable by identity of
  its fields)."""

  call: AttentionCall
  backend: Backend
  plan: Plan

  def rebuild(self, q, k, v, arrays) -> AttentionCall:
    q_lengths, kv_lengths, q_ids, kv_ids, slopes = arrays
    mask = dataclasses.replace(self.call.mask, q_lengths=q_lengths,
                               kv_lengths=kv_lengths, q_segment_ids=q_ids,
                               kv_segment_ids=kv_ids)
    return dataclasses.replace(self.call, query=q, key=k, value=v, mask=mask,
                               alibi_slopes=slopes)

  def __hash__(self):
    return id(self)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q, k, v, arrays, static: _Static):
  out, lse = forward(static.rebuild(q, k, v, arrays), static.backend,
                     static.plan)
  return out.astype(q.dtype), lse


def _attend_fwd(q, k, v, arrays, static: _Static):
  out, lse = forward(static.rebuild(q, k, v, arrays), static.backend,
                     static.plan)
  return (out.astype(q.dtype), lse), (q, k, v, arrays, out, lse)


def _attend_bwd(static: _Static, residuals, cotangents):
  q, k, v, arrays, out, lse = residuals
  d_out, d_lse = cotangents
  dq, dk, dv = backward(static.rebuild(q, k, v, arrays), static.backend,
                        static.plan, out, lse, d_out, d_lse)
  return dq, dk, dv, jax.tree.map(lambda _: None, arrays)


_attend.defvjp(_attend_fwd, _attend_bwd)


# ----------------------------------------------------------------- backend
@dataclasses.dataclass(frozen=True)
class ContextBackend:
  """A backend that computes a call holding one shard of each sequence by
  context parallelism over ``plan``, each block served by the block
  methods of ``inner``; it declines (``NotImplementedError``) where
  ``inner`` declines a block, so that dispatch tries the next backend of
  an order as for any call.

  Attributes:
    inner: the backend of every block.
    plan: the mesh axis, strategy and layout.
  """

  inner: Backend
  plan: Plan

  @property
  def name(self) -> str:
    return self.inner.name

  def __call__(self, call: AttentionCall) -> tuple[Array, Array]:
    if not (hasattr(self.inner, "forward")
            and hasattr(self.inner, "backward")):
      raise NotImplementedError(
          f"{self.inner.name}: serves no blocks of a sharded sequence")
    return attend(call, self.inner, self.plan)


def check_blocks(call: AttentionCall, plan: Plan, backend: Backend) -> None:
  """``NotImplementedError`` unless ``backend``'s block methods serve the
  blocks of ``call`` (a shard's call) under ``plan``, traced abstractly on
  one block of the plan's shape, outside any mesh axis."""
  if not (hasattr(backend, "forward") and hasattr(backend, "backward")):
    raise NotImplementedError(
        f"{backend.name}: serves no blocks of a sharded sequence")
  t, s = call.query.shape[1], call.key.shape[1]
  q_part, kv_part = plan.chunks(0, t)[0], plan.chunks(0, s)[0]
  if plan.strategy == "all_gather":
    kv_part = (0, plan.size * s, 0)
  key_shape = call.key.shape[:1] + (max(kv_part[1], s),) + call.key.shape[2:]
  keys = jax.ShapeDtypeStruct(key_shape, call.key.dtype)
  ids = call.mask.kv_segment_ids
  if ids is not None:
    ids = jax.ShapeDtypeStruct(key_shape[:2], ids.dtype)
  jax.eval_shape(
      lambda k, v, ids: backend.forward(
          _block_call(call, q_part, kv_part, (k, v, ids))), keys, keys, ids)

