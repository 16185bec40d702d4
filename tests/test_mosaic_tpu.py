"""The ``mosaic_tpu`` kernels in Pallas's interpret mode on the CPU: the
shared conformance suite, the tile schedule they walk, their configuration,
when they decline, and ``jax_enable_x64``, extreme windows and segment ids,
and empty axes.

Blocks of 16 x 32 (legal in interpret mode only) make the suite's small
shapes span several tiles in both directions.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import masks, reference
from jflash import tiles as tile_rules
from jax.experimental import pallas as pl

from jflash.core.call import AttentionCall
from jflash.backends.mosaic_tpu import MosaicTpuBackend, MosaicTpuConfig
from jflash.backends.mosaic_tpu import common, config, ops
from jflash.backends.mosaic_tpu.config import GENERATIONS
from tests import conformance
from tests._support import (Case, fresh_rng, grads_of, lse_err,
                            random_normal, random_qkv, random_segments,
                            rel_err)

SMALL = MosaicTpuBackend(MosaicTpuConfig(block_q=16, block_kv=32))


class TestMosaicTpuInterpret(conformance.AttentionConformance):
  implementation = SMALL
  interpret = True
  supports_bias = False
  supports_dense_mask = False
  dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)

  # Bias broadcasting is declined as a whole (test_unsupported_features_
  # decline covers it).
  test_bias_broadcasting = None


def _call(rng, *, b=2, t=100, s=100, n=4, k=2, h=32, dtype=jnp.float32,
          **kwargs):
  q, key, value = random_qkv(rng, b=b, t=t, s=s, n=n, k=k, h=h, dtype=dtype)
  case = Case(q, key, value, kwargs=kwargs)
  call, _ = case.canonical(q, key, value, None)
  return dataclasses.replace(call, interpret=True), case


# ------------------------------------------------------------- sparsity
def _nonempty_tiles(visible: np.ndarray, bq: int, bk: int) -> np.ndarray:
  """``[B, nq, nk]``: tiles holding a visible pair (brute force)."""
  b, t, s = visible.shape
  nq, nk = -(-t // bq), -(-s // bk)
  padded = np.zeros((b, nq * bq, nk * bk), bool)
  padded[:, :t, :s] = visible
  return padded.reshape(b, nq, bq, nk, bk).any(axis=(2, 4))


def _computed_tiles(monkeypatch, call) -> dict[str, np.ndarray]:
  """How many tiles each kernel computes, reported from inside the
  kernels while they run: ``common.when_visited``, through which every
  kernel computes a tile, is wrapped with a host callback that records the
  grid indices.  ``{"forward": [B, N, nq], "dq": [B, N, nq],
  "dkv": [B, K, nk]}`` (``dkv`` summed over each key/value head's query
  heads)."""
  calls = []  # grid indices of each computed tile
  original = common.when_visited

  def grid_indices():
    ids = []
    for axis in range(5):
      try:
        ids.append(pl.program_id(axis))
      except ValueError:  # past the kernel's grid
        break
    return ids

  def counting_when_visited(count, j, cls, step):
    ids = grid_indices()  # read outside the conditional tile step

    def counted_step(masked):
      step(masked)
      jax.debug.callback(lambda *ids: calls.append(tuple(map(int, ids))),
                         *ids)
    original(count, j, cls, counted_step)

  monkeypatch.setattr(common, "when_visited", counting_when_visited)
  plan = SMALL.plan(call)
  q, k, v = call.query, call.key, call.value
  out, vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, call.mask, None, plan),
                     q, k, v)
  jax.block_until_ready(out)
  jax.effects_barrier()
  forward_calls = list(calls)
  calls.clear()
  jax.block_until_ready(vjp((jnp.ones_like(out[0]), jnp.zeros_like(out[1]))))
  jax.effects_barrier()
  b, heads, kv_heads = q.shape[0], q.shape[2], k.shape[2]

  def count(records, shape):
    counts = np.zeros(shape, np.int64)
    for ids in records:
      counts[ids[:3]] += 1
    return counts
  # Forward and dQ have 4 grid axes, dK/dV 5.
  return {
      "forward": count(forward_calls, (b, heads, plan.num_q)),
      "dq": count([c for c in calls if len(c) == 4], (b, heads, plan.num_q)),
      "dkv": count([c for c in calls if len(c) == 5],
                   (b, kv_heads, plan.num_kv))}


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True, local_window_size=(20, 0)),
    dict(is_causal=True, local_window_size=(7, 3),
         key_value_seq_lengths=np.array([100, 41], np.int32)),
    dict(is_causal=True, local_window_size=(20, 0), offsets=(37, 5),
         key_value_seq_lengths=np.array([110, 60], np.int32)),
], ids=["causal_window", "causal_window_lengths", "offsets"])
def test_kernels_visit_only_nonempty_tiles(monkeypatch, kwargs):
  """Counted inside the kernels as they run: each computes exactly the
  tiles with a visible pair, per batch row, and the visit lists are
  shorter than a full row of tiles (the grid itself shrinks); with
  offsets too (global lengths), whose schedule is computed at run time."""
  kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
            for k, v in kwargs.items()}
  offsets = kwargs.pop("offsets", None)
  call, _ = _call(fresh_rng(), **kwargs)
  if offsets is not None:
    call = dataclasses.replace(call, mask=dataclasses.replace(
        call.mask, q_offset=jnp.int32(offsets[0]),
        kv_offset=jnp.int32(offsets[1])))
  visits = _computed_tiles(monkeypatch, call)
  plan = SMALL.plan(call)
  visible = np.asarray(call.mask.visibility())[:, 0]
  tiles = _nonempty_tiles(visible, plan.block_q, plan.block_kv)
  heads, kv_heads = call.query.shape[2], call.key.shape[2]
  expected_rows = tiles.sum(2)  # [B, nq]
  expected_cols = tiles.sum(1)  # [B, nk]
  want = np.broadcast_to(expected_rows[:, None], (tiles.shape[0], heads,
                                                  tiles.shape[1]))
  np.testing.assert_array_equal(np.asarray(visits["forward"]), want)
  np.testing.assert_array_equal(np.asarray(visits["dq"]), want)
  np.testing.assert_array_equal(
      np.asarray(visits["dkv"]),
      np.broadcast_to(expected_cols[:, None] * (heads // kv_heads),
                      (tiles.shape[0], kv_heads, tiles.shape[2])))
  total = int(np.asarray(visits["forward"]).sum())
  assert total == heads * tiles.sum() < heads * tiles.size / 2
  assert plan.kv_steps < plan.num_kv and plan.q_steps < plan.num_q


def test_empty_tiles_are_never_copied():
  """Replays the key/value block index the kernels' BlockSpecs compute at
  every grid step: Pallas copies a block only when the index changes, so
  the copies are exactly one per visited tile (plus, for a query block with
  nothing to visit, one block it never computes with)."""
  rng = fresh_rng()
  call, _ = _call(rng, b=1, t=200, s=200, is_causal=True,
                  local_window_size=(30, 0))
  plan = SMALL.plan(call)
  meta = jax.tree.map(np.asarray, common.metadata(call.mask, plan))
  classes = np.asarray(tile_rules.tile_classes(call.mask, plan.block_q,
                                          plan.block_kv))[0]
  copies, previous = 0, None
  for i in range(plan.num_q):
    for j in range(plan.kv_steps):
      block, cls = (int(x) for x in common.visit_at(
          meta.kv_visits, meta.kv_count, 0, i, j))
      if j < meta.kv_count[0, i]:
        assert classes[i, block] != tile_rules.EMPTY and cls == classes[i, block]
      if (i, block) != previous:
        copies += 1
        assert classes[i, block] != tile_rules.EMPTY
      previous = (i, block)
  assert copies == int((classes != tile_rules.EMPTY).sum())


def test_step_bounds_cover_every_schedule():
  """tiles.max_visited_blocks never cuts a visit list short (checked
  against a brute-force NumPy mask)."""
  rng = fresh_rng()
  for _ in range(300):
    t, s = (int(x) for x in rng.integers(1, 300, 2))
    bq, bk = (int(x) for x in rng.choice([8, 16, 32, 64], 2))
    causal = bool(rng.random() < 0.5)
    window = None
    if rng.random() < 0.8:
      window = tuple(int(x) for x in rng.integers(0, 80, 2))
    mask = masks.AttentionMask(batch=1, q_len=t, kv_len=s, is_causal=causal,
                               window=window)
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    visible = np.ones((t, s), bool)
    if causal:
      visible &= cols <= rows
    if window is not None:
      visible &= (cols >= rows - window[0]) & (cols <= rows + window[1])
    tiles = _nonempty_tiles(visible[None], bq, bk)[0]
    per_q, per_kv = tile_rules.max_visited_blocks(mask, bq, bk)
    assert tiles.sum(1).max() <= per_q <= -(-s // bk)
    assert tiles.sum(0).max() <= per_kv <= -(-t // bq)


def test_visibility_at_matches_block_visibility():
  rng = fresh_rng()
  call, _ = _call(rng, b=2, t=50, s=70, is_causal=True,
                  local_window_size=(9, 4),
                  query_seq_lengths=jnp.asarray([50, 20], jnp.int32),
                  key_value_seq_lengths=jnp.asarray([33, 70], jnp.int32),
                  segment_ids=(jnp.asarray(np.sort(rng.integers(0, 3, (2, 50)))),
                               jnp.asarray(np.sort(rng.integers(0, 3, (2, 70))))))
  mask = call.mask
  want = np.asarray(mask.visibility())[:, 0]
  q_idx, kv_idx = np.arange(50)[:, None], np.arange(70)[None, :]
  for b in range(2):
    got = masks.visibility_at(
        mask, q_idx, kv_idx, q_length=mask.q_lengths[b],
        kv_length=mask.kv_lengths[b],
        q_segment_ids=mask.q_segment_ids[b][:, None],
        kv_segment_ids=mask.kv_segment_ids[b][None, :])
    np.testing.assert_array_equal(np.asarray(got), want[b])
    got_t = masks.visibility_at(
        mask, q_idx.T, kv_idx.T, q_length=mask.q_lengths[b],
        kv_length=mask.kv_lengths[b],
        q_segment_ids=mask.q_segment_ids[b][None, :],
        kv_segment_ids=mask.kv_segment_ids[b][:, None])
    np.testing.assert_array_equal(np.asarray(got_t), want[b].T)


# ------------------------------------------------------------- declining
def test_declines_what_it_cannot_compute():
  rng = fresh_rng()
  q, k, v = random_qkv(rng)
  for extra, pattern in ((dict(bias=jnp.ones((12, 12))), "bias"),
                         (dict(mask=jnp.ones((12, 12), bool)), "mask")):
    with pytest.raises(NotImplementedError, match=pattern):
      jflash.dot_product_attention(q, k, v, **extra, implementation=SMALL,
                                   interpret=True)
    # A sequence of backends falls through to one that serves the call.
    out = jflash.dot_product_attention(q, k, v, **extra,
                                       implementation=(SMALL, "xla"),
                                       interpret=True)
    assert out.shape == q.shape
  wide = random_qkv(rng, h=320)
  with pytest.raises(NotImplementedError, match="head dim 320"):
    jflash.dot_product_attention(*wide, implementation=SMALL, interpret=True)


def test_schedule_shared_by_rows_when_smem_is_short(monkeypatch):
  """Per-row schedules that would not fit SMEM give way to one shared by
  all rows (still exact); one that does not fit even then is declined."""
  from jflash.backends import mosaic_tpu
  rng = fresh_rng()
  call, case = _call(rng, b=2, t=64, s=64, is_causal=True,
                     key_value_seq_lengths=jnp.asarray([64, 20], jnp.int32))
  plan = SMALL.plan(call)
  assert plan.per_batch
  # Per row: 2 rows * 4 query blocks * (2 steps + 1) * 4 bytes = 96 bytes.
  monkeypatch.setattr(mosaic_tpu.attention, "METADATA_BUDGET_BYTES", 64)
  assert not SMALL.plan(call).per_batch
  out = case.call_jflash(*case.arrays, implementation=SMALL, interpret=True)
  want = case.call_jflash(*case.arrays, implementation="xla")
  assert rel_err(out, want) < 1e-5
  monkeypatch.setattr(mosaic_tpu.attention, "METADATA_BUDGET_BYTES", 16)
  with pytest.raises(NotImplementedError, match="SMEM"):
    SMALL.plan(call)


# ---------------------------------------------------------------- config
def test_config_validation():
  with pytest.raises(ValueError, match=r"block_q.*multiple of 8.*got 12"):
    MosaicTpuConfig(block_q=12)
  with pytest.raises(ValueError, match="block_kv"):
    MosaicTpuConfig(block_kv=0)
  with pytest.raises(ValueError, match="vmem_limit_bytes"):
    MosaicTpuConfig(vmem_limit_bytes=10)
  gen = GENERATIONS["v5e"]
  with pytest.raises(ValueError, match=r"block_q=64 must be a multiple of 128"):
    MosaicTpuConfig(block_q=64).resolve(gen, 128, 2, interpret=False)
  assert MosaicTpuConfig(block_q=64).resolve(gen, 128, 2,
                                             interpret=True)[0] == 64


def test_generation_default_blocks():
  """Every generation has a default tiling for each padded head dim and
  kernel input width, a multiple of its MXU width with at least as many
  rows as keys; an unknown TPU (and interpret mode) takes the smallest,
  which fits every generation.  That each default compiles is checked by
  libtpu's compiler in tests/test_tpu_compile.py."""
  assert config.generation_of("TPU v5 lite").name == "v5e"
  assert config.generation_of("TPU v6 lite").name == "v6e"
  assert config.generation_of("TPU v5").name == "v5p"
  assert config.generation_of("TPU v4").name == "v4"
  assert config.generation_of("cpu") is config.FALLBACK
  for head_dim in (128, 256):
    for itemsize in (2, 4):
      areas = []
      for gen in GENERATIONS.values():
        assert gen.vmem_limit_bytes <= gen.vmem_bytes
        bq, bk = config.default_blocks(gen, head_dim, itemsize)
        assert bq % gen.mxu == 0 and bk % gen.mxu == 0 and bq >= bk
        areas.append(bq * bk)
      bq, bk = config.default_blocks(config.FALLBACK, head_dim, itemsize)
      assert bq * bk == min(areas)
  assert set(config.BLOCKS) == {(g, h, i) for g in GENERATIONS
                                for h in (128, 256) for i in (2, 4)}


def _tpu_mesh(device_kind: str, cores: int):
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType
  device = AbstractDevice(device_kind=device_kind, num_cores=cores,
                          platform="tpu")
  return AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                      abstract_device=device)


@pytest.mark.parametrize("interpret", [False, True])
def test_default_plan_follows_the_generation(interpret):
  """The default tiling comes from the target TPU's generation; short
  sequences round blocks up to whole 128-row tiles, in interpret mode too,
  which therefore runs the plan the TPU would."""
  call, _ = _call(fresh_rng(), t=300, s=1100, h=80)
  call = dataclasses.replace(call, interpret=interpret)
  with jax.sharding.use_abstract_mesh(_tpu_mesh("TPU v6 lite", 1)):
    plan = MosaicTpuBackend().plan(call)
  want = config.default_blocks(GENERATIONS["v6e"], 128, 2)
  assert (plan.block_q, plan.block_kv, plan.head_dim) == (
      384, min(want[1], 1152), 128)
  assert (plan.num_q, plan.num_kv) == (1, -(-1100 // plan.block_kv))
  assert plan.vmem_limit_bytes == GENERATIONS["v6e"].vmem_limit_bytes
  assert plan.interpret is interpret
  small = SMALL.plan(dataclasses.replace(call, interpret=True))
  assert (small.block_q, small.block_kv) == (16, 32)


def test_tpu_legal_blocks_in_interpret_mode():
  """128-row blocks, the smallest a TPU compiles, over 3 x 3 tiles:
  output and gradients against the ``xla`` backend."""
  rng = fresh_rng()
  q, k, v = random_qkv(rng, b=1, t=300, s=300, n=2, k=1, h=64)
  case = Case(q, k, v, kwargs=dict(
      is_causal=True, local_window_size=(150, 0),
      segment_ids=jnp.asarray(random_segments(rng, 1, 300))))
  cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  tiles = MosaicTpuBackend(MosaicTpuConfig(block_q=128, block_kv=128))

  def run(implementation, interpret):
    def fn(q, k, v, bias):
      return case.call_jflash(q, k, v, bias, implementation=implementation,
                              interpret=interpret)
    return jax.jit(lambda *a: (fn(*a), grads_of(fn, Case(*a), cot)))(
        *case.arrays)

  got, want = run(tiles, True), run("xla", False)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(g, w) < 1e-5


def test_tpu_interpreter_with_two_cores():
  """Pallas's TPU interpreter simulates DMAs, fills uninitialized VMEM with
  NaN and here splits the parallel grid axes over two cores, as on a v4 or
  v5p megacore: output and gradients against the ``xla`` backend."""
  from jax.experimental.pallas import tpu as pltpu
  rng = fresh_rng()
  q, k, v = random_qkv(rng, b=2, t=40, s=40, n=2, k=1, h=32)
  case = Case(q, k, v, kwargs=dict(
      is_causal=True, local_window_size=(9, 0),
      key_value_seq_lengths=jnp.asarray([30, 40], jnp.int32),
      segment_ids=jnp.asarray(random_segments(rng, 2, 40))))
  cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  backend = MosaicTpuBackend(MosaicTpuConfig(
      block_q=16, block_kv=16,
      interpret_params=pltpu.InterpretParams(num_cores_or_threads=2)))

  def run(implementation, interpret):
    def fn(q, k, v, bias):
      return case.call_jflash(q, k, v, bias, implementation=implementation,
                              interpret=interpret)
    return jax.jit(lambda *a: (fn(*a), grads_of(fn, Case(*a), cot)))(
        *case.arrays)

  got, want = run(backend, True), run("xla", False)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(g, w) < 1e-5


@pytest.mark.parametrize("dtype,features", [
    (jnp.bfloat16, "all"), (jnp.float32, "causal")], ids=["bf16", "f32"])
@pytest.mark.parametrize("device_kind,cores", [
    ("TPU v4", 2), ("TPU v5 lite", 1), ("TPU v5", 2), ("TPU v6 lite", 1)])
def test_lowers_for_each_tpu_generation_from_the_cpu(device_kind, cores,
                                                     dtype, features):
  """Exports forward and backward for a TPU with the generation's default
  tiling: this runs Pallas's Mosaic lowering (block shapes, scalar
  prefetch, a Mosaic rule for every op in the kernels) without a TPU.
  Mosaic's own compiler passes run only on a TPU and are not covered."""
  from jax import export
  rng = fresh_rng()
  t, s = 300, 1100
  q, k, v = random_qkv(rng, t=t, s=s, n=4, k=2, h=64, dtype=dtype)
  kwargs = dict(is_causal=True)
  if features == "all":
    kwargs.update(
        local_window_size=(100, 0),
        key_value_seq_lengths=jnp.asarray([s, 200], jnp.int32),
        segment_ids=(jnp.asarray(random_segments(rng, 2, t)),
                     jnp.asarray(random_segments(rng, 2, s))),
        logits_soft_cap=30.0)

  def loss(q, k, v):
    out, lse = jflash.dot_product_attention(
        q, k, v, **kwargs, implementation="mosaic_tpu", return_residual=True)
    return out.astype(jnp.float32).sum() + lse.astype(jnp.float32).sum()

  with jax.sharding.use_abstract_mesh(_tpu_mesh(device_kind, cores)):
    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                             platforms=["tpu"])(q, k, v)
  assert exported.mlir_module().count("tpu_custom_call") == 3


def test_shape_only_metadata_is_a_trace_time_constant():
  """Causal + window visits depend on shapes alone: built while tracing
  (no operations in the graph) and equal to the per-call ones."""
  call, _ = _call(fresh_rng(), is_causal=True, local_window_size=(21, 3))
  plan = SMALL.plan(call)
  jaxpr = jax.make_jaxpr(lambda: common.metadata(call.mask, plan))()
  assert not jaxpr.eqns
  static = common.metadata(call.mask, plan)
  # The same rules with lengths that hide nothing: traced, so computed at
  # run time by the same schedule.
  full = jnp.full((call.mask.batch,), call.mask.kv_len, jnp.int32)
  traced = jax.jit(lambda full: common.metadata(dataclasses.replace(
      call.mask, kv_lengths=full), plan))(full)
  for got, want in zip(jax.tree.leaves(static), jax.tree.leaves(traced)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------------ x64
# Mosaic TPU has no 64-bit types: under jax_enable_x64 every index and
# scalar in the kernels must still be int32 / float32.
_SUITE = TestMosaicTpuInterpret()


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _pallas_calls(jaxpr):
  from jax.extend import core
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, core.ClosedJaxpr):
          yield from _pallas_calls(sub.jaxpr)
        elif isinstance(sub, core.Jaxpr):
          yield from _pallas_calls(sub)


def _kernel_texts(case: Case) -> list[str]:
  """Kernel and index-map jaxprs of the forward and both backward kernels."""
  def loss(q, k, v):
    out, lse = case.call_jflash(q, k, v, None, implementation=SMALL,
                                interpret=True, return_residual=True)
    return out.sum() + lse.sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(
      *case.arrays[:3])
  texts = []
  for eqn in _pallas_calls(jaxpr.jaxpr):
    maps = [str(b.index_map_jaxpr)
            for b in eqn.params["grid_mapping"].block_mappings]
    texts.append("\n".join([str(eqn.params["jaxpr"]), *maps]))
  return texts


def _wide_ints(kwargs: dict) -> dict:
  """Lengths and segment ids as int64 (what integer arrays default to
  under x64)."""
  out = dict(kwargs)
  for name in ("query_seq_lengths", "key_value_seq_lengths", "segment_ids"):
    if name in out:
      out[name] = jax.tree.map(lambda x: jnp.asarray(x, jnp.int64), out[name])
  return out


def _all_features(rng, *, heads=4, kv_heads=2, q_len=45, kv_len=61,
                  dtype=jnp.float32) -> Case:
  """Every feature the kernels serve at once (``combined`` without the
  bias and dense mask they decline)."""
  case = conformance.build_case(rng, "causal", dtype=dtype, heads=heads,
                                kv_heads=kv_heads, q_len=q_len, kv_len=kv_len)
  case.kwargs.update(
      local_window_size=(int(rng.integers(1, 20)), 0),
      query_seq_lengths=jnp.asarray(rng.integers(0, q_len + 1, 2), jnp.int32),
      key_value_seq_lengths=jnp.asarray(rng.integers(1, kv_len + 1, 2),
                                        jnp.int32),
      segment_ids=(jnp.asarray(random_segments(rng, 2, q_len)),
                   jnp.asarray(random_segments(rng, 2, kv_len))),
      logits_soft_cap=float(rng.uniform(1.0, 4.0)), scale=1.0)
  return case


def test_x64_traces_the_same_kernels():
  """Forward, dQ and dK/dV traced with and without x64 are the same
  jaxprs (so the same Mosaic kernels): no int64 or float64 anywhere."""
  case = _all_features(fresh_rng())
  plain = _kernel_texts(case)
  with jax.enable_x64(True):
    case.kwargs = _wide_ints(case.kwargs)
    wide = _kernel_texts(case)
  assert len(plain) == 3
  assert wide == plain
  assert not any("64[" in text for text in wide)


@pytest.mark.parametrize("feature", [
    f for f in conformance.FEATURES if f != "combined"] + ["all"])
def test_x64_matches_reference(x64, feature):
  """Every feature under x64, with int64 lengths and segment ids and odd
  lengths (tails in both directions): output, logsumexp and gradients
  against the reference; bias and dense mask still decline."""
  rng, seed = conformance.new_rng()
  if feature == "all":
    case = _all_features(rng)
  else:
    case = conformance.build_case(rng, feature, dtype=jnp.float32, q_len=45,
                                  kv_len=61)
  case.kwargs = _wide_ints(case.kwargs)
  _SUITE.check_case(case, jnp.float32, seed)


@pytest.mark.parametrize("heads,kv_heads,dtype", [
    (4, 4, jnp.float32), (6, 1, jnp.float32), (4, 2, jnp.bfloat16)],
    ids=["mha", "mqa", "gqa_bf16"])
def test_x64_head_groups(x64, heads, kv_heads, dtype):
  rng, seed = conformance.new_rng()
  case = _all_features(rng, heads=heads, kv_heads=kv_heads, q_len=37,
                       kv_len=37, dtype=dtype)
  case.kwargs = _wide_ints(case.kwargs)
  _SUITE.check_case(case, dtype, seed)


@pytest.mark.parametrize("enable_x64,causal,window", [
    (True, False, (45 + 61, 45 + 61)), (True, False, (0, 61)),
    (True, True, (2 * 45 + 61, 3 * 61)), (True, True, (2**31 - 1, 0)),
    (False, False, (44, 60))],
    ids=["x64_both_t_plus_s", "x64_right_s", "x64_causal_wider",
         "x64_left_int32_max", "x32_exact"])
def test_windows_as_wide_as_the_sequences(enable_x64, causal, window):
  """Windows up to and past both sequence lengths (and a left side of the
  largest int32): the kernels' position math (positions plus or minus a
  window side, in int32) stays exact."""
  rng, seed = conformance.new_rng()
  case = conformance.build_case(rng, "causal" if causal else "plain",
                                dtype=jnp.float32, q_len=45, kv_len=61)
  case.kwargs["local_window_size"] = window
  with jax.enable_x64(enable_x64):
    _SUITE.check_case(case, jnp.float32, seed)


@pytest.mark.parametrize("enable_x64", [False, True], ids=["x32", "x64"])
def test_segment_ids_at_the_int32_extremes(enable_x64):
  """Segment ids at and next to the int32 limits, negative ones, and ids
  that differ only in the sign bit or the lowest bit are compared exactly
  (also when they arrive as int64 under x64)."""
  rng, seed = conformance.new_rng()
  top, bottom = np.iinfo(np.int32).max, np.iinfo(np.int32).min
  values = np.array([bottom, bottom + 1, -1, 0, 1, top - 1, top], np.int64)
  t = 45
  # Runs of random lengths of randomly chosen extreme values, so that tiles
  # hold several segments and the same id recurs in separate runs.
  ids = np.repeat(rng.choice(values, (2, t)), 1, axis=1)
  runs = np.sort(rng.choice(np.arange(1, t), (2, 6)), axis=1)
  for b in range(2):
    for start in runs[b]:
      ids[b, start:] = ids[b, start]
  case = conformance.build_case(rng, "causal", dtype=jnp.float32, q_len=t,
                                kv_len=t)
  with jax.enable_x64(enable_x64):
    dtype = jnp.int64 if enable_x64 else jnp.int32
    case.kwargs["segment_ids"] = jnp.asarray(ids.astype(dtype))
    _SUITE.check_case(case, jnp.float32, seed)


@pytest.mark.parametrize("shape", [(0, 20, 20, 32), (2, 0, 20, 32),
                                   (2, 20, 0, 32), (2, 20, 30, 0)],
                         ids=["batch0", "queries0", "keys0", "headdim0"])
def test_empty_axes(shape):
  """Called directly, the backend answers empty axes exactly (an empty grid
  would leave its outputs unwritten): zeros and a logsumexp of -inf, zero
  gradients; a head dim of 0 still attends (logsumexp log(#visible))."""
  b, t, s, h = shape
  rng = fresh_rng()
  q, k, v = random_qkv(rng, b=b, t=t, s=s, n=4, k=2, h=h)
  case = Case(q, k, v, kwargs=dict(is_causal=True, scale=1.0))
  call, _ = case.canonical(q, k, v, None)
  call = dataclasses.replace(call, interpret=True)

  def run(q, k, v):
    return SMALL(dataclasses.replace(call, query=q, key=k, value=v))

  out, lse = run(q, k, v)
  assert out.shape == q.shape and lse.shape == q.shape[:-1]
  assert not np.asarray(out).any()
  if h == 0:  # causal: query t sees keys 0 .. t, each with logit 0
    want = np.log(np.arange(1, t + 1, dtype=np.float64))[None, :, None]
    np.testing.assert_allclose(np.asarray(lse),
                               np.broadcast_to(want, lse.shape), rtol=1e-6)
  else:
    assert np.isneginf(np.asarray(lse)).all()
  grads = jax.grad(lambda *a: run(*a)[1].sum() + run(*a)[0].sum(),
                   argnums=(0, 1, 2))(q, k, v)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and not np.asarray(g).any()


# --------------------------------------------------------------- offsets
# A mask with offsets describes one block of longer sequences (a device's
# shard, a ring step of context parallelism): causal, window and lengths
# apply to the global positions t + q_offset and s + kv_offset.  Each case
# splits its keys into two blocks at `split`, as a ring would, and names
# where the query block stands against the key blocks.
_OFFSET_CASES = {
    # Queries wholly after the keys: every pair visible (FULL tiles).
    "causal_ahead_gqa_soft_cap": dict(
        t=40, s=72, q_offset=80, kv_offset=0, split=40, is_causal=True,
        heads=4, kv_heads=1, soft_cap=2.0),
    "causal_overlapping_segments": dict(
        t=40, s=56, q_offset=24, kv_offset=8, split=24, is_causal=True,
        segments=True),
    # Queries mostly before the keys: rows that see nothing, and a second
    # key block that no query sees.
    "causal_behind": dict(t=40, s=48, q_offset=0, kv_offset=30, split=24,
                          is_causal=True),
    # Global lengths that end inside the blocks.
    "window_both_sides_lengths": dict(
        t=40, s=64, q_offset=100, kv_offset=90, split=32, window=(6, 9),
        q_lengths=(125, 140), kv_lengths=(120, 200)),
    # The band misses the first key block entirely.
    "window_misses_a_block": dict(t=24, s=80, q_offset=50, kv_offset=20,
                                  split=20, window=(4, 4)),
    # The band misses every key: zeros, a logsumexp of -inf, zero
    # gradients (and no NaN).
    "window_misses_all": dict(t=24, s=40, q_offset=0, kv_offset=100,
                              split=16, window=(3, 2)),
}


def _offset_mask(case: dict, q_ids, kv_ids, q_offset, kv_offset, kv_len,
                 batch: int) -> masks.AttentionMask:
  """The case's mask over ``kv_len`` keys at global ``kv_offset``
  (lengths in the offsets' integer type)."""
  lengths = {name: None if case.get(name) is None else
             jnp.asarray(case[name], q_offset.dtype)
             for name in ("q_lengths", "kv_lengths")}
  return masks.AttentionMask(
      batch=batch, q_len=case["t"], kv_len=kv_len,
      is_causal=case.get("is_causal", False), window=case.get("window"),
      q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_offset=q_offset,
      kv_offset=kv_offset, **lengths)


def _offset_results(case: dict, arrays, offsets):
  """Reference and kernel results of one case (traced: the offsets are
  per-call values).

  Returns ``(want, got)``, each a dict with the whole call's ``out``,
  ``lse`` and gradients ``grads`` (through ``__call__``, with random
  cotangents of both outputs), and, for ``got``, ``blocks``: each key
  block's block ``forward``, and ``block_grads``: dQ summed over the key
  blocks' block ``backward`` (given the whole call's reference ``out``
  and ``lse``), dK and dV concatenated.  ``want["blocks"]`` is the
  reference on each key block's mask.
  """
  q, k, v, q_ids, kv_ids, d_out, d_lse = arrays
  q_offset, kv_offset = offsets
  split, s = case["split"], case["s"]
  scale, cap = 0.3, case.get("soft_cap")
  batch = q.shape[0]

  def call_of(k, v, kv_ids, kv_offset, mask_len):
    mask = _offset_mask(case, q_ids, kv_ids, q_offset, kv_offset, mask_len,
                        batch)
    return AttentionCall(q, k, v, None, mask, scale=scale,
                         logits_soft_cap=cap, returns_residual=True,
                         interpret=True)

  def cut(x, lo, hi):
    return None if x is None else x[:, lo:hi]

  full = call_of(k, v, kv_ids, kv_offset, s)
  blocks = [call_of(cut(k, lo, hi), cut(v, lo, hi), cut(kv_ids, lo, hi),
                    kv_offset + lo, hi - lo)
            for lo, hi in ((0, split), (split, s))]

  def reference_of(call):
    def run(q, k, v):
      return reference.reference_attention(
          q, k, v, None, call.mask, scale=scale, logits_soft_cap=cap)
    return run

  def with_grads(run):
    (out, lse), vjp = jax.vjp(run, q, k, v)
    # The reference computes in float64 under x64.
    grads = vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype)))
    return dict(out=out, lse=lse, grads=grads)

  want = with_grads(reference_of(full))
  want["blocks"] = [reference_of(c)(c.query, c.key, c.value) for c in blocks]
  got = with_grads(lambda q, k, v: SMALL(
      dataclasses.replace(full, query=q, key=k, value=v)))
  got["blocks"] = [SMALL.forward(c) for c in blocks]
  parts = [SMALL.backward(c, want["out"], want["lse"], d_out, d_lse)
           for c in blocks]
  got["block_grads"] = (sum(p[0] for p in parts),
                        jnp.concatenate([p[1] for p in parts], axis=1),
                        jnp.concatenate([p[2] for p in parts], axis=1))
  return want, got


def _offset_arrays(rng, case: dict):
  b, t, s = 2, case["t"], case["s"]
  q, k, v = random_qkv(rng, b=b, t=t, s=s, n=case.get("heads", 4),
                       k=case.get("kv_heads", 2), h=32)
  q_ids = kv_ids = None
  if case.get("segments"):
    q_ids = jnp.asarray(random_segments(rng, b, t))
    kv_ids = jnp.asarray(random_segments(rng, b, s))
  d_out = random_normal(rng, q.shape, jnp.float32)
  d_lse = random_normal(rng, q.shape[:3], jnp.float32)
  return q, k, v, q_ids, kv_ids, d_out, d_lse


def _check_offset_results(want, got, info: str) -> None:
  assert rel_err(got["out"], want["out"]) < 1e-5, info
  assert lse_err(got["lse"], want["lse"]) < 1e-5, info
  for (out, lse), (w_out, w_lse) in zip(got["blocks"], want["blocks"]):
    assert rel_err(out, w_out) < 1e-5, info
    assert lse_err(lse, w_lse) < 1e-5, info
  for grads in (got["grads"], got["block_grads"]):
    for name, g, w in zip("qkv", grads, want["grads"]):
      assert np.isfinite(np.asarray(g)).all(), (name, info)
      assert rel_err(g, w) < 1e-5, (name, info)


@pytest.mark.parametrize("name", list(_OFFSET_CASES))
def test_offsets_match_reference(name):
  """Masks with offsets, the offsets traced: ``__call__`` (output,
  logsumexp, gradients), the block ``forward`` of each key block, and the
  block ``backward`` of each key block given the whole call's output and
  logsumexp (summed as context parallelism sums them), all against the
  reference."""
  case = _OFFSET_CASES[name]
  rng, seed = conformance.new_rng()
  arrays = _offset_arrays(rng, case)
  offsets = (jnp.int32(case["q_offset"]), jnp.int32(case["kv_offset"]))
  want, got = jax.jit(functools.partial(_offset_results, case))(arrays,
                                                               offsets)
  _check_offset_results(want, got, f"seed={seed}")


def test_one_trace_serves_any_offsets():
  """The offsets are per-call values: one jitted block forward serves
  query blocks ahead of, behind and overlapping the key block (each with
  its own tile schedule, computed at run time)."""
  case = dict(t=40, s=48, is_causal=True, window=(30, 0))
  rng, seed = conformance.new_rng()
  q, k, v = random_qkv(rng, b=2, t=40, s=48, n=4, k=2, h=32)
  traces = []

  def block_forward(q_offset, kv_offset):
    traces.append(1)
    mask = _offset_mask(case, None, None, q_offset, kv_offset, 48, 2)
    return SMALL.forward(AttentionCall(q, k, v, None, mask, scale=0.3,
                                       logits_soft_cap=None, interpret=True))

  block_forward = jax.jit(block_forward)
  for offsets in ((90, 0), (0, 30), (20, 10)):
    q_offset, kv_offset = (jnp.int32(x) for x in offsets)
    out, lse = block_forward(q_offset, kv_offset)
    mask = _offset_mask(case, None, None, q_offset, kv_offset, 48, 2)
    w_out, w_lse = reference.reference_attention(q, k, v, None, mask,
                                                 scale=0.3)
    assert rel_err(out, w_out) < 1e-5, (offsets, seed)
    assert lse_err(lse, w_lse) < 1e-5, (offsets, seed)
  assert len(traces) == 1


_ALL_WITH_OFFSETS = dict(t=40, s=56, q_offset=30, kv_offset=20, split=24,
                         is_causal=True, window=(25, 0), segments=True,
                         q_lengths=(65, 50), kv_lengths=(60, 76),
                         soft_cap=2.0)


def test_offsets_under_x64():
  """Under ``jax_enable_x64``, with int64 offsets, lengths and segment
  ids: the kernels trace to the same jaxprs as without it (all index math
  int32), and every result matches the float64 reference."""
  case = _ALL_WITH_OFFSETS
  rng, seed = conformance.new_rng()
  arrays = _offset_arrays(rng, case)
  run = functools.partial(_offset_results, case)

  def kernel_texts(arrays, offsets):
    jaxpr = jax.make_jaxpr(run)(arrays, offsets)
    return [str(eqn.params["jaxpr"]) + "\n".join(
        str(b.index_map_jaxpr)
        for b in eqn.params["grid_mapping"].block_mappings)
            for eqn in _pallas_calls(jaxpr.jaxpr)]

  def offsets_as(dtype):
    return tuple(jnp.asarray(case[name], dtype)
                 for name in ("q_offset", "kv_offset"))

  plain = kernel_texts(arrays, offsets_as(jnp.int32))
  with jax.enable_x64(True):
    wide_arrays = tuple(
        None if x is None else
        x.astype(jnp.int64) if jnp.issubdtype(x.dtype, jnp.integer) else x
        for x in arrays)
    wide = kernel_texts(wide_arrays, offsets_as(jnp.int64))
    # Forward and backward of __call__ (3), two block forwards and two
    # block backwards (2 each).
    assert len(wide) == 9 and wide == plain
    assert not any("64[" in text for text in wide)
    want, got = jax.jit(run)(wide_arrays, offsets_as(jnp.int64))
    _check_offset_results(want, got, f"seed={seed}")


def test_offsets_lower_for_a_tpu_from_the_cpu():
  """The block forward and backward with offsets (and every feature the
  kernels serve) export for a TPU with the default tiling: Pallas's Mosaic
  lowering accepts the offsets operand and its use in the element mask."""
  from jax import export
  case = _ALL_WITH_OFFSETS
  rng = fresh_rng()
  q, k, v, q_ids, kv_ids, d_out, d_lse = _offset_arrays(rng, case)
  q, k, v, d_out = (x.astype(jnp.bfloat16) for x in (q, k, v, d_out))
  backend = MosaicTpuBackend()

  def block(q, k, v, q_offset, kv_offset):
    mask = _offset_mask(case, q_ids, kv_ids, q_offset, kv_offset, case["s"],
                        q.shape[0])
    call = AttentionCall(q, k, v, None, mask, scale=0.3,
                         logits_soft_cap=case["soft_cap"])
    out, lse = backend.forward(call)
    return out, lse, backend.backward(call, out, lse, d_out, d_lse)

  offsets = (jnp.int32(case["q_offset"]), jnp.int32(case["kv_offset"]))
  with jax.sharding.use_abstract_mesh(_tpu_mesh("TPU v5 lite", 1)):
    exported = export.export(jax.jit(block), platforms=["tpu"])(
        q, k, v, *offsets)
  assert exported.mlir_module().count("tpu_custom_call") == 3
