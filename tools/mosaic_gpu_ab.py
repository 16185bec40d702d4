"""Compare mosaic_gpu kernel variants on a Hopper GPU in one process: the
default configuration and the fused one-pass backward
(``MosaicGpuConfig(fuse_dq=True)``).

For each cell and variant it prints forward, forward+backward and
backward-only TFLOP/s (by the FlashAttention convention), whether two calls
give bitwise-identical results, and the relative difference of the output
and each gradient from the default's.  With ``--ptxas`` it first compiles
every variant on a small shape with ``MOSAIC_GPU_DUMP_PTXAS=1`` so that
ptxas reports registers and spills.

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/mosaic_gpu_ab.py [--ptxas]
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
          (64, 4096, False), (256, 4096, False))
_VARIANTS = (("default", {}), ("fuse_dq", dict(fuse_dq=True)))


def _time(fn, args) -> float:
  """Seconds per call, enqueueing calls and blocking once (median)."""
  return time_function(fn, [args], TimerConfig())["ms"] * 1e-3


def _rel(x, y) -> float:
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _compile_small() -> None:
  """Compiles every variant once on a small shape (for the ptxas report)."""
  q = jnp.ones((1, 1024, 2, 128), jnp.bfloat16)
  for name, fields in _VARIANTS:
    backend = MosaicGpuBackend(MosaicGpuConfig(**fields))
    loss = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
        q, k, v, implementation=backend).astype(jnp.float32).sum()
    print(f"=== {name}", flush=True)
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
      if ("===" in line or "spill" in low or "registers" in low
          or "function properties" in low):
        print(line, flush=True)
  rng = np.random.default_rng(int(time.time()))
  for head_dim, seq, causal in _CELLS:
    heads, batch = 2048 // head_dim, 16384 // seq
    q, k, v, cot = (jnp.asarray(rng.standard_normal(
        (batch, seq, heads, head_dim)), jnp.bfloat16) for _ in range(4))
    flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    results = {}
    for name, fields in _VARIANTS:
      if head_dim > 128 and fields.get("fuse_dq"):
        continue  # the fused backward serves head dims up to 128
      backend = MosaicGpuBackend(MosaicGpuConfig(**fields))
      attend = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
          q, k, v, is_causal=causal, implementation=backend)
      forward = jax.jit(attend)

      def both(q, k, v, cot, attend=attend):  # cot an argument, as in training
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(cot))
      both = jax.jit(both)
      try:
        first, second = both(q, k, v, cot), both(q, k, v, cot)
        same = all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(first, second))
        results[name] = first
        t_fwd, t_both = _time(forward, (q, k, v)), _time(both, (q, k, v, cot))
        print(f"h={head_dim} s={seq} causal={causal} {name}: fwd "
              f"{flops / t_fwd / 1e12:6.1f} fwd+bwd "
              f"{3.5 * flops / t_both / 1e12:6.1f} bwd-only "
              f"{2.5 * flops / (t_both - t_fwd) / 1e12:6.1f} "
              f"rerun-identical={same}", flush=True)
      except Exception as err:  # noqa: BLE001 (report and go on)
        print(f"h={head_dim} s={seq} causal={causal} {name}: "
              f"{type(err).__name__}: {str(err)[:300]}", flush=True)
    for name, got in results.items():
      if name != "default" and "default" in results:
        diffs = [_rel(a, b) for a, b in zip(got, results["default"])]
        print(f"  {name} vs default relative difference out/dq/dk/dv: "
              + " ".join(f"{d:.1e}" for d in diffs), flush=True)


if __name__ == "__main__":
  main()
