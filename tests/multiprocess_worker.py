"""One process of the multi-process context-parallel check.

``python -m tests.multiprocess_worker PROCESS_ID PORT SEED`` joins a
2-process JAX cluster on localhost (4 CPU devices each, CPU collectives
over gloo), builds a data x context mesh over all 8 devices, runs
``jflash.dot_product_attention`` on sequence-sharded global arrays
(explicit shardings, ``context_parallel`` inside a ``shard_map``, and
Auto mesh axes with the TPU kernels in interpret mode partitioned by XLA),
forward and gradients, and prints one ``RESULT`` line with their largest
relative errors against the reference computed on this process alone.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int, seed: int) -> None:
  jax.distributed.initialize(f"localhost:{port}", num_processes=2,
                             process_id=process_id)
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jflash
  from tests._support import (Case, random_qkv, random_segments, rel_err)

  assert jax.process_count() == 2 and jax.device_count() == 8
  rng = np.random.default_rng(seed)  # the same inputs on both processes
  q, k, v = (np.asarray(x) for x in random_qkv(rng, b=2, t=64, s=64, n=4,
                                                k=2, h=16))
  ids = random_segments(rng, 2, 64, 4)
  cotangent = rng.standard_normal(q.shape).astype(np.float32)

  local = jax.local_devices()[0]
  with jax.default_device(local):
    case = Case(*(jnp.asarray(x) for x in (q, k, v)),
                kwargs={"is_causal": True, "segment_ids": jnp.asarray(ids)})

    def ref_loss(q, k, v):
      return jnp.sum(case.call_reference(q, k, v, None, jit=False)[0]
                     * cotangent)
    ref_out = case.call_reference(case.query, case.key, case.value, None)[0]
    ref_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(
        case.query, case.key, case.value)

  mesh = jax.make_mesh((2, 4), ("data", "context"),
                       axis_types=(AxisType.Explicit,) * 2)
  spec = P("data", "context")

  def global_array(x):
    return jax.make_array_from_callback(
        x.shape, NamedSharding(mesh, spec), lambda index: x[index])

  def explicit(q, k, v, ids):
    return jflash.dot_product_attention(q, k, v, is_causal=True,
                                        segment_ids=ids)

  ring = jflash.ContextParallel(strategy="ring", axis_name="context")

  def in_shard_map(q, k, v, ids):
    return jax.shard_map(
        lambda q, k, v, ids: jflash.dot_product_attention(
            q, k, v, is_causal=True, segment_ids=ids,
            context_parallel=ring),
        in_specs=(spec,) * 4, out_specs=spec)(q, k, v, ids)

  from jflash.backends import MosaicTpuBackend, MosaicTpuConfig
  kernel = MosaicTpuBackend(MosaicTpuConfig(block_q=16, block_kv=16))

  def auto_kernels(q, k, v, ids):
    return jflash.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids, implementation=kernel,
        interpret=True)

  results = {}
  ct = global_array(cotangent)
  for name, attend in (("explicit", explicit),
                       ("shard_map_ring", in_shard_map),
                       ("auto_kernels", auto_kernels)):
    if name == "auto_kernels":
      mesh = jax.make_mesh((2, 4), ("data", "context"),
                           axis_types=(AxisType.Auto,) * 2)
    arrays = [global_array(x) for x in (q, k, v, ids)]
    ct = global_array(cotangent)
    def loss(q, k, v, ids, ct):
      out = attend(q, k, v, ids)
      return jnp.sum(out * ct), out
    with jax.set_mesh(mesh):
      (_, out), grads = jax.jit(jax.value_and_grad(
          loss, argnums=(0, 1, 2), has_aux=True))(*arrays, ct)
    gathered = [multihost_utils.process_allgather(x, tiled=True)
                for x in (out,) + tuple(grads)]
    errors = [rel_err(x, r) for x, r in zip(
        gathered, (ref_out,) + tuple(ref_grads))]
    results[name] = max(errors)
  print("RESULT " + json.dumps({"process": process_id, **results}),
        flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*(int(a) for a in sys.argv[1:4]))
