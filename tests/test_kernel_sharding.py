"""Kernel backends on explicitly sharded inputs (``jflash.parallel.sharding``),
checked with the TPU kernels in interpret mode on 4 CPU devices: each device
runs its batch/head block, the numbers match the unsharded call, the
results keep the input sharding and no collective is needed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from jflash.backends import MosaicTpuBackend, MosaicTpuConfig
from tests._support import fresh_rng, random_qkv, random_segments, rel_err

SMALL = MosaicTpuBackend(MosaicTpuConfig(block_q=16, block_kv=32))

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4,
                                reason="needs 4 devices")


def _attend(q, k, v, ids, lengths):
  """Causal attention; with ``ids`` and ``lengths`` None the tile schedule
  depends on shapes only and is built while tracing, inside shard_map."""
  return jflash.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids,
      key_value_seq_lengths=lengths, implementation=SMALL, interpret=True)


def _loss(q, k, v, ids, lengths, cot):
  out, vjp = jax.vjp(lambda q, k, v: _attend(q, k, v, ids, lengths), q, k, v)
  return out, vjp(cot)


@pytest.mark.parametrize("spec", [P("data", None, "model", None),
                                  P(("data", "model"), None, None, None),
                                  P(None, None, "model", None)],
                         ids=["batch+heads", "batch-both-axes", "heads"])
@pytest.mark.parametrize("per_call_mask", [True, False],
                         ids=["segments+lengths", "causal-only"])
def test_explicitly_sharded_inputs_run_per_shard(spec, per_call_mask):
  rng = fresh_rng()
  b, t, n, k = 4, 48, 4, 2
  q, key, value = random_qkv(rng, b=b, t=t, s=t, n=n, k=k, h=32)
  cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  ids = lengths = None
  if per_call_mask:
    ids = jnp.asarray(random_segments(rng, b, t))
    lengths = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  sharding = NamedSharding(mesh, spec)
  fn = jax.jit(_loss)
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, sharding) for x in (q, key, value)]
    out, grads = fn(*args, ids, lengths, jax.device_put(cot, sharding))
    hlo = fn.lower(*args, ids, lengths,
                   jax.device_put(cot, sharding)).compile().as_text()
  want_out, want_grads = jax.jit(_loss)(q, key, value, ids, lengths, cot)
  assert rel_err(out, want_out) < 1e-5
  for g, w in zip(grads, want_grads):
    assert rel_err(g, w) < 1e-5
  for x in (out, *grads):
    assert x.sharding.is_equivalent_to(sharding, 4)
  # Attention needs nothing from other devices.
  for collective in ("all-gather", "all-reduce", "all-to-all",
                     "collective-permute"):
    assert collective not in hlo


def test_sequence_sharding_runs_the_kernel_per_block():
  """A sequence sharded over an explicit mesh axis runs context
  parallelism, every block on the kernel."""
  rng = fresh_rng()
  q, key, value = random_qkv(rng, b=2, t=64, s=64, n=2, k=2, h=32)
  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  sharding = NamedSharding(mesh, P("model", "data", None, None))
  fn = jax.jit(lambda q, k, v: jflash.dot_product_attention(
      q, k, v, is_causal=True, implementation=SMALL, interpret=True))
  with jax.set_mesh(mesh):
    out = fn(*[jax.device_put(x, sharding) for x in (q, key, value)])
  want = jflash.dot_product_attention(q, key, value, is_causal=True,
                                      implementation="xla")
  assert rel_err(out, want) < 1e-5
  assert out.sharding.is_equivalent_to(sharding, 4)


def test_auto_sharding_still_exact():
  """Under Auto sharding the kernel runs on the arrays XLA gives it."""
  rng = fresh_rng()
  q, key, value = random_qkv(rng, b=4, t=40, s=40, n=2, k=2, h=32)
  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(AxisType.Auto,) * 2)
  sharding = NamedSharding(mesh, P("data", None, "model", None))
  fn = jax.jit(lambda q, k, v: jflash.dot_product_attention(
      q, k, v, is_causal=True, implementation=SMALL, interpret=True))
  with jax.set_mesh(mesh):
    out = fn(*[jax.device_put(x, sharding) for x in (q, key, value)])
  want = fn(q, key, value)
  assert rel_err(out, want) < 1e-6
  assert np.isfinite(np.asarray(out)).all()
