"""jflash.decode_attention and the cache writes against the exact reference
on the equivalent full mask, written independently here."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import masks, reference
from jflash.core.platform import host_target, is_hopper
from jflash.backends.mosaic_tpu.decode import MosaicTpuDecodeBackend
from jflash.backends.xla import DecodeConfig, XlaDecodeBackend
from tests._support import (HOPPER, extremes, fresh_rng, integer_array,
                            integer_sources, lowering_for_hopper, lse_err,
                            plain_attention, random_normal, rel_err,
                            saturated_int32)

F32_TOL = 1e-5
LOW_PRECISION_FLOOR = 2e-3


def brute_visibility(lengths, num_new, capacity, window):
  """``[B, 1, T, S]``: new token t of row b stands at lengths[b] - T + t and
  sees written slots up to its own position, within the window."""
  vis = np.zeros((len(lengths), 1, num_new, capacity), bool)
  for b, length in enumerate(lengths):
    for t in range(num_new):
      p = int(length) - num_new + t
      lo = 0 if window is None else p - window[0]
      vis[b, 0, t, max(lo, 0):max(min(p + 1, length), 0)] = True
  return vis


@dataclasses.dataclass
class Problem:
  """A decode call with its contiguous cache and, when paged, the same
  cache as shuffled pages."""

  query: jax.Array
  key: jax.Array            # [B, S, K, H]
  value: jax.Array
  lengths: np.ndarray
  window: tuple[int, int] | None
  cap: float | None
  table: np.ndarray | None = None
  key_pages: jax.Array | None = None
  value_pages: jax.Array | None = None

  @property
  def visibility(self) -> np.ndarray:
    return brute_visibility(self.lengths, self.query.shape[1],
                            self.key.shape[1], self.window)

  def reference(self):
    mask = masks.AttentionMask(
        batch=self.query.shape[0], q_len=self.query.shape[1],
        kv_len=self.key.shape[1], dense=jnp.asarray(self.visibility))
    return reference.reference_attention(
        self.query, self.key, self.value, None, mask,
        scale=1 / np.sqrt(self.query.shape[-1]),
        logits_soft_cap=self.cap, compute_dtype=jnp.float32)

  def plain(self):
    """Same-dtype materialized attention: the error baseline."""
    return plain_attention(self.query, self.key, self.value, None,
                           jnp.asarray(self.visibility),
                           1 / np.sqrt(self.query.shape[-1]), self.cap)

  def decode(self, paged: bool, backend=None, jit=True, interpret=False):
    fn = functools.partial(
        jflash.decode_attention, local_window_size=self.window,
        logits_soft_cap=self.cap, implementation=backend,
        return_residual=True, interpret=interpret)
    if paged:
      run = lambda q, k, v, n, t: fn(q, k, v, n, block_table=t)
      args = (self.query, self.key_pages, self.value_pages, self.lengths,
              self.table)
    else:
      run = lambda q, k, v, n: fn(q, k, v, n)
      args = (self.query, self.key, self.value, self.lengths)
    return (jax.jit(run) if jit else run)(*args)


def paginate(rng, key: jax.Array, value: jax.Array, lengths, page_size: int,
             extra_pages: int = 3):
  """The caches ``[B, S, K, H]`` as pages in a random order, with spare
  pages of noise; table entries of pages past a sequence's length point
  anywhere (out of range included)."""
  batch, capacity = key.shape[:2]
  max_pages = capacity // page_size
  num_pages = batch * max_pages + extra_pages
  table = rng.permutation(num_pages)[:batch * max_pages].reshape(
      batch, max_pages).astype(np.int32)
  result = [table]
  for cache in (key, value):
    pages = random_normal(rng, (num_pages, page_size) + cache.shape[2:],
                          cache.dtype)
    blocks = cache.reshape(batch * max_pages, page_size, *cache.shape[2:])
    result.append(pages.at[table.reshape(-1)].set(blocks))
  for b in range(batch):
    first_unused = -(-int(lengths[b]) // page_size)
    table[b, first_unused:] = rng.integers(-5, num_pages + 5,
                                           max_pages - first_unused)
  return tuple(result)


def make_problem(rng, *, batch=4, num_new=1, heads=(4, 2), head_dim=16,
                 capacity=48, window=None, cap=None, page_size=None,
                 dtype=jnp.float32) -> Problem:
  num_heads, kv_heads = heads
  lengths = rng.integers(0, capacity + 1, batch)
  # The edges: an empty cache, a full one, one token short of T.
  lengths[:3] = (0, capacity, max(num_new - 1, 0))
  q = random_normal(rng, (batch, num_new, num_heads, head_dim), dtype)
  k = random_normal(rng, (batch, capacity, kv_heads, head_dim), dtype)
  v = random_normal(rng, (batch, capacity, kv_heads, head_dim), dtype)
  problem = Problem(q, k, v, lengths.astype(np.int32), window, cap)
  if page_size is not None:
    problem.table, problem.key_pages, problem.value_pages = paginate(
        rng, k, v, lengths, page_size)
  return problem


def backend(chunk_size: int, num_splits: int | None, kind: str = "xla"):
  config = DecodeConfig(chunk_size=chunk_size, num_splits=num_splits)
  if kind == "mosaic_tpu":
    return MosaicTpuDecodeBackend(config)
  return XlaDecodeBackend(config)


def check_against_reference(problem: Problem, out, lse, info: str):
  ref_out, ref_lse = problem.reference()
  out32 = np.asarray(jnp.asarray(out, jnp.float32))
  assert out.dtype == problem.query.dtype and lse.dtype == jnp.float32, info
  assert not np.isnan(out32).any(), info
  dead = np.isneginf(np.asarray(ref_lse))
  assert np.all(out32[dead] == 0), info
  if problem.query.dtype == jnp.float32:
    bound = F32_TOL
  else:
    bound = 2 * rel_err(problem.plain(), ref_out) + LOW_PRECISION_FLOOR
  assert rel_err(out, ref_out) <= bound, info
  lse_tol = 1e-5 if problem.query.dtype == jnp.float32 else 2e-2
  assert lse_err(lse, ref_lse) <= lse_tol * max(
      1.0, float(np.max(np.abs(np.where(dead, 0, ref_lse))))), info


# (T, paged, heads (N, K), window, soft cap, chunk, splits)
CASES = [
    (1, False, (4, 2), None, None, 8, None),
    (1, True, (8, 2), (5, 0), None, 8, 2),
    (2, True, (4, 1), (9, 3), 5.0, 16, None),
    (2, False, (2, 2), None, 3.0, 8, 1),
    (7, False, (4, 2), (6, 6), None, 8, 3),
    (7, True, (3, 3), (2, 0), 4.0, 8, None),
    (16, True, (4, 2), None, 2.0, 8, None),
    (16, False, (4, 1), (20, 1), 5.0, 16, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: (
    f"T{c[0]}-{'paged' if c[1] else 'contig'}-N{c[2][0]}K{c[2][1]}"
    f"-w{c[3]}-cap{c[4]}-c{c[5]}s{c[6]}"))
def test_matches_reference(case):
  num_new, paged, heads, window, cap, chunk, splits = case
  rng = fresh_rng()
  problem = make_problem(rng, num_new=num_new, heads=heads, window=window,
                         cap=cap, page_size=4 if paged else None)
  out, lse = problem.decode(paged, backend(chunk, splits))
  check_against_reference(problem, out, lse,
                          f"{case} lengths={problem.lengths}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("paged", [False, True])
def test_low_precision_within_same_dtype_baseline(dtype, paged):
  rng = fresh_rng()
  problem = make_problem(rng, num_new=2, heads=(4, 2), window=(12, 0),
                         cap=None, page_size=8 if paged else None,
                         dtype=dtype)
  out, lse = problem.decode(paged, backend(16, None))
  check_against_reference(problem, out, lse, f"{dtype} paged={paged}")
  # Float32 products: the reference rounded once to the dtype.
  config = DecodeConfig(chunk_size=16, matmul_inputs="float32")
  out, _ = problem.decode(paged, XlaDecodeBackend(config))
  same = np.asarray(out == problem.reference()[0].astype(dtype))
  assert same.mean() > 0.98, same.mean()


def test_default_backend_and_split_counts_agree_with_reference():
  """Every split count (one run up to one chunk per split) and the default
  configuration give the reference result; auto splits fill the workers."""
  rng = fresh_rng()
  problem = make_problem(rng, num_new=3, heads=(4, 2), capacity=40,
                         page_size=4)
  for splits in (1, 4, 10):
    out, lse = problem.decode(True, backend(4, splits))
    check_against_reference(problem, out, lse, f"splits={splits}")
  out, lse = problem.decode(True)
  check_against_reference(problem, out, lse, "default")


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("paged,window", [(False, None), (False, (9, 0)),
                                          (True, None)])
def test_xla_decode_default_chunking_on_every_platform(platform, paged,
                                                       window):
  """The xla decode backend chooses its chunks for the platform the call
  is traced for (few large steps on GPUs and TPUs, cache-sized chunks on
  a CPU, both within max_logits_elements), slicing a contiguous cache
  that the chunks cut exactly; traced for each platform here (the xla
  program runs anywhere), every plan matches the reference."""
  from jflash.core.splits import make_plan  # pylint: disable=import-outside-toplevel
  rng = fresh_rng()
  problem = make_problem(rng, batch=4, num_new=2, heads=(4, 2),
                         capacity=256, window=window,
                         page_size=8 if paged else None)
  for config in (DecodeConfig(), DecodeConfig(max_logits_elements=4096)):
    with jflash.lowering_for(platform):
      out, lse = problem.decode(paged, XlaDecodeBackend(config))
    check_against_reference(problem, out, lse, f"{platform} {config}")
  call = dataclasses.replace(
      jflash.decode._canonical_call(problem.query, problem.key, problem.value,
                                    problem.lengths, None, None, window,
                                    None), platform=platform)
  small = make_plan(call, DecodeConfig(max_logits_elements=4096))
  # B * splits * (N * T + 2 * K * H) elements a slot: 4 * 2 * (8 + 64).
  assert small.chunk * 4 * small.num_splits * 72 <= max(4096, 8 * 576)
  whole = make_plan(call, DecodeConfig())
  assert whole.per_split == 1 or window is not None


def test_reruns_are_bitwise_identical():
  """No atomics and a fixed merge order: a compiled call gives the same bits
  on every run (split results are merged in split order)."""
  rng = fresh_rng()
  problem = make_problem(rng, num_new=7, heads=(4, 2), page_size=4,
                         window=(10, 0), cap=4.0)
  runs = [problem.decode(True, backend(8, 3)) for _ in range(3)]
  jax.clear_caches()  # and once more from a fresh compilation
  runs.append(problem.decode(True, backend(8, 3)))
  for out, lse in runs[1:]:
    np.testing.assert_array_equal(np.asarray(out), np.asarray(runs[0][0]))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(runs[0][1]))


# (T, paged, heads, window, soft cap, dtype): the Pallas TPU kernel in
# interpret mode; one grid step per page (page size 4) or per 8 slots.
TPU_CASES = [
    (1, True, (8, 2), (5, 0), None, jnp.float32),
    (2, False, (4, 1), None, 3.0, jnp.float32),
    (7, True, (4, 2), (9, 2), 4.0, jnp.bfloat16),
    (16, True, (3, 3), None, None, jnp.float16),
    (16, False, (4, 2), (20, 0), 5.0, jnp.float32),
]


@pytest.mark.parametrize("case", TPU_CASES, ids=lambda c: (
    f"T{c[0]}-{'paged' if c[1] else 'contig'}-N{c[2][0]}K{c[2][1]}"
    f"-w{c[3]}-cap{c[4]}-{jnp.dtype(c[5]).name}"))
def test_mosaic_tpu_kernel_in_interpret_mode(case):
  num_new, paged, heads, window, cap, dtype = case
  rng = fresh_rng()
  problem = make_problem(rng, num_new=num_new, heads=heads, window=window,
                         cap=cap, page_size=4 if paged else None,
                         dtype=dtype)
  out, lse = problem.decode(paged, backend(8, 2, "mosaic_tpu"),
                            interpret=True)
  check_against_reference(problem, out, lse,
                          f"{case} lengths={problem.lengths}")
  if dtype != jnp.float32:
    # matmul_inputs="float32" keeps the probabilities in float32: the
    # output is then the reference rounded once to the dtype (the default
    # low-precision products miss that rounding in about a fifth of the
    # entries).
    config = DecodeConfig(chunk_size=8, num_splits=2,
                          matmul_inputs="float32")
    out, _ = problem.decode(paged, MosaicTpuDecodeBackend(config),
                            interpret=True)
    ref_out, _ = problem.reference()
    same = np.asarray(out == ref_out.astype(dtype))
    assert same.mean() > 0.98, (case, same.mean())


def test_mosaic_tpu_declines_off_tpu_without_interpret():
  rng = fresh_rng()
  problem = make_problem(rng, num_new=1)
  args = (problem.query, problem.key, problem.value, problem.lengths)
  if jax.default_backend() != "tpu":
    with pytest.raises(NotImplementedError, match="interpret"):
      jflash.decode_attention(*args, implementation="mosaic_tpu")
  got = jflash.decode_attention(*args, implementation=["mosaic_tpu", "xla"])
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(jflash.decode_attention(*args)))


def poisoned(problem: Problem, paged: bool) -> Problem:
  """The problem with NaN in every cache slot no new token sees; paged,
  also NaN in every page no sequence reads and -1 in the table entries of
  pages outside every key range (never dereferenced)."""
  seen = problem.visibility[:, 0].any(1)  # [B, S]
  poison = lambda x: jnp.where(jnp.asarray(seen)[..., None, None], x,
                               jnp.nan)
  dirty = dataclasses.replace(problem, key=poison(problem.key),
                              value=poison(problem.value))
  if not paged:
    return dirty
  page_size = problem.key_pages.shape[1]
  pages_seen = seen.reshape(seen.shape[0], -1, page_size).any(-1)
  table = problem.table.copy()
  table[~pages_seen] = -1
  k_pages = jnp.full_like(problem.key_pages, jnp.nan)
  v_pages = k_pages
  for b, j in zip(*np.nonzero(pages_seen)):
    block = slice(j * page_size, (j + 1) * page_size)
    k_pages = k_pages.at[table[b, j]].set(dirty.key[b, block])
    v_pages = v_pages.at[table[b, j]].set(dirty.value[b, block])
  return dataclasses.replace(dirty, table=table, key_pages=k_pages,
                             value_pages=v_pages)


@pytest.mark.parametrize("paged,kind", [(False, "xla"), (True, "xla"),
                                        (True, "mosaic_tpu")])
def test_slots_and_pages_no_query_sees_are_never_used(paged, kind):
  """NaN in every slot no new token sees (past the length, before the
  window) and junk table entries leave the result bitwise unchanged."""
  rng = fresh_rng()
  window = (5, 0)
  problem = make_problem(rng, num_new=2, heads=(4, 2), window=window,
                         page_size=4 if paged else None)
  run = functools.partial(Problem.decode, paged=paged,
                          backend=backend(8, 2, kind),
                          interpret=kind == "mosaic_tpu")
  clean = run(problem)
  got = run(poisoned(problem, paged))
  for g, c in zip(got, clean):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


def test_append_then_decode_round_trip():
  """Ragged sequences grown step by step (T = 7, 1, 2) through pages in a
  random order and through a contiguous cache: same cache contents, same
  decode result, equal to the reference on the whole history."""
  rng = fresh_rng()
  batch, heads, head_dim, page_size, max_pages = 3, (4, 2), 8, 4, 6
  capacity = page_size * max_pages
  num_pages = batch * max_pages + 2
  table = rng.permutation(num_pages)[:batch * max_pages].reshape(
      batch, max_pages).astype(np.int32)
  shape = (num_pages, page_size, heads[1], head_dim)
  k_pages, v_pages = jnp.zeros(shape), jnp.zeros(shape)
  k_cache = jnp.zeros((batch, capacity, heads[1], head_dim))
  v_cache = jnp.zeros_like(k_cache)
  history_k = np.zeros((batch, capacity, heads[1], head_dim), np.float32)
  history_v = np.zeros_like(history_k)
  lengths = np.array([0, 3, 10], np.int32)
  append_pages = jax.jit(jflash.append_to_pages, donate_argnums=(0, 1))
  append_cache = jax.jit(jflash.append_to_cache)
  for num_new in (7, 1, 2):
    lengths = lengths + num_new
    new_k = random_normal(rng, (batch, num_new) + shape[2:], jnp.float32)
    new_v = random_normal(rng, (batch, num_new) + shape[2:], jnp.float32)
    k_pages, v_pages = append_pages(k_pages, v_pages, table, lengths, new_k,
                                    new_v)
    k_cache, v_cache = append_cache(k_cache, v_cache, lengths, new_k, new_v)
    for b in range(batch):
      history_k[b, lengths[b] - num_new:lengths[b]] = new_k[b]
      history_v[b, lengths[b] - num_new:lengths[b]] = new_v[b]
    np.testing.assert_array_equal(np.asarray(k_cache), history_k)
    np.testing.assert_array_equal(np.asarray(v_cache), history_v)
    gathered = np.asarray(k_pages)[table].reshape(history_k.shape)
    np.testing.assert_array_equal(gathered, history_k)
    q = random_normal(rng, (batch, num_new, heads[0], head_dim), jnp.float32)
    problem = Problem(q, jnp.asarray(history_k), jnp.asarray(history_v),
                      lengths, None, None, table, k_pages, v_pages)
    paged_out = problem.decode(True, backend(8, None))
    contiguous_out = problem.decode(False, backend(8, None))
    check_against_reference(problem, *paged_out, f"T={num_new}")
    np.testing.assert_allclose(np.asarray(paged_out[0]),
                               np.asarray(contiguous_out[0]), atol=1e-6)


def test_append_drops_tokens_outside_the_cache():
  """Lengths below T drop the tokens at negative positions; nothing else
  moves."""
  rng = fresh_rng()
  cache = random_normal(rng, (2, 8, 1, 4), jnp.float32)
  new = random_normal(rng, (2, 3, 1, 4), jnp.float32)
  k, _ = jflash.append_to_cache(cache, cache, np.array([1, 8]), new, new)
  want = np.asarray(cache).copy()
  want[0, 0] = new[0, 2]
  want[1, 5:8] = new[1]
  np.testing.assert_array_equal(np.asarray(k), want)
  table = np.array([[2, -1], [0, 1]], np.int32)  # row 0's second page unset
  pages = random_normal(rng, (3, 4, 1, 4), jnp.float32)
  k, _ = jflash.append_to_pages(pages, pages, table, np.array([6, 2]), new,
                                new)
  want = np.asarray(pages).copy()
  want[2, 3] = new[0, 0]  # positions 3 (page 2), 4 and 5 (unset page)
  want[0, 0:2] = new[1, 1:]
  np.testing.assert_array_equal(np.asarray(k), want)


def test_has_no_derivative():
  rng = fresh_rng()
  problem = make_problem(rng, num_new=1)
  loss = lambda q: jflash.decode_attention(q, problem.key, problem.value,
                                           problem.lengths).sum()
  with pytest.raises(NotImplementedError, match="inference"):
    jax.grad(loss)(problem.query)
  with pytest.raises(NotImplementedError, match="inference"):
    jax.jvp(loss, (problem.query,), (jnp.ones_like(problem.query),))
  # Without a derivative asked for, a traced call inside jax.grad of
  # something else is fine.
  constant = jax.grad(lambda x: x * jax.lax.stop_gradient(
      loss(problem.query)))(1.0)
  np.testing.assert_allclose(constant, loss(problem.query), rtol=1e-6)


def test_implementation_choice():
  rng = fresh_rng()
  problem = make_problem(rng, num_new=2)
  args = (problem.query, problem.key, problem.value, problem.lengths)
  want = jflash.decode_attention(*args)
  with pytest.raises(NotImplementedError, match="mosaic_gpu"):
    jflash.decode_attention(*args, implementation="mosaic_gpu")
  got = jflash.decode_attention(*args, implementation=["cudnn", "xla"])
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="implementation"):
    jflash.decode_attention(*args, implementation="nope")
  empty = jflash.decode_attention(problem.query[:0], problem.key[:0],
                                  problem.value[:0], problem.lengths[:0])
  assert empty.shape == (0,) + problem.query.shape[1:]


def _errors():
  q = jnp.zeros((2, 1, 4, 8))
  kv = jnp.zeros((2, 16, 2, 8))
  pages = jnp.zeros((5, 4, 2, 8))
  lengths = np.array([3, 4], np.int32)
  table = np.zeros((2, 4), np.int32)
  call = jflash.decode_attention
  return [
      (lambda: call(q[0], kv, kv, lengths), "query"),
      (lambda: call(jnp.zeros((2, 17, 4, 8)), kv, kv, lengths), "T=17"),
      (lambda: call(q.astype(jnp.int32), kv, kv, lengths), "query"),
      (lambda: call(q, kv.astype(jnp.bfloat16), kv, lengths), "key_cache"),
      (lambda: call(q, kv, kv[:, :8], lengths), "value_cache"),
      (lambda: call(q, kv[:1], kv[:1], lengths), "batch"),
      (lambda: call(q, kv[..., :4], kv[..., :4], lengths), "head dim"),
      (lambda: call(jnp.zeros((2, 1, 3, 8)), kv, kv, lengths), "multiple"),
      (lambda: call(q, kv, kv, lengths[:1]), "lengths"),
      (lambda: call(q, kv, kv, lengths.astype(np.float32)), "lengths"),
      (lambda: call(q, pages, pages, lengths, block_table=table[0]),
       "block_table"),
      (lambda: call(q, pages, pages, lengths,
                    block_table=table.astype(np.float32)), "block_table"),
      (lambda: call(q, pages[:, :0], pages[:, :0], lengths,
                    block_table=table), "page"),
      (lambda: call(q, kv, kv, lengths, scale=float("inf")), "scale"),
      (lambda: call(q, kv, kv, lengths, logits_soft_cap=-1.0),
       "logits_soft_cap"),
      (lambda: call(q, kv, kv, lengths, local_window_size=-1),
       "local_window_size"),
      (lambda: call(q, kv, kv, lengths, local_window_size=(1, 2, 3)),
       "local_window_size"),
      (lambda: call(q, kv, kv, lengths, return_residual="yes"),
       "return_residual"),
      (lambda: jflash.append_to_pages(pages, pages, table, lengths,
                                      jnp.zeros((2, 1, 3, 8)),
                                      jnp.zeros((2, 1, 3, 8))), "new_key"),
      (lambda: jflash.append_to_pages(pages, pages, table, lengths[:1],
                                      kv[:, :1], kv[:, :1]), "lengths"),
      (lambda: jflash.append_to_cache(kv, kv, lengths,
                                      kv[:, :1].astype(jnp.float16),
                                      kv[:, :1].astype(jnp.float16)),
       "dtype"),
      (lambda: jflash.append_to_cache(kv, pages, lengths, kv[:, :1],
                                      kv[:, :1]), "same shape"),
  ]


@pytest.mark.parametrize("index", range(len(_errors())))
def test_invalid_arguments_are_rejected(index):
  fn, match = _errors()[index]
  with pytest.raises(ValueError, match=match):
    fn()


@pytest.mark.parametrize("window", [None, 3])
def test_flax_decode_steps_run_decode_attention(window, monkeypatch):
  """The NNX module's decode=True steps go through decode_attention (GQA,
  with and without a window) and match its causal forward token by token."""
  from flax import nnx

  from jflash.flax import common
  from jflash.flax import nnx as jnnx
  calls = []

  def counting(*args, **kwargs):
    calls.append(args[0].shape)
    return jflash.decode_attention(*args, **kwargs)

  monkeypatch.setattr(common, "decode_attention", counting)
  rng = fresh_rng()
  x = random_normal(rng, (2, 6, 16), jnp.float32)
  module = jnnx.MultiHeadAttention(4, 16, num_kv_heads=2, decode=False,
                                   local_window_size=window,
                                   rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  want = module(x, is_causal=True)
  module.init_cache(x.shape)
  for t in range(x.shape[1]):
    got = module(x[:, t:t + 1], decode=True)
    assert rel_err(got[:, 0], want[:, t]) < 1e-5, t
  assert calls == [(2, 1, 4, 4)] * x.shape[1]


def test_lengths_of_any_integer_type_and_past_the_capacity():
  """Python lists and int64 lengths beyond int32 read as the same values,
  clipped to the capacity (a full cache)."""
  rng = fresh_rng()
  problem = make_problem(rng, num_new=2, capacity=16)
  args = (problem.query, problem.key, problem.value)
  lengths = [0, 16, 1, 9]
  want = jflash.decode_attention(*args, np.array(lengths, np.int32))
  got = jflash.decode_attention(*args, lengths)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  huge = np.array([0, 2**40, 1, 9], np.int64)
  got = jflash.decode_attention(*args, huge)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _junk_past_lengths(table: np.ndarray, lengths, page_size: int,
                       junk: list[int]) -> list[list[int]]:
  """``table`` as Python ints with the entries of pages past each
  sequence's (clipped) length replaced by ``junk``, in turn."""
  rows = table.astype(object).tolist()
  capacity = table.shape[1] * page_size
  count = 0
  for row, length in zip(rows, lengths):
    used = -(-min(max(length, 0), capacity) // page_size)
    for j in range(used, len(row)):
      row[j] = junk[count % len(junk)]
      count += 1
  return rows


def _scalar(value: int, dtype: np.dtype, source: str):
  """A scalar argument in ``dtype``: a NumPy scalar, or a 0-d JAX array
  for ``"jax"`` (a jitted call takes it as a static Python value)."""
  if source == "jax":
    return integer_array(value, dtype, source)
  return dtype.type(value)


@pytest.mark.parametrize("dtype,source,x64", integer_sources())
def test_decode_integer_arguments_of_every_dtype(dtype, source, x64):
  """``lengths``, ``block_table``, ``local_window_size`` and
  ``return_residual`` in any integer dtype, on the host, on the device or
  traced, give the int32 call's result on the same values saturated to
  int32: lengths below 0 or past the capacity clipped, the dtype's extremes
  in table entries no new token reads never dereferenced."""
  rng = fresh_rng()
  low, high = extremes(dtype)
  num_new, page_size, max_pages = 2, 4, 3
  capacity = page_size * max_pages
  lengths = [low, 1, 5, capacity + 3, high]
  clipped = [min(max(n, 0), capacity) for n in lengths]
  problem = make_problem(rng, batch=5, num_new=num_new, capacity=capacity)
  table, k_pages, v_pages = paginate(rng, problem.key, problem.value,
                                     clipped, page_size)
  junk = [high, low, -1] if low < 0 else [high, low]
  table = _junk_past_lengths(table, lengths, page_size, junk)
  q, k, v = problem.query, problem.key, problem.value

  def run(lengths, table, window, flag, jit):
    def paged(n, t):
      return jflash.decode_attention(q, k_pages, v_pages, n, block_table=t,
                                     local_window_size=window,
                                     return_residual=flag)

    def contiguous(n):
      return jflash.decode_attention(q, k, v, n, local_window_size=window,
                                     return_residual=flag)
    wrap = jax.jit if jit else (lambda f: f)
    return wrap(paged)(lengths, table), wrap(contiguous)(lengths)

  with jax.enable_x64(x64):
    want = run(saturated_int32(lengths), saturated_int32(table),
               (5, int(saturated_int32(high))), True, source == "jit")
    got = run(integer_array(lengths, dtype, source),
              integer_array(table, dtype, source),
              (_scalar(5, dtype, source), _scalar(high, dtype, source)),
              _scalar(1, dtype, source), source == "jit")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6,
                               atol=1e-6)
  if low < 0:
    with jax.enable_x64(x64), pytest.raises(ValueError,
                                            match="local_window_size"):
      jflash.decode_attention(q, k, v, saturated_int32(lengths),
                              local_window_size=_scalar(-1, dtype, source))


@pytest.mark.parametrize("dtype,source,x64", integer_sources())
def test_append_integer_arguments_of_every_dtype(dtype, source, x64):
  """``lengths`` and ``block_table`` of any integer dtype write what the
  int32 call on the values saturated to int32 writes: lengths clipped to
  ``[0, S]`` as decode_attention clips them, tokens at negative positions
  or under a table entry outside ``[0, P)`` dropped."""
  rng = fresh_rng()
  low, high = extremes(dtype)
  num_new, page_size, max_pages, num_pages = 3, 4, 3, 20
  capacity = page_size * max_pages
  lengths = [low, 2, 7, capacity + 4, high, 9]
  # Pages 1.. hold the sequences; page 0 only where an unsigned dtype's
  # smallest value stands (no other row writes it).
  table = rng.permutation(np.arange(1, num_pages))[:6 * max_pages].reshape(
      6, max_pages).astype(object)
  table[5, 1] = high   # the page of positions 6 and 7: dropped
  table[3, 2] = low    # the page of the clipped length's last three slots
  table = table.tolist()
  shape = (num_pages, page_size, 2, 4)
  pages = random_normal(rng, shape, jnp.float32)
  cache = random_normal(rng, (6, capacity, 2, 4), jnp.float32)
  new = random_normal(rng, (6, num_new, 2, 4), jnp.float32)

  def run(lengths, table, jit):
    wrap = jax.jit if jit else (lambda f: f)
    paged = wrap(lambda n, t: jflash.append_to_pages(
        pages, pages + 1, t, n, new, new + 1))
    contiguous = wrap(lambda n: jflash.append_to_cache(
        cache, cache + 1, n, new, new + 1))
    return paged(lengths, table), contiguous(lengths)

  with jax.enable_x64(x64):
    want = run(saturated_int32(lengths), saturated_int32(table),
               source == "jit")
    got = run(integer_array(lengths, dtype, source),
              integer_array(table, dtype, source), source == "jit")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("lengths", [np.array([18], np.int32),
                                     np.array([18], np.int64),
                                     jnp.array([18], jnp.uint32)],
                         ids=["int32", "int64-numpy", "uint32-jax"])
def test_lengths_past_the_capacity_write_the_slots_decode_reads(lengths):
  """A length past the capacity is the capacity, for the writes as for the
  attention: the ``T`` new tokens go to the last ``T`` slots, where
  decode_attention's queries then see them."""
  rng = fresh_rng()
  capacity, num_new, page_size = 16, 3, 4
  cache = random_normal(rng, (1, capacity, 1, 8), jnp.float32)
  new_k = random_normal(rng, (1, num_new, 1, 8), jnp.float32)
  new_v = random_normal(rng, (1, num_new, 1, 8), jnp.float32)
  k, v = jflash.append_to_cache(cache, cache, lengths, new_k, new_v)
  want_k = np.asarray(cache).copy()
  want_k[0, capacity - num_new:] = new_k[0]
  np.testing.assert_array_equal(np.asarray(k), want_k)
  table = np.array([[3, 0, 2, 1]], np.int32)
  pages = cache.reshape(4, page_size, 1, 8)[np.argsort(table[0])]
  k_pages, _ = jflash.append_to_pages(pages, pages, table, lengths, new_k,
                                      new_k)
  np.testing.assert_array_equal(
      np.asarray(k_pages)[table[0]].reshape(want_k.shape), want_k)
  q = random_normal(rng, (1, num_new, 2, 8), jnp.float32)
  got = jflash.decode_attention(q, k, v, lengths)
  want = Problem(q, k, v, np.array([capacity]), None, None).reference()[0]
  assert rel_err(got, want) <= F32_TOL
  # The new tokens see themselves: the same as attending with the length
  # that fits.
  np.testing.assert_array_equal(
      np.asarray(got),
      np.asarray(jflash.decode_attention(q, k, v, np.array([capacity]))))


def test_traced_window_is_rejected_by_name():
  rng = fresh_rng()
  problem = make_problem(rng, batch=3, capacity=8)
  with pytest.raises(ValueError, match="local_window_size must be .*traced"):
    jax.jit(lambda w: jflash.decode_attention(
        problem.query, problem.key, problem.value, problem.lengths,
        local_window_size=w))(jnp.asarray(3))


@pytest.mark.parametrize("paged", [False, True])
def test_mosaic_tpu_kernel_lowers_for_tpu(paged, monkeypatch):
  """Exported for a TPU from this host, the kernel passes Pallas's TPU
  lowering (block shapes Mosaic accepts, scalar-prefetched index maps)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  batch, num_new, heads, kv_heads, head_dim = 2, 3, 8, 2, 128
  spec = jax.ShapeDtypeStruct
  cache = spec((10, 16, kv_heads, head_dim) if paged
               else (batch, 64, kv_heads, head_dim), jnp.bfloat16)
  args = [spec((batch, num_new, heads, head_dim), jnp.bfloat16), cache,
          cache, spec((batch,), jnp.int32)]
  if paged:
    args.append(spec((batch, 4), jnp.int32))

  def run(q, k, v, lengths, table=None):
    return jflash.decode_attention(q, k, v, lengths, block_table=table,
                                   local_window_size=(20, 0),
                                   implementation="mosaic_tpu")

  with jflash.lowering_for("tpu", "TPU v5 lite"):
    exported = jax.export.export(jax.jit(run), platforms=["tpu"])(*args)
  assert "jflash_mosaic_tpu_decode" in exported.mlir_module()


@pytest.mark.parametrize("alibi", [False, True], ids=["rope", "alibi"])
def test_generation_example_matches_the_uncached_model(alibi):
  """examples/generate_cached.py: prefill in chunks of 16 and 4 tokens,
  then one token per step through shuffled pages, gives the logits of one
  uncached forward pass and the same greedy tokens (with RoPE, and with
  ALiBi in both attention calls)."""
  from flax import nnx

  from examples import generate_cached as example
  from examples.model import Config, TransformerLM
  rng = fresh_rng()
  prompt_len, new_tokens = 20, 4
  cfg = Config(vocab_size=32, seq_len=prompt_len + new_tokens, num_layers=1,
               d_model=32, num_heads=2, alibi=alibi)
  graphdef, state = nnx.split(TransformerLM(
      cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30)))))
  prompts = rng.integers(0, 32, (3, prompt_len)).astype(np.int32)
  caches, table = example.empty_pages(cfg, 3, prompt_len + new_tokens, 8, rng)
  tokens, logits = example.generate_cached(graphdef, state, prompts,
                                           new_tokens, caches, table)
  sequence = jnp.concatenate([jnp.asarray(prompts), tokens], axis=1)
  full = nnx.merge(graphdef, state)(sequence)[:, prompt_len - 1:-1]
  np.testing.assert_allclose(np.asarray(logits), np.asarray(full), atol=1e-4)
  np.testing.assert_array_equal(
      np.asarray(tokens), np.asarray(jnp.argmax(full, -1)))


# ------------------------------------------------------- the Hopper kernel
def _gpu_backend(**config):
  from jflash.backends.mosaic_gpu.decode import (MosaicGpuDecodeBackend,
                                                 MosaicGpuDecodeConfig)
  return MosaicGpuDecodeBackend(MosaicGpuDecodeConfig(**config))


# (T, heads (N, K), head dim, capacity, page size or None, window, soft cap,
# config): GQA groups of one to 64 rows and several row tiles, one split
# and several, every head dim, pages shorter than a chunk, equal to it and
# longer.
GPU_CASES = [
    (1, (32, 8), 128, 1024, None, None, None, {}),
    (1, (8, 2), 128, 1008, 16, (100, 0), None, {}),
    (2, (4, 1), 64, 576, 64, None, 5.0, {}),
    (7, (32, 1), 64, 296, None, (50, 3), 30.0, dict(num_splits=3)),
    (16, (4, 4), 256, 512, 256, None, None, {}),
    (16, (16, 4), 128, 640, 128, (200, 0), 4.0, dict(block_kv=128)),
    (8, (32, 8), 128, 4096, 64, None, None, dict(stages=2, num_splits=1)),
    (3, (8, 8), 256, 48, None, None, None, {}),
    (1, (8, 8), 64, 520, None, None, None, dict(num_splits=1)),
]


def _gpu_problem(rng, case, dtype):
  num_new, heads, head_dim, capacity, page_size, window, cap, _ = case
  return make_problem(rng, batch=5, num_new=num_new, heads=heads,
                      head_dim=head_dim, capacity=capacity, window=window,
                      cap=cap, page_size=page_size, dtype=dtype)


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: (
    f"T{c[0]}-N{c[1][0]}K{c[1][1]}-H{c[2]}-S{c[3]}-p{c[4]}-w{c[5]}"
    f"-cap{c[6]}-{'-'.join(f'{k}{v}' for k, v in c[7].items())}"))
def test_hopper_kernel_lowers_for_cuda_on_any_host(case):
  """The Hopper decode kernel traces and lowers for a CUDA target on the
  CPU (shape, layout and shared-memory errors surface here), also under
  x64."""
  from jflash.backends import mosaic_gpu
  num_new, heads, head_dim, capacity, page_size, window, cap, config = case
  batch = 3
  q = jax.ShapeDtypeStruct((batch, num_new, heads[0], head_dim),
                           jnp.bfloat16)
  table = None
  if page_size is None:
    kv = jax.ShapeDtypeStruct((batch, capacity, heads[1], head_dim),
                              jnp.bfloat16)
  else:
    max_pages = capacity // page_size
    kv = jax.ShapeDtypeStruct((batch * max_pages + 2, page_size, heads[1],
                               head_dim), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((batch, max_pages), jnp.int32)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)

  def run(q, k, v, n, t):
    return jflash.decode_attention(
        q, k, v, n, block_table=t, local_window_size=window,
        logits_soft_cap=cap, implementation=_gpu_backend(**config))
  for x64 in (False, True):
    with jax.enable_x64(x64), lowering_for_hopper():
      text = jax.jit(run).trace(q, kv, kv, lengths, table).lower(
          lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "jflash_decode" in text


def test_hopper_kernel_declines_what_it_does_not_serve():
  """Off Hopper, in interpret mode, float32, other head dims, contiguous
  caches whose length is not a multiple of 8 and page sizes that do not
  tile a chunk go to the next backend."""
  from jflash.backends import mosaic_gpu
  rng = fresh_rng()
  problem = make_problem(rng, num_new=2, head_dim=64, capacity=48,
                         dtype=jnp.bfloat16)
  args = (problem.query, problem.key, problem.value, problem.lengths)
  if jax.default_backend() != "gpu":
    with pytest.raises(NotImplementedError, match="Hopper GPU"):
      jflash.decode_attention(*args, implementation=_gpu_backend())
  declined = [
      (dict(interpret=True), {}, "interpret"),
      (dict(dtype=jnp.float32), {}, "float32"),
      (dict(head_dim=96), {}, "head dims"),
      (dict(capacity=132), {}, "multiple of 8"),
      (dict(page_size=12), {}, "page size 12"),
      (dict(page_size=48), {}, "page size 48"),
  ]
  for changes, config, message in declined:
    interpret = changes.pop("interpret", False)
    shape = dict(num_new=2, head_dim=64, capacity=96, dtype=jnp.bfloat16)
    shape.update(changes)
    problem = make_problem(rng, **shape)
    if problem.table is None:
      call = (problem.query, problem.key, problem.value, problem.lengths)
      kw = {}
    else:
      call = (problem.query, problem.key_pages, problem.value_pages,
              problem.lengths)
      kw = dict(block_table=problem.table)
    with lowering_for_hopper():
      with pytest.raises(NotImplementedError, match=message):
        jflash.decode_attention(*call, **kw, interpret=interpret,
                                implementation=_gpu_backend(**config))


def _on_hopper() -> bool:
  from jflash.backends import mosaic_gpu
  host = host_target()
  return host.platform == "cuda" and is_hopper(host.device_kind)


hopper = pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper GPU")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: (
    f"T{c[0]}-N{c[1][0]}K{c[1][1]}-H{c[2]}-S{c[3]}-p{c[4]}-w{c[5]}"
    f"-cap{c[6]}-{'-'.join(f'{k}{v}' for k, v in c[7].items())}"))
def test_hopper_kernel_matches_reference(case, dtype, paged):
  """Ragged lengths (0, the capacity, one short of T, random), GQA/MQA,
  windows, soft cap, contiguous and paged: within the same-dtype baseline
  of the exact reference."""
  if paged and case[4] is None:
    case = case[:4] + (64 if case[3] % 64 == 0 else 8,) + case[5:]
  if not paged:
    case = case[:4] + (None,) + case[5:]
  rng = fresh_rng()
  problem = _gpu_problem(rng, case, dtype)
  out, lse = problem.decode(paged, _gpu_backend(**case[7]))
  check_against_reference(problem, out, lse,
                          f"{case} lengths={problem.lengths}")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("paged", [False, True])
def test_hopper_kernel_never_uses_slots_no_query_sees(paged):
  """NaN in every slot no new token sees and junk table entries leave the
  kernel's result bitwise unchanged; reruns give the same bits."""
  rng = fresh_rng()
  problem = make_problem(rng, batch=6, num_new=3, heads=(8, 2),
                         head_dim=128, capacity=512, window=(150, 0),
                         page_size=16 if paged else None,
                         dtype=jnp.bfloat16)
  run = functools.partial(Problem.decode, paged=paged,
                          backend=_gpu_backend(num_splits=3))
  clean = run(problem)
  dirty = poisoned(problem, paged)
  for _ in range(2):
    got = run(dirty)
    for g, c in zip(got, clean):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
  check_against_reference(problem, *clean, "poisoned")


@pytest.mark.gpu
@hopper
def test_hopper_kernel_split_counts_and_default_agree():
  """One split, many, and the automatic count (which fills the SMs) all
  match the reference; the default decode implementation on a Hopper GPU
  is the kernel."""
  rng = fresh_rng()
  problem = make_problem(rng, batch=3, num_new=1, heads=(32, 8),
                         head_dim=128, capacity=2048, page_size=64,
                         dtype=jnp.bfloat16)
  for splits in (1, 5, None):
    out, lse = problem.decode(True, _gpu_backend(num_splits=splits))
    check_against_reference(problem, out, lse, f"splits={splits}")
  default = problem.decode(True)
  kernel = problem.decode(True, _gpu_backend())
  np.testing.assert_array_equal(np.asarray(default[0]),
                                np.asarray(kernel[0]))


def test_decode_inside_a_checked_shard_map():
  """Inside a user's jax.shard_map that checks how values vary over the
  mesh (check_vma, the default), decoding runs per shard and equals the
  unsharded call; the Hopper kernels (decode, attention and its gradient)
  lower for CUDA there too, their outputs varying as their inputs."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jflash.backends import mosaic_gpu
  rng = fresh_rng()
  mesh = jax.make_mesh((2,), ("d",))
  problem = make_problem(rng, batch=4, num_new=2, heads=(4, 2),
                         window=(9, 0), page_size=4)
  decode = lambda q, k, v, n: jflash.decode_attention(
      q, k, v, n, local_window_size=problem.window)
  sharded = jax.jit(jax.shard_map(decode, mesh=mesh,
                                  in_specs=(P("d"),) * 4, out_specs=P("d")))
  spec = NamedSharding(mesh, P("d"))
  args = (problem.query, problem.key, problem.value,
          jnp.asarray(problem.lengths))
  got = sharded(*jax.device_put(args, spec))
  np.testing.assert_allclose(np.asarray(got),
                             np.asarray(jax.jit(decode)(*args)),
                             rtol=1e-6, atol=1e-6)

  # Lowered for a Hopper GPU: a mesh of such devices.
  from jax.sharding import AbstractDevice, AbstractMesh
  mesh = AbstractMesh((2,), ("d",), abstract_device=AbstractDevice(
      device_kind=HOPPER, num_cores=None, platform="cuda"))
  spec = NamedSharding(mesh, P("d"))
  qkv = jax.ShapeDtypeStruct((4, 128, 4, 64), jnp.bfloat16, sharding=spec)

  def grads(q, k, v):
    loss = lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=True, implementation="mosaic_gpu").astype(
            jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  step = jax.shard_map(grads, mesh=mesh, in_specs=(P("d"),) * 3,
                       out_specs=(P("d"),) * 3)
  cache = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=spec)
  new = jax.ShapeDtypeStruct((4, 1, 8, 128), jnp.bfloat16, sharding=spec)
  lengths = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=spec)
  kernel_decode = jax.shard_map(
      lambda q, k, v, n: jflash.decode_attention(
          q, k, v, n, implementation="mosaic_gpu"),
      mesh=mesh, in_specs=(P("d"),) * 4, out_specs=P("d"))
  with lowering_for_hopper():
    text = jax.jit(step).trace(qkv, qkv, qkv).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3
    text = jax.jit(kernel_decode).trace(new, cache, cache, lengths).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("field,value", [("block_kv", 96), ("block_kv", 0),
                                         ("stages", 1), ("stages", 2.0),
                                         ("num_splits", 0)])
def test_hopper_config_rejects_bad_values(field, value):
  from jflash.backends.mosaic_gpu.decode import MosaicGpuDecodeConfig
  with pytest.raises(ValueError, match=f"MosaicGpuDecodeConfig.{field}"):
    MosaicGpuDecodeConfig(**{field: value})


def test_hopper_config_reaches_the_kernel_plan():
  """Chunk, ring depth (capped by shared memory) and split count follow the
  config; the default split count fills the SMs and never exceeds the
  chunks a sequence can need."""
  from jflash.backends.mosaic_gpu import common
  from jflash.backends.mosaic_gpu.decode import (MosaicGpuDecodeBackend,
                                                 MosaicGpuDecodeConfig)
  rng = fresh_rng()
  problem = make_problem(rng, batch=3, num_new=1, heads=(8, 2),
                         head_dim=128, capacity=4096, dtype=jnp.bfloat16)
  call = jflash.decode._canonical_call(
      problem.query, problem.key, problem.value, problem.lengths, None,
      None, None, None)
  plan = lambda **c: MosaicGpuDecodeBackend(
      MosaicGpuDecodeConfig(**c))._static(call)
  default = plan()
  assert (default.block_kv, default.stages) == (64, 4)
  assert default.num_splits == common.num_sms() // (3 * 2)
  custom = plan(block_kv=128, stages=2, num_splits=5)
  assert (custom.block_kv, custom.stages, custom.num_splits) == (128, 2, 5)
  assert plan(stages=3).stages == 3
  assert plan(num_splits=1000).num_splits == 4096 // 64
  assert plan(block_kv=128, stages=9).stages == 2  # what fits beside Q
  head_256 = make_problem(rng, batch=3, num_new=1, heads=(4, 4),
                          head_dim=256, capacity=512, dtype=jnp.bfloat16)
  call = jflash.decode._canonical_call(
      head_256.query, head_256.key, head_256.value, head_256.lengths, None,
      None, None, None)
  st = MosaicGpuDecodeBackend()._static(call)
  assert (st.q_buffers, st.stages) == (1, 2)
