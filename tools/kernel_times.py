"""Per-kernel device time of forward+backward on a Hopper GPU (CUPTI, via
``jax.experimental.mosaic.gpu.profiler.measure``): where the time of a
cell goes, kernel by kernel, for jflash's ``mosaic_gpu`` backend and for
``jax.nn``'s cuDNN in the same process.

Each line gives a kernel's median time per call over ``--iterations``
calls, its share of the call, and for jflash's kernels the TFLOP/s of the
tile products that kernel does (forward 2 per visited pair, dQ pass 3, dK/dV
pass 4, fused backward 5; by the FlashAttention convention each product is
``2*B*N*T*S*H`` flops, halved when causal).

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/kernel_times.py [--cells 128:1024:0 ...]
      [--config fuse_dq=true ...]

A cell is ``H:S:causal`` with ``B*S = 16384`` and ``N*H = 2048``.  The
cotangent is an argument of the timed function, as in a training step (a
closed-over constant would let XLA fold the backward's work on it at
compile time).  ``--hlo DIR`` writes each function's optimized HLO there.
"""

from __future__ import annotations

import argparse
import statistics

# Run as a script from tools/, so its sibling is importable.
from mosaic_gpu_same import _parse_config

_DEFAULT_CELLS = ("128:1024:0", "128:1024:1", "128:4096:1", "128:16384:0",
                  "128:16384:1", "64:4096:0", "256:4096:0")
# Tile products per visited pair, for FLOP rates per kernel.
_PRODUCTS = {"jflash_forward": 2, "jflash_dq": 3, "jflash_dkv": 4,
             "jflash_fused_backward": 5}


def write_hlo(fn, args, path: str) -> None:
  """The optimized HLO of ``jax.jit`` function ``fn`` on ``args``."""
  with open(path, "w") as f:
    f.write(fn.lower(*args).compile().as_text())


def _kernel_medians(fn, args, iterations: int) -> list[tuple[str, float]]:
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415
  _, timings = profiler.measure(fn, aggregate=False,
                                iterations=iterations)(*args)
  if timings is None:
    raise RuntimeError("the profiler saw no kernel launches")
  if iterations == 1:
    timings = [timings]
  names = [name for name, _ in timings[0]]
  return [(name, statistics.median(t[k][1] for t in timings))
          for k, name in enumerate(names)]


def _short(name: str) -> str:
  for known in _PRODUCTS:
    if known in name:
      return known
  return name[:60]


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--cells", nargs="*", default=list(_DEFAULT_CELLS))
  parser.add_argument("--config", nargs="*", default=[],
                      help="MosaicGpuConfig fields for jflash")
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--no-cudnn", action="store_true")
  parser.add_argument("--hlo", metavar="DIR", default=None,
                      help="write each function's optimized HLO to DIR")
  args = parser.parse_args()

  import jax  # noqa: PLC0415 (only where a GPU runs)
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends.mosaic_gpu import (MosaicGpuBackend,  # noqa: PLC0415
                                          MosaicGpuConfig)
  backend = MosaicGpuBackend(MosaicGpuConfig(**_parse_config(args.config)))
  rng = np.random.default_rng(0)
  for text in args.cells:
    head_dim, seq, causal = (int(x) for x in text.split(":"))
    heads, batch = 2048 // head_dim, 16384 // seq
    q, k, v, cot = (jnp.asarray(rng.standard_normal(
        (batch, seq, heads, head_dim)), jnp.bfloat16) for _ in range(4))
    product = 2 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    impls = [("jflash", lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=bool(causal), implementation=backend))]
    if not args.no_cudnn:
      impls.append(("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=bool(causal), implementation="cudnn")))
    for name, attend in impls:
      def both(q, k, v, cot, attend=attend):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(cot))
      fn, fn_args = jax.jit(both), (q, k, v, cot)
      try:
        if args.hlo:
          write_hlo(fn, fn_args, f"{args.hlo}/{text.replace(':', '_')}_"
                    f"{name}.hlo.txt")
        kernels = _kernel_medians(fn, fn_args, args.iterations)
      except Exception as err:  # noqa: BLE001 (report and go on)
        print(f"h={head_dim} s={seq} causal={causal} {name}: "
              f"{type(err).__name__}: {str(err)[:200]}", flush=True)
        continue
      total = sum(ms for _, ms in kernels)
      print(f"h={head_dim} s={seq} causal={causal} {name}: {total:.3f} ms "
            f"per forward+backward, {3.5 * product * 2 / total / 1e9:.0f} "
            "TFLOP/s", flush=True)
      for kernel, ms in kernels:
        short = _short(kernel)
        rate = ""
        if short in _PRODUCTS:
          rate = (f", {_PRODUCTS[short] * product / ms / 1e9:.0f} TFLOP/s of "
                  "its products")
        print(f"  {short}: {ms:.3f} ms ({100 * ms / total:.0f}%){rate}",
              flush=True)


if __name__ == "__main__":
  main()
