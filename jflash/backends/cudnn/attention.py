"""The ``cudnn`` backend: ``jax.nn.dot_product_attention(implementation="cudnn")``.

It serves only calls whose meaning cuDNN reproduces exactly, and declines
(``NotImplementedError``) everything else rather than approximate it:
segment ids, soft cap, dense boolean masks (whose fully hidden rows cuDNN
does not define), windows without ``is_causal`` (cuDNN supports only a left
window), ``return_residual=True`` (``jax.nn`` stops the gradient of cuDNN's
logsumexp; jflash's is differentiable), a scale that is not positive (cuDNN
returns NaN for it, measured on an H200), float32/float64 inputs, head dims
that are not multiples of 8 or above 256, and platforms other than CUDA
GPUs.  Rows with no visible key are set to zeros and a logsumexp of
``-inf``, as for every jflash backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jflash.core.call import AttentionCall

Array = jax.Array


def _decline(reason: str):
  raise NotImplementedError(f"cudnn: {reason}")


@dataclasses.dataclass(frozen=True)
class CudnnBackend:
  """Delegates to cuDNN's fused attention through ``jax.nn``."""

  name: str = "cudnn"

  def __call__(self, call: AttentionCall) -> tuple[Array, Array]:
    if call.interpret:
      _decline("cuDNN kernels cannot run in Pallas interpret mode")
    platform = call.target().platform
    if platform != "cuda":
      _decline(f"needs a CUDA GPU, the call is traced for {platform!r}")
    mask = call.mask
    if call.dtype not in (jnp.bfloat16, jnp.float16):
      _decline(f"needs bfloat16 or float16 inputs, got {call.dtype}")
    head_dim = call.query.shape[-1]
    if head_dim % 8 or head_dim > 256:
      _decline(f"head dim {head_dim} is not a multiple of 8 up to 256")
    if mask.q_segment_ids is not None:
      _decline("segment_ids are not supported")
    if call.logits_soft_cap is not None:
      _decline("logits_soft_cap is not supported")
    if call.alibi_slopes is not None:
      _decline("alibi_slopes are not supported through jax.nn")
    if mask.dense is not None:
      _decline("a dense boolean mask is not supported")
    if mask.mask_fn is not None:
      _decline("mask_fn is not supported through jax.nn")
    if mask.has_offsets:
      _decline("sequence offsets (context parallelism) are not supported")
    if mask.window is not None and not mask.is_causal:
      _decline("local_window_size needs is_causal=True")
    if not call.scale > 0:
      # cuDNN's kernels return NaN for a zero or negative scale.
      _decline(f"needs a positive scale, got {call.scale}")
    if call.returns_residual:
      _decline("jax.nn's cuDNN path returns a logsumexp without gradient")
    try:
      out, lse = jax.nn.dot_product_attention(
          call.query, call.key, call.value, call.bias, None,
          scale=call.scale, is_causal=mask.is_causal,
          query_seq_lengths=mask.q_lengths,
          key_value_seq_lengths=mask.kv_lengths,
          local_window_size=mask.window, implementation="cudnn",
          return_residual=True)
    except (ValueError, RuntimeError, NotImplementedError) as err:
      raise NotImplementedError(f"cudnn: {err}") from err
    lse = lse.astype(jnp.float32)
    if mask.may_have_empty_rows():
      has_keys = mask.rows_with_visible_keys()[:, :, None]  # [B, T, 1]
      out = jnp.where(has_keys[..., None], out, jnp.zeros((), out.dtype))
      lse = jnp.where(has_keys, lse, -jnp.inf)
    return out, lse
