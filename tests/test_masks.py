"""The shared mask module against brute force written independently here."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jflash import masks, tiles
from tests._support import random_segments, seeded_rng


# Jitted once per shape instead of dispatching op by op.
tile_classes = jax.jit(tiles.tile_classes, static_argnums=(1, 2))
visibility = jax.jit(lambda m: m.visibility())


def brute_visibility(batch, q_len, kv_len, is_causal=False, window=None,
                     q_lengths=None, kv_lengths=None, q_ids=None, kv_ids=None,
                     dense=None):
  """Plain Python loops over the documented rule: ``[B, N|1, T, S]``."""
  heads = 1 if dense is None else dense.shape[1]
  out = np.zeros((batch, heads, q_len, kv_len), bool)
  for b, n, t, s in itertools.product(range(batch), range(heads),
                                      range(q_len), range(kv_len)):
    ok = True
    if is_causal and s > t:
      ok = False
    if window is not None and not (t - window[0] <= s <= t + window[1]):
      ok = False
    if q_lengths is not None and t >= q_lengths[b]:
      ok = False
    if kv_lengths is not None and s >= kv_lengths[b]:
      ok = False
    if q_ids is not None and q_ids[b, t] != kv_ids[b, s]:
      ok = False
    if dense is not None:
      d = dense[b % dense.shape[0], n % dense.shape[1], t % dense.shape[2],
                s % dense.shape[3]]
      ok = ok and bool(d)
    out[b, n, t, s] = ok
  return out


def random_mask(rng, batch, q_len, kv_len, *, causal, window, lengths,
                segments, dense, sorted_segments=True):
  kw = dict(is_causal=causal)
  if window:
    kw["window"] = (int(rng.integers(0, q_len)), int(rng.integers(0, kv_len)))
  if lengths:
    kw["q_lengths"] = rng.integers(0, q_len + 1, batch).astype(np.int32)
    kw["kv_lengths"] = rng.integers(0, kv_len + 1, batch).astype(np.int32)
  if segments:
    if sorted_segments:
      kw["q_ids"] = random_segments(rng, batch, q_len)
      kw["kv_ids"] = random_segments(rng, batch, kv_len)
    else:
      kw["q_ids"] = rng.integers(0, 3, (batch, q_len)).astype(np.int32)
      kw["kv_ids"] = rng.integers(0, 3, (batch, kv_len)).astype(np.int32)
  if dense:
    kw["dense"] = rng.random((1, 2, q_len, kv_len)) < 0.9
  mask = masks.AttentionMask(
      batch=batch, q_len=q_len, kv_len=kv_len, is_causal=causal,
      window=kw.get("window"),
      q_lengths=None if not lengths else jnp.asarray(kw["q_lengths"]),
      kv_lengths=None if not lengths else jnp.asarray(kw["kv_lengths"]),
      q_segment_ids=None if not segments else jnp.asarray(kw["q_ids"]),
      kv_segment_ids=None if not segments else jnp.asarray(kw["kv_ids"]),
      dense=None if not dense else jnp.asarray(kw["dense"]))
  return mask, brute_visibility(batch, q_len, kv_len, **kw)


def brute_tile_classes(vis, block_q, block_kv):
  """EMPTY/PARTIAL/FULL per tile from the element mask (padding hidden)."""
  batch, _, q_len, kv_len = vis.shape
  nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
  padded = np.zeros((batch, vis.shape[1], nq * block_q, nk * block_kv), bool)
  padded[:, :, :q_len, :kv_len] = vis
  blocks = padded.reshape(batch, vis.shape[1], nq, block_q, nk, block_kv)
  anyv = blocks.any(axis=(1, 3, 5))
  allv = blocks.all(axis=(1, 3, 5))
  return np.where(anyv, np.where(allv, tiles.FULL, tiles.PARTIAL), tiles.EMPTY)


COMBOS = [dict(causal=c, window=w, lengths=l, segments=s, dense=d)
          for c, w, l, s, d in itertools.product([False, True], repeat=5)]


def _seeded():
  return seeded_rng()


@pytest.mark.parametrize("combo", COMBOS,
                         ids=lambda c: "-".join(k for k, v in c.items() if v)
                         or "none")
def test_element_visibility_matches_brute_force(combo):
  rng, seed = _seeded()
  batch, q_len, kv_len = 2, int(rng.integers(1, 24)), int(rng.integers(1, 24))
  mask, want = random_mask(rng, batch, q_len, kv_len, **combo)
  got = np.asarray(visibility(mask))
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want,
                                err_msg=f"seed={seed}")


@pytest.mark.parametrize("combo", COMBOS,
                         ids=lambda c: "-".join(k for k, v in c.items() if v)
                         or "none")
def test_tile_classes(combo):
  """Empty tiles hide every pair and full tiles show every pair; for the
  structural rules (causal, window, lengths) the classification is exact, and
  so is emptiness for sorted segments alone."""
  rng, seed = _seeded()
  for _ in range(3):
    batch = 2
    q_len, kv_len = int(rng.integers(1, 70)), int(rng.integers(1, 70))
    block_q, block_kv = int(rng.integers(1, 17)), int(rng.integers(1, 17))
    mask, vis = random_mask(rng, batch, q_len, kv_len, **combo)
    got = np.asarray(tile_classes(mask, block_q, block_kv))
    want = brute_tile_classes(vis, block_q, block_kv)
    info = (f"seed={seed} T={q_len} S={kv_len} blocks={block_q},{block_kv} "
            f"window={mask.window}")
    # Never wrong in the unsafe direction.
    assert not np.any((got == tiles.EMPTY) & (want != tiles.EMPTY)), info
    assert not np.any((got == tiles.FULL) & (want != tiles.FULL)), info
    others = combo["causal"] or combo["window"] or combo["lengths"]
    if not combo["dense"] and not (combo["segments"] and others):
      # Structural rules alone, or sorted (contiguous) segments alone:
      # exact emptiness.  (Combined, each part is exact on its own but
      # their intersection inside one tile may be empty.)
      np.testing.assert_array_equal(got == tiles.EMPTY, want == tiles.EMPTY,
                                    err_msg=info)
    if not combo["dense"] and not combo["segments"]:
      np.testing.assert_array_equal(got, want, err_msg=info)


def test_tile_classes_where_light_cpu_codegen_aborted():
  """A shape whose tile classification aborted XLA:CPU's LLVM instruction
  selection at ``--xla_backend_optimization_level=1`` on AVX-512 hosts (see
  ``conftest.py``): it must compile and agree with brute force."""
  rng, seed = _seeded()
  combo = dict(causal=False, window=False, lengths=False, segments=True,
               dense=True)
  mask, vis = random_mask(rng, 2, 16, 48, **combo)
  got = np.asarray(tile_classes(mask, 11, 9))
  want = brute_tile_classes(vis, 11, 9)
  assert not np.any((got == tiles.EMPTY) & (want != tiles.EMPTY)), seed
  assert not np.any((got == tiles.FULL) & (want != tiles.FULL)), seed


def test_unsorted_segments_are_conservative():
  rng, seed = _seeded()
  mask, vis = random_mask(rng, 2, 40, 40, causal=False, window=False,
                          lengths=False, segments=True, dense=False,
                          sorted_segments=False)
  got = np.asarray(tile_classes(mask, 8, 8))
  want = brute_tile_classes(vis, 8, 8)
  assert not np.any((got == tiles.EMPTY) & (want != tiles.EMPTY)), seed
  assert not np.any((got == tiles.FULL) & (want != tiles.FULL)), seed


def test_causal_window_tile_count():
  """Causal + window at a known geometry visits the expected tiles."""
  seq, block, left = 256, 32, 40
  mask = masks.AttentionMask(batch=1, q_len=seq, kv_len=seq, is_causal=True,
                             window=(left, left))
  sched = tiles.tile_schedule(mask, block, block)
  # Query block i sees key blocks from floor((32 i - 40) / 32) to i.
  expected = sum(i - max(0, (block * i - left) // block) + 1
                 for i in range(seq // block))
  assert int(sched.visited_tiles) == expected
  nq = seq // block
  assert int((sched.classes == tiles.FULL).sum()) < expected < nq * nq


def test_schedule_orders_list_nonempty_tiles_first():
  rng, seed = _seeded()
  mask, _ = random_mask(rng, 3, 50, 60, causal=True, window=True,
                        lengths=True, segments=True, dense=False)
  sched = jax.tree.map(np.asarray, jax.jit(
      tiles.tile_schedule, static_argnums=(1, 2))(mask, 8, 16))
  classes = sched.classes
  for b in range(3):
    for qi in range(classes.shape[1]):
      n = int(sched.kv_count[b, qi])
      visited = np.asarray(sched.kv_order[b, qi, :n])
      np.testing.assert_array_equal(
          visited, np.flatnonzero(classes[b, qi] != tiles.EMPTY), str(seed))
    for ki in range(classes.shape[2]):
      n = int(sched.q_count[b, ki])
      np.testing.assert_array_equal(
          np.asarray(sched.q_order[b, ki, :n]),
          np.flatnonzero(classes[b, :, ki] != tiles.EMPTY), str(seed))
  merged = tiles.tile_schedule(mask, 8, 16, merge_batch=True)
  assert merged.classes.shape[0] == 1
  np.testing.assert_array_equal(
      np.asarray(merged.classes[0] != tiles.EMPTY),
      (classes != tiles.EMPTY).any(0))


def test_rows_with_visible_keys():
  rng, seed = _seeded()
  mask, vis = random_mask(rng, 2, 30, 20, causal=True, window=True,
                          lengths=True, segments=False, dense=False)
  np.testing.assert_array_equal(np.asarray(mask.rows_with_visible_keys()),
                                vis.any(axis=(1, 3)), err_msg=str(seed))
  with pytest.raises(ValueError):
    random_mask(rng, 1, 4, 4, causal=False, window=False, lengths=False,
                segments=True, dense=False)[0].rows_with_visible_keys()


def test_tile_classes_under_jit_with_traced_lengths():
  mask = masks.AttentionMask(batch=1, q_len=64, kv_len=64,
                             kv_lengths=jnp.asarray([20], jnp.int32))
  f = jax.jit(lambda m: tiles.tile_classes(m, 16, 16))
  got = np.asarray(f(mask))
  assert (got[0, :, 2:] == tiles.EMPTY).all()
  assert (got[0, :, 0] == tiles.FULL).all()
  assert (got[0, :, 1] == tiles.PARTIAL).all()


def test_invalid_mask_construction():
  with pytest.raises(ValueError, match="window"):
    masks.AttentionMask(batch=1, q_len=4, kv_len=4, window=(-1, 2))
  with pytest.raises(ValueError, match="segment"):
    masks.AttentionMask(batch=1, q_len=4, kv_len=4,
                        q_segment_ids=jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="block"):
    tiles.tile_classes(masks.AttentionMask(batch=1, q_len=4, kv_len=4), 0, 4)


@pytest.mark.parametrize("combo", [c for c in COMBOS if not c["segments"]
                                   and not c["dense"]],
                         ids=lambda c: "-".join(k for k, v in c.items() if v)
                         or "none")
def test_may_have_empty_rows_is_safe(combo):
  """When the static check says every row sees a key, brute force agrees."""
  rng, seed = _seeded()
  for _ in range(5):
    q_len, kv_len = int(rng.integers(1, 30)), int(rng.integers(1, 30))
    mask, vis = random_mask(rng, 2, q_len, kv_len, **combo)
    if not mask.may_have_empty_rows():
      assert vis.any(axis=(1, 3)).all(), f"seed={seed} window={mask.window}"


def test_key_visibility_at_matches_rows_of_the_full_mask():
  rng, seed = _seeded()
  for _ in range(5):
    length = int(rng.integers(1, 40))
    window = (int(rng.integers(0, length)), int(rng.integers(0, length)))
    causal = bool(rng.integers(0, 2))
    want = brute_visibility(1, length, length, is_causal=causal,
                            window=window)[0, 0]
    row_at = jax.jit(lambda p: masks.key_visibility_at(
        p, length, is_causal=causal, window=window))
    for position in range(length):
      np.testing.assert_array_equal(np.asarray(row_at(position)),
                                    want[position], err_msg=str(seed))




def brute_decode_visibility(lengths, num_new, kv_len, window):
  """``[B, T, S]``: new query t of row b stands at lengths[b] - T + t and
  sees written slots up to its own position (and the window's left side)."""
  out = np.zeros((len(lengths), num_new, kv_len), bool)
  for b, length in enumerate(lengths):
    for t in range(num_new):
      p = int(length) - num_new + t
      for s in range(kv_len):
        ok = s <= p and s < length
        if window is not None:
          ok = ok and p - window[0] <= s <= p + window[1]
        out[b, t, s] = ok
  return out


def _random_decode_problem(rng):
  num_new = int(rng.choice([1, 2, 7, 16]))
  kv_len = int(rng.integers(1, 40))
  lengths = rng.integers(0, kv_len + 1, 4)
  lengths[:2] = (0, kv_len)  # the ends: an empty cache and a full one
  window = None
  if rng.integers(0, 2):
    window = (int(rng.integers(0, kv_len + 3)), int(rng.integers(0, 3)))
  return num_new, kv_len, lengths.astype(np.int32), window


def test_decode_row_bounds_and_visibility_match_brute_force():
  rng, seed = _seeded()
  for _ in range(6):
    num_new, kv_len, lengths, window = _random_decode_problem(rng)
    want = brute_decode_visibility(lengths, num_new, kv_len, window)
    info = f"seed={seed} T={num_new} S={kv_len} L={lengths} w={window}"
    lo, hi = masks.decode_row_bounds(jnp.asarray(lengths), num_new,
                                     kv_len=kv_len, window=window)
    s = np.arange(kv_len)
    got = (s >= np.asarray(lo)[..., None]) & (s < np.asarray(hi)[..., None])
    np.testing.assert_array_equal(got, want, err_msg=info)
    # Any key positions, in any order, including past the cache.
    positions = rng.integers(-2, kv_len + 2, (len(lengths), 9)).astype(
        np.int32)
    vis = np.asarray(masks.decode_visibility(
        jnp.asarray(lengths), num_new, jnp.asarray(positions),
        kv_len=kv_len, window=window))
    padded = np.pad(want, ((0, 0), (0, 0), (2, 2)))
    expect = np.take_along_axis(padded, positions[:, None, :] + 2, axis=2)
    np.testing.assert_array_equal(vis, expect, err_msg=info)


def test_decode_key_range_is_the_hull_of_visible_keys():
  rng, seed = _seeded()
  for _ in range(6):
    num_new, kv_len, lengths, window = _random_decode_problem(rng)
    vis = brute_decode_visibility(lengths, num_new, kv_len, window).any(1)
    first, end = masks.decode_key_range(jnp.asarray(lengths), num_new,
                                        kv_len=kv_len, window=window)
    for b in range(len(lengths)):
      seen = np.flatnonzero(vis[b])
      want = (seen[0], seen[-1] + 1) if seen.size else (0, 0)
      assert (int(first[b]), int(end[b])) == want, (seed, b, lengths, window)


def test_decode_chunk_class_matches_brute_force():
  """``full`` exactly when every new query sees every slot of the chunk;
  ``unseen`` exactly when some slot of it is seen by no query (chunks
  may start anywhere, also before 0 or past the cache)."""
  rng, seed = _seeded()
  for _ in range(6):
    num_new, kv_len, lengths, window = _random_decode_problem(rng)
    vis = brute_decode_visibility(lengths, num_new, kv_len, window)
    vis = np.pad(vis, ((0, 0), (0, 0), (8, 8)))  # slots -8 .. kv_len + 7
    chunk = int(rng.integers(1, 9))
    starts = np.arange(-8, kv_len + 8 - chunk + 1, dtype=np.int32)
    for b, length in enumerate(lengths):
      bounds = masks.decode_bounds(jnp.int32(length), num_new,
                                   kv_len=kv_len, window=window)
      full, unseen = tiles.decode_chunk_class(bounds, jnp.asarray(starts),
                                              chunk)
      for i, start in enumerate(starts):
        block = vis[b, :, start + 8:start + 8 + chunk]
        info = (seed, num_new, kv_len, int(length), window, int(start),
                chunk)
        assert bool(full[i]) == bool(block.all()), info
        assert bool(unseen[i]) == bool(not block.any(0).all()), info


def test_decode_max_chunks_bounds_every_length():
  rng, seed = _seeded()
  for _ in range(6):
    num_new, kv_len, _, window = _random_decode_problem(rng)
    chunk = int(rng.integers(1, 9))
    bound = tiles.decode_max_chunks(num_new, kv_len, chunk, window)
    lengths = np.arange(kv_len + 1, dtype=np.int32)
    first, end = masks.decode_key_range(jnp.asarray(lengths), num_new,
                                        kv_len=kv_len, window=window)
    first, end = np.asarray(first), np.asarray(end)
    touched = np.where(end > first, (end - 1) // chunk - first // chunk + 1,
                       0)
    assert touched.max() <= bound <= -(-kv_len // chunk), (seed, window)
    if window is None:  # a full cache touches every chunk
      assert touched.max() == bound


def test_row_bounds_with_per_row_offsets_matches_each_row():
  rng, seed = _seeded()
  offsets = rng.integers(-5, 20, 3).astype(np.int32)
  kv_lengths = rng.integers(0, 25, 3).astype(np.int32)
  window = (int(rng.integers(0, 8)), int(rng.integers(0, 8)))
  q_idx = jnp.arange(6, dtype=jnp.int32)[None]
  kw = dict(q_len=6, kv_len=24, is_causal=True, window=window)
  lo, hi = masks.row_bounds(q_idx, q_offset=jnp.asarray(offsets)[:, None],
                            kv_length=jnp.asarray(kv_lengths)[:, None], **kw)
  for b in range(3):
    lo_b, hi_b = masks.row_bounds(q_idx[0], q_offset=jnp.int32(offsets[b]),
                                  kv_length=jnp.int32(kv_lengths[b]), **kw)
    np.testing.assert_array_equal(lo[b], lo_b, err_msg=str(seed))
    np.testing.assert_array_equal(hi[b], hi_b, err_msg=str(seed))
