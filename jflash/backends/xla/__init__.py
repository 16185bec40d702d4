"""``xla``: blockwise exact attention and split-K decode in pure JAX; serves
every valid call on every platform."""

from jflash.backends.xla.attention import XlaBackend, XlaConfig
from jflash.backends.xla.decode import XlaDecodeBackend
from jflash.core.splits import DecodeConfig

__all__ = ["DecodeConfig", "XlaBackend", "XlaConfig", "XlaDecodeBackend"]
