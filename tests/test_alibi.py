"""ALiBi: ``-slope * |t - s|`` on each head's logits, after the soft cap.

Every backend that serves the slopes, forward, logsumexp and gradients
against the exact reference; the same penalty given as a dense bias;
positions when ``T != S`` and under context parallelism (global); decode;
the standard slopes; the edges and the errors.
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
from tests._support import (fresh_rng, lowering_for_hopper, lse_err,
                            random_normal, random_segments, rel_err)
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
    "causal_per_batch_slopes": dict(is_causal=True, per_batch=True),
}


@dataclasses.dataclass
class Problem:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  slopes: jax.Array
  kwargs: dict

  def reference(self, q, k, v, slopes=None):
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
        logits_soft_cap=call.logits_soft_cap,
        alibi_slopes=self.slopes if slopes is None else slopes)


def _problem(rng, feature: str, dtype=jnp.float32, t=40, s=56, heads=(4, 2),
             head_dim=16) -> Problem:
  batch = 2
  n, k = heads
  q = random_normal(rng, (batch, t, n, head_dim), dtype)
  key = random_normal(rng, (batch, s, k, head_dim), dtype)
  value = random_normal(rng, (batch, s, k, head_dim), dtype)
  kwargs = dict(FEATURES[feature])
  # Slopes large enough that the penalty reorders the weights within the
  # short test sequences.
  shape = (batch, n) if kwargs.pop("per_batch", False) else (n,)
  slopes = jnp.asarray(rng.uniform(0.05, 0.8, shape), jnp.float32)
  if kwargs.pop("lengths", False):
    kwargs["query_seq_lengths"] = jnp.asarray([t, t - 3], jnp.int32)
    kwargs["key_value_seq_lengths"] = jnp.asarray([s - 20, s - 7], jnp.int32)
  if kwargs.pop("segments", False):
    kwargs["segment_ids"] = (jnp.asarray(random_segments(rng, batch, t)),
                             jnp.asarray(random_segments(rng, batch, s)))
  return Problem(q, key, value, slopes, kwargs)


def _loss(fn, cotangent):
  def value(q, k, v):
    out, lse = fn(q, k, v)
    lse = jnp.where(jnp.isinf(lse), 0.0, lse)
    return jnp.sum(out * cotangent) + jnp.sum(jnp.sin(lse))
  return value


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_matches_the_reference_with_gradients(backend, feature):
  problem = _problem(fresh_rng(), feature)
  kwargs = dict(problem.kwargs, **BACKENDS[backend])
  cotangent = random_normal(fresh_rng(), problem.q.shape, jnp.float32)

  def ours(q, k, v):
    return jflash.dot_product_attention(q, k, v, alibi_slopes=problem.slopes,
                                        return_residual=True, **kwargs)

  args = (problem.q, problem.k, problem.v)
  out, lse = jax.jit(ours)(*args)
  ref_out, ref_lse = problem.reference(*args)
  assert rel_err(out, ref_out) < 1e-5
  assert lse_err(lse, ref_lse) < 1e-5
  # The penalty matters at these slopes: without it the result differs.
  assert rel_err(out, problem.reference(*args, slopes=jnp.zeros_like(
      problem.slopes))[0]) > 1e-2
  grads = jax.jit(jax.grad(_loss(ours, cotangent), argnums=(0, 1, 2)))(*args)
  want = jax.grad(_loss(problem.reference, cotangent),
                  argnums=(0, 1, 2))(*args)
  for got, ref in zip(grads, want):
    assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("t, s", [(40, 56), (56, 40), (1, 33)])
def test_equals_the_same_penalty_as_a_dense_bias(t, s):
  """Without a soft cap, ALiBi is the bias ``-slope * |t - s|`` (top-left
  aligned positions, as ``is_causal`` uses), whatever ``T`` and ``S``."""
  problem = _problem(fresh_rng(), "plain", t=t, s=s, heads=(4, 1))
  distance = np.abs(np.arange(t)[:, None] - np.arange(s)[None, :])
  bias = -np.asarray(problem.slopes)[:, None, None] * distance
  args = (problem.q, problem.k, problem.v)
  for causal in (False, True):
    got = jflash.dot_product_attention(*args, alibi_slopes=problem.slopes,
                                       is_causal=causal)
    want = jflash.dot_product_attention(*args, bias=bias[None].astype(
        np.float32), is_causal=causal, implementation="xla")
    assert rel_err(got, want) < 1e-6


def test_the_penalty_comes_after_the_soft_cap():
  """A large penalty is not capped: with slopes far beyond the cap, each
  row attends to the key at its own position."""
  rng = fresh_rng()
  q = random_normal(rng, (1, 16, 2, 8), jnp.float32)
  k = random_normal(rng, (1, 16, 2, 8), jnp.float32)
  v = random_normal(rng, (1, 16, 2, 8), jnp.float32)
  out = jflash.dot_product_attention(q, k, v, logits_soft_cap=1.0,
                                     alibi_slopes=jnp.full((2,), 50.0))
  np.testing.assert_allclose(np.asarray(out), np.asarray(v), atol=1e-6)


def test_low_precision_unbatched_vmap_and_x64():
  problem = _problem(fresh_rng(), "causal")
  args = (problem.q, problem.k, problem.v)
  kwargs = dict(alibi_slopes=problem.slopes, is_causal=True)
  low = jflash.dot_product_attention(*(x.astype(jnp.bfloat16) for x in args),
                                     **kwargs)
  assert low.dtype == jnp.bfloat16
  assert rel_err(low, problem.reference(*args)[0]) < 2e-2
  batched = jflash.dot_product_attention(*args, **kwargs)
  one = jflash.dot_product_attention(*(x[1] for x in args), **kwargs)
  assert rel_err(one, batched[1]) < 1e-6
  mapped = jax.vmap(lambda q, k, v: jflash.dot_product_attention(
      q, k, v, **kwargs))(*args)
  assert rel_err(mapped, batched) < 1e-6
  with jax.enable_x64(True):
    q, k, v = (x.astype(jnp.float64) for x in args)
    slopes = problem.slopes.astype(jnp.float64)
    out = jflash.dot_product_attention(q, k, v, alibi_slopes=slopes,
                                       is_causal=True)
    ref, _ = problem.reference(q, k, v, slopes)
    assert out.dtype == jnp.float64 and rel_err(out, ref) < 1e-12


def test_forward_mode_and_second_order():
  """jax.jvp and jax.grad of jax.grad through the xla formulation."""
  problem = _problem(fresh_rng(), "causal", t=24, s=24)
  args = (problem.q, problem.k, problem.v)

  def ours(q, k, v):
    return jflash.dot_product_attention(q, k, v, is_causal=True,
                                        alibi_slopes=problem.slopes)

  def ref(q, k, v):
    return problem.reference(q, k, v)[0]

  tangents = tuple(random_normal(fresh_rng(), x.shape, jnp.float32)
                   for x in args)
  _, got = jax.jvp(ours, args, tangents)
  _, want = jax.jvp(ref, args, tangents)
  assert rel_err(got, want) < 1e-5
  hvp = lambda fn: jax.grad(lambda q: jnp.sum(jax.grad(
      lambda q: jnp.sum(jnp.sin(fn(q, *args[1:]))))(q) ** 2))(args[0])
  assert rel_err(hvp(ours), hvp(ref)) < 1e-4


def test_standard_slopes():
  """Press et al.'s geometric slopes, and for a head count that is not a
  power of two, the next lower power's slopes then every other one of
  twice as many."""
  np.testing.assert_allclose(jflash.alibi_slopes(8),
                             2.0 ** -np.arange(1, 9), rtol=1e-7)
  twelve = jflash.alibi_slopes(12)
  np.testing.assert_allclose(twelve[:8], 2.0 ** -np.arange(1, 9), rtol=1e-7)
  np.testing.assert_allclose(twelve[8:], 2.0 ** -(np.arange(4) + 0.5),
                             rtol=1e-6)
  assert jflash.alibi_slopes(1).shape == (1,)
  with pytest.raises(ValueError, match="num_heads"):
    jflash.alibi_slopes(0)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((3,), np.float32), r"\[N\] = \(4,\) or \[B, N\] = \(1, 4\)"),
    (np.zeros((2, 4), np.float32), r"got shape \(2, 4\)"),
    (np.zeros((4,), np.int32), "floating dtype"),
    ("many", "must be an array"),
])
def test_bad_slopes_name_the_argument(bad, match):
  q = jnp.zeros((1, 8, 4, 16), jnp.float32)
  with pytest.raises(ValueError, match="alibi_slopes"):
    jflash.dot_product_attention(q, q, q, alibi_slopes=bad)
  with pytest.raises(ValueError, match=match):
    jflash.dot_product_attention(q, q, q, alibi_slopes=bad)
  with pytest.raises(ValueError, match="alibi_slopes"):
    jflash.decode_attention(q[:, :1], q, q, jnp.asarray([4]),
                            alibi_slopes=bad)


def test_no_derivative_is_taken_of_the_slopes():
  """The slopes are constants: a derivative asked of them raises rather
  than returning zeros; stop_gradient is the way to pass learned ones."""
  problem = _problem(fresh_rng(), "causal")
  args = (problem.q, problem.k, problem.v)

  def loss(slopes):
    return jflash.dot_product_attention(*args, alibi_slopes=slopes,
                                        is_causal=True).sum()
  with pytest.raises(ValueError, match="alibi_slopes are constants"):
    jax.grad(loss)(problem.slopes)
  assert jax.grad(lambda s: loss(jax.lax.stop_gradient(s)))(
      problem.slopes).shape == problem.slopes.shape


def test_kernels_decline_by_name_and_the_default_serves():
  """Traced for a Hopper GPU, cuDNN and the Mosaic GPU kernels decline
  the slopes by name, and the default passes to a backend that serves
  them; on every platform the default serves them."""
  q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)
  slopes = jflash.alibi_slopes(4)
  with lowering_for_hopper():
    for name in ("cudnn", "mosaic_gpu"):
      with pytest.raises(NotImplementedError, match=f"{name}: alibi_slopes"):
        jflash.selected_implementation(q, q, q, alibi_slopes=slopes,
                                       implementation=name)
  for platform in ("cpu", "cuda", "tpu"):
    assert jflash.selected_implementation(
        q, q, q, alibi_slopes=slopes, is_causal=True,
        platform=platform) in ("xla", "mosaic_tpu")


# ------------------------------------------------------ context parallel
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_context_parallel_uses_global_positions(strategy, layout):
  """A sequence sharded over 4 devices: every shard's penalty is taken at
  the global positions; forward and gradients equal the unsharded call."""
  rng = fresh_rng()
  mesh = jax.make_mesh((4,), ("c",), axis_types=(AxisType.Explicit,))
  q = random_normal(rng, (2, 64, 4, 16), jnp.float32)
  k = random_normal(rng, (2, 64, 2, 16), jnp.float32)
  v = random_normal(rng, (2, 64, 2, 16), jnp.float32)
  slopes = jnp.asarray(rng.uniform(0.05, 0.5, (2, 4)), jnp.float32)
  parallel = jflash.ContextParallel(strategy=strategy, layout=layout)

  def loss(q, k, v, **extra):
    return jnp.sum(jnp.cos(jflash.dot_product_attention(
        q, k, v, is_causal=True, alibi_slopes=slopes, **extra)))

  want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  arrays = (q, k, v)
  if layout == "zigzag":
    arrays = tuple(jflash.load_balance(x, 4) for x in arrays)
  sharding = NamedSharding(mesh, P(None, "c"))
  sharded = [jax.device_put(x, sharding) for x in arrays]
  value, grads = jax.jit(jax.value_and_grad(
      lambda q, k, v: loss(q, k, v, context_parallel=parallel),
      argnums=(0, 1, 2)))(*sharded)
  if layout == "zigzag":
    grads = tuple(jflash.restore_order(g, 4) for g in grads)
  assert rel_err(value, want[0]) < 1e-6
  for g, w in zip(grads, want[1]):
    assert rel_err(g, w) < 1e-5


def test_sharded_over_batch_and_heads():
  """Slopes per batch row and head follow the inputs' batch and head
  sharding."""
  rng = fresh_rng()
  mesh = jax.make_mesh((2, 2, 2), ("b", "c", "h"),
                       axis_types=(AxisType.Explicit,) * 3)
  q = random_normal(rng, (2, 32, 4, 16), jnp.float32)
  slopes = jnp.asarray(rng.uniform(0.05, 0.5, (2, 4)), jnp.float32)
  want = jflash.dot_product_attention(q, q, q, is_causal=True,
                                      alibi_slopes=slopes)
  sharded = jax.device_put(q, NamedSharding(mesh, P("b", "c", "h")))
  got = jax.jit(lambda x: jflash.dot_product_attention(
      x, x, x, is_causal=True, alibi_slopes=slopes))(sharded)
  assert rel_err(got, want) < 1e-6


# ---------------------------------------------------------------- decode
@pytest.mark.parametrize("kind", ["xla", "mosaic_tpu"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("per_batch", [False, True])
def test_decode_with_alibi(kind, paged, per_batch):
  """The new token at position ``p`` is penalized ``slope * (p - s)`` for
  slot ``s``; against the reference on the same visibility."""
  rng = fresh_rng()
  problem = make_problem(rng, num_new=3, heads=(4, 2), window=(9, 0),
                         page_size=8 if paged else None)
  batch, num_new = problem.query.shape[:2]
  slopes = jnp.asarray(rng.uniform(0.05, 0.5, (batch, 4) if per_batch
                                   else (4,)), jnp.float32)
  args = ((problem.query, problem.key_pages, problem.value_pages,
           problem.lengths) if paged else
          (problem.query, problem.key, problem.value, problem.lengths))
  out, lse = jflash.decode_attention(
      *args, block_table=problem.table if paged else None,
      local_window_size=problem.window, alibi_slopes=slopes,
      return_residual=True, interpret=kind != "xla",
      implementation=("xla" if kind == "xla"
                      else jflash.backends.MosaicTpuDecodeBackend()))
  # The reference's query t at position lengths - T + t, as a dense bias.
  positions = np.asarray(problem.lengths)[:, None] - num_new + np.arange(
      num_new)
  distance = np.abs(positions[:, :, None]
                    - np.arange(problem.key.shape[1])[None, None, :])
  bias = -np.asarray(slopes).reshape(-1, 4)[:, :, None, None] * distance[
      :, None]
  mask = jflash.masks.AttentionMask(
      batch=batch, q_len=num_new, kv_len=problem.key.shape[1],
      dense=jnp.asarray(problem.visibility))
  ref_out, ref_lse = reference.reference_attention(
      problem.query, problem.key, problem.value,
      jnp.asarray(bias, jnp.float32), mask,
      scale=1 / np.sqrt(problem.query.shape[-1]))
  assert rel_err(out, ref_out) < 1e-5
  assert lse_err(lse, ref_lse) < 1e-5


def test_the_hopper_decode_kernel_declines_by_name():
  q = jax.ShapeDtypeStruct((2, 1, 8, 128), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  with lowering_for_hopper():
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
      jax.eval_shape(lambda q, k, v, n: jflash.decode_attention(
          q, k, v, n, alibi_slopes=jflash.alibi_slopes(8),
          implementation="mosaic_gpu"), q, cache, cache, lengths)


def test_flax_attention_fn_takes_slopes_and_mask_functions():
  """jflash.flax.attention_fn passes ALiBi slopes (``[N]`` or one row per
  leading batch index) and a mask function through, leading batch dims
  flattened as for every other argument."""
  from jflash.flax import attention_fn  # pylint: disable=import-outside-toplevel
  rng = fresh_rng()
  q = random_normal(rng, (2, 3, 20, 4, 8), jnp.float32)
  slopes = jnp.asarray(rng.uniform(0.05, 0.5, (2, 3, 4)), jnp.float32)
  fn = jflash.masks.PrefixLM(5)
  got = attention_fn(q, q, q, alibi_slopes=slopes, mask_fn=fn)
  flat = q.reshape(6, 20, 4, 8)
  want = jflash.dot_product_attention(flat, flat, flat, mask_fn=fn,
                                      alibi_slopes=slopes.reshape(6, 4))
  assert rel_err(got.reshape(6, 20, 4, 8), want) < 1e-6
  one = attention_fn(q, q, q, alibi_slopes=slopes[0, 0])
  assert rel_err(one[0, 0], jflash.dot_product_attention(
      q[0, 0], q[0, 0], q[0, 0], alibi_slopes=slopes[0, 0])) < 1e-6
  with pytest.raises(ValueError, match="alibi_slopes"):
    attention_fn(q, q, q, alibi_slopes=slopes[0])
