"""tools/timing_gap.py: its group timing and its sustained run's figures,
on host functions of a known duration (the tool itself needs a GPU for its
CUPTI column)."""

import importlib.util
import pathlib
import re
import time

import numpy as np

_PATH = pathlib.Path(__file__).parent.parent / "tools" / "timing_gap.py"
_SPEC = importlib.util.spec_from_file_location("timing_gap", _PATH)
timing_gap = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(timing_gap)


def _sleeper(seconds: float):
  calls = []

  def fn(*args):
    calls.append(args)
    time.sleep(seconds)
    return np.float32(len(calls))
  return fn, calls


class _FakeClocks:
  """Answers every window with a fixed clock and power, recording it."""

  def __init__(self, mhz: float, watts: float):
    self.mhz, self.watts, self.windows = mhz, watts, []

  def window(self, start, end):
    self.windows.append((start, end))
    return {"sm_mhz": self.mhz, "watts": self.watts, "samples": 3}


def test_enqueue_groups_time_each_call_and_rotate_inputs():
  rng = np.random.default_rng()
  seconds = float(rng.uniform(0.002, 0.004))
  fn, calls = _sleeper(seconds)
  inputs = [(i,) for i in range(3)]
  clocks = _FakeClocks(1500.0, 600.0)
  rows = timing_gap._enqueue(fn, inputs, calls=4, repeats=3, clocks=clocks)
  assert len(rows) == 3 and len(calls) == 12
  # Consecutive calls take consecutive input sets.
  assert [c[0] for c in calls] == [i % 3 for i in range(12)]
  for ms, window in rows:
    assert seconds * 1e3 <= ms < seconds * 1e3 + 200
    assert window["sm_mhz"] == 1500.0
  assert len(clocks.windows) == 3


def test_sustained_reports_its_second_half_and_rates_per_clock():
  rng = np.random.default_rng()
  seconds = float(rng.uniform(0.001, 0.002))
  fn, _ = _sleeper(seconds)
  mhz = float(rng.uniform(1400, 1900))
  clocks = _FakeClocks(mhz, 690.0)
  flops = float(rng.uniform(1e11, 1e12))
  begin = time.perf_counter()
  text = timing_gap._sustained(fn, [(0,), (1,)], 0.3, clocks, flops)
  ms, rate, got_mhz, watts, per_ghz = (float(x) for x in re.search(
      r"sustained 0 s: ([\d.]+) ms \(([\d.]+) TFLOP/s, (\d+) MHz, (\d+) W, "
      r"([\d.]+) TFLOP/s per GHz\)", text).groups())
  assert seconds * 1e3 <= ms < seconds * 1e3 + 200
  # The printed figures round the per-call time; the rate follows from it.
  assert abs(rate - flops / ms / 1e9) <= 0.05 * rate
  assert round(mhz) == got_mhz and watts == 690
  assert abs(per_ghz - rate / (mhz / 1e3)) <= 0.1
  # One window, from the middle of the run on.
  (start, end), = clocks.windows
  assert start >= begin + 0.1 and end >= begin + 0.3


def test_sustained_without_a_sampler_gives_the_time_alone():
  fn, _ = _sleeper(0.001)
  text = timing_gap._sustained(fn, [(0,)], 0.05, None, 1e11)
  assert "TFLOP/s" in text and "MHz" not in text
