"""Kernel backends under ``jax.jit`` with ``Auto``-mode shardings.

A Pallas kernel is an opaque custom call to XLA's partitioner, which
would gather every input onto every device and run the whole call on each.
:func:`run_sharded` instead wraps a kernel backend's forward and backward
in ``jax.experimental.custom_partitioning``, so that the partitioner asks
this module how to split them, once it knows the inputs' shardings:

* batch and heads (query and key/value heads together; under MQA the one
  key/value head is replicated and its gradients summed over the head
  axes): each device runs the kernel on its block, with no communication;
* the query sequence: context parallelism (:mod:`jflash.parallel.context`)
  over the sequence's mesh axes, keys and values sharded like the queries;
* anything the kernels cannot split (the head dim, a batch or head count
  that does not divide into the shards, a sequence the backend's block
  methods do not serve) is resharded to replicate that axis only, keeping
  the rest of the split.

The rules are given both as a Shardy sharding rule (the default
partitioner) and as the GSPMD callbacks.  Inputs with explicit shardings
(``AxisType.Explicit`` meshes) go through :func:`sharding.per_shard`
instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import (ArrayMapping,
                                                  CompoundFactor,
                                                  SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jflash.parallel import context, sharding
from jflash.core.call import AttentionCall, Backend

if TYPE_CHECKING:
  from jflash.parallel import ContextParallel

Array = jax.Array
Run = Callable[[AttentionCall], tuple[Array, Array]]

MASK_ARRAYS = ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids",
               "q_offset", "kv_offset")
"""The array fields of a mask that travel as operands (a kernel backend
declines a dense mask)."""


def run_sharded(call: AttentionCall, backend: Backend, run: Run,
                parallel: ContextParallel | None = None
                ) -> tuple[Array, Array]:
  """``run(call)`` (``(out [B, T, N, H], lse [B, T, N])``) split over the
  devices as the inputs are sharded.

  Args:
    call: the whole call.
    backend: supplies the block methods ``forward(call)`` and
      ``backward(call, out, lse, d_out, d_lse)`` that compute each
      device's part and the backward pass.
    run: the backend's differentiable kernel call, used as is where
      nothing is split (a single device, or inside a ``shard_map``) and
      per shard for explicit shardings.
    parallel: the strategy and layout of a sequence-sharded call (a
      :class:`jflash.ContextParallel`); None for the defaults (the
      strategy by head counts, the contiguous layout).
  """
  if sharding.is_explicitly_sharded(call):
    return sharding.per_shard(call, run, backend.name)
  if (not _devices_to_split(call.platform) or call.bias is not None
      or call.mask.dense is not None or call.alibi_slopes is not None):
    return run(call)
  mask = call.mask
  names = tuple(n for n in MASK_ARRAYS if getattr(mask, n) is not None)
  bare = dataclasses.replace(
      call, query=None, key=None, value=None,
      mask=dataclasses.replace(mask, **{n: None for n in MASK_ARRAYS}))
  static = _Static(bare, names, call.query.shape, call.key.shape,
                   call.query.dtype, backend, run, parallel)
  arrays = tuple(getattr(mask, n) for n in names)
  if call.interpret and _has_effects(static, call.query, call.key,
                                     call.value, arrays):
    return run(call)
  return _attention(static)(call.query, call.key, call.value, arrays)


_PLATFORM_KIND = {"cuda": "gpu", "rocm": "gpu"}
"""Lowering platform names -> the platform of JAX's devices."""


def _devices_to_split(platform: str | None) -> bool:
  """Whether the call is traced for several devices present here.  Not
  when it is lowered for another platform than this host's (a
  per-platform branch of ``implementation=None``, or an abstract mesh of
  another platform's devices, as ``jax.export`` for a TPU from a CPU
  host), which ``custom_partitioning`` cannot lower (it needs the
  devices)."""
  host = jax.devices()[0].platform
  if platform is not None and _PLATFORM_KIND.get(platform, platform) != host:
    return False
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and device.platform != host:
    return False
  if mesh.axis_names and mesh.size == 1:
    return False
  return jax.device_count() > 1


def _has_effects(static: _Static, *args) -> bool:
  """Whether the kernel call has side effects (the callbacks of Pallas's
  TPU interpreter with ``InterpretParams``; compiled kernels have none):
  ``custom_partitioning`` declares none for its function, so such a call
  runs as it is."""
  def forward(q, k, v, arrays):
    return static.run(static.rebuild(q, k, v, arrays))
  return bool(jax.make_jaxpr(forward)(*args).effects)


# ------------------------------------------------------------ static facts
@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
  """The static part of one call: everything but its arrays."""

  call: AttentionCall  # arrays removed
  names: tuple[str, ...]  # the mask arrays present, in operand order
  q_shape: tuple[int, int, int, int]
  kv_shape: tuple[int, int, int, int]
  dtype: Any
  backend: Backend
  run: Run
  parallel: Any  # a ContextParallel, or None

  def rebuild(self, q: Array, k: Array, v: Array, arrays: tuple,
              sequence_shards: bool = False) -> AttentionCall:
    """The call of the arrays given (whole or one device's blocks).  With
    ``sequence_shards`` the mask describes blocks of the global sequences
    (offsets present; lengths stay global, segment ids are local), as
    :func:`sharding.run_sequence_sharded` builds it."""
    mask = dataclasses.replace(
        self.call.mask, batch=q.shape[0], q_len=q.shape[1],
        kv_len=k.shape[1], **dict(zip(self.names, arrays)),
        **({"has_offsets": True} if sequence_shards else {}))
    return dataclasses.replace(self.call, query=q, key=k, value=v,
                               mask=mask)

  def with_batch(self, batch: int) -> "_Static":
    """The same call over ``batch`` rows."""
    return dataclasses.replace(
        self, q_shape=(batch,) + tuple(self.q_shape[1:]),
        kv_shape=(batch,) + tuple(self.kv_shape[1:]),
        call=dataclasses.replace(self.call, mask=dataclasses.replace(
            self.call.mask, batch=batch)))


# ------------------------------------------------------------------ layout
@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one call is split: the mesh axes (a name, a tuple of names, or
  None) of the batch, sequence and head axes, and the context-parallel
  plan when the sequence is split."""

  batch: Any
  sequence: Any
  heads: Any
  kv_heads: Any  # None under MQA with sharded heads: K/V replicated
  plan: context.Plan | None

  @property
  def x_spec(self) -> P:
    return P(self.batch, self.sequence, self.heads, None)

  @property
  def kv_spec(self) -> P:
    return P(self.batch, self.sequence, self.kv_heads, None)

  @property
  def lse_spec(self) -> P:
    return P(self.batch, self.sequence, self.heads)

  @property
  def summed_heads(self) -> Any:
    """The head axes dK and dV are summed over (MQA), or None."""
    return self.heads if self.kv_heads is None else None

  def mask_spec(self, name: str) -> P:
    if name.endswith("offset"):
      return P()
    if name.endswith("lengths"):
      return P(self.batch)
    return P(self.batch, self.sequence)


def _spec(shape) -> tuple:
  """The per-dimension mesh axes of an argument's sharding (None entries
  for a replicated or unknown one)."""
  sharding_ = getattr(shape, "sharding", None)
  spec = tuple(getattr(sharding_, "spec", ()) or ())
  return spec + (None,) * (len(shape.shape) - len(spec))


def _layout(static: _Static, mesh, q_shape, k_shape) -> _Layout:
  """The split of a call whose query and key arrive sharded as
  ``q_shape`` and ``k_shape``: batch and heads take the query's mesh axes
  (else the key's), the sequence the query's, each where the kernels can
  use them; the head dim is never split."""
  batch, _, heads, _ = static.q_shape
  kv_heads = static.kv_shape[2]
  q_spec, k_spec = _spec(q_shape), _spec(k_shape)
  used: set[str] = set()

  def take(entry, size: int, *more_sizes: int):
    """``entry`` if its shards divide every size and its axes are free."""
    parts = sharding.shard_count(mesh, entry)
    if (entry is None or any(n % parts for n in (size,) + more_sizes)
        or used & set(sharding.mesh_axes(entry))):
      return None
    used.update(sharding.mesh_axes(entry))
    return entry

  b = take(q_spec[0] if q_spec[0] is not None else k_spec[0], batch)
  # Query head j reads K/V head j // (N / K): split together, the shards
  # line up when they divide K (MQA's one K/V head is replicated).
  h = q_spec[2] if q_spec[2] is not None else (
      k_spec[2] if kv_heads > 1 else None)
  h = take(h, heads, *((kv_heads,) if kv_heads > 1 else ()))
  kv_h = None if (kv_heads == 1 and sharding.shard_count(mesh, h) > 1) else h
  seq = take(q_spec[1], static.q_shape[1], static.kv_shape[1])
  plan = None
  if sharding.shard_count(mesh, seq) > 1:
    plan = _sequence_plan(static, mesh, b, seq, h, kv_h, sharding.shard_count(mesh, seq))
  return _Layout(b, seq if plan is not None else None, h, kv_h, plan)


def _sequence_plan(static: _Static, mesh, b, seq, h, kv_h,
                   shards: int) -> context.Plan | None:
  """The context-parallel plan over the sequence axes ``seq``, or None
  when the sequences cannot be split there (a call that already holds
  blocks of longer sequences, a backend whose block methods decline the
  blocks): the sequence is then gathered."""
  _, q_len, heads, _ = static.q_shape
  kv_len, kv_heads = static.kv_shape[1], static.kv_shape[2]
  if static.call.mask.has_offsets:
    return None
  parallel = static.parallel
  strategy = getattr(parallel, "strategy", "auto")
  if strategy == "auto":
    strategy = context.default_strategy(heads, kv_heads)
  axis = sharding.mesh_axes(seq)
  plan = context.Plan(axis=axis if len(axis) > 1 else axis[0], size=shards,
                      strategy=strategy,
                      layout=getattr(parallel, "layout", "contiguous"))
  plan.validate(q_len // shards, kv_len // shards)
  layout = _Layout(b, seq, h, kv_h, plan)
  local = _local_shapes(static, mesh, layout)

  def trace(q, k, v, arrays):
    call = static.rebuild(q, k, v, arrays, sequence_shards=True)
    context.check_blocks(call, plan, static.backend)
    return 0

  try:
    jax.eval_shape(trace, *local)
  except NotImplementedError:
    return None
  return plan


def _local_shapes(static: _Static, mesh, layout: _Layout) -> tuple:
  """Abstract ``(q, k, v, mask arrays)`` of one device's blocks."""
  def local(shape, spec, dtype):
    return jax.ShapeDtypeStruct(
        tuple(d // sharding.shard_count(mesh, e) for d, e in zip(shape, spec)), dtype)

  whole = {"q_lengths": (static.q_shape[0],),
           "kv_lengths": (static.q_shape[0],),
           "q_segment_ids": static.q_shape[:2],
           "kv_segment_ids": static.kv_shape[:2],
           "q_offset": (), "kv_offset": ()}
  arrays = tuple(local(whole[n], tuple(layout.mask_spec(n)) +
                       (None,) * len(whole[n]), jnp.int32)
                 for n in static.names)
  return (local(static.q_shape, layout.x_spec, static.dtype),
          local(static.kv_shape, layout.kv_spec, static.dtype),
          local(static.kv_shape, layout.kv_spec, static.dtype), arrays)


def _shardings(mesh, layout: _Layout, static: _Static, kinds: str):
  """NamedShardings of a sequence of ``x`` (like the query), ``kv`` (like
  keys), ``lse`` operands, followed by the mask arrays."""
  specs = {"x": layout.x_spec, "kv": layout.kv_spec, "lse": layout.lse_spec}
  named = [NamedSharding(mesh, specs[k]) for k in kinds.split()]
  arrays = tuple(NamedSharding(mesh, layout.mask_spec(n))
                 for n in static.names)
  return named, arrays


def _without_constants(fn: Callable) -> Callable:
  """``fn`` traced as one ``jax.jit`` call: a kernel's tile schedule built
  while tracing (``trace_time``) is a constant array, which
  ``custom_partitioning`` does not take as a free constant of its
  function, but takes inside a nested call."""
  jitted = jax.jit(fn)

  def call(*args):
    return jitted(*args)
  return call


# ------------------------------------------------------------ sharding rule
def _rule(static: _Static, operands: str, results: str) -> SdyShardingRule:
  """The Shardy rule: batch ``b``, sequences ``t``/``s``, heads (``n``, or
  under GQA/MQA ``(k g)`` for the queries and ``k`` for keys and values)
  and the head dim ``h``, which must be replicated.  The partition
  functions make the final choice; the rule guides propagation."""
  heads, kv_heads = static.q_shape[2], static.kv_shape[2]
  # Shardy takes no factor of size 1 in a compound: MQA's one K/V head is
  # a factor of its own (replicated when the query heads are split).
  grouped = heads != kv_heads and kv_heads > 1
  q_heads = CompoundFactor("k", "g") if grouped else "n"
  k_heads = "k" if grouped or heads != kv_heads else "n"
  maps = {"x": ArrayMapping("b", "t", q_heads, "h"),
          "kv": ArrayMapping("b", "s", k_heads, "h"),
          "lse": ArrayMapping("b", "t", q_heads)}
  arrays = {"q_lengths": ArrayMapping("b"), "kv_lengths": ArrayMapping("b"),
            "q_segment_ids": ArrayMapping("b", "t"),
            "kv_segment_ids": ArrayMapping("b", "s"),
            "q_offset": ArrayMapping(), "kv_offset": ArrayMapping()}
  sizes = {"g": heads // kv_heads} if grouped else {}
  return SdyShardingRule(
      tuple(maps[k] for k in operands.split())
      + tuple(arrays[n] for n in static.names),
      tuple(maps[k] for k in results.split()),
      need_replication_factors=("h",), **sizes)


# --------------------------------------------------------------- functions
def _attention(static: _Static) -> Callable:
  """The differentiable call ``(q, k, v, mask arrays) -> (out, lse)``: a
  partitioned forward whose derivative is a partitioned backward."""
  inference = _batchable(static, lambda s: _forward(s, training=False))
  training = _batchable(static, lambda s: _forward(s, training=True))
  backward = _batchable(static, _backward)

  @jax.custom_vjp
  def attention(q, k, v, arrays):
    return inference(q, k, v, arrays)

  def attention_fwd(q, k, v, arrays):
    out, lse = training(q, k, v, arrays)
    return (out.astype(static.dtype), lse), (q, k, v, arrays, out, lse)

  def attention_bwd(residuals, cotangents):
    q, k, v, arrays, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = backward(q, k, v, out, lse, d_out, d_lse, arrays)
    return dq, dk, dv, tuple(None for _ in arrays)

  attention.defvjp(attention_fwd, attention_bwd)
  return attention


def _batchable(static: _Static,
               build: Callable[[_Static], Callable]) -> Callable:
  """``build(static)`` with a ``jax.vmap`` rule (``custom_partitioning``
  has none): the mapped axis is folded into the batch axis of every
  operand (the operands not mapped are broadcast), and the folded call is
  built for the larger batch."""
  fn = jax.custom_batching.custom_vmap(build(static))

  @fn.def_vmap
  def rule(axis_size: int, in_batched, *args):
    batch = static.q_shape[0]
    names = (None,) * (len(args) - 1) + (static.names,)

    def fold(x, mapped, name=None):
      if name is not None and name.endswith("offset"):
        if mapped:
          raise NotImplementedError(
              "sequence offsets mapped by jax.vmap differ per call; map "
              "the call outside the kernel backend")
        return x
      if not mapped:
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
      return x.reshape((axis_size * batch,) + x.shape[2:])

    folded = []
    for arg, mapped, name in zip(args, in_batched, names):
      if name is None:
        folded.append(fold(arg, mapped))
      else:
        folded.append(tuple(fold(x, m, n)
                            for x, m, n in zip(arg, mapped, name)))
    outs = _batchable(static.with_batch(axis_size * batch), build)(*folded)
    outs = tuple(o.reshape((axis_size, batch) + o.shape[1:]) for o in outs)
    return outs, tuple(True for _ in outs)

  return fn


def _forward(static: _Static, training: bool) -> custom_partitioning:
  """The forward pass as a custom-partitioned function: ``(out, lse)``,
  ``out`` in the input dtype for inference, float32 for training (the
  backward's residual)."""
  out_dtype = jnp.float32 if training else static.dtype

  def whole(q, k, v, arrays):
    call = static.rebuild(q, k, v, arrays)
    out, lse = (static.backend.forward(call) if training
                else static.run(call))
    return out.astype(out_dtype), lse.astype(jnp.float32)

  def local_fn(layout: _Layout):
    def run_local(q, k, v, arrays):
      if layout.plan is None:
        return whole(q, k, v, arrays)
      call = static.rebuild(q, k, v, arrays, sequence_shards=True)
      out, lse = context.forward(call, static.backend, layout.plan)
      return out.astype(out_dtype), lse.astype(jnp.float32)
    return run_local

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    layout = _layout(static, mesh, *arg_shapes[:2])
    return tuple(_shardings(mesh, layout, static, "x lse")[0])

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    layout = _layout(static, mesh, *arg_shapes[:2])
    (q, k, v), arrays = _shardings(mesh, layout, static, "x kv kv")
    results = tuple(_shardings(mesh, layout, static, "x lse")[0])
    return mesh, local_fn(layout), results, (q, k, v, arrays)

  fn = custom_partitioning(_without_constants(whole))
  fn.def_partition(partition, infer_sharding_from_operands=infer,
                   sharding_rule=_rule(static, "x kv kv", "x lse"))
  return fn


def _backward(static: _Static) -> custom_partitioning:
  """The backward pass as a custom-partitioned function: ``(dq, dk, dv)``
  from the forward's ``out`` and ``lse`` and their cotangents."""

  def whole(q, k, v, out, lse, d_out, d_lse, arrays):
    call = static.rebuild(q, k, v, arrays)
    grads = static.backend.backward(call, out, lse, d_out, d_lse)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))

  def local_fn(layout: _Layout):
    def run_local(q, k, v, out, lse, d_out, d_lse, arrays):
      if layout.plan is None:
        call = static.rebuild(q, k, v, arrays)
        dq, dk, dv = static.backend.backward(call, out, lse, d_out, d_lse)
      else:
        call = static.rebuild(q, k, v, arrays, sequence_shards=True)
        dq, dk, dv = context.backward(call, static.backend, layout.plan,
                                      out, lse, d_out, d_lse)
      if layout.summed_heads is not None:
        # MQA: every device's query heads read the one key/value head.
        dk, dv = (lax.psum(g.astype(jnp.float32), sharding.mesh_axes(layout.heads))
                  for g in (dk, dv))
      return tuple(g.astype(x.dtype) for g, x in zip((dq, dk, dv),
                                                      (q, k, v)))
    return run_local

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    layout = _layout(static, mesh, *arg_shapes[:2])
    return tuple(_shardings(mesh, layout, static, "x kv kv")[0])

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    layout = _layout(static, mesh, *arg_shapes[:2])
    operands, arrays = _shardings(mesh, layout, static,
                                  "x kv kv x lse x lse")
    results = tuple(_shardings(mesh, layout, static, "x kv kv")[0])
    return mesh, local_fn(layout), results, (*operands, arrays)

  fn = custom_partitioning(_without_constants(whole))
  fn.def_partition(partition, infer_sharding_from_operands=infer,
                   sharding_rule=_rule(static, "x kv kv x lse x lse",
                                       "x kv kv"))
  return fn
