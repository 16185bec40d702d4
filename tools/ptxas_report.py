"""Registers and spills of the mosaic_gpu kernels, from ptxas, on a Hopper
GPU: compiles the forward and backward once per head dim (64, 128, 256) on
a small causal shape with ``MOSAIC_GPU_DUMP_PTXAS=1`` and prints, per
kernel, the ``Used ... registers`` line and the stack/spill line.

Usage (from the repository root, on the GPU; ``PYTHONPATH`` picks the tree)::

  PYTHONPATH=. python3 tools/ptxas_report.py [--config fuse_dq=true ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

# Run as a script from tools/, so its sibling is importable.
from mosaic_gpu_same import _parse_config


def _compile(fields: dict) -> None:
  import jax  # noqa: PLC0415 (the child process only)
  import jax.numpy as jnp  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends.mosaic_gpu import (MosaicGpuBackend,  # noqa: PLC0415
                                          MosaicGpuConfig)
  backend = MosaicGpuBackend(MosaicGpuConfig(**fields))
  for head_dim in (64, 128, 256):
    if head_dim > 128 and fields.get("fuse_dq"):
      continue  # the fused backward serves head dims up to 128
    q = jnp.ones((1, 1024, 2, head_dim), jnp.bfloat16)
    loss = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True,
        implementation=backend).astype(jnp.float32).sum()
    print(f"=== head dim {head_dim}", flush=True)
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q))


def summarize(text: str) -> list[str]:
  """The head-dim markers, and per ptxas function its register and
  spill lines, one line each."""
  lines, function = [], None
  for line in text.splitlines():
    if line.startswith("=== "):
      lines.append(line)
      continue
    named = re.search(r"(?:Function properties for|Compiling entry "
                      r"function|in function) '?([\w.$]+)'?", line)
    if named:
      function = named.group(1)
      if "properties" in line or "Compiling" in line:
        continue
    low = line.lower()
    if "spill" in low or "used" in low and "registers" in low:
      lines.append(f"{function}: {line.strip()}")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", nargs="*", default=[],
                      help="MosaicGpuConfig fields, e.g. fuse_dq=true")
  parser.add_argument("--compile-only", action="store_true",
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  fields = _parse_config(args.config)
  if args.compile_only:
    _compile(fields)
    return
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
  done = subprocess.run(
      [sys.executable, __file__, "--compile-only", "--config", *args.config],
      env=env, capture_output=True, text=True, check=False)
  for line in summarize(done.stdout + done.stderr):
    print(line, flush=True)
  if done.returncode:
    print(f"compiling failed (exit {done.returncode}):\n"
          + done.stderr[-2000:], flush=True)


if __name__ == "__main__":
  main()
