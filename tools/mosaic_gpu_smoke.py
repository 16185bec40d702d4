"""Quick check of the mosaic_gpu backend on a Hopper GPU: output and
gradients against a float32 reference on a few shapes, bitwise rerun
determinism, then a short timing against jax.nn's cuDNN.

Usage: PYTHONPATH=. python3 tools/mosaic_gpu_smoke.py [--no-timing]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jflash


def _rel(x, y):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _check(rng, b, t, s, n, kh, h, dtype=jnp.bfloat16, **kw):
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
  k = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  cot = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)

  def run(impl, q, k, v):
    f = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
        q, k, v, implementation=impl, **kw)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cot.astype(out.dtype))

  got = jax.jit(lambda q, k, v: run("mosaic_gpu", q, k, v))(q, k, v)
  again = jax.jit(lambda q, k, v: run("mosaic_gpu", q, k, v))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want = jax.jit(lambda q, k, v: run("xla", q, k, v))(*f32)
  plain = jax.jit(lambda q, k, v: run("xla", q, k, v))(q, k, v)
  names = ("out", "dq", "dk", "dv")
  flat = lambda r: [r[0], *r[1]]  # noqa: E731
  errs = {n: _rel(g, w) for n, g, w in zip(names, flat(got), flat(want))}
  base = {n: _rel(g, w) for n, g, w in zip(names, flat(plain), flat(want))}
  same = all(np.array_equal(np.asarray(a), np.asarray(c))
             for a, c in zip(flat(got), flat(again)))
  nan = any(np.isnan(np.asarray(x, np.float32)).any() for x in flat(got))
  ok = same and not nan and all(errs[n] < 2 * base[n] + 5e-3 for n in names)
  print(f"{'OK ' if ok else 'BAD'} b={b} t={t} s={s} n={n} k={kh} h={h} "
        f"{jnp.dtype(dtype).name} {kw}: "
        + " ".join(f"{n}={errs[n]:.2e}(xla-bf16 {base[n]:.1e})"
                   for n in names) + f" deterministic={same} nan={nan}",
        flush=True)
  return ok


def _cases(rng):
  t = 300
  seg = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32)
  yield dict(b=1, t=256, s=256, n=2, kh=2, h=128)
  yield dict(b=1, t=256, s=256, n=2, kh=2, h=128, is_causal=True)
  yield dict(b=2, t=t, s=t, n=4, kh=2, h=64, is_causal=True)
  yield dict(b=2, t=t, s=t, n=4, kh=1, h=128, segment_ids=seg)
  yield dict(b=2, t=t, s=t, n=2, kh=2, h=128, local_window_size=(40, 7),
             logits_soft_cap=3.0, scale=0.5)
  yield dict(b=2, t=t, s=t, n=2, kh=2, h=128,
             query_seq_lengths=jnp.asarray([0, 200], jnp.int32),
             key_value_seq_lengths=jnp.asarray([300, 100], jnp.int32),
             is_causal=True)
  yield dict(b=1, t=130, s=333, n=2, kh=2, h=80)
  yield dict(b=1, t=256, s=256, n=2, kh=2, h=256, is_causal=True)
  yield dict(b=1, t=256, s=256, n=2, kh=2, h=128, dtype=jnp.float16)


def _time(fn, args, calls=10, repeats=5):
  fn(*args)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      result = fn(*args)
    jax.block_until_ready(result)
    times.append((time.perf_counter() - start) / calls)
  return float(np.median(times))


def _timing(rng):
  for h, s, causal in ((128, 16384, False), (128, 16384, True),
                       (64, 4096, False), (128, 4096, False),
                       (128, 4096, True), (256, 4096, False)):
    n, b = 2048 // h, 16384 // s
    q, k, v, cot = (jnp.asarray(rng.standard_normal((b, s, n, h)),
                                jnp.bfloat16) for _ in range(4))
    flops = 4 * b * n * s * s * h / (2 if causal else 1)
    row = []
    for name in ("mosaic_gpu", "cudnn"):
      if name == "cudnn":
        attn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=causal, implementation="cudnn")
      else:
        attn = lambda q, k, v: jflash.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=causal, implementation=name)
      fwd = jax.jit(attn)
      bwd = jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v)[1](cot))
      try:
        tf = flops / _time(fwd, (q, k, v)) / 1e12
        tb = 3.5 * flops / _time(bwd, (q, k, v)) / 1e12
        row.append(f"{name} fwd {tf:6.1f} fwd+bwd {tb:6.1f}")
      except Exception as err:  # noqa: BLE001
        row.append(f"{name} error {type(err).__name__}: {str(err)[:200]}")
    print(f"h={h} s={s} causal={causal}: " + " | ".join(row), flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--no-timing", action="store_true")
  parser.add_argument("--no-checks", action="store_true")
  args = parser.parse_args()
  print(jax.devices(), jflash.default_order(), flush=True)
  rng = np.random.default_rng(int(time.time()))
  ok = True
  for case in () if args.no_checks else _cases(rng):
    print("case", {k: v for k, v in case.items() if not hasattr(v, "shape")},
          flush=True)
    try:
      ok &= _check(rng, **case)
    except Exception as err:  # noqa: BLE001
      ok = False
      print(f"ERR {case}: {type(err).__name__}: {str(err)[:2000]}",
            flush=True)
  if not args.no_timing:
    _timing(rng)
  print("ALL OK" if ok else "FAILURES", flush=True)


if __name__ == "__main__":
  main()
