"""The ``mosaic_tpu`` tiling per TPU generation, from libtpu's compiler.

For each generation, padded head dim (128, 256) and input dtype (bfloat16,
float32; float16 runs the float32 kernels), compiles the forward and both
backward kernels of a causal call with segment ids and a soft cap (the
kernels' largest VMEM footprint) for that TPU from this CPU host, and
reports:

* the largest tiling among :data:`CANDIDATES` (largest area first, more
  query rows first) that compiles under the generation's scoped VMEM limit
  (``Generation.vmem_limit_bytes``), pipelines double-buffered;
* the VMEM it needs: the smallest scoped limit (in MiB) under which it
  still compiles, found by bisection.

Needs libtpu (``pip install '.[tpu]'``).  The result is the block table of
``jflash/backends/mosaic_tpu/config.py`` and the figures of docs/tpu.md.

    PYTHONPATH=. python tools/tpu_blocks.py [--generations v4 v5e] [--out f]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")

CANDIDATES = ((1024, 1024), (1024, 512), (512, 1024), (512, 512), (512, 256),
              (256, 256), (256, 128), (128, 128))
"""Tilings tried, largest first; none above 1024 x 1024, where a float32
score tile already takes 4 MiB and an 8k sequence runs 8 steps per row."""
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1",
              "v6e": "v6e:2x2"}
MIB = 1 << 20


def _compiles(device, head_dim: int, dtype: str, block_q: int,
              block_kv: int, vmem_limit: int | None) -> tuple[bool, str]:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends import MosaicTpuBackend, MosaicTpuConfig  # noqa: PLC0415
  mesh = jax.sharding.Mesh(np.array([device]), ("x",))
  sharding = jax.NamedSharding(mesh, jax.P())
  t = 4096
  x = jax.ShapeDtypeStruct((1, t, 4, head_dim), jnp.dtype(dtype),
                           sharding=sharding)
  ids = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=sharding)
  backend = MosaicTpuBackend(MosaicTpuConfig(
      block_q=block_q, block_kv=block_kv, vmem_limit_bytes=vmem_limit))

  def loss(q, k, v, ids):
    return jflash.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids, logits_soft_cap=30.0,
        implementation=backend).astype(jnp.float32).sum()

  try:
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x, ids).lower(
        lowering_platforms=("tpu",)).compile()
  except Exception as err:  # noqa: BLE001 (the compiler's answer)
    return False, str(err).split("\n")[0][:200]
  return True, ""


def measure(generation: str, head_dim: int, dtype: str) -> dict:
  from jax.experimental import topologies  # noqa: PLC0415

  from jflash.backends.mosaic_tpu.config import generation_of  # noqa: PLC0415
  device = topologies.get_topology_desc(TOPOLOGIES[generation],
                                        "tpu").devices[0]
  limit = generation_of(device.device_kind).vmem_limit_bytes
  for block_q, block_kv in CANDIDATES:
    ok, why = _compiles(device, head_dim, dtype, block_q, block_kv, limit)
    if ok:
      break
    print(f"  {generation} H={head_dim} {dtype} {block_q}x{block_kv}: {why}",
          flush=True)
  else:
    return dict(generation=generation, head_dim=head_dim, dtype=dtype,
                blocks=None, limit_mib=limit // MIB)
  low, high = 0, limit // MIB  # fails at low (or 0), compiles at high
  while high - low > 1:
    mid = (low + high) // 2
    if _compiles(device, head_dim, dtype, block_q, block_kv, mid * MIB)[0]:
      high = mid
    else:
      low = mid
  return dict(generation=generation, head_dim=head_dim, dtype=dtype,
              blocks=[block_q, block_kv], vmem_mib=high,
              limit_mib=limit // MIB)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--generations", nargs="*", default=list(TOPOLOGIES))
  parser.add_argument("--out", default=None, help="JSON file of the rows")
  args = parser.parse_args(argv)
  rows = []
  for generation in args.generations:
    for head_dim in (128, 256):
      for dtype in ("bfloat16", "float32"):
        row = measure(generation, head_dim, dtype)
        print(json.dumps(row), flush=True)
        rows.append(row)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  print("| generation | head dim | dtype | blocks | VMEM needed / limit |")
  print("|---|--:|---|---|---|")
  for r in rows:
    blocks = "none fit" if r["blocks"] is None else "x".join(
        map(str, r["blocks"]))
    need = f"{r.get('vmem_mib', '-')} / {r['limit_mib']} MiB"
    print(f"| {r['generation']} | {r['head_dim']} | {r['dtype']} | {blocks} "
          f"| {need} |")


if __name__ == "__main__":
  main()
