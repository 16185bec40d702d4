"""Sweep ``MosaicGpuConfig`` candidates on the current Hopper GPU and print
the per-head-dim table for ``jflash/backends/mosaic_gpu/config.py``.

The forward is tuned first (block_q, block_kv, stages, then the
``overlap_qk`` switch on the best tiling), timing the forward alone; then
the backward, one group of fields at a time starting from the best forward
(dQ tiles, then dK/dV tiles, then the ring depths, then ``fuse_dq`` where
the head dim allows it), timing forward+backward.  Each candidate's output is compared with the
default configuration's before it is timed; candidates that do not fit in
shared memory or fail to compile are reported and skipped.

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 -m benchmarks.tune_mosaic_gpu --head-dims 64,128 \\
      --seq 4096 --out tune.json

The shapes follow the benchmark grid: ``B*S = 16384`` tokens and
``N*H = 2048``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from benchmarks.timing import TimerConfig, time_function
from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
from jflash.backends.mosaic_gpu.config import default_config

_SMEM_BYTES = 227 * 1024


def forward_candidates(head_dim: int) -> list[MosaicGpuConfig]:
  """Forward tilings whose shared memory fits (Q for two warpgroups plus a
  K/V ring, bfloat16) and whose per-thread accumulators can fit in the
  registers a consumer gets."""
  found = []
  for block_q, block_kv, stages in itertools.product(
      (64, 128), (64, 128, 192, 256), (2, 3, 4)):
    smem = 2 * (2 * block_q * head_dim + 2 * stages * block_kv * head_dim)
    # Output accumulator (float32) plus the score tile (float32) and its
    # bfloat16 copy, per thread of a warpgroup; the compiler decides the
    # rest, and spills show up in the timing.
    registers = (block_q * head_dim + 1.5 * block_q * block_kv) / 128
    # A loose filter: compiling reports the exact shared-memory overflow.
    if smem <= _SMEM_BYTES and registers <= 256:
      found.append(MosaicGpuConfig(block_q=block_q, block_kv=block_kv,
                                   stages=stages))
  return found


def forward_switches() -> list[dict]:
  """Tried on the best forward tiling: the intra-warpgroup overlap."""
  return [dict(overlap_qk=False), dict(overlap_qk=True)]


def backward_groups(head_dim: int) -> list[list[dict]]:
  """Field groups varied one after another for the backward."""
  blocks = (64, 128)
  dq = [dict(block_q_dq=a, block_kv_dq=b) for a, b in
        itertools.product(blocks, blocks)]
  dkv = [dict(block_q_dkv=a, block_kv_dkv=b) for a, b in
         itertools.product(blocks, blocks)
         if head_dim <= 128 or b == 64]
  stages = [dict(stages_dq=a, stages_dkv=b) for a, b in
            itertools.product((1, 2, 3), (1, 2, 3))]
  groups = [dq, dkv, stages]
  if head_dim <= 128:  # the one-pass backward's range
    # The fused backward replaces the dQ pass, whose fields it rejects.
    no_dq_pass = dict(block_q_dq=None, block_kv_dq=None, stages_dq=None)
    groups.append([dict(fuse_dq=False)] + [
        dict(fuse_dq=True, dq_slots=n, **no_dq_pass) for n in (1, 2, 4, 8)])
  return groups


def _rel(x, y) -> float:
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


@dataclasses.dataclass
class Tuner:
  """Times configurations of one shape."""

  head_dim: int
  seq: int
  causal: bool
  timer: TimerConfig

  def __post_init__(self):
    heads, batch = 2048 // self.head_dim, max(1, 16384 // self.seq)
    shape = (batch, self.seq, heads, self.head_dim)
    keys = jax.random.split(jax.random.key(int(time.time())), 8)
    make = lambda key: jax.random.normal(key, shape, jnp.bfloat16)  # noqa
    self.inputs = [tuple(make(k) for k in keys[i:i + 4]) for i in (0, 4)]
    self.flops = 4 * batch * heads * self.seq ** 2 * self.head_dim
    self.flops /= 2 if self.causal else 1
    self.baseline: dict[str, jax.Array] = {}

  def _functions(self, config: MosaicGpuConfig):
    backend = MosaicGpuBackend(config)

    def attend(q, k, v):
      return jflash.dot_product_attention(q, k, v, is_causal=self.causal,
                                          implementation=backend)

    def forward(q, k, v, cot):
      del cot
      return attend(q, k, v)

    def both(q, k, v, cot):
      out, vjp = jax.vjp(attend, q, k, v)
      return out, *vjp(cot)
    return dict(fwd=jax.jit(forward), fwdbwd=jax.jit(both))

  def measure(self, config: MosaicGpuConfig, pass_name: str) -> dict:
    """TFLOP/s of one pass, after checking it against the default config."""
    fn = self._functions(config)[pass_name]
    try:
      result = jax.block_until_ready(fn(*self.inputs[0]))
    except Exception as err:  # noqa: BLE001 (compile failures are data)
      return dict(error=f"{type(err).__name__}: {str(err)[:200]}")
    result = result if isinstance(result, tuple) else (result,)
    if pass_name not in self.baseline:
      reference = self._functions(MosaicGpuConfig())[pass_name]
      ref = reference(*self.inputs[0])
      self.baseline[pass_name] = ref if isinstance(ref, tuple) else (ref,)
    diff = max(_rel(a, b) for a, b in zip(result, self.baseline[pass_name]))
    if not np.isfinite(diff) or diff > 1e-2:
      return dict(error=f"differs from the default config by {diff:.2e}")
    timing = time_function(fn, self.inputs, self.timer)
    factor = 3.5 if pass_name == "fwdbwd" else 1.0
    return dict(tflops=factor * self.flops / (timing["ms"] * 1e-3) / 1e12,
                ms=timing["ms"], diff=diff)


def tune(tuner: Tuner, log) -> tuple[MosaicGpuConfig, list[dict]]:
  rows = []
  best, best_tflops = None, -1.0
  for config in forward_candidates(tuner.head_dim):
    row = dict(pass_="fwd", config=dataclasses.asdict(config),
               **tuner.measure(config, "fwd"))
    rows.append(row)
    log(row)
    if row.get("tflops", -1) > best_tflops:
      best, best_tflops = config, row["tflops"]
  if best is None:
    best = MosaicGpuConfig()
  tiling = best
  for fields in forward_switches():
    config = dataclasses.replace(tiling, **fields)
    row = dict(pass_="fwd", config=dataclasses.asdict(config),
               **tuner.measure(config, "fwd"))
    rows.append(row)
    log(row)
    if row.get("tflops", -1) > best_tflops:
      best, best_tflops = config, row["tflops"]
  best_both = -1.0
  for group in backward_groups(tuner.head_dim):
    group_best = best
    for fields in group:
      config = dataclasses.replace(best, **fields)
      row = dict(pass_="fwdbwd", config=dataclasses.asdict(config),
                 **tuner.measure(config, "fwdbwd"))
      rows.append(row)
      log(row)
      if row.get("tflops", -1) > best_both:
        group_best, best_both = config, row["tflops"]
    best = group_best
  return best.resolved(tuner.head_dim), rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--head-dims", default="64,128,256")
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None, help="JSON file for all rows")
  args = parser.parse_args()
  timer = TimerConfig(calls=args.calls, repeats=args.repeats, warmup=2)
  results, table = [], {}

  def log(row):
    shown = {k: v for k, v in row["config"].items() if v is not None}
    value = (f"{row['tflops']:6.1f} TFLOP/s" if "tflops" in row
             else row["error"])
    print(f"  {row['pass_']:6s} {shown}: {value}", flush=True)

  for head_dim in (int(h) for h in args.head_dims.split(",")):
    print(f"head dim {head_dim}, S={args.seq}, causal={args.causal} "
          f"(default {default_config(head_dim)})", flush=True)
    tuner = Tuner(head_dim, args.seq, args.causal, timer)
    best, rows = tune(tuner, log)
    if not any("tflops" in row for row in rows):
      print(f"  no candidate ran for head dim {head_dim}; its default stays",
            flush=True)
      continue
    table[head_dim] = best
    results.append(dict(head_dim=head_dim, seq=args.seq, causal=args.causal,
                        best=dataclasses.asdict(best), rows=rows))
    if args.out:
      with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind,
                       jax=jax.__version__, results=results), f, indent=1)
  print("\nPaste into jflash/backends/mosaic_gpu/config.py (_DEFAULTS):")
  for head_dim, config in table.items():
    fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(
        config).items())
    print(f"    {head_dim}: MosaicGpuConfig({fields}),")


if __name__ == "__main__":
  main()
