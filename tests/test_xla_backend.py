"""The conformance suite on the ``xla`` backend, with small tiles so that
every case spans many of them (and once with the default tiling)."""

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
