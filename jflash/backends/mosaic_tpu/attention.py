"""The ``mosaic_tpu`` backend: FlashAttention kernels in Pallas Mosaic TPU.

Three kernels (:mod:`.forward`, :mod:`.backward`) walk one block-sparse
tile schedule from :mod:`jflash.masks`, passed to each by scalar prefetch:
empty tiles are neither copied into VMEM nor computed, full tiles skip the
element mask.  Runs on TPUs, and anywhere in Pallas's interpret mode
(``interpret=True``), which is how it is tested on the CPU.  See
``docs/tpu.md`` for what was verified and the tiling per generation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jflash import tiles
from jflash.core.call import AttentionCall
from jflash.core.padding import round_up
from jflash.parallel.partitioning import run_sharded
from jflash.backends.mosaic_tpu import common, ops
from jflash.backends.mosaic_tpu.common import Plan
from jflash.backends.mosaic_tpu.config import (LANES, SUBLANES,
                                               MosaicTpuConfig, generation_of)

Array = jax.Array

MAX_HEAD_DIM = 256
"""Largest head dim served (padded to 256 lanes)."""
METADATA_BUDGET_BYTES = 256 * 1024
"""Most scalar-prefetch (SMEM) bytes one kernel's tile visits may take."""
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _granule(block: int) -> int:
  return LANES if block % LANES == 0 else SUBLANES


@dataclasses.dataclass(frozen=True)
class MosaicTpuBackend:
  """Pallas Mosaic TPU kernels.

  Serves float32, bfloat16 and float16 (computed by the float32 kernels)
  with head dims up to 256, causal, windows, lengths, segment ids, GQA/MQA,
  soft cap and ALiBi, also for masks with query/key offsets (one block of
  context parallelism, through :meth:`forward` and :meth:`backward` as
  well as the ordinary call).  Declines (``NotImplementedError``): a dense
  ``bias`` or boolean ``mask`` (``xla`` serves them), other dtypes, larger
  head dims, and any platform but a TPU unless the call asks for
  ``interpret=True``.

  Attributes:
    config: the tiling; its ``None`` fields follow the TPU generation.
    name: ``"mosaic_tpu"``.
  """

  config: MosaicTpuConfig = MosaicTpuConfig()
  name: str = "mosaic_tpu"

  def __call__(self, call: AttentionCall) -> tuple[Array, Array]:
    """``(out [B, T, N, H], logsumexp [B, T, N] float32)``; inputs
    explicitly sharded over batch or heads run per shard."""
    self._check_supported(call)
    return run_sharded(call, self, self._run, call.context_parallel)

  def _run(self, call: AttentionCall) -> tuple[Array, Array]:
    batch, q_len, _, _ = call.query.shape
    if 0 in (batch, q_len, call.key.shape[1]):
      # An empty grid runs no kernel step, so nothing would write the
      # outputs: no key is visible, hence zeros and a logsumexp of -inf.
      q = call.query
      return (jnp.zeros_like(q),
              jnp.full(q.shape[:-1], -jnp.inf, jnp.float32))
    plan = self.plan(call)
    return ops.attention(call.query, call.key, call.value, call.mask,
                         call.alibi_slopes, plan)

  def forward(self, call: AttentionCall) -> tuple[Array, Array]:
    """``(out float32, lse)`` without a derivative: one block of a
    context-parallel call."""
    self._check_supported(call)
    if 0 in call.query.shape[:2] or call.key.shape[1] == 0:
      return self._run(call)
    plan = self.plan(call)
    return ops.run_forward(call.query, call.key, call.value, call.mask,
                           call.alibi_slopes,
                           common.metadata(call.mask, plan), plan,
                           jnp.float32)

  def backward(self, call: AttentionCall, out: Array, lse: Array,
               d_out: Array, d_lse: Array) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of one block given the whole call's ``out`` and
    ``lse``."""
    self._check_supported(call)
    if 0 in call.query.shape[:2] or call.key.shape[1] == 0:
      return (jnp.zeros_like(call.query), jnp.zeros_like(call.key),
              jnp.zeros_like(call.value))
    plan = self.plan(call)
    return ops.run_backward(call.query, call.key, call.value, call.mask,
                            call.alibi_slopes,
                            common.metadata(call.mask, plan), plan, out, lse,
                            d_out, d_lse)

  def plan(self, call: AttentionCall) -> Plan:
    """The static plan of one call, or ``NotImplementedError`` if this
    backend declines it."""
    self._check_supported(call)
    mask = call.mask
    batch, q_len, _, head_dim = call.query.shape
    kv_len = call.key.shape[1]
    kernel_dtype = jnp.float32 if call.dtype == jnp.float16 else call.dtype
    head_padded = round_up(max(head_dim, 1), LANES)  # H = 0 takes 1 block
    gen = generation_of(call.target().device_kind)
    block_q, block_kv, vmem_limit = self.config.resolve(
        gen, head_padded, jnp.dtype(kernel_dtype).itemsize,
        interpret=call.interpret)
    # Short sequences shrink a block to the sequence, rounded up to whole
    # 128-row tiles when the block is TPU-legal (so that interpret mode
    # runs the plan a TPU would), else to whole sublanes.
    block_q = min(block_q, round_up(q_len, _granule(block_q)))
    block_kv = min(block_kv, round_up(kv_len, _granule(block_kv)))
    num_q, num_kv = -(-q_len // block_q), -(-kv_len // block_kv)
    kv_steps, q_steps = tiles.max_visited_blocks(mask, block_q, block_kv)
    per_row = (mask.q_lengths is not None or mask.kv_lengths is not None
               or mask.q_segment_ids is not None)
    per_batch = per_row and self._metadata_bytes(
        batch, num_q, num_kv, kv_steps, q_steps) <= METADATA_BUDGET_BYTES
    needed = self._metadata_bytes(batch if per_batch else 1, num_q, num_kv,
                                  kv_steps, q_steps)
    if needed > METADATA_BUDGET_BYTES:
      raise NotImplementedError(
          f"{self.name}: the tile schedule of {num_q}x{num_kv} tiles of "
          f"{block_q}x{block_kv} needs {needed} bytes of SMEM, more than "
          f"{METADATA_BUDGET_BYTES}; use larger blocks or 'xla'")
    interpret = False
    if call.interpret:
      interpret = (True if self.config.interpret_params is None
                   else self.config.interpret_params)
    return Plan(
        scale=float(call.scale), soft_cap=call.logits_soft_cap,
        rules=mask.static_rules(),
        block_q=block_q, block_kv=block_kv, num_q=num_q, num_kv=num_kv,
        kv_steps=kv_steps, q_steps=q_steps, head_dim=head_padded,
        per_batch=per_batch, has_segments=mask.q_segment_ids is not None,
        interpret=interpret, vmem_limit_bytes=vmem_limit)

  # ---------------------------------------------------------------- checks
  def _check_supported(self, call: AttentionCall) -> None:
    platform = call.target().platform
    if platform != "tpu" and not call.interpret:
      raise NotImplementedError(
          f"{self.name}: needs a TPU (the call is traced for {platform!r}); "
          "pass interpret=True to run the kernels in Pallas's interpret mode")
    if call.bias is not None:
      raise NotImplementedError(
          f"{self.name}: a dense bias is not supported by these kernels; "
          "the 'xla' backend serves it")
    if call.mask.dense is not None:
      raise NotImplementedError(
          f"{self.name}: a dense boolean mask is not supported by these "
          "kernels; the 'xla' backend serves it")
    if call.dtype not in _DTYPES:
      raise NotImplementedError(
          f"{self.name}: dtype {call.dtype} is not supported (float32, "
          "bfloat16, float16)")
    head_dim = call.query.shape[3]
    if head_dim > MAX_HEAD_DIM:
      raise NotImplementedError(
          f"{self.name}: head dim {head_dim} is above {MAX_HEAD_DIM}")

  @staticmethod
  def _metadata_bytes(rows: int, num_q: int, num_kv: int, kv_steps: int,
                      q_steps: int) -> int:
    """SMEM bytes of the larger of the two visit lists (with counts)."""
    return 4 * rows * max(num_q * (kv_steps + 1), num_kv * (q_steps + 1))


__all__ = ["MAX_HEAD_DIM", "MosaicTpuBackend"]
