"""One forward+backward of jflash's ``mosaic_gpu`` backend on one cell, for
``tools/ncu_profile.sh`` to profile: the first call compiles, the second is
the one to look at (``--launch-skip`` in the script skips the first).

Usage (on the GPU): PYTHONPATH=. python3 tools/ncu_target.py --cell
128:16384:0 [--config fuse_dq=true ...]
"""

from __future__ import annotations

import argparse

# Run as a script from tools/, so its sibling is importable.
from mosaic_gpu_same import _parse_config


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cell", default="128:16384:0",
                      help="H:S:causal, with B*S = 16384 and N*H = 2048")
  parser.add_argument("--config", nargs="*", default=[])
  args = parser.parse_args()
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends import MosaicGpuBackend, MosaicGpuConfig  # noqa

  head_dim, seq, causal = (int(x) for x in args.cell.split(":"))
  shape = (16384 // seq, seq, 2048 // head_dim, head_dim)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, cot = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
  backend = MosaicGpuBackend(MosaicGpuConfig(**_parse_config(args.config)))

  def both(q, k, v, cot):
    out, vjp = jax.vjp(lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=bool(causal), implementation=backend), q, k, v)
    return out, *vjp(cot)
  fn = jax.jit(both)
  for _ in range(2):
    jax.block_until_ready(fn(q, k, v, cot))


if __name__ == "__main__":
  main()
