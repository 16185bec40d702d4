"""Formulations of the backward's row statistics (``delta = rowsum(dO * O)
- dlse`` and the base-2 logsumexp, ``[B, N, 2, Tp]``) timed inside a whole
forward+backward of the ``mosaic_gpu`` backend on a Hopper GPU (CUPTI,
kernel by kernel, as ``tools/kernel_times.py``).

XLA fuses the statistics into one fusion whose cost depends on how the
reduction over the head dimension meets the ``T <-> N`` transpose; this
tool swaps ``jflash.backends.mosaic_gpu._row_statistics`` for each
formulation and prints, per cell, the time of the kernels that are not
jflash's and whether the gradients match the current formulation's.

Usage (from the repository root, on the GPU)::

  PYTHONPATH=. python3 tools/row_statistics_variants.py [--cells 128:1024:0]
"""

from __future__ import annotations

import argparse

from kernel_times import _kernel_medians, _short


def _variants():
  import jax  # noqa: PLC0415 (only where a GPU runs)
  import jax.numpy as jnp  # noqa: PLC0415

  from jflash.backends import mosaic_gpu  # noqa: PLC0415
  from jflash.backends.padding import pad_axis  # noqa: PLC0415
  log2e = mosaic_gpu.LOG2E

  def finish(delta_btn, lse, q_pad, barrier):
    if barrier:
      delta_btn = jax.lax.optimization_barrier(delta_btn)
    delta = pad_axis(jnp.swapaxes(delta_btn, 1, 2), 2, q_pad)
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * log2e)
    return jnp.stack([lse2, delta], axis=2)

  def row_reduce(out, d_out, lse, d_lse, q_pad):
    """The current reduction without its barrier: XLA fuses it with the
    transpose again."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32),
                    axis=-1) - d_lse.astype(jnp.float32)
    return finish(delta, lse, q_pad, False)

  def batched_dot(out, d_out, lse, d_lse, q_pad):
    delta = jax.lax.dot_general(
        d_out, out.astype(d_out.dtype), (((3,), (3,)), ((0, 1, 2), (0, 1, 2))),
        preferred_element_type=jnp.float32) - d_lse.astype(jnp.float32)
    return finish(delta, lse, q_pad, True)

  def fused_einsum(out, d_out, lse, d_lse, q_pad):
    """The first formulation: one einsum to ``[B, N, T]``, which XLA fuses
    with the transpose (uncoalesced reads of O and dO)."""
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32),
                       out.astype(jnp.float32))
    delta = pad_axis(delta - jnp.swapaxes(d_lse.astype(jnp.float32), 1, 2),
                     2, q_pad)
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * log2e)
    return jnp.stack([lse2, delta], axis=2)

  def reduction_barrier(out, d_out, lse, d_lse, q_pad):
    """The earlier formulation: a row reduction (its order left to XLA,
    which may pick it per process) behind a barrier."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32),
                    axis=-1) - d_lse.astype(jnp.float32)
    return finish(delta, lse, q_pad, True)

  def tree_by_8_columns(out, d_out, lse, d_lse, q_pad):
    """The current two stages with 8 partial sums per row instead of 32
    (the same additions: halve ``[..., H / 8, 8]`` over its first axis,
    then the 8 partial sums)."""
    x = d_out.astype(jnp.float32) * out.astype(jnp.float32)
    h = x.shape[-1]
    if h % 8 or h & (h - 1):
      return mosaic_gpu._row_statistics(out, d_out, lse, d_lse, q_pad)  # noqa: SLF001
    x = x.reshape(*x.shape[:-1], h // 8, 8)
    while x.shape[-2] > 1:
      half = x.shape[-2] // 2
      x = x[..., :half, :] + x[..., half:, :]
    partial = jax.lax.optimization_barrier(x[..., 0, :])
    delta = mosaic_gpu._fixed_order_row_sum(partial)  # noqa: SLF001
    return finish(delta - d_lse.astype(jnp.float32), lse, q_pad, True)

  def one_stage_tree(out, d_out, lse, d_lse, q_pad):
    """The earlier fixed order in one fusion: halving each whole row (the
    same additions; XLA fused it with the transpose and read each row
    from one thread, 0.36 ms at S=1024 on an H200)."""
    x = d_out.astype(jnp.float32) * out.astype(jnp.float32)
    width = 1
    while width < x.shape[-1]:
      width *= 2
    x = pad_axis(x, x.ndim - 1, width)
    while x.shape[-1] > 1:
      half = x.shape[-1] // 2
      x = x[..., :half] + x[..., half:]
    return finish(x[..., 0] - d_lse.astype(jnp.float32), lse, q_pad, True)

  # "current" (mosaic_gpu._row_statistics): a fixed halving tree of
  # elementwise additions in two stages (32 partial sums per row), behind
  # optimization barriers.
  return {"current": mosaic_gpu._row_statistics,  # noqa: SLF001
          "reduction_barrier": reduction_barrier,
          "tree_by_8_columns": tree_by_8_columns,
          "one_stage_tree": one_stage_tree,
          "fused_einsum": fused_einsum,
          "row_reduce": row_reduce,
          "batched_dot_barrier": batched_dot}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--cells", nargs="*",
                      default=["128:1024:0", "128:4096:1", "128:16384:0"])
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--variants", nargs="*", default=None,
                      help="names of the formulations to time (default: "
                      "all); 'current' always runs first")
  args = parser.parse_args()

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from jflash.backends import mosaic_gpu  # noqa: PLC0415
  rng = np.random.default_rng(0)
  variants = _variants()
  if args.variants:
    unknown = set(args.variants) - set(variants)
    if unknown:
      raise SystemExit(f"unknown variants {sorted(unknown)}; known: "
                       f"{sorted(variants)}")
    variants = {name: variant for name, variant in variants.items()
                if name == "current" or name in args.variants}
  for text in args.cells:
    head_dim, seq, causal = (int(x) for x in text.split(":"))
    heads, batch = 2048 // head_dim, 16384 // seq
    q, k, v, cot = (jnp.asarray(rng.standard_normal(
        (batch, seq, heads, head_dim)), jnp.bfloat16) for _ in range(4))
    reference = None
    for name, variant in variants.items():
      mosaic_gpu._row_statistics = variant  # noqa: SLF001

      def both(q, k, v, cot):
        out, vjp = jax.vjp(lambda q, k, v: jflash.dot_product_attention(
            q, k, v, is_causal=bool(causal), implementation="mosaic_gpu"),
            q, k, v)
        return (out, *vjp(cot))
      fn = jax.jit(both)  # the cotangent an argument, as in training
      grads = [np.asarray(x, np.float32) for x in fn(q, k, v, cot)]
      if reference is None:
        reference, same = grads, "reference"
      else:
        worst = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                    for a, b in zip(grads, reference))
        same = f"max rel. difference to current {worst:.1e}"
      kernels = _kernel_medians(fn, (q, k, v, cot), args.iterations)
      total = sum(ms for _, ms in kernels)
      others = [(n, ms) for n, ms in kernels if not n.startswith("jflash")]
      other_ms = sum(ms for _, ms in others)
      listed = ", ".join(f"{_short(n)} {ms:.3f}" for n, ms in others
                         if ms >= 0.005)
      print(f"{text} {name}: total {total:.3f} ms, not jflash's "
            f"{other_ms:.3f} ms ({listed}); {same}", flush=True)
  mosaic_gpu._row_statistics = variants["current"]  # noqa: SLF001


if __name__ == "__main__":
  main()
