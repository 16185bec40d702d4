"""The GPU's SM clock and board power while implementations are timed.

Under sustained load an H200 runs at its power limit and lowers its SM
clock, so two kernels doing the same products at the same speed per clock
can differ in TFLOP/s by how much power each draws.  :class:`ClockSampler`
polls ``nvidia-smi`` in its loop mode from a background thread, stamping
each reading with the host clock that :mod:`benchmarks.timing` stamps its
groups with; :func:`window_mean` then gives the mean over one timing
group.

Usage::

  with ClockSampler() as clocks:
    ...                        # time something between t0 and t1
    clocks.window(t0, t1)      # {"sm_mhz": ..., "watts": ..., "samples": n}
"""

from __future__ import annotations

import os
import pty
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence

QUERY = ("clocks.sm", "power.draw")


def parse_line(line: str) -> tuple[float, float] | None:
  """``(sm_mhz, watts)`` from a line of ``nvidia-smi --query-gpu=clocks.sm,
  power.draw --format=csv,noheader,nounits``; None for anything else (a
  blank line, ``[N/A]``, a header)."""
  fields = [f.strip() for f in line.split(",")]
  if len(fields) != 2:
    return None
  try:
    return float(fields[0]), float(fields[1])
  except ValueError:
    return None


def window_mean(samples: Sequence[tuple[float, float, float]], start: float,
                end: float, slack: float = 0.0) -> dict | None:
  """Mean clock and power of the ``(time, sm_mhz, watts)`` samples taken
  in ``[start, end]``.  A window shorter than the sampling interval may
  hold none: then the one sample nearest to its middle, if it lies
  within ``slack`` seconds of the window.  None when there is none."""
  inside = [(mhz, watts) for t, mhz, watts in samples if start <= t <= end]
  if not inside:
    middle = (start + end) / 2
    near = [(abs(t - middle), mhz, watts) for t, mhz, watts in samples
            if start - slack <= t <= end + slack]
    if not near:
      return None
    _, mhz, watts = min(near)
    inside = [(mhz, watts)]
  return dict(sm_mhz=statistics.fmean(m for m, _ in inside),
              watts=statistics.fmean(w for _, w in inside),
              samples=len(inside))


def summarize_windows(windows: Sequence[dict | None]) -> dict | None:
  """Median over timing groups of their means (groups without samples
  left out), and the number of samples in all."""
  seen = [w for w in windows if w]
  if not seen:
    return None
  return dict(sm_mhz=round(statistics.median(w["sm_mhz"] for w in seen)),
              watts=round(statistics.median(w["watts"] for w in seen)),
              samples=sum(w["samples"] for w in seen))


class ClockSampler:
  """Readings of GPU ``device`` every ``interval_ms`` milliseconds through
  ``nvidia-smi -lms``, for as long as the sampler is open.

  Args:
    interval_ms: polling interval (nvidia-smi's own limits apply; readings
      come about every 10 ms at best).
    device: the GPU index nvidia-smi reports on.
    command: the program to run instead of ``nvidia-smi`` (for tests); it
      gets the same arguments.

  Raises:
    FileNotFoundError: on :meth:`start`, when the program is not found.
  """

  def __init__(self, interval_ms: int = 10, device: int = 0,
               command: str = "nvidia-smi"):
    if interval_ms < 1:
      raise ValueError(f"interval_ms must be at least 1, got {interval_ms}")
    self.interval_s = interval_ms / 1000
    self.argv = [command, f"--query-gpu={','.join(QUERY)}",
                 "--format=csv,noheader,nounits", "-lms", str(interval_ms),
                 "-i", str(device)]
    self.samples: list[tuple[float, float, float]] = []
    self._process: subprocess.Popen | None = None
    self._reader: threading.Thread | None = None
    self._master: int | None = None
    self._lock = threading.Lock()

  @staticmethod
  def available(command: str = "nvidia-smi") -> bool:
    """Whether the sampling program can be found."""
    return shutil.which(command) is not None

  def start(self) -> "ClockSampler":
    if not self.available(self.argv[0]):
      raise FileNotFoundError(f"{self.argv[0]} not found: the GPU clock "
                              f"cannot be sampled")
    # A terminal for its output, so that nvidia-smi writes each reading as
    # it takes it (into a pipe its C library would buffer kilobytes, and
    # the readings would arrive, and be stamped, seconds late).
    self._master, follower = pty.openpty()
    self._process = subprocess.Popen(self.argv, stdout=follower,
                                     stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL)
    os.close(follower)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    return self

  def _read(self) -> None:
    pending = b""
    while True:
      try:
        chunk = os.read(self._master, 4096)
      except OSError:  # the program ended and its terminal closed
        return
      if not chunk:
        return
      now = time.perf_counter()
      pending += chunk
      *lines, pending = pending.split(b"\n")
      for line in lines:
        reading = parse_line(line.decode(errors="replace"))
        if reading is not None:
          with self._lock:
            self.samples.append((now, *reading))

  def window(self, start: float, end: float) -> dict | None:
    """:func:`window_mean` of the readings so far, with two sampling
    intervals of slack."""
    with self._lock:
      samples = list(self.samples)
    return window_mean(samples, start, end, slack=2 * self.interval_s)

  def close(self) -> None:
    if self._process is not None:
      self._process.terminate()
      try:
        self._process.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self._process.kill()
      self._process = None
    if self._reader is not None:
      self._reader.join(timeout=5)
      self._reader = None
    if self._master is not None:
      os.close(self._master)
      self._master = None

  def __enter__(self) -> "ClockSampler":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()
