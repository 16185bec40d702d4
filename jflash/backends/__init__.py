"""The backends behind :func:`jflash.dot_product_attention`, by name.

``BACKENDS`` maps each name accepted by ``implementation=`` to its backend.
:func:`default_order` gives the order tried when ``implementation=None``.
"""

from __future__ import annotations

import types

import jax

from jflash.backends import gpu_table
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


_ORDERS = {
    # On a GPU model with measured entries (gpu_table.py) the faster of
    # cudnn and mosaic_gpu goes first per call; elsewhere cuDNN, and
    # mosaic_gpu serves what it declines.
    "cuda": ("cudnn", "mosaic_gpu", "xla"),
    "rocm": ("xla",),
    "tpu": ("mosaic_tpu", "xla"),
    "cpu": ("xla",),
}


def default_order(platform: str | None = None) -> tuple[str, ...]:
  """Backends tried for ``implementation=None`` on ``platform``: ``"cpu"``,
  ``"cuda"`` (or ``"gpu"``, as ``jax.default_backend()`` names it),
  ``"rocm"`` or ``"tpu"``; default: the platform this host lowers for.
  Always ends with ``"xla"``, which serves every valid call.

  Raises:
    ValueError: ``platform`` is none of those.
  """
  if platform is None:
    platform = jax.export.default_export_platform()
  if platform == "gpu":
    host = jax.export.default_export_platform()
    platform = host if host in ("cuda", "rocm") else "cuda"
  if platform not in _ORDERS:
    raise ValueError(f"default_order: unknown platform {platform!r}; known: "
                     f"{sorted(_ORDERS) + ['gpu']}")
  return _ORDERS[platform]


def call_orders(call: AttentionCall, platform: str
                ) -> tuple[tuple[Backend, ...], tuple[Backend, ...]]:
  """``(inference, training)``: the backends tried for ``call`` on
  ``platform`` with ``implementation=None``, for a call whose derivative
  is not taken and for one whose backward follows.

  On a CUDA host whose GPU model has measured entries in
  :data:`jflash.backends.gpu_table.TABLE`, the entry of the call's cell puts
  the faster of ``mosaic_gpu`` and ``cudnn`` first for each use; otherwise
  (other platforms, other GPUs, cells not measured) both are
  :func:`default_order`.
  """
  order = default_order(platform)
  entry = None
  if platform == "cuda" and jax.default_backend() == "gpu":
    entry = gpu_table.lookup(gpu_table.local_gpu_model(), call)

  def first(name: str | None) -> tuple[Backend, ...]:
    names = order if name is None else (name,) + tuple(
        n for n in order if n != name)
    return tuple(BACKENDS[n] for n in names)

  if entry is None:
    return first(None), first(None)
  return first(entry.inference), first(entry.training)


__all__ = ["AttentionCall", "Backend", "BACKENDS", "MosaicGpuBackend",
           "MosaicGpuConfig", "MosaicTpuBackend", "MosaicTpuConfig",
           "XlaBackend", "XlaConfig", "call_orders", "default_order"]
