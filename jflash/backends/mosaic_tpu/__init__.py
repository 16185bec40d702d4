"""``mosaic_tpu``: FlashAttention and decode kernels for TPUs in Pallas
Mosaic TPU (:mod:`.attention`, :mod:`.decode`)."""

from jflash.backends.mosaic_tpu.attention import MAX_HEAD_DIM, MosaicTpuBackend
from jflash.backends.mosaic_tpu.config import MosaicTpuConfig
from jflash.backends.mosaic_tpu.decode import MosaicTpuDecodeBackend

__all__ = ["MAX_HEAD_DIM", "MosaicTpuBackend", "MosaicTpuConfig",
           "MosaicTpuDecodeBackend"]
