"""Check that two source trees trace identical ``mosaic_tpu`` kernels.

For refactors of ``jflash/backends/mosaic_tpu`` that must not change any
kernel: every cell below (head dims 64/128/256 with each mask feature, in
float32, bfloat16 and float16, for the CPU interpreter and for abstract
v4 and v6e TPUs) is traced with ``jax.make_jaxpr`` through forward and
backward, and each ``pallas_call`` is written out as text: its name, grid,
compiler parameters, block shapes, index-map jaxprs, scratch and kernel
jaxpr.  Tracing needs no TPU and runs nothing.

Usage (from the repository root; ``OLD`` a copy of the tree to compare
against, e.g. ``git archive REV jflash | tar -x -C OLD``)::

  PYTHONPATH=OLD python3 tools/mosaic_tpu_jaxprs.py --save old.json
  PYTHONPATH=. python3 tools/mosaic_tpu_jaxprs.py --save new.json
  python3 tools/mosaic_tpu_jaxprs.py --compare old.json new.json

``--x64`` traces with ``jax_enable_x64`` on: the kernels must come out
the same as without it (all index math int32, all arithmetic float32).
``--compare`` prints each cell whose kernels differ, with the first
differing lines, and exits with status 1 if any does.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys

HEAD_DIMS = (64, 128, 256)
DTYPES = ("float32", "bfloat16", "float16")
# (name, query heads, key/value heads, T, S, keyword arguments); T and S are
# not multiples of any block, so every kernel has tails.
FEATURES = (
    ("plain", 4, 2, 300, 1100, {}),
    ("causal", 4, 2, 1100, 1100, dict(is_causal=True)),
    ("window", 4, 2, 1100, 1100, dict(local_window_size=(200, 100))),
    ("causal_window", 4, 2, 1100, 1100,
     dict(is_causal=True, local_window_size=(300, 0))),
    ("lengths", 4, 2, 700, 900, dict(query_seq_lengths=[700, 300],
                                     key_value_seq_lengths=[500, 900])),
    ("segments", 4, 2, 700, 900, dict(segment_ids="pair")),
    ("soft_cap", 4, 2, 700, 700, dict(logits_soft_cap=30.0)),
    ("scale", 4, 2, 700, 700, dict(scale=0.3)),
    ("mha", 4, 4, 700, 700, dict(is_causal=True)),
    ("mqa", 6, 1, 700, 700, dict(is_causal=True)),
    ("combined", 4, 2, 700, 700, dict(
        is_causal=True, local_window_size=(250, 0),
        key_value_seq_lengths=[700, 400], segment_ids="self",
        logits_soft_cap=30.0)),
)
# (label, abstract TPU device kind or None for the CPU interpreter).
TARGETS = (("interpret", None), ("v4", "TPU v4"), ("v6e", "TPU v6 lite"))


def _pallas_calls(jaxpr):
  from jax.extend import core  # noqa: PLC0415
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, core.ClosedJaxpr):
          yield from _pallas_calls(sub.jaxpr)
        elif isinstance(sub, core.Jaxpr):
          yield from _pallas_calls(sub)


def _describe(eqn) -> str:
  """One ``pallas_call`` as text, without source locations."""
  params = eqn.params
  grid = params["grid_mapping"]
  lines = [f"name {params['name']}", f"grid {grid.grid}",
           f"index operands {grid.num_index_operands}",
           f"compiler {params['compiler_params']}",
           f"interpret {params['interpret']}",
           f"in {[str(v.aval) for v in eqn.invars]}",
           f"out {[str(a) for a in params['out_avals']]}",
           f"scratch {[str(a) for a in grid.scratch_avals]}"]
  for k, block in enumerate(grid.block_mappings):
    lines.append(f"block {k} {block.block_shape} {block.array_aval}")
    lines.append(str(block.index_map_jaxpr))
  lines.append(str(params["jaxpr"]))
  return "\n".join(lines)


def _cell(head_dim: int, dtype: str, feature, target) -> str:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import jflash  # noqa: PLC0415

  _, heads, kv_heads, t, s, kwargs = feature
  kwargs = dict(kwargs)
  batch = 2
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if name in kwargs:
      kwargs[name] = jnp.asarray(kwargs[name], jnp.int32)
  ids = kwargs.pop("segment_ids", None)
  if ids == "self":
    kwargs["segment_ids"] = jnp.zeros((batch, t), jnp.int32)
  elif ids == "pair":
    kwargs["segment_ids"] = (jnp.zeros((batch, t), jnp.int32),
                             jnp.zeros((batch, s), jnp.int32))
  dt = jnp.dtype(dtype)
  q = jax.ShapeDtypeStruct((batch, t, heads, head_dim), dt)
  kv = jax.ShapeDtypeStruct((batch, s, kv_heads, head_dim), dt)

  def loss(q, k, v):
    out, lse = jflash.dot_product_attention(
        q, k, v, **kwargs, implementation="mosaic_tpu",
        interpret=target[1] is None, return_residual=True)
    return out.astype(jnp.float32).sum() + lse.sum()

  fn = jax.grad(loss, argnums=(0, 1, 2))
  if target[1] is None:
    jaxpr = jax.make_jaxpr(fn)(q, kv, kv)
  else:
    from jax.sharding import (AbstractDevice, AbstractMesh,  # noqa: PLC0415
                              AxisType)
    device = AbstractDevice(device_kind=target[1], num_cores=1,
                            platform="tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                        abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
      jaxpr = jax.make_jaxpr(fn)(q, kv, kv)
  return "\n\n".join(_describe(e) for e in _pallas_calls(jaxpr.jaxpr))


def save(path: str) -> None:
  cells = {}
  for head_dim in HEAD_DIMS:
    for dtype in DTYPES:
      for feature in FEATURES:
        for target in TARGETS:
          label = f"h={head_dim} {dtype} {feature[0]} {target[0]}"
          cells[label] = _cell(head_dim, dtype, feature, target)
  with open(path, "w") as f:
    json.dump(cells, f, indent=0)
  calls = sum(text.count("\nname ") + 1 for text in cells.values())
  print(f"{len(cells)} cells, {calls} kernels -> {path}")


def compare(old_path: str, new_path: str) -> int:
  with open(old_path) as f:
    old = json.load(f)
  with open(new_path) as f:
    new = json.load(f)
  differ = 0
  for label in sorted(set(old) | set(new)):
    a, b = old.get(label), new.get(label)
    if a == b:
      continue
    differ += 1
    print(f"DIFFERENT {label}")
    if a is None or b is None:
      print("  (missing on one side)")
      continue
    diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(),
                                     lineterm="", n=1))
    print("\n".join("  " + line for line in diff[:40]))
  print(f"{len(old)} cells, {differ} different")
  return 1 if differ else 0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--save", metavar="FILE")
  parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
  parser.add_argument("--x64", action="store_true",
                      help="trace with jax_enable_x64 on")
  args = parser.parse_args()
  if args.x64:
    import jax  # noqa: PLC0415
    jax.config.update("jax_enable_x64", True)
  if args.save:
    save(args.save)
  if args.compare:
    sys.exit(compare(*args.compare))


if __name__ == "__main__":
  main()
