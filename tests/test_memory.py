"""Linear memory: forward+backward at T = S = 16384 runs on the CPU with a
small fraction of the memory that materialized logits would take."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import reference
from jflash.masks import AttentionMask
from tests._support import fresh_rng, rel_err
from tests.conftest import OPTIMIZED

B, T, N, H = 1, 16384, 8, 64
LOGITS_BYTES = B * N * T * T * 4  # one float32 [B, N, T, S] tensor: 8.6 GB


def _fwd_bwd(q, k, v, cot):
  out, vjp = jax.vjp(jflash.dot_product_attention, q, k, v)
  return out, vjp(cot)


@pytest.mark.slow
def test_long_sequence_forward_backward_is_linear_in_memory():
  spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  compiled = jax.jit(_fwd_bwd).lower(spec, spec, spec, spec).compile(
      compiler_options=OPTIMIZED)
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < 0.05 * LOGITS_BYTES, f"temporaries {temp / 1e6:.0f} MB"

  rng = fresh_rng()
  q, k, v, cot = (jnp.asarray(rng.standard_normal((B, T, N, H), np.float32))
                  for _ in range(4))
  out, (dq, dk, dv) = compiled(q, k, v, cot)

  # A few query rows against the reference (each output row and its dq row
  # depend only on that query row).
  rows = np.array([0, 1, 4097, T - 1])
  mask = AttentionMask(batch=B, q_len=len(rows), kv_len=T)

  def ref_rows(q_rows):
    return reference.reference_attention(q_rows, k, v, None, mask,
                                         scale=H ** -0.5)[0]

  want, ref_vjp = jax.vjp(ref_rows, q[:, rows])
  assert rel_err(out[:, rows], want) < 1e-5
  assert rel_err(dq[:, rows], ref_vjp(cot[:, rows])[0]) < 1e-5
  # Global identities: softmax rows sum to one, so sum_s dV[s] = sum_t dO[t];
  # and sum_s dS[t, s] = 0 for every row, so sum_s dK[s] = 0.
  assert rel_err(dv.sum(1), cot.sum(1)) < 1e-4
  dk_sum = jnp.abs(dk.sum(1))
  assert float((dk_sum / jnp.abs(dk).sum(1)).max()) < 1e-4
