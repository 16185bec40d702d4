"""The GPU clock sampler of the benchmarks (CPU): readings parsed, stamped
as they are taken, averaged per timing group, and shown in grid.md."""

import json
import os
import stat
import sys
import time

import jax.numpy as jnp
import pytest

from benchmarks import clocks, grid, impls, report
from benchmarks.cells import Cell
from benchmarks.timing import TimerConfig

# A stand-in for nvidia-smi: Python's print buffers kilobytes when its
# output is a pipe and flushes each line on a terminal, as C programs do.
# It reports 1000 MHz / 100 W for its first 0.4 s, then 2000 MHz / 300 W.
_FAKE = """#!{python}
import sys, time
assert "--query-gpu=clocks.sm,power.draw" in sys.argv, sys.argv
start = time.monotonic()
print("clocks.sm [MHz], power.draw [W]")
while True:
    late = time.monotonic() - start > 0.4
    print("2000, 300.5" if late else "1000, 100.5")
    print("[N/A], [N/A]")
    time.sleep(0.005)
"""


def _first_reading(sampler, timeout=30.0):
  """Waits for the sampler's first reading (the fake's start-up time
  varies with the machine's load), so that its periods line up."""
  deadline = time.perf_counter() + timeout
  while not sampler.samples:
    assert time.perf_counter() < deadline, "no reading from the fake"
    time.sleep(0.001)


@pytest.fixture
def fake_smi(tmp_path):
  path = tmp_path / "fake-smi"
  path.write_text(_FAKE.format(python=sys.executable))
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return str(path)


def test_parse_line_takes_readings_and_skips_the_rest():
  assert clocks.parse_line("1980, 412.31\n") == (1980.0, 412.31)
  for line in ("", "[N/A], [N/A]", "clocks.sm [MHz], power.draw [W]",
               "1980", "1, 2, 3"):
    assert clocks.parse_line(line) is None


def test_window_mean_and_group_summary():
  samples = [(0.0, 1000.0, 100.0), (1.0, 1500.0, 200.0),
             (2.0, 2000.0, 400.0), (3.0, 1900.0, 500.0)]
  got = clocks.window_mean(samples, 0.5, 2.0)
  assert got == dict(sm_mhz=1750.0, watts=300.0, samples=2)
  assert clocks.window_mean(samples, 5.0, 6.0) is None
  # A window between two readings: the nearest one within the slack.
  assert clocks.window_mean(samples, 1.2, 1.3) is None
  assert clocks.window_mean(samples, 1.2, 1.3, slack=0.5) == dict(
      sm_mhz=1500.0, watts=200.0, samples=1)
  assert clocks.window_mean(samples, 1.6, 1.7, slack=0.5) == dict(
      sm_mhz=2000.0, watts=400.0, samples=1)
  summary = clocks.summarize_windows(
      [got, None, dict(sm_mhz=1000.0, watts=90.0, samples=1),
       dict(sm_mhz=1900.0, watts=500.0, samples=3)])
  assert summary == dict(sm_mhz=1750, watts=300, samples=6)
  assert clocks.summarize_windows([None, None]) is None


def test_sampler_stamps_readings_as_they_are_taken(fake_smi):
  """Readings of the first and the later period fall in their own
  windows: they are not held back in the program's output buffer."""
  with clocks.ClockSampler(interval_ms=5, command=fake_smi) as sampler:
    _first_reading(sampler)
    t0 = time.perf_counter()
    time.sleep(0.3)
    t1 = time.perf_counter()
    time.sleep(0.3)  # the switch to 2000 MHz at 0.4 s
    t2 = time.perf_counter()
    time.sleep(0.3)
    t3 = time.perf_counter()
  early, late = sampler.window(t0, t1), sampler.window(t2, t3)
  assert early["samples"] >= 3 and late["samples"] >= 3
  assert early["sm_mhz"] == 1000.0 and early["watts"] == 100.5
  assert late["sm_mhz"] == 2000.0 and late["watts"] == 300.5
  count = len(sampler.samples)
  time.sleep(0.05)
  assert len(sampler.samples) == count  # closed: no more readings


def test_sampler_refuses_a_missing_program_and_a_bad_interval():
  with pytest.raises(FileNotFoundError, match="no-such-smi"):
    clocks.ClockSampler(command="no-such-smi").start()
  with pytest.raises(ValueError, match="interval_ms"):
    clocks.ClockSampler(interval_ms=0)


def test_grid_entries_carry_clocks_and_grid_md_shows_them(fake_smi,
                                                         tmp_path):
  timer = TimerConfig(calls=2, repeats=3, warmup=1, max_seconds=1.0)
  chosen = impls.make_impls(["jflash:xla"])
  with clocks.ClockSampler(interval_ms=5, command=fake_smi) as sampler:
    _first_reading(sampler)
    time.sleep(0.45)  # past the fake's first period
    runner = grid.CellRunner(chosen, timer, dtype=jnp.float32,
                             input_sets=2, seed=5, clocks=sampler)
    rows = runner.run(Cell(1, 64, 2, 16, causal=True), 0)
  for row in rows:
    entry = row["impls"]["jflash:xla"]
    assert "windows" not in entry
    assert entry["clocks"]["sm_mhz"] == 2000
    assert entry["clocks"]["watts"] == 300  # round(300.5) is even: 300
    assert entry["clocks"]["samples"] >= 1
  doc = dict(meta=dict(report.run_metadata("abc123"), dtype="float32",
                       timer=timer.describe(), input_sets=2,
                       impls=["jflash:xla"]), rows=rows)
  md = report.markdown(doc)
  assert "## Clocks" in md
  per_ghz = rows[0]["impls"]["jflash:xla"]["tflops"] / 2.0
  assert f"2000 MHz 300 W, {report.fmt_number(per_ghz)}/GHz" in md
  without = dict(doc, rows=[dict(r, impls={
      k: {f: v for f, v in e.items() if f != "clocks"}
      for k, e in r["impls"].items()}) for r in rows])
  assert "## Clocks" not in report.markdown(without)


@pytest.mark.parametrize("readings", [True, False])
def test_grid_command_with_clocks(tmp_path, monkeypatch, readings):
  """``--clocks`` end to end with a stand-in nvidia-smi on PATH: every
  timed entry carries its clocks, or, when the program gives no readings,
  the run says so in its metadata instead of leaving them out silently."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  smi = bin_dir / "nvidia-smi"
  line = "1700, 550.0" if readings else "[N/A], [N/A]"
  smi.write_text(f"#!{sys.executable}\nimport time\nwhile True:\n"
                 f"    print({line!r}, flush=True)\n    time.sleep(0.005)\n")
  smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  out = tmp_path / "out"
  assert grid.main(["--quick", "--clocks", "--impls", "jax_nn_xla",
                    "--passes", "fwd", "--calls", "2", "--repeats", "2",
                    "--out", str(out), "--no-png", "--no-progress"]) == 0
  doc = json.loads((out / "grid.json").read_text())
  entries = [e for row in doc["rows"] for e in row["impls"].values()
             if "tflops" in e]
  assert entries
  if readings:
    assert all(e["clocks"]["sm_mhz"] == 1700 for e in entries)
    assert "## Clocks" in (out / "grid.md").read_text()
  else:
    assert not any("clocks" in e for e in entries)
    assert "no readings" in doc["meta"]["clocks"]


def test_grid_command_refuses_clocks_without_nvidia_smi(tmp_path,
                                                        monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  assert grid.main(["--quick", "--clocks", "--out",
                    str(tmp_path / "out")]) == 2
  assert not (tmp_path / "out").exists()
