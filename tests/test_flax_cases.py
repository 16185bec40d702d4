"""The cases Flax's own attention tests check, run against jflash.flax.

Flax's Linen and NNX attention tests check output shapes and dtypes across
batch dims and feature sizes, dropout keys and determinism, decoding along a
scanned axis and under x64, the causal receptive field, sown attention
weights in multi-layer models, ``keep_rngs``, ``in_kv_features``,
Linen/NNX consistency across ``use_bias`` / ``dtype`` / ``param_dtype`` /
``decode`` / ``normalize_qk``, and grouped-query attention.  Each test here
runs the same situation through jflash's modules (or ``attention_fn``) and
Flax's own, on the same parameters, and compares what comes out.
"""

from __future__ import annotations

import contextlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import jax_utils, nnx

import jflash.flax as jf
from jflash.flax import linen as jlinen
from jflash.flax import nnx as jnnx


def _normal(seed: int, shape, dtype=jnp.float32) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _close(a, b, tol=1e-5) -> None:
  np.testing.assert_allclose(np.asarray(a, np.float64),
                             np.asarray(b, np.float64), atol=tol, rtol=tol)


@contextlib.contextmanager
def _no_fallback():
  """A fallback to Flax's attention inside this block fails the test."""
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*falling back")
    yield


def _copy_linen_params(module: nnx.Module, params) -> None:
  """Linen MultiHeadDotProductAttention parameters into an NNX module."""
  for name, leaves in params.items():
    layer = getattr(module, name)
    for leaf, value in leaves.items():
      getattr(layer, leaf)[...] = value


# --------------------------------------------------------------------------
# Linen
# --------------------------------------------------------------------------

@pytest.mark.parametrize("shape,use_bias", [
    ((4, 6, 5), True), ((4, 2, 3, 5), False)])
def test_linen_output_shape_dtype_and_values_match_flax(shape, use_bias):
  x = _normal(0, shape)
  cfg = dict(num_heads=8, qkv_features=16, use_bias=use_bias,
             deterministic=False)  # head dim 2; no dropout: no fallback
  theirs = nn.MultiHeadDotProductAttention(**cfg)
  variables = theirs.init(jax.random.key(1), x)
  with _no_fallback():
    got, our_vars = jlinen.MultiHeadAttention(**cfg).init_with_output(
        jax.random.key(1), x)
  jax.tree.map(np.testing.assert_array_equal, our_vars, variables)
  assert got.shape == x.shape and got.dtype == jnp.float32
  _close(got, theirs.apply(variables, x))


def test_linen_dropout_keys_behave_as_in_flax():
  """Two identical layers share ``dropout_rng`` when it is passed, else draw
  their own from the ``dropout`` stream; either way the bits are Flax's."""

  class Pair(nn.Module):
    cls: type

    @nn.compact
    def __call__(self, x, dropout_rng=None):
      cfg = dict(num_heads=4, qkv_features=16, dropout_rate=0.5,
                 deterministic=False, kernel_init=nn.initializers.ones)
      return (self.cls(**cfg)(x, x, dropout_rng=dropout_rng),
              self.cls(**cfg)(x, x, dropout_rng=dropout_rng))

  x = _normal(2, (3, 6, 8))
  ours, theirs = Pair(jlinen.MultiHeadAttention), Pair(
      nn.MultiHeadAttention)  # Flax's alias: the same auto names as ours
  keys = jax.random.split(jax.random.key(3), 3)
  rngs = {"params": keys[0], "dropout": keys[1]}
  with pytest.warns(UserWarning, match="dropout"):
    variables = ours.init(rngs, x)
  for kwargs in (dict(rngs={"dropout": keys[1]}),
                 dict(rngs={"dropout": keys[2]}),
                 dict(dropout_rng=keys[2])):
    with pytest.warns(UserWarning, match="dropout"):
      a, b = ours.apply(variables, x, **kwargs)
    want_a, want_b = theirs.apply(variables, x, **kwargs)
    np.testing.assert_array_equal(a, want_a)
    np.testing.assert_array_equal(b, want_b)
    assert (a == b).all() == ("dropout_rng" in kwargs)


def test_linen_deterministic_runs_jflash_and_ignores_rngs():
  x = _normal(4, (3, 6, 8))
  cfg = dict(num_heads=4, qkv_features=16)
  theirs = nn.MultiHeadDotProductAttention(**cfg)
  variables = theirs.init(jax.random.key(5), x)
  want = theirs.apply(variables, x)
  cases = ((dict(dropout_rate=0.0, deterministic=True), {}),
           (dict(dropout_rate=0.0), dict(deterministic=True)),
           (dict(dropout_rate=0.5), dict(deterministic=True)))
  for fields, call in cases:
    module = jlinen.MultiHeadAttention(**cfg, **fields)
    with _no_fallback():
      outs = [module.apply(variables, x, rngs={"dropout": jax.random.key(s)},
                           **call) for s in (6, 7)]
    np.testing.assert_array_equal(outs[0], outs[1])
    _close(outs[0], want)
  # Dropout without a deterministic flag anywhere: Flax's merge_param error.
  errors = []
  for cls in (nn.MultiHeadDotProductAttention, jlinen.MultiHeadAttention):
    with pytest.raises(Exception, match="deterministic") as info:  # noqa: PT011
      cls(**cfg, dropout_rate=0.5).apply(variables, x)
    errors.append((type(info.value), str(info.value)))
  assert errors[0] == errors[1]


@pytest.mark.parametrize("spatial,axis", [((5,), 1), ((3, 5), 2)])
def test_linen_decoding_along_an_axis_matches_causal(spatial, axis):
  """Flax scans the decoder over one axis of ``[2, *spatial, F]``; the
  decoder's cache has every other axis as a batch dim."""
  heads, feats = 3, 4
  x = _normal(8, (2,) + spatial + (heads * feats,))
  cfg = dict(num_heads=heads, qkv_features=heads * feats)
  full = nn.MultiHeadDotProductAttention(**cfg)
  decoder = jlinen.MultiHeadAttention(**cfg, decode=True)
  variables = decoder.init(jax.random.key(9), x)
  cache, params = variables["cache"], variables["params"]
  mask = nn.make_causal_mask(jnp.ones((2,) + spatial))
  want = full.apply({"params": params}, x, mask=mask)

  def step(cache, xt):
    y, updates = decoder.apply({"params": params, "cache": cache}, xt,
                               mutable=["cache"])
    return updates["cache"], y

  with _no_fallback():
    _, got = jax.jit(lambda c, x: jax_utils.scan_in_dim(
        step, c, x, axis=(axis,), keepdims=True))(cache, x)
  _close(got, want)


def test_linen_receptive_field_is_causal():
  """d out[t] / d x[s] is nonzero exactly for s <= t, with a causal mask
  and with is_causal."""
  length = 10
  x = _normal(10, (1, length, 1))
  module = jlinen.MultiHeadAttention(num_heads=1,
                                     kernel_init=nn.initializers.ones)
  variables = module.init(jax.random.key(11), x)
  mask = nn.make_causal_mask(jnp.ones((1, length)))
  for kwargs in (dict(mask=mask), dict(is_causal=True)):
    jac = jax.jit(jax.jacrev(lambda x: module.apply(variables, x, **kwargs)))(x)
    deps = np.abs(np.asarray(jac))[0, :, 0, 0, :, 0] > 1e-6  # [t, s]
    np.testing.assert_array_equal(deps, np.tri(length, dtype=bool))


def test_linen_sow_weights_in_a_multi_layer_model():

  class Model(nn.Module):
    cls: type

    @nn.compact
    def __call__(self, x, sow_weights=False):
      cfg = dict(num_heads=8, qkv_features=16)
      x = self.cls(**cfg)(x, sow_weights=sow_weights)
      x = self.cls(**cfg)(x)
      return self.cls(**cfg)(x, sow_weights=sow_weights)

  x = _normal(12, (4, 6, 5))
  ours, theirs = Model(jlinen.MultiHeadAttention), Model(
      nn.MultiHeadAttention)
  variables = theirs.init(jax.random.key(13), x)
  with pytest.warns(UserWarning, match="sow"):
    got, state = ours.apply(variables, x, sow_weights=True,
                            mutable=["intermediates"])
  want, want_state = theirs.apply(variables, x, sow_weights=True,
                                  mutable=["intermediates"])
  _close(got, want)
  inter = state["intermediates"]
  assert set(inter) == {"MultiHeadAttention_0", "MultiHeadAttention_2"}
  for name in inter:
    (weights,) = inter[name]["attention_weights"]
    assert weights.shape == (4, 8, 6, 6)
    _close(weights, want_state["intermediates"][name]["attention_weights"][0])
  with _no_fallback():
    got, state = ours.apply(variables, x, mutable=["intermediates"])
  assert "intermediates" not in state
  _close(got, want)


def test_decode_under_x64_matches_flax():
  with jax.enable_x64(True):
    x = _normal(14, (1, 4, 4), jnp.float64)
    cfg = dict(num_heads=2, qkv_features=4, decode=True)
    ours, theirs = (jlinen.MultiHeadAttention(**cfg),
                    nn.MultiHeadDotProductAttention(**cfg))
    variables = theirs.init(jax.random.key(15), x)
    made = {}
    for name, module in (("ours", ours), ("theirs", theirs)):
      params, cache, outs = variables["params"], variables["cache"], []
      for t in range(2):
        with _no_fallback():
          y, updates = module.apply({"params": params, "cache": cache},
                                    x[:, t:t + 1], mutable=["cache"])
        cache = updates["cache"]
        outs.append(y)
      made[name] = outs
    for got, want in zip(made["ours"], made["theirs"]):
      assert got.shape == want.shape == (1, 1, 4)
      assert got.dtype == want.dtype == jnp.float64
      _close(got, want, 1e-12)

    # NNX on the same parameters.  Flax's NNX module computes through
    # jax.nn.dot_product_attention, which rounds float64 logits to float32,
    # so the exact float64 reference is Flax's Linen output above.
    make = lambda cls: cls(in_features=4, num_heads=2, qkv_features=4,
                           decode=True, rngs=nnx.Rngs(16))
    ours, theirs = make(jnnx.MultiHeadAttention), make(nnx.MultiHeadAttention)
    for module in (ours, theirs):
      _copy_linen_params(module, variables["params"])
      module.init_cache(x.shape, dtype=x.dtype)
    assert ours.cached_key[...].shape == (1, 4, 2, 2)
    for t in range(2):
      with _no_fallback():
        got = ours(x[:, t:t + 1])
      assert got.shape == (1, 1, 4) and got.dtype == jnp.float64
      _close(got, made["theirs"][t], 1e-12)
      _close(got, theirs(x[:, t:t + 1]), 1e-6)


# --------------------------------------------------------------------------
# NNX
# --------------------------------------------------------------------------

def test_nnx_basic_shape_and_in_kv_features_match_flax():
  x, y = _normal(17, (1, 7, 3)), _normal(18, (1, 5, 4))
  for kwargs, args in ((dict(), (x,)), (dict(in_kv_features=4), (x, y))):
    make = lambda cls: cls(num_heads=2, in_features=3, qkv_features=6,
                           out_features=6, rngs=nnx.Rngs(19), **kwargs)
    ours, theirs = make(jnnx.MultiHeadAttention), make(nnx.MultiHeadAttention)
    with _no_fallback():
      got = ours(*args, decode=False)
    assert got.shape == (1, 7, 6)
    _close(got, theirs(*args, decode=False))


def test_nnx_sow_weights_in_a_multi_layer_model():

  class Model(nnx.Module):

    def __init__(self, cls, rngs):
      self.layers = nnx.List([cls(in_features=8, num_heads=8, decode=False,
                                  rngs=rngs) for _ in range(3)])

    def __call__(self, x, sow_weights=False):
      x = self.layers[0](x, sow_weights=sow_weights)
      x = self.layers[1](x)
      return self.layers[2](x, sow_weights=sow_weights)

  x = _normal(20, (4, 6, 8))
  ours = Model(jnnx.MultiHeadAttention, nnx.Rngs(21))
  theirs = Model(nnx.MultiHeadAttention, nnx.Rngs(21))
  with pytest.warns(UserWarning, match="sow"):
    got = ours(x, True)
  _close(got, theirs(x, True))
  inter = nnx.pop(ours, nnx.Intermediate)
  want = nnx.pop(theirs, nnx.Intermediate)
  assert set(inter["layers"]) == {0, 2}
  for i in (0, 2):
    (weights,) = inter["layers"][i]["attention_weights"]
    (want_weights,) = want["layers"][i]["attention_weights"]
    assert weights.shape == (4, 8, 6, 6)
    _close(weights, want_weights)
  with _no_fallback():
    ours(x)
  assert not nnx.pop(ours, nnx.Intermediate)


@pytest.mark.parametrize("keep_rngs", [True, False])
def test_nnx_keep_rngs_as_in_flax(keep_rngs):
  x = _normal(22, (2, 6, 4))
  make = lambda cls: cls(in_features=4, num_heads=2, qkv_features=4,
                         decode=False, dropout_rate=0.5, deterministic=False,
                         keep_rngs=keep_rngs, rngs=nnx.Rngs(23))
  ours, theirs = make(jnnx.MultiHeadAttention), make(nnx.MultiHeadAttention)
  assert (ours.rngs is None) == (not keep_rngs)
  assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(
      nnx.state(theirs))
  if not keep_rngs:
    with pytest.raises(ValueError) as flax_error:
      theirs(x)
    with pytest.raises(ValueError) as our_error:
      ours(x)
    assert str(our_error.value) == str(flax_error.value)
  call = (lambda m: m(x)) if keep_rngs else (
      lambda m: m(x, rngs=nnx.Rngs(dropout=24)))
  with pytest.warns(UserWarning, match="dropout"):
    got = call(ours)
  np.testing.assert_array_equal(got, call(theirs))


@pytest.mark.parametrize("use_bias,dtype,param_dtype,decode,normalize_qk", [
    (True, jnp.float32, jnp.float32, False, False),
    (False, jnp.float16, jnp.float32, True, True),
    (True, jnp.float32, jnp.float16, True, False),
    (False, jnp.float16, jnp.float16, False, True),
])
def test_nnx_and_linen_agree_with_flax_linen(use_bias, dtype, param_dtype,
                                             decode, normalize_qk):
  """Flax checks its NNX module against its Linen one on a single
  unbatched token ``[1, F]``; here both jflash modules are checked against
  Flax's Linen module on that input and on a batch."""
  cfg = dict(num_heads=2, qkv_features=6, out_features=6, use_bias=use_bias,
             dtype=dtype, param_dtype=param_dtype, normalize_qk=normalize_qk)
  tol = 1e-5 if jnp.float16 not in (dtype, param_dtype) else 2e-2
  for x in (_normal(25, (1, 3)), _normal(26, (2, 1, 3))):
    linen_cfg = dict(cfg, decode=decode)
    theirs = nn.MultiHeadDotProductAttention(**linen_cfg)
    variables = theirs.init(jax.random.key(27), x)
    want, _ = theirs.apply(variables, x, mutable=["cache"])
    with _no_fallback():
      got, _ = jlinen.MultiHeadAttention(**linen_cfg).apply(
          variables, x, mutable=["cache"])
    _close(got, want, tol)
    ours = jnnx.MultiHeadAttention(in_features=3, decode=decode,
                                   rngs=nnx.Rngs(28), **cfg)
    _copy_linen_params(ours, variables["params"])
    if decode:
      ours.init_cache(x.shape, dtype=dtype)
    with _no_fallback():
      got = ours(x)
    assert got.dtype == want.dtype
    _close(got, want, tol)


def test_precision_falls_back_to_flax_in_both_frameworks():
  x = _normal(29, (2, 5, 3))
  cfg = dict(num_heads=2, qkv_features=6, precision=jax.lax.Precision.HIGHEST)
  theirs = nn.MultiHeadDotProductAttention(**cfg)
  variables = theirs.init(jax.random.key(30), x)
  with pytest.warns(UserWarning, match="precision"):
    got = jlinen.MultiHeadAttention(**cfg).apply(variables, x)
  np.testing.assert_array_equal(got, theirs.apply(variables, x))
  make = lambda cls: cls(in_features=3, decode=False, rngs=nnx.Rngs(31),
                         **cfg)
  ours, flax_nnx = make(jnnx.MultiHeadAttention), make(nnx.MultiHeadAttention)
  with pytest.warns(UserWarning, match="precision"):
    got = ours(x)
  _close(got, flax_nnx(x))


# --------------------------------------------------------------------------
# Grouped-query attention through attention_fn
# --------------------------------------------------------------------------

def test_attention_fn_grouped_query_heads():
  q = _normal(32, (2, 4, 6, 8))
  k, v = _normal(33, (2, 5, 3, 8)), _normal(34, (2, 5, 3, 8))
  want = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, axis=-2),
                                      jnp.repeat(v, 2, axis=-2))
  with _no_fallback():
    got = jax.jit(jf.attention_fn)(q, k, v)
  assert got.shape == (2, 4, 6, 8)
  _close(got, want)

  class Sink(nnx.Module):
    pass

  with pytest.warns(UserWarning, match="sow"):
    _close(jf.attention_fn(q, k, v, module=Sink()), want, 1e-4)
  with pytest.raises(ValueError, match="multiple"):
    jf.attention_fn(jnp.ones((1, 4, 5, 8)), jnp.ones((1, 4, 2, 8)),
                    jnp.ones((1, 4, 2, 8)))
