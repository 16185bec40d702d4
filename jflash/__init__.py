"""jflash: exact FlashAttention for JAX, one API on GPU, TPU and CPU."""

from jflash.core.alibi import alibi_slopes
from jflash.attention import dot_product_attention, selected_implementation
from jflash.core.platform import lowering_for
from jflash.core.registry import BACKENDS, DECODE_BACKENDS, default_order
from jflash.decode import append_to_cache, append_to_pages, decode_attention
from jflash.parallel import ContextParallel, load_balance, restore_order

__version__ = "0.1.0"

__all__ = ["dot_product_attention", "selected_implementation", "alibi_slopes",
           "BACKENDS",
           "DECODE_BACKENDS", "decode_attention", "append_to_pages",
           "append_to_cache", "ContextParallel", "default_order",
           "load_balance", "lowering_for", "restore_order", "__version__"]
