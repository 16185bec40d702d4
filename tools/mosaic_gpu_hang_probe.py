"""Find which ``mosaic_gpu`` kernel, shape and configuration stops finishing,
on a Hopper GPU.

Each (case, stage) runs in its own child process
(:mod:`benchmarks.shape_check`) with a timeout, so that a kernel that
deadlocks costs one timeout and the probe goes on: ``fwd`` runs the
forward alone, ``bwd`` the forward and its VJP.  Cases are the
benchmark grid's shapes (B * S = 16384, N * H = 2048), where each CTA of the
persistent kernels takes many items.  One line per run: status, seconds,
and for finished runs the relative error of the output (and gradients) on
two heads against the float32 reference.

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/mosaic_gpu_hang_probe.py [--timeout 60] \\
      [--stages fwd,bwd] [--config fuse_dq=true] [--only 64:1024:causal]

``--tree DIR`` runs another source tree's ``jflash`` (see
``tools/stage_trees.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (head dim, sequence length, causal, left window or None)
_CASES = ((64, 1024, True, None), (64, 1024, False, None),
          (64, 4096, True, None), (128, 1024, True, None),
          (128, 1024, False, None), (128, 4096, True, None),
          (128, 2048, True, 256), (128, 16384, True, 1024),
          (256, 1024, True, None), (256, 4096, False, None))
# Run as a script, not with -m, so that the child imports jflash from
# PYTHONPATH (--tree first) rather than from the working directory.
_CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "benchmarks", "shape_check.py")


def _case_name(case) -> str:
  head_dim, seq, causal, window = case
  name = f"{head_dim}:{seq}:{'causal' if causal else 'full'}"
  return name + (f":w{window}" if window else "")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--timeout", type=float, default=60.0)
  parser.add_argument("--stages", default="fwd,bwd")
  parser.add_argument("--config", nargs="*", default=[],
                      help="MosaicGpuConfig fields, e.g. fuse_dq=true")
  parser.add_argument("--only", nargs="*", default=[],
                      help="case names (head:seq:causal|full[:wN])")
  parser.add_argument("--tree", default=".")
  args = parser.parse_args()
  from benchmarks.impls import config_fields  # noqa: PLC0415
  fields = config_fields(args.config)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONPATH=os.pathsep.join(filter(None, [
                 os.path.abspath(args.tree), os.environ.get("PYTHONPATH")])))
  cases = [c for c in _CASES if not args.only or _case_name(c) in args.only]
  for stage in args.stages.split(","):
    for case in cases:
      payload = json.dumps([[*case, stage, fields]])
      start = time.monotonic()
      try:
        done = subprocess.run(
            [sys.executable, _CHECK, payload],
            capture_output=True, text=True, env=env, timeout=args.timeout,
            check=False)
        results = [json.loads(ln[len("RESULT "):])
                   for ln in done.stdout.splitlines()
                   if ln.startswith("RESULT ")]
        phases = " ".join(ln[6:] for ln in done.stdout.splitlines()
                          if ln.startswith("PHASE "))
        status = (f"ok {phases} errors {results[-1]['errors']}"
                  if done.returncode == 0 and results
                  else "error " + done.stderr.strip()[-600:])
      except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (
            err.stdout or "")
        phases = [ln[6:] for ln in out.splitlines()
                  if ln.startswith("PHASE ")]
        status = f"TIMEOUT after phase {phases[-1] if phases else 'start'}"
      print(f"{stage} {_case_name(case)} {args.config} "
            f"{time.monotonic() - start:.0f}s {status}", flush=True)


if __name__ == "__main__":
  main()
