"""The backends behind :func:`jflash.dot_product_attention`, by name.

``BACKENDS`` maps each name accepted by ``implementation=`` to its backend.
:func:`default_order` gives the order tried when ``implementation=None``.
"""

from __future__ import annotations

import types

import jax

from jflash.backends.base import AttentionCall, Backend
from jflash.backends.cudnn import CudnnBackend
from jflash.backends.mosaic_tpu import MosaicTpuBackend, MosaicTpuConfig
from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
from jflash.backends.xla import XlaBackend, XlaConfig

BACKENDS: types.MappingProxyType[str, Backend] = types.MappingProxyType({
    "mosaic_gpu": MosaicGpuBackend(),
    "mosaic_tpu": MosaicTpuBackend(),
    "cudnn": CudnnBackend(),
    "xla": XlaBackend(),
})


def default_order(platform: str | None = None) -> tuple[str, ...]:
  """Backends tried for ``implementation=None`` on ``platform`` (default:
  ``jax.default_backend()``).  Always ends with ``"xla"``, which serves
  every valid call."""
  platform = platform or jax.default_backend()
  if platform == "gpu":
    # cuDNN first while it is measured faster on dense shapes
    # (docs/performance.md); mosaic_gpu serves what it declines.
    return ("cudnn", "mosaic_gpu", "xla")
  if platform == "tpu":
    return ("mosaic_tpu", "xla")
  return ("xla",)


__all__ = ["AttentionCall", "Backend", "BACKENDS", "MosaicGpuBackend",
           "MosaicGpuConfig", "MosaicTpuBackend", "MosaicTpuConfig",
           "XlaBackend", "XlaConfig", "default_order"]
