"""tools/timing_gap.py: its group timing and its sustained run's figures,
on host functions of a known duration under a stand-in clock (the tool
itself needs a GPU for its CUPTI column)."""

import importlib.util
import pathlib
import re

import numpy as np
import pytest

from tests._seeds import fresh_rng

_PATH = pathlib.Path(__file__).parents[2] / "tools" / "timing_gap.py"
_SPEC = importlib.util.spec_from_file_location("timing_gap", _PATH)
timing_gap = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(timing_gap)


class _FakeTime:
  """A host clock that moves only when a timed function runs: each call of
  the function returned by :meth:`function` takes exactly ``seconds``, so
  the tool's arithmetic is checked exactly, whatever else the machine is
  doing."""

  def __init__(self, now: float):
    self.now = now

  def perf_counter(self) -> float:
    return self.now

  def function(self, seconds: float):
    calls = []

    def fn(*args):
      calls.append(args)
      self.now += seconds
      return np.float32(len(calls))
    return fn, calls


class _FakeClocks:
  """Answers every window with a fixed clock and power, recording it."""

  def __init__(self, mhz: float, watts: float):
    self.mhz, self.watts, self.windows = mhz, watts, []

  def window(self, start, end):
    self.windows.append((start, end))
    return {"sm_mhz": self.mhz, "watts": self.watts, "samples": 3}


def test_enqueue_groups_time_each_call_and_rotate_inputs(monkeypatch):
  rng = fresh_rng()
  seconds = float(rng.uniform(0.002, 0.004))
  clock = _FakeTime(float(rng.uniform(10, 1000)))
  monkeypatch.setattr(timing_gap, "time", clock)
  begin = clock.now
  fn, calls = clock.function(seconds)
  inputs = [(i,) for i in range(3)]
  clocks = _FakeClocks(1500.0, 600.0)
  rows = timing_gap._enqueue(fn, inputs, calls=4, repeats=3, clocks=clocks)
  assert len(rows) == 3 and len(calls) == 12
  # Consecutive calls take consecutive input sets.
  assert [c[0] for c in calls] == [i % 3 for i in range(12)]
  for ms, window in rows:
    assert ms == pytest.approx(seconds * 1e3)
    assert window["sm_mhz"] == 1500.0
  # Each group's clock window spans exactly its four calls.
  assert clocks.windows == [
      pytest.approx((begin + 4 * r * seconds, begin + 4 * (r + 1) * seconds))
      for r in range(3)]


def test_sustained_reports_its_second_half_and_rates_per_clock(monkeypatch):
  rng = fresh_rng()
  seconds = float(rng.uniform(0.001, 0.002))
  clock = _FakeTime(float(rng.uniform(10, 1000)))
  monkeypatch.setattr(timing_gap, "time", clock)
  fn, calls = clock.function(seconds)
  mhz = float(rng.uniform(1400, 1900))
  clocks = _FakeClocks(mhz, 690.0)
  flops = float(rng.uniform(1e11, 1e12))
  begin = clock.now
  text = timing_gap._sustained(fn, [(0,), (1,)], 0.3, clocks, flops)
  ms, rate, got_mhz, watts, per_ghz = (float(x) for x in re.search(
      r"sustained 0 s: ([\d.]+) ms \(([\d.]+) TFLOP/s, (\d+) MHz, (\d+) W, "
      r"([\d.]+) TFLOP/s per GHz\)", text).groups())
  assert ms == pytest.approx(seconds * 1e3, abs=5e-4)  # printed to 1 us
  # The printed figures round the per-call time; the rate follows from it.
  assert abs(rate - flops / ms / 1e9) <= 0.05 * rate
  assert round(mhz) == got_mhz and watts == 690
  assert abs(per_ghz - rate / (mhz / 1e3)) <= 0.1
  # Groups of 10 calls until 0.3 s have passed; one clock window, over the
  # second half of the groups.
  group = 10 * seconds
  groups = len(calls) // 10
  assert len(calls) == 10 * groups
  assert 0.3 - 1e-9 <= groups * group < 0.3 + group + 1e-9
  (start, end), = clocks.windows
  assert start == pytest.approx(begin + (groups // 2) * group)
  assert end == pytest.approx(begin + groups * group)


def test_sustained_without_a_sampler_gives_the_time_alone(monkeypatch):
  clock = _FakeTime(0.0)
  monkeypatch.setattr(timing_gap, "time", clock)
  fn, _ = clock.function(0.001)
  text = timing_gap._sustained(fn, [(0,)], 0.05, None, 1e11)
  assert "TFLOP/s" in text and "MHz" not in text
