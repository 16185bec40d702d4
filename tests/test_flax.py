"""jflash.flax: attention_fn in Flax's modules, and the drop-in modules.

Everything is checked against Flax's own attention (same parameters, same
dropout keys) or against an independent float64 numpy computation.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jflash.flax as jf
from jflash.flax import linen as jlinen
from jflash.flax import nnx as jnnx

B, T, F, N = 2, 16, 32, 4
TOL = dict(atol=1e-5, rtol=1e-5)


def _normal(seed: int, shape, dtype=jnp.float32) -> jax.Array:
  # numpy draws: jax.random would compile once per shape (seconds on CPU).
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _close(a, b, **tol) -> None:
  np.testing.assert_allclose(np.asarray(a, np.float64),
                             np.asarray(b, np.float64), **(tol or TOL))


def _segments(seed: int, shape) -> jax.Array:
  """Sorted random packed-document ids ``[..., T]`` (several per row)."""
  ids = np.random.default_rng(seed).integers(0, 3, shape)
  return jnp.asarray(np.sort(ids, axis=-1), jnp.int32)


def _naive(q, k, v, visible, *, cap=None, bias=None) -> np.ndarray:
  """Independent float64 attention; ``visible`` ``[B|1, N|1, T, S]`` bool.
  Rows with no visible key give zeros (jflash's documented convention)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  groups = q.shape[-2] // k.shape[-2]
  k, v = np.repeat(k, groups, axis=-2), np.repeat(v, groups, axis=-2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  if cap is not None:
    logits = cap * np.tanh(logits / cap)
  visible = np.broadcast_to(np.asarray(visible), logits.shape)
  logits = np.where(visible, logits, -np.inf)
  row_max = np.max(logits, -1, keepdims=True)
  weights = np.where(visible, np.exp(logits - np.where(
      np.isfinite(row_max), row_max, 0.0)), 0.0)
  total = weights.sum(-1, keepdims=True)
  probs = weights / np.where(total == 0, 1.0, total)
  return np.einsum("bnts,bsnh->btnh", probs, v)


def _window(t: int, s: int, left: int, right: int) -> np.ndarray:
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  return (j >= i - left) & (j <= i + right)


def _linen_project(params, x):
  """Flax Linen q/k/v projection done by hand: ``[B, T, N, H]`` each."""
  return tuple(jnp.einsum("btf,fnh->btnh", x, params[n]["kernel"])
               + params[n]["bias"] for n in ("query", "key", "value"))


def _linen_out(params, o):
  return jnp.einsum("btnh,nhf->btf", o, params["out"]["kernel"]) + \
      params["out"]["bias"]


# --------------------------------------------------------------------------
# attention_fn plugged into Flax's own modules
# --------------------------------------------------------------------------

def _masks(kind: str, batch_shape, t: int):
  """(mask or None, [batch..., T] bool rows that see at least one key)."""
  rows = np.ones(batch_shape + (t,), bool)
  if kind == "none":
    return None, rows
  if kind == "causal":
    return nn.make_causal_mask(jnp.ones(batch_shape + (t,))), rows
  lengths = np.array([t, t - 5, 3, t - 1, 7, 1][:int(np.prod(batch_shape))])
  valid = (np.arange(t) < lengths[:, None]).reshape(batch_shape + (t,))
  if kind == "kv_padding":  # every query row keeps some keys
    return nn.make_attention_mask(jnp.ones(batch_shape + (t,)), valid), rows
  return nn.make_attention_mask(valid, valid), valid  # "padding"


@pytest.mark.parametrize("kind,batch_shape", [
    ("none", (B,)), ("causal", (2, 3)), ("kv_padding", (B,)),
    ("padding", (2, 3))])
def test_linen_attention_fn_matches_flax(kind, batch_shape):
  x = _normal(0, batch_shape + (T, F))
  mask, rows = _masks(kind, batch_shape, T)
  cfg = dict(num_heads=N, bias_init=nn.initializers.normal(1.0))
  ours = nn.MultiHeadDotProductAttention(attention_fn=jf.attention_fn, **cfg)
  theirs = nn.MultiHeadDotProductAttention(**cfg)
  variables = theirs.init(jax.random.key(1), x)
  apply = lambda m: jax.jit(lambda v, x, mask: m.apply(v, x, mask=mask))
  got = apply(ours)(variables, x, mask)
  want = apply(theirs)(variables, x, mask)
  _close(got[rows], want[rows])
  # Padded query rows see nothing: jflash's attention output there is zero,
  # so the module returns the out-projection bias.
  out_bias = variables["params"]["out"]["bias"]
  _close(got[~rows], np.broadcast_to(out_bias, got[~rows].shape))


@pytest.mark.parametrize("case", ["mask", "is_causal", "gqa_causal", "batch"])
def test_nnx_attention_fn_matches_flax(case):
  batch_shape = (2, 3) if case == "batch" else (B,)
  x = _normal(2, batch_shape + (T, F))
  kv_heads = 2 if case == "gqa_causal" else None
  make = lambda **kw: nnx.MultiHeadAttention(
      N, F, num_kv_heads=kv_heads, decode=False, rngs=nnx.Rngs(3), **kw)
  ours, theirs = make(attention_fn=jf.attention_fn), make()
  mask = (nn.make_causal_mask(jnp.ones(batch_shape + (T,)))
          if case in ("mask", "batch") else None)
  causal = case in ("is_causal", "gqa_causal")
  call = nnx.jit(lambda m, x, mask: m(x, mask=mask, is_causal=causal))
  want = call(theirs, x, mask)
  _close(call(ours, x, mask), want)
  if causal:  # the causal mask really was applied
    unmasked = nnx.jit(lambda m, x: m(x))(theirs, x)
    assert np.abs(np.asarray(want - unmasked)).max() > 1e-2


def test_attention_fn_direct_batch_dims_bias_segments_lengths():
  """Two leading batch dims; bias needing a broadcast; segment ids and
  lengths flattened consistently with the batch."""
  bs, h, s = (2, 3), 8, 12
  q, k, v = (_normal(i, bs + (n, N, h)) for i, n in ((4, T), (5, s), (6, s)))
  bias = _normal(7, (2, 1, N, T, s))
  q_ids, kv_ids = _segments(8, bs + (T,)), _segments(9, bs + (s,))
  kv_len = jnp.array([[s, 9, 5], [12, 1, 7]])
  got = jax.jit(lambda q, k, v, b, i, j, n: jf.attention_fn(
      q, k, v, b, segment_ids=(i, j), key_value_seq_lengths=n))(
          q, k, v, bias, q_ids, kv_ids, kv_len)
  q_ids_np, kv_ids_np = np.asarray(q_ids), np.asarray(kv_ids)
  visible = ((q_ids_np[..., :, None] == kv_ids_np[..., None, :])
             & (np.arange(s) < np.asarray(kv_len)[..., None, None]))[:, :, None]
  flat = lambda x: np.asarray(x).reshape((6,) + x.shape[2:])
  want = _naive(flat(q), flat(k), flat(v), flat(visible),
                bias=flat(np.broadcast_to(bias, bs + (N, T, s))))
  assert got.shape == bs + (T, N, h)
  _close(np.asarray(got).reshape(want.shape), want)


def test_attention_fn_value_head_dim_and_dtype():
  q, k = _normal(10, (B, T, N, 8)), _normal(11, (B, 20, N, 8))
  v = _normal(12, (B, 20, N, 12))
  mask = nn.make_causal_mask(jnp.ones((B, T)))[..., :20]
  mask = jnp.pad(mask, [(0, 0)] * 3 + [(0, 4)], constant_values=1)
  fn = jax.jit(jf.attention_fn, static_argnames="dtype")
  _close(fn(q, k, v, mask=mask), nn.dot_product_attention(q, k, v, mask=mask))
  # dtype promotes like Flax: bfloat16 query with dtype=float32.
  got = fn(q.astype(jnp.bfloat16), k, k, dtype=jnp.float32)
  want = nn.dot_product_attention(q.astype(jnp.bfloat16), k, k,
                                  dtype=jnp.float32)
  assert got.dtype == want.dtype == jnp.float32
  _close(got, want)
  got = fn(q, k, k, dtype=jnp.bfloat16)
  assert got.dtype == jnp.bfloat16
  _close(got, nn.dot_product_attention(q, k, k), atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------------
# jflash's own modules: parameters and outputs
# --------------------------------------------------------------------------

def test_linen_module_params_interchangeable():
  x = _normal(13, (B, T, F))
  make = lambda cls, normalize_qk: cls(num_heads=N, qkv_features=16,
                                       out_features=24,
                                       normalize_qk=normalize_qk)
  for normalize_qk in (False, True):  # same tree and shapes
    ours, theirs = (jax.eval_shape(make(cls, normalize_qk).init,
                                   jax.random.key(14), x)
                    for cls in (jlinen.MultiHeadAttention,
                                nn.MultiHeadDotProductAttention))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert jax.tree.map(jnp.shape, ours) == jax.tree.map(jnp.shape, theirs)
    assert set(ours["params"]) == {"query", "key", "value", "out"} | (
        {"query_ln", "key_ln"} if normalize_qk else set())
  ours, theirs = (make(cls, True) for cls in (jlinen.MultiHeadAttention,
                                              nn.MultiHeadDotProductAttention))
  v_ours, v_theirs = (jax.jit(m.init)(jax.random.key(14), x)
                      for m in (ours, theirs))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), v_ours,
               v_theirs)  # same values for the same rng
  # Identical trees: either module runs on the other's parameters.
  mask = nn.make_causal_mask(jnp.ones((B, T)))
  run = lambda m, v: jax.jit(lambda v, x: m.apply(v, x, mask=mask))(v, x)
  _close(run(ours, v_theirs), run(theirs, v_ours))


def test_linen_module_gradients_match_flax():
  x = _normal(17, (B, T, F))
  ours, theirs = jlinen.MultiHeadAttention(num_heads=N), \
      nn.MultiHeadDotProductAttention(num_heads=N)
  params = theirs.init(jax.random.key(18), x)["params"]
  mask = nn.make_causal_mask(jnp.ones((B, T)))
  y = _normal(19, (B, T, F))
  grad = lambda m: jax.jit(jax.grad(lambda p: jnp.sum(
      (m.apply({"params": p}, x, mask=mask) - y) ** 2)))(params)
  jax.tree.map(lambda a, b: _close(a, b, atol=2e-5, rtol=2e-5),
               grad(ours), grad(theirs))


def test_nnx_module_params_interchangeable():
  x = _normal(20, (B, T, F))
  make = lambda cls, seed, normalize_qk=True: cls(
      N, F, 16, 24, num_kv_heads=2, decode=False, normalize_qk=normalize_qk,
      rngs=nnx.Rngs(seed))
  for normalize_qk in (False, True):
    ours, theirs = (nnx.state(make(cls, 21, normalize_qk), nnx.Param)
                    for cls in (jnnx.MultiHeadAttention,
                                nnx.MultiHeadAttention))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), ours,
                 theirs)
    assert set(ours.keys()) >= {"query", "key", "value", "out"}
    assert ("query_ln" in ours) == ("key_ln" in ours) == normalize_qk
  call = nnx.jit(lambda m, x: m(x, is_causal=True))
  ours, theirs = make(jnnx.MultiHeadAttention, 0), \
      make(nnx.MultiHeadAttention, 0)
  nnx.update(ours, nnx.state(make(nnx.MultiHeadAttention, 22), nnx.Param))
  nnx.update(theirs, nnx.state(make(jnnx.MultiHeadAttention, 22), nnx.Param))
  _close(call(ours, x), call(theirs, x))
  assert np.abs(np.asarray(call(ours, x) - call(
      make(jnnx.MultiHeadAttention, 0), x))).max() > 1e-2  # really loaded


def test_linen_module_segment_ids_match_block_diagonal_mask():
  x = _normal(24, (B, T, F))
  ids = _segments(25, (B, T))
  ours, theirs = jlinen.MultiHeadAttention(num_heads=N), \
      nn.MultiHeadDotProductAttention(num_heads=N)
  variables = theirs.init(jax.random.key(26), x)
  dense = nn.combine_masks(nn.make_attention_mask(ids, ids, jnp.equal),
                           nn.make_causal_mask(ids))
  got = jax.jit(lambda v, x, ids: ours.apply(v, x, segment_ids=ids,
                                             is_causal=True))(variables, x, ids)
  want = jax.jit(lambda v, x, m: theirs.apply(v, x, mask=m))(variables, x,
                                                              dense)
  _close(got, want)


def test_nnx_module_segment_ids_match_block_diagonal_mask():
  x = _normal(27, (B, T, F))
  ids = _segments(28, (B, T))
  make = lambda cls: cls(N, F, num_kv_heads=2, decode=False, rngs=nnx.Rngs(29))
  ours, theirs = make(jnnx.MultiHeadAttention), make(nnx.MultiHeadAttention)
  dense = nn.make_attention_mask(ids, ids, jnp.equal)
  got = nnx.jit(lambda m, x, ids: m(x, segment_ids=ids, is_causal=True))(
      ours, x, ids)
  want = nnx.jit(lambda m, x, d: m(x, mask=d, is_causal=True))(theirs, x,
                                                               dense)
  _close(got, want)


def test_linen_module_window_and_soft_cap_applied():
  x = _normal(30, (B, T, F))
  module = jlinen.MultiHeadAttention(num_heads=N, local_window_size=(3, 1),
                                     logits_soft_cap=1.0, implementation="xla")
  params = jax.jit(module.init)(jax.random.key(31), x)["params"]
  got = jax.jit(lambda p, x: module.apply({"params": p}, x))(params, x)
  q, k, v = _linen_project(params, x)
  visible = _window(T, T, 3, 1)
  want = _linen_out(params, _naive(q, k, v, visible, cap=1.0))
  _close(got, want)
  plain = _linen_out(params, _naive(q, k, v, np.ones((T, T), bool)))
  assert np.abs(np.asarray(want) - np.asarray(plain)).max() > 1e-2


def test_nnx_module_window_cap_and_lengths_applied():
  x = _normal(32, (B, T, F))
  module = jnnx.MultiHeadAttention(N, F, num_kv_heads=2, decode=False,
                                   local_window_size=4, logits_soft_cap=1.5,
                                   implementation=["cudnn", "xla"],
                                   rngs=nnx.Rngs(33))
  q_len, kv_len = jnp.array([T, 9]), jnp.array([11, 6])
  got = nnx.jit(lambda m, x, a, b: m(x, is_causal=True, query_seq_lengths=a,
                                     key_value_seq_lengths=b))(
                                         module, x, q_len, kv_len)
  q, k, v = module.query(x), module.key(x), module.value(x)
  visible = (_window(T, T, 4, 4) & np.tri(T, dtype=bool))[None, None] & (
      np.arange(T)[:, None] < np.asarray(q_len)[:, None, None, None]) & (
          np.arange(T) < np.asarray(kv_len)[:, None, None, None])
  want = module.out(jnp.asarray(_naive(q, k, v, visible, cap=1.5),
                                jnp.float32))
  _close(got, want)


@pytest.mark.parametrize("window", [None, 3])
def test_linen_module_decode_matches_causal(window):
  x = _normal(34, (B, 10, F))
  decoder = jlinen.MultiHeadAttention(num_heads=N, decode=True,
                                      local_window_size=window)
  variables = jax.jit(decoder.init)(jax.random.key(35), x)
  flax_cache = nn.MultiHeadDotProductAttention(num_heads=N, decode=True).init(
      jax.random.key(35), x)["cache"]
  assert jax.tree.structure(variables["cache"]) == jax.tree.structure(
      flax_cache)
  params, cache = variables["params"], variables["cache"]
  full = jlinen.MultiHeadAttention(num_heads=N, local_window_size=window)
  want = jax.jit(lambda p, x: full.apply({"params": p}, x, is_causal=True))(
      params, x)
  step = jax.jit(lambda p, c, xt: decoder.apply(
      {"params": p, "cache": c}, xt, mutable=["cache"]))
  for t in range(x.shape[1]):
    out, updates = step(params, cache, x[:, t:t + 1])
    cache = updates["cache"]
    _close(out[:, 0], want[:, t])
  assert int(cache["cache_index"]) == x.shape[1]
  # A decode step that falls back to Flax (sow_weights) uses a dense
  # occupancy/window mask instead of lengths: same output, stored weights.
  cache = dict(cache, cache_index=jnp.array(6, jnp.int32))  # rewind
  with pytest.warns(UserWarning, match="sow"):
    out, state = decoder.apply({"params": params, "cache": cache},
                               x[:, 6:7], sow_weights=True,
                               mutable=["cache", "intermediates"])
  _close(out[:, 0], want[:, 6])
  (weights,) = state["intermediates"]["attention_weights"]
  visible = np.arange(10) <= 6
  if window is not None:
    visible &= np.arange(10) >= 6 - window
  assert np.all(np.asarray(weights)[..., ~visible] == 0)
  assert np.all(np.asarray(weights)[..., visible] > 0)


@pytest.mark.parametrize("window", [None, 2])
def test_nnx_module_decode_matches_causal(window):
  x = _normal(36, (B, 10, F))
  module = jnnx.MultiHeadAttention(N, F, num_kv_heads=2, decode=False,
                                   local_window_size=window, rngs=nnx.Rngs(37))
  want = nnx.jit(lambda m, x: m(x, is_causal=True))(module, x)
  module.init_cache(x.shape)
  step = nnx.jit(lambda m, xt: m(xt, decode=True))
  for t in range(x.shape[1]):
    _close(step(module, x[:, t:t + 1])[:, 0], want[:, t])
  assert int(module.cache_index[...]) == x.shape[1]


# --------------------------------------------------------------------------
# Fallback to Flax's attention and refusals
# --------------------------------------------------------------------------

def test_attention_fn_dropout_falls_back_to_flax():
  q, k, v = (_normal(i, (B, T, N, 8)) for i in (38, 39, 40))
  mask = nn.make_causal_mask(jnp.ones((B, T)))
  kw = dict(mask=mask, dropout_rng=jax.random.key(41), dropout_rate=0.3,
            deterministic=False)
  with pytest.warns(UserWarning, match="dropout_rate"):
    got = jf.attention_fn(q, k, v, **kw)
  want = nn.dot_product_attention(q, k, v, **kw)
  np.testing.assert_array_equal(got, want)
  no_dropout = jax.jit(jf.attention_fn)(q, k, v, mask=mask)
  assert np.abs(np.asarray(got - no_dropout)).max() > 0.1
  with pytest.warns(UserWarning, match="precision"):
    got = jf.attention_fn(q, k, v, mask=mask, precision="highest")
  _close(got, nn.dot_product_attention(q, k, v, mask=mask, precision="highest"))
  # GQA through the Linen fallback (key/value heads repeated) with is_causal.
  k2, v2 = k[:, :, :2], v[:, :, :2]
  with pytest.warns(UserWarning, match="precision"):
    got = jf.attention_fn(q, k2, v2, is_causal=True, precision="highest")
  _close(got, jax.nn.dot_product_attention(q, k2, v2, is_causal=True))


def test_linen_modules_dropout_fall_back_to_flax():
  x = _normal(42, (B, T, F))
  cfg = dict(num_heads=N, dropout_rate=0.3, deterministic=False)
  theirs = nn.MultiHeadDotProductAttention(**cfg)
  variables = theirs.init(jax.random.key(43), x)
  rngs = {"dropout": jax.random.key(44)}
  want = theirs.apply(variables, x, rngs=rngs)
  for ours in (nn.MultiHeadDotProductAttention(attention_fn=jf.attention_fn,
                                               **cfg),
               jlinen.MultiHeadAttention(**cfg)):
    with pytest.warns(UserWarning, match="dropout"):
      got = ours.apply(variables, x, rngs=rngs)
    _close(got, want)
  no_dropout = nn.MultiHeadDotProductAttention(num_heads=N)
  assert np.abs(np.asarray(want - no_dropout.apply(variables, x))).max() > 0.1


def test_nnx_module_dropout_falls_back_to_flax():
  x = _normal(45, (B, T, F))
  make = lambda cls: cls(N, F, dropout_rate=0.3, deterministic=False,
                         decode=False, rngs=nnx.Rngs(46))
  ours, theirs = make(jnnx.MultiHeadAttention), make(nnx.MultiHeadAttention)
  with pytest.warns(UserWarning, match="dropout"):
    got = ours(x, is_causal=True)
  _close(got, theirs(x, is_causal=True))


def test_sow_weights_fall_back_and_store_weights():
  x = _normal(47, (B, T, F))
  ours, theirs = jlinen.MultiHeadAttention(num_heads=N), \
      nn.MultiHeadDotProductAttention(num_heads=N)
  variables = theirs.init(jax.random.key(48), x)
  with pytest.warns(UserWarning, match="sow"):
    got, state = ours.apply(variables, x, is_causal=True, sow_weights=True,
                            mutable=["intermediates"])
  mask = nn.make_causal_mask(jnp.ones((B, T)))
  want, want_state = theirs.apply(variables, x, mask=mask, sow_weights=True,
                                  mutable=["intermediates"])
  _close(got, want)
  (weights,) = state["intermediates"]["attention_weights"]
  (want_weights,) = want_state["intermediates"]["attention_weights"]
  assert weights.shape == (B, N, T, T)
  _close(weights, want_weights)
  plugged = nn.MultiHeadDotProductAttention(num_heads=N,
                                            attention_fn=jf.attention_fn)
  with pytest.warns(UserWarning, match="sow"):
    got, state = plugged.apply(variables, x, mask=mask, sow_weights=True,
                               mutable=["intermediates"])
  _close(got, want)
  _close(state["intermediates"]["attention_weights"][0], want_weights)

  make = lambda cls: cls(N, F, decode=False, rngs=nnx.Rngs(49))
  ours, theirs = make(jnnx.MultiHeadAttention), make(nnx.MultiHeadAttention)
  with pytest.warns(UserWarning, match="sow"):
    got = ours(x, is_causal=True, sow_weights=True)
  _close(got, theirs(x, is_causal=True, sow_weights=True))
  (weights,) = nnx.pop(ours, nnx.Intermediate)["attention_weights"]
  (want_weights,) = nnx.pop(theirs, nnx.Intermediate)["attention_weights"]
  _close(weights, want_weights)
  assert np.all(np.triu(np.asarray(weights), 1) == 0)


def test_fallback_with_jflash_only_argument_raises():
  q = _normal(50, (B, T, N, 8))
  ids = _segments(51, (B, T))
  with pytest.raises(NotImplementedError, match="dropout.*segment_ids"):
    jf.attention_fn(q, q, q, dropout_rng=jax.random.key(0), dropout_rate=0.1,
                    segment_ids=ids)
  with pytest.raises(NotImplementedError, match="module.*logits_soft_cap"):
    jf.attention_fn(q, q, q, module=object(), logits_soft_cap=5.0)
  x = _normal(52, (B, T, F))
  module = jlinen.MultiHeadAttention(num_heads=N, dropout_rate=0.1,
                                     deterministic=False)
  variables = module.init(jax.random.key(53), x)
  with pytest.raises(NotImplementedError, match="segment_ids"):
    module.apply(variables, x, segment_ids=ids,
                 rngs={"dropout": jax.random.key(54)})
  module = jlinen.MultiHeadAttention(num_heads=N, logits_soft_cap=3.0)
  with pytest.raises(NotImplementedError, match="logits_soft_cap"):
    module.apply(variables, x, sow_weights=True, mutable=["intermediates"])


def test_input_positions_and_custom_attention_fn_raise():
  x = _normal(55, (B, T, F))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  q = _normal(56, (B, T, N, 8))
  with pytest.raises(NotImplementedError, match="input_positions"):
    jf.attention_fn(q, q, q, input_positions=pos)
  flax_mha = nnx.MultiHeadAttention(N, F, attention_fn=jf.attention_fn,
                                    decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="input_positions"):
    flax_mha(x, input_positions=pos)
  with pytest.raises(NotImplementedError, match="input_positions"):
    jnnx.MultiHeadAttention(N, F, decode=False, rngs=nnx.Rngs(0))(
        x, input_positions=pos)
  custom = functools.partial(nn.dot_product_attention, precision="highest")
  with pytest.raises(ValueError, match="attention_fn"):
    jlinen.MultiHeadAttention(num_heads=N, attention_fn=custom).init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="attention_fn"):
    jnnx.MultiHeadAttention(N, F, attention_fn=custom, rngs=nnx.Rngs(0))
  # implementation is forwarded to jflash.dot_product_attention.
  with pytest.raises(ValueError, match="unknown backend"):
    jlinen.MultiHeadAttention(num_heads=N, implementation="nope").init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="unknown backend"):
    jnnx.MultiHeadAttention(N, F, implementation="nope", decode=False,
                            rngs=nnx.Rngs(0))(x)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------

def _data():
  x = _normal(57, (B, T, F))
  y = jnp.tanh(jnp.cumsum(x, axis=1) / 4)  # causal target
  return x, y, _segments(58, (B, T))


def test_linen_module_trains():
  x, y, ids = _data()
  model = jlinen.MultiHeadAttention(num_heads=N, logits_soft_cap=20.0)
  params = jax.jit(model.init)(jax.random.key(59), x)["params"]
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)
  loss_fn = lambda p: jnp.mean((model.apply(
      {"params": p}, x, is_causal=True, segment_ids=ids) - y) ** 2)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(15):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.6 * losses[0], losses


def test_nnx_module_trains():
  x, y, ids = _data()
  model = jnnx.MultiHeadAttention(N, F, num_kv_heads=2, decode=False,
                                  local_window_size=(8, 0), rngs=nnx.Rngs(60))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss_fn = lambda m: jnp.mean((m(x, segment_ids=ids) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(15)]
  assert losses[-1] < 0.6 * losses[0], losses
