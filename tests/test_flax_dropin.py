"""jflash.flax as a drop-in for Flax: errors, warnings and inputs that code
written for Flax's attention relies on.

Each error test takes Flax's own message from Flax's own code on the same
bad input and checks that jflash's message contains it (and says more);
outputs are compared with Flax's modules on the same parameters.
"""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jflash.flax as jf
from jflash.flax import linen as jlinen
from jflash.flax import nnx as jnnx

B, T, S, F, N = 2, 16, 12, 32, 4


def _normal(seed: int, shape, dtype=jnp.float32) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _close(a, b, tol=1e-5) -> None:
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def _message(fn) -> str:
  """The message of the exception ``fn()`` raises (any type)."""
  with pytest.raises(Exception) as info:  # noqa: PT011 - any type on purpose
    fn()
  return str(info.value)


class _Sink(nnx.Module):
  """A module to sow into: sends Flax's function down its checking path."""


# --------------------------------------------------------------------------
# attention_fn: shapes, masks, ids
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["depth", "length", "rank", "batch"])
def test_attention_fn_shape_errors_say_what_flax_says(case):
  q = _normal(0, (B, T, N, 8))
  k = v = _normal(1, (B, S, N, 8))
  if case == "depth":  # the value may differ in head dim, the key may not
    k = v = _normal(1, (B, S, N, 7))
  elif case == "length":
    v = _normal(2, (B, S - 1, N, 8))
  elif case == "rank":
    v = v[0]
  else:
    k = v = _normal(1, (B + 1, S, N, 8))
  flax_msg = _message(lambda: nnx.dot_product_attention(q, k, v,
                                                        module=_Sink()))
  with pytest.raises(ValueError) as info:
    jf.attention_fn(q, k, v)
  assert flax_msg in str(info.value)
  assert str(q.shape) in str(info.value)  # jflash's detail: all the shapes


def test_attention_fn_value_head_dim_may_differ_either_way():
  q, k = _normal(3, (B, T, N, 8)), _normal(4, (B, S, N, 8))
  for hv in (4, 13):
    v = _normal(5 + hv, (B, S, N, hv))
    got = jax.jit(jf.attention_fn)(q, k, v)
    assert got.shape == (B, T, N, hv)
    _close(got, nn.dot_product_attention(q, k, v))


def test_attention_fn_mask_and_bias_of_wrong_shape_name_the_argument():
  q = _normal(6, (B, T, N, 8))
  k = _normal(7, (B, S, N, 8))
  bad = jnp.ones((B + 1, 1, T, S), jnp.bool_)
  with pytest.raises(ValueError, match=re.escape(
      f"mask must be broadcastable to [batch..., N, T, S] = {(B, N, T, S)}, "
      f"got shape {bad.shape}")):
    jf.attention_fn(q, k, k, mask=bad)
  with pytest.raises(ValueError, match=r"bias .*\(2, 4, 16, 12\).*missing "
                     r"leading axes.*got shape \(3, 16, 12\)"):
    jf.attention_fn(q, k, k, _normal(8, (3, T, S)))
  # Flax's module with jflash plugged in reports the same.
  x = _normal(9, (B, T, F))
  layer = nn.MultiHeadDotProductAttention(num_heads=N,
                                          attention_fn=jf.attention_fn)
  variables = layer.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="mask must be broadcastable"):
    layer.apply(variables, x, mask=jnp.ones((B + 1, 1, T, T), jnp.bool_))


def test_attention_fn_segment_ids_and_lengths_of_wrong_shape():
  q = _normal(10, (B, T, N, 8))
  k = _normal(11, (B, S, N, 8))
  with pytest.raises(ValueError, match=re.escape(
      "segment_ids must have shape [batch..., T] = (2, 16) (the query's "
      "batch dims (2,)), got shape (2,)")):
    jf.attention_fn(q, q, q, segment_ids=jnp.zeros((B,), jnp.int32))
  with pytest.raises(ValueError, match=re.escape(
      "segment_ids[1] (kv_segment_ids) must have shape [batch..., S] = "
      "(2, 12)")):
    jf.attention_fn(q, k, k, segment_ids=(jnp.zeros((B, T), jnp.int32),
                                          jnp.zeros((B, T), jnp.int32)))
  with pytest.raises(ValueError, match=r"needs T == S.*T=16, S=12"):
    jf.attention_fn(q, k, k, segment_ids=jnp.zeros((B, T), jnp.int32))
  with pytest.raises(ValueError, match=re.escape(
      "query_seq_lengths must have shape [batch...] = (2,)")):
    jf.attention_fn(q, q, q, query_seq_lengths=jnp.ones((B, 1), jnp.int32))


def test_attention_fn_python_lists_read_as_arrays_tuples_as_pairs():
  """A nested list of ids is one array [batch..., T] (as np.asarray reads
  it); a tuple, or a list of two arrays, is a (query, key) pair."""
  q = _normal(12, (B, T, N, 8))
  k = _normal(13, (B, S, N, 8))
  rng = np.random.default_rng(14)
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=-1)
  kv_ids = np.sort(rng.integers(0, 3, (B, S)), axis=-1)
  fn = jax.jit(jf.attention_fn)
  want = fn(q, q, q, segment_ids=jnp.asarray(ids))
  _close(jf.attention_fn(q, q, q, segment_ids=ids.tolist()), want)
  assert np.abs(np.asarray(want - fn(q, q, q))).max() > 1e-2  # ids applied
  pair = (jnp.asarray(ids), jnp.asarray(kv_ids))
  want = fn(q, k, k, segment_ids=pair)
  _close(jf.attention_fn(q, k, k, segment_ids=list(pair)), want)
  lengths = [T, 5]
  _close(jf.attention_fn(q, q, q, key_value_seq_lengths=lengths),
         fn(q, q, q, key_value_seq_lengths=jnp.asarray(lengths)))


# --------------------------------------------------------------------------
# Fallback warnings point at the caller
# --------------------------------------------------------------------------

def test_fallback_warning_points_at_the_callers_line():
  x = _normal(15, (B, T, F))
  linen_jflash = jlinen.MultiHeadAttention(num_heads=N, dropout_rate=0.2,
                                           deterministic=False)
  linen_plugged = nn.MultiHeadDotProductAttention(
      num_heads=N, attention_fn=jf.attention_fn)
  nnx_jflash = jnnx.MultiHeadAttention(N, F, decode=False, rngs=nnx.Rngs(0))
  params = linen_plugged.init(jax.random.key(1), x)
  calls = (
      lambda: linen_jflash.apply(params, x,
                                 rngs={"dropout": jax.random.key(2)}),
      lambda: linen_plugged.apply(params, x, sow_weights=True,
                                  mutable="intermediates"),
      lambda: nnx_jflash(x, sow_weights=True),
      lambda: nnx.jit(lambda m, x: m(x, sow_weights=True))(nnx_jflash, x),
  )
  for call in calls:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      call()
    (fallback,) = [w for w in caught if "falling back" in str(w.message)]
    assert fallback.filename == __file__, (fallback.filename, fallback.lineno)


# --------------------------------------------------------------------------
# The modules: Flax's errors and warnings
# --------------------------------------------------------------------------

def _linen_pair(**cfg):
  return jlinen.MultiHeadAttention(**cfg), nn.MultiHeadDotProductAttention(
      **cfg)


def test_linen_kv_argument_errors_and_warnings_match_flax():
  q, kv = _normal(16, (3, 5)), _normal(17, (9, 5))
  ours, theirs = _linen_pair(num_heads=2, qkv_features=8)
  key = jax.random.key(18)
  for kwargs in (dict(inputs_v=kv), dict(inputs_kv=kv, inputs_v=kv),
                 dict(inputs_k=kv, inputs_kv=kv)):
    flax_msg = _message(lambda: theirs.init(key, q, **kwargs))
    with pytest.raises(ValueError) as info:
      ours.init(key, q, **kwargs)
    assert flax_msg in str(info.value)
    assert str(info.value) != flax_msg  # plus what was passed
  with pytest.warns(DeprecationWarning) as flax_warnings:
    want, want_vars = theirs.init_with_output(key, q, inputs_kv=kv)
  with pytest.warns(DeprecationWarning,
                    match="The inputs_kv arg will be deprecated soon."):
    got, got_vars = ours.init_with_output(key, q, inputs_kv=kv)
  assert flax_warnings
  jax.tree.map(np.testing.assert_array_equal, got_vars, want_vars)
  _close(got, want)
  _close(ours.apply(got_vars, q, kv), got)
  _close(ours.apply(got_vars, q, inputs_k=kv, inputs_v=kv), got)


def test_linen_mask_passed_as_inputs_v_warns_like_flax():
  x = _normal(19, (1, 10, 1))
  ours, theirs = _linen_pair(num_heads=1)
  variables = theirs.init(jax.random.key(20), x, x)
  mask = nn.make_causal_mask(jnp.ones((1, 10)))
  results = []
  for module in (theirs, ours):
    with pytest.warns(DeprecationWarning) as caught:
      with pytest.raises(Exception) as error:  # noqa: PT011 - compared below
        module.apply(variables, x, x, mask)
    results.append((type(error.value), [str(w.message) for w in caught]))
  (flax_error, flax_warnings), (our_error, our_warnings) = results
  assert our_error is flax_error  # the value kernel does not fit the mask
  signature = ("the function signature of MultiHeadDotProductAttention's "
               "`__call__` method has changed")
  assert any(signature in w for w in flax_warnings)
  assert any(signature in w for w in our_warnings)
  with warnings.catch_warnings():  # a [.., S, F] value with S != F: silent
    warnings.simplefilter("error", DeprecationWarning)
    ours.apply(variables, x, x, x)


def test_linen_qkv_features_error_says_what_flax_says():
  x = _normal(22, (B, T, 6))
  ours, theirs = _linen_pair(num_heads=4)
  flax_msg = _message(lambda: theirs.init(jax.random.key(0), x))
  with pytest.raises(ValueError) as info:
    ours.init(jax.random.key(0), x)
  assert flax_msg in str(info.value)


def test_nnx_kv_errors_say_what_flax_says():
  x, kv = _normal(23, (B, T, F)), _normal(24, (B, S, F))
  make = lambda cls: cls(N, F, decode=False, rngs=nnx.Rngs(25))
  ours, theirs = make(jnnx.MultiHeadAttention), make(nnx.MultiHeadAttention)
  for args in ((x, None, kv), (x, kv, kv[:, :-2])):
    flax_msg = _message(lambda: theirs(*args))
    with pytest.raises(ValueError) as info:
      ours(*args)
    assert flax_msg in str(info.value)
    assert str(info.value) != flax_msg


def test_linen_complex_inputs_fall_back_to_flax():
  x = (_normal(26, (4, 6, 5)) + 1j * _normal(27, (4, 6, 5))).astype(
      jnp.complex64)
  ours, theirs = _linen_pair(num_heads=8, qkv_features=16)
  variables = theirs.init(jax.random.key(28), x)
  with pytest.warns(UserWarning, match="complex"):
    got = ours.apply(variables, x)
  want = theirs.apply(variables, x)
  assert got.dtype == want.dtype == jnp.complex64
  _close(got, want)
  with pytest.warns(UserWarning, match="complex"):
    got, state = ours.apply(variables, x, sow_weights=True,
                            mutable=["intermediates"])
  _close(got, want)
  with pytest.raises(NotImplementedError, match="complex.*segment_ids"):
    ours.apply(variables, x, segment_ids=jnp.zeros((4, 6), jnp.int32))
  q = x[..., None, :4]
  with pytest.warns(UserWarning, match="complex"):
    _close(jf.attention_fn(q, q, q), nn.dot_product_attention(q, q, q))


def test_linen_name_keeps_flax_parameter_paths():
  """The Linen module's automatic name is ``MultiHeadAttention_<i>`` (Flax's
  is ``MultiHeadDotProductAttention_<i>``); ``name=`` keeps Flax's paths,
  and with them its initial values and outputs."""
  x = _normal(29, (B, T, F))

  class Parent(nn.Module):
    cls: type
    child_name: str | None = None

    @nn.compact
    def __call__(self, x):
      mask = nn.make_causal_mask(jnp.ones(x.shape[:-1]))
      return self.cls(num_heads=N, name=self.child_name)(x, mask=mask)

  flax_parent = Parent(nn.MultiHeadDotProductAttention)
  want, flax_vars = flax_parent.init_with_output(jax.random.key(30), x)
  assert set(flax_vars["params"]) == {"MultiHeadDotProductAttention_0"}
  auto = Parent(jlinen.MultiHeadAttention).init(jax.random.key(30), x)
  assert set(auto["params"]) == {"MultiHeadAttention_0"}
  named = Parent(jlinen.MultiHeadAttention, "MultiHeadDotProductAttention_0")
  got, our_vars = named.init_with_output(jax.random.key(30), x)
  jax.tree.map(np.testing.assert_array_equal, our_vars, flax_vars)
  _close(got, want)
