"""Hash the Mosaic GPU module of every default ``mosaic_gpu`` kernel, on any
host, so that two source trees can be checked to build the same kernels.

Each cell (head dim, mask feature, lengths) goes through
``jflash.dot_product_attention(..., implementation="mosaic_gpu")`` with its
gradient, lowered for CUDA on the host (no GPU needed: the backend's Hopper
check is bypassed).  Each Mosaic GPU custom call's module is read back from
its bytecode, printed without source locations, and hashed; the forward,
dQ, dK/dV or fused backward kernels of a cell appear in lowering order.

Usage (from the repository root; ``OLD`` a checkout of another commit)::

  PYTHONPATH=OLD python tools/mosaic_gpu_modules.py --save old.json
  PYTHONPATH=. python tools/mosaic_gpu_modules.py --save new.json
  python tools/mosaic_gpu_modules.py --compare old.json new.json

``--x64`` lowers with ``jax_enable_x64`` on; ``--text DIR`` also writes each
module's text; ``--only TEXT`` keeps the cells whose name contains it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys

HOPPER = "NVIDIA H100 80GB HBM3"
"""The device kind the modules are lowered for."""

# (head dim, query length, key length, feature).  The 4096-key cells select
# the fused backward by default at head dims 64 and 128 (without a mask and
# causal); the others run the two-pass backward.
_HEAD_DIMS = (64, 128, 256)
_FEATURES = ("none", "causal", "window", "lengths", "segments", "softcap",
             "gqa")
_LENGTHS = ((200, 330), (4096, 4096))


def _cells():
  for head_dim in _HEAD_DIMS:
    for t, s in _LENGTHS:
      for feature in _FEATURES:
        yield head_dim, t, s, feature


def _name(head_dim, t, s, feature) -> str:
  return f"h={head_dim} t={t} s={s} {feature}"


def _lower(head_dim: int, t: int, s: int, feature: str):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import jflash  # noqa: PLC0415

  batch, heads = 2, 4
  kv_heads = 2 if feature == "gqa" else heads
  q = jax.ShapeDtypeStruct((batch, t, heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, s, kv_heads, head_dim), jnp.bfloat16)
  ints = jax.ShapeDtypeStruct((batch,), jnp.int32)
  q_ids = jax.ShapeDtypeStruct((batch, t), jnp.int32)
  kv_ids = jax.ShapeDtypeStruct((batch, s), jnp.int32)
  args = (q, kv, kv, ints, ints, q_ids, kv_ids)

  def loss(q, k, v, q_lengths, kv_lengths, q_segments, kv_segments):
    extra = {}
    if feature == "causal":
      extra = dict(is_causal=True)
    elif feature == "window":
      extra = dict(is_causal=True, local_window_size=(100, 0))
    elif feature == "lengths":
      extra = dict(query_seq_lengths=q_lengths,
                   key_value_seq_lengths=kv_lengths)
    elif feature == "segments":
      extra = dict(segment_ids=(q_segments, kv_segments))
    elif feature == "softcap":
      extra = dict(logits_soft_cap=30.0)
    out = jflash.dot_product_attention(q, k, v, implementation="mosaic_gpu",
                                       **extra)
    return jnp.sum(out.astype(jnp.float32))

  run = jax.grad(loss, argnums=(0, 1, 2))
  return jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",))


def _modules(lowered) -> list[tuple[str, str]]:
  """``(kernel name, module text without locations)`` per Mosaic GPU call."""
  from jax._src.interpreters import mlir  # noqa: PLC0415
  from jax._src.lib import mosaic_gpu_dialect  # noqa: PLC0415
  from jax._src.lib.mlir import ir  # noqa: PLC0415

  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          inner = inner.operation
          if (inner.name == "stablehlo.custom_call" and "mosaic_gpu"
              in str(inner.attributes["call_target_name"])):
            config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
            found.append(ir.StringAttr(config["module"]).value_bytes)
          walk(inner)

  walk(lowered.compiler_ir("stablehlo").operation)
  context = mlir.make_ir_context()
  context.allow_unregistered_dialects = True
  mosaic_gpu_dialect.register_dialect(context)
  result = []
  for data in found:
    module = ir.Module.parse(data, context=context)
    text = module.operation.get_asm(enable_debug_info=False)
    # The dump name carries a per-process counter.
    text = re.sub(r'(dump_basename = "[A-Za-z_]*?)_\d+"', r'\1"', text)
    name = re.search(r"module @(\w+)", text)
    result.append((name.group(1) if name else "?", text))
  return result


def _save(path: str, only: list[str], x64: bool, text_dir: str | None):
  import jax  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends import mosaic_gpu  # noqa: PLC0415

  if x64:
    jax.config.update("jax_enable_x64", True)
  # Lowering for CUDA from a host without a Hopper GPU, in this tree's
  # way or in an older tree's.
  hopper = contextlib.ExitStack()
  if hasattr(jflash, "lowering_for"):
    hopper.enter_context(jflash.lowering_for("cuda", HOPPER))
  elif hasattr(mosaic_gpu, "lowering_for_hopper"):
    hopper.enter_context(mosaic_gpu.lowering_for_hopper())
  else:
    mosaic_gpu._is_hopper = lambda: True  # noqa: SLF001
  results = {}
  for cell in _cells():
    name = _name(*cell)
    if only and not any(text in name for text in only):
      continue
    try:
      modules = _modules(_lower(*cell))
    except Exception as err:  # noqa: BLE001 (record and go on)
      results[name] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
      print(f"{name}: {results[name]['error']}", flush=True)
      continue
    results[name] = dict(kernels=[
        [kernel, hashlib.sha256(text.encode()).hexdigest()[:16]]
        for kernel, text in modules])
    print(f"{name}: " + " ".join(f"{k}:{h}" for k, h
                                 in results[name]["kernels"]), flush=True)
    if text_dir:
      os.makedirs(text_dir, exist_ok=True)
      for i, (kernel, text) in enumerate(modules):
        file = re.sub(r"[^\w=]+", "_", name) + f"_{i}_{kernel}.mlir"
        with open(os.path.join(text_dir, file), "w") as f:
          f.write(text)
  hopper.close()
  with open(path, "w") as f:
    json.dump(results, f, indent=1)


def _compare(old_path: str, new_path: str) -> bool:
  with open(old_path) as f:
    old = json.load(f)
  with open(new_path) as f:
    new = json.load(f)
  same = True
  for name in sorted(set(old) | set(new)):
    a, b = old.get(name), new.get(name)
    if a != b:
      same = False
      print(f"DIFFERENT {name}: {a} -> {b}")
  print(f"{len(old)} cells, " + ("all identical" if same else "differences"))
  return same


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--save")
  parser.add_argument("--compare", nargs=2)
  parser.add_argument("--only", nargs="*", default=[])
  parser.add_argument("--x64", action="store_true")
  parser.add_argument("--text", help="also write each module's text here")
  args = parser.parse_args()
  if args.compare:
    sys.exit(0 if _compare(*args.compare) else 1)
  _save(args.save, args.only, args.x64, args.text)


if __name__ == "__main__":
  main()
