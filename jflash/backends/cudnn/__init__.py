"""``cudnn``: cuDNN's fused attention through ``jax.nn`` (CUDA GPUs)."""

from jflash.backends.cudnn.attention import CudnnBackend

__all__ = ["CudnnBackend"]
