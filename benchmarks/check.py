"""Correctness before timing: errors against a float32 reference.

The reference (:func:`jflash.reference.reference_attention`) materializes the
``[B, N, T, S]`` logits, which is too large at long sequences.  Heads are
independent, so it is computed only for the first ``check_heads`` key/value
heads (and the query heads that read them), and an implementation's output
and gradients are compared on those heads: ``out`` and ``dq`` on the query
heads, ``dk`` and ``dv`` on the key/value heads.  The gradients use the same
random cotangent as the timed function.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from benchmarks.cells import Cell
from jflash.masks import AttentionMask
from jflash.reference import reference_attention

QUANTITIES = ("out", "dq", "dk", "dv")
SANITY_LIMIT = 5e-2
"""A relative error above this (or NaN) fails the cell: it is not timed."""
CUDNN_RATIO_LIMIT = 1.5
"""The accuracy target: no more than this times cuDNN's error."""


def head_counts(cell: Cell, check_heads: int) -> tuple[int, int]:
  """``(query heads, key/value heads)`` compared."""
  kv = max(1, min(check_heads, cell.kv_heads))
  return kv * (cell.num_heads // cell.kv_heads), kv


def reference(cell: Cell, q, k, v, segment_ids, ct,
              check_heads: int = 1) -> dict[str, jax.Array]:
  """Float32 ``out, dq, dk, dv`` on the compared heads."""
  nq, nk = head_counts(cell, check_heads)
  seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  mask = AttentionMask(batch=cell.batch, q_len=cell.seq_len,
                       kv_len=cell.seq_len, is_causal=cell.causal,
                       window=cell.local_window_size, q_segment_ids=seg,
                       kv_segment_ids=seg)
  scale = 1.0 / math.sqrt(cell.head_dim)

  @jax.jit
  def run(q, k, v, ct, mask):
    def attend(q, k, v):
      return reference_attention(q, k, v, None, mask, scale=scale,
                                 compute_dtype=jnp.float32)[0]
    out, pullback = jax.vjp(attend, q, k, v)
    dq, dk, dv = pullback(ct)
    return dict(out=out, dq=dq, dk=dk, dv=dv)

  f32 = lambda x, n: x[:, :, :n].astype(jnp.float32)  # noqa: E731
  return run(f32(q, nq), f32(k, nk), f32(v, nk), f32(ct, nq), mask)


@jax.jit
def _rel_err(x: jax.Array, ref: jax.Array) -> jax.Array:
  x = x.astype(jnp.float32)
  denom = jnp.linalg.norm(ref.ravel())
  return jnp.linalg.norm((x - ref).ravel()) / jnp.where(denom > 0, denom, 1.0)


def relative_errors(cell: Cell, outputs: tuple[jax.Array, ...],
                    ref: dict[str, jax.Array],
                    check_heads: int = 1) -> dict[str, float]:
  """``||x - ref|| / ||ref||`` for each output of a pass (``out`` for the
  forward; ``out, dq, dk, dv`` for forward+backward)."""
  nq, nk = head_counts(cell, check_heads)
  errors = {}
  for name, x in zip(QUANTITIES, outputs):
    n = nq if name in ("out", "dq") else nk
    errors[name] = float(_rel_err(x[:, :, :n], ref[name]))
  return errors


def sanity_failure(errors: dict[str, float]) -> str | None:
  """Why the errors fail the sanity bound, or None."""
  bad = [f"{k}={v:.3g}" for k, v in errors.items()
         if not math.isfinite(v) or v > SANITY_LIMIT]
  if bad:
    return (f"relative error above {SANITY_LIMIT:g} or not finite: "
            + ", ".join(bad))
  return None


def ratios(errors: dict[str, float],
           baseline: dict[str, float] | None) -> dict[str, float] | None:
  """Per-quantity ``error / baseline error`` (None without a baseline)."""
  if not baseline:
    return None
  out = {}
  for k, v in errors.items():
    b = baseline.get(k)
    if b is not None and b > 0 and math.isfinite(v):
      out[k] = v / b
  return out or None
