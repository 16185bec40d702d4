"""Where the wall-clock time of a call goes beyond its kernels, on a GPU.

For each cell, implementation and pass, the same jitted function is timed
three ways in one process:

* CUPTI (``jax.experimental.mosaic.gpu.profiler.measure``): the summed
  kernel time per call, and how many kernels a call launches;
* ``enqueue`` groups of 10 calls (the benchmark grid's method) and of
  ``--long`` calls, each blocked once, with the SM clock and board power
  over each group (``benchmarks.clocks``).

The difference between a group's per-call time and the kernel time is time
the GPU spends between kernels or before the first one, or a lower clock
than the profiled calls ran at; a difference that shrinks with the group's
length is a fixed cost per group.

``--sustain SECONDS`` adds a run of back-to-back groups of 10 calls for
that long, and reports its second half: per-call time, SM clock, board
power, and TFLOP/s per GHz of clock (the work done per clock cycle, which
a power-limited clock does not change).

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/timing_gap.py [--cells 128:16384:1 ...]
      [--impls jflash jax_nn_cudnn] [--long 60]

A cell is ``H:S:causal`` with ``B*S = 16384`` and ``N*H = 2048``.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _enqueue(fn, input_sets, calls: int, repeats: int, clocks) -> list:
  """Per-call milliseconds and clock of ``repeats`` groups of ``calls``."""
  import jax  # noqa: PLC0415
  rows = []
  n = len(input_sets)
  for r in range(repeats):
    out = None
    start = time.perf_counter()
    for i in range(calls):
      out = fn(*input_sets[(r * calls + i) % n])
    jax.block_until_ready(out)
    end = time.perf_counter()
    rows.append(((end - start) / calls * 1e3, clocks.window(start, end)
                 if clocks else None))
  return rows


def _sustained(fn, input_sets, seconds: float, clocks, flops: float) -> str:
  """Groups of 10 calls back to back for ``seconds``; the second half's
  per-call time, clock and power."""
  import jax  # noqa: PLC0415
  n, calls, spans = len(input_sets), 10, []
  begin = time.perf_counter()
  r = 0
  while time.perf_counter() - begin < seconds:
    start = time.perf_counter()
    out = None
    for i in range(calls):
      out = fn(*input_sets[(r * calls + i) % n])
    jax.block_until_ready(out)
    spans.append((start, time.perf_counter()))
    r += 1
  half = spans[len(spans) // 2:]
  ms = statistics.median((e - s) / calls * 1e3 for s, e in half)
  window = clocks.window(half[0][0], half[-1][1]) if clocks else None
  text = f"; sustained {seconds:.0f} s: {ms:.3f} ms ({flops / ms / 1e9:.1f} "
  text += "TFLOP/s"
  if window:
    ghz = window["sm_mhz"] / 1e3
    text += (f", {window['sm_mhz']:.0f} MHz, {window['watts']:.0f} W, "
             f"{flops / ms / 1e9 / ghz:.1f} TFLOP/s per GHz")
  return text + ")"


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--cells", nargs="*",
                      default=["128:16384:1", "128:16384:0", "64:4096:0"])
  parser.add_argument("--impls", nargs="*",
                      default=["jflash", "jax_nn_cudnn"])
  parser.add_argument("--passes", nargs="*", default=["fwd", "fwdbwd"])
  parser.add_argument("--long", type=int, default=60)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--sustain", type=float, default=0.0)
  args = parser.parse_args()

  import jax  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415

  from benchmarks import cells as cells_lib  # noqa: PLC0415
  from benchmarks import impls as impls_lib  # noqa: PLC0415
  from benchmarks.clocks import ClockSampler  # noqa: PLC0415

  impls = impls_lib.make_impls(args.impls)
  with ClockSampler() as clocks:
    for text in args.cells:
      head_dim, seq, causal = (int(x) for x in text.split(":"))
      cell = cells_lib.Cell(batch=16384 // seq, seq_len=seq,
                            num_heads=2048 // head_dim, head_dim=head_dim,
                            causal=bool(causal))
      input_sets = [impls_lib.random_inputs(jax.random.key(i), cell,
                                            jax.numpy.bfloat16)
                    for i in range(3)]
      input_sets = [(q, k, v, None, ct) for q, k, v, ct in input_sets]
      for impl in impls:
        attend = impl.build(cell)
        for pass_name in args.passes:
          fn = impls_lib.pass_function(attend, pass_name)
          flops = cells_lib.forward_flops(cell) * (
              3.5 if pass_name == "fwdbwd" else 1.0)
          for inputs in input_sets:  # compiles, and warms every input set
            jax.block_until_ready(fn(*inputs))
          _, timings = profiler.measure(fn, aggregate=False,
                                        iterations=10)(*input_sets[0])
          sums = [sum(ms for _, ms in t) for t in timings]
          kernel_ms = statistics.median(sums)
          kernels = len(timings[0])
          line = (f"{cell.name} {impl.name} {pass_name}: kernels "
                  f"{kernel_ms:.3f} ms ({kernels} per call, "
                  f"{flops / kernel_ms / 1e9:.1f} TFLOP/s)")
          for calls in (10, args.long):
            rows = _enqueue(fn, input_sets, calls, args.repeats, clocks)
            ms = statistics.median(r[0] for r in rows)
            mhz = [r[1]["sm_mhz"] for r in rows if r[1]]
            mhz_text = f" {statistics.fmean(mhz):.0f} MHz" if mhz else ""
            line += (f"; enqueue x{calls} {ms:.3f} ms "
                     f"({flops / ms / 1e9:.1f} TFLOP/s, gap "
                     f"{ms - kernel_ms:+.3f} ms{mhz_text})")
          if args.sustain > 0:
            line += _sustained(fn, input_sets, args.sustain, clocks, flops)
          print(line, flush=True)


if __name__ == "__main__":
  main()
