"""Train the demo language model on a data x context mesh.

The batch is split over the ``data`` axis and every sequence over the
``context`` axis: each device holds ``B / data`` sequences of ``T /
context`` tokens, and jflash's attention runs context parallelism over the
``context`` axis by itself (no ``shard_map`` in the model).  The tokens,
their positions and targets are put in the load-balanced (zigzag) order
once, on the host, so that causal attention gives every device the same
work.

    python -m examples.train_sharded --devices 8 --context 4   # CPU
    python -m examples.train_sharded --context 2               # all GPUs

Prints the mesh, the attention backend, loss and tokens/s, and the memory
per device (XLA's compiled estimate; on GPUs also the measured peak).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--devices", type=int, default=0,
                 help="on a CPU, force this many host devices (0: use the "
                 "platform's devices)")
  p.add_argument("--context", type=int, default=2,
                 help="devices per sequence (the context axis); the rest "
                 "split the batch")
  p.add_argument("--strategy", choices=("auto", "ring", "all_gather"),
                 default="auto")
  p.add_argument("--no-load-balance", action="store_true",
                 help="keep tokens in order (contiguous layout)")
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--seq-len", type=int, default=512)
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.devices:
    # Must be set before JAX starts its CPU backend.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{args.devices}")
  if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jflash
  from examples.model import Config, TransformerLM, num_params
  from examples.train_lm import CharData

  n = jax.device_count()
  if args.context < 1 or n % args.context:
    raise SystemExit(f"--context={args.context} must divide the {n} devices")
  data_size = n // args.context
  if args.batch_size % data_size:
    raise SystemExit(f"--batch-size={args.batch_size} must be a multiple of "
                     f"the data axis size {data_size}")
  balanced = not args.no_load_balance
  mesh = jax.make_mesh((data_size, args.context), ("data", "context"),
                       axis_types=(AxisType.Explicit,) * 2)
  tokens_spec = NamedSharding(mesh, P("data", "context"))
  layout = "zigzag" if balanced else "contiguous"
  cp = jflash.ContextParallel(strategy=args.strategy, layout=layout)

  data = CharData()
  dtype = jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") \
      else jnp.float32
  cfg = Config(vocab_size=data.vocab_size, seq_len=args.seq_len,
               num_layers=args.layers, d_model=args.d_model,
               num_heads=args.heads, dtype=dtype, context_parallel=cp)
  with jax.set_mesh(mesh):
    model = TransformerLM(cfg, rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr, b2=0.99),
                              wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def loss_fn(model, x, positions, y):
    logits = model(x, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train_step(state, x, positions, y):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, positions, y)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  def arrange(x):
    """Zigzag order on the host, then placed on the mesh."""
    if balanced:
      x = np.asarray(jflash.load_balance(x, args.context))
    return jax.device_put(x, tokens_spec)

  rng = np.random.default_rng(args.seed)
  positions = np.broadcast_to(np.arange(args.seq_len, dtype=np.int32),
                              (args.batch_size, args.seq_len))
  positions = arrange(positions)

  def batch():
    x, y = data.batch(rng, "train", args.batch_size, args.seq_len)
    return arrange(x), arrange(y)

  qkv = jax.ShapeDtypeStruct(
      (args.batch_size, args.seq_len, cfg.num_heads, cfg.head_dim), dtype,
      sharding=NamedSharding(mesh, P("data", "context")))
  with jax.set_mesh(mesh):
    backend = jflash.selected_implementation(
        qkv, qkv, qkv, is_causal=True, context_parallel=cp)
    x, y = batch()
    compiled = train_step.lower(state, x, positions, y).compile()
  print(f"JAX {jax.__version__}, {n} x {jax.devices()[0].device_kind} in "
        f"{jax.process_count()} process(es); mesh data={data_size} x "
        f"context={args.context}; layout {layout}, strategy {args.strategy}")
  print(f"model: {num_params(model):,} parameters; attention backend per "
        f"block: {backend!r}; each device holds {args.batch_size // data_size}"
        f" x {args.seq_len // args.context} tokens")

  losses, timed_from = [], None
  with jax.set_mesh(mesh):
    for step in range(1, args.steps + 1):
      x, y = batch()
      state, loss = compiled(state, x, positions, y)
      if step == 1:
        jax.block_until_ready(loss)
        timed_from = time.perf_counter()
      if step % 10 == 0 or step == args.steps:
        losses.append(float(loss))
        print(f"step {step:4d}  loss {losses[-1]:.3f}", flush=True)
  elapsed = time.perf_counter() - timed_from
  tokens_per_s = (args.steps - 1) * args.batch_size * args.seq_len / elapsed
  stats = compiled.memory_analysis()
  per_device = {"compiled_temp_bytes": int(stats.temp_size_in_bytes),
                "compiled_argument_bytes": int(stats.argument_size_in_bytes)}
  peak = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in peak:
    per_device["measured_peak_bytes"] = int(peak["peak_bytes_in_use"])
  mib = 1 << 20
  print(f"{tokens_per_s:,.0f} tokens/s after compilation; per device: " +
        ", ".join(f"{k.replace('_bytes', '')} {v / mib:,.1f} MiB"
                  for k, v in per_device.items()))
  return {"tokens_per_s": tokens_per_s, "losses": losses,
          "backend": backend, **per_device}


if __name__ == "__main__":
  main()
