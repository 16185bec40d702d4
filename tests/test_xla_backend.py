"""The conformance suite on the ``xla`` backend, with small tiles so that
every case spans many of them (and once with the default tiling)."""

import pytest

from jflash.backends import XlaBackend, XlaConfig
from tests import conformance


class TestXlaSmallTiles(conformance.AttentionConformance):
  implementation = XlaBackend(XlaConfig(block_q=16, block_kv=32))


class TestXlaDefaultTiles(conformance.AttentionConformance):
  implementation = "xla"

  # The default tiling is exercised on a subset; the rest is shared logic.
  test_feature = None
  test_head_groups = None
  test_bias_broadcasting = None
  test_head_dims = None


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


def test_config_rejects_unknown_matmul_inputs():
  with pytest.raises(ValueError, match="matmul_inputs"):
    XlaConfig(matmul_inputs="tf32")
