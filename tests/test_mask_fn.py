"""Mask functions: visibility as a function of positions, with the tiles
it hides skipped.

Every ready-made pattern and a user's own function, on every backend that
serves them, against the same visibility given as a dense boolean mask
(built here with NumPy from an independent statement of each pattern);
tile classes against the dense mask's; the schedule built while tracing;
context parallelism at global positions; decode; the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from jflash import masks, tiles
from jflash.backends import MosaicTpuBackend, MosaicTpuConfig
from jflash.backends.mosaic_tpu import common as tpu_common
from tests._support import (fresh_rng, lowering_for_hopper, lse_err,
                            random_normal, random_segments, rel_err)
from tests.test_decode import make_problem

BACKENDS = {
    "xla": dict(implementation="xla"),
    "mosaic_tpu": dict(implementation=MosaicTpuBackend(
        MosaicTpuConfig(block_q=16, block_kv=32)), interpret=True),
}


def _even_positions(q, k):
  """A user's own function: keys at even positions, and the query's own."""
  return (k % 2 == 0) | (k == q)


# name -> (mask function, the same pattern in NumPy on [T, 1] x [1, S])
PATTERNS = {
    "prefix_lm": (masks.PrefixLM(13),
                  lambda t, s: (s < 13) | (s <= t)),
    "chunked_causal": (masks.ChunkedCausal(16),
                       lambda t, s: (t // 16 == s // 16) & (s <= t)),
    "global_window": (masks.GlobalAndWindow(3, 6, 2),
                      lambda t, s: (t < 3) | (s < 3) | (np.abs(t - s) <= 6)
                      & (s - t <= 2)),
    "dilated": (masks.Dilated(4, 3),
                lambda t, s: (t >= s) & (t - s < 12) & ((t - s) % 3 == 0)),
    "user": (_even_positions, lambda t, s: (s % 2 == 0) | (s == t)),
}


def _dense(pattern: str, t: int, s: int) -> np.ndarray:
  return PATTERNS[pattern][1](np.arange(t)[:, None], np.arange(s)[None, :])


def _loss(fn, cotangent):
  def value(q, k, v):
    out, lse = fn(q, k, v)
    lse = jnp.where(jnp.isinf(lse), 0.0, lse)
    return jnp.sum(out * cotangent) + jnp.sum(jnp.sin(lse))
  return value


# Every pattern on its own; the mixes with lengths and segments on two
# patterns (the mixing is the same code for every function), to keep the
# interpret-mode time of the suite small.
_SHAPES = {"self": (70, 70, {}),
           "cross-lengths": (45, 83, {"lengths": True}),
           "segments-cap": (64, 64, {"segments": True,
                                     "logits_soft_cap": 4.0})}
_CASES = ([(p, "self") for p in sorted(PATTERNS)]
          + [(p, m) for p in ("chunked_causal", "user")
             for m in ("cross-lengths", "segments-cap")])


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("pattern, shape", _CASES,
                         ids=[f"{p}-{m}" for p, m in _CASES])
def test_matches_the_same_dense_mask_with_gradients(backend, pattern, shape):
  t, s, extra = _SHAPES[shape]
  rng = fresh_rng()
  q = random_normal(rng, (2, t, 4, 16), jnp.float32)
  k = random_normal(rng, (2, s, 2, 16), jnp.float32)
  v = random_normal(rng, (2, s, 2, 16), jnp.float32)
  kwargs = dict(extra)
  if kwargs.pop("lengths", False):
    kwargs["query_seq_lengths"] = jnp.asarray([t, t - 9], jnp.int32)
    kwargs["key_value_seq_lengths"] = jnp.asarray([s - 30, s], jnp.int32)
  if kwargs.pop("segments", False):
    kwargs["segment_ids"] = jnp.asarray(random_segments(rng, 2, t))
  cotangent = random_normal(fresh_rng(), q.shape, jnp.float32)

  def ours(q, k, v):
    return jflash.dot_product_attention(
        q, k, v, mask_fn=PATTERNS[pattern][0], return_residual=True,
        **kwargs, **BACKENDS[backend])

  def dense(q, k, v):
    return jflash.dot_product_attention(
        q, k, v, mask=_dense(pattern, t, s), return_residual=True,
        implementation="xla", **kwargs)

  args = (q, k, v)
  (out, lse), (want_out, want_lse) = jax.jit(ours)(*args), dense(*args)
  assert rel_err(out, want_out) < 1e-5
  assert lse_err(lse, want_lse) < 1e-5
  grads = jax.jit(jax.grad(_loss(ours, cotangent), argnums=(0, 1, 2)))(*args)
  want = jax.grad(_loss(dense, cotangent), argnums=(0, 1, 2))(*args)
  for got, ref in zip(grads, want):
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 64)])
def test_tile_classes_equal_the_dense_masks(pattern, blocks):
  """Alone, a mask function's tiles are classified exactly: empty, full and
  partial as the same visibility given densely."""
  t, s = 200, 160
  by_fn = masks.AttentionMask(batch=1, q_len=t, kv_len=s,
                              mask_fn=PATTERNS[pattern][0])
  by_dense = masks.AttentionMask(batch=1, q_len=t, kv_len=s,
                                 dense=jnp.asarray(_dense(pattern, t, s))[None, None])
  np.testing.assert_array_equal(
      np.asarray(tiles.tile_classes(by_fn, *blocks)),
      np.asarray(tiles.tile_classes(by_dense, *blocks)))


def test_a_sparse_pattern_visits_few_tiles_and_is_built_while_tracing():
  """A dilated window over 8192 positions visits under a tenth of the
  tiles;
  the TPU kernels' schedule is a constant of the traced program (no
  per-call work), and the xla backend's loops run over the visited tiles
  only."""
  mask = masks.AttentionMask(batch=1, q_len=8192, kv_len=8192,
                             mask_fn=masks.Dilated(64, 8))
  sched = tiles.tile_schedule(mask, 128, 128)
  visited = int(sched.visited_tiles)
  assert visited / 64**2 < 0.1
  plan = MosaicTpuBackend(MosaicTpuConfig(block_q=128, block_kv=128)).plan(
      jflash.attention._canonicalize(
          jnp.zeros((1, 8192, 1, 128)), jnp.zeros((1, 8192, 1, 128)),
          jnp.zeros((1, 8192, 1, 128)), None, None, scale=None,
          is_causal=False, query_seq_lengths=None,
          key_value_seq_lengths=None, local_window_size=None,
          segment_ids=None, logits_soft_cap=None, mask_fn=mask.mask_fn,
          interpret=True)[0])
  traced = jax.make_jaxpr(lambda: tpu_common.metadata(mask, plan))()
  assert not traced.eqns  # constants only
  assert int(traced.consts[1].sum()) == visited


def test_rows_that_see_no_key_are_zero():
  rng = fresh_rng()
  q = random_normal(rng, (1, 40, 2, 8), jnp.float32)
  none_before_20 = lambda t, s: (t >= 20) & (s <= t)  # noqa: E731
  out, lse = jflash.dot_product_attention(q, q, q, mask_fn=none_before_20,
                                          return_residual=True)
  assert np.all(np.asarray(out[0, :20]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[0, :20])))
  grads = jax.grad(lambda x: jflash.dot_product_attention(
      x, x, x, mask_fn=none_before_20).sum())(q)
  assert not np.isnan(np.asarray(grads)).any()


def test_x64_and_vmap():
  rng = fresh_rng()
  fn = masks.ChunkedCausal(8)
  with jax.enable_x64(True):
    q = random_normal(rng, (2, 30, 2, 8), jnp.float32).astype(jnp.float64)
    got = jflash.dot_product_attention(q, q, q, mask_fn=fn)
    dense = (np.arange(30)[:, None] // 8 == np.arange(30)[None, :] // 8) & (
        np.arange(30)[None, :] <= np.arange(30)[:, None])
    want = jflash.dot_product_attention(q, q, q, mask=dense)
    assert got.dtype == jnp.float64 and rel_err(got, want) < 1e-12
  q = random_normal(rng, (2, 30, 2, 8), jnp.float32)
  mapped = jax.vmap(lambda x: jflash.dot_product_attention(
      x, x, x, mask_fn=fn))(q)
  assert rel_err(mapped, jflash.dot_product_attention(q, q, q,
                                                      mask_fn=fn)) < 1e-6


@pytest.mark.parametrize("bad, match", [
    (3, "must be a callable"),
    (lambda q, k: q - k, "bool array"),
    (lambda q, k: jnp.ones((5,), bool), "bool array"),
    (lambda q: q > 0, "failed on int32 positions"),
])
def test_bad_mask_functions_name_the_argument(bad, match):
  q = jnp.zeros((1, 8, 2, 8), jnp.float32)
  with pytest.raises(ValueError, match="mask_fn") as err:
    jflash.dot_product_attention(q, q, q, mask_fn=bad)
  assert err.match(match)
  with pytest.raises(ValueError, match="mask_fn"):
    jflash.decode_attention(q[:, :1], q, q, jnp.asarray([4]), mask_fn=bad)


def test_kernels_without_it_decline_by_name():
  q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)
  fn = masks.PrefixLM(10)
  with lowering_for_hopper():
    for name in ("cudnn", "mosaic_gpu"):
      with pytest.raises(NotImplementedError, match=f"{name}: mask_fn"):
        jflash.selected_implementation(q, q, q, mask_fn=fn,
                                       implementation=name)
    assert jflash.selected_implementation(q, q, q, mask_fn=fn) == "xla"
  assert jflash.selected_implementation(q, q, q, mask_fn=fn,
                                        platform="tpu") == "mosaic_tpu"


# ------------------------------------------------------ context parallel
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_context_parallel_uses_global_positions(strategy, layout):
  rng = fresh_rng()
  mesh = jax.make_mesh((4,), ("c",), axis_types=(AxisType.Explicit,))
  q = random_normal(rng, (2, 64, 4, 16), jnp.float32)
  k = random_normal(rng, (2, 64, 2, 16), jnp.float32)
  v = random_normal(rng, (2, 64, 2, 16), jnp.float32)
  fn = masks.GlobalAndWindow(5, 9, 0)
  parallel = jflash.ContextParallel(strategy=strategy, layout=layout)

  def loss(q, k, v, **extra):
    return jnp.sum(jnp.cos(jflash.dot_product_attention(
        q, k, v, mask_fn=fn, **extra)))

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


# ---------------------------------------------------------------- decode
@pytest.mark.parametrize("kind", ["xla", "mosaic_tpu"])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_with_a_mask_function(kind, paged):
  """The new token at position ``p`` sees slot ``s`` where the function
  says so, on top of causality and the window."""
  rng = fresh_rng()
  problem = make_problem(rng, num_new=3, heads=(4, 2), window=(20, 0),
                         page_size=8 if paged else None)
  fn = masks.ChunkedCausal(8)
  args = ((problem.query, problem.key_pages, problem.value_pages,
           problem.lengths) if paged else
          (problem.query, problem.key, problem.value, problem.lengths))
  out, lse = jflash.decode_attention(
      *args, block_table=problem.table if paged else None,
      local_window_size=problem.window, mask_fn=fn, return_residual=True,
      interpret=kind != "xla",
      implementation=("xla" if kind == "xla"
                      else jflash.backends.MosaicTpuDecodeBackend()))
  batch, num_new = problem.query.shape[:2]
  positions = np.asarray(problem.lengths)[:, None] - num_new + np.arange(
      num_new)
  slots = np.arange(problem.key.shape[1])
  same_chunk = positions[:, :, None] // 8 == slots[None, None, :] // 8
  dense = np.asarray(problem.visibility) & same_chunk[:, None]
  want_out, want_lse = jflash.dot_product_attention(
      problem.query, problem.key, problem.value, mask=dense,
      implementation="xla", return_residual=True)
  assert rel_err(out, want_out) < 1e-5
  assert lse_err(lse, want_lse.astype(jnp.float32)) < 1e-5
