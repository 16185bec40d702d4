"""The public contract: input validation, dispatch, and equivalence with
``jax.nn.dot_product_attention`` on every argument the two share."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash.backends import XlaBackend, XlaConfig
from tests._support import (Case, extremes, fresh_rng, integer_array,
                            integer_sources, random_normal, random_qkv,
                            random_segments, rel_err, saturated_int32)


_rng = fresh_rng
_qkv = random_qkv


# ---------------------------------------------------------------- errors
def _bad_inputs(rng):
  q, k, v = _qkv(rng)
  ids = jnp.zeros((2, 12), jnp.int32)
  yield "head dim", dict(query=q[..., :8]), r"head dim"
  yield "heads", dict(query=random_normal(rng, (2, 12, 3, 16), jnp.float32)), \
      r"multiple of key/value heads"
  yield "batch", dict(key=k[:1], value=v[:1]), r"batch"
  yield "kv shape", dict(value=v[:, :5]), r"same shape"
  yield "rank", dict(query=q[0, 0]), r"\[B, T, N, H\]"
  yield "mixed rank", dict(query=q[0]), r"same rank"
  yield "int query", dict(query=q.astype(jnp.int32)), r"query must have a floating"
  yield "int key", dict(key=k.astype(jnp.int32), value=v.astype(jnp.int32)), \
      r"key must have a floating"
  yield "dtype mix", dict(key=k.astype(jnp.bfloat16),
                          value=v.astype(jnp.bfloat16)), r"same dtype"
  yield "segment shape", dict(segment_ids=ids[:, :5]), r"segment_ids"
  yield "segment dtype", dict(segment_ids=ids.astype(jnp.float32)), \
      r"segment_ids .* integer"
  yield "segment pair", dict(segment_ids=(ids, ids, ids)), r"pair"
  yield "segment T != S", dict(key=k[:, :7], value=v[:, :7],
                               segment_ids=ids), r"T == S"
  yield "window negative", dict(local_window_size=-1), r"local_window_size"
  yield "window pair negative", dict(local_window_size=(3, -2)), \
      r"local_window_size"
  yield "window type", dict(local_window_size=(1.5, 2)), r"local_window_size"
  yield "lengths shape", dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), \
      r"query_seq_lengths"
  yield "lengths dtype", dict(key_value_seq_lengths=jnp.ones((2,))), \
      r"key_value_seq_lengths"
  yield "mask dtype", dict(mask=jnp.ones((2, 1, 12, 12))), r"mask must be boolean"
  yield "mask shape", dict(mask=jnp.ones((2, 3, 12, 12), bool)), \
      r"mask must be broadcastable"
  yield "bias shape", dict(bias=jnp.ones((2, 4, 12, 5))), \
      r"bias must be broadcastable"
  yield "bias rank", dict(bias=jnp.ones((1, 2, 4, 12, 12))), r"bias must have"
  yield "bias int", dict(bias=jnp.ones((12, 12), jnp.int32)), r"bias must have"
  yield "soft cap", dict(logits_soft_cap=0.0), r"logits_soft_cap"
  yield "scale nan", dict(scale=float("nan")), r"scale"
  yield "causal", dict(is_causal="yes"), r"is_causal"
  yield "implementation", dict(implementation="flash"), r"unknown backend"
  yield "implementation empty", dict(implementation=[]), r"implementation"
  yield "implementation type", dict(implementation=3), r"implementation"
  yield "residual", dict(return_residual=2), r"return_residual"
  yield "causal int", dict(is_causal=2), r"is_causal"
  yield "causal array", dict(is_causal=np.array([True, False])), r"is_causal"
  yield "window array shape", dict(local_window_size=np.array([1, 2, 3])), \
      r"local_window_size"
  yield "window bool", dict(local_window_size=True), r"local_window_size"
  yield "window float array", dict(local_window_size=np.array([1.0, 2.0])), \
      r"local_window_size"
  yield "soft cap past float32", dict(logits_soft_cap=1e39), \
      r"logits_soft_cap"
  yield "soft cap below float32", dict(logits_soft_cap=1e-45), \
      r"logits_soft_cap"
  yield "scale past float32", dict(scale=1e39), r"scale"
  yield "scale over soft cap", dict(scale=1e20, logits_soft_cap=1e-20), \
      r"scale / logits_soft_cap"
  yield "interpret", dict(interpret="yes"), r"interpret must be a bool"


# Collection needs only the names; each test draws its inputs from its own
# seed.
_BAD_INPUT_NAMES = [c[0] for c in _bad_inputs(np.random.default_rng(0))]


@pytest.mark.parametrize("name", _BAD_INPUT_NAMES)
def test_bad_input_raises_value_error(name):
  rng = _rng()
  q, k, v = _qkv(rng)
  override, pattern = {n: (o, p) for n, o, p in _bad_inputs(rng)}[name]
  args = dict(query=q, key=k, value=v)
  args.update(override)
  with pytest.raises(ValueError, match=pattern):
    jflash.dot_product_attention(**args)


def test_traced_scale_is_rejected():
  q, k, v = _qkv(_rng())
  with pytest.raises(ValueError, match="scale must be a Python number"):
    jax.jit(lambda s: jflash.dot_product_attention(q, k, v, scale=s))(0.5)


@pytest.mark.parametrize("name", ["mask", "bias"])
def test_broadcast_error_shows_the_shape_passed(name):
  """The message shows the array as passed, not with the leading axes of
  size 1 that canonicalization adds."""
  q, k, v = _qkv(_rng())
  given = jnp.ones((3, 12, 12), bool if name == "mask" else jnp.float32)
  with pytest.raises(ValueError) as info:
    jflash.dot_product_attention(q, k, v, **{name: given})
  message = str(info.value)
  assert message.startswith(name) and "shape (3, 12, 12)" in message
  assert "(1, 3, 12, 12)" not in message and "leading axes" in message


@pytest.mark.parametrize("flag", ["is_causal", "local_window_size"])
def test_traced_structural_arguments_are_rejected_by_name(flag):
  q, k, v = _qkv(_rng())
  value = jnp.asarray(True) if flag == "is_causal" else jnp.asarray([2, 0])
  with pytest.raises(ValueError, match=f"{flag} must be .*traced"):
    jax.jit(lambda x: jflash.dot_product_attention(q, k, v, **{flag: x}))(
        value)


def test_error_message_shows_received_shapes():
  q, k, v = _qkv(_rng())
  with pytest.raises(ValueError, match=r"\(2, 12, 4, 8\)"):
    jflash.dot_product_attention(q[..., :8], k, v)


# -------------------------------------------------------------- dispatch
def test_default_order_per_platform():
  assert jflash.default_order("cpu") == ("xla",)
  assert jflash.default_order("gpu") == ("cudnn", "mosaic_gpu", "xla")
  assert jflash.default_order("tpu") == ("mosaic_tpu", "xla")


def test_unbuilt_kernels_decline_clearly():
  q, k, v = _qkv(_rng())
  with pytest.raises(NotImplementedError, match="mosaic_gpu"):
    jflash.dot_product_attention(q, k, v, implementation="mosaic_gpu")


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="off-TPU only")
def test_tpu_kernels_decline_off_tpu_unless_interpreted():
  q, k, v = _qkv(_rng())
  with pytest.raises(NotImplementedError,
                     match=r"mosaic_tpu: needs a TPU.*interpret=True"):
    jflash.dot_product_attention(q, k, v, implementation="mosaic_tpu")
  out = jflash.dot_product_attention(q, k, v, implementation="mosaic_tpu",
                                     interpret=True)
  want = jflash.dot_product_attention(q, k, v, implementation="xla")
  assert rel_err(out, want) < 1e-5


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU/TPU only")
def test_cudnn_declines_off_gpu_and_sequence_falls_through():
  q, k, v = _qkv(_rng(), dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="cudnn"):
    jflash.dot_product_attention(q, k, v, implementation="cudnn")
  out = jflash.dot_product_attention(q, k, v, implementation=("cudnn", "xla"))
  want = jflash.dot_product_attention(q, k, v, implementation="xla")
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(want, np.float32))
  assert jflash.selected_implementation(
      q, k, v, implementation=["mosaic_gpu", "cudnn", "xla"]) == "xla"


def test_interpret_declined_by_cudnn_and_ignored_by_xla():
  q, k, v = _qkv(_rng(), dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="interpret"):
    jflash.dot_product_attention(q, k, v, implementation="cudnn",
                                 interpret=True)
  out = jflash.dot_product_attention(q, k, v, implementation="xla",
                                     interpret=True)
  want = jflash.dot_product_attention(q, k, v, implementation="xla")
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(want, np.float32))


def test_error_lists_every_declining_backend():
  q, k, v = _qkv(_rng())
  # Neither serves a dense boolean mask, on any platform.
  mask = jnp.ones((12, 12), bool)
  with pytest.raises(NotImplementedError) as info:
    jflash.dot_product_attention(q, k, v, mask=mask,
                                 implementation=["mosaic_tpu", "cudnn"])
  assert "mosaic_tpu" in str(info.value) and "cudnn" in str(info.value)


def test_selected_implementation_on_this_platform():
  q, k, v = _qkv(_rng())
  name = jflash.selected_implementation(q, k, v, is_causal=True)
  assert name in jflash.default_order()
  if jax.default_backend() == "cpu":
    assert name == "xla"


def test_configured_backend_object():
  rng = _rng()
  q, k, v = _qkv(rng, t=40, s=40)
  small = XlaBackend(XlaConfig(block_q=8, block_kv=8))
  a = jflash.dot_product_attention(q, k, v, is_causal=True,
                                   implementation=small)
  b = jflash.dot_product_attention(q, k, v, is_causal=True)
  assert rel_err(a, b) < 1e-6
  with pytest.raises(ValueError, match="block_q"):
    XlaConfig(block_q=0)


def test_empty_sequences():
  rng = _rng()
  q, k, v = _qkv(rng, s=12)
  out, lse = jflash.dot_product_attention(q, k[:, :0], v[:, :0],
                                          return_residual=True)
  assert out.shape == q.shape and not np.asarray(out).any()
  assert np.isneginf(np.asarray(lse)).all()
  g = jax.grad(lambda q: jflash.dot_product_attention(q, k, v)[:, :0].sum())(q)
  assert not np.asarray(g).any()


def test_empty_axes_match_jax_nn_shapes():
  """Batch, query length and heads of size 0 give the empty arrays jax.nn
  gives, forward and backward (values: the conformance suite)."""
  rng = _rng()
  for b, t, s, n in ((0, 8, 8, 2), (2, 0, 8, 2), (2, 8, 8, 0)):
    q = random_normal(rng, (b, t, n, 16), jnp.float32)
    k = v = random_normal(rng, (b, s, 1, 16), jnp.float32)
    for fn in (jflash.dot_product_attention, jax.nn.dot_product_attention):
      out, lse = fn(q, k, v, is_causal=True, return_residual=True)
      grads = jax.grad(lambda *a: fn(*a).sum(), (0, 1, 2))(q, k, v)
      assert out.shape == q.shape and lse.shape == q.shape[:-1]
      assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert jflash.selected_implementation(q, k, v) == "xla"


def test_traced_64_bit_segment_ids():
  """Traced int64 ids (x64) keep ids that differ only above bit 31 apart:
  the result equals the reference on the small ids they stand for."""
  rng = _rng()
  q, k, v = _qkv(rng, t=24, s=24)
  small = jnp.asarray(random_segments(rng, 2, 24))
  with jax.enable_x64(True):
    wide = (jnp.asarray(small, jnp.int64) * 2**32 + 9) * (-1) ** small
    fn = jax.jit(lambda q, ids: jflash.dot_product_attention(
        q, k, v, segment_ids=ids, is_causal=True))
    got = fn(q, wide)
  want, _ = Case(q, k, v, kwargs=dict(segment_ids=small, is_causal=True)
                 ).call_reference(q, k, v, None)
  assert rel_err(got, want) < 1e-5


def _distinct_labels(dtype: np.dtype) -> list[int]:
  """Four distinct segment ids ``dtype`` holds, its extremes among them,
  and for 64-bit dtypes two that agree in their low 32 bits."""
  low, high = extremes(dtype)
  labels = []
  for x in (5, low, high, 5 + 2**32, 0, 1):
    if low <= x <= high and x not in labels:
      labels.append(x)
  return labels[:4]


@pytest.mark.parametrize("dtype,source,x64", integer_sources())
def test_integer_arguments_of_every_dtype(dtype, source, x64):
  """``query_seq_lengths``, ``key_value_seq_lengths``, ``segment_ids``,
  ``local_window_size`` and ``is_causal`` in any integer dtype, on the
  host, on the device or traced, give the int32 call's result: lengths and
  window sides mean what the same values saturated to int32 mean (a
  dtype's extremes lie past every sequence), ids are compared exactly."""
  rng = _rng()
  low, high = extremes(dtype)
  t = s = 8
  q, k, v = _qkv(rng, b=4, t=t, s=s)
  q_lengths = [low, 3, t + 2, high]
  kv_lengths = [high, low, 6, s + 5]
  small_q = random_segments(rng, 4, t)
  small_kv = random_segments(rng, 4, s)
  labels = np.array(_distinct_labels(dtype), object)
  wide_q, wide_kv = labels[small_q].tolist(), labels[small_kv].tolist()

  def run(q_lengths, kv_lengths, q_ids, kv_ids, window, causal, jit):
    def attend(q_lengths, kv_lengths, q_ids, kv_ids):
      return jflash.dot_product_attention(
          q, k, v, query_seq_lengths=q_lengths,
          key_value_seq_lengths=kv_lengths, segment_ids=(q_ids, kv_ids),
          local_window_size=window, is_causal=causal, return_residual=True)
    return (jax.jit(attend) if jit else attend)(q_lengths, kv_lengths,
                                                q_ids, kv_ids)

  def scalar(x):
    return integer_array(x, dtype, source) if source == "jax" else dtype.type(x)

  with jax.enable_x64(x64):
    want = run(saturated_int32(q_lengths), saturated_int32(kv_lengths),
               small_q, small_kv, (2, int(saturated_int32(high))), True,
               source == "jit")
    got = run(*(integer_array(x, dtype, source)
                for x in (q_lengths, kv_lengths, wide_q, wide_kv)),
              (scalar(2), scalar(high)), scalar(1), source == "jit")
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6,
                                 atol=1e-6)
    if low < 0:
      with pytest.raises(ValueError, match="local_window_size"):
        jflash.dot_product_attention(q, k, v, local_window_size=scalar(-1))


# ---------------------------------------------------------- jax.nn parity
def _bool_and_int_like():
  yield "causal array", dict(is_causal=jnp.array(True)), {}
  yield "causal numpy", dict(is_causal=np.bool_(True)), {}
  yield "causal int", dict(is_causal=1), {}
  yield "residual int", dict(is_causal=True), dict(return_residual=1)
  yield "window numpy", dict(local_window_size=np.array([2, 0])), {}
  yield "window jax", dict(local_window_size=jnp.array([3, 1])), {}


@pytest.mark.parametrize("name,kwargs,extra", list(_bool_and_int_like()),
                         ids=[c[0] for c in _bool_and_int_like()])
def test_bool_and_int_like_arguments_match_jax_nn(name, kwargs, extra):
  """Concrete bool-like and int-like values jax.nn takes mean the same."""
  q, k, v = _qkv(_rng())
  ours = jflash.dot_product_attention(q, k, v, **kwargs, **extra)
  theirs = jax.nn.dot_product_attention(q, k, v, **kwargs, **extra,
                                        implementation="xla")
  if extra:
    assert isinstance(ours, tuple) and isinstance(theirs, tuple)
    ours, theirs = ours[0], theirs[0]
  assert rel_err(ours, theirs) < 1e-5
def _jax_nn_cases():
  yield "plain", {}, False, False
  yield "causal", dict(is_causal=True), False, False
  yield "window", dict(local_window_size=(3, 2)), False, False
  yield "window int", dict(local_window_size=4), False, False
  yield "causal window", dict(is_causal=True, local_window_size=(5, 0)), \
      False, False
  yield "lengths", "lengths", False, False
  yield "scale", dict(scale=0.37), False, False
  yield "bias", {}, True, False
  yield "mask", {}, False, True
  yield "tril mask", {}, False, "tril"
  yield "causal lengths", "causal lengths", False, False
  yield "tril mask lengths", "lengths", False, "tril"
  yield "bias causal", dict(is_causal=True), True, False
  yield "causal window right", dict(is_causal=True, local_window_size=(3, 2)), \
      False, False
  yield "everything", "everything", True, True


@pytest.mark.parametrize("name,kwargs,use_bias,use_mask", list(_jax_nn_cases()),
                         ids=[c[0] for c in _jax_nn_cases()])
@pytest.mark.parametrize("t,s", [(20, 20), (13, 29)])
def test_matches_jax_nn(name, kwargs, use_bias, use_mask, t, s):
  rng = _rng()
  q, k, v = _qkv(rng, t=t, s=s)
  if kwargs in ("lengths", "causal lengths", "everything"):
    kwargs = dict(query_seq_lengths=jnp.asarray([t, t // 2], jnp.int32),
                  key_value_seq_lengths=jnp.asarray([s, s // 3 + 1], jnp.int32))
    if name == "everything":
      kwargs.update(is_causal=True, local_window_size=(6, 1), scale=0.3)
    if name == "causal lengths":
      kwargs.update(is_causal=True)
  bias = random_normal(rng, (1, 4, t, s), jnp.float32) if use_bias else None
  mask = None
  if use_mask == "tril":  # a causal mask written out, as [1, 1, T, S]
    mask = jnp.tril(jnp.ones((t, s), bool))[None, None]
  elif use_mask:
    mask = jnp.asarray(rng.random((2, 1, t, s)) < 0.8)
  # Rows that see nothing: jax.nn returns an average of the values there,
  # jflash zeros (documented).  Compare the rows that see something.
  live = np.asarray(jax.jit(lambda: jflash.dot_product_attention(
      q, k, v, bias, mask, return_residual=True, **kwargs)[1])())
  live = np.isfinite(live)
  cot = random_normal(rng, q.shape, jnp.float32) * live[..., None]
  argnums = (0, 1, 2, 3) if use_bias else (0, 1, 2)

  def both(fn):
    def loss(q, k, v, bias):
      return jnp.sum(fn(q, k, v, bias, mask, **kwargs) * cot)
    out, lse = fn(q, k, v, bias, mask, return_residual=True, **kwargs)
    return out, lse, jax.grad(loss, argnums)(q, k, v, bias)

  ours, our_lse, ours_g = jax.jit(lambda: both(
      jflash.dot_product_attention))()
  theirs, their_lse, theirs_g = jax.jit(lambda: both(
      lambda *a, **kw: jax.nn.dot_product_attention(
          *a, implementation="xla", **kw)))()
  assert our_lse.dtype == their_lse.dtype and ours.dtype == theirs.dtype
  np.testing.assert_allclose(np.asarray(ours)[live], np.asarray(theirs)[live],
                             rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(our_lse)[live],
                             np.asarray(their_lse)[live], rtol=2e-5, atol=2e-5)
  for a, b in zip(ours_g, theirs_g):
    assert rel_err(a, b) < 2e-5


def test_matches_jax_nn_unbatched():
  rng = _rng()
  q, k, v = _qkv(rng, b=1)
  q, k, v = q[0], k[0], v[0]
  ours = jflash.dot_product_attention(q, k, v, is_causal=True)
  theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  assert ours.shape == theirs.shape == q.shape
  assert rel_err(ours, theirs) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16],
                         ids=["bf16", "f16"])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_vmapped_grouped_heads_match_jax_nn_on_repeated_heads(dtype, groups):
  """``jax.vmap`` over the batch of unbatched ``[T, N, H]`` inputs with N/G
  key/value heads equals jax.nn on key/value heads repeated G times; the
  key/value gradients are the repeated heads' gradients summed."""
  rng = _rng()
  b, t, n, h = 2, 40, 4, 32
  q, k, v = _qkv(rng, b=b, t=t, s=t, n=n, k=n // groups, h=h, dtype=dtype)
  cot = random_normal(rng, q.shape, dtype)
  ours = jax.vmap(lambda q, k, v: jflash.dot_product_attention(q, k, v))
  out, vjp = jax.vjp(ours, q, k, v)
  dq, dk, dv = vjp(cot)
  repeat = lambda x: jnp.repeat(x, groups, axis=2)
  want, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
      q, repeat(k), repeat(v), implementation="xla"), q, k, v)
  wq, wk, wv = vjp(cot)
  tol = 2e-2  # both sides round to the input dtype
  for got, ref in ((out, want), (dq, wq), (dk, wk), (dv, wv)):
    assert got.dtype == dtype and got.shape == ref.shape
    assert rel_err(got, ref) < tol


@pytest.mark.parametrize("batch", [1, 4])
def test_bias_gradient_of_vmapped_self_attention_matches_jax_nn(batch):
  """Self-attention (one array as query, key and value), a full ``[B, N, S,
  S]`` bias and a ``[1, 1, S]`` mask held fixed under ``jax.vmap``: the
  output and every gradient, the bias's included, equal jax.nn's."""
  rng = _rng()
  s, n, h = 48, 4, 32
  x = random_normal(rng, (batch, s, n, h), jnp.float32)
  bias = random_normal(rng, (batch, n, s, s), jnp.float32)
  mask = jnp.asarray(rng.random((1, 1, s)) < 0.8).at[..., 0].set(True)
  cot = random_normal(rng, x.shape, jnp.float32)

  def run(fn):
    attend = jax.vmap(lambda x, bias, mask: fn(x, x, x, bias, mask),
                      in_axes=(0, 0, None))
    out, vjp = jax.vjp(lambda x, bias: attend(x, bias, mask), x, bias)
    return (out, *vjp(cot))

  got = jax.jit(lambda: run(jflash.dot_product_attention))()
  want = jax.jit(lambda: run(lambda *a: jax.nn.dot_product_attention(
      *a, implementation="xla")))()
  for g, w in zip(got, want):
    assert rel_err(g, w) < 2e-5


def test_int32_segment_ids_are_used_as_given():
  """int32 ids reach the mask unchanged with no extra operation; only
  64-bit ids are ranked."""
  from jflash.attention import _canonicalize
  q, k, v = _qkv(_rng(), t=16, s=16)

  def canonical_ids(ids):
    call, _ = _canonicalize(
        q, k, v, None, None, scale=None, is_causal=False,
        query_seq_lengths=None, key_value_seq_lengths=None,
        local_window_size=None, segment_ids=ids, logits_soft_cap=None)
    return call.mask.q_segment_ids

  ids = jnp.asarray(random_segments(_rng(), 2, 16))
  jaxpr = jax.make_jaxpr(canonical_ids)(ids)
  assert not jaxpr.eqns and jaxpr.jaxpr.outvars == jaxpr.jaxpr.invars
  with jax.enable_x64(True):
    jaxpr = jax.make_jaxpr(canonical_ids)(ids.astype(jnp.int64))
  assert "sort" in str(jaxpr)


def test_segment_ids_as_nested_lists():
  """A list of two arrays is a (q, kv) pair; a nested list of numbers is one
  array of ids, also when its batch is 2 (the same rule as jflash.flax)."""
  rng = fresh_rng()
  q, k, v = random_qkv(rng, b=2, t=8, s=8, n=2, k=2, h=16)
  ids = random_segments(rng, 2, 8)
  want, _ = Case(q, k, v, kwargs=dict(segment_ids=jnp.asarray(ids))
                 ).call_reference(q, k, v, None)
  as_list = jflash.dot_product_attention(q, k, v, segment_ids=ids.tolist())
  as_pair = jflash.dot_product_attention(
      q, k, v, segment_ids=[jnp.asarray(ids), jnp.asarray(ids)])
  assert rel_err(as_list, want) < 1e-5
  assert rel_err(as_pair, want) < 1e-5
