"""What tracing one attention call costs: jaxpr size, trace time, kernels.

Traces ``jax.jit(jax.grad(loss))`` of one causal call (the common training
step) for each implementation named and prints the jaxpr's lines, its
Pallas kernels and the median trace time over
fresh functions (so that no trace cache serves them).  On a CPU host the
default (``None``) should cost what ``xla`` costs, since only the target
platform's backends are traced.

    PYTHONPATH=. python tools/trace_cost.py [--impls None xla] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time


def measure(implementation, shape, repeats: int) -> dict:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  times, text = [], ""
  for _ in range(repeats):
    def loss(q, k, v):
      return jflash.dot_product_attention(
          q, k, v, is_causal=True,
          implementation=implementation).astype(jnp.float32).sum()
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    start = time.perf_counter()
    traced = fn.trace(spec, spec, spec)
    times.append(time.perf_counter() - start)
    text = str(traced.jaxpr)
  return dict(implementation=str(implementation),
              jaxpr_lines=len(text.splitlines()),
              pallas_calls=text.count("pallas_call"),
              trace_s=statistics.median(times))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--impls", nargs="*", default=["None", "xla"])
  parser.add_argument("--shape", default="2,1024,8,64",
                      help="B,T,N,H of query, key and value")
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args(argv)
  shape = tuple(int(x) for x in args.shape.split(","))
  rows = [measure(None if name == "None" else name, shape, args.repeats)
          for name in args.impls]
  print("| implementation | jaxpr lines | pallas_call | trace s (median) |")
  print("|---|--:|--:|--:|")
  for r in rows:
    print(f"| {r['implementation']} | {r['jaxpr_lines']} | "
          f"{r['pallas_calls']} | {r['trace_s']:.3f} |")


if __name__ == "__main__":
  main()
