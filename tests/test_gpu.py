"""GPU runs of the conformance suite (marked ``gpu``; skipped elsewhere).

Run on a CUDA machine with ``pytest -m gpu``.
"""

import jax.numpy as jnp
import pytest

from tests import conformance

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
    return super().supported(case, dtype) and full_bias

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


class TestXlaGpu(conformance.AttentionConformance):
  """The fallback on the GPU (float32 matmuls at HIGHEST precision)."""

  implementation = "xla"


class TestDefaultGpu(conformance.AttentionConformance):
  """``implementation=None`` on the GPU: every call is served exactly."""

  implementation = None
