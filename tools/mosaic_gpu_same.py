"""Check that two source trees give bitwise-identical ``mosaic_gpu`` results,
and time both, on a Hopper GPU.

For kernel changes that must not change any number (the order in which
CTAs are launched, scheduling, barriers), this is a stronger check than a
tolerance against the reference: the same fixed-seed inputs go through each
tree in its own process, and the output and gradients must hash the same.

Usage (from the repository root, on the GPU; ``OLD`` a copy of the tree to
compare against, e.g. staged by ``tools/stage_trees.sh``)::

  PYTHONPATH=OLD python3 tools/mosaic_gpu_same.py --save old.json
  PYTHONPATH=. python3 tools/mosaic_gpu_same.py --save new.json
  python3 tools/mosaic_gpu_same.py --compare old.json new.json [more.json]

``--config fuse_dq=true`` (any ``MosaicGpuConfig`` fields) runs a variant;
``--forward-only`` compiles and times the forward alone (a forward change
is checked in half the time).
"""

from __future__ import annotations

import argparse
import hashlib
import json

# (head dim, sequence length, causal, window, feature); B * S = 16384,
# N * H = 2048.  A feature (a soft cap of 30, or 8 packed segments per row)
# marks a cell that runs only when --only names it.
_CELLS = ((128, 16384, False, None, None), (128, 16384, True, None, None),
          (128, 4096, True, None, None), (64, 4096, True, None, None),
          (256, 4096, False, None, None), (128, 16384, True, (1024, 0), None),
          (128, 1024, False, None, None), (128, 1024, True, None, None),
          (128, 4096, True, None, "softcap"), (64, 4096, True, None, "softcap"),
          (128, 16384, False, None, "segments"),
          (64, 4096, False, None, "segments"),
          (256, 16384, False, None, None), (256, 1024, True, None, None),
          (256, 1024, False, None, None), (128, 4096, False, None, None),
          (64, 4096, False, None, None), (64, 16384, False, None, None),
          (64, 16384, True, None, None))
_SEGMENTS = 8


def _digest(x) -> str:
  import numpy as np  # noqa: PLC0415 (only where a GPU runs)
  return hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:16]


def _parse_config(items: list[str]) -> dict:
  """``["fuse_dq=true", "stages=3"]`` -> MosaicGpuConfig fields
  (:func:`benchmarks.impls.config_fields`)."""
  if not items:  # trees older than config_fields run without fields
    return {}
  from benchmarks.impls import config_fields  # noqa: PLC0415
  return config_fields(items)


def _run(path: str, implementation: str, shrink: int,
         config: dict, only: list[str], forward_only: bool = False) -> None:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from benchmarks.timing import TimerConfig, time_function  # noqa: PLC0415

  if config:
    from jflash.backends import (MosaicGpuBackend,  # noqa: PLC0415
                                 MosaicGpuConfig)
    implementation = MosaicGpuBackend(MosaicGpuConfig(**config))

  timer = TimerConfig(repeats=5, warmup=2)
  results = {}
  for head_dim, seq, causal, window, feature in _CELLS:
    label = f"h={head_dim} s={seq} causal={causal} window={window}"
    label += f" {feature}" if feature else ""
    # Matched without "window=None" (in the name and in the filter), so that
    # "window" picks windowed cells and a printed name still picks its cell.
    matched = label.replace(" window=None", "")
    if only and not any(text.replace(" window=None", "") in matched
                        for text in only):
      continue
    if feature and not any(feature in text for text in only):
      continue
    heads, batch = 2048 // head_dim, 16384 // seq
    seq //= shrink
    rng = np.random.default_rng(seq + head_dim + causal)
    q, k, v, cot = (jnp.asarray(rng.standard_normal(
        (batch, seq, heads, head_dim)), jnp.bfloat16) for _ in range(4))
    visible = seq * seq / 2 if causal else seq * seq
    if window is not None:
      visible = sum(min(i, window[0]) + 1 for i in range(seq))
    extra = {}
    if feature == "softcap":
      extra = dict(logits_soft_cap=30.0)
    elif feature == "segments":
      extra = dict(segment_ids=jnp.repeat(
          jnp.arange(_SEGMENTS, dtype=jnp.int32), seq // _SEGMENTS)[None]
          .repeat(batch, axis=0))
      visible = _SEGMENTS * (seq // _SEGMENTS) ** 2
    flops = 4 * batch * heads * visible * head_dim

    def attend(q, k, v, causal=causal, window=window, extra=extra):
      return jflash.dot_product_attention(
          q, k, v, is_causal=causal, local_window_size=window,
          implementation=implementation, **extra)

    def both(q, k, v, cot, attend=attend):
      out, vjp = jax.vjp(attend, q, k, v)
      return (out, *vjp(cot))
    # The cotangent is an argument, as in a training step: closed over as
    # a constant, XLA folds the backward's work on it at compile time.
    forward, both = jax.jit(attend), jax.jit(both)
    name = f"h={head_dim} s={seq} causal={causal} window={window}"
    name += f" {feature}" if feature else ""
    try:
      # forward_only: the output alone, no backward compiled or timed.
      values = (forward(q, k, v),) if forward_only else both(q, k, v, cot)
      t_fwd = time_function(forward, [(q, k, v)], timer)["ms"] * 1e-3
      t_both = float("nan") if forward_only else time_function(
          both, [(q, k, v, cot)], timer)["ms"] * 1e-3
    except Exception as err:  # noqa: BLE001 (record and go on)
      results[name] = dict(error=f"{type(err).__name__}: {str(err)[:200]}")
      print(f"{name}: {results[name]['error']}", flush=True)
      _write(path, results)
      continue
    results[name] = dict(
        digests=[_digest(x) for x in values],
        finite=bool(all(np.isfinite(np.asarray(x, np.float32)).all()
                        for x in values)),
        fwd=flops / t_fwd / 1e12, fwd_bwd=3.5 * flops / t_both / 1e12)
    print(f"{name}: fwd {results[name]['fwd']:6.1f} fwd+bwd "
          f"{results[name]['fwd_bwd']:6.1f} "
          f"finite={results[name]['finite']}", flush=True)
    _write(path, results)  # a run cut short keeps what it measured


def _write(path: str, results: dict) -> None:
  with open(path, "w") as f:
    json.dump(results, f, indent=1)


def _compare(old_path: str, *new_paths: str) -> None:
  for new_path in new_paths:
    print(f"== {old_path} -> {new_path}")
    _compare_two(old_path, new_path)


def _compare_two(old_path: str, new_path: str) -> None:
  with open(old_path) as f:
    old = json.load(f)
  with open(new_path) as f:
    new = json.load(f)
  for name in old:
    a, b = old[name], new.get(name)
    if b is None or "error" in a or "error" in b:
      print(f"{name}: not comparable ({(b or {}).get('error', 'missing')}; "
            f"{a.get('error', 'ran')} in {old_path})")
      continue
    same = [x == y for x, y in zip(a["digests"], b["digests"])]
    print(f"{name}: out/dq/dk/dv identical={same} fwd {a['fwd']:.1f} -> "
          f"{b['fwd']:.1f}, fwd+bwd {a['fwd_bwd']:.1f} -> {b['fwd_bwd']:.1f}")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--save")
  parser.add_argument("--compare", nargs="+")
  parser.add_argument("--implementation", default="mosaic_gpu")
  parser.add_argument("--shrink", type=int, default=1,
                      help="divide sequence lengths (a CPU smoke test)")
  parser.add_argument("--config", nargs="*", default=[],
                      help="MosaicGpuConfig fields, e.g. fuse_dq=true")
  parser.add_argument("--only", nargs="*", default=[],
                      help="run only the cells whose name (as printed, "
                      "before shrinking, without 'window=None') contains "
                      "one of these, e.g. 'h=128 s=16384' or 'window'; "
                      "the soft-cap and packed-segment cells run only when "
                      "named ('softcap', 'segments')")
  parser.add_argument("--forward-only", action="store_true",
                      help="compile, compare and time the forward alone "
                      "(its output's digest; fwd+bwd is recorded as nan)")
  args = parser.parse_args()
  if args.compare:
    _compare(*args.compare)
  else:
    _run(args.save, args.implementation, args.shrink,
         _parse_config(args.config), args.only, args.forward_only)


if __name__ == "__main__":
  main()
