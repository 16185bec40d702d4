"""Device timing of a jitted function.

Two methods:

* ``enqueue`` (default): ``calls`` calls enqueued back to back and blocked
  once, timed by the host clock around the whole group; the per-call time is
  the group's time divided by ``calls``.  The host waits only once per
  group, so the figure is the device's throughput (dispatch overlaps the
  device work).
* ``profiler``: ``jax.experimental.mosaic.gpu.profiler.measure`` (CUPTI), the
  summed kernel time of each call (gaps between kernels excluded).  GPU only.

Both exclude ``warmup`` calls, report the median over ``repeats`` groups and
rotate the calls through several input sets so no call reuses the previous
call's inputs.  A function slower than ``max_seconds`` per measurement gets
fewer calls per group (at least one).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax

METHODS = ("enqueue", "profiler")


@dataclasses.dataclass(frozen=True)
class TimerConfig:
  """How to time.

  Attributes:
    method: ``enqueue`` or ``profiler``.
    calls: calls per group.
    repeats: groups; the median is reported.
    warmup: calls before timing (after the compiling call).
    max_seconds: budget for the timed groups of one function; fewer calls
      per group when the estimate exceeds it.
  """

  method: str = "enqueue"
  calls: int = 10
  repeats: int = 7
  warmup: int = 3
  max_seconds: float = 2.0

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"timer method must be one of {METHODS}, got "
                       f"{self.method!r}")
    if min(self.calls, self.repeats) < 1 or self.warmup < 0:
      raise ValueError("calls and repeats must be positive, warmup >= 0")

  def describe(self) -> dict:
    return dataclasses.asdict(self)


def _calls_within_budget(cfg: TimerConfig, seconds_per_call: float) -> int:
  if seconds_per_call <= 0:
    return cfg.calls
  fit = int(cfg.max_seconds / (cfg.repeats * seconds_per_call))
  return max(1, min(cfg.calls, fit))


def time_function(fn: Callable, input_sets: Sequence[tuple],
                  cfg: TimerConfig) -> dict:
  """Milliseconds per call of ``fn(*inputs)``.

  Returns:
    ``ms`` (median per-call time), ``ms_groups`` (every group's per-call
    time), ``calls`` (per group, after the budget) and ``repeats``.
  """
  n = len(input_sets)
  t_call = 0.0
  for i in range(max(cfg.warmup, 1)):
    start = time.perf_counter()
    jax.block_until_ready(fn(*input_sets[i % n]))
    t_call = time.perf_counter() - start  # the last one is the estimate
  calls = _calls_within_budget(cfg, t_call)
  if cfg.method == "enqueue":
    groups = _enqueue(fn, input_sets, calls, cfg.repeats)
  else:
    groups = _profiler(fn, input_sets, calls, cfg.repeats)
  return dict(ms=statistics.median(groups), ms_groups=groups, calls=calls,
              repeats=cfg.repeats)


def _enqueue(fn: Callable, input_sets: Sequence[tuple], calls: int,
             repeats: int) -> list[float]:
  n = len(input_sets)
  groups = []
  for r in range(repeats):
    out = None
    start = time.perf_counter()
    for i in range(calls):
      out = fn(*input_sets[(r * calls + i) % n])
    jax.block_until_ready(out)
    groups.append((time.perf_counter() - start) / calls * 1e3)
  return groups


def _profiler(fn: Callable, input_sets: Sequence[tuple], calls: int,
              repeats: int) -> list[float]:
  from jax.experimental.mosaic.gpu import profiler
  measured = profiler.measure(fn, iterations=calls)
  n = len(input_sets)
  groups = []
  for r in range(repeats):
    _, timings = measured(*input_sets[r % n])
    if timings is None:
      raise RuntimeError("the profiler saw no kernel launches")
    per_call = timings if isinstance(timings, list) else [timings]
    groups.append(float(statistics.fmean(per_call)))
  return groups
