"""Where the ``mosaic_gpu`` forward spends its cycles, per warpgroup, on a
Hopper GPU: one call with Mosaic GPU's on-device profiler on.

The forward kernel marks its phases as named regions (``q_wait``, ``qk``,
``softmax``, ``v_wait``, ``turn_wait``, ``pv`` or ``pv_qk``, ``last_pv``,
``epilogue``, ``first_k_wait``; the producer's ``free_wait_0`` and
``free_wait_1`` for K and V slots).  With profiling on, each region's start
and end are stamped with the SM's cycle counter into shared memory and
dumped as a Chrome trace; this script summarizes the trace: per warpgroup
role, cycles per CTA in each region (mean over CTAs), the share of the
CTA's span, how many times it ran, and the spread of the CTAs' spans (the
persistent kernel's balance).  Stamping costs a few cycles per event and
keeps the compiler from moving code across a region's edges, so absolute
times are a little off; the split between regions is the point.

With ``--backward`` the call is forward and backward (a gradient with a
random cotangent), only the backward's kernels are profiled (the
forward's ring leaves no shared memory for the buffer at head dim 64),
and each one's trace is summarized: the dK/dV kernel's consumers mark
``k_wait``, ``q_wait``, ``do_wait``, ``s_wait`` (``S`` and ``dP``
issued, ``S`` waited for), ``p``, ``dp_wait``, ``dv_dk`` (the two
accumulating products, with ``ds`` inside it) and ``epilogue``; its
producer ``q_free_wait`` and ``do_free_wait``.

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/forward_trace.py --head-dim 256 --seq 1024 \\
      --causal --out trace_dir [--config block_kv=128] [--heads 4] \\
      [--backward]

The profile buffer takes ``48 * space`` bytes of shared memory beside the
kernel's (``--space``, regions per warpgroup; events past it are
dropped, and a region cut short is closed at the last event): shapes whose
CTAs visit many tiles need fewer heads or a smaller batch (``--heads``,
``--batch``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import shutil
import statistics
import tempfile


_ROLES = ("consumer 0", "consumer 1", "producer")
# Stamps are cycles since a trace's first event, written as ns / 1e3.
_CYCLES_PER_TS = 1e3


def region_cycles(events: list[dict]) -> dict:
  """Per warpgroup role of the forward (the kernel's warpgroups 0, 1: the
  consumers; 2: the producer), from a Mosaic GPU profile's Chrome trace
  events (``tid`` is ``1 + 3 * cta + warpgroup``): ``{role: {"spans":
  [cycles per CTA], "cycles": {region: [cycles per CTA]}, "runs":
  {region: total count}}}``.  A region nested in another counts in both."""
  by_trace = collections.defaultdict(list)
  for event in events:
    by_trace[event["tid"]].append(event)
  out = {role: {"spans": [], "cycles": collections.defaultdict(list),
                "runs": collections.Counter()} for role in _ROLES}
  for tid, trace in sorted(by_trace.items()):
    role = out[_ROLES[(tid - 1) % 3]]
    stack, per_region = [], collections.Counter()
    for event in trace:
      if event["ph"] == "B":
        stack.append(event)
      else:
        begin = stack.pop()
        per_region[begin["name"]] += ((event["ts"] - begin["ts"])
                                      * _CYCLES_PER_TS)
        role["runs"][begin["name"]] += 1
    role["spans"].append((trace[-1]["ts"] - trace[0]["ts"]) * _CYCLES_PER_TS)
    for name, cycles in per_region.items():
      role["cycles"][name].append(cycles)
  return out


def _summarize(trace_path: str, out_dir: str, keep_ctas: int,
               kept_name: str = "trace_first_ctas.json.gz") -> str:
  with open(trace_path) as f:
    events = json.load(f)["traceEvents"]
  data = region_cycles(events)
  ctas = len(data["consumer 0"]["spans"])
  lines = [f"trace {os.path.basename(trace_path)}: {ctas} CTAs"]
  for role in _ROLES:
    spans = data[role]["spans"]
    if not spans:
      continue
    mean_span = statistics.mean(spans)
    lines.append(f"== {role}: span per CTA {mean_span:,.0f} cycles (min "
                 f"{min(spans):,.0f}, max {max(spans):,.0f})")
    covered = 0.0
    for name, values in sorted(data[role]["cycles"].items(),
                               key=lambda kv: -sum(kv[1])):
      per_cta = sum(values) / ctas
      covered += per_cta
      runs = data[role]["runs"][name] / ctas
      lines.append(f"  {name:14s} {per_cta:12,.0f} cycles/CTA "
                   f"{100 * per_cta / mean_span:5.1f}%  {runs:7.1f} runs/CTA"
                   f"  {per_cta / max(runs, 1e-9):8,.0f} cycles/run")
    lines.append(f"  {'(outside)':14s} {mean_span - covered:12,.0f} "
                 f"cycles/CTA {100 * (1 - covered / mean_span):5.1f}%")
  kept = [e for e in events if (e["tid"] - 1) // 3 < keep_ctas]
  with gzip.open(os.path.join(out_dir, kept_name), "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": kept}, f)
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--batch", type=int, default=None,
                      help="default 16384 / seq")
  parser.add_argument("--heads", type=int, default=None,
                      help="default 2048 / head dim")
  parser.add_argument("--space", type=int, default=512,
                      help="profiled regions per warpgroup")
  parser.add_argument("--config", nargs="*", default=[],
                      help="MosaicGpuConfig fields, field=value")
  parser.add_argument("--keep-ctas", type=int, default=4,
                      help="CTAs whose raw events are saved")
  parser.add_argument("--backward", action="store_true",
                      help="run forward and backward, profile the "
                      "backward's kernels")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends import MosaicGpuBackend, MosaicGpuConfig  # noqa: PLC0415
  from jflash.backends.mosaic_gpu import common  # noqa: PLC0415
  from benchmarks.timing import TimerConfig, time_function  # noqa: PLC0415

  config = {}
  for item in args.config:
    name, value = item.split("=")
    config[name] = {"true": True, "false": False}.get(value.lower(), None)
    if config[name] is None:
      config[name] = int(value)
  implementation = (MosaicGpuBackend(MosaicGpuConfig(**config)) if config
                    else "mosaic_gpu")
  batch = args.batch or 16384 // args.seq
  heads = args.heads or 2048 // args.head_dim
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(
      (batch, args.seq, heads, args.head_dim)), jnp.bfloat16)
      for _ in range(3))

  def forward(q, k, v):
    return jflash.dot_product_attention(q, k, v, is_causal=args.causal,
                                        implementation=implementation)
  flops = 4 * batch * heads * args.seq ** 2 * args.head_dim
  flops /= 2 if args.causal else 1
  plain_params = common.COMPILER_PARAMS
  profiled_params = None  # set below, once the dump directory exists
  if args.backward:
    cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)

    def attend(q, k, v):
      # The forward is traced by jax.vjp, the backward's kernels only when
      # the cotangent is pulled back: only they see the profiled params.
      out, vjp = jax.vjp(forward, q, k, v)
      if profiled_params is not None:
        common.COMPILER_PARAMS = profiled_params
      try:
        grads = vjp(cotangent)
      finally:
        common.COMPILER_PARAMS = plain_params
      return out, grads
    flops *= 3.5
  else:
    attend = forward
  plain = jax.jit(attend)
  ms = time_function(plain, [(q, k, v)], TimerConfig(repeats=5,
                                                     warmup=2))["ms"]
  os.makedirs(args.out, exist_ok=True)
  lines = [f"B={batch} T=S={args.seq} N={heads} H={args.head_dim} "
           f"causal={args.causal} config={config or 'default'}: unprofiled "
           f"{ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s"]
  dump = tempfile.mkdtemp()
  profiled_params = dataclasses.replace(
      plain_params, profile_space=args.space, profile_dir=dump,
      profile_bounds_check=True)
  if not args.backward:
    common.COMPILER_PARAMS = profiled_params
  profiled = jax.jit(lambda q, k, v: attend(q, k, v))
  # Warm the clocks with the unprofiled kernel, then one profiled call
  # (each compiled profiled kernel writes one trace).
  time_function(plain, [(q, k, v)], TimerConfig(repeats=3, warmup=1))
  jax.block_until_ready(profiled(q, k, v))
  jax.effects_barrier()
  traces = sorted(glob.glob(os.path.join(dump, "*-trace.json")))
  if not traces:
    raise SystemExit(f"no trace in {dump}: {os.listdir(dump)}")
  for n, trace in enumerate(traces if args.backward else traces[-1:]):
    lines.append(_summarize(trace, args.out, args.keep_ctas,
                            f"trace{n}_first_ctas.json.gz"))
  shutil.rmtree(dump)
  text = "\n".join(lines)
  print(text)
  with open(os.path.join(args.out, "summary.txt"), "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
