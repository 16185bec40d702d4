"""Compare the two mosaic_gpu backwards on a Hopper GPU in one process:
the two-pass (dQ pass + dK/dV pass) and the fused one-pass
(``MosaicGpuConfig(fuse_dq=True)``).

For each cell it prints forward+backward and backward-only TFLOP/s (by the
FlashAttention convention), whether two calls give bitwise-identical
gradients, and the relative difference of each gradient between the two
designs.  With ``--ptxas`` it first compiles both on a small shape with
``MOSAIC_GPU_DUMP_PTXAS=1`` so that ptxas reports registers and spills.

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/mosaic_gpu_backward_ab.py [--ptxas]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from benchmarks.timing import TimerConfig, time_function
from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig

_CELLS = ((128, 16384, False), (128, 4096, True), (128, 16384, True),
          (64, 4096, False))


def _time(fn, args) -> float:
  """Seconds per call, enqueueing calls and blocking once (median)."""
  return time_function(fn, [args], TimerConfig())["ms"] * 1e-3


def _rel(x, y) -> float:
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _compile_small() -> None:
  """Compiles both backwards once on a small shape (for the ptxas report)."""
  q = jnp.ones((1, 1024, 2, 128), jnp.bfloat16)
  for fuse in (False, True):
    backend = MosaicGpuBackend(MosaicGpuConfig(fuse_dq=fuse))
    loss = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
        q, k, v, implementation=backend).astype(jnp.float32).sum()
    print(f"=== fuse_dq={fuse}", flush=True)
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--ptxas", action="store_true")
  parser.add_argument("--compile-only", action="store_true",
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.compile_only:
    _compile_small()
    return
  if args.ptxas:
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
    done = subprocess.run([sys.executable, __file__, "--compile-only"],
                          env=env, capture_output=True, text=True,
                          check=False)
    for line in (done.stdout + done.stderr).splitlines():
      low = line.lower()
      if "===" in line or "spill" in low or "registers" in low:
        print(line, flush=True)
  rng = np.random.default_rng(int(time.time()))
  for head_dim, seq, causal in _CELLS:
    heads, batch = 2048 // head_dim, 16384 // seq
    q, k, v, cot = (jnp.asarray(rng.standard_normal(
        (batch, seq, heads, head_dim)), jnp.bfloat16) for _ in range(4))
    flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    grads = {}
    for name, fuse in (("two-pass", False), ("fused", True)):
      backend = MosaicGpuBackend(MosaicGpuConfig(fuse_dq=fuse))
      attend = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
          q, k, v, is_causal=causal, implementation=backend)
      forward = jax.jit(attend)
      both = jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](cot))
      try:
        first, second = both(q, k, v), both(q, k, v)
        same = all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(first, second))
        grads[name] = first
        t_fwd, t_both = _time(forward, (q, k, v)), _time(both, (q, k, v))
        print(f"h={head_dim} s={seq} causal={causal} {name}: fwd+bwd "
              f"{3.5 * flops / t_both / 1e12:6.1f} bwd-only "
              f"{2.5 * flops / (t_both - t_fwd) / 1e12:6.1f} "
              f"rerun-identical={same}", flush=True)
      except Exception as err:  # noqa: BLE001 (report and go on)
        print(f"h={head_dim} s={seq} causal={causal} {name}: "
              f"{type(err).__name__}: {str(err)[:300]}", flush=True)
    if len(grads) == 2:
      diffs = [_rel(a, b) for a, b in zip(grads["fused"], grads["two-pass"])]
      print("  fused vs two-pass relative difference dq/dk/dv: "
            + " ".join(f"{d:.1e}" for d in diffs), flush=True)


if __name__ == "__main__":
  main()
