"""``mosaic_gpu``: FlashAttention and decode kernels for Hopper GPUs in
Pallas Mosaic GPU (:mod:`.attention`, :mod:`.decode`)."""

from jflash.backends.mosaic_gpu.attention import MosaicGpuBackend
from jflash.backends.mosaic_gpu.config import (MosaicGpuConfig,
                                               default_config, tuned_config)
from jflash.backends.mosaic_gpu.decode import (MosaicGpuDecodeBackend,
                                               MosaicGpuDecodeConfig)

__all__ = ["MosaicGpuBackend", "MosaicGpuConfig", "MosaicGpuDecodeBackend",
           "MosaicGpuDecodeConfig", "default_config", "tuned_config"]
