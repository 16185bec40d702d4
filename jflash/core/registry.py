"""Every backend by name, and the order ``implementation=None`` tries them.

:data:`BACKENDS` holds the attention backends and :data:`DECODE_BACKENDS`
the decode backends, under the names ``implementation=`` accepts; a name
with no decode kernel (``cudnn``) declines decode calls.  The default
orders are per platform; on Hopper GPUs :func:`call_orders` refines the
attention order per call from the measured table
(:mod:`jflash.core.gpu_table`).
"""

from __future__ import annotations

import types

from jflash.backends.cudnn import CudnnBackend
from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuDecodeBackend
from jflash.backends.mosaic_tpu import MosaicTpuBackend, MosaicTpuDecodeBackend
from jflash.backends.xla import XlaBackend, XlaDecodeBackend
from jflash.core import gpu_table
from jflash.core.call import AttentionCall, Backend
from jflash.core.platform import Target, target

BACKENDS: types.MappingProxyType[str, Backend] = types.MappingProxyType({
    "mosaic_gpu": MosaicGpuBackend(),
    "mosaic_tpu": MosaicTpuBackend(),
    "cudnn": CudnnBackend(),
    "xla": XlaBackend(),
})
"""Attention backends by name."""

DECODE_BACKENDS: types.MappingProxyType[str, Backend] = types.MappingProxyType({
    "mosaic_gpu": MosaicGpuDecodeBackend(),
    "mosaic_tpu": MosaicTpuDecodeBackend(),
    "xla": XlaDecodeBackend(),
})
"""Decode backends by name."""

_ORDERS = {
    # On a GPU model with measured entries (gpu_table.py) the faster of
    # cudnn and mosaic_gpu goes first per call; elsewhere cuDNN, and
    # mosaic_gpu serves what it declines.
    "cuda": ("cudnn", "mosaic_gpu", "xla"),
    "rocm": ("xla",),
    "tpu": ("mosaic_tpu", "xla"),
    "cpu": ("xla",),
}

_DECODE_ORDERS = {
    "cuda": ("mosaic_gpu", "xla"),
    # Verified in interpret mode and compiled by libtpu for v4, v5e, v5p
    # and v6e (tests/test_tpu_compile.py); not yet timed on a TPU.
    "tpu": ("mosaic_tpu", "xla"),
}


def _platform_name(platform: str) -> str:
  """``"gpu"`` (``jax.default_backend()``'s name) as ``"cuda"``."""
  return "cuda" if platform == "gpu" else platform


def default_order(platform: str | None = None) -> tuple[str, ...]:
  """Backends tried for ``implementation=None`` on ``platform``: ``"cpu"``,
  ``"cuda"`` (or ``"gpu"``, as ``jax.default_backend()`` names it),
  ``"rocm"`` or ``"tpu"``; default: the platform calls are traced for
  here (:func:`jflash.core.platform.target`).  Always ends with
  ``"xla"``, which serves every valid call.

  Raises:
    ValueError: ``platform`` is none of those.
  """
  if platform is None:
    platform = target().platform
  platform = _platform_name(platform)
  if platform not in _ORDERS:
    raise ValueError(f"default_order: unknown platform {platform!r}; known: "
                     f"{sorted(_ORDERS) + ['gpu']}")
  return _ORDERS[platform]


def call_orders(call: AttentionCall, target: Target
                ) -> tuple[tuple[Backend, ...], tuple[Backend, ...]]:
  """``(inference, training)``: the attention backends tried for ``call``
  with ``implementation=None`` on ``target``, for a call whose derivative
  is not taken and for one whose backward follows.

  On a GPU model with measured entries in :data:`gpu_table.TABLE`, the
  entry of the call's cell puts the faster of ``mosaic_gpu`` and ``cudnn``
  first for each use; otherwise both are :func:`default_order`.  A
  platform jflash does not know gets ``xla``.
  """
  order = _ORDERS.get(target.platform, ("xla",))
  entry = None
  if target.platform == "cuda":
    entry = gpu_table.lookup(gpu_table.gpu_model(target.device_kind), call)

  def first(name: str | None) -> tuple[Backend, ...]:
    names = order if name is None else (name,) + tuple(
        n for n in order if n != name)
    return tuple(BACKENDS[n] for n in names)

  if entry is None:
    return first(None), first(None)
  return first(entry.inference), first(entry.training)


def decode_order(target: Target) -> tuple[Backend, ...]:
  """The decode backends tried for ``implementation=None`` on ``target``."""
  return tuple(DECODE_BACKENDS[n]
               for n in _DECODE_ORDERS.get(target.platform, ("xla",)))
