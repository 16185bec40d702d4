"""Find which ``mosaic_gpu`` kernel, shape and configuration stops finishing,
on a Hopper GPU.

Each (case, stage) runs in its own child process with a timeout, so that a
kernel that deadlocks costs one timeout and the probe goes on: ``fwd`` runs
the forward alone, ``bwd`` the forward and its VJP.  Cases are the
benchmark grid's shapes (B * S = 16384, N * H = 2048), where each CTA of the
persistent kernels takes many items.  One line per run: status, seconds,
and for finished runs the relative error of the output (and gradients) on
two heads against the float32 reference.

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/mosaic_gpu_hang_probe.py [--timeout 60] \\
      [--stages fwd,bwd] [--config overlap_qk=true] [--only 64:1024:causal]

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

# (head dim, sequence length, causal, window)
_CASES = ((64, 1024, True, None), (64, 1024, False, None),
          (64, 4096, True, None), (128, 1024, True, None),
          (128, 1024, False, None), (128, 4096, True, None),
          (128, 2048, True, (256, 0)), (128, 16384, True, (1024, 0)),
          (256, 1024, True, None), (256, 4096, False, None))

_CHILD = """
import json, sys, time
T0 = time.monotonic()
import jax, jax.numpy as jnp, numpy as np
import jflash
from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
from jflash.masks import AttentionMask
from jflash.reference import reference_attention
head_dim, seq, causal, window, stage, fields = json.loads(sys.argv[1])
window = tuple(window) if window else None
rng = np.random.default_rng(0)
heads, batch = 2048 // head_dim, 16384 // seq
q, k, v, ct = (jnp.asarray(rng.standard_normal(
    (batch, seq, heads, head_dim), np.float32), jnp.bfloat16)
    for _ in range(4))
backend = MosaicGpuBackend(MosaicGpuConfig(**fields))
def attend(q, k, v):
  return jflash.dot_product_attention(
      q, k, v, is_causal=causal, local_window_size=window,
      implementation=backend)
def both(q, k, v, ct):
  out, vjp = jax.vjp(attend, q, k, v)
  return (out, *vjp(ct))
run = jax.jit(both) if stage == "bwd" else jax.jit(
    lambda q, k, v, ct: (attend(q, k, v),))
print(f"PHASE inputs@{time.monotonic() - T0:.0f}s", flush=True)
run = run.lower(q, k, v, ct).compile()
print(f"PHASE compiled@{time.monotonic() - T0:.0f}s", flush=True)
got = jax.block_until_ready(run(q, k, v, ct))
print(f"PHASE ran@{time.monotonic() - T0:.0f}s", flush=True)
sub = [x[:1, :, :2] for x in (q, k, v, ct)]
mask = AttentionMask(batch=1, q_len=seq, kv_len=seq, is_causal=causal,
                     window=window)
def exact(q, k, v):
  return reference_attention(q, k, v, None, mask, scale=head_dim ** -0.5)[0]
def exact_all(q, k, v, ct):
  out, vjp = jax.vjp(exact, q, k, v)
  return (out, *vjp(ct))
# Jitted: op by op, each of the reference's operations compiles on its
# own (about 45 s per shape on the H200).
want = jax.jit(exact_all)(*(x.astype(jnp.float32) for x in sub))
errors = []
for g, w in zip(got, want):
  g = np.asarray(g[:1, :, :2], np.float64)
  w = np.asarray(w, np.float64)
  errors.append(float(np.linalg.norm(g - w) / np.linalg.norm(w)))
print(f"PHASE checked@{time.monotonic() - T0:.0f}s", flush=True)
print("ERRORS " + json.dumps(errors), flush=True)
"""


def _case_name(case) -> str:
  head_dim, seq, causal, window = case
  name = f"{head_dim}:{seq}:{'causal' if causal else 'full'}"
  return name + (f":w{window[0]}" if window else "")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--timeout", type=float, default=60.0)
  parser.add_argument("--stages", default="fwd,bwd")
  parser.add_argument("--config", nargs="*", default=[],
                      help="MosaicGpuConfig fields, e.g. overlap_qk=true")
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
      payload = json.dumps([*case, stage, fields])
      start = time.monotonic()
      try:
        done = subprocess.run([sys.executable, "-c", _CHILD, payload],
                              capture_output=True, text=True, env=env,
                              timeout=args.timeout, check=False)
        lines = [ln for ln in done.stdout.splitlines()
                 if ln.startswith("ERRORS ")]
        phases = " ".join(ln[6:] for ln in done.stdout.splitlines()
                          if ln.startswith("PHASE "))
        status = (f"ok {phases} {lines[-1][7:]}"
                  if done.returncode == 0 and lines
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
