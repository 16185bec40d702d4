"""GPU runs of the conformance suite (marked ``gpu``; skipped elsewhere).

Run on a CUDA machine with ``pytest -m gpu``.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from tests import conformance
from tests._support import (Case, grads_of, lse_err, next_seed, random_normal,
                            rel_err)

pytestmark = pytest.mark.gpu


class TestCudnnGpu(conformance.AttentionConformance):
  """``jax.nn``'s cuDNN path behind jflash's contract: what it cannot do
  exactly, it declines."""

  implementation = "cudnn"
  dtypes = (jnp.bfloat16, jnp.float16)
  supports_segments = False
  supports_soft_cap = False
  supports_dense_mask = False
  supports_noncausal_window = False
  supports_residual = False
  feature_len = 96

  def supported(self, case, dtype):
    # cuDNN needs a bias of the full [T, S] extent; jax.nn rejects others.
    t, s = case.query.shape[-3], case.key.shape[-3]
    full_bias = case.bias is None or case.bias.shape[-2:] == (t, s)
    # cuDNN returns NaN for a scale <= 0, so the backend declines it.
    positive_scale = case.kwargs.get("scale", 1.0) > 0
    return super().supported(case, dtype) and full_bias and positive_scale

  def may_decline(self, case):
    # Under differentiation cuDNN declines some odd sequence lengths
    # (jax.nn raises "Unsupported sequence length"); served ones must be
    # exact.
    return case.query.shape[-3] % 2 == 1 or case.key.shape[-3] % 2 == 1


class TestMosaicGpu(conformance.AttentionConformance):
  """The Hopper kernels: every visibility rule, soft cap, GQA, odd lengths
  and head dims, in bfloat16 and float16."""

  implementation = "mosaic_gpu"
  dtypes = (jnp.bfloat16, jnp.float16)
  supports_bias = False
  supports_dense_mask = False
  # Not a multiple of any block size, and several tiles of 64 and 128.
  feature_len = 301


class TestMosaicGpuFusedBackward(TestMosaicGpu):
  """The one-pass backward (``MosaicGpuConfig(fuse_dq=True)``): dQ added
  into a float32 accumulator in a fixed order from the dK/dV loop.  It
  serves head dims up to 128 and rejects 256 by name."""

  head_dims = (32, 64, 80, 128)

  @property
  def implementation(self):
    from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
    return MosaicGpuBackend(MosaicGpuConfig(fuse_dq=True))

  def check_case(self, case, dtype, seed):
    if case.query.shape[-1] > 128:
      with pytest.raises(ValueError, match="fuse_dq"):
        case.call_jflash(*case.arrays, **self.backend_kwargs)
      return
    super().check_case(case, dtype, seed)


class TestMosaicGpuVariantForwardLoop(TestMosaicGpu):
  """The forward's other loop at every head dim
  (``MosaicGpuConfig(qk_after_pv=True)``, the default at head dim 128
  only): each step's next ``Q K^T`` issued right behind its ``P V``."""

  @property
  def implementation(self):
    from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
    return MosaicGpuBackend(MosaicGpuConfig(qk_after_pv=True))


class TestMosaicGpuOverlappedBackward(TestMosaicGpu):
  """The backward with ``MosaicGpuConfig(overlap_sdp=True)``: each step's
  ``S`` and ``dP`` products issued together.  It serves head dims up to
  128 and rejects 256 by name."""

  head_dims = (32, 64, 80, 128)

  @property
  def implementation(self):
    from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
    return MosaicGpuBackend(MosaicGpuConfig(overlap_sdp=True))

  def check_case(self, case, dtype, seed):
    if case.query.shape[-1] > 128:
      with pytest.raises(ValueError, match="overlap_sdp"):
        case.call_jflash(*case.arrays, **self.backend_kwargs)
      return
    super().check_case(case, dtype, seed)


def _check_fused_backward(feature, fused_config, two_pass, *, q_len, kv_len,
                          head_dim):
  """Gradients of the one-pass backward under ``fused_config`` at a
  GQA shape (2 rows, 4 query heads, 2 KV heads): bitwise equal across
  reruns and within 1.5x the error of ``two_pass`` (an implementation)
  against the float32 reference.  Returns ``(grads, got, seed)``:
  ``grads(implementation)`` the jitted dQ, dK, dV on the same inputs and
  cotangent, ``got`` the fused ones."""
  from jflash.backends.mosaic_gpu import MosaicGpuBackend
  rng, seed = conformance.new_rng()
  case = conformance.build_case(rng, feature, dtype=jnp.bfloat16, batch=2,
                                q_len=q_len, kv_len=kv_len, heads=4,
                                kv_heads=2, head_dim=head_dim)
  cot = random_normal(rng, case.query.shape, jnp.bfloat16)

  def grads(implementation):
    def f(q, k, v):
      return case.call_jflash(q, k, v, None, implementation=implementation)
    return jax.jit(lambda *a: jax.vjp(f, *a)[1](cot))(*case.arrays[:3])

  fused = MosaicGpuBackend(fused_config)
  got = grads(fused)
  again = grads(fused)
  base_grads = grads(two_pass)
  up = [a.astype(jnp.float32) for a in case.arrays[:3]]
  _, vjp = jax.vjp(lambda *a: case.call_reference(*a, None, jit=False)[0],
                   *up)
  exact = vjp(cot.astype(jnp.float32))
  for name, g, g2, base, ref in zip("qkv", got, again, base_grads, exact):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g2),
                                  err_msg=f"d{name} seed={seed}")
    assert rel_err(g, ref) <= 1.5 * rel_err(base, ref), (name, seed)
  return grads, got, seed


@pytest.mark.parametrize("feature", ["causal", "segments", "plain"])
@pytest.mark.parametrize("dq_slots", [1, 2, 4])
def test_mosaic_gpu_fused_backward_ordered_adds(feature, dq_slots):
  """The one-pass backward with several key blocks per dQ accumulator, so
  that the ordered adds wait on each other: gradients within 1.5x the
  two-pass backward's error against the float32 reference, and bitwise
  equal across reruns."""
  from jflash.backends.mosaic_gpu import MosaicGpuConfig
  _check_fused_backward(feature, MosaicGpuConfig(fuse_dq=True,
                                                 dq_slots=dq_slots),
                        "mosaic_gpu", q_len=1100, kv_len=1300, head_dim=128)


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "lengths",
                                     "segments", "soft_cap"])
@pytest.mark.parametrize("q_len,kv_len", [(1100, 1300), (50, 4100)])
def test_mosaic_gpu_fused_backward_wide_query_tiles_at_head_dim_64(
    feature, q_len, kv_len):
  """The one-pass backward with 128-query dK/dV tiles and S and dP issued
  one after the other, the default at head dim 64 from 4096 keys without a
  moving mask: gradients within 1.5x the two-pass backward's error against
  the float32 reference, bitwise equal across reruns, and (where the
  default rule applies) bitwise equal to the default call.  Lengths off
  the tiles, fewer queries than one tile, GQA."""
  from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
  grads, got, seed = _check_fused_backward(
      feature, MosaicGpuConfig(fuse_dq=True, block_q_dkv=128,
                               overlap_sdp=False, dq_slots=2),
      MosaicGpuBackend(MosaicGpuConfig(fuse_dq=False)),
      q_len=q_len, kv_len=kv_len, head_dim=64)
  if feature == "plain" and kv_len >= 4096:
    for name, g, d in zip("qkv", got, grads("mosaic_gpu")):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(d),
                                    err_msg=f"default d{name} seed={seed}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len,kv_len", [(4100, 4100), (1100, 4200)])
def test_mosaic_gpu_fused_backward_is_the_causal_default(head_dim, q_len,
                                                          kv_len):
  """Under a causal mask from 4096 keys the default backward is the
  one-pass one (four dQ accumulators and 128-query dK/dV tiles at head dim
  64, two accumulators at 128): gradients within 1.5x the two-pass
  backward's error against the float32 reference, bitwise equal across
  reruns and to the explicit configuration.  Lengths off the tiles, fewer
  queries than keys, GQA."""
  from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
  from jflash.backends.mosaic_gpu.config import default_config
  config = default_config(head_dim, kv_len, causal=True)
  assert config.fuse_dq and config.dq_slots == (4 if head_dim == 64 else 2)
  grads, got, seed = _check_fused_backward(
      "causal", config, MosaicGpuBackend(MosaicGpuConfig(fuse_dq=False)),
      q_len=q_len, kv_len=kv_len, head_dim=head_dim)
  for name, g, d in zip("qkv", got, grads("mosaic_gpu")):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(d),
                                  err_msg=f"default d{name} seed={seed}")


def test_mosaic_gpu_writes_every_output_element():
  """Poisoned memory: the allocator's free blocks are filled with NaN right
  before the call, so any output or gradient element a kernel fails to
  write (including the exact zeros of rows that see no key) shows up."""
  rng, seed = conformance.new_rng()
  case = conformance.build_case(rng, "lengths", dtype=jnp.bfloat16,
                                q_len=333, kv_len=333, head_dim=128)
  case.kwargs["query_seq_lengths"] = jnp.asarray([0, 200], jnp.int32)
  case.kwargs["is_causal"] = True
  cot = random_normal(rng, case.query.shape, jnp.bfloat16)
  run = jax.jit(lambda *a: grads_of_with_out(case, cot, *a))
  run(*case.arrays)  # compile first: the poison must be the last allocation
  poison = jnp.full((64 * 2**20,), jnp.nan, jnp.float32).block_until_ready()
  del poison
  out, grads = run(*case.arrays)
  for x in (out, *grads):
    assert np.isfinite(np.asarray(x, np.float32)).all(), f"seed={seed}"
  dead = np.asarray(case.kwargs["query_seq_lengths"])[:, None] <= np.arange(
      case.query.shape[1])[None, :]
  assert np.all(np.asarray(out, np.float32)[dead] == 0), f"seed={seed}"


def test_mosaic_gpu_memory_at_128k():
  """Forward+backward at B=1, T=S=131072, N=16, H=128 bfloat16 peaks at no
  more than 1.3x the bytes of inputs, output and gradients (measured in a
  fresh process, so earlier tests do not count)."""
  command = [sys.executable, "-m", "benchmarks.memory_128k",
             "--seed", str(next_seed())]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONPATH=os.pathsep.join(
                 filter(None, [root, os.environ.get("PYTHONPATH")])))
  done = subprocess.run(command, capture_output=True, text=True, env=env,
                        cwd=root, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result["finite"], result
  assert result["ratio"] <= 1.3, result


# Forward and backward at the benchmark grid's shapes, where every CTA of
# the persistent kernels takes many items, each checked on its first two
# heads against the float32 reference (benchmarks/shape_check.py).  Run in
# a child process, so that a deadlock fails the test at its timeout
# instead of stalling the suite.
_MANY_ITEMS_CASES = [
    (64, 1024, True, None, {}),
    (64, 4096, True, None, {}), (64, 1024, False, None, {}),
    (128, 1024, True, None, {}), (128, 1024, True, None,
                                  {"qk_after_pv": True}),
    (128, 2048, True, 256, {}), (256, 1024, True, None, {})]


def test_mosaic_gpu_many_items_per_cta_finish_and_match():
  """The persistent kernels at the benchmark grid's shapes, where each CTA
  loops over dozens of items of varying length (causal, windows, head dims
  64, 128, 256, the forward's other loops): every call finishes and its
  output and gradients match the float32 reference on two heads."""
  _, seed = conformance.new_rng()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONPATH=os.pathsep.join(
                 filter(None, [root, os.environ.get("PYTHONPATH")])))
  cases = [[h, s, c, w, "bwd", f] for h, s, c, w, f in _MANY_ITEMS_CASES]
  try:
    done = subprocess.run([sys.executable, "-m", "benchmarks.shape_check",
                           json.dumps(cases), str(seed)],
                          capture_output=True, text=True, env=env, cwd=root,
                          timeout=400, check=False)
  except subprocess.TimeoutExpired as err:
    pytest.fail(f"did not finish in 400 s (a deadlock?), seed={seed}; "
                f"finished so far: {err.stdout}")
  assert done.returncode == 0, done.stderr[-2000:]
  lines = [json.loads(line[len("RESULT "):])
           for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  assert len(lines) == len(cases), done.stdout
  for line in lines:
    # bfloat16 inputs against a float32 reference: about 2.5e-3 (the
    # benchmark grid's accuracy table, for cuDNN and jflash alike).
    assert max(line["errors"]) < 1e-2, (line, seed)


def grads_of_with_out(case, cot, q, k, v, bias):
  def f(q, k, v):
    return case.call_jflash(q, k, v, bias, implementation="mosaic_gpu")
  out, vjp = jax.vjp(f, q, k, v)
  return out, vjp(cot)


class TestXlaGpu(conformance.AttentionConformance):
  """The fallback on the GPU (float32 matmuls at HIGHEST precision)."""

  implementation = "xla"


class TestDefaultGpu(conformance.AttentionConformance):
  """``implementation=None`` on the GPU: every call is served exactly."""

  implementation = None


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("axis", [0, 2], ids=["batch", "heads"])
def test_mosaic_gpu_explicitly_sharded_inputs_on_two_gpus(axis):
  """Inputs sharded over batch or heads (an Explicit mesh of 2 GPUs) run
  the kernels per shard: the numbers of one device (up to the rounding of
  the XLA glue), the input sharding kept, and no collective in the
  compiled program."""
  rng, seed = conformance.new_rng()
  b, t, n, k, h = 2, 300, 4, 2, 128
  q = random_normal(rng, (b, t, n, h), jnp.bfloat16)
  key = random_normal(rng, (b, t, k, h), jnp.bfloat16)
  value = random_normal(rng, (b, t, k, h), jnp.bfloat16)
  cot = random_normal(rng, (b, t, n, h), jnp.bfloat16)

  def loss(q, key, value, cot):
    out, vjp = jax.vjp(lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=True, implementation="mosaic_gpu"), q, key, value)
    return out, vjp(cot)

  spec = [None] * 4
  spec[axis] = "x"
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
  sharding = NamedSharding(mesh, P(*spec))
  fn = jax.jit(loss)
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, sharding) for x in (q, key, value, cot)]
    out, grads = fn(*args)
    hlo = fn.lower(*args).compile().as_text()
  want_out, want_grads = jax.jit(loss)(q, key, value, cot)
  for got, want in zip((out, *grads), (want_out, *want_grads)):
    assert rel_err(got, want) < 1e-3, f"seed={seed}"
    assert got.sharding.is_equivalent_to(sharding, 4)
  for collective in ("all-gather", "all-reduce", "all-to-all",
                     "collective-permute"):
    assert collective not in hlo


def test_mosaic_gpu_inside_a_checked_shard_map():
  """Inside a user's jax.shard_map with check_vma (its default) over every
  GPU, the kernels' forward, their gradients and the decode kernel run per
  shard and give the numbers of the unsharded call.  The attention's
  sequences have an odd length; the decode kernel reads a contiguous cache
  of a multiple of 8 slots (TMA's row groups), the first 296."""
  rng, seed = conformance.new_rng()
  devices = len(jax.devices())
  b, t, n, k, h = 2 * devices, 300, 4, 2, 128
  slots = t - t % 8
  q = random_normal(rng, (b, t, n, h), jnp.bfloat16)
  key = random_normal(rng, (b, t, k, h), jnp.bfloat16)
  value = random_normal(rng, (b, t, k, h), jnp.bfloat16)
  cot = random_normal(rng, (b, t, n, h), jnp.bfloat16)
  lengths = jnp.asarray(rng.integers(0, slots + 1, size=(b,)), jnp.int32)

  def step(q, key, value, cot, lengths):
    out, vjp = jax.vjp(lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=True, implementation="mosaic_gpu"), q, key, value)
    decoded = jflash.decode_attention(q[:, :1], key[:, :slots],
                                      value[:, :slots], lengths,
                                      implementation="mosaic_gpu")
    return out, vjp(cot), decoded

  mesh = jax.make_mesh((devices,), ("x",))
  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"),) * 5,
                                  out_specs=P("x")))
  args = (q, key, value, cot, lengths)
  got = sharded(*jax.device_put(args, NamedSharding(mesh, P("x"))))
  want = jax.jit(step)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(g, w) < 1e-3, f"seed={seed}"


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mosaic_gpu_row_maxima_that_keep_growing(is_causal, dtype):
  """Keys whose norms ramp up along the sequence (up on some heads, down
  on others) plus a few large keys late in the sequence: the row maxima
  of many rows move at steps after a query tile's first, in some warps
  and not others, which the forward's online softmax must follow.  The
  output and gradients match the exact reference in float32."""
  rng, seed = conformance.new_rng()
  batch, q_len, kv_len, heads, head_dim = 2, 1999, 2048, 4, 128
  q = rng.standard_normal((batch, q_len, heads, head_dim), np.float32)
  k = rng.standard_normal((batch, kv_len, heads, head_dim), np.float32)
  v = rng.standard_normal((batch, kv_len, heads, head_dim), np.float32)
  ramp = np.linspace(0.2, 2.5, kv_len, dtype=np.float32)
  k[:, :, 0::2] *= ramp[None, :, None, None]
  k[:, :, 1::2] *= ramp[::-1][None, :, None, None]
  # A few keys aligned with single queries: a jump of that row alone.
  for b in range(batch):
    for col in rng.choice(np.arange(600, kv_len), size=16, replace=False):
      row = int(rng.integers(0, q_len))
      h = int(rng.integers(0, heads))
      k[b, col, h] = 0.4 * q[b, row, h]
  q, k, v = (jnp.asarray(x).astype(dtype) for x in (q, k, v))
  cot = random_normal(rng, q.shape, dtype)
  case = Case(q, k, v, kwargs={"is_causal": is_causal})
  exact = Case(*(x.astype(jnp.float32) for x in (q, k, v)),
               kwargs=case.kwargs)

  def kernel(*arrays):
    return case.call_jflash(*arrays, implementation="mosaic_gpu")

  def reference(*arrays):
    return exact.call_reference(*arrays, jit=False)[0]

  def with_grads(fn, kwargs):
    return jax.jit(lambda q, k, v: (fn(q, k, v, None), *grads_of(
        fn, Case(q, k, v, kwargs=kwargs), cot)))

  got = with_grads(kernel, case.kwargs)(*case.arrays[:3])
  want = with_grads(reference, exact.kwargs)(*exact.arrays[:3])
  for name, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
    assert np.isfinite(np.asarray(x, np.float32)).all(), (name, seed)
    assert rel_err(x, ref) < 1e-2, (name, rel_err(x, ref), seed)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("feature,q_len,kv_len", [
    ("plain", 300, 333), ("causal", 300, 333), ("window", 300, 333),
    ("lengths", 300, 333), ("segments", 300, 333), ("soft_cap", 300, 333),
    ("combined", 300, 333),
    # The fused backward's defaults (head dims 64 and 128).
    ("plain", 1100, 4200), ("causal", 1100, 4200)])
def test_mosaic_gpu_under_x64(head_dim, feature, q_len, kv_len):
  """With ``jax_enable_x64`` on (64-bit Python ints and loop indices
  while tracing), the kernels run: output and gradients of every mask
  feature, soft cap and GQA match the float32 reference."""
  rng, seed = conformance.new_rng()
  case = conformance.build_case(rng, feature, dtype=jnp.bfloat16, batch=2,
                                q_len=q_len, kv_len=kv_len, heads=4,
                                kv_heads=2, head_dim=head_dim)
  # The kernels serve no dense bias or mask.
  case.bias = case.mask = None
  with jax.enable_x64(True):
    cot = random_normal(rng, case.query.shape, jnp.bfloat16)

    def kernel(*arrays):
      return case.call_jflash(*arrays, implementation="mosaic_gpu")

    exact = Case(*(x.astype(jnp.float32) for x in case.arrays[:3]),
                 kwargs=case.kwargs)

    def reference(*arrays):
      return exact.call_reference(*arrays, jit=False)[0]

    got = jax.jit(lambda q, k, v: (kernel(q, k, v, None), *grads_of(
        kernel, Case(q, k, v, kwargs=case.kwargs), cot)))(*case.arrays[:3])
    want = jax.jit(lambda q, k, v: (reference(q, k, v, None), *grads_of(
        reference, Case(q, k, v, kwargs=exact.kwargs), cot)))(
            *exact.arrays[:3])
  for name, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
    assert np.isfinite(np.asarray(x, np.float32)).all(), (name, seed)
    assert rel_err(x, ref) < 1e-2, (name, rel_err(x, ref), seed)


@pytest.mark.parametrize("head_dim,seq_len,is_causal", [
    (128, 4096, False), (128, 16384, True), (256, 4096, False),
    (64, 4096, True)])
def test_default_order_on_hopper_follows_the_table(head_dim, seq_len,
                                                   is_causal, caplog):
  """``implementation=None`` on this GPU: the forward-only program holds
  the backend chosen for inference and the gradient program the one chosen
  for training (``selected_implementation``, from the measured table);
  both match the float32 reference, and no branch traced for another
  platform warns."""
  rng, seed = conformance.new_rng()
  batch, heads = 1, 2048 // head_dim // 4
  q, k, v = (random_normal(rng, (batch, seq_len, heads, head_dim),
                           jnp.bfloat16) for _ in range(3))
  cot = random_normal(rng, q.shape, jnp.bfloat16)
  case = Case(q, k, v, kwargs={"is_causal": is_causal})
  exact = Case(*(x.astype(jnp.float32) for x in (q, k, v)),
               kwargs=case.kwargs)

  def default(*arrays):
    return case.call_jflash(*arrays)

  def reference(*arrays):
    return exact.call_reference(*arrays, jit=False)[0]

  forward = jax.jit(lambda q, k, v: default(q, k, v, None))
  training = jax.jit(lambda q, k, v: grads_of(
      default, Case(q, k, v, kwargs=case.kwargs), cot))
  with caplog.at_level("WARNING", logger="jflash"):
    for fn, for_training in ((forward, False), (training, True)):
      name = jflash.selected_implementation(
          q, k, v, is_causal=is_causal, for_training=for_training)
      assert name in ("mosaic_gpu", "cudnn"), name
      hlo = fn.lower(q, k, v).compile().as_text()
      assert f"jflash/{name}" in hlo, (name, for_training)
    got = (forward(q, k, v), *training(q, k, v))
  assert not caplog.records, [r.getMessage() for r in caplog.records]
  want = jax.jit(lambda q, k, v: (reference(q, k, v, None), *grads_of(
      reference, Case(q, k, v, kwargs=exact.kwargs), cot)))(*exact.arrays[:3])
  for label, x, ref in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(x, ref) < 1e-2, (label, rel_err(x, ref), seed)


# ------------------------------------------------- blocks with offsets
def _offset_visibility(batch: int, t: int, s: int, *, q_offset: int,
                       kv_offset: int, is_causal: bool, window, q_lengths,
                       kv_lengths, q_ids, kv_ids) -> np.ndarray:
  """``[B, T, S]`` bool, written out in numpy from the semantics of a
  block of longer sequences: causal, window and lengths at global
  positions ``t + q_offset`` and ``s + kv_offset``, segment ids local."""
  gq = np.arange(t)[:, None] + q_offset
  gk = np.arange(s)[None, :] + kv_offset
  vis = np.ones((batch, t, s), bool)
  if is_causal:
    vis &= gk <= gq
  if window is not None:
    vis &= (gk >= gq - window[0]) & (gk <= gq + window[1])
  if q_lengths is not None:
    vis &= gq[None] < np.asarray(q_lengths)[:, None, None]
  if kv_lengths is not None:
    vis &= gk[None] < np.asarray(kv_lengths)[:, None, None]
  if q_ids is not None:
    vis &= np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]
  return vis


def _offset_block(rng, dtype, *, t, s, q_offset, kv_offset, is_causal=False,
                  window=None, lengths=False, segments=False, kv_heads=2,
                  head_dim=64, soft_cap=None):
  """Random inputs of one block (4 query heads) and its ``AttentionCall``
  builder ``call(q, k, v)``; the mask is checked against
  :func:`_offset_visibility` before use."""
  from jflash import masks
  from jflash.core.call import AttentionCall
  batch, heads = 2, 4
  q = random_normal(rng, (batch, t, heads, head_dim), dtype)
  k = random_normal(rng, (batch, s, kv_heads, head_dim), dtype)
  v = random_normal(rng, (batch, s, kv_heads, head_dim), dtype)
  rules = {}
  if lengths:
    # Global lengths: row 0's end inside both blocks' span, row 1's at
    # random (possibly before either block starts).
    end = max(q_offset + t, kv_offset + s)
    start = min(q_offset, kv_offset)
    rules.update(
        q_lengths=np.asarray([start + (end - start) * 2 // 3,
                              rng.integers(0, end + 10)], np.int32),
        kv_lengths=np.asarray([start + (end - start) // 2,
                               rng.integers(0, end + 10)], np.int32))
  if segments:
    # Segment ids of the global sequence, cut at both blocks: segments
    # cross the blocks' boundaries.
    length = max(q_offset + t, kv_offset + s)
    ids = np.cumsum(rng.random((batch, length)) < 8 / length, axis=1)
    rules.update(q_segment_ids=ids[:, q_offset:q_offset + t].astype(np.int32),
                 kv_segment_ids=ids[:, kv_offset:kv_offset + s].astype(
                     np.int32))
  mask = masks.AttentionMask(
      batch=batch, q_len=t, kv_len=s, is_causal=is_causal, window=window,
      q_offset=jnp.asarray(q_offset, jnp.int32),
      kv_offset=jnp.asarray(kv_offset, jnp.int32),
      **{n: jnp.asarray(x) for n, x in rules.items()})
  want = _offset_visibility(
      batch, t, s, q_offset=q_offset, kv_offset=kv_offset,
      is_causal=is_causal, window=window, q_lengths=rules.get("q_lengths"),
      kv_lengths=rules.get("kv_lengths"), q_ids=rules.get("q_segment_ids"),
      kv_ids=rules.get("kv_segment_ids"))
  np.testing.assert_array_equal(np.asarray(mask.visibility())[:, 0], want)
  scale = 1.0 / np.sqrt(head_dim)

  def call(q, k, v):
    return AttentionCall(q, k, v, None, mask, scale, soft_cap,
                         returns_residual=True)
  return (q, k, v), call, want


def _plain_with_lse(call):
  """``(out, lse)`` of a plain materialized implementation in the inputs'
  dtype (:func:`tests._support.plain_attention`; the logsumexp from its
  float32 logits): the same-dtype error baseline."""
  from tests._support import plain_attention
  visible = call.mask.visibility()
  out = plain_attention(call.query, call.key, call.value, None, visible,
                        call.scale, call.logits_soft_cap)
  groups = call.query.shape[2] // call.key.shape[2]
  logits = jnp.einsum("btnh,bsnh->bnts", call.query,
                      jnp.repeat(call.key, groups, axis=2),
                      preferred_element_type=jnp.float32) * call.scale
  if call.logits_soft_cap is not None:
    cap = call.logits_soft_cap
    logits = cap * jnp.tanh(logits / cap)
  lse = jax.nn.logsumexp(jnp.where(visible, logits, -jnp.inf), axis=-1)
  return out, jnp.swapaxes(lse, 1, 2)


def _exact(call):
  """``(out, lse)`` of :func:`jflash.reference.reference_attention` in
  float32."""
  from jflash.reference import reference_attention
  up = [x.astype(jnp.float32) for x in (call.query, call.key, call.value)]
  return reference_attention(*up, None, call.mask, scale=call.scale,
                             logits_soft_cap=call.logits_soft_cap)


# Where the query block stands against the key block, and what hides
# pairs; every case GQA (4 query heads) and lengths off the tiles.
_OFFSET_CASES = {
    "causal_ahead": dict(t=300, s=333, q_offset=400, kv_offset=0,
                         is_causal=True),
    "causal_overlap": dict(t=300, s=333, q_offset=150, kv_offset=37,
                           is_causal=True),
    "causal_behind": dict(t=300, s=200, q_offset=0, kv_offset=300,
                          is_causal=True),
    "window_left": dict(t=300, s=333, q_offset=333, kv_offset=0,
                        is_causal=True, window=(250, 0)),
    "window_both": dict(t=300, s=333, q_offset=100, kv_offset=180,
                        window=(70, 40)),
    "window_misses": dict(t=200, s=333, q_offset=2000, kv_offset=0,
                          window=(300, 300)),
    "segments_lengths": dict(t=300, s=333, q_offset=200, kv_offset=100,
                             is_causal=True, segments=True, lengths=True),
    "lengths_mqa": dict(t=300, s=333, q_offset=333, kv_offset=0,
                        lengths=True, kv_heads=1),
    "soft_cap_128": dict(t=300, s=333, q_offset=64, kv_offset=64,
                         is_causal=True, soft_cap=2.0, head_dim=128),
    "window_256": dict(t=300, s=333, q_offset=333, kv_offset=0,
                       window=(300, 10), head_dim=256),
}
_OFFSET_DTYPES = [("bf16", jnp.bfloat16, name) for name in _OFFSET_CASES] + [
    ("f16", jnp.float16, name) for name in ("causal_overlap", "window_misses",
                                             "segments_lengths")]


def _on_arrays(fn, call):
  """``fn(call)`` jitted with the call's query, key and value as
  arguments (not constants for XLA to fold)."""
  return jax.jit(lambda q, k, v: fn(dataclasses.replace(
      call, query=q, key=k, value=v)))(call.query, call.key, call.value)


def _check_out_and_lse(out, lse, call, info):
  """``out`` and ``lse`` against the exact reference: no NaN, rows that see
  nothing exactly zero with ``-inf`` logsumexp, the output within twice
  the plain same-dtype error (plus the conformance floor), the logsumexp
  within the conformance bound."""
  ref_out, ref_lse = _on_arrays(_exact, call)
  plain_out, _ = _on_arrays(_plain_with_lse, call)
  out32 = np.asarray(out, np.float32)
  assert not np.isnan(out32).any(), info
  dead = np.isneginf(np.asarray(ref_lse))
  assert np.all(out32[dead] == 0), info
  assert np.all(np.isneginf(np.asarray(lse))[dead]), info
  bound = 2 * rel_err(plain_out, ref_out) + conformance.LOW_PRECISION_FLOOR
  assert rel_err(out, ref_out) <= bound, info
  scale = max(1.0, float(np.max(np.abs(
      np.where(np.isfinite(ref_lse), ref_lse, 0)))))
  assert lse_err(lse, ref_lse) < 2e-2 * scale, info


def _check_grads(got, call, d_out, d_lse, info):
  """``(dq, dk, dv)`` against the exact reference's gradients for the
  cotangents ``(d_out, d_lse)``, within twice the plain same-dtype
  implementation's error plus the conformance floor."""
  def vjp_of(fn, up: bool):
    def grads(q, k, v, d_out, d_lse):
      if up:
        q, k, v, d_out = (x.astype(jnp.float32) for x in (q, k, v, d_out))
      outs, vjp = jax.vjp(lambda q, k, v: fn(
          dataclasses.replace(call, query=q, key=k, value=v)), q, k, v)
      # Cotangents in the outputs' dtypes (float64 under x64).
      return vjp(tuple(c.astype(o.dtype)
                       for c, o in zip((d_out, d_lse), outs)))
    return jax.jit(grads)(call.query, call.key, call.value, d_out, d_lse)
  arrays = (call.query, call.key, call.value)
  want = vjp_of(_exact, up=True)
  plain = vjp_of(_plain_with_lse, up=False)
  for name, g, w, p, x in zip("qkv", got, want, plain, arrays):
    g32 = np.asarray(g, np.float32)
    assert g.dtype == x.dtype and g.shape == x.shape, (name, info)
    assert np.isfinite(g32).all(), (name, info)
    bound = 2 * rel_err(p, w) + conformance.LOW_PRECISION_FLOOR
    assert rel_err(g, w) <= bound, (name, rel_err(g, w), bound, info)


def _offset_inputs(dtype_name, dtype, name):
  rng, seed = conformance.new_rng()
  arrays, call, visible = _offset_block(rng, dtype, **_OFFSET_CASES[name])
  return rng, f"{name} {dtype_name} seed={seed}", arrays, call, visible


@pytest.mark.parametrize("dtype_name,dtype,name", _OFFSET_DTYPES)
def test_mosaic_gpu_offsets_forward(dtype_name, dtype, name):
  """The block forward (``MosaicGpuBackend.forward``) of a query block
  ahead of, behind or overlapping its key block: output and logsumexp
  against the exact reference, rows that see nothing (a band that
  misses the block, a causal block behind its keys, global lengths)
  zero with ``-inf`` logsumexp."""
  from jflash.backends.mosaic_gpu import MosaicGpuBackend
  _, info, arrays, call, visible = _offset_inputs(dtype_name, dtype, name)
  out, lse = jax.jit(lambda *a: MosaicGpuBackend().forward(call(*a)))(
      *arrays)
  assert out.shape == arrays[0].shape and lse.shape == out.shape[:-1]
  _check_out_and_lse(out, lse, call(*arrays), info)
  # The cases are built so that some rows of some blocks see nothing.
  if name in ("causal_behind", "window_misses"):
    assert not visible.any() and np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize("dtype_name,dtype,name", _OFFSET_DTYPES)
def test_mosaic_gpu_offsets_block_backward(dtype_name, dtype, name):
  """The block backward (``MosaicGpuBackend.backward``) given the block's
  own output and logsumexp and random cotangents of both: gradients
  against the exact reference's for the same cotangents."""
  from jflash.backends.mosaic_gpu import MosaicGpuBackend
  rng, info, arrays, call, _ = _offset_inputs(dtype_name, dtype, name)
  backend = MosaicGpuBackend()
  d_out = random_normal(rng, arrays[0].shape, dtype)
  d_lse = random_normal(rng, arrays[0].shape[:-1], jnp.float32)

  def block(q, k, v):
    # The float32 output as the forward returns it.
    out, lse = backend.forward(call(q, k, v))
    return backend.backward(call(q, k, v), out, lse, d_out, d_lse)
  got = jax.jit(block)(*arrays)
  _check_grads(got, call(*arrays), d_out, d_lse, info)


@pytest.mark.parametrize("fuse_dq", [False, True], ids=["two_pass", "fused"])
@pytest.mark.parametrize("name", ["causal_overlap", "window_misses",
                                  "segments_lengths", "soft_cap_128"])
def test_mosaic_gpu_offsets_grad(name, fuse_dq):
  """``jax.grad`` through the backend's differentiable call on a block
  with offsets (the two-pass and the fused backward): gradients for
  random cotangents of the output and logsumexp against the exact
  reference's."""
  from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
  rng, info, arrays, call, _ = _offset_inputs("bf16", jnp.bfloat16, name)
  backend = MosaicGpuBackend(MosaicGpuConfig(fuse_dq=fuse_dq))
  d_out = random_normal(rng, arrays[0].shape, jnp.bfloat16)
  d_lse = random_normal(rng, arrays[0].shape[:-1], jnp.float32)

  def loss(q, k, v):
    out, lse = backend(call(q, k, v))
    lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
    return (jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
            + jnp.sum(lse * d_lse))
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*arrays)
  _check_grads(got, call(*arrays), d_out, d_lse, info)


@pytest.mark.parametrize("implementation", ["mosaic_gpu", None])
def test_attention_sinks_on_the_gpu(implementation):
  """Sinks through the Hopper kernels and through the default (which must
  pass over cuDNN, whose logsumexp has no gradient): output and gradients,
  sinks' included, against the float32 reference with sinks."""
  from tests.test_sinks import _problem  # pylint: disable=import-outside-toplevel
  problem = _problem(np.random.default_rng(next_seed()), "causal",
                     dtype=jnp.bfloat16, t=300, s=300, heads=(8, 2),
                     head_dim=128)
  args = (problem.q, problem.k, problem.v, problem.sinks)
  cot = random_normal(np.random.default_rng(next_seed()), problem.q.shape,
                      jnp.float32)

  def loss(fn):
    return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot)

  ours = lambda q, k, v, s: jflash.dot_product_attention(
      q, k, v, is_causal=True, attention_sinks=s,
      implementation=implementation)
  ref = lambda q, k, v, s: problem.reference(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
      s)[0]
  assert rel_err(jax.jit(ours)(*args), ref(*args)) < 2e-2
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(*args)
  want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(*args)
  for g, w in zip(got, want):
    assert rel_err(g, w) < 3e-2
  if implementation is None:
    assert jflash.selected_implementation(
        *args[:3], is_causal=True, attention_sinks=problem.sinks,
        for_training=True) != "cudnn"
