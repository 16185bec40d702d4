"""Kernel backends under ``jax.jit`` with ``Auto``-mode ``NamedSharding``
inputs (``jflash.parallel.partitioning``), checked with the TPU kernels in
interpret mode on the host devices, under both Shardy and GSPMD: each
device runs its batch/head block with no collective, axes the kernels
cannot split are gathered alone, and sharded sequences run context
parallelism; values and gradients match the reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from jflash.backends import (MosaicTpuBackend, MosaicTpuConfig, XlaBackend,
                             XlaConfig)
from jflash.parallel import partitioning
from jflash.core.call import AttentionCall
from jflash.masks import AttentionMask
from tests._support import (Case, fresh_rng, lse_err, random_qkv,
                            random_segments, rel_err)

SMALL = MosaicTpuBackend(MosaicTpuConfig(block_q=16, block_kv=16))
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute",
               "all-to-all")

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8,
                                reason="needs 8 devices")


@dataclasses.dataclass(frozen=True)
class PartitionedXla:
  """The ``xla`` backend's blocks behind :func:`partitioning.run_sharded`
  (its block methods serve sequence offsets), to check the
  context-parallel path whatever the kernels serve."""

  inner: XlaBackend = XlaBackend(XlaConfig(block_q=8, block_kv=8))
  name: str = "partitioned_xla"

  def __call__(self, call):
    return partitioning.run_sharded(call, self.inner, self.inner)


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
  """Runs the test under Shardy (JAX's default) and under GSPMD."""
  saved = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
  yield request.param
  jax.config.update("jax_use_shardy_partitioner", saved)


def _padded(spec) -> tuple:
  """A partition spec's first three entries (batch, sequence, heads)."""
  return (tuple(spec) + (None,) * 3)[:3]


def _counts(text: str) -> dict[str, int]:
  return {c: text.count(c + "(") + text.count(c + "-start(")
          for c in COLLECTIVES}


def _loss(out, lse, cot):
  """A loss through both outputs (rows that see no key have a logsumexp
  of -inf and no gradient)."""
  lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
  return jnp.sum(out * cot) + jnp.sum(lse * cot[..., 0])


def _divides(x, mesh, spec) -> bool:
  return all(d % np.prod([mesh.shape[a] for a in
                          (e if isinstance(e, tuple) else (e,))], dtype=int)
             == 0 for d, e in zip(x.shape, spec) if e is not None)


def _run(mesh_shape, names, spec, kwargs, *, b=4, t=32, n=4, k=2, h=16,
         backend=SMALL, kv_spec=None):
  """Runs the forward and gradients under ``jax.jit`` with q, k, v sharded
  as ``spec`` on an Auto mesh; checks them against the reference and
  returns the output's partition spec and the program's collectives."""
  rng = fresh_rng()
  q, key, value = random_qkv(rng, b=b, t=t, s=t, n=n, k=k, h=h)
  cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  kwargs = dict(kwargs)
  if kwargs.pop("segments", False):
    kwargs["segment_ids"] = jnp.asarray(random_segments(rng, b, t))
  if kwargs.pop("lengths", False):
    kwargs["key_value_seq_lengths"] = jnp.asarray(
        rng.integers(1, t + 1, b), jnp.int32)
    kwargs["query_seq_lengths"] = jnp.asarray(
        rng.integers(1, t + 1, b), jnp.int32)
  case = Case(q, key, value, kwargs=kwargs)

  mesh = jax.make_mesh(mesh_shape, names,
                       axis_types=(AxisType.Auto,) * len(names))
  specs = (spec, kv_spec or spec, kv_spec or spec, spec)

  def loss(q, k, v, cot):
    # Uneven shardings (heads that do not divide) can only arise inside
    # a program, as they do from a producer's sharding.
    q, k, v, cot = (jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, s)) for x, s in zip((q, k, v, cot), specs))
    out, lse = jflash.dot_product_attention(
        q, k, v, **kwargs, implementation=backend, interpret=True,
        return_residual=True)
    return _loss(out, lse, cot), (out, lse)

  placed = [jax.device_put(x, NamedSharding(mesh, s if _divides(x, mesh, s)
                                            else P()))
            for x, s in zip((q, key, value, cot), specs)]
  # One program with the forward and the backward.
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(
      *placed).compile()
  grads, (out, lse) = compiled(*placed)

  def reference_loss(q, k, v):
    return _loss(*case.call_reference(q, k, v, None, jit=False), cot)

  want_out, want_lse = case.call_reference(q, key, value, None)
  want_grads = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2)))(
      q, key, value)
  assert rel_err(out, want_out) < 1e-5
  assert lse_err(lse, want_lse) < 1e-4
  for got, want in zip(grads, want_grads):
    assert rel_err(got, want) < 1e-4
  return out.sharding.spec, _counts(compiled.as_text())


# ------------------------------------------------------ batch and heads
@pytest.mark.parametrize("mesh_shape,names,spec,n,k", [
    ((4,), ("data",), P("data"), 4, 2),
    ((4,), ("model",), P(None, None, "model"), 4, 4),
    ((2, 2), ("data", "model"), P("data", None, "model"), 4, 2),
    ((2, 4), ("data", "model"), P("data", None, "model"), 8, 4),
], ids=["batch", "heads", "batch-x-heads", "gqa-batch-x-heads"])
def test_batch_and_head_sharding_needs_no_collective(partitioner, mesh_shape,
                                                     names, spec, n, k):
  out_spec, collectives = _run(
      mesh_shape, names, spec, dict(is_causal=True, segments=True,
                                    lengths=True), n=n, k=k)
  assert _padded(out_spec) == _padded(spec)
  assert collectives == dict.fromkeys(COLLECTIVES, 0), collectives


def test_mqa_sums_key_gradients_over_head_shards(partitioner):
  """One K/V head under query heads split over ``model``: K/V are
  replicated there, and dK/dV are summed over it (the one collective)."""
  out_spec, collectives = _run(
      (2, 2), ("data", "model"), P("data", None, "model"),
      dict(is_causal=True, segments=True), n=4, k=1,
      kv_spec=P("data"))
  assert _padded(out_spec) == ("data", None, "model")
  assert collectives.pop("all-reduce") > 0
  assert collectives == dict.fromkeys(collectives, 0), collectives


@pytest.mark.parametrize("spec,n,k", [
    (P("data", None, None, "model"), 4, 2),
    (P("data", None, "model"), 3, 3),
    (P("data", None, "model"), 4, 4),
], ids=["head-dim", "heads-not-dividing", "batch-not-dividing"])
def test_unsplittable_axes_are_gathered_alone(partitioner, spec, n, k):
  """The head dim, or heads (batch) that do not divide into the shards,
  are replicated while the other split axis stays split."""
  b = 3 if n == 4 and k == 4 else 4
  out_spec, _ = _run((2, 2), ("data", "model"), spec,
                        dict(is_causal=True, segments=True), b=b, n=n, k=k)
  kept = ("data", None, None) if b == 4 else (None, None, "model")
  assert _padded(out_spec) == kept


# ------------------------------------------------------------- sequences
@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True),
    dict(is_causal=True, segments=True, lengths=True),
    dict(local_window_size=(5, 3), lengths=True),
], ids=["causal", "segments+lengths", "window+lengths"])
def test_sequence_sharding_runs_context_parallel(partitioner, kwargs):
  """The query sequence split over ``seq`` with batch over ``data``: a
  ring over ``seq`` (collective permutes, no gather of the sequence)."""
  out_spec, collectives = _run(
      (2, 4), ("data", "seq"), P("data", "seq"), kwargs, n=2, k=2,
      backend=PartitionedXla())
  assert _padded(out_spec)[:2] == ("data", "seq")
  assert collectives["collective-permute"] > 0
  assert collectives["all-gather"] == 0


def test_sequence_sharding_under_gqa_gathers_keys(partitioner):
  out_spec, collectives = _run(
      (4,), ("seq",), P(None, "seq"), dict(is_causal=True, segments=True),
      n=4, k=1, backend=PartitionedXla(), kv_spec=P())
  assert _padded(out_spec)[:2] == (None, "seq")
  assert collectives["all-gather"] > 0
  assert collectives["collective-permute"] == 0


def test_kernel_on_sharded_sequence_matches_reference(partitioner):
  """mosaic_tpu with the query sequence split: a context-parallel ring
  whose blocks run on the kernels, exact, with the batch kept split."""
  out_spec, collectives = _run(
      (2, 2), ("data", "seq"), P("data", "seq"),
      dict(is_causal=True, segments=True, lengths=True), n=2, k=2)
  assert _padded(out_spec)[0] == "data"
  assert collectives["collective-permute"] > 0
  assert collectives["all-gather"] == 0


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_strategy_reaches_partitioned_kernels(strategy):
  """``context_parallel=ContextParallel(strategy)`` under Auto mesh axes:
  the partitioned kernels use the strategy asked for."""
  rng = fresh_rng()
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(AxisType.Auto,))
  q, k, v = random_qkv(rng, b=1, t=64, s=64, n=2, k=2, h=16)
  ids = jnp.asarray(random_segments(rng, 1, 64, 4))
  cp = jflash.ContextParallel(strategy=strategy)
  sharding = NamedSharding(mesh, P(None, "seq"))
  fn = jax.jit(lambda q, k, v, ids: jflash.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, implementation=SMALL,
      interpret=True, context_parallel=cp))
  args = [jax.device_put(x, sharding) for x in (q, k, v, ids)]
  with jax.set_mesh(mesh):
    out = fn(*args)
    text = fn.lower(*args).compile().as_text()
  case = Case(q, k, v, kwargs=dict(is_causal=True, segment_ids=ids))
  want, _ = case.call_reference(q, k, v, None)
  assert rel_err(out, want) < 1e-5
  counts = _counts(text)
  assert (counts["collective-permute"] > 0) == (strategy == "ring")
  assert (counts["all-gather"] > 0) == (strategy == "all_gather")


def test_zigzag_layout_needs_a_known_sharding():
  """Under Auto mesh axes the sharding of the sequence is unknown while
  tracing, so a layout that depends on it is refused, not ignored."""
  q, k, v = random_qkv(fresh_rng(), b=1, t=64, s=64, n=2, k=2, h=16)
  cp = jflash.ContextParallel(layout="zigzag")
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(AxisType.Auto,))
  for impl in (None, "xla", SMALL):
    with jax.set_mesh(mesh), pytest.raises(ValueError,
                                           match="layout='zigzag'"):
      jax.jit(lambda q, k, v, impl=impl: jflash.dot_product_attention(
          q, k, v, implementation=impl, interpret=True,
          context_parallel=cp))(q, k, v)
  # One shard: the zigzag order is the sequence order.
  got = jflash.dot_product_attention(q, k, v, is_causal=True,
                                     context_parallel=cp)
  want = jflash.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------ transforms
def test_vmap_and_static_schedules_outside_a_mesh():
  """``jax.vmap`` (folded into the batch axis) and a causal-only mask
  (whose tile schedule is a constant built while tracing), on one
  device's arrays with several devices present."""
  rng = fresh_rng()
  q, key, value = (jnp.stack([x, -x]) for x in
                   random_qkv(rng, b=2, t=32, s=32, n=2, k=1, h=16))

  def loss(q, k, v):
    out = jflash.dot_product_attention(q, k, v, is_causal=True,
                                       implementation=SMALL, interpret=True)
    return jnp.sum(out * out), out

  got_grads, got = jax.jit(jax.vmap(jax.grad(loss, (0, 1, 2),
                                             has_aux=True)))(q, key, value)
  for i in range(2):
    case = Case(q[i], key[i], value[i], kwargs=dict(is_causal=True))
    want, _ = case.call_reference(q[i], key[i], value[i], None)
    want_grads = jax.jit(jax.grad(lambda *a: jnp.sum(case.call_reference(
        *a, None, jit=False)[0] ** 2), (0, 1, 2)))(q[i], key[i], value[i])
    assert rel_err(got[i], want) < 1e-5
    for g, w in zip(got_grads, want_grads):
      assert rel_err(g[i], w) < 1e-4


def test_batch_split_of_keys_alone_is_followed(partitioner):
  """Keys and values split over batch, queries replicated: the queries
  are sliced to match rather than the keys and values gathered.  The one
  gather left is the replicated query's gradient."""
  out_spec, collectives = _run((4,), ("data",), P(), dict(is_causal=True),
                               kv_spec=P("data"))
  assert _padded(out_spec)[0] == "data"
  assert collectives.pop("all-gather") <= 1
  assert collectives == dict.fromkeys(collectives, 0), collectives


def test_flax_model_on_auto_data_by_context_mesh_matches_one_device():
  """A Flax NNX model jitted on a data x context mesh of Auto axes, with
  packed documents and causal masking: its attention runs the kernels
  per device (a ring over the context axis, nothing gathered), and loss
  and gradients equal those on one device."""
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.qkv = nnx.Linear(32, 3 * 32, rngs=rngs)
      self.out = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x, ids):
      b, t, _ = x.shape
      q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * 2, 16), 3, axis=2)
      y = jflash.dot_product_attention(
          q, k, v, is_causal=True, segment_ids=ids, implementation=SMALL,
          interpret=True)
      return self.out(y.reshape(b, t, 32))

  rng = fresh_rng()
  model = Model(nnx.Rngs(int(rng.integers(1 << 30))))
  graphdef, params = nnx.split(model)
  x = jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.float32)
  ids = jnp.asarray(random_segments(rng, 2, 64, 4))
  target = jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.float32)

  def loss(params, x, ids, target):
    return jnp.mean((nnx.merge(graphdef, params)(x, ids) - target) ** 2)

  step = jax.jit(jax.value_and_grad(loss))
  want_loss, want_grads = step(params, x, ids, target)
  mesh = jax.make_mesh((2, 4), ("data", "context"),
                       axis_types=(AxisType.Auto,) * 2)
  tokens = NamedSharding(mesh, P("data", "context"))
  with jax.set_mesh(mesh):
    args = (jax.device_put(params, NamedSharding(mesh, P())),
            *(jax.device_put(a, tokens) for a in (x, ids, target)))
    got_loss, got_grads = step(*args)
    counts = _counts(step.lower(*args).compile().as_text())
  assert abs(float(got_loss) - float(want_loss)) <= 1e-5 * float(want_loss)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert rel_err(g, w) < 1e-4
  assert counts["collective-permute"] > 0
  assert counts["all-gather"] == 0
