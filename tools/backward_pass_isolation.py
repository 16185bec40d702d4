"""Does one backward kernel's run change another's bits?  On a Hopper GPU.

The two-pass backward runs a dQ kernel and then a dK/dV kernel on the same
inputs; neither reads the other's output, so dK and dV must be bitwise the
same whether or not the dQ kernel ran first (and dQ whether or not the dK/dV
kernel ran).  This runs each cell's gradients three ways in one process:
both kernels; the dK/dV kernel alone (the dQ kernel replaced by zeros at
trace time); the dQ kernel alone.  It prints the digests and whether they
agree, and repeats the full run to show it is deterministic.  A mismatch
means one kernel leaves state the other reads (an out-of-bounds write, or a
race whose outcome depends on what ran before).  It also prints digests of
the backward's float32 row statistics (base-2 logsumexp and ``delta``),
copied to the host as they are formed, so that two trees' runs can be
compared for where their bits first part.

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/backward_pass_isolation.py [--only TEXT ...]
"""

from __future__ import annotations

import argparse
import contextlib

from mosaic_gpu_same import _digest

# (head dim, sequence length, causal, soft cap); B * S = 16384, N * H = 2048.
_CELLS = ((256, 4096, False, None), (128, 1024, False, None),
          (64, 4096, True, 30.0), (128, 16384, False, None))


@contextlib.contextmanager
def _replaced(module, name: str, make):
  original = getattr(module, name)
  setattr(module, name, make(original))
  try:
    yield
  finally:
    setattr(module, name, original)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", nargs="*", default=[])
  args = parser.parse_args()

  import jax  # noqa: PLC0415 (only where a GPU runs)
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends import mosaic_gpu  # noqa: PLC0415
  from jflash.backends.mosaic_gpu import backward_dkv, backward_dq  # noqa: PLC0415

  seen_stats = []

  def recording_statistics(original):
    def record(*args, **kwargs):
      stats = original(*args, **kwargs)
      jax.debug.callback(lambda x: seen_stats.append(np.asarray(x)), stats)
      return stats
    return record

  def zeros_instead_of_dq(original):
    del original
    return lambda q, *a, **kw: jnp.zeros(q.shape, q.dtype)

  def zeros_instead_of_dkv(original):
    del original
    return lambda q, k, *a, **kw: (jnp.zeros(k.shape, k.dtype),) * 2

  for head_dim, seq, causal, soft_cap in _CELLS:
    name = f"h={head_dim} s={seq} causal={causal} soft_cap={soft_cap}"
    if args.only and not any(text in name for text in args.only):
      continue
    heads, batch = 2048 // head_dim, 16384 // seq
    rng = np.random.default_rng(seq + head_dim + causal)
    q, k, v, cot = (jnp.asarray(rng.standard_normal(
        (batch, seq, heads, head_dim)), jnp.bfloat16) for _ in range(4))

    def compiled():
      def attend(q, k, v):
        return jflash.dot_product_attention(
            q, k, v, is_causal=causal, logits_soft_cap=soft_cap,
            implementation="mosaic_gpu")
      # A fresh function each time, so that the patched kernels are traced.
      return jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](cot))

    def grads(run=None):
      return [_digest(x) for x in (run or compiled())(q, k, v)]

    run = compiled()
    both = grads(run)
    again = grads(run)
    seen_stats.clear()
    with _replaced(mosaic_gpu, "_row_statistics", recording_statistics):
      recorded = grads()
    stats = seen_stats[-1]  # [B, N, 2, Tp]
    print(f"{name}: lse2 {_digest(stats[:, :, 0])} delta "
          f"{_digest(stats[:, :, 1])} dq/dk/dv {' '.join(both)} (with the "
          f"statistics copied out: same={recorded == both})", flush=True)
    with _replaced(backward_dq, "dq_kernel_call", zeros_instead_of_dq):
      dkv_alone = grads()
    with _replaced(backward_dkv, "dkv_kernel_call", zeros_instead_of_dkv):
      dq_alone = grads()
    print(f"{name}: rerun same={both == again}; "
          f"dK/dV without the dQ kernel same="
          f"{[both[1] == dkv_alone[1], both[2] == dkv_alone[2]]}; "
          f"dQ without the dK/dV kernel same={both[0] == dq_alone[0]}",
          flush=True)


if __name__ == "__main__":
  main()
