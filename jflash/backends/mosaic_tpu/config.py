"""Tiling and VMEM budget of the ``mosaic_tpu`` backend, per TPU generation.

One tiling ``block_q x block_kv`` serves the forward, dQ and dK/dV kernels,
because one tile schedule (:func:`jflash.tiles.tile_schedule`) is computed
per call and shared by all three.  The defaults (:data:`BLOCKS`) are the
compiler's answers: the largest tiling that libtpu compiles for each
generation under its VMEM request (``tools/tpu_blocks.py``; the figures
are in ``docs/tpu.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

LANES = 128
"""Width of a TPU vector register row: head dims are padded to it."""
SUBLANES = 8
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Generation:
  """What the tiling needs to know about one TPU generation (per chip, as
  one JAX device; v4 and v5p chips are one megacore device of two cores).

  Attributes:
    name: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``.
    vmem_bytes: VMEM of one TensorCore.
    hbm_bytes_per_s: HBM bandwidth of the device.
    bf16_flops: peak bfloat16 matmul rate of the device.
    mxu: systolic array width (128 before v6e, 256 from v6e); block sizes
      are multiples of it.
  """

  name: str
  vmem_bytes: int
  hbm_bytes_per_s: float
  bf16_flops: float
  mxu: int

  @property
  def ridge(self) -> float:
    """FLOPs per HBM byte above which a kernel is compute bound."""
    return self.bf16_flops / self.hbm_bytes_per_s

  @property
  def vmem_limit_bytes(self) -> int:
    """Scoped VMEM requested per kernel: three quarters of a core's VMEM,
    at most 64 MiB (the rest is left to Mosaic's internal scratch)."""
    return min(self.vmem_bytes * 3 // 4, 64 * MIB)


# Peak bfloat16 rate and HBM bandwidth per chip: Google Cloud's TPU pages
# (v5e, v5p, v6e; v4 from secondary sources).  VMEM per TensorCore: JAX's
# hardware table (jax/_src/tpu_info.py in JAX 0.11.2).  docs/tpu.md derives
# the block sizes and says which figures are unconfirmed.
GENERATIONS: dict[str, Generation] = {
    "v4": Generation("v4", vmem_bytes=16 * MIB, hbm_bytes_per_s=1.2e12,
                     bf16_flops=2.75e14, mxu=128),
    "v5e": Generation("v5e", vmem_bytes=128 * MIB, hbm_bytes_per_s=8.19e11,
                      bf16_flops=1.97e14, mxu=128),
    "v5p": Generation("v5p", vmem_bytes=64 * MIB, hbm_bytes_per_s=2.765e12,
                      bf16_flops=4.59e14, mxu=128),
    "v6e": Generation("v6e", vmem_bytes=128 * MIB, hbm_bytes_per_s=1.64e12,
                      bf16_flops=9.2e14, mxu=256),
}

# Other or unknown TPUs (and interpret mode off a TPU): the smallest VMEM of
# the table.
FALLBACK = Generation("unknown", vmem_bytes=16 * MIB, hbm_bytes_per_s=8.2e11,
                      bf16_flops=1.97e14, mxu=128)

# (generation, padded head dim, bytes per kernel input element) ->
# (block_q, block_kv): the largest tiling up to 1024 x 1024 (more rows
# first) whose three kernels libtpu compiles, double-buffered, under the
# generation's VMEM request, with segment ids and a soft cap (the largest
# footprint); float16 runs the float32 kernels.  Beyond 1024 x 1024 a
# float32 score tile alone takes 4 MiB and an 8k sequence has 8 steps per
# row.  Found by tools/tpu_blocks.py; VMEM needed per entry in docs/tpu.md.
BLOCKS: dict[tuple[str, int, int], tuple[int, int]] = {
    # v4: 12 MiB requested of 16; the 1024-row bf16 tiles need 11.
    ("v4", 128, 2): (1024, 512), ("v4", 128, 4): (512, 512),
    ("v4", 256, 2): (512, 512), ("v4", 256, 4): (512, 256),
    # v5e, v6e: 64 MiB requested; 1024 x 1024 needs 14 to 41.
    ("v5e", 128, 2): (1024, 1024), ("v5e", 128, 4): (1024, 1024),
    ("v5e", 256, 2): (1024, 1024), ("v5e", 256, 4): (1024, 1024),
    # v5p: 48 MiB requested; float32 at head dim 256 needs more than that
    # at 1024 x 1024, 28 MiB at 1024 x 512.
    ("v5p", 128, 2): (1024, 1024), ("v5p", 128, 4): (1024, 1024),
    ("v5p", 256, 2): (1024, 1024), ("v5p", 256, 4): (1024, 512),
    ("v6e", 128, 2): (1024, 1024), ("v6e", 128, 4): (1024, 1024),
    ("v6e", 256, 2): (1024, 1024), ("v6e", 256, 4): (1024, 1024),
}


def default_blocks(gen: Generation, head_dim: int,
                   itemsize: int) -> tuple[int, int]:
  """``(block_q, block_kv)`` of :data:`BLOCKS` for a padded head dim (128
  or 256) and kernel input bytes (2 or 4); an unknown generation takes the
  smallest entry of any generation, which fits them all."""
  key = (head_dim, itemsize)
  if gen.name in GENERATIONS:
    return BLOCKS[(gen.name,) + key]
  return min((BLOCKS[(name,) + key] for name in GENERATIONS),
             key=lambda blocks: blocks[0] * blocks[1])

_DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e", "TPU v5e": "v5e",
    "TPU v5": "v5p", "TPU v5p": "v5p",
    "TPU v6 lite": "v6e", "TPU v6e": "v6e",
}


def generation_of(device_kind: str) -> Generation:
  """The :class:`Generation` of a ``jax.Device.device_kind`` (e.g.
  ``"TPU v5 lite"``); :data:`FALLBACK` for anything else."""
  name = _DEVICE_KINDS.get(device_kind)
  return GENERATIONS[name] if name else FALLBACK


@dataclasses.dataclass(frozen=True)
class MosaicTpuConfig:
  """Tiling of the ``mosaic_tpu`` kernels.

  Attributes:
    block_q: query rows per tile, or None for the generation's default
      (:data:`BLOCKS`).  Compiling for a TPU needs a
      multiple of 128; in interpret mode any multiple of 8 works (small
      blocks make small test shapes span many tiles).  Clipped to the
      sequence length rounded up to that granule.
    block_kv: keys per tile, same rules.
    vmem_limit_bytes: scoped VMEM requested per kernel, or None for the
      generation's :attr:`Generation.vmem_limit_bytes`.
    interpret_params: what ``pallas_call(interpret=...)`` receives when a
      call asks for ``interpret=True``: None for ``True`` (Pallas's generic
      interpreter: fast), or for instance
      ``jax.experimental.pallas.tpu.InterpretParams()`` for the TPU
      interpreter, which also simulates DMAs and VMEM (slower).
  """

  block_q: int | None = None
  block_kv: int | None = None
  vmem_limit_bytes: int | None = None
  interpret_params: Any = None

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      value = getattr(self, name)
      if value is None:
        continue
      if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
          or value < SUBLANES or value % SUBLANES):
        raise ValueError(f"MosaicTpuConfig.{name} must be None or a positive "
                         f"multiple of {SUBLANES} (of 128 to compile for a "
                         f"TPU), got {value!r}")
    limit = self.vmem_limit_bytes
    if limit is not None and (not isinstance(limit, (int, np.integer))
                              or isinstance(limit, bool) or limit < MIB):
      raise ValueError("MosaicTpuConfig.vmem_limit_bytes must be None or an "
                       f"int of at least {MIB} (1 MiB), got {limit!r}")

  def resolve(self, gen: Generation, head_dim: int, itemsize: int, *,
              interpret: bool) -> tuple[int, int, int]:
    """``(block_q, block_kv, vmem_limit_bytes)`` for one call before
    clipping to the sequence lengths.

    Raises:
      ValueError: an explicit block is not a multiple of 128 while
        compiling for a TPU.
    """
    default_q, default_kv = default_blocks(gen, head_dim, itemsize)
    block_q = default_q if self.block_q is None else int(self.block_q)
    block_kv = default_kv if self.block_kv is None else int(self.block_kv)
    if not interpret:
      for name, value in (("block_q", block_q), ("block_kv", block_kv)):
        if value % LANES:
          raise ValueError(
              f"MosaicTpuConfig.{name}={value} must be a multiple of "
              f"{LANES} to compile for a TPU (smaller multiples of "
              f"{SUBLANES} are for interpret=True only)")
    limit = (gen.vmem_limit_bytes if self.vmem_limit_bytes is None
             else int(self.vmem_limit_bytes))
    return block_q, block_kv, limit
