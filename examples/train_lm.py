"""Train a small character-level transformer LM whose attention is jflash's.

Runs on the CPU in a few minutes (``make demo``); on a GPU or TPU the same
command picks the fastest jflash kernel for the platform by itself.

    python -m examples.train_lm --steps 300 --out-dir demo_output
    python examples/train_lm.py --help

What it prints: the attention backend jflash selected, training loss and
tokens/s (tqdm bar), validation loss, a generated sample, and the compiled peak
memory of attention forward+backward at a long sequence for jflash against
``jax.nn.dot_product_attention(implementation='xla')``.  It writes the loss
curve (``loss.png``), the sample (``sample.txt``) and the numbers
(``metrics.json``) to ``--out-dir``; ``loss.png`` also charts the memory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python examples/train_lm.py`
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import jflash
from examples.model import Config, TransformerLM, num_params

DATA_DIR = Path(__file__).resolve().parent / "data"


# ----------------------------------------------------------------------------
# Data: every examples/data/*.txt, character level.
# ----------------------------------------------------------------------------
class CharData:
  """Characters of the shipped texts; the last 10% of each file is held out."""

  def __init__(self, data_dir: Path = DATA_DIR, val_fraction: float = 0.1):
    files = sorted(data_dir.glob("*.txt"))
    if not files:
      raise FileNotFoundError(f"no *.txt files in {data_dir}")
    texts = [f.read_text(encoding="utf-8") for f in files]
    self.files = [f.name for f in files]
    self.chars = sorted(set("".join(texts)))
    self.stoi = {c: i for i, c in enumerate(self.chars)}
    train, val = [], []
    for text in texts:
      cut = int(len(text) * (1 - val_fraction))
      train.append(text[:cut])
      val.append(text[cut:])
    self.train = self.encode("\n\n".join(train))
    self.val = self.encode("\n\n".join(val))

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    return np.array([self.stoi[c] for c in text], dtype=np.int32)

  def decode(self, ids) -> str:
    return "".join(self.chars[int(i)] for i in ids)

  def batch(self, rng: np.random.Generator, split: str, batch_size: int,
            seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Random windows: inputs ``[B, T]`` and next-character targets."""
    data = self.train if split == "train" else self.val
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)[None]
    window = data[idx]
    return window[:, :-1], window[:, 1:]


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------
def loss_fn(model: TransformerLM, x: jax.Array, y: jax.Array) -> jax.Array:
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_steps(graphdef):
  """Jitted train/eval steps on the split ``(model, optimizer)`` state."""

  @jax.jit
  def train_step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  @jax.jit
  def eval_step(state, x, y):
    model, _ = nnx.merge(graphdef, state)
    return loss_fn(model, x, y)

  return train_step, eval_step


def evaluate(eval_step, state, data: CharData, batch_size: int, seq_len: int,
             batches: int = 6) -> float:
  rng = np.random.default_rng(1234)  # the same validation windows every time
  losses = [eval_step(state, *data.batch(rng, "val", batch_size, seq_len))
            for _ in range(batches)]
  return float(np.mean(jax.device_get(losses)))


def generate(graphdef, state, data: CharData, prompt: str, length: int,
             seq_len: int, temperature: float, seed: int) -> str:
  """Samples ``length`` characters after ``prompt`` (no KV cache: the model
  reruns on the last ``seq_len`` characters each step, one compilation)."""

  @jax.jit
  def next_token(state, window, pos, key):
    model, _ = nnx.merge(graphdef, state)
    logits = model(window)[0, pos]
    return jax.random.categorical(key, logits / temperature)

  ids = list(data.encode(prompt)) or [0]
  key = jax.random.key(seed)
  for _ in range(length):
    context = ids[-seq_len:]
    window = np.zeros((1, seq_len), np.int32)
    window[0, :len(context)] = context  # causal: padding after pos is unseen
    key, sub = jax.random.split(key)
    ids.append(int(next_token(state, window, len(context) - 1, sub)))
  return data.decode(ids)


# ----------------------------------------------------------------------------
# Memory: compiled (not run) attention forward+backward at a long sequence.
# ----------------------------------------------------------------------------
def attention_peak_bytes(attention, batch: int, seq_len: int, heads: int,
                         head_dim: int, dtype=jnp.float32) -> int:
  """temp + output bytes of ``jit(value_and_grad(sum(attention(q, k, v))))``,
  from XLA's memory analysis of the compiled program."""
  shape = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), dtype)

  def loss(q, k, v):
    return attention(q, k, v).astype(jnp.float32).sum()

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  stats = jax.jit(grad).lower(shape, shape, shape).compile().memory_analysis()
  if stats is None:
    raise RuntimeError("this backend reports no memory analysis")
  return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


def memory_comparison(seq_len: int, batch: int = 1, heads: int = 8,
                      head_dim: int = 64) -> dict:
  jflash_bytes = attention_peak_bytes(
      lambda q, k, v: jflash.dot_product_attention(q, k, v, is_causal=True),
      batch, seq_len, heads, head_dim)
  xla_bytes = attention_peak_bytes(
      lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="xla"),
      batch, seq_len, heads, head_dim)
  return {"shape": f"B={batch} T=S={seq_len} N={heads} H={head_dim} float32",
          "jflash_bytes": jflash_bytes, "jax_nn_xla_bytes": xla_bytes}


# ----------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------
def plot_results(path: Path, train_losses: list[float],
                 val_points: list[tuple[int, float]], title: str,
                 memory: dict | None) -> None:
  """Loss curves, and (if measured) the attention memory comparison."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if memory:
    fig, (ax, mem_ax) = plt.subplots(
        1, 2, figsize=(11, 4.5), dpi=120, width_ratios=(2.2, 1))
  else:
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
  steps = np.arange(1, len(train_losses) + 1)
  ax.plot(steps, train_losses, color="tab:blue", alpha=0.3, lw=1,
          label="train (per step)")
  window = max(1, min(20, len(train_losses) // 10))
  if window > 1:
    smooth = np.convolve(train_losses, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1:], smooth, color="tab:blue", lw=2,
            label=f"train ({window}-step mean)")
  if val_points:
    vs, vl = zip(*val_points)
    ax.plot(vs, vl, "o-", color="tab:orange", lw=2, label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / character)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()

  if memory:
    mib = 1 << 20
    names = ["jflash", "jax.nn (xla)"]
    values = [memory["jflash_bytes"] / mib, memory["jax_nn_xla_bytes"] / mib]
    bars = mem_ax.bar(names, values, color=["tab:green", "tab:gray"])
    mem_ax.set_yscale("log")
    mem_ax.set_ylim(min(values) / 3, max(values) * 4)
    for bar, value in zip(bars, values):
      mem_ax.annotate(f"{value:,.0f} MiB", (bar.get_x() + bar.get_width() / 2,
                                            value),
                      ha="center", va="bottom", xytext=(0, 3),
                      textcoords="offset points")
    mem_ax.set_ylabel("peak memory, MiB (log scale)")
    mem_ax.set_title(f"attention fwd+bwd memory\n{memory['shape']}",
                     fontsize=10)
    mem_ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


# ----------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description="Train a small character-level transformer LM whose "
      "attention is jflash.dot_product_attention.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--steps", type=int, default=400, help="training steps")
  p.add_argument("--seq-len", type=int, default=128, help="context length")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--out-dir", type=Path, default=Path("demo_output"),
                 help="where loss.png, sample.txt and metrics.json go")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--learned-positions", action="store_true",
                 help="learned absolute position embeddings instead of RoPE")
  p.add_argument("--alibi", action="store_true",
                 help="ALiBi (a per-head distance penalty inside the "
                 "attention kernels) instead of any position embedding")
  p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"),
                 default="auto", help="compute dtype; auto: bfloat16 on GPU "
                 "and TPU (where the attention kernels run), float32 on CPU")
  p.add_argument("--prompt", default="The river ")
  p.add_argument("--sample-chars", type=int, default=400)
  p.add_argument("--temperature", type=float, default=0.8)
  p.add_argument("--memory-seq-len", type=int, default=8192,
                 help="sequence length of the attention memory comparison "
                 "(0 skips it)")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.steps < 1:
    raise SystemExit("--steps must be >= 1")
  args.out_dir.mkdir(parents=True, exist_ok=True)
  t_start = time.perf_counter()

  data = CharData()
  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(
      args.dtype, jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu")
      else jnp.float32)
  cfg = Config(vocab_size=data.vocab_size, seq_len=args.seq_len,
               num_layers=args.layers, d_model=args.d_model,
               num_heads=args.heads, rope=not args.learned_positions,
               alibi=args.alibi, dtype=dtype)
  model = TransformerLM(cfg, rngs=nnx.Rngs(args.seed))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup_steps=max(1, min(50, args.steps // 10)),
      decay_steps=args.steps, end_value=args.lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b2=0.99, weight_decay=0.1))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  # The backend jflash picks for this model's attention call, by platform.
  qkv = jax.ShapeDtypeStruct(
      (args.batch_size, args.seq_len, cfg.num_heads, cfg.head_dim), cfg.dtype)
  backend = jflash.selected_implementation(qkv, qkv, qkv, is_causal=True)
  print(f"JAX {jax.__version__} on {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}, {jax.device_count()} device(s))")
  print(f"jflash attention backend: {backend!r}  (jflash picks it per "
        f"platform; candidates here: {list(jflash.default_order())})")
  print(f"data: {len(data.train):,} train / {len(data.val):,} validation "
        f"characters from {len(data.files)} files, vocabulary "
        f"{data.vocab_size}")
  print(f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.num_heads} heads x {cfg.head_dim}, context {cfg.seq_len}, "
        f"{num_params(model):,} parameters, compute dtype "
        f"{jnp.dtype(cfg.dtype).name}")

  graphdef, state = nnx.split((model, optimizer))
  train_step, eval_step = make_steps(graphdef)
  rng = np.random.default_rng(args.seed)
  tokens_per_step = args.batch_size * args.seq_len

  train_losses: list[float] = []
  val_points: list[tuple[int, float]] = []
  val_points.append((0, evaluate(eval_step, state, data, args.batch_size,
                                 args.seq_len)))
  pending = []  # device losses not yet fetched (keeps the pipeline full)
  timed_from = None  # start of timing: after step 1 (compilation)
  eval_seconds = 0.0  # validation time, excluded from tokens/s
  bar = tqdm(range(1, args.steps + 1), desc="training", unit="step",
             dynamic_ncols=True, mininterval=0.5)
  for step in bar:
    x, y = data.batch(rng, "train", args.batch_size, args.seq_len)
    state, loss = train_step(state, x, y)
    pending.append(loss)
    if step == 1:
      jax.block_until_ready(loss)
      timed_from = time.perf_counter()
    if step % 10 == 0 or step == args.steps:
      train_losses.extend(float(v) for v in jax.device_get(pending))
      pending = []
      elapsed = time.perf_counter() - timed_from - eval_seconds
      tps = (step - 1) * tokens_per_step / elapsed if step > 1 else 0.0
      bar.set_postfix(loss=f"{train_losses[-1]:.3f}", tok_s=f"{tps:,.0f}")
    if step % args.eval_every == 0 or step == args.steps:
      t_eval = time.perf_counter()
      val = evaluate(eval_step, state, data, args.batch_size, args.seq_len)
      eval_seconds += time.perf_counter() - t_eval
      val_points.append((step, val))
      bar.write(f"step {step:5d}  train loss {np.mean(train_losses[-10:]):.3f}"
                f"  val loss {val:.3f}")
  bar.close()
  train_time = time.perf_counter() - timed_from - eval_seconds
  timed_steps = args.steps - 1
  tokens_per_s = (timed_steps * tokens_per_step / train_time
                  if timed_steps else float("nan"))
  print(f"trained {args.steps} steps: final train loss "
        f"{np.mean(train_losses[-10:]):.3f}, val loss {val_points[-1][1]:.3f} "
        f"(uniform guess: {math.log(data.vocab_size):.3f}); "
        f"{tokens_per_s:,.0f} tokens/s after compilation")

  sample = generate(graphdef, state, data, args.prompt, args.sample_chars,
                    args.seq_len, args.temperature, args.seed)
  print("\n--- sample " + "-" * 60)
  print(sample)
  print("-" * 71 + "\n")
  (args.out_dir / "sample.txt").write_text(sample + "\n", encoding="utf-8")

  memory = None
  if args.memory_seq_len > 0:
    print(f"attention peak memory, forward+backward, B=1 T=S="
          f"{args.memory_seq_len} N=8 H=64 float32 (compiled, not run):")
    memory = memory_comparison(args.memory_seq_len)
    mib = 1 << 20
    print(f"  jflash.dot_product_attention (backend {backend!r}): "
          f"{memory['jflash_bytes'] / mib:10,.1f} MiB")
    print(f"  jax.nn.dot_product_attention(implementation='xla'): "
          f"{memory['jax_nn_xla_bytes'] / mib:10,.1f} MiB")
    ratio = memory["jax_nn_xla_bytes"] / memory["jflash_bytes"]
    print(f"  -> jflash needs {ratio:.1f}x less memory" if ratio >= 1 else
          f"  -> jflash needs {1 / ratio:.2f}x more memory at this size")

  png = args.out_dir / "loss.png"
  plot_results(png, train_losses, val_points,
               f"char-level LM, jflash backend '{backend}' on "
               f"{jax.default_backend()}: {tokens_per_s:,.0f} tokens/s",
               memory)
  metrics = {
      "backend": backend, "platform": jax.default_backend(),
      "jax_version": jax.__version__, "steps": args.steps,
      "batch_size": args.batch_size, "seq_len": args.seq_len,
      "num_params": num_params(model), "tokens_per_s": tokens_per_s,
      "final_train_loss": float(np.mean(train_losses[-10:])),
      "val_losses": val_points, "train_losses": train_losses,
      "attention_memory": memory,
      "total_seconds": time.perf_counter() - t_start,
  }
  (args.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
  print(f"wrote {png}, {args.out_dir / 'sample.txt'} and "
        f"{args.out_dir / 'metrics.json'}  "
        f"(total {metrics['total_seconds']:.0f} s)")
  return metrics


if __name__ == "__main__":
  main()
