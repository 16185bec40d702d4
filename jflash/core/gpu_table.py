"""The default's choice between ``mosaic_gpu`` and ``cudnn`` on Hopper GPUs.

Each :class:`Entry` records which backend measured faster for one cell of
the benchmark grid (GPU model, head dim, key length, mask kind, GQA, dtype),
for the forward pass alone (``inference``) and for forward plus backward
(``training``).  ``benchmarks/dispatch_table.py`` builds the entries from
grid results.  A call looks up the entry of its GPU model, head dim
(rounded up to 64, 128 or 256, the widths the kernels run at), mask kind,
GQA and dtype at the measured key length nearest its own (on a log scale);
a call with no such entry keeps the default order.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from jflash.backends.mosaic_gpu.config import padded_head_dim
from jflash.core.call import AttentionCall


@dataclasses.dataclass(frozen=True)
class Entry:
  """One measured cell.

  Attributes:
    gpu: GPU model, e.g. ``"H100"`` (see :func:`gpu_model`).
    head_dim: 64, 128 or 256.
    seq_len: the key length measured (query length equal).
    mask: ``"none"``, ``"causal"``, ``"window"`` or ``"other"`` (see
      :func:`mask_kind`; ``"offsets"`` has no entries).
    gqa: fewer key/value heads than query heads.
    dtype: ``"bfloat16"`` or ``"float16"``.
    inference: backend faster for the forward pass alone.
    training: backend faster for forward plus backward.
    source: the measurement the entry comes from.
  """

  gpu: str
  head_dim: int
  seq_len: int
  mask: str
  gqa: bool
  dtype: str
  inference: str
  training: str
  source: str


_H100 = "benchmarks/results/2026-12-07-h100-grid-6704647/grid.json (H100)"
_H200 = "benchmarks/results/2026-12-04-h200-grid-2dfdde0/grid.json (H200)"

TABLE: tuple[Entry, ...] = (
    # Built by benchmarks/dispatch_table.py from _H100.
    Entry('H100', 64, 1024, 'causal', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H100),
    Entry('H100', 64, 1024, 'none', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H100),
    Entry('H100', 64, 4096, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H100),
    Entry('H100', 64, 4096, 'none', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H100),
    Entry('H100', 64, 16384, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H100),
    Entry('H100', 64, 16384, 'none', False, 'bfloat16',
          'mosaic_gpu', 'cudnn', _H100),
    Entry('H100', 128, 1024, 'causal', False, 'bfloat16',
          'cudnn', 'cudnn', _H100),
    Entry('H100', 128, 1024, 'none', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H100),
    Entry('H100', 128, 4096, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'cudnn', _H100),
    Entry('H100', 128, 4096, 'none', False, 'bfloat16',
          'mosaic_gpu', 'cudnn', _H100),
    Entry('H100', 128, 16384, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'cudnn', _H100),
    Entry('H100', 128, 16384, 'none', False, 'bfloat16',
          'mosaic_gpu', 'cudnn', _H100),
    Entry('H100', 128, 16384, 'window', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H100),
    Entry('H100', 256, 1024, 'causal', False, 'bfloat16',
          'cudnn', 'cudnn', _H100),
    Entry('H100', 256, 1024, 'none', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H100),
    Entry('H100', 256, 4096, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H100),
    Entry('H100', 256, 4096, 'none', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H100),
    Entry('H100', 256, 16384, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H100),
    Entry('H100', 256, 16384, 'none', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H100),
    # Built by benchmarks/dispatch_table.py from _H200.
    Entry('H200', 64, 1024, 'causal', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H200),
    Entry('H200', 64, 1024, 'none', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 64, 4096, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 64, 4096, 'none', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 64, 16384, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 64, 16384, 'none', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 128, 1024, 'causal', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H200),
    Entry('H200', 128, 1024, 'none', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H200),
    Entry('H200', 128, 4096, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 128, 4096, 'none', False, 'bfloat16',
          'mosaic_gpu', 'cudnn', _H200),
    Entry('H200', 128, 16384, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'cudnn', _H200),
    Entry('H200', 128, 16384, 'none', False, 'bfloat16',
          'mosaic_gpu', 'cudnn', _H200),
    Entry('H200', 128, 16384, 'window', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 256, 1024, 'causal', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H200),
    Entry('H200', 256, 1024, 'none', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 256, 4096, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 256, 4096, 'none', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H200),
    Entry('H200', 256, 16384, 'causal', False, 'bfloat16',
          'mosaic_gpu', 'mosaic_gpu', _H200),
    Entry('H200', 256, 16384, 'none', False, 'bfloat16',
          'cudnn', 'mosaic_gpu', _H200),
)
"""Every measured cell; kernels and cuDNN measured in the same run."""


def gpu_model(device_kind: str) -> str | None:
  """The model in a ``jax.Device.device_kind`` such as ``"NVIDIA H100 80GB
  HBM3"`` (``"H100"``), or None."""
  found = re.search(r"\b([A-Z]{1,2}\d{2,3})\b", device_kind)
  return found.group(1) if found else None


def local_gpu_model() -> str | None:
  """The model of this host's first GPU, or None without one."""
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  return gpu_model(device.device_kind) if device.platform == "gpu" else None


def mask_kind(call: AttentionCall) -> str:
  """``"none"``, ``"causal"``, ``"window"``, ``"other"`` (lengths,
  segment ids, a dense mask, a bias or a soft cap) or ``"offsets"``.

  ``"offsets"``: a mask with query/key offsets, one block of a
  context-parallel call, whatever else it holds.  cuDNN declines offsets,
  so no cell is measured for them and no entry's choice of cuDNN applies:
  the default order stands, in which ``mosaic_gpu`` serves them.
  """
  mask = call.mask
  if mask.has_offsets:
    return "offsets"
  if (mask.q_lengths is not None or mask.kv_lengths is not None
      or mask.q_segment_ids is not None or mask.dense is not None
      or mask.mask_fn is not None or call.alibi_slopes is not None
      or call.bias is not None or call.logits_soft_cap is not None):
    return "other"
  if mask.window is not None:
    return "window"
  return "causal" if mask.is_causal else "none"


def lookup(gpu: str | None, call: AttentionCall,
           table: tuple[Entry, ...] = TABLE) -> Entry | None:
  """The entry for ``call`` on ``gpu``, or None."""
  _, _, num_heads, head_dim = call.query.shape
  candidates = [
      e for e in table
      if e.gpu == gpu and head_dim <= 256
      and e.head_dim == padded_head_dim(head_dim)
      and e.mask == mask_kind(call)
      and e.gqa == (call.key.shape[2] != num_heads)
      and e.dtype == str(call.dtype)]
  if not candidates:
    return None
  kv_len = max(call.key.shape[1], 1)
  return min(candidates,
             key=lambda e: (abs(math.log(kv_len / e.seq_len)), e.seq_len))
