"""The conformance suite on the ``xla`` backend, with small tiles so that
every case spans many of them (and once with the default tiling)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash.backends import XlaBackend, XlaConfig
from tests import conformance
from tests._support import fresh_rng, random_qkv


class TestXlaSmallTiles(conformance.AttentionConformance):
  implementation = XlaBackend(XlaConfig(block_q=16, block_kv=32))


class TestXlaDefaultTiles(conformance.AttentionConformance):
  implementation = "xla"

  # The default tiling is exercised on a subset; the rest is shared logic.
  test_feature = None
  test_head_groups = None
  test_bias_broadcasting = None
  test_head_dims = None
  test_windows_wider_than_the_sequences = None
  test_segment_ids_beyond_int32 = None
  test_lengths_beyond_int32 = None
  test_extreme_soft_caps = None
  test_empty_axes = None


class TestXlaFloat32Products(conformance.AttentionConformance):
  """``matmul_inputs="float32"``: low-precision inputs multiplied in
  float32 at HIGHEST precision (the default multiplies them in their own
  dtype)."""

  implementation = XlaBackend(XlaConfig(block_q=16, block_kv=32,
                                        matmul_inputs="float32"))
  test_head_groups = None
  test_bias_broadcasting = None
  test_head_dims = None
  test_sequence_lengths = None
  test_windows_wider_than_the_sequences = None
  test_segment_ids_beyond_int32 = None
  test_lengths_beyond_int32 = None
  test_empty_axes = None
  test_x64 = None


def test_config_rejects_unknown_matmul_inputs():
  with pytest.raises(ValueError, match="matmul_inputs"):
    XlaConfig(matmul_inputs="tf32")


def test_matmul_inputs_selects_the_product_dtype():
  """``"float32"`` computes bfloat16 inputs exactly as their float32 upcast
  (rounded once at the end); ``"auto"`` multiplies them in bfloat16."""
  q, k, v = random_qkv(fresh_rng(), b=2, t=40, s=40, n=4, k=2, h=32,
                       dtype=jnp.bfloat16)

  def run(matmul_inputs, *arrays):
    backend = XlaBackend(XlaConfig(block_q=16, block_kv=32,
                                   matmul_inputs=matmul_inputs))
    return np.asarray(jax.jit(lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=True, implementation=backend))(*arrays),
                      np.float32)

  upcast = run("auto", *(x.astype(jnp.float32) for x in (q, k, v)))
  rounded = np.asarray(jnp.asarray(upcast).astype(jnp.bfloat16), np.float32)
  np.testing.assert_array_equal(run("float32", q, k, v), rounded)
  assert not np.array_equal(run("auto", q, k, v), rounded)


def test_default_tiles_follow_the_window():
  """Without explicit blocks, a window's tiles shrink to about half its
  span (at least 64), so that a narrow band is not computed in 512-wide
  tiles; explicit blocks are kept."""
  from jflash.backends.xla.attention import default_block
  assert default_block(None) == 512
  assert [default_block(w) for w in (17, 130, 257, 600, 1025, 5000)] == [
      64, 64, 128, 256, 512, 512]
  q = jnp.zeros((1, 2048, 2, 16), jnp.float32)
  call, _ = jflash.attention._canonicalize(
      q, q, q, None, None, scale=None, is_causal=True,
      query_seq_lengths=None, key_value_seq_lengths=None,
      local_window_size=(16, 0), segment_ids=None, logits_soft_cap=None)
  assert XlaBackend()._plan(call).block_q == 64
  assert XlaBackend(XlaConfig(block_q=256, block_kv=128))._plan(
      call).block_kv == 128
