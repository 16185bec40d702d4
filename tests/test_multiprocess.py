"""Context parallelism across processes: 2 JAX processes on this host with
4 CPU devices each (``tests/multiprocess_worker.py``), one data x context
mesh over all 8 devices (explicit shardings, a shard_map, and Auto axes
with the TPU kernels partitioned by XLA), checked against a
single-process reference."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

from tests._seeds import next_seed

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_match_the_reference():
  port = _free_port()
  seed = next_seed()
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  workers = [subprocess.Popen(
      [sys.executable, "-m", "tests.multiprocess_worker", str(i), str(port),
       str(seed)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outputs = []
  try:
    for worker in workers:
      outputs.append(worker.communicate(timeout=900)[0])
  finally:
    for worker in workers:
      worker.kill()
  results = []
  for worker, output in zip(workers, outputs):
    assert worker.returncode == 0, output[-4000:]
    lines = [l for l in output.splitlines() if l.startswith("RESULT ")]
    assert lines, output[-4000:]
    results.append(json.loads(lines[-1][len("RESULT "):]))
  assert sorted(r["process"] for r in results) == [0, 1]
  for result in results:
    assert result["explicit"] < 2e-5, result
    assert result["shard_map_ring"] < 2e-5, result
    assert result["auto_kernels"] < 2e-5, result
