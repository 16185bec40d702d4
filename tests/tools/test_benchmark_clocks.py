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
from tests._seeds import next_seed

# Stand-ins for nvidia-smi.  Their output file buffers kilobytes when it is
# a pipe and writes each line as it is printed on a terminal, as C programs
# do (whatever PYTHONUNBUFFERED says).  Neither depends on time: the first prints reading i and then
# waits for the file <acks>/<i> before the next, so that the test knows
# which readings exist at any moment; the second reports 1000 MHz / 100.5 W
# until the file <flag> exists, then 2000 MHz / 300.5 W.
_LOCKSTEP = """#!{python}
import os, sys, time
assert "--query-gpu=clocks.sm,power.draw" in sys.argv, sys.argv
with open({pid!r}, "w") as f:
    f.write(str(os.getpid()))
out = open(sys.stdout.fileno(), "w", closefd=False)
print("clocks.sm [MHz], power.draw [W]", file=out)
for i, line in enumerate({readings!r}):
    print(line, file=out)
    print("[N/A], [N/A]", file=out)
    while not os.path.exists(os.path.join({acks!r}, str(i))):
        time.sleep(0.001)
while True:
    time.sleep(1)
"""
_SWITCHING = """#!{python}
import os, sys, time
assert "--query-gpu=clocks.sm,power.draw" in sys.argv, sys.argv
out = open(sys.stdout.fileno(), "w", closefd=False)
print("clocks.sm [MHz], power.draw [W]", file=out)
while True:
    print("2000, 300.5" if os.path.exists({flag!r}) else "1000, 100.5",
          file=out)
    print("[N/A], [N/A]", file=out)
    time.sleep(0.005)
"""


def _program(path, text):
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return str(path)


def _wait_for(sampler, done, what, timeout=120.0):
  """Polls until ``done(samples)``; the timeout only guards against a hang
  (a reading that never arrives), it is not what the test measures."""
  deadline = time.perf_counter() + timeout
  while True:
    with sampler._lock:
      samples = list(sampler.samples)
    if done(samples):
      return
    assert time.perf_counter() < deadline, what
    time.sleep(0.001)


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


def test_sampler_stamps_readings_as_they_are_taken(tmp_path):
  """Each reading is received and stamped while the program waits before
  its next one (not held back in the program's output buffer), so readings
  fall into the windows in which they were taken; closing the sampler
  stops the program."""
  acks, pid = tmp_path / "acks", tmp_path / "pid"
  acks.mkdir()
  readings = ["1000, 100.5"] * 3 + ["2000, 300.5"] * 3
  smi = _program(tmp_path / "fake-smi", _LOCKSTEP.format(
      python=sys.executable, pid=str(pid), readings=readings,
      acks=str(acks)))
  t0 = time.perf_counter()
  with clocks.ClockSampler(interval_ms=5, command=smi) as sampler:
    for i in range(len(readings)):
      _wait_for(sampler, lambda s: len(s) > i,
                f"reading {i} not received while the program waits")
      assert len(sampler.samples) == i + 1
      if i == 2:
        t1 = time.perf_counter()
        t2 = time.perf_counter()
      (acks / str(i)).touch()
    t3 = time.perf_counter()
    early, late = sampler.window(t0, t1), sampler.window(t2, t3)
  assert early == dict(sm_mhz=1000.0, watts=100.5, samples=3)
  assert late == dict(sm_mhz=2000.0, watts=300.5, samples=3)
  with pytest.raises(ProcessLookupError):
    os.kill(int(pid.read_text()), 0)


def test_sampler_refuses_a_missing_program_and_a_bad_interval():
  with pytest.raises(FileNotFoundError, match="no-such-smi"):
    clocks.ClockSampler(command="no-such-smi").start()
  with pytest.raises(ValueError, match="interval_ms"):
    clocks.ClockSampler(interval_ms=0)


def test_grid_entries_carry_clocks_and_grid_md_shows_them(tmp_path):
  """Each timed entry carries the clock of its own timing groups: the
  stand-in reports 1000 MHz until it is switched to 2000 MHz before the
  cell runs, and every entry then shows 2000."""
  flag = tmp_path / "switched"
  smi = _program(tmp_path / "fake-smi", _SWITCHING.format(
      python=sys.executable, flag=str(flag)))
  timer = TimerConfig(calls=2, repeats=3, warmup=1, max_seconds=1e6)
  chosen = impls.make_impls(["jflash:xla"])
  with clocks.ClockSampler(interval_ms=5, command=smi) as sampler:
    _wait_for(sampler, lambda s: s, "no reading from the stand-in")
    flag.touch()
    # Readings arrive in the order they are taken: once one at 2000 MHz
    # has been stamped, every later one is at 2000 MHz.
    _wait_for(sampler, lambda s: s[-1][1] == 2000.0,
              "no reading after the switch")
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
                    "--seed", str(next_seed() >> 1), "--out", str(out),
                    "--no-png", "--no-progress"]) == 0
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
