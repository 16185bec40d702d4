"""JAX transformations, sharding, float64 gradients and tile skipping."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jflash
from jflash import BACKENDS
from jflash.backends import (MosaicTpuBackend, MosaicTpuConfig, XlaBackend,
                             XlaConfig)
from tests._support import (Case, fresh_rng, random_normal, random_qkv,
                            random_segments, rel_err)

SMALL_TILES = XlaBackend(XlaConfig(block_q=8, block_kv=16))


_rng = fresh_rng
_qkv = functools.partial(random_qkv, t=24, s=24)


def test_vmap_matches_loop():
  rng = _rng()
  q, k, v = _qkv(rng)
  stack = [jnp.stack([x, x * 0.5 + 1.0, -x]) for x in (q, k, v)]
  ids = jnp.asarray(random_segments(rng, 2, 24))

  def f(q, k, v):
    return jflash.dot_product_attention(q, k, v, is_causal=True,
                                        segment_ids=ids,
                                        implementation=SMALL_TILES)

  def value_and_grads(q, k, v):
    return f(q, k, v), jax.grad(lambda *a: f(*a).sum(), (0, 1, 2))(q, k, v)

  batched, g_batched = jax.jit(jax.vmap(value_and_grads))(*stack)
  single = jax.jit(value_and_grads)
  looped = [single(*(x[i] for x in stack)) for i in range(3)]
  assert rel_err(batched, jnp.stack([o for o, _ in looped])) < 1e-6
  for j in range(3):
    assert rel_err(g_batched[j], jnp.stack([g[j] for _, g in looped])) < 1e-6


def test_vmap_over_segment_ids():
  """Data-dependent tile schedules under vmap stay exact."""
  rng = _rng()
  q, k, v = _qkv(rng, b=1)
  ids = jnp.asarray(np.stack([random_segments(rng, 1, 24) for _ in range(3)]))

  def f(ids):
    return jflash.dot_product_attention(q, k, v, segment_ids=ids,
                                        implementation=SMALL_TILES)

  batched = jax.jit(jax.vmap(f))(ids)
  single = jax.jit(f)
  for i in range(3):
    assert rel_err(batched[i], single(ids[i])) < 1e-6


def test_checkpoint_and_scan():
  rng = _rng()
  q, k, v = _qkv(rng)
  weights = random_normal(rng, (3, 16, 16), jnp.float32) * 0.2

  def layer(x, w):
    y = jflash.dot_product_attention(x @ w, k, v, is_causal=True,
                                     implementation=SMALL_TILES)
    return x + y, None

  def model(q, layer_fn):
    return jax.lax.scan(layer_fn, q, weights)[0].sum()

  plain = jax.jit(jax.value_and_grad(lambda q: model(q, layer)))(q)
  remat = jax.jit(jax.value_and_grad(
      lambda q: model(q, jax.checkpoint(layer))))(q)

  @jax.jit
  def unrolled(x):
    for i in range(3):
      x = layer(x, weights[i])[0]
    return x.sum()

  assert rel_err(plain[0], unrolled(q)) < 1e-6
  assert rel_err(plain[0], remat[0]) < 1e-6
  assert rel_err(plain[1], remat[1]) < 1e-6


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
@pytest.mark.parametrize("spec", [P("data", None, "model", None),
                                  P("data", None, None, None),
                                  P(None, None, "model", None)],
                         ids=["batch+heads", "batch", "heads"])
def test_sharded_inputs(spec, axis_type):
  """Inputs sharded over batch and/or heads: same numbers, the output keeps
  the sharding, and no all-gather of the inputs is needed."""
  rng = _rng()
  q, k, v = _qkv(rng, b=4, t=40, s=40, n=4, k=2)
  ids = jnp.asarray(random_segments(rng, 4, 40))
  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(axis_type, axis_type))
  sharding = NamedSharding(mesh, spec)
  ids_sharding = NamedSharding(mesh, P(spec[0], None))
  qs, ks, vs = (jax.device_put(x, sharding) for x in (q, k, v))
  ids_s = jax.device_put(ids, ids_sharding)

  def loss(q, k, v, ids):
    out = jflash.dot_product_attention(q, k, v, is_causal=True,
                                       segment_ids=ids,
                                       implementation=SMALL_TILES)
    return out, jax.grad(lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids,
        implementation=SMALL_TILES).sum(), (0, 1, 2))(q, k, v)

  fn = jax.jit(loss)
  with jax.set_mesh(mesh):
    out, grads = fn(qs, ks, vs, ids_s)
    hlo = fn.lower(qs, ks, vs, ids_s).compile().as_text()
  want_out, want_grads = jax.jit(loss)(q, k, v, ids)
  assert rel_err(out, want_out) < 1e-6
  for g, w in zip(grads, want_grads):
    assert rel_err(g, w) < 1e-6
  for x in (out,) + tuple(grads):
    assert x.sharding.is_equivalent_to(sharding, 4)
  assert "all-gather" not in hlo


def test_float64_check_grads():
  rng = _rng()
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64) for x in _qkv(rng, t=10, s=13, h=8))
    bias = jnp.asarray(rng.standard_normal((1, 4, 10, 13)))
    ids = (jnp.asarray(random_segments(rng, 2, 10, 2)),
           jnp.asarray(random_segments(rng, 2, 13, 2)))

    def f(q, k, v, bias):
      return jflash.dot_product_attention(
          q, k, v, bias, is_causal=True, local_window_size=(6, 2),
          segment_ids=ids, logits_soft_cap=3.0,
          key_value_seq_lengths=jnp.asarray([13, 9], jnp.int32),
          implementation=XlaBackend(XlaConfig(block_q=4, block_kv=4)))

    out = f(q, k, v, bias)
    assert out.dtype == jnp.float64
    # Central differences err by eps**2 times the third derivative: at
    # check_grads' default eps (1e-4) about one draw in a hundred exceeded
    # 1e-6; at 1e-5 that term is a hundred times smaller and rounding
    # (1e-16 / eps) stays far below the tolerance.
    check_grads(f, (q, k, v, bias), order=1, modes=["rev"], atol=1e-6,
                rtol=1e-6, eps=1e-5)


def test_empty_tiles_are_never_read():
  """Keys in tiles the schedule marks empty may hold NaN: they are skipped,
  not computed and masked (which would turn 0 * NaN into NaN)."""
  rng = _rng()
  q, k, v = _qkv(rng, b=2, t=64, s=64)
  backend = XlaBackend(XlaConfig(block_q=16, block_kv=16))
  # Key blocks 2 and 3 lie past every row's key length: empty tiles.
  lengths = jnp.asarray([32, 20], jnp.int32)
  k_bad = k.at[:, 32:].set(jnp.nan)
  v_bad = v.at[:, 32:].set(jnp.nan)
  out = jflash.dot_product_attention(q, k_bad, v_bad,
                                     key_value_seq_lengths=lengths,
                                     implementation=backend)
  want = jflash.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                      implementation=backend)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  # Packed documents aligned to tiles: off-diagonal document tiles skipped.
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 16)[None].repeat(2, 0)
  v_doc = v.at[:, 16:32].set(jnp.nan)  # only document 1's keys are poisoned
  out = np.asarray(jflash.dot_product_attention(q, k, v_doc, segment_ids=ids,
                                                implementation=backend))
  assert np.isnan(out[:, 16:32]).all()
  assert np.isfinite(np.delete(out, np.s_[16:32], axis=1)).all()
  # Causal: the upper triangle of tiles is skipped.
  v_future = v.at[:, 48:].set(jnp.nan)
  out = np.asarray(jflash.dot_product_attention(q, k, v_future, is_causal=True,
                                                implementation=backend))
  assert np.isfinite(out[:, :48]).all() and np.isnan(out[:, 48:]).all()


# ------------------------------------------- forward mode and higher order
# Pallas kernels run through the interpreter with tiles small enough that the
# test shapes span several of them.
TPU_TILES = MosaicTpuBackend(MosaicTpuConfig(block_q=8, block_kv=8))
IMPLEMENTATIONS = {"default": None, "xla": "xla", "mosaic_tpu": TPU_TILES}


def _extra(implementation: str) -> dict:
  """The keyword arguments that select ``implementation``."""
  extra = dict(implementation=IMPLEMENTATIONS[implementation])
  if implementation == "mosaic_tpu":
    extra["interpret"] = True
  return extra


def _featured_case(rng, features: str):
  """A small float32 case with the named visibility features, as
  ``(q, k, v, bias, kwargs)``: ``causal``; ``mask`` adds a window, segment
  ids, key lengths and a soft cap; ``all`` adds a bias to those."""
  q, k, v = random_qkv(rng, b=2, t=10, s=13, n=4, k=2, h=8)
  bias, kwargs = None, dict(is_causal=True)
  if features in ("mask", "all"):
    kwargs.update(
        local_window_size=(6, 2), logits_soft_cap=3.0,
        key_value_seq_lengths=jnp.asarray([13, 9], jnp.int32),
        segment_ids=(jnp.asarray(random_segments(rng, 2, 10, 2)),
                     jnp.asarray(random_segments(rng, 2, 13, 2))))
  if features == "all":
    bias = random_normal(rng, (1, 4, 10, 13), jnp.float32)
  return q, k, v, bias, kwargs


def _reference_fn(bias, kwargs):
  case = Case(None, None, None, bias, kwargs=kwargs)
  def f(q, k, v):
    out, lse = case.call_reference(q, k, v, bias, jit=False)
    return out, lse
  return f


def _jflash_fn(bias, kwargs, **extra):
  def f(q, k, v):
    return jflash.dot_product_attention(q, k, v, bias, **kwargs,
                                        return_residual=True, **extra)
  return f


def _finite_lse(lse, ref):
  """Zeroes the entries of rows that see no key (a logsumexp of -inf)."""
  return jnp.where(jnp.isneginf(ref), 0.0, lse)


def _assert_tangents_match(got, want, tol=1e-5):
  """``((out, lse), (d_out, d_lse))`` of jflash against the reference's."""
  (out, lse), (d_out, d_lse) = got
  (ref_out, ref_lse), (ref_d_out, ref_d_lse) = want
  assert rel_err(out, ref_out) < tol
  assert rel_err(d_out, ref_d_out) < tol
  assert rel_err(_finite_lse(d_lse, ref_lse),
                 _finite_lse(ref_d_lse, ref_lse)) < tol


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("features", ["causal", "mask"])
def test_forward_mode_in_every_form(implementation, features):
  """jax.jvp eager, under jax.jit, of a jitted function; jax.linearize;
  jax.vmap of jax.jvp: each the reference's derivative."""
  rng = _rng()
  q, k, v, bias, kwargs = _featured_case(rng, features)
  primals = (q, k, v)
  tangents = tuple(random_normal(rng, x.shape, x.dtype) for x in primals)
  mine = _jflash_fn(bias, kwargs, **_extra(implementation))
  ref = _reference_fn(bias, kwargs)
  want = jax.jvp(ref, primals, tangents)

  _assert_tangents_match(jax.jvp(mine, primals, tangents), want)
  _assert_tangents_match(jax.jit(lambda *p: jax.jvp(mine, p, tangents))(
      *primals), want)
  _assert_tangents_match(jax.jvp(jax.jit(mine), primals, tangents), want)
  value, linear = jax.linearize(mine, *primals)
  _assert_tangents_match((value, linear(*tangents)), want)

  stacked = tuple(jnp.stack([t, -0.5 * t]) for t in tangents)
  def tangent_out(*ts):
    return jax.jvp(lambda q, k, v: mine(q, k, v)[0], primals, ts)[1]
  batched = jax.vmap(tangent_out)(*stacked)
  assert rel_err(batched[0], want[1][0]) < 1e-5
  assert rel_err(batched[1], -0.5 * want[1][0]) < 1e-5


def test_forward_mode_with_a_bias():
  """Tangents of the bias as well as of query, key and value."""
  rng = _rng()
  q, k, v, bias, kwargs = _featured_case(rng, "all")
  primals = (q, k, v, bias)
  tangents = tuple(random_normal(rng, x.shape, x.dtype) for x in primals)

  def mine(q, k, v, bias):
    return _jflash_fn(bias, kwargs)(q, k, v)

  def ref(q, k, v, bias):
    return _reference_fn(bias, kwargs)(q, k, v)

  _assert_tangents_match(jax.jvp(mine, primals, tangents),
                         jax.jvp(ref, primals, tangents))


@pytest.mark.parametrize("implementation", ["default", "mosaic_tpu"])
def test_jacfwd_and_hessian_match_the_reference(implementation):
  rng = _rng()
  q, k, v, bias, kwargs = _featured_case(rng, "mask")
  q, k, v = q[:, :4, :2], k[:, :6, :1], v[:, :6, :1]  # a small Jacobian
  kwargs = dict(is_causal=True, logits_soft_cap=3.0)
  weights = random_normal(rng, (2, 4, 2, 8), jnp.float32)
  mine = _jflash_fn(None, kwargs, **_extra(implementation))
  ref = _reference_fn(None, kwargs)

  def scalar(f):
    return lambda q: jnp.sum(f(q, k, v)[0] * weights)

  jac = jax.jacfwd(lambda q: mine(q, k, v)[0])(q)
  ref_jac = jax.jacfwd(lambda q: ref(q, k, v)[0])(q)
  assert rel_err(jac, ref_jac) < 1e-5
  hess = jax.hessian(scalar(mine))(q)
  ref_hess = jax.hessian(scalar(ref))(q)
  assert rel_err(hess, ref_hess) < 1e-4


@pytest.mark.parametrize("implementation,features",
                         [("default", "all"), ("xla", "causal"),
                          ("mosaic_tpu", "mask")])
def test_second_order_matches_the_reference(implementation, features):
  """Hessian-vector products (forward over reverse, also through a jitted
  gradient and through lax.scan) and reverse over reverse."""
  rng = _rng()
  q, k, v, bias, kwargs = _featured_case(rng, features)
  weights = random_normal(rng, q.shape, jnp.float32)
  tangent = random_normal(rng, q.shape, jnp.float32)

  def loss(f):
    return lambda q, k, v: jnp.sum(jnp.tanh(f(q, k, v)[0]) * weights)

  def hvp(f, jit=False):
    grad = jax.grad(loss(f))
    return jax.jvp(jax.jit(grad) if jit else grad, (q, k, v),
                   (tangent, 0 * k, 0 * v))[1]

  def scan_hvp(f):
    def scanned(q):
      out = jax.lax.scan(lambda c, _: (f(c, k, v)[0], None), q, None,
                         length=2)[0]
      return jnp.sum(jnp.tanh(out) * weights)
    return jax.jvp(jax.grad(scanned), (q,), (tangent,))[1]

  def grad_of_grad(f):
    inner = jax.grad(loss(f), argnums=(0, 1, 2))
    return jax.grad(lambda q, k, v: sum(
        jnp.sum(g ** 2) for g in inner(q, k, v)), argnums=(0, 1, 2))(q, k, v)

  mine = _jflash_fn(bias, kwargs, **_extra(implementation))
  ref = _reference_fn(bias, kwargs)
  assert rel_err(hvp(mine), hvp(ref)) < 1e-4
  assert rel_err(hvp(mine, jit=True), hvp(ref)) < 1e-4
  assert rel_err(scan_hvp(mine), scan_hvp(ref)) < 1e-4
  for got, want in zip(grad_of_grad(mine), grad_of_grad(ref)):
    assert rel_err(got, want) < 1e-4


def test_vmap_and_reverse_mode_around_forward_mode():
  """jax.grad of a vmapped jax.jvp (the tangent map batched, then
  transposed) and jax.vmap of jax.grad."""
  rng = _rng()
  q, k, v, bias, kwargs = _featured_case(rng, "mask")
  tangents = jnp.stack([random_normal(rng, q.shape, jnp.float32)
                        for _ in range(2)])
  weights = random_normal(rng, (2,) + q.shape, jnp.float32)

  def grad_of_vmapped_jvp(f):
    def loss(q):
      outs = jax.vmap(lambda t: jax.jvp(lambda q: f(q, k, v)[0], (q,),
                                        (t,))[1])(tangents)
      return jnp.sum(jnp.sin(outs) * weights)
    return jax.grad(loss)(q)

  def vmapped_grad(f):
    return jax.vmap(jax.grad(lambda q: jnp.sum(jnp.sin(f(q, k, v)[0]))))(
        jnp.stack([q, 2 * q]))

  mine = _jflash_fn(bias, kwargs, **_extra("mosaic_tpu"))
  ref = _reference_fn(bias, kwargs)
  assert rel_err(grad_of_vmapped_jvp(mine), grad_of_vmapped_jvp(ref)) < 1e-4
  assert rel_err(vmapped_grad(mine), vmapped_grad(ref)) < 1e-5


def test_forward_mode_uses_an_xla_backend_of_the_list():
  """Tangents come from the first XlaBackend of an explicit list (here
  with its own tiles), else from the default one."""
  rng = _rng()
  q, k, v, bias, kwargs = _featured_case(rng, "causal")
  tangents = tuple(random_normal(rng, x.shape, x.dtype) for x in (q, k, v))
  want = jax.jvp(_reference_fn(bias, kwargs), (q, k, v), tangents)
  tiles = []

  class Recording(XlaBackend):
    def differentiable(self, call):
      tiles.append(self.config.block_q)
      return super().differentiable(call)

  mine = _jflash_fn(bias, kwargs, interpret=True, implementation=[
      TPU_TILES, Recording(XlaConfig(block_q=4, block_kv=8))])
  _assert_tangents_match(jax.jvp(mine, (q, k, v), tangents), want)
  assert tiles and set(tiles) == {4}


@pytest.mark.parametrize("implementation,features",
                         [("xla", "all"), ("mosaic_tpu", "mask")])
def test_reverse_mode_is_the_backends_own_backward(implementation, features):
  """jax.grad through jflash gives the very bits of the chosen backend's
  own custom_vjp backward, called directly."""
  rng = _rng()
  q, k, v, bias, kwargs = _featured_case(rng, features)
  weights = random_normal(rng, q.shape, jnp.float32)
  extra = _extra(implementation)
  backend = (BACKENDS["xla"] if implementation == "xla" else TPU_TILES)

  def loss(out, lse):
    return jnp.sum(jnp.sin(out) * weights) + 0.1 * jnp.sum(
        jnp.where(jnp.isneginf(lse), 0.0, lse))

  def through_jflash(q, k, v, bias):
    return loss(*_jflash_fn(bias, kwargs, **extra)(q, k, v))

  def direct(q, k, v, bias):
    call, _ = Case(None, None, None, bias, kwargs=kwargs).canonical(
        q, k, v, bias)
    call = dataclasses.replace(call, interpret=True)
    return loss(*backend(call))

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  got = jax.jit(jax.grad(through_jflash, argnums))(q, k, v, bias)
  want = jax.jit(jax.grad(direct, argnums))(q, k, v, bias)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # The same kernels: as many Pallas calls (forward and backward).
  counts = [_count_primitive(jax.make_jaxpr(jax.grad(fn, argnums))(
      q, k, v, bias).jaxpr, "pallas_call") for fn in (through_jflash, direct)]
  assert counts[0] == counts[1]
  assert counts[0] > 0 or implementation == "xla"


def _count_primitive(jaxpr, name: str) -> int:
  """Equations of primitive ``name`` in ``jaxpr`` and its sub-jaxprs."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          count += _count_primitive(sub, name)
  return count


def test_reverse_mode_keeps_the_custom_backward(monkeypatch):
  """One level of reverse mode (including under jax.checkpoint and scan)
  runs the backends' own backward passes; only forward mode reaches the
  formulation JAX differentiates."""
  rng = _rng()
  q, k, v = _qkv(rng)

  def refuse(self, call):
    raise AssertionError("reverse mode reached XlaBackend.differentiable")
  monkeypatch.setattr(XlaBackend, "differentiable", refuse)

  def f(q):
    return jflash.dot_product_attention(q, k, v, is_causal=True)
  jax.grad(lambda q: f(q).sum())(q)
  jax.jit(jax.grad(lambda q: jax.checkpoint(f)(q).sum()))(q)
  jax.vjp(f, q)[1](q)
  jax.grad(lambda q: jax.lax.scan(lambda c, _: (f(c), None), q, None,
                                  length=2)[0].sum())(q)
  jax.grad(lambda q: jax.vmap(f)(jnp.stack([q, q])).sum())(q)
  with pytest.raises(AssertionError, match="differentiable"):
    jax.jvp(f, (q,), (q,))


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_context_parallel_calls_are_reverse_mode_only():
  """A sequence-sharded call differentiates in reverse mode; forward mode
  raises NotImplementedError naming jflash."""
  rng = _rng()
  q, k, v = _qkv(rng, b=1, t=32, s=32)
  mesh = jax.make_mesh((4,), ("context",), axis_types=(AxisType.Auto,))
  attend = jax.shard_map(
      lambda q, k, v: jflash.dot_product_attention(
          q, k, v, is_causal=True, implementation=SMALL_TILES,
          context_parallel=jflash.ContextParallel(axis_name="context")),
      mesh=mesh, in_specs=(P(None, "context"),) * 3,
      out_specs=P(None, "context"))

  def grads(f):
    return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))),
                    (0, 1, 2))(q, k, v)

  reference_fn = lambda q, k, v: _reference_fn(None, dict(is_causal=True))(
      q, k, v)[0]
  for got, want in zip(jax.jit(lambda: grads(attend))(), grads(reference_fn)):
    assert rel_err(got, want) < 1e-5
  with pytest.raises(NotImplementedError, match=r"jflash.*context-parallel"):
    jax.jvp(attend, (q, k, v), (q, k, v))
  with pytest.raises(NotImplementedError, match=r"jflash.*context-parallel"):
    jax.jit(lambda q: jax.jvp(attend, (q, k, v), (q, k, v)))(q)


@pytest.mark.parametrize("form", ["jit", "shard_map", "shard_map+checkpoint",
                                  "shard_map+scan"])
def test_reverse_mode_runs_the_forward_kernel_once(form):
  """jax.grad with implementation=None, exported for a TPU from this host
  (a mesh of TPU devices): the TPU's program runs the forward kernel once,
  as the backend's own custom_vjp does, across jit, shard_map, checkpoint
  and scan boundaries."""
  from jax.sharding import AbstractDevice, AbstractMesh
  mesh = AbstractMesh((4,), ("c",), (AxisType.Explicit,),
                      abstract_device=AbstractDevice(
                          device_kind="TPU v5 lite", num_cores=None,
                          platform="tpu"))

  def attend(q, k, v):
    return jflash.dot_product_attention(q, k, v, is_causal=True)

  def in_shard_map(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("c"),) * 3,
                                 out_specs=P("c")))

  def scanned(q, k, v):
    # The values are stacked outputs, not carried: none is needed by
    # the backward pass.
    return jax.lax.scan(lambda c, x: (c, attend(x, k, v)), 0.0,
                        jnp.stack([q, 2.0 * q]))[1].sum(0)

  fn, sharded = {
      "jit": (jax.jit(attend), False),
      "shard_map": (in_shard_map(attend), True),
      "shard_map+checkpoint": (in_shard_map(jax.checkpoint(attend)), True),
      "shard_map+scan": (in_shard_map(scanned), True)}[form]
  spec = jax.ShapeDtypeStruct(
      (4 if sharded else 1, 128, 2, 128), jnp.float32,
      sharding=NamedSharding(mesh, P("c")) if sharded else None)
  grad = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), (0, 1, 2)))
  with jflash.lowering_for("tpu", "TPU v5 lite"):
    module = jax.export.export(grad, platforms=["tpu"])(
        spec, spec, spec).mlir_module()
  kernels = re.findall(r'kernel_name = "jflash_mosaic_tpu_(\w+)"', module)
  assert sorted(kernels) == ["dkv", "dq", "forward"], kernels
