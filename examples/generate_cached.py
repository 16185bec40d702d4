"""Greedy generation with a paged key/value cache and
``jflash.decode_attention``.

The language model of ``model.py`` (random weights: this shows the
mechanics, not the text) generates for a batch of prompts:

1. prefill: the prompts go through the cache in chunks of up to 16 tokens
   (each chunk one ``append_to_pages`` + ``decode_attention`` per layer);
2. decode: one token per step, the cache read through a block table whose
   pages lie in a random order in one shared pool.

It checks the cached logits against one uncached forward pass over the
whole generated sequence, then prints tokens/s for the cached loop and for
generation without a cache (the model rerun over a fixed window per
token, as ``train_lm.py`` samples).

    python -m examples.generate_cached --batch 4 --prompt-len 40 --new-tokens 64
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jflash
from examples.model import Config, TransformerLM


def cached_forward(model: TransformerLM, tokens, lengths, caches, table):
  """``tokens [B, T]`` appended to sequences that then hold ``lengths [B]``
  tokens: their logits ``[B, T, vocab]`` and the updated per-layer
  ``(key_pages, value_pages)``."""
  b, t = tokens.shape
  positions = lengths[:, None] - t + jnp.arange(t)[None]
  x = model.lookup(tokens)
  if model.pos is not None:
    x = x + model.pos(positions)
  updated = []
  for block, (k_pages, v_pages) in zip(model.blocks, caches):
    q, k, v = block.attn.qkv_heads(block.ln1(x), positions)
    k_pages, v_pages = jflash.append_to_pages(k_pages, v_pages, table,
                                              lengths, k, v)
    y = jflash.decode_attention(q, k_pages, v_pages, lengths,
                                block_table=table,
                                alibi_slopes=block.attn.alibi_slopes())
    x = x + block.attn.proj(y.reshape(b, t, -1))
    x = x + block.mlp(block.ln2(x))
    updated.append((k_pages, v_pages))
  return model.embed.attend(model.ln_f(x)).astype(jnp.float32), updated


def empty_pages(cfg: Config, batch: int, total: int, page_size: int,
                rng: np.random.Generator):
  """Per-layer zero pages and a block table over a shuffled pool."""
  max_pages = -(-total // page_size)
  pool = batch * max_pages
  table = rng.permutation(pool).reshape(batch, max_pages).astype(np.int32)
  shape = (pool, page_size, cfg.num_heads, cfg.head_dim)
  caches = [(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
            for _ in range(cfg.num_layers)]
  return caches, jnp.asarray(table)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def cached_step(graphdef, state, tokens, lengths, caches, table):
  """One jitted :func:`cached_forward` (the pages donated: updated in
  place)."""
  model = nnx.merge(graphdef, state)
  return cached_forward(model, tokens, lengths, caches, table)


@functools.partial(jax.jit, static_argnums=0)
def uncached_next_token(graphdef, state, tokens, pos):
  model = nnx.merge(graphdef, state)
  return jnp.argmax(model(tokens)[:, pos], axis=-1).astype(jnp.int32)


def generate_cached(graphdef, state, prompts: np.ndarray, new_tokens: int,
                    caches, table, chunk: int = jflash.decode.MAX_NEW_TOKENS):
  """Greedy tokens ``[B, new_tokens]`` and every step's logits."""
  step = functools.partial(cached_step, graphdef)
  batch, prompt_len = prompts.shape
  lengths = jnp.zeros((batch,), jnp.int32)
  for start in range(0, prompt_len, chunk):
    piece = jnp.asarray(prompts[:, start:start + chunk])
    lengths = lengths + piece.shape[1]
    logits, caches = step(state, piece, lengths, caches, table)
  out, all_logits = [], []
  for _ in range(new_tokens):
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    out.append(token)
    all_logits.append(logits[:, -1])
    lengths = lengths + 1
    logits, caches = step(state, token[:, None], lengths, caches, table)
  return jnp.stack(out, 1), jnp.stack(all_logits, 1)


def generate_uncached(graphdef, state, prompts: np.ndarray, new_tokens: int,
                      window: int) -> jax.Array:
  """The same greedy loop without a cache: the model reruns over a fixed
  window (one compilation; causal, so the padding after a position is
  unseen)."""

  next_token = functools.partial(uncached_next_token, graphdef)
  batch, prompt_len = prompts.shape
  tokens = jnp.zeros((batch, window), jnp.int32).at[:, :prompt_len].set(
      prompts)
  for i in range(new_tokens):
    token = next_token(state, tokens, prompt_len + i - 1)
    tokens = tokens.at[:, prompt_len + i].set(token)
  return tokens[:, prompt_len:prompt_len + new_tokens]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=40)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  total = args.prompt_len + args.new_tokens
  cfg = Config(vocab_size=64, seq_len=total, num_layers=args.layers)
  graphdef, state = nnx.split(TransformerLM(cfg, rngs=nnx.Rngs(args.seed)))
  rng = np.random.default_rng(args.seed)
  prompts = rng.integers(0, cfg.vocab_size,
                         (args.batch, args.prompt_len)).astype(np.int32)

  def cached():
    caches, table = empty_pages(cfg, args.batch, total, args.page_size, rng)
    return generate_cached(graphdef, state, prompts, args.new_tokens, caches,
                           table)

  def uncached():
    return generate_uncached(graphdef, state, prompts, args.new_tokens, total)

  results = {}
  for name, fn in (("paged cache", cached), ("no cache", uncached)):
    jax.block_until_ready(fn())  # compile
    start = time.perf_counter()
    results[name] = jax.block_until_ready(fn())
    seconds = time.perf_counter() - start
    rate = args.batch * args.new_tokens / seconds
    print(f"{name:>12}: {rate:10.1f} tokens/s ({args.batch} sequences x "
          f"{args.new_tokens} new tokens in {seconds:.3f} s)")
  tokens, logits = results["paged cache"]
  # The cached logits of every generated step against one uncached pass.
  model = nnx.merge(graphdef, state)
  sequence = jnp.concatenate([jnp.asarray(prompts), tokens], axis=1)
  full = model(sequence)[:, args.prompt_len - 1:total - 1]
  print(f"max |cached - uncached| logit: "
        f"{float(jnp.abs(full - logits).max()):.2e}; greedy tokens equal "
        f"without a cache: {bool((results['no cache'] == tokens).all())}")


if __name__ == "__main__":
  main()
