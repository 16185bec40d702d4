"""What CI can check of the Hopper backend without a GPU: its configuration,
when it declines, the per-step tile metadata it feeds the kernels, and that
every kernel traces and lowers to Mosaic GPU (shared-memory budget
included) for each head dim.  The kernels themselves run in
``tests/test_gpu.py`` on the device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import masks, tiles
from jflash.backends import mosaic_gpu
from jflash.backends.mosaic_gpu import MosaicGpuConfig
from jflash.backends.mosaic_gpu.common import LogitTransform, MaskSpec
from jflash.backends.mosaic_gpu import common, schedule
from tests._support import fresh_rng, lowering_for_hopper, random_segments

_rng = fresh_rng


def _forward_and_backward(mask, plan):
  """``run(q, k, v) -> (out, lse, grads)`` through the mosaic_gpu kernels."""
  def run(q, k, v):
    (out, lse), vjp = jax.vjp(
        lambda q, k, v: mosaic_gpu.attention._attention(q, k, v, mask, plan), q, k, v)
    return out, lse, vjp((out, lse))
  return run


def _cuda_lowering(run, q, kv) -> str:
  """The StableHLO text of ``run`` lowered for CUDA (on any host)."""
  return jax.jit(run).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("field,value", [("block_q", 96), ("block_kv", 0),
                                         ("stages", 1), ("stages_dq", 0),
                                         ("stages_dkv", 0), ("fuse_dq", 1),
                                         ("qk_after_pv", 1),
                                         ("block_q_dq", 64.0),
                                         ("dq_slots", 0), ("dq_slots", 2.0)])
def test_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=f"MosaicGpuConfig.{field}"):
    MosaicGpuConfig(**{field: value})


def test_qk_after_pv_default_follows_head_dim_and_features():
  """A caller's qk_after_pv is kept; the table turns it on at head dim
  128 only, and segment ids or a soft cap turn it off."""
  for value in (False, True):
    assert MosaicGpuConfig(qk_after_pv=value).resolved(64).qk_after_pv \
        == value
  assert [mosaic_gpu.default_config(h).qk_after_pv
          for h in (64, 128, 256)] == [False, True, False]
  assert not mosaic_gpu.default_config(128, 4096, segments=True).qk_after_pv
  assert not mosaic_gpu.default_config(128, 4096, soft_cap=True).qk_after_pv
  assert mosaic_gpu.default_config(128, 4096, causal=True).qk_after_pv


def _forward_kernel_text(head_dim: int, **fields) -> str:
  """The traced forward (its kernel body included) for a causal mask."""
  mask = masks.AttentionMask(batch=1, q_len=256, kv_len=256, is_causal=True)
  plan = mosaic_gpu.attention._Plan(
      spec=MaskSpec.of(mask), logits=LogitTransform(0.1, None),
      config=MosaicGpuConfig(**fields).resolved(head_dim),
      head_dim=head_dim)
  q = jax.ShapeDtypeStruct((1, 256, 2, head_dim), jnp.bfloat16)
  return str(jax.make_jaxpr(
      lambda q, k, v: mosaic_gpu.attention._attention(q, k, v, mask, plan))(q, q, q))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_qk_after_pv_reaches_the_kernel(head_dim):
  """qk_after_pv changes the forward kernel that is traced, not only the
  resolved configuration: the chained loop issues more products (its
  first Q K^T before the loop, its last P V alone)."""
  default = _forward_kernel_text(head_dim, qk_after_pv=False)
  chained = _forward_kernel_text(head_dim, qk_after_pv=True)
  assert chained.count("wgmma") > default.count("wgmma")


def test_fused_backward_rejects_head_dim_256():
  with pytest.raises(ValueError, match="fuse_dq.*256"):
    MosaicGpuConfig(fuse_dq=True).resolved(256)
  assert MosaicGpuConfig(fuse_dq=True).resolved(100).fuse_dq


@pytest.mark.parametrize("head_dim", [32, 64, 100, 128, 256])
def test_overlap_sdp_default_follows_head_dim_and_features(head_dim):
  """S and dP are issued together by default up to head dim 128, not
  with segment ids or a soft cap, and a caller's stages_dq=1 (which cannot
  issue them together) turns the default off instead of failing; a
  caller's explicit choice is kept."""
  small = head_dim <= 128
  assert mosaic_gpu.default_config(head_dim).overlap_sdp == small
  assert mosaic_gpu.default_config(head_dim, 4095, causal=True).overlap_sdp \
      == small
  assert not mosaic_gpu.default_config(head_dim, segments=True).overlap_sdp
  assert not mosaic_gpu.default_config(head_dim, soft_cap=True).overlap_sdp
  assert not MosaicGpuConfig(stages_dq=1).resolved(head_dim).overlap_sdp
  assert not MosaicGpuConfig(overlap_sdp=False).resolved(head_dim).overlap_sdp
  if small:
    assert MosaicGpuConfig(overlap_sdp=True).resolved(
        head_dim, segments=True).overlap_sdp
    with pytest.raises(ValueError, match="stages_dq=1"):
      MosaicGpuConfig(overlap_sdp=True, stages_dq=1).resolved(head_dim)


def test_overlap_sdp_rejects_configurations_it_cannot_change():
  """overlap_sdp is refused where no pass would issue S and dP together:
  head dim 256, and a one-buffer dQ pass of the two-pass backward."""
  with pytest.raises(ValueError, match="overlap_sdp.*256"):
    MosaicGpuConfig(overlap_sdp=True).resolved(256)
  with pytest.raises(ValueError, match="overlap_sdp.*stages_dq=1"):
    MosaicGpuConfig(overlap_sdp=True, stages_dq=1).resolved(128)
  assert MosaicGpuConfig(overlap_sdp=True).resolved(128).overlap_sdp
  assert MosaicGpuConfig(overlap_sdp=True, fuse_dq=True).resolved(64).fuse_dq


@pytest.mark.parametrize("fields", [dict(dq_slots=2),
                                    dict(dq_slots=2, fuse_dq=False),
                                    dict(fuse_dq=True, block_q_dq=128),
                                    dict(fuse_dq=True, block_kv_dq=64),
                                    dict(fuse_dq=True, stages_dq=3)])
def test_config_rejects_fields_of_a_pass_that_does_not_run(fields):
  name = next(n for n in fields if n != "fuse_dq")
  with pytest.raises(ValueError, match=f"MosaicGpuConfig.{name}=.*no effect"):
    MosaicGpuConfig(**fields).resolved(128)
  # The same fields with the pass that reads them are accepted, and so is
  # the default value with either.
  fuse = "dq_slots" in fields
  ok = dict(fields, fuse_dq=fuse)
  assert getattr(MosaicGpuConfig(**ok).resolved(128), name) == fields[name]
  default = getattr(mosaic_gpu.default_config(128), name)
  for fuse_dq in (False, True):
    MosaicGpuConfig(**{name: default, "fuse_dq": fuse_dq}).resolved(128)


@pytest.mark.parametrize("dq_slots", [1, 2, 3])
def test_fused_backward_ranks_order_every_query_tile(dq_slots):
  """Each key block visits its query tiles in decreasing order; for each
  query tile and accumulator, the key blocks adding to it get ranks 0, 1,
  2, ... in key-block order; the visited flags mark exactly the query tiles
  some key block adds to each accumulator."""
  rng = _rng()
  batch, t, s = 2, 333, 300
  mask = masks.AttentionMask(
      batch=batch, q_len=t, kv_len=s, is_causal=True, window=(150, 0),
      kv_lengths=jnp.asarray([300, 120], jnp.int32),
      q_segment_ids=jnp.asarray(random_segments(rng, batch, t)),
      kv_segment_ids=jnp.asarray(random_segments(rng, batch, s)))
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.1, None),
                          config=MosaicGpuConfig(
                              fuse_dq=True, block_kv_dkv=64,
                              dq_slots=dq_slots).resolved(128),
                          head_dim=128)
  bq, bk = plan.config.block_q_dkv, plan.config.block_kv_dkv
  pads = mosaic_gpu.attention._padding(mask, plan)
  slots = mosaic_gpu.attention._fused_slots(plan.config, pads)
  assert slots == min(dq_slots, pads.kv_pad // (2 * bk))
  order, count, _, ranks, visited = map(
      np.asarray, schedule.fused_keys_metadata(mask, bq, bk, pads,
                                                slots=slots))
  assert visited.shape[:2] == (slots, batch)
  visible = np.asarray(mask.visibility())[:, 0]
  for b in range(batch):
    seen = {}  # (accumulator, query tile) -> contributions so far
    for j in range(order.shape[1]):  # key blocks in grid order
      visiting = order[b, j, :count[b, j]]
      assert np.all(np.diff(visiting) < 0)  # decreasing query tiles
      for step in range(count[b, j]):
        key = (j % slots, order[b, j, step])
        assert ranks[b, j, step] == seen.get(key, 0)
        seen[key] = seen.get(key, 0) + 1
    for q_tile in range(visited.shape[2]):
      rows = visible[b, q_tile * bq:(q_tile + 1) * bq]
      for r in range(slots):
        assert visited[r, b, q_tile] == ((r, q_tile) in seen)
      if rows.any():
        assert any((r, q_tile) in seen for r in range(slots))


def test_config_resolves_per_head_dim():
  config = MosaicGpuConfig(block_kv=64).resolved(80)
  assert config.block_kv == 64
  assert config.block_q == mosaic_gpu.default_config(128).block_q
  assert all(v is not None for v in vars(config).values())
  with pytest.raises(ValueError, match="above 256"):
    mosaic_gpu.default_config(320)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_key_tiles_never_wider_than_the_keys(head_dim):
  """With the number of keys known, the forward and dQ key tiles narrow to
  the smallest of 64, 128, 256 covering them (never widening the tuned
  tile); an explicit tile is kept; long sequences get the tuned table."""
  tuned = mosaic_gpu.default_config(head_dim)
  rng = _rng()
  # (4095: below the fused backward's rule, tested on its own.)
  for kv_len in [1, 64, 65, 128, 129, 256, 257, 4095,
                 *rng.integers(1, 600, 5).tolist()]:
    config = MosaicGpuConfig().resolved(head_dim, kv_len)
    cover = next(w for w in (64, 128, 256, 1 << 30) if w >= kv_len)
    for name in ("block_kv", "block_kv_dq"):
      assert getattr(config, name) == min(cover, getattr(tuned, name)), (
          name, kv_len)
    # The other fields are the tuned ones.
    others = {f: getattr(config, f) for f in vars(config)
              if f not in ("block_kv", "block_kv_dq")}
    assert others == {f: getattr(tuned, f) for f in others}
  explicit = MosaicGpuConfig(block_kv=tuned.block_kv).resolved(head_dim, 10)
  assert explicit.block_kv == tuned.block_kv


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_feature_rules_narrow_key_tiles(head_dim):
  """A soft cap narrows the dQ key tile to at most 64 above head dim 64,
  segment ids the forward key tile to at most 128 at head dim 64; both
  turn overlap_sdp and qk_after_pv off; nothing else changes, the narrower of a feature's
  and the length rule's tile wins, and a caller's explicit tile is
  kept."""
  row = mosaic_gpu.default_config(head_dim)
  capped = mosaic_gpu.default_config(head_dim, soft_cap=True)
  assert capped.block_kv_dq == (row.block_kv_dq if head_dim == 64
                                else min(64, row.block_kv_dq))
  assert not capped.overlap_sdp and not capped.qk_after_pv
  assert dataclasses.replace(capped, block_kv_dq=row.block_kv_dq,
                             overlap_sdp=row.overlap_sdp,
                             qk_after_pv=row.qk_after_pv) == row
  packed = mosaic_gpu.default_config(head_dim, segments=True)
  assert packed.block_kv == (min(128, row.block_kv) if head_dim == 64
                             else row.block_kv)
  assert not packed.overlap_sdp and not packed.qk_after_pv
  assert dataclasses.replace(packed, block_kv=row.block_kv,
                             overlap_sdp=row.overlap_sdp,
                             qk_after_pv=row.qk_after_pv) == row
  both = MosaicGpuConfig().resolved(head_dim, 100, soft_cap=True,
                                    segments=True)
  assert both.block_kv_dq == min(capped.block_kv_dq, 128)  # 100 keys
  assert both.block_kv == min(128, packed.block_kv)
  explicit = MosaicGpuConfig(block_kv_dq=row.block_kv_dq).resolved(
      head_dim, 4096, soft_cap=True)
  assert explicit.block_kv_dq == row.block_kv_dq


def test_fused_backward_default_needs_many_keys_and_no_moving_mask():
  """At head dims 64 and 128 the fused backward is the default from 4096
  keys without a window, soft cap or segment ids, under a causal mask only
  up to 32768 keys, never at head dim 256; at head dim 64 it takes two
  dQ accumulators (four causal), 128-query dK/dV tiles and issues S and dP
  one after the other, at head dim 128 one accumulator (two causal); dQ-pass
  tiles set by the caller keep the two-pass backward at every length."""
  assert mosaic_gpu.default_config(128, 4096).fuse_dq
  assert mosaic_gpu.default_config(128, 4096).dq_slots == 1
  assert mosaic_gpu.default_config(128, 4096).block_q_dkv == 64
  assert mosaic_gpu.default_config(100, 16384).fuse_dq
  assert not mosaic_gpu.default_config(128, 4095).fuse_dq
  assert not mosaic_gpu.default_config(128).fuse_dq
  for head_dim in (40, 64):
    fused = mosaic_gpu.default_config(head_dim, 4096)
    assert fused.fuse_dq and fused.dq_slots == 2
    assert fused.block_q_dkv == 128 and not fused.overlap_sdp
    two_pass = mosaic_gpu.default_config(head_dim, 4095)
    assert not two_pass.fuse_dq and two_pass.block_q_dkv == 64
    assert two_pass.overlap_sdp
    causal = mosaic_gpu.default_config(head_dim, 16384, causal=True)
    assert causal.fuse_dq and causal.dq_slots == 4
    assert causal.block_q_dkv == 128 and not causal.overlap_sdp
    assert not mosaic_gpu.default_config(head_dim, 4095, causal=True).fuse_dq
    assert not mosaic_gpu.default_config(head_dim, 32769, causal=True).fuse_dq
    assert mosaic_gpu.default_config(head_dim, 32768, causal=True).fuse_dq
  assert MosaicGpuConfig(overlap_sdp=True).resolved(64, 16384).overlap_sdp
  assert not mosaic_gpu.default_config(256, 65536).fuse_dq
  assert not mosaic_gpu.default_config(128, 16384, window=(1024, 0)).fuse_dq
  assert not mosaic_gpu.default_config(128, 16384, window=(8191, 0)).fuse_dq
  assert not mosaic_gpu.default_config(128, 16384, window=(8192, 8192)).fuse_dq
  causal = mosaic_gpu.default_config(128, 16384, causal=True)
  assert causal.fuse_dq and causal.dq_slots == 2
  assert causal.block_q_dkv == 64 and causal.overlap_sdp
  assert MosaicGpuConfig().resolved(128, 4096, causal=True).dq_slots == 2
  assert not MosaicGpuConfig().resolved(128, 4095, causal=True).fuse_dq
  assert not MosaicGpuConfig().resolved(128, 65536, causal=True).fuse_dq
  assert mosaic_gpu.default_config(128, 65536).fuse_dq
  assert not mosaic_gpu.default_config(128, 16384, causal=True,
                                       window=(1024, 0)).fuse_dq
  assert not mosaic_gpu.default_config(128, 16384, causal=True,
                                       segments=True).fuse_dq
  assert not mosaic_gpu.default_config(128, 16384, soft_cap=True).fuse_dq
  assert not mosaic_gpu.default_config(128, 16384, segments=True).fuse_dq
  two_pass = MosaicGpuConfig(block_kv_dq=64).resolved(128, 16384)
  assert not two_pass.fuse_dq and two_pass.block_kv_dq == 64
  assert MosaicGpuConfig(dq_slots=2).resolved(128, 16384).dq_slots == 2
  assert not MosaicGpuConfig(fuse_dq=False).resolved(128, 16384).fuse_dq
  with pytest.raises(ValueError, match="dq_slots"):
    MosaicGpuConfig(dq_slots=2).resolved(128, 2048)
  with pytest.raises(ValueError, match="block_kv_dq"):
    MosaicGpuConfig(fuse_dq=True, block_kv_dq=64).resolved(128, 16384)
  # Copies of a row at another length stay valid.
  for copied in (mosaic_gpu.default_config(128),
                 mosaic_gpu.tuned_config(128, 16384)):
    assert not copied.resolved(128, 16384).fuse_dq
  assert mosaic_gpu.default_config(128, 16384).resolved(128, 1024).fuse_dq
  # The tuned table, which the tuner starts from, is the rule's input.
  assert not mosaic_gpu.tuned_config(128, 16384).fuse_dq
  assert dataclasses.replace(mosaic_gpu.tuned_config(128, 16384),
                             fuse_dq=True, dq_slots=1) == (
                                 mosaic_gpu.default_config(128, 16384))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_short_sequences_lower_with_narrow_key_tiles(head_dim):
  """Forward and backward lower to Mosaic GPU with the tiles a short key
  sequence gets (77 queries, 50 keys: 64-key tiles)."""
  batch, t, s = 2, 77, 50
  mask = masks.AttentionMask(batch=batch, q_len=t, kv_len=s, is_causal=True,
                             kv_lengths=jnp.asarray([50, 20], jnp.int32))
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.125, None),
                          config=MosaicGpuConfig().resolved(head_dim, s),
                          head_dim=head_dim)
  assert plan.config.block_kv == 64
  q = jax.ShapeDtypeStruct((batch, t, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, s, 2, head_dim), jnp.bfloat16)

  run = _forward_and_backward(mask, plan)
  text = _cuda_lowering(run, q, kv)
  assert text.count("custom_call @mosaic_gpu") == 3


def test_declines_off_hopper_and_for_unsupported_inputs():
  rng = _rng()
  q = jnp.asarray(rng.standard_normal((1, 16, 2, 64)), jnp.bfloat16)
  cases = [dict(), dict(interpret=True)]
  for kwargs in cases:
    with pytest.raises(NotImplementedError, match="mosaic_gpu"):
      jflash.dot_product_attention(q, q, q, implementation="mosaic_gpu",
                                   **kwargs)
  # With mosaic_gpu first, dispatch still lands on a backend that serves.
  out = jflash.dot_product_attention(q, q, q,
                                     implementation=("mosaic_gpu", "xla"))
  assert out.shape == q.shape


def test_classes_per_step_matches_direct_lookup():
  rng = _rng()
  batch, n, m = 2, 3, 5
  classes = jnp.asarray(rng.integers(0, 3, (batch, 2 * n, m)), jnp.int32)
  order = jnp.asarray(np.stack([np.stack([rng.permutation(m)
                                          for _ in range(n)])
                                for _ in range(batch)]), jnp.int32)
  got = np.asarray(schedule.classes_per_step(classes, order))
  c, o = np.asarray(classes), np.asarray(order)
  for b in range(batch):
    for i in range(n):
      for s in range(m):
        for w in range(2):
          assert got[b, i, s, w] == c[b, 2 * i + w, o[b, i, s]]


def test_row_statistics_match_float64():
  """The backward's per-row inputs: base-2 logsumexp (+inf where the row
  sees nothing) and ``delta = rowsum(dO * O) - dlse``, transposed to
  ``[B, N, 2, Tp]`` with zero padding, against float64 NumPy."""
  rng = _rng()
  batch, t, n, h, tp = 2, 37, 3, 64, 48
  out, d_out = (jnp.asarray(rng.standard_normal((batch, t, n, h)),
                            jnp.bfloat16) for _ in range(2))
  lse = rng.standard_normal((batch, n, tp)).astype(np.float32)
  lse[0, 1, 3] = lse[1, 2, 36] = -np.inf
  d_lse = rng.standard_normal((batch, t, n)).astype(np.float32)
  got = np.asarray(jax.jit(mosaic_gpu.attention._row_statistics, static_argnums=4)(
      out, d_out, jnp.asarray(lse), jnp.asarray(d_lse), tp))
  assert got.shape == (batch, n, 2, tp)
  lse2 = np.where(np.isneginf(lse), np.inf, lse * np.log2(np.e))
  np.testing.assert_allclose(got[:, :, 0], lse2, rtol=1e-6)
  o64, do64 = (np.asarray(x, np.float64) for x in (out, d_out))
  delta = (np.einsum("btnh,btnh->bnt", do64, o64)
           - np.swapaxes(d_lse, 1, 2))
  np.testing.assert_allclose(got[:, :, 1, :t], delta, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(got[:, :, 1, t:], 0.0)


def test_schedule_covers_every_visible_pair():
  """The forward's CTA schedule visits every tile holding a visible pair,
  and a tile a consumer treats as FULL has every pair visible."""
  rng = _rng()
  batch, t, s = 2, 300, 260
  mask = masks.AttentionMask(
      batch=batch, q_len=t, kv_len=s, is_causal=True, window=(70, 0),
      kv_lengths=jnp.asarray([260, 190], jnp.int32),
      q_segment_ids=jnp.asarray(random_segments(rng, batch, t)),
      kv_segment_ids=jnp.asarray(random_segments(rng, batch, s)))
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.1, None),
                          config=MosaicGpuConfig().resolved(128), head_dim=128)
  config = plan.config
  pads = mosaic_gpu.attention._padding(mask, plan)
  order, count, classes, block_order = schedule.rows_metadata(
      mask, config.block_q, config.block_kv, pads)
  # CTAs take every row block of every batch row exactly once.
  np.testing.assert_array_equal(np.sort(np.asarray(block_order)),
                                np.arange(count.size))
  visible = np.asarray(mask.visibility())[:, 0]
  bq, bk = config.block_q, config.block_kv
  order, count, classes = map(np.asarray, (order, count, classes))
  for b in range(batch):
    for i in range(order.shape[1]):
      visited = set(order[b, i, :count[b, i]].tolist())
      for w in range(2):
        rows = visible[b, (2 * i + w) * bq:(2 * i + w + 1) * bq]
        for kv_tile in range(-(-s // bk)):
          pairs = rows[:, kv_tile * bk:(kv_tile + 1) * bk]
          if pairs.any():
            assert kv_tile in visited
      for step in range(count[b, i]):
        kv_tile = order[b, i, step]
        for w in range(2):
          if classes[b, i, step, w] == tiles.FULL:
            rows = slice((2 * i + w) * bq, (2 * i + w + 1) * bq)
            tile = visible[b, rows, kv_tile * bk:(kv_tile + 1) * bk]
            assert tile.shape == (bq, bk) and tile.all()


@pytest.mark.parametrize("make,keys_per_cta", [("keys_metadata", 2),
                                               ("shared_keys_metadata", 1),
                                               ("fused_keys_metadata", 2)])
def test_key_schedules_cover_every_visible_pair(make, keys_per_cta):
  """The dK/dV CTA schedules (each consumer with its own keys, both on the
  same keys, or the fused backward's decreasing order) visit every query
  tile holding a visible pair, and a tile a consumer treats as FULL has
  every pair visible."""
  rng = _rng()
  batch, t, s = 2, 300, 333
  mask = masks.AttentionMask(
      batch=batch, q_len=t, kv_len=s, is_causal=True, window=(90, 0),
      q_lengths=jnp.asarray([300, 170], jnp.int32),
      q_segment_ids=jnp.asarray(random_segments(rng, batch, t)),
      kv_segment_ids=jnp.asarray(random_segments(rng, batch, s)))
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.1, None),
                          config=MosaicGpuConfig().resolved(256), head_dim=256)
  bq, bk = plan.config.block_q_dkv, plan.config.block_kv_dkv
  pads = mosaic_gpu.attention._padding(mask, plan)
  metadata = getattr(schedule, make)(mask, bq, bk, pads)
  order, count, classes = map(np.asarray, metadata[:3])
  assert order.shape[1] * keys_per_cta * bk == pads.kv_pad
  if make != "fused_keys_metadata":  # its CTAs go in key-block order
    # CTAs take every key block of every batch row exactly once.
    np.testing.assert_array_equal(np.sort(np.asarray(metadata[3])),
                                  np.arange(count.size))
  visible = np.asarray(mask.visibility())[:, 0]
  for b in range(batch):
    for j in range(order.shape[1]):
      visited = set(order[b, j, :count[b, j]].tolist())
      for w in range(2):
        first = (j * keys_per_cta + (w if keys_per_cta == 2 else 0)) * bk
        keys = visible[b, :, first:first + bk]
        for q_tile in range(-(-t // bq)):
          if keys[q_tile * bq:(q_tile + 1) * bq].any():
            assert q_tile in visited
        for step in range(count[b, j]):
          q_tile = order[b, j, step]
          if classes[b, j, step, w] == tiles.FULL:
            tile = keys[q_tile * bq:(q_tile + 1) * bq]
            assert tile.shape == (bq, bk) and tile.all()


@pytest.mark.parametrize("variant", [{}, dict(qk_after_pv=True),
                                     dict(fuse_dq=True),
                                     dict(fuse_dq=True, dq_slots=1),
                                     dict(overlap_sdp=True),
                                     dict(overlap_sdp=False),
                                     dict(fuse_dq=True, overlap_sdp=True)],
                         ids=["default", "qk_after_pv",
                              "fuse_dq",
                              "fuse_dq_one_slot", "overlap_sdp",
                              "plain_sdp", "fuse_dq_overlap_sdp"])
@pytest.mark.parametrize("head_dim,features", [
    (128, dict(is_causal=True, lengths=True)),
    # Segment ids at head dim 128: the fused backward's shared memory then
    # has room for one dQ staging buffer, not two.
    (128, dict(segments=True, soft_cap=1.5)),
    (64, dict(segments=True, window=(33, 5), soft_cap=2.0)),
    (256, dict(lengths=True)),
    (256, dict(segments=True, is_causal=True, soft_cap=3.0)),
])
def test_kernels_lower_to_mosaic_gpu(head_dim, features, variant):
  """Forward and backward kernels, in each configuration variant, trace and
  lower for a CUDA target on the CPU (shape, layout and shared-memory
  errors surface here)."""
  if (variant.get("fuse_dq") or variant.get("overlap_sdp")) and head_dim > 128:
    pytest.skip("the variant serves head dims up to 128")
  rng = _rng()
  batch, t, s, n, k = 2, 200, 330, 4, 2
  q = jax.ShapeDtypeStruct((batch, t, n, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, s, k, head_dim), jnp.bfloat16)
  rules = dict(is_causal=features.get("is_causal", False),
               window=features.get("window"))
  if features.get("lengths"):
    rules.update(q_lengths=jnp.asarray([t, 10], jnp.int32),
                 kv_lengths=jnp.asarray([200, s], jnp.int32))
  if features.get("segments"):
    rules.update(
        q_segment_ids=jnp.asarray(random_segments(rng, batch, t)),
        kv_segment_ids=jnp.asarray(random_segments(rng, batch, s)))
  mask = masks.AttentionMask(batch=batch, q_len=t, kv_len=s, **rules)
  plan = mosaic_gpu.attention._Plan(
      spec=MaskSpec.of(mask),
      logits=LogitTransform(0.125, features.get("soft_cap")),
      config=MosaicGpuConfig(**variant).resolved(head_dim),
      head_dim=head_dim)

  run = _forward_and_backward(mask, plan)
  text = _cuda_lowering(run, q, kv)
  # Forward, then dQ and dK/dV, or the one fused backward kernel.
  kernels = text.count("custom_call @mosaic_gpu")
  assert kernels == (2 if variant.get("fuse_dq") else 3)
  backward_kernels = (("jflash_fused_backward",) if variant.get("fuse_dq")
                      else ("jflash_dq", "jflash_dkv"))
  for name in ("jflash_forward",) + backward_kernels:
    assert f"{name}_mosaic_gpu" in text, name
  # Only backward passes with overlap_sdp (set or by default) wait for all
  # but the newest product.
  jaxpr = str(jax.make_jaxpr(run)(q, kv, kv))
  assert ("wait_n=1" in jaxpr) == plan.config.overlap_sdp
  if "overlap_sdp" in variant:
    assert plan.config.overlap_sdp == variant["overlap_sdp"]


@pytest.mark.parametrize("rules", [dict(is_causal=True),
                                   dict(window=(100, 30)),
                                   dict(is_causal=True, window=(257, 0)),
                                   dict()])
@pytest.mark.parametrize("make", ["rows_metadata", "keys_metadata",
                                  "shared_keys_metadata"])
def test_shape_only_schedules_become_constants(rules, make):
  """Without lengths or segment ids the schedule depends on shapes alone;
  it is then built while tracing (constants in the graph) and must equal
  the one built per call."""
  make = getattr(schedule, make)
  mask = masks.AttentionMask(batch=3, q_len=777, kv_len=1000, **rules)
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.1, None),
                          config=MosaicGpuConfig().resolved(128), head_dim=128)
  pads = mosaic_gpu.attention._padding(mask, plan)
  c = plan.config
  traced = jax.jit(lambda: make(mask, c.block_q, c.block_kv, pads))()
  static_jaxpr = jax.make_jaxpr(lambda: mosaic_gpu.attention._metadata(
      make, mask, c.block_q, c.block_kv, pads))()
  # Nothing is computed at run time: the outputs are literals/constants.
  assert not static_jaxpr.eqns
  static = jax.jit(lambda: mosaic_gpu.attention._metadata(
      make, mask, c.block_q, c.block_kv, pads))()
  for got, want in zip(static, traced):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("fuse_dq", [False, True])
def test_shape_only_metadata_compiles_once_per_schedule(fuse_dq,
                                                        monkeypatch):
  """Tracing forward and backward with a mask of shapes alone (causal and
  a window) builds each tile schedule with one XLA compilation, not one
  per array operation of the schedule (which took seconds per shape)."""
  batch, t, s = 2, 1000, 1500
  mask = masks.AttentionMask(batch=batch, q_len=t, kv_len=s, is_causal=True,
                             window=(300, 0))
  config = MosaicGpuConfig(fuse_dq=fuse_dq).resolved(128)
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.125, None), config=config,
                          head_dim=128)
  q = jax.ShapeDtypeStruct((batch, t, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, s, 2, 128), jnp.bfloat16)
  schedules, compiles = [], []
  built = mosaic_gpu.attention._metadata
  monkeypatch.setattr(mosaic_gpu.attention, "_metadata",
                      lambda *a: schedules.append(a) or built(*a))

  def count(event, *_, **__):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    jax.jit(_forward_and_backward(mask, plan)).trace(q, kv, kv)
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert len(schedules) == (2 if fuse_dq else 3)
  assert 1 <= len(compiles) <= len(schedules)


@pytest.mark.parametrize("width", [1, 3, 64, 80, 128, 256])
def test_row_statistics_sum_matches_a_float64_sum(width):
  """delta's fixed-order row sum agrees with a float64 sum on random rows
  of any width (padded to a power of two with zeros), to float32 rounding."""
  x = jax.random.normal(jax.random.key(width), (3, 5, width), jnp.float32)
  got = mosaic_gpu.attention._fixed_order_row_sum(x)
  want = np.asarray(x, np.float64).sum(-1)
  assert got.shape == (3, 5) and got.dtype == jnp.float32
  scale = np.abs(np.asarray(x, np.float64)).sum(-1)
  assert np.all(np.abs(np.asarray(got, np.float64) - want)
                <= 4 * width * np.finfo(np.float32).eps * scale + 1e-30)


@pytest.mark.parametrize("width", [1, 3, 32, 33, 64, 80, 128, 256])
def test_row_statistics_sum_adds_in_the_halving_order(width):
  """The row sum's additions are exactly those of halving the row (padded
  to a power of two with zeros): element i plus element i + n/2 until one
  is left, in float32, whatever stages it is computed in; a NumPy loop of
  those additions gives the same bits."""
  x = jax.random.normal(jax.random.key(100 + width), (4, 7, width),
                        jnp.float32)
  got = np.asarray(jax.jit(mosaic_gpu.attention._fixed_order_row_sum)(x))
  want = np.asarray(x)
  size = 1
  while size < width:
    size *= 2
  want = np.concatenate(
      [want, np.zeros(want.shape[:-1] + (size - width,), np.float32)], -1)
  while want.shape[-1] > 1:
    half = want.shape[-1] // 2
    want = (want[..., :half] + want[..., half:]).astype(np.float32)
  np.testing.assert_array_equal(got, want[..., 0])


@pytest.mark.parametrize("num_heads,batch,blocks", [(16, 1, 8), (3, 2, 5),
                                                    (1, 1, 1), (64, 4, 16)])
def test_persistent_items_deal_every_item_once(num_heads, batch, blocks):
  """Every (head, batch row, block) goes to exactly one CTA of a persistent
  kernel, as the block order places it, and no CTA gets more than one
  item above another."""
  rng = _rng()
  block_order = jnp.asarray(rng.permutation(batch * blocks), jnp.int32)
  items = common.PersistentItems.over(num_heads, batch, blocks)
  assert items.num_ctas == min(num_heads * batch * blocks, common.num_sms())
  seen, per_cta = [], []
  for cta in range(items.num_ctas):
    mine = []
    for n in range(items.passes):
      k, (head, b, block) = items.item_at(block_order, jnp.int32(cta),
                                          jnp.int32(n))
      if int(k) < items.num_items:
        flat = int(block_order[int(k) // num_heads])
        assert (int(head), int(b), int(block)) == (
            int(k) % num_heads, flat // blocks, flat % blocks)
        mine.append(int(k))
    seen += mine
    per_cta.append(len(mine))
  assert sorted(seen) == list(range(num_heads * batch * blocks))
  assert max(per_cta) - min(per_cta) <= 1


@pytest.mark.parametrize("head_dim,fuse_dq", [(64, False), (128, True),
                                              (192, False)])
def test_sequences_are_padded_only_to_row_groups_of_eight(head_dim, fuse_dq):
  """The kernels tile the padded extents but get the arrays at their own
  lengths (rounded up to 8 rows): the tail tiles come through TMA's zero
  fill, so no copy pads Q, K, V or dO to a whole tile."""
  rng = _rng()
  t, s = (int(x) for x in rng.integers(300, 700, size=2))
  mask = masks.AttentionMask(batch=2, q_len=t, kv_len=s, is_causal=True)
  config = MosaicGpuConfig(fuse_dq=fuse_dq).resolved(head_dim, s)
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.1, None), config=config,
                          head_dim=head_dim)
  pads = mosaic_gpu.attention._padding(mask, plan)
  q_rows, kv_rows = -(-t // 8) * 8, -(-s // 8) * 8
  assert (pads.q_rows, pads.kv_rows) == (q_rows, kv_rows)
  assert pads.q_pad >= q_rows and pads.kv_pad >= kv_rows
  assert pads.q_pad % config.block_q_dkv == 0
  assert pads.kv_pad % (2 * config.block_kv_dkv) == 0
  q = jax.ShapeDtypeStruct((2, t, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, s, 2, head_dim), jnp.bfloat16)
  text = _cuda_lowering(_forward_and_backward(mask, plan), q, kv)
  hp = pads.head_pad
  calls = [line for line in text.splitlines()
           if "custom_call @mosaic_gpu" in line]
  assert len(calls) == (2 if fuse_dq else 3)
  operands = " ".join(calls)
  assert f"tensor<2x{q_rows}x4x{hp}xbf16>" in operands
  assert f"tensor<2x{kv_rows}x2x{hp}xbf16>" in operands
  for extent, heads in ((pads.q_pad, 4), (pads.kv_pad, 2)):
    if extent not in (q_rows, kv_rows):
      assert f"tensor<2x{extent}x{heads}x{hp}xbf16>" not in operands


def test_sequences_shorter_than_a_tile_are_padded_to_it():
  mask = masks.AttentionMask(batch=1, q_len=40, kv_len=30, is_causal=False)
  config = MosaicGpuConfig().resolved(128, 30)
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.1, None), config=config,
                          head_dim=128)
  pads = mosaic_gpu.attention._padding(mask, plan)
  assert (pads.q_rows, pads.kv_rows) == (pads.q_pad, pads.kv_pad)
  assert pads.q_pad >= 64 and pads.kv_pad >= 64


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("features,t,s", [
    (dict(is_causal=True, lengths=True), 200, 330),
    (dict(window=(33, 5), segments=True, soft_cap=2.0), 200, 330),
    (dict(), 4096, 4096),  # the fused backward at head dims 64 and 128
    (dict(is_causal=True), 4096, 4096),
])
def test_kernels_lower_under_x64(head_dim, features, t, s):
  """With ``jax_enable_x64`` on, Python ints and Python-bounded loop
  indices are 64-bit: forward and gradient through
  ``jflash.dot_product_attention(implementation="mosaic_gpu")`` (GQA, each
  mask feature, soft cap) still trace and lower for CUDA, with every
  kernel's index math in int32."""
  rng = _rng()
  batch, n, k = 2, 4, 2
  q = jax.ShapeDtypeStruct((batch, t, n, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, s, k, head_dim), jnp.bfloat16)
  extra = dict(is_causal=features.get("is_causal", False),
               local_window_size=features.get("window"),
               logits_soft_cap=features.get("soft_cap"))
  if features.get("lengths"):
    extra.update(query_seq_lengths=np.asarray([t, 10]),
                 key_value_seq_lengths=np.asarray([200, s]))
  if features.get("segments"):
    extra.update(segment_ids=(random_segments(rng, batch, t),
                              random_segments(rng, batch, s)))

  def loss(q, k, v):
    out = jflash.dot_product_attention(q, k, v, implementation="mosaic_gpu",
                                       **extra)
    return jnp.sum(out.astype(jnp.float32))

  with jax.enable_x64(True), lowering_for_hopper():
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  fused = mosaic_gpu.default_config(
      head_dim, s, causal=extra["is_causal"], soft_cap="soft_cap" in features,
      segments="segments" in features, window=features.get("window")).fuse_dq
  assert text.count("custom_call @mosaic_gpu") == (2 if fused else 3)


def test_heaviest_first_starts_the_longest_blocks_first():
  rng = _rng()
  batch, t, s = 3, 70, 90
  mask = masks.AttentionMask(
      batch=batch, q_len=t, kv_len=s, is_causal=True,
      kv_lengths=jnp.asarray(rng.integers(1, s + 1, batch), jnp.int32),
      q_segment_ids=jnp.asarray(random_segments(rng, batch, t)),
      kv_segment_ids=jnp.asarray(random_segments(rng, batch, s)))
  sched = tiles.tile_schedule(mask, 8, 16)
  for count in (np.asarray(sched.kv_count), np.asarray(sched.q_count),
                rng.integers(0, 4, (2, 9))):  # many ties
    order = np.asarray(schedule.heaviest_first(jnp.asarray(count)))
    flat = count.reshape(-1)
    # Every block exactly once; counts non-increasing; ties in index order.
    np.testing.assert_array_equal(np.sort(order), np.arange(flat.size))
    np.testing.assert_array_equal(
        order, np.lexsort((np.arange(flat.size), -flat)))
  # Causal with no other rule: the last query block has the most tiles.
  causal = tiles.tile_schedule(
      masks.AttentionMask(batch=2, q_len=64, kv_len=64, is_causal=True), 16,
      16)
  np.testing.assert_array_equal(
      np.asarray(schedule.heaviest_first(causal.kv_count)),
      [3, 7, 2, 6, 1, 5, 0, 4])


def test_visited_in_reverse_and_earlier_visitors():
  rng = _rng()
  visits = rng.random((2, 5, 4)) < 0.6  # [B, nq, nk]
  mask = masks.AttentionMask(
      batch=2, q_len=40, kv_len=40, is_causal=True,
      window=(int(rng.integers(0, 20)), int(rng.integers(0, 20))))
  sched = tiles.tile_schedule(mask, 8, 10)
  order, count = np.asarray(sched.q_order), np.asarray(sched.q_count)
  got = np.asarray(schedule.visited_in_reverse(jnp.asarray(order),
                                               jnp.asarray(count)))
  for idx in np.ndindex(count.shape):
    n = count[idx]
    np.testing.assert_array_equal(
        got[idx], np.concatenate([order[idx][:n][::-1], order[idx][n:]]))
  # Ranks: for key block j at a step visiting query tile i, the number of
  # key blocks before j that visit i.
  steps = rng.integers(0, 5, (2, 4, 6))
  ranks = np.asarray(schedule.earlier_visitors(jnp.asarray(visits),
                                               jnp.asarray(steps)))
  for b, j, s in np.ndindex(steps.shape):
    assert ranks[b, j, s] == visits[b, steps[b, j, s], :j].sum()


@pytest.mark.parametrize("slots", [1, 2, 3, 5])
def test_earlier_visitors_and_visited_per_slot(slots):
  rng = _rng()
  nq, nk = int(rng.integers(1, 7)), int(rng.integers(1, 9))
  visits = rng.random((2, nq, nk)) < 0.6  # [B, nq, nk]
  steps = rng.integers(0, nq, (2, nk, 5))
  ranks = np.asarray(schedule.earlier_visitors(
      jnp.asarray(visits), jnp.asarray(steps), slots=slots))
  for b, j, s in np.ndindex(steps.shape):
    same_sum = [i for i in range(j) if i % slots == j % slots]
    assert ranks[b, j, s] == visits[b, steps[b, j, s], same_sum].sum()
  per_slot = np.asarray(schedule.visited_per_slot(jnp.asarray(visits),
                                                  slots))
  assert per_slot.shape == (slots, 2, nq)
  for r, b, i in np.ndindex(per_slot.shape):
    assert per_slot[r, b, i] == visits[b, i, r::slots].any()
  with pytest.raises(ValueError, match="slots"):
    schedule.earlier_visitors(jnp.asarray(visits), jnp.asarray(steps),
                              slots=0)


def test_lowering_for_hopper_is_scoped():
  """Off a Hopper host the backend declines; inside
  ``lowering_for_hopper`` the same call lowers for CUDA with Mosaic GPU
  kernels; after the context the decline is back."""
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

  def run(q):
    return jflash.dot_product_attention(q, q, q, implementation="mosaic_gpu")

  def lower():
    return jax.jit(run).trace(q).lower(lowering_platforms=("cuda",)).as_text()

  with pytest.raises(NotImplementedError, match="Hopper"):
    lower()
  with lowering_for_hopper():
    assert "custom_call @mosaic_gpu" in lower()
  with pytest.raises(NotImplementedError, match="Hopper"):
    lower()


# ------------------------------------------------------------------ offsets
def _offset_mask(rng, batch: int, t: int, s: int, *, q_offset: int,
                 kv_offset: int, is_causal=False, window=None,
                 lengths=False, segments=False) -> masks.AttentionMask:
  """One block of longer sequences: local queries ``[0, t)`` at global
  ``q_offset``, keys ``[0, s)`` at global ``kv_offset``; lengths are
  global, segment ids local."""
  rules = {}
  if lengths:
    # Global lengths that end inside, before and after each block.
    rules.update(
        q_lengths=jnp.asarray(rng.integers(0, q_offset + t + 40, batch),
                              jnp.int32),
        kv_lengths=jnp.asarray(rng.integers(0, kv_offset + s + 40, batch),
                               jnp.int32))
  if segments:
    rules.update(
        q_segment_ids=jnp.asarray(random_segments(rng, batch, t)),
        kv_segment_ids=jnp.asarray(random_segments(rng, batch, s)))
  return masks.AttentionMask(
      batch=batch, q_len=t, kv_len=s, is_causal=is_causal, window=window,
      q_offset=jnp.asarray(q_offset, jnp.int32),
      kv_offset=jnp.asarray(kv_offset, jnp.int32), **rules)


# Query block ahead of, behind, and overlapping the key block, and (window
# (50, 20)) a band that misses the block entirely.
_OFFSET_PLACES = [(300, 0), (0, 300), (90, 40), (1000, 0)]


@pytest.mark.parametrize("q_offset,kv_offset", _OFFSET_PLACES)
@pytest.mark.parametrize("rules", [
    dict(is_causal=True, lengths=True),
    dict(window=(50, 20), segments=True),
    # Sides wider than the block: they reach keys of other blocks, so a
    # kernel must not clamp them to the block's lengths.
    dict(is_causal=True, window=(400, 0)),
    dict(window=(20, 500), lengths=True, segments=True),
])
def test_offset_tile_visibility_matches_the_mask(q_offset, kv_offset, rules):
  """The kernels' element mask (``MaskSpec.tile_visibility`` with the
  offsets the kernels read) agrees with the mask's own visibility for
  every batch row, and refuses to run without the offsets it was built
  for."""
  rng = _rng()
  batch, t, s = 2, 70, 90
  mask = _offset_mask(rng, batch, t, s, q_offset=q_offset,
                      kv_offset=kv_offset, **rules)
  spec = MaskSpec.of(mask)
  assert spec.has_offsets
  offsets = mosaic_gpu.attention._mask_inputs(
      mask, mosaic_gpu.attention._Padded(t, s, t, s, 64))["offsets"]
  np.testing.assert_array_equal(np.asarray(offsets), [q_offset, kv_offset])
  q_ids = jnp.arange(t, dtype=jnp.int32)[:, None]
  kv_ids = jnp.arange(s, dtype=jnp.int32)[None, :]
  want = np.asarray(mask.visibility())[:, 0]
  for b in range(batch):
    def row(x):
      return None if x is None else x[b]
    q_seg = row(mask.q_segment_ids)
    kv_seg = row(mask.kv_segment_ids)
    got = spec.tile_visibility(
        q_ids, kv_ids, row(mask.q_lengths), row(mask.kv_lengths),
        None if q_seg is None else q_seg[:, None],
        None if kv_seg is None else kv_seg[None, :],
        offsets[0], offsets[1])
    np.testing.assert_array_equal(np.asarray(got), want[b])
  with pytest.raises(ValueError, match="has_offsets"):
    spec.tile_visibility(q_ids, kv_ids, None, None, None, None)


def test_offsets_reach_the_kernels_only_with_offsets():
  """A mask without offsets gives the kernels no offsets input (their
  modules stay as before); one with offsets (either given, the other 0)
  gives ``[q_offset, kv_offset]``."""
  plain = masks.AttentionMask(batch=1, q_len=8, kv_len=8, is_causal=True)
  pads = mosaic_gpu.attention._Padded(128, 128, 128, 128, 64)
  assert mosaic_gpu.attention._mask_inputs(plain, pads)["offsets"] is None
  assert not MaskSpec.of(plain).has_offsets
  only_kv = dataclasses.replace(plain, kv_offset=jnp.asarray(5, jnp.int32))
  np.testing.assert_array_equal(
      np.asarray(mosaic_gpu.attention._mask_inputs(only_kv, pads)["offsets"]), [0, 5])


@pytest.mark.parametrize("q_offset,kv_offset", [(260, 0), (0, 200),
                                                (100, 37)])
def test_offset_schedules_cover_every_visible_pair(q_offset, kv_offset):
  """With offsets, the forward's and the dK/dV pass's schedules (built by
  jflash.masks from the traced offsets) visit every tile holding a visible
  pair and call FULL only tiles whose pairs are all visible."""
  rng = _rng()
  batch, t, s = 2, 300, 333
  mask = _offset_mask(rng, batch, t, s, q_offset=q_offset,
                      kv_offset=kv_offset, is_causal=True, window=(150, 0),
                      lengths=True, segments=True)
  plan = mosaic_gpu.attention._Plan(spec=MaskSpec.of(mask),
                          logits=LogitTransform(0.1, None),
                          config=MosaicGpuConfig().resolved(128), head_dim=128)
  c = plan.config
  pads = mosaic_gpu.attention._padding(mask, plan)
  visible = np.asarray(mask.visibility())[:, 0]
  # Rows: the forward, per CTA of 2 * block_q queries.
  order, count, classes, _ = map(np.asarray, jax.jit(
      schedule.rows_metadata, static_argnums=(1, 2, 3))(
          mask, c.block_q, c.block_kv, pads))
  bq, bk = c.block_q, c.block_kv
  for b in range(batch):
    for i in range(order.shape[1]):
      visited = order[b, i, :count[b, i]].tolist()
      for w in range(2):
        rows = visible[b, (2 * i + w) * bq:(2 * i + w + 1) * bq]
        for j in range(-(-s // bk)):
          tile = rows[:, j * bk:(j + 1) * bk]
          assert j in visited or not tile.any(), (b, i, j)
          if j in visited:
            step_class = classes[b, i, visited.index(j), w]
            assert step_class != tiles.FULL or (
                tile.shape == (bq, bk) and tile.all()), (b, i, j)
  # Keys: the dK/dV pass, per CTA of 2 * block_kv keys.
  bq, bk = c.block_q_dkv, c.block_kv_dkv
  order, count, classes, _ = map(np.asarray, jax.jit(
      schedule.keys_metadata, static_argnums=(1, 2, 3))(mask, bq, bk, pads))
  for b in range(batch):
    for j in range(order.shape[1]):
      visited = order[b, j, :count[b, j]].tolist()
      for w in range(2):
        keys = visible[b, :, (2 * j + w) * bk:(2 * j + w + 1) * bk]
        for i in range(-(-t // bq)):
          tile = keys[i * bq:(i + 1) * bq]
          assert i in visited or not tile.any(), (b, j, i)
          if i in visited:
            step_class = classes[b, j, visited.index(i), w]
            assert step_class != tiles.FULL or (
                tile.shape == (bq, bk) and tile.all()), (b, j, i)


def _offset_block_run(mask_rules: dict, backend, *, soft_cap=None):
  """``run(q, k, v, q_offset, kv_offset)``: the block forward, the block
  backward on its result, and ``jax.grad`` through the backend's
  ``__call__``, for one block whose offsets are traced arguments."""
  from jflash.core.call import AttentionCall

  def run(q, k, v, q_offset, kv_offset):
    batch, t, s = q.shape[0], q.shape[1], k.shape[1]
    mask = masks.AttentionMask(batch=batch, q_len=t, kv_len=s,
                               q_offset=q_offset, kv_offset=kv_offset,
                               **mask_rules)

    def call(q, k, v):
      return AttentionCall(q, k, v, None, mask, 0.125, soft_cap,
                           returns_residual=True)
    out, lse = backend.forward(call(q, k, v))
    d_out = out.astype(q.dtype)
    grads = backend.backward(call(q, k, v), d_out, lse, d_out,
                             jnp.zeros_like(lse))

    def loss(q, k, v):
      o, l = backend(call(q, k, v))
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(
          jnp.where(jnp.isneginf(l), 0.0, l))
    return out, lse, grads, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  return run


@pytest.mark.parametrize("head_dim,rules,x64,config", [
    (64, dict(is_causal=True), False, {}),
    (64, dict(window=(100, 30)), True, {}),
    (128, dict(is_causal=True, window=(700, 0), segments=True), False, {}),
    (256, dict(lengths=True, is_causal=True), True, {}),
    (128, dict(is_causal=True, lengths=True), True, dict(fuse_dq=True)),
    (64, dict(segments=True, soft_cap=2.0), False, dict(fuse_dq=True)),
])
def test_offset_calls_lower_to_mosaic_gpu(head_dim, rules, x64, config):
  """Block forward, block backward and the differentiable call of a mask
  with traced offsets (GQA, each mask feature, the two-pass and the fused
  backward) trace and lower for CUDA on the CPU, under ``jax_enable_x64``
  too, every kernel receiving the offsets."""
  rng = _rng()
  batch, t, s, n, k = 2, 200, 330, 4, 2
  mask_rules = dict(is_causal=rules.get("is_causal", False),
                    window=rules.get("window"))
  if rules.get("lengths"):
    mask_rules.update(q_lengths=jnp.asarray([700, 10], jnp.int32),
                      kv_lengths=jnp.asarray([450, 900], jnp.int32))
  if rules.get("segments"):
    mask_rules.update(
        q_segment_ids=jnp.asarray(random_segments(rng, batch, t)),
        kv_segment_ids=jnp.asarray(random_segments(rng, batch, s)))
  backend = mosaic_gpu.MosaicGpuBackend(MosaicGpuConfig(**config))
  run = _offset_block_run(mask_rules, backend, soft_cap=rules.get("soft_cap"))
  q = jax.ShapeDtypeStruct((batch, t, n, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, s, k, head_dim), jnp.bfloat16)
  offset = jax.ShapeDtypeStruct((), jnp.int32)
  with jax.enable_x64(x64), lowering_for_hopper():
    text = jax.jit(run).trace(q, kv, kv, offset, offset).lower(
        lowering_platforms=("cuda",)).as_text()
  # Per use (block forward and backward, call forward and backward): the
  # forward, then dQ and dK/dV or the one fused backward.
  per_backward = 1 if config.get("fuse_dq") else 2
  assert text.count("custom_call @mosaic_gpu") == 2 * (1 + per_backward)


def test_offset_masks_keep_the_default_order_where_cudnn_declines():
  """A causal block with offsets is its own kind in the measured table:
  the H100 entry that puts cuDNN first for causal training at this size
  does not apply, the default order stands, and its cuDNN declines the
  call so that mosaic_gpu comes next."""
  from jflash.backends import cudnn
  from jflash.core import gpu_table
  from jflash.core.call import AttentionCall
  q = jnp.zeros((1, 16384, 2, 128), jnp.bfloat16)
  mask = masks.AttentionMask(batch=1, q_len=16384, kv_len=16384,
                             is_causal=True)
  plain = AttentionCall(q, q, q, None, mask, 0.1, None)
  entry = gpu_table.lookup("H100", plain)
  assert entry is not None and entry.training == "cudnn"
  block = dataclasses.replace(plain, mask=dataclasses.replace(
      mask, q_offset=jnp.asarray(16384, jnp.int32),
      kv_offset=jnp.asarray(0, jnp.int32)))
  assert gpu_table.mask_kind(block) == "offsets"
  assert gpu_table.lookup("H100", block) is None
  order = jflash.default_order("cuda")
  assert order.index("cudnn") < order.index("mosaic_gpu")
  with pytest.raises(NotImplementedError, match="offsets"):
    cudnn.CudnnBackend()(dataclasses.replace(block, platform="cuda"))
