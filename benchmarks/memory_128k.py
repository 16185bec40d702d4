"""Peak device memory of forward+backward at ``B=1, T=S=131072, N=16,
H=128`` bfloat16, against the bytes of inputs, output and gradients.

Usage (on the GPU, fresh process): ``PYTHONPATH=. python3 -m
benchmarks.memory_128k [--impl mosaic_gpu] [--causal] [--config
fuse_dq=true dq_slots=1] [--seed N]``.  Prints one JSON line; the target is
``peak / (inputs + outputs + gradients) <= 1.3``.  ``--config`` sets
``MosaicGpuConfig`` fields of the ``mosaic_gpu`` backend.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--impl", default="mosaic_gpu")
  parser.add_argument("--seq", type=int, default=131072)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--seed", type=int, default=None,
                      help="of the random inputs (default: the current time)")
  parser.add_argument("--config", nargs="*", default=[],
                      help="MosaicGpuConfig fields, e.g. fuse_dq=true")
  args = parser.parse_args()
  implementation = args.impl
  if args.config:
    if args.impl != "mosaic_gpu":
      raise ValueError(f"--config sets the mosaic_gpu backend, got --impl "
                       f"{args.impl}")
    from jflash.backends.mosaic_gpu import (MosaicGpuBackend,  # noqa: PLC0415
                                            MosaicGpuConfig)
    fields = {}
    for item in args.config:
      key, value = item.split("=", 1)
      low = value.lower()
      fields[key] = (low == "true") if low in ("true", "false") else int(value)
    implementation = MosaicGpuBackend(MosaicGpuConfig(**fields))
  shape = (1, args.seq, args.heads, args.head_dim)
  seed = int(time.time()) if args.seed is None else args.seed
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, cot = (jax.random.normal(key, shape, jnp.bfloat16)
                  for key in keys)
  jax.block_until_ready((q, k, v, cot))

  def loss_grads(q, k, v, cot):
    f = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=args.causal, implementation=implementation)
    out, vjp = jax.vjp(f, q, k, v)
    return out, *vjp(cot)

  step = jax.jit(loss_grads)
  device = jax.devices()[0]
  before = device.memory_stats().get("peak_bytes_in_use", 0)
  start = time.perf_counter()
  results = jax.block_until_ready(step(q, k, v, cot))
  seconds = time.perf_counter() - start
  peak = device.memory_stats().get("peak_bytes_in_use", 0)
  one = int(np.prod(shape)) * 2
  # q, k, v, cotangent in; out, dq, dk, dv out.
  essential = 8 * one
  finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all())
               for x in results)
  print(json.dumps(dict(
      impl=args.impl, config=args.config, shape=shape, causal=args.causal,
      peak_bytes=peak, peak_before_bytes=before, essential_bytes=essential,
      ratio=round(peak / essential, 3), first_call_seconds=round(seconds, 2),
      finite=finite, device=device.device_kind)), flush=True)


if __name__ == "__main__":
  main()
