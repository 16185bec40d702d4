"""The backends, one package each: ``xla`` (every platform), ``cudnn``
(CUDA GPUs), ``mosaic_gpu`` (Hopper GPUs) and ``mosaic_tpu`` (TPUs).

Each holds its attention backend (a ``jax.custom_vjp`` over its kernels)
and, where it has one, its decode backend.  Configured instances are passed
as ``implementation=``; ``jflash.BACKENDS`` holds the default instance of
each attention backend by name.
"""

from jflash.backends.cudnn import CudnnBackend
from jflash.backends.mosaic_gpu import (MosaicGpuBackend, MosaicGpuConfig,
                                        MosaicGpuDecodeBackend,
                                        MosaicGpuDecodeConfig)
from jflash.backends.mosaic_tpu import (MosaicTpuBackend, MosaicTpuConfig,
                                        MosaicTpuDecodeBackend)
from jflash.backends.xla import (DecodeConfig, XlaBackend, XlaConfig,
                                 XlaDecodeBackend)

__all__ = ["CudnnBackend", "DecodeConfig", "MosaicGpuBackend",
           "MosaicGpuConfig", "MosaicGpuDecodeBackend",
           "MosaicGpuDecodeConfig", "MosaicTpuBackend", "MosaicTpuConfig",
           "MosaicTpuDecodeBackend", "XlaBackend", "XlaConfig",
           "XlaDecodeBackend"]
