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

:func:`time_functions` times several functions with their groups
interleaved.  A GPU's clock is not constant over a run: after a pause
(compiling, checking) the first group can run faster than the rest, and
under sustained load the power limit lowers the clock.  Taking group ``r``
of every function before group ``r + 1`` of any puts the functions under
the same conditions.
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
    time), ``calls`` (per group, after the budget), ``repeats`` and
    ``windows`` (each group's start and end on ``time.perf_counter``).

  Raises:
    Whatever ``fn`` raises.
  """
  result, = time_functions([fn], input_sets, cfg)
  if "error" in result:
    raise result["error"]
  return result


def time_functions(fns: Sequence[Callable], input_sets: Sequence[tuple],
                   cfg: TimerConfig) -> list[dict]:
  """:func:`time_function` for each of ``fns``, groups interleaved.

  Every function is warmed up first; then group ``r`` of each function runs
  before group ``r + 1`` of any, in the order given.

  Returns:
    One dict per function, as :func:`time_function` returns, or
    ``{"error": exception}`` for a function that raised (it is not called
    again; the others go on).
  """
  timers = []
  for fn in fns:
    try:
      timers.append(_GroupTimer(fn, input_sets, cfg))
    except Exception as err:  # noqa: BLE001 (reported per function)
      timers.append(err)
  groups: list[list[float]] = [[] for _ in fns]
  windows: list[list[tuple[float, float]]] = [[] for _ in fns]
  for r in range(cfg.repeats):
    for i, timer in enumerate(timers):
      if isinstance(timer, Exception):
        continue
      try:
        start = time.perf_counter()
        groups[i].append(timer.group(r))
        windows[i].append((start, time.perf_counter()))
      except Exception as err:  # noqa: BLE001 (reported per function)
        timers[i] = err
  results = []
  for timer, times, spans in zip(timers, groups, windows):
    if isinstance(timer, Exception):
      results.append({"error": timer})
    else:
      results.append(dict(ms=statistics.median(times), ms_groups=times,
                          calls=timer.calls, repeats=cfg.repeats,
                          windows=spans))
  return results


class _GroupTimer:
  """Warms ``fn`` up, picks the calls per group, then times group ``r`` on
  request (per-call milliseconds)."""

  def __init__(self, fn: Callable, input_sets: Sequence[tuple],
               cfg: TimerConfig):
    self.fn, self.input_sets = fn, input_sets
    n = len(input_sets)
    t_call = 0.0
    for i in range(max(cfg.warmup, 1)):
      start = time.perf_counter()
      jax.block_until_ready(fn(*input_sets[i % n]))
      t_call = time.perf_counter() - start  # the last one is the estimate
    self.calls = _calls_within_budget(cfg, t_call)
    self.measured = None
    if cfg.method == "profiler":
      from jax.experimental.mosaic.gpu import profiler
      self.measured = profiler.measure(fn, iterations=self.calls)

  def group(self, r: int) -> float:
    n = len(self.input_sets)
    if self.measured is not None:
      _, timings = self.measured(*self.input_sets[r % n])
      if timings is None:
        raise RuntimeError("the profiler saw no kernel launches")
      per_call = timings if isinstance(timings, list) else [timings]
      return float(statistics.fmean(per_call))
    out = None
    start = time.perf_counter()
    for i in range(self.calls):
      out = self.fn(*self.input_sets[(r * self.calls + i) % n])
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / self.calls * 1e3
