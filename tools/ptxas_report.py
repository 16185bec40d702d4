"""Registers and spills of the mosaic_gpu kernels, from ptxas: compiles the
forward and backward once per head dim (64, 128, 256) on a small shape,
causal unless ``--mask`` names another mask (none, segments, window,
softcap), with ``MOSAIC_GPU_DUMP_PTXAS=1`` and prints, per kernel, the ``Used
... registers`` line, the stack/spill line and any ptxas warning (such as
C7513, ``wgmma`` serialized) or performance note (C7512, ``wgmma``
serialized for want of registers).

On a Hopper GPU (``PYTHONPATH`` picks the tree)::

  PYTHONPATH=. python3 tools/ptxas_report.py [--config fuse_dq=true ...]

On a host without a GPU, after ``bash tools/offline_cuda/setup.sh`` (which
fetches the CUDA plugin of the pinned jaxlib and ptxas, and builds a
stand-in driver that answers as an sm_90 device)::

  PYTHONPATH=. python3 tools/ptxas_report.py --offline /tmp/jflash-cuda

The kernels are lowered for CUDA on the CPU and each is compiled by the
plugin's Mosaic GPU compiler; loading the result then fails, which is
expected.  ``--raw FILE`` keeps the compiler's whole output (with
``--sass``, the SASS too).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Run as a script from tools/, so its siblings are importable.
import sass_turn_gap
from mosaic_gpu_same import _parse_config


def _offline_compiler(plugin: str):
  """``compile(module_bytes)`` through the CUDA plugin's Mosaic GPU
  compiler (ptxas reports on stderr; the final load fails)."""
  compile_module = ctypes.CDLL(plugin).MosaicGpuCompile
  compile_module.argtypes = [ctypes.c_char_p, ctypes.c_int]
  compile_module.restype = ctypes.POINTER(ctypes.c_void_p)

  def run(module: bytes) -> None:
    compile_module(ctypes.c_char_p(module), ctypes.c_int(len(module)))
    sys.stdout.flush()
  return run


# Masks the kernels are compiled for (--mask): dot_product_attention
# keyword arguments on a [1, T, 2, H] input (T = --seq-len, 1024 unless
# given).
_MASKS = {
    "causal": dict(is_causal=True),
    "none": {},
    "segments": {},  # segment ids made in _mask_kwargs
    "window": dict(is_causal=True, local_window_size=(256, 0)),
    "softcap": dict(is_causal=True, logits_soft_cap=30.0),
}


def _mask_kwargs(name: str, seq_len: int = 1024) -> dict:
  kwargs = dict(_MASKS[name])
  if name == "segments":  # four segments of about equal length
    import jax.numpy as jnp  # noqa: PLC0415 (the child process only)
    kwargs["segment_ids"] = (jnp.arange(seq_len, dtype=jnp.int32) * 4
                             // seq_len)[None]
  return kwargs


def _compile(fields: dict, head_dims: list[int], plugin: str | None,
             mask: str = "causal", heads: int = 2,
             seq_len: int = 1024) -> None:
  import jax  # noqa: PLC0415 (the child process only)
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import core  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends.mosaic_gpu import (MosaicGpuBackend,  # noqa: PLC0415
                                          MosaicGpuConfig)
  backend = MosaicGpuBackend(MosaicGpuConfig(**fields))
  compile_offline = None
  hopper = contextlib.ExitStack()
  if plugin:
    # Lowering for CUDA on the CPU: the target is taken for a Hopper GPU.
    hopper.enter_context(jflash.lowering_for("cuda",
                                             "NVIDIA H100 80GB HBM3"))
    compile_offline = _offline_compiler(plugin)
  for head_dim in head_dims:
    if head_dim > 128 and fields.get("fuse_dq"):
      continue  # the fused backward serves head dims up to 128
    q = jnp.ones((1, seq_len, heads, head_dim), jnp.bfloat16)
    kwargs = _mask_kwargs(mask, seq_len)
    loss = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
        q, k, v, implementation=backend, **kwargs).astype(jnp.float32).sum()
    print(f"=== head dim {head_dim}", flush=True)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    if compile_offline is None:
      jax.block_until_ready(grad(q, q, q))
      continue
    known = set(core.KNOWN_KERNELS)
    grad.trace(q, q, q).lower(lowering_platforms=("cuda",))
    for kernel_id, module in list(core.KNOWN_KERNELS.items()):
      if kernel_id not in known:
        compile_offline(module)
  hopper.close()


def summarize(text: str) -> list[str]:
  """The head-dim markers, and per ptxas function its register and
  spill lines, one line each."""
  lines, function = [], None
  for line in text.splitlines():
    if line.startswith("=== "):
      lines.append(line)
      continue
    named = re.search(r"(?:Function properties for|Compiling entry "
                      r"function|in function) '?([\w.$]+)'?", line)
    if named:
      function = named.group(1)
      if "properties" in line or "Compiling" in line:
        continue
    low = line.lower()
    if ("spill" in low or "used" in low and "registers" in low
        or "ptxas warning" in low or "performance loss" in low):
      lines.append(f"{function}: {line.strip()}")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", nargs="*", default=[],
                      help="MosaicGpuConfig fields, e.g. fuse_dq=true")
  parser.add_argument("--head-dims", default="64,128,256")
  parser.add_argument("--offline", metavar="DIR", default=None,
                      help="compile on a host without a GPU, with what "
                      "tools/offline_cuda/setup.sh prepared in DIR")
  parser.add_argument("--raw", metavar="FILE", default=None,
                      help="write the compiler's whole output to FILE")
  parser.add_argument("--sass", action="store_true",
                      help="also dump SASS (into --raw's file)")
  parser.add_argument("--mask", default="causal", choices=sorted(_MASKS),
                      help="the mask the kernels are compiled for")
  parser.add_argument("--heads", type=int, default=2,
                      help="heads of the [1, T, heads, H] inputs; with "
                      "more than about 16 the persistent kernels get "
                      "several items per CTA, whose code (the next item's "
                      "loads) is otherwise folded away")
  parser.add_argument("--seq-len", type=int, default=1024,
                      help="T of the inputs (queries and keys); a length "
                      "that is not a multiple of the tiles compiles the "
                      "tail tiles' code paths")
  parser.add_argument("--turn-gap", action="store_true",
                      help="also compile the forward kernels' PTX to SASS "
                      "(ptxas and nvdisasm from PATH, or --offline's) and "
                      "print what each consumer computes between taking "
                      "its turn and issuing P V (tools/sass_turn_gap.py)")
  parser.add_argument("--compile-only", action="store_true",
                      help=argparse.SUPPRESS)
  parser.add_argument("--plugin", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  fields = _parse_config(args.config)
  head_dims = [int(h) for h in args.head_dims.split(",")]
  if args.compile_only:
    _compile(fields, head_dims, args.plugin, args.mask, args.heads,
             args.seq_len)
    return
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
  if args.sass:
    env["MOSAIC_GPU_DUMP_SASS"] = "1"
  child = [sys.executable, __file__, "--compile-only", "--head-dims",
           args.head_dims, "--mask", args.mask, "--heads", str(args.heads),
           "--seq-len", str(args.seq_len), "--config", *args.config]
  if args.offline:
    root = os.path.abspath(args.offline)
    unpacked = os.path.join(root, "unpacked")
    cuda = os.path.join(unpacked, "nvidia", "cu13")
    env.update(
        LD_LIBRARY_PATH=os.path.join(root, "driver"),
        PATH=os.path.join(cuda, "bin") + os.pathsep + env.get("PATH", ""),
        MOSAIC_GPU_CUDA_ROOT=cuda,
        MOSAIC_GPU_RUNTIME_LIB_PATH=os.path.join(
            unpacked, "jax_cuda13_plugin", "libmosaic_gpu_runtime.so"),
        JAX_PLATFORMS="cpu")
    child += ["--plugin", os.path.join(unpacked, "jax_plugins", "xla_cuda13",
                                       "xla_cuda_plugin.so")]
  done = subprocess.run(child, env=env, capture_output=True, text=True,
                        check=False)
  if args.raw:
    with open(args.raw, "w") as f:
      f.write(done.stdout + done.stderr)
  for line in summarize(done.stdout + done.stderr):
    print(line, flush=True)
  if done.returncode:
    print(f"compiling failed (exit {done.returncode}):\n"
          + done.stderr[-2000:], flush=True)
  if args.turn_gap and not done.returncode:
    # Compiled again with the PTX dumped (a dump takes ptxas's report off
    # the output that the lines above read).
    dump = tempfile.mkdtemp(prefix="jflash-ptx-")
    subprocess.run(child, env=dict(env, MOSAIC_GPU_DUMP_TO=dump,
                                   MOSAIC_GPU_DUMP_PTX="1"),
                   capture_output=True, text=True, check=False)
    _print_turn_gaps(dump, env)
    shutil.rmtree(dump, ignore_errors=True)


def _print_turn_gaps(dump: str, env: dict) -> None:
  """SASS of every forward kernel's PTX under ``dump`` (in the order
  compiled: one per head dim) and its turn gaps."""
  numbered = [(int(m.group(1)), f) for f in os.listdir(dump)
              if (m := re.fullmatch(r"jflash_forward_(\d+)\.ptx", f))]
  ptx = [f for _, f in sorted(numbered)]
  if not ptx:
    print("turn gaps: no forward PTX was dumped", flush=True)
  for name in ptx:
    source = os.path.join(dump, name)
    cubin = source[:-len(".ptx")] + ".cubin"
    steps = (["ptxas", "-arch=sm_90a", "-O3", source, "-o", cubin],
             ["nvdisasm", "-c", cubin])
    for step in steps:
      out = subprocess.run(step, env=env, capture_output=True, text=True,
                           check=False)
      if out.returncode:
        print(f"{name}: {step[0]} failed: {out.stderr[-500:]}", flush=True)
        break
    else:
      gaps = sass_turn_gap.turn_gaps(out.stdout)
      print(f"{name}: {len(gaps)} turn waits", flush=True)
      for gap in gaps:
        print("  " + sass_turn_gap.describe(gap), flush=True)


if __name__ == "__main__":
  main()
