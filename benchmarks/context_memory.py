"""Memory per device of context-parallel attention as the context axis grows.

Compiles (does not run) attention forward + backward of one global problem
sharded over 1, 2, 4, ... devices along the sequence, for each strategy,
and reports XLA's per-device temporary memory.  On a CPU it forces host
devices, so it runs anywhere:

    python -m benchmarks.context_memory --devices 8 --seq-len 32768
    python -m benchmarks.context_memory --out benchmarks/results/<dir>/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8,
                 help="host devices to force on a CPU")
  p.add_argument("--seq-len", type=int, default=32768,
                 help="global sequence length (strong scaling)")
  p.add_argument("--per-device-len", type=int, default=0,
                 help="if set, the sequence length per device instead "
                 "(weak scaling: the global length grows with the shards)")
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--out", type=Path)
  return p.parse_args(argv)


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count="
                             f"{args.devices}")
  if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jflash

  dtype = jnp.dtype(args.dtype)
  rows = []
  shards = 1
  while shards <= jax.device_count():
    mesh = jax.make_mesh((shards,), ("context",),
                         axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:shards])
    seq = NamedSharding(mesh, P(None, "context"))
    length = (shards * args.per_device_len if args.per_device_len
              else args.seq_len)
    q = jax.ShapeDtypeStruct((1, length, args.heads, args.head_dim),
                             dtype, sharding=seq)
    kv = jax.ShapeDtypeStruct((1, length, args.kv_heads,
                               args.head_dim), dtype, sharding=seq)
    for strategy in ("ring", "all_gather"):
      cp = jflash.ContextParallel(strategy=strategy)

      def loss(q, k, v, cp=cp):
        out = jflash.dot_product_attention(q, k, v, is_causal=True,
                                           context_parallel=cp)
        return jnp.sum(out.astype(jnp.float32))

      with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
            q, kv, kv).compile()
      stats = compiled.memory_analysis()
      rows.append({"shards": shards, "strategy": strategy, "seq_len": length,
                   "temp_bytes": int(stats.temp_size_in_bytes),
                   "argument_bytes": int(stats.argument_size_in_bytes)})
      print(f"{shards:3d} shards  {strategy:10s}  temp "
            f"{stats.temp_size_in_bytes / 2**20:9.1f} MiB  inputs "
            f"{stats.argument_size_in_bytes / 2**20:8.1f} MiB per device",
            flush=True)
    shards *= 2
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "platform": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "problem": (f"B=1 T=S={args.seq_len}" if not args.per_device_len
                    else f"B=1 T=S={args.per_device_len} per device") +
                   f" N={args.heads} K={args.kv_heads}"
                   f" H={args.head_dim} {dtype.name} causal, fwd+bwd",
        "rows": rows}, indent=1))
  return rows


if __name__ == "__main__":
  main()
