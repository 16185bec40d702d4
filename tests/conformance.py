"""The conformance suite every backend runs (subclass per backend).

A backend's test class subclasses :class:`AttentionConformance`, sets
``implementation`` (a name or a configured backend object) and the
``supports_*`` flags.  Cases a backend does not support must raise
``NotImplementedError`` when that backend is requested alone (checked by
``test_unsupported_features_decline``); they never silently compute
something else.

Accuracy rules (FlashAttention's style):
  * float32 inputs: relative error against the float32 reference under
    ``F32_TOL`` for the output and ``F32_GRAD_TOL`` for every gradient.
  * bfloat16/float16 inputs: error at most twice that of a plain
    materialized implementation in the same dtype (``jax.nn``'s ``xla``
    arithmetic), plus ``LOW_PRECISION_FLOOR``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from tests._support import (Case, grads_of, lse_err, random_normal,
                            random_segments, rel_err, seeded_rng)

F32_TOL = 1e-5
# Gradients get a wider float32 bound.  The backward's dS = P (dP - delta)
# takes delta = rowsum(dO * O) rather than rowsum(P * dP) (FlashAttention's
# identity, which needs no extra pass over the keys).  In a row that sees
# one key, or is nearly one-hot, dP and delta agree to rounding, so dS is
# of order eps * |dO| |V| where the exact value is zero; with scale 1 and
# few visible pairs that reaches about 5e-5 of ||dQ|| (seen once in ~200
# random combined cases), while a wrong mask or tile is off by 1e-2 or more.
F32_GRAD_TOL = 1e-4
LOW_PRECISION_FLOOR = 2e-3

FEATURES = ("plain", "causal", "window", "causal_window", "lengths",
            "segments", "bias", "soft_cap", "mask", "scale", "combined")


def new_rng() -> tuple[np.random.Generator, int]:
  """The running test's next generator and its seed (tests/_seeds.py)."""
  return seeded_rng()


def build_case(rng: np.random.Generator, feature: str, *, dtype, batch=2,
               q_len=77, kv_len=77, heads=4, kv_heads=2, head_dim=32,
               bias_shape=None) -> Case:
  """Random inputs (never zeros) exercising one feature (or all of them)."""
  q = random_normal(rng, (batch, q_len, heads, head_dim), dtype)
  k = random_normal(rng, (batch, kv_len, kv_heads, head_dim), dtype)
  v = random_normal(rng, (batch, kv_len, kv_heads, head_dim), dtype)
  case = Case(q, k, v)
  kw: dict[str, Any] = {}
  combined = feature == "combined"
  if feature in ("causal", "causal_window") or combined:
    kw["is_causal"] = True
  if feature in ("window", "causal_window") or combined:
    # At least one key on each side: a window of only the query itself has
    # exactly zero dQ and dK, which no relative error can measure.
    kw["local_window_size"] = (int(rng.integers(1, 20)),
                               int(rng.integers(1, 20)))
  if feature == "lengths" or combined:
    kw["query_seq_lengths"] = jnp.asarray(
        rng.integers(0, q_len + 1, batch), jnp.int32)
    kw["key_value_seq_lengths"] = jnp.asarray(
        rng.integers(1, kv_len + 1, batch), jnp.int32)
  if feature == "segments" or combined:
    q_ids = random_segments(rng, batch, q_len)
    if q_len == kv_len and rng.random() < 0.5:
      kw["segment_ids"] = jnp.asarray(q_ids)
    else:
      kw["segment_ids"] = (jnp.asarray(q_ids),
                           jnp.asarray(random_segments(rng, batch, kv_len)))
  if feature == "bias" or combined:
    shape = bias_shape or (batch, 1, q_len, kv_len)
    case.bias = random_normal(rng, shape, dtype)
  if feature == "soft_cap" or combined:
    kw["logits_soft_cap"] = float(rng.uniform(1.0, 4.0))
    kw["scale"] = 1.0  # large logits so that the cap matters
  if feature == "mask" or combined:
    case.mask = jnp.asarray(rng.random((batch, heads, q_len, kv_len)) < 0.7)
  if feature == "scale":
    kw["scale"] = float(rng.uniform(0.05, 0.5))
  case.kwargs = kw
  return case


class AttentionConformance:
  """Shared conformance tests; subclasses pick the backend."""

  implementation: Any = None
  # Passed with every call: run Pallas kernels through the interpreter.
  interpret = False
  supports_bias = True
  supports_dense_mask = True
  supports_soft_cap = True
  supports_segments = True
  supports_noncausal_window = True
  supports_residual = True
  dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
  head_dims = (32, 64, 80, 128, 256)
  # Sequence length of the feature tests: not a multiple of any block size.
  feature_len = 77

  # ---------------------------------------------------------------- core
  @property
  def backend_kwargs(self) -> dict[str, Any]:
    """The keyword arguments that select this class's backend."""
    return dict(implementation=self.implementation, interpret=self.interpret)

  def supported(self, case: Case, dtype) -> bool:
    """Whether the backend must serve ``case``; otherwise it must raise
    ``NotImplementedError``."""
    kw = case.kwargs
    return ((self.supports_bias or case.bias is None)
            and (self.supports_dense_mask or case.mask is None)
            and (self.supports_soft_cap or "logits_soft_cap" not in kw)
            and (self.supports_segments or "segment_ids" not in kw)
            and (self.supports_noncausal_window or kw.get("is_causal", False)
                 or "local_window_size" not in kw)
            and dtype in self.dtypes
            and case.query.shape[-1] in self.head_dims)

  def attention(self, case: Case):
    def fn(q, k, v, bias):
      return case.call_jflash(q, k, v, bias,
                              **self.backend_kwargs)
    return fn

  def check_case(self, case: Case, dtype, seed: int):
    """Output, logsumexp and every gradient against the reference, each
    side computed in one compiled function."""
    if not self.supported(case, dtype):
      # Declining loudly is the contract for what a backend cannot do.
      with pytest.raises(NotImplementedError):
        case.call_jflash(*case.arrays, **self.backend_kwargs)
      return
    info = f"seed={seed} kwargs={list(case.kwargs)} dtype={dtype.__name__}"
    rng = np.random.default_rng(seed + 1)
    # The cotangent is representable in the input dtype, so every side
    # differentiates against the same numbers.
    cot = random_normal(rng, case.query.shape, dtype)
    residual = self.supports_residual

    def ours(*arrays):
      def f(*a):
        r = case.call_jflash(*a, **self.backend_kwargs,
                             return_residual=residual)
        return r if residual else (r, None)
      (out, lse), vjp = jax.vjp(f, *arrays)
      zero_lse = None if lse is None else jnp.zeros_like(lse)
      return out, lse, vjp((cot, zero_lse))

    def exact(*arrays):
      up = [None if a is None else a.astype(jnp.promote_types(
          a.dtype, jnp.float32)) for a in arrays]
      (out, lse), vjp = jax.vjp(
          lambda *a: case.call_reference(*a, jit=False), *up)
      return out, lse, vjp((cot.astype(out.dtype), jnp.zeros_like(lse)))

    def plain(*arrays):
      out, vjp = jax.vjp(lambda *a: case.call_plain(*a, jit=False), *arrays)
      return out, vjp(cot)

    try:
      out, lse, got = jax.jit(ours)(*case.arrays)
    except NotImplementedError as err:
      if self.may_decline(case):
        pytest.skip(f"declined (allowed for this backend): {err}")
      raise
    ref_out, ref_lse, want = jax.jit(exact)(*case.arrays)
    assert out.dtype == case.query.dtype and out.shape == case.query.shape
    assert not np.isnan(np.asarray(out, np.float32)).any(), info
    # Rows that see nothing are exact zeros.
    dead = np.isneginf(np.asarray(ref_lse))
    assert np.all(np.asarray(out, np.float32)[dead] == 0), info
    if residual:
      self.check_logsumexp(lse, ref_lse, out, dtype, info)
    else:
      with pytest.raises(NotImplementedError):
        case.call_jflash(*case.arrays, **self.backend_kwargs,
                         return_residual=True)
    names = ["out", "dq", "dk", "dv", "dbias"]
    got, want = [out, *got], [ref_out, *want]
    if case.bias is not None and case.bias.shape[-1] == 1:
      # A bias constant along the keys cancels in the softmax: its exact
      # gradient is zero, so only an absolute bound makes sense.
      assert float(jnp.abs(got[4].astype(jnp.float32)).max()) < 1e-3, info
      got[4] = want[4] = None
    if dtype == jnp.float32:
      bounds = [F32_TOL] + [F32_GRAD_TOL] * 4
    else:
      p_out, p_grads = jax.jit(plain)(*case.arrays)
      bounds = [None if p is None else 2 * rel_err(p, w) + LOW_PRECISION_FLOOR
                for p, w in zip([p_out, *p_grads], want)]
    for name, g, w, bound, x in zip(names, got, want, bounds,
                                    (case.query,) + case.arrays):
      if g is None:
        continue
      assert g.dtype == x.dtype, f"{name} dtype {info}"
      assert rel_err(g, w) <= bound, f"{name} {info}"

  def check_logsumexp(self, lse, ref_lse, out, dtype, info: str):
    assert lse.shape == out.shape[:-1] and lse.dtype == out.dtype, info
    scale = max(1.0, float(np.max(np.abs(
        np.where(np.isfinite(ref_lse), ref_lse, 0)))))
    tol = F32_TOL if dtype == jnp.float32 else 2e-2
    assert lse_err(lse, ref_lse) < tol * scale, info

  def may_decline(self, case: Case) -> bool:
    """Cases the backend may either serve exactly or decline (a library
    underneath decides); declining must still be a NotImplementedError."""
    del case
    return False

  @property
  def main_dtype(self):
    """The dtype of single-dtype tests: float32 where supported."""
    return jnp.float32 if jnp.float32 in self.dtypes else self.dtypes[0]

  # --------------------------------------------------------------- tests
  @pytest.mark.parametrize("feature", FEATURES)
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                           ids=["f32", "bf16"])
  def test_feature(self, feature, dtype):
    rng, seed = new_rng()
    case = build_case(rng, feature, dtype=dtype, q_len=self.feature_len,
                      kv_len=self.feature_len)
    self.check_case(case, dtype, seed)

  @pytest.mark.parametrize("feature", ("causal", "window", "segments",
                                       "combined"))
  def test_feature_cross_attention(self, feature):
    rng, seed = new_rng()
    case = build_case(rng, feature, dtype=self.main_dtype, q_len=45, kv_len=100)
    self.check_case(case, self.main_dtype, seed)

  @pytest.mark.parametrize("q_len,kv_len", [(1, 1), (7, 7), (129, 129),
                                            (1000, 1000), (7, 129), (129, 7),
                                            (1, 1000)])
  def test_sequence_lengths(self, q_len, kv_len):
    rng, seed = new_rng()
    feature = "causal" if q_len == kv_len else "plain"
    case = build_case(rng, feature, dtype=self.main_dtype, batch=1, heads=2,
                      kv_heads=1, q_len=q_len, kv_len=kv_len)
    self.check_case(case, self.main_dtype, seed)

  def test_sequence_lengths_bf16(self):
    rng, seed = new_rng()
    case = build_case(rng, "segments", dtype=jnp.bfloat16, batch=1, heads=2,
                      kv_heads=2, q_len=300, kv_len=300)
    self.check_case(case, jnp.bfloat16, seed)

  @pytest.mark.parametrize("head_dim", (32, 64, 80, 128, 256))
  def test_head_dims(self, head_dim):
    rng, seed = new_rng()
    case = build_case(rng, "causal", dtype=self.main_dtype, batch=1, heads=2,
                      kv_heads=2, head_dim=head_dim, q_len=70, kv_len=70)
    self.check_case(case, self.main_dtype, seed)

  @pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)],
                           ids=["mha", "gqa", "mqa"])
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                           ids=["f32", "bf16"])
  def test_head_groups(self, heads, kv_heads, dtype):
    rng, seed = new_rng()
    case = build_case(rng, "combined", dtype=dtype, heads=heads,
                      kv_heads=kv_heads, q_len=50, kv_len=50)
    self.check_case(case, dtype, seed)

  @pytest.mark.parametrize("scale", (-0.3, 0.0), ids=["negative", "zero"])
  def test_nonpositive_scale(self, scale):
    """A scale <= 0 is legal: the row maximum must then be taken after
    scaling (kernels may fold a positive scale into their exponent)."""
    rng, seed = new_rng()
    case = build_case(rng, "causal", dtype=self.main_dtype, q_len=70,
                      kv_len=70)
    case.kwargs["scale"] = scale
    self.check_case(case, self.main_dtype, seed)

  def test_float16(self):
    rng, seed = new_rng()
    n = self.feature_len
    case = build_case(rng, "combined", dtype=jnp.float16, q_len=n, kv_len=n)
    self.check_case(case, jnp.float16, seed)

  @pytest.mark.parametrize("bias_shape", [(1, 1, 1, 64), (2, 4, 1, 1),
                                          (1, 4, 40, 64), (2, 1, 40, 1)])
  def test_bias_broadcasting(self, bias_shape):
    rng, seed = new_rng()
    case = build_case(rng, "bias", dtype=self.main_dtype, heads=4, kv_heads=2,
                      q_len=40, kv_len=64, bias_shape=bias_shape)
    self.check_case(case, self.main_dtype, seed)

  def test_unbatched_inputs(self):
    rng, seed = new_rng()
    case = build_case(rng, "segments", dtype=self.main_dtype, batch=1,
                      q_len=33, kv_len=33)
    ids = case.kwargs["segment_ids"]
    case.kwargs["segment_ids"] = (ids[0] if not isinstance(ids, tuple)
                                  else (ids[0][0], ids[1][0]))
    case.kwargs["is_causal"] = True
    case.query, case.key, case.value = (x[0] for x in case.arrays[:3])
    self.check_case(case, self.main_dtype, seed)

  def test_logsumexp_gradient(self):
    """The logsumexp is differentiable (``jax.nn`` stops its gradient)."""
    if not self.supports_residual or self.main_dtype != jnp.float32:
      pytest.skip("checked in float32 on backends that return a residual")
    rng, seed = new_rng()
    case = build_case(rng, "causal_window", dtype=self.main_dtype)
    case.kwargs["local_window_size"] = (5, 0)
    cot_out = random_normal(rng, case.query.shape, jnp.float32)
    cot_lse = random_normal(rng, case.query.shape[:-1], jnp.float32)

    def loss(fn):
      def inner(q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * cot_out) + jnp.sum(lse * cot_lse)
      return jax.grad(inner, argnums=(0, 1, 2))(*case.arrays[:3])

    got = loss(lambda q, k, v: case.call_jflash(
        q, k, v, None, **self.backend_kwargs,
        return_residual=True))
    want = loss(lambda q, k, v: case.call_reference(q, k, v, None))
    for g, w in zip(got, want):
      assert rel_err(g, w) < F32_GRAD_TOL, f"seed={seed}"

  def test_fully_masked_rows_are_zero(self):
    rng, seed = new_rng()
    n = self.feature_len
    case = build_case(rng, "lengths", dtype=self.main_dtype, q_len=n,
                      kv_len=n)
    case.kwargs["query_seq_lengths"] = jnp.asarray([0, 30], jnp.int32)
    case.kwargs["key_value_seq_lengths"] = jnp.asarray([n, 0], jnp.int32)
    out = jax.jit(self.attention(case))(*case.arrays)
    assert np.all(np.asarray(out, np.float32) == 0)
    if self.supports_residual:
      _, lse = case.call_jflash(*case.arrays, return_residual=True,
                                **self.backend_kwargs)
      assert np.all(np.isneginf(np.asarray(lse, np.float32)))
    cot = random_normal(rng, out.shape, jnp.float32)
    grads = jax.jit(lambda *a: grads_of(self.attention(case), Case(
        *a, kwargs=case.kwargs), cot))(*case.arrays)
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g))) and np.all(
          np.asarray(g) == 0), f"seed={seed}"

  def test_deterministic(self):
    rng, _ = new_rng()
    dtype, n = self.dtypes[-1], self.feature_len
    case = build_case(rng, "combined", dtype=dtype, q_len=n, kv_len=n)
    if not self.supported(case, dtype):
      case = build_case(rng, "causal", dtype=dtype, q_len=n, kv_len=n)
    cot = random_normal(rng, case.query.shape, jnp.float32)
    argnums = (0, 1, 2, 3) if case.bias is not None else (0, 1, 2)
    run = jax.jit(lambda *a: (self.attention(case)(*a), grads_of(
        self.attention(case), Case(*a, mask=case.mask, kwargs=case.kwargs),
        cot, argnums)))
    first = jax.tree.map(np.asarray, run(*case.arrays))
    second = jax.tree.map(np.asarray, run(*case.arrays))
    jax.tree.map(np.testing.assert_array_equal, first, second)

  def test_nan_input_propagates(self):
    rng, _ = new_rng()
    case = build_case(rng, "causal", dtype=self.main_dtype,
                      q_len=self.feature_len, kv_len=self.feature_len)
    case.query = case.query.at[1, 20, 0, 3].set(jnp.nan)
    out = case.call_jflash(*case.arrays, **self.backend_kwargs)
    out = np.asarray(out, np.float32)
    assert np.isnan(out[1, 20, 0]).all()
    clean = np.ones(out.shape[:3], bool)
    clean[1, 20, 0] = False
    assert np.isfinite(out[clean]).all()

  def test_unsupported_features_decline(self):
    """What the backend cannot do raises NotImplementedError, never drops."""
    rng, _ = new_rng()
    flags = {"bias": self.supports_bias, "mask": self.supports_dense_mask,
             "soft_cap": self.supports_soft_cap,
             "segments": self.supports_segments}
    for feature, ok in flags.items():
      if ok:
        continue
      case = build_case(rng, feature, dtype=self.dtypes[0])
      with pytest.raises(NotImplementedError):
        case.call_jflash(*case.arrays, **self.backend_kwargs)


  # ------------------------------------------------------------ edges
  # Inputs at the edges of the argument types: windows wider than any
  # sequence, ids and lengths beyond int32, extreme soft caps, empty axes,
  # and the whole path under ``jax_enable_x64``.  Where jflash must
  # reinterpret an argument (a huge window is an unbounded one, wide ids
  # are renumbered), the reference gets the same problem written the plain
  # way, so the test states the meaning independently of jflash's code.

  @pytest.mark.parametrize("window,is_causal,x64", [
      ((2**40, 0), False, True), ((2**31, 2**31), False, False),
      ((3, 2**63 - 1), False, True), (2**70, True, False)],
      ids=["2^40-left-x64", "2^31-both", "2^63-right-x64", "2^70-causal"])
  def test_windows_wider_than_the_sequences(self, window, is_causal, x64):
    rng, seed = new_rng()
    n = self.feature_len
    case = build_case(rng, "plain", dtype=self.main_dtype, q_len=n, kv_len=n)
    case.kwargs = dict(local_window_size=window, is_causal=is_causal)
    left, right = window if isinstance(window, tuple) else (window, window)
    t, s = np.arange(n)[:, None], np.arange(n)[None, :]
    # s - t lies in (-n, n): compare in Python ints, exact for any window.
    visible = np.vectorize(lambda d: -left <= int(d) <= right)(s - t)
    if is_causal:
      visible &= s <= t
    case.reference_kwargs = {}
    case.reference_mask = jnp.asarray(visible)
    with jax.enable_x64(x64):
      self.check_case(case, self.main_dtype, seed)

  @pytest.mark.parametrize("source", ["numpy", "numpy-x64", "jax-x64"])
  def test_segment_ids_beyond_int32(self, source):
    """Ids that agree in their low 32 bits but differ above are different
    documents."""
    rng, seed = new_rng()
    n = self.feature_len
    case = build_case(rng, "segments", dtype=self.main_dtype, q_len=n,
                      kv_len=n)
    small = random_segments(rng, 2, n)
    labels = np.array([5, 5 + 2**32, 5 - 2**40, 5 + 2**62], np.int64)
    wide = labels[rng.permutation(4)][small]
    case.reference_kwargs = dict(segment_ids=jnp.asarray(small))
    with jax.enable_x64(source.endswith("x64")):
      case.kwargs = dict(segment_ids=jnp.asarray(wide)
                         if source.startswith("jax") else wide)
      self.check_case(case, self.main_dtype, seed)

  @pytest.mark.parametrize("source", ["numpy", "jax-x64", "uint32"])
  def test_lengths_beyond_int32(self, source):
    """A length at or past the sequence length hides nothing."""
    rng, seed = new_rng()
    n = self.feature_len
    case = build_case(rng, "lengths", dtype=self.main_dtype, q_len=n,
                      kv_len=n)
    wide = np.array([2**32 + 3, n - 5], np.int64), np.array(
        [2**33, 2**32 - 1], np.int64)
    case.reference_kwargs = dict(
        query_seq_lengths=jnp.asarray([n, n - 5], jnp.int32),
        key_value_seq_lengths=jnp.asarray([n, n], jnp.int32))
    with jax.enable_x64(source == "jax-x64"):
      if source == "jax-x64":
        wide = tuple(jnp.asarray(x) for x in wide)
      elif source == "uint32":
        wide = (np.array([2**32 - 1, n - 5], np.uint32),
                jnp.asarray([2**31, 2**32 - 1], jnp.uint32))
      case.kwargs = dict(query_seq_lengths=wide[0],
                         key_value_seq_lengths=wide[1])
      self.check_case(case, self.main_dtype, seed)

  @pytest.mark.parametrize("cap", [1e-30, 1e30])
  def test_extreme_soft_caps(self, cap):
    """A tiny cap makes every logit about +-cap; a huge one changes
    nothing.  Neither may overflow a constant a backend derives."""
    rng, seed = new_rng()
    n = self.feature_len
    case = build_case(rng, "causal", dtype=self.main_dtype, q_len=n, kv_len=n)
    case.kwargs["logits_soft_cap"] = cap
    self.check_case(case, self.main_dtype, seed)

  @pytest.mark.parametrize("feature", ["causal_window", "segments",
                                       "combined"])
  def test_x64(self, feature):
    """The same results with ``jax_enable_x64`` on (Python scalars and
    index arithmetic then default to 64 bits)."""
    rng, seed = new_rng()
    n = self.feature_len
    with jax.enable_x64(True):
      case = build_case(rng, feature, dtype=self.main_dtype, q_len=n,
                        kv_len=n)
      self.check_case(case, self.main_dtype, seed)

  @pytest.mark.parametrize("empty", ["batch", "query", "key", "heads",
                                     "head_dim"])
  def test_empty_axes(self, empty):
    """An empty axis gives empty (or, for ``H == 0``, bias-only) results and
    gradients, as the reference defines them, on every backend."""
    rng, seed = new_rng()
    dims = dict(batch=2, query=20, key=24, heads=2, head_dim=16)
    dims[empty] = 0
    b, t, s, n, h = dims.values()
    dtype = self.main_dtype
    q = random_normal(rng, (b, t, n, h), dtype)
    k = random_normal(rng, (b, s, max(n // 2, 1), h), dtype)
    v = random_normal(rng, (b, s, max(n // 2, 1), h), dtype)
    bias = random_normal(rng, (b, n, t, s), dtype)
    case = Case(q, k, v, bias, kwargs=dict(is_causal=True))
    cot = random_normal(rng, q.shape, jnp.float32)
    cot_lse = random_normal(rng, q.shape[:-1], jnp.float32)

    def grads(fn):
      def loss(*arrays):
        out, lse = fn(*arrays)
        return (jnp.sum(out.astype(jnp.float32) * cot)
                + jnp.sum(jnp.where(jnp.isneginf(lse), 0, lse) * cot_lse))
      return fn(*case.arrays), jax.grad(loss, (0, 1, 2, 3))(*case.arrays)

    (out, lse), got = jax.jit(lambda: grads(lambda *a: case.call_jflash(
        *a, return_residual=True, **self.backend_kwargs)))()
    (ref_out, ref_lse), want = jax.jit(lambda: grads(
        lambda *a: case.call_reference(*a, jit=False)))()
    info = f"seed={seed} empty={empty}"
    assert out.shape == q.shape and out.dtype == dtype, info
    assert lse.shape == q.shape[:-1], info
    # Both logsumexps come back rounded to the input dtype (as in jax.nn):
    # allow that rounding (one ulp of bfloat16 is 2**-7 relative).
    tol = max(1e-3, 2 * float(jnp.finfo(dtype).eps))
    assert lse_err(lse, ref_lse) < tol * max(1.0, float(np.max(
        np.abs(np.where(np.isfinite(ref_lse), ref_lse, 0)), initial=0))), info
    for g, w, x in zip(got, want, case.arrays):
      assert g.shape == x.shape and g.dtype == x.dtype, info
      assert rel_err(g, w) < 1e-2, info
    assert jflash.selected_implementation(
        *case.arrays, case.mask, **case.kwargs,
        **self.backend_kwargs) == "xla", info
