"""Flax integration for jflash.

* :func:`attention_fn`: pass as ``attention_fn=`` to
  ``flax.linen.MultiHeadDotProductAttention`` or
  ``flax.nnx.MultiHeadAttention``.
* :class:`jflash.flax.linen.MultiHeadAttention` and
  :class:`jflash.flax.nnx.MultiHeadAttention`: drop-in modules with the same
  parameters as Flax's, plus ``segment_ids``, sequence lengths, local windows
  and logit soft capping.

Importing this package imports Flax; ``import jflash`` alone does not.
"""

from jflash.flax import linen, nnx
from jflash.flax.attention_fn import attention_fn

__all__ = ["attention_fn", "linen", "nnx"]
