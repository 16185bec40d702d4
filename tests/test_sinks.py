"""Attention sinks: one logit per head in every row's softmax denominator.

Every backend that serves them, forward, logsumexp and gradients (the
sinks' included) against the exact reference, which gives each row one
more, always visible, column whose value is zero; decode; context
parallelism (counted once per row); the edges and the errors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from jflash import reference
from jflash.backends import MosaicTpuBackend, MosaicTpuConfig
from tests._support import (fresh_rng, lse_err, random_normal,
                            random_segments, rel_err)
from tests.test_decode import make_problem

BACKENDS = {
    "xla": dict(implementation="xla"),
    "mosaic_tpu": dict(implementation=MosaicTpuBackend(
        MosaicTpuConfig(block_q=16, block_kv=32)), interpret=True),
}
FEATURES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window_lengths": dict(local_window_size=(5, 2), lengths=True),
    "segments_softcap": dict(segments=True, logits_soft_cap=3.0),
}


@dataclasses.dataclass
class Problem:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  sinks: jax.Array
  kwargs: dict

  def reference(self, q, k, v, sinks):
    call, _ = jflash.attention._canonicalize(
        q, k, v, None, None, scale=None,
        is_causal=self.kwargs.get("is_causal", False),
        query_seq_lengths=self.kwargs.get("query_seq_lengths"),
        key_value_seq_lengths=self.kwargs.get("key_value_seq_lengths"),
        local_window_size=self.kwargs.get("local_window_size"),
        segment_ids=self.kwargs.get("segment_ids"),
        logits_soft_cap=self.kwargs.get("logits_soft_cap"))
    return reference.reference_attention(
        call.query, call.key, call.value, None, call.mask, scale=call.scale,
        logits_soft_cap=call.logits_soft_cap, attention_sinks=sinks)


def _problem(rng, feature: str, dtype=jnp.float32, t=40, s=56, heads=(4, 2),
             head_dim=16) -> Problem:
  batch = 2
  n, k = heads
  q = random_normal(rng, (batch, t, n, head_dim), dtype)
  key = random_normal(rng, (batch, s, k, head_dim), dtype)
  value = random_normal(rng, (batch, s, k, head_dim), dtype)
  # Sinks around the logits' own scale, so that they take a visible share.
  sinks = jnp.asarray(rng.normal(1.0, 1.5, n), jnp.float32)
  kwargs = dict(FEATURES[feature])
  if kwargs.pop("lengths", False):
    # Row 0 sees no key at all: its weight goes to the sink alone.
    kwargs["query_seq_lengths"] = jnp.asarray([t, t - 3], jnp.int32)
    kwargs["key_value_seq_lengths"] = jnp.asarray([0, s - 7], jnp.int32)
  if kwargs.pop("segments", False):
    kwargs["segment_ids"] = (jnp.asarray(random_segments(rng, batch, t)),
                             jnp.asarray(random_segments(rng, batch, s)))
  return Problem(q, key, value, sinks, kwargs)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_matches_the_reference_with_gradients(backend, feature):
  problem = _problem(fresh_rng(), feature)
  kwargs = dict(problem.kwargs, **BACKENDS[backend])
  cotangent = random_normal(fresh_rng(), problem.q.shape, jnp.float32)

  def ours(q, k, v, sinks):
    return jflash.dot_product_attention(q, k, v, attention_sinks=sinks,
                                        return_residual=True, **kwargs)

  def loss(fn):
    def value(q, k, v, sinks):
      out, lse = fn(q, k, v, sinks)
      lse = jnp.where(jnp.isinf(lse), 0.0, lse)
      return jnp.sum(out * cotangent) + jnp.sum(jnp.sin(lse))
    return value

  args = (problem.q, problem.k, problem.v, problem.sinks)
  out, lse = jax.jit(ours)(*args)
  ref_out, ref_lse = problem.reference(*args)
  assert rel_err(out, ref_out) < 1e-5
  assert lse_err(lse, ref_lse) < 1e-5
  assert not np.isnan(np.asarray(out)).any()
  grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(*args)
  want = jax.grad(loss(problem.reference), argnums=(0, 1, 2, 3))(*args)
  for got, ref in zip(grads, want):
    assert rel_err(got, ref) < 1e-4


def test_a_row_that_sees_no_key_puts_its_weight_on_the_sink():
  problem = _problem(fresh_rng(), "window_lengths")
  out, lse = jflash.dot_product_attention(
      problem.q, problem.k, problem.v, attention_sinks=problem.sinks,
      return_residual=True, **problem.kwargs)
  # Batch row 0 has no keys: zeros, and the logsumexp of the sink alone.
  assert np.all(np.asarray(out[0]) == 0)
  np.testing.assert_allclose(np.asarray(lse[0]), np.broadcast_to(
      np.asarray(problem.sinks), lse[0].shape), rtol=1e-6)


def test_minus_infinite_sinks_are_no_sinks():
  """A sink of -inf takes no weight: the call without sinks, and no NaN
  where a row sees no key either."""
  problem = _problem(fresh_rng(), "window_lengths")
  none = jnp.full_like(problem.sinks, -jnp.inf)
  args = (problem.q, problem.k, problem.v)
  got = jflash.dot_product_attention(*args, attention_sinks=none,
                                     return_residual=True, **problem.kwargs)
  want = jflash.dot_product_attention(*args, return_residual=True,
                                      **problem.kwargs)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  grads = jax.grad(lambda s: jflash.dot_product_attention(
      *args, attention_sinks=s, **problem.kwargs).sum())(none)
  assert not np.isnan(np.asarray(grads)).any()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_within_the_same_dtype_error(dtype):
  rng = fresh_rng()
  problem = _problem(rng, "causal", dtype=dtype)
  out = jflash.dot_product_attention(problem.q, problem.k, problem.v,
                                     attention_sinks=problem.sinks,
                                     is_causal=True)
  assert out.dtype == dtype
  ref_out, _ = problem.reference(problem.q, problem.k, problem.v,
                                 problem.sinks)
  assert rel_err(out, ref_out) < 2e-2


def test_unbatched_vmap_and_x64():
  problem = _problem(fresh_rng(), "causal")
  args = (problem.q, problem.k, problem.v)
  batched = jflash.dot_product_attention(*args, attention_sinks=problem.sinks,
                                         is_causal=True)
  one = jflash.dot_product_attention(*(x[1] for x in args),
                                     attention_sinks=problem.sinks,
                                     is_causal=True)
  assert rel_err(one, batched[1]) < 1e-6
  mapped = jax.vmap(lambda q, k, v: jflash.dot_product_attention(
      q, k, v, attention_sinks=problem.sinks, is_causal=True))(*args)
  assert rel_err(mapped, batched) < 1e-6
  with jax.enable_x64(True):
    q, k, v = (x.astype(jnp.float64) for x in args)
    sinks = problem.sinks.astype(jnp.float64)
    out = jflash.dot_product_attention(q, k, v, attention_sinks=sinks,
                                       is_causal=True)
    ref, _ = problem.reference(q, k, v, sinks)
    assert out.dtype == jnp.float64 and rel_err(out, ref) < 1e-12


def test_the_default_on_every_platform_serves_sinks():
  """Sinks need a differentiable logsumexp, so jax.nn's cuDNN path (whose
  logsumexp has no gradient) declines them; the other backends serve."""
  q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)
  sinks = jnp.zeros((4,), jnp.float32)
  for platform in ("cpu", "tpu"):
    name = jflash.selected_implementation(q, q, q, attention_sinks=sinks,
                                          is_causal=True, platform=platform)
    assert name == jflash.default_order(platform)[0]
  with pytest.raises(NotImplementedError, match="cudnn"):
    jflash.dot_product_attention(
        jnp.zeros((1, 8, 4, 64), jnp.bfloat16),
        jnp.zeros((1, 8, 4, 64), jnp.bfloat16),
        jnp.zeros((1, 8, 4, 64), jnp.bfloat16), attention_sinks=sinks,
        implementation="cudnn")


@pytest.mark.parametrize("bad, match", [
    (np.zeros((3,), np.float32), r"\[N\] = \(4,\).*got shape \(3,\)"),
    (np.zeros((2, 4), np.float32), r"\[N\] = \(4,\)"),
    (np.zeros((4,), np.int32), "floating dtype"),
    ("many", "must be an array"),
])
def test_bad_sinks_name_the_argument(bad, match):
  q = jnp.zeros((1, 8, 4, 16), jnp.float32)
  with pytest.raises(ValueError, match="attention_sinks"):
    jflash.dot_product_attention(q, q, q, attention_sinks=bad)
  with pytest.raises(ValueError, match=match):
    jflash.dot_product_attention(q, q, q, attention_sinks=bad)
  with pytest.raises(ValueError, match="attention_sinks"):
    jflash.decode_attention(q[:, :1], q, q, jnp.asarray([4]),
                            attention_sinks=bad)


# ------------------------------------------------------ context parallel
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_counts_each_sink_once(strategy):
  """A sequence sharded over 4 devices: the sink joins each row's
  denominator once (after the shards' merge), forward and gradients equal
  to the unsharded call."""
  rng = fresh_rng()
  mesh = jax.make_mesh((4,), ("c",), axis_types=(AxisType.Explicit,))
  q = random_normal(rng, (2, 64, 4, 16), jnp.float32)
  k = random_normal(rng, (2, 64, 2, 16), jnp.float32)
  v = random_normal(rng, (2, 64, 2, 16), jnp.float32)
  sinks = jnp.asarray(rng.normal(1.0, 1.5, 4), jnp.float32)
  parallel = jflash.ContextParallel(strategy=strategy)

  def loss(q, k, v, sinks, **extra):
    return jnp.sum(jnp.cos(jflash.dot_product_attention(
        q, k, v, is_causal=True, attention_sinks=sinks, **extra)))

  sharding = NamedSharding(mesh, P(None, "c"))
  sharded = [jax.device_put(x, sharding) for x in (q, k, v)]
  got = jax.jit(jax.value_and_grad(
      lambda q, k, v, s: loss(q, k, v, s, context_parallel=parallel),
      argnums=(0, 1, 2, 3)))(*sharded, sinks)
  want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
  assert rel_err(got[0], want[0]) < 1e-6
  for g, w in zip(got[1], want[1]):
    assert rel_err(g, w) < 1e-5


# ---------------------------------------------------------------- decode
@pytest.mark.parametrize("kind", ["xla", "mosaic_tpu"])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_with_sinks(kind, paged):
  rng = fresh_rng()
  problem = make_problem(rng, num_new=3, heads=(4, 2), window=(9, 0),
                         page_size=8 if paged else None)
  sinks = jnp.asarray(rng.normal(1.0, 1.5, 4), jnp.float32)
  implementation = "xla" if kind == "xla" else jflash.backends.MosaicTpuDecodeBackend()
  args = ((problem.query, problem.key_pages, problem.value_pages,
           problem.lengths) if paged else
          (problem.query, problem.key, problem.value, problem.lengths))
  out, lse = jflash.decode_attention(
      *args, block_table=problem.table if paged else None,
      local_window_size=problem.window, attention_sinks=sinks,
      implementation=implementation, return_residual=True,
      interpret=kind != "xla")
  mask = jflash.masks.AttentionMask(
      batch=problem.query.shape[0], q_len=problem.query.shape[1],
      kv_len=problem.key.shape[1], dense=jnp.asarray(problem.visibility))
  ref_out, ref_lse = reference.reference_attention(
      problem.query, problem.key, problem.value, None, mask,
      scale=1 / np.sqrt(problem.query.shape[-1]), attention_sinks=sinks)
  assert rel_err(out, ref_out) < 1e-5
  assert lse_err(lse, ref_lse) < 1e-5


# ------------------------------------------------------------------- Flax
def test_linen_module_sinks_parameter():
  """attention_sinks=True creates ``sinks [N]`` (zeros): learned (it gets a
  gradient), at -inf the module without sinks, and very large it takes all
  the weight (the attention output is zero, the output projection's bias
  remains); decoding step by step equals the whole sequence."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from jflash.flax import linen  # pylint: disable=import-outside-toplevel
  rng = fresh_rng()
  x = random_normal(rng, (2, 12, 16), jnp.float32)
  module = linen.MultiHeadAttention(num_heads=4, qkv_features=16,
                                    attention_sinks=True,
                                    bias_init=nn.initializers.normal(1.0))
  plain = linen.MultiHeadAttention(num_heads=4, qkv_features=16,
                                   bias_init=nn.initializers.normal(1.0))
  params = module.init(jax.random.key(0), x)["params"]
  assert params["sinks"].shape == (4,)
  assert np.all(np.asarray(params["sinks"]) == 0)
  params = dict(params, sinks=jnp.asarray(rng.normal(1.0, 1.0, 4),
                                          jnp.float32))

  def loss(p):
    return jnp.sum(module.apply({"params": p}, x, is_causal=True) ** 2)
  assert np.all(np.asarray(jax.grad(loss)(params)["sinks"]) != 0)
  no_sinks = {k: v for k, v in params.items() if k != "sinks"}
  np.testing.assert_allclose(
      np.asarray(module.apply({"params": dict(params, sinks=jnp.full(
          (4,), -jnp.inf))}, x, is_causal=True)),
      np.asarray(plain.apply({"params": no_sinks}, x, is_causal=True)),
      rtol=1e-6, atol=1e-6)
  saturated = module.apply({"params": dict(params, sinks=jnp.full(
      (4,), 1e4))}, x, is_causal=True)
  np.testing.assert_allclose(
      np.asarray(saturated), np.broadcast_to(np.asarray(
          params["out"]["bias"]), saturated.shape), rtol=1e-5, atol=1e-5)

  decoder = linen.MultiHeadAttention(num_heads=4, qkv_features=16,
                                     attention_sinks=True, decode=True)
  cache = decoder.init(jax.random.key(0), x)["cache"]
  steps = []
  for t in range(x.shape[1]):
    y, updated = decoder.apply({"params": params, "cache": cache},
                               x[:, t:t + 1], mutable=["cache"])
    cache = updated["cache"]
    steps.append(y)
  whole = module.apply({"params": params}, x, is_causal=True)
  assert rel_err(jnp.concatenate(steps, axis=1), whole) < 1e-5


def test_nnx_module_sinks_parameter():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jflash.flax import nnx as jnnx  # pylint: disable=import-outside-toplevel
  rng = fresh_rng()
  x = random_normal(rng, (2, 10, 16), jnp.float32)
  module = jnnx.MultiHeadAttention(4, 16, attention_sinks=True,
                                   rngs=nnx.Rngs(0), decode=False)
  assert module.sinks[...].shape == (4,)
  module.sinks[...] = jnp.asarray(rng.normal(1.0, 1.0, 4), jnp.float32)
  grads = nnx.grad(lambda m: jnp.sum(m(x, is_causal=True) ** 2))(module)
  assert np.all(np.asarray(grads.sinks[...]) != 0)
  out = module(x, is_causal=True)
  module.sinks[...] = jnp.full((4,), -jnp.inf)
  without = jnnx.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0), decode=False)
  assert rel_err(module(x, is_causal=True), without(x, is_causal=True)) < 1e-6
  assert rel_err(out, without(x, is_causal=True)) > 1e-3


def test_hopper_kernels_lower_with_sinks():
  """Traced for a Hopper GPU, a call with sinks runs the Mosaic GPU
  kernels (forward and backward), not cuDNN or xla."""
  from tests._support import lowering_for_hopper  # pylint: disable=import-outside-toplevel
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  sinks = jax.ShapeDtypeStruct((4,), jnp.float32)

  def grad(q, k, v, s):
    return jax.grad(lambda *a: jflash.dot_product_attention(
        *a[:3], is_causal=True, attention_sinks=a[3]).astype(
            jnp.float32).sum(), argnums=(0, 1, 2, 3))(q, k, v, s)

  with lowering_for_hopper():
    text = jax.jit(grad).trace(q, q, q, sinks).lower(
        lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") >= 2
