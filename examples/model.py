"""A small decoder-only transformer language model in Flax NNX whose
attention layer calls :func:`jflash.dot_product_attention` directly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import jflash


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int
  seq_len: int = 128
  num_layers: int = 4
  d_model: int = 128
  num_heads: int = 4
  mlp_ratio: int = 4
  rope: bool = True  # rotary position embeddings (else learned absolute)
  # ALiBi instead of any position embedding: a per-head linear penalty on
  # the distance between query and key, inside jflash's kernels.
  alibi: bool = False
  dtype: jnp.dtype = jnp.float32
  # How attention runs over a sequence sharded across devices (layout and
  # strategy); None: jflash's defaults.
  context_parallel: jflash.ContextParallel | None = None

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def rotary(x: jax.Array, positions: jax.Array | None = None,
           base: float = 10000.0) -> jax.Array:
  """Rotary position embedding of ``x [B, T, N, H]`` at ``positions
  [B, T]`` (default ``0..T-1``)."""
  t, h = x.shape[1], x.shape[-1]
  if positions is None:
    positions = jnp.arange(t)[None]
  freqs = base ** (-jnp.arange(0, h // 2, dtype=jnp.float32) / (h // 2))
  angles = positions.astype(jnp.float32)[..., None] * freqs
  cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention; the attention itself is jflash's."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    if cfg.d_model % cfg.num_heads:
      raise ValueError(f"d_model={cfg.d_model} must be a multiple of "
                       f"num_heads={cfg.num_heads}")
    self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
    self.rope = cfg.rope and not cfg.alibi
    self.alibi = cfg.alibi
    self.context_parallel = cfg.context_parallel
    init = nnx.initializers.normal(0.02)
    self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, use_bias=False,
                          kernel_init=init, dtype=cfg.dtype, rngs=rngs)
    # Residual projections start small (GPT-2 style) for stable training.
    self.proj = nnx.Linear(
        cfg.d_model, cfg.d_model, use_bias=False, dtype=cfg.dtype,
        kernel_init=nnx.initializers.normal(0.02 / (2 * cfg.num_layers)**0.5),
        rngs=rngs)

  def alibi_slopes(self):
    """ALiBi's standard slopes ``[N]`` (constants, not parameters), or
    None."""
    return jflash.alibi_slopes(self.num_heads) if self.alibi else None

  def qkv_heads(self, x: jax.Array, positions: jax.Array | None = None):
    """``x [B, T, D]`` -> ``q, k, v``, each ``[B, T, N, H]`` (jax.nn layout)."""
    b, t, _ = x.shape
    qkv = self.qkv(x).reshape(b, t, 3, self.num_heads, self.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.rope:
      q, k = rotary(q, positions), rotary(k, positions)
    return q, k, v

  def __call__(self, x: jax.Array,
               positions: jax.Array | None = None) -> jax.Array:
    b, t, d = x.shape
    q, k, v = self.qkv_heads(x, positions)
    # The one line that matters: exact FlashAttention, best kernel for the
    # platform (cuDNN / Mosaic on GPU, Mosaic on TPU, blockwise XLA on CPU),
    # context-parallel when the sequence is sharded across devices.
    y = jflash.dot_product_attention(q, k, v, is_causal=True,
                                     alibi_slopes=self.alibi_slopes(),
                                     context_parallel=self.context_parallel)
    return self.proj(y.reshape(b, t, d))


class MLP(nnx.Module):

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    hidden = cfg.mlp_ratio * cfg.d_model
    self.up = nnx.Linear(cfg.d_model, hidden, dtype=cfg.dtype,
                         kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.down = nnx.Linear(
        hidden, cfg.d_model, dtype=cfg.dtype,
        kernel_init=nnx.initializers.normal(0.02 / (2 * cfg.num_layers)**0.5),
        rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.attn = CausalSelfAttention(cfg, rngs=rngs)
    self.ln2 = nnx.LayerNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array,
               positions: jax.Array | None = None) -> jax.Array:
    x = x + self.attn(self.ln1(x), positions)
    return x + self.mlp(self.ln2(x))


class TransformerLM(nnx.Module):
  """Token embedding (positions: rotary in attention, or learned absolute),
  ``num_layers`` blocks, a final LayerNorm and an output head tied to the
  token embedding."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init,
                           dtype=cfg.dtype, rngs=rngs)
    self.pos = (None if cfg.rope or cfg.alibi else
                nnx.Embed(cfg.seq_len, cfg.d_model, embedding_init=init,
                          dtype=cfg.dtype, rngs=rngs))
    self.blocks = nnx.List([Block(cfg, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array,
               positions: jax.Array | None = None) -> jax.Array:
    """``tokens [B, T]`` int -> logits ``[B, T, vocab]`` (float32).

    ``positions [B, T]``: each token's position in its sequence, when the
    tokens are not in order (a load-balanced layout); default ``0..T-1``.
    """
    x = self.lookup(tokens)
    if self.pos is not None:
      x = x + self.pos(jnp.arange(tokens.shape[1])[None] if positions is None
                       else positions)
    for block in self.blocks:
      x = block(x, positions)
    return self.embed.attend(self.ln_f(x)).astype(jnp.float32)

  def lookup(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings ``[B, T, D]``.  Tokens explicitly sharded over a
    mesh (``jax.sharding.AxisType.Explicit``) give embeddings sharded the
    same way, which JAX asks to be stated for a gather."""
    spec = getattr(jax.typeof(tokens).sharding, "spec", None)
    if spec is None or all(s is None for s in spec):
      return self.embed(tokens)
    table = self.embed.embedding[...]
    out = table.at[tokens].get(out_sharding=jax.P(*spec, None))
    return out.astype(self.cfg.dtype)


def num_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
