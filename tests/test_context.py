"""Context parallelism: sequences sharded over mesh axes, computed exactly.

Every case compares the sharded call (ring or all-gather, contiguous or
zigzag layout) with the exact reference on the whole sequences, forward,
logsumexp and gradients, on fresh random inputs over the 8 host devices of
``conftest``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from tests._support import (Case, fresh_rng, lse_err, random_qkv,
                            random_segments, rel_err)

TOL = 2e-5


def _mesh(shape, names, kind=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _mask_kwargs(rng, name, b, t):
  """User-level mask arguments of one named case (global positions)."""
  if name == "causal":
    return {"is_causal": True}
  if name == "window":
    return {"local_window_size": (int(rng.integers(3, t // 2)),
                                  int(rng.integers(0, t // 3)))}
  if name == "causal_window":
    return {"is_causal": True, "local_window_size": (t // 5, 0)}
  if name == "segments":
    # Documents of random lengths, crossing shard boundaries.
    return {"is_causal": True,
            "segment_ids": jnp.asarray(random_segments(rng, b, t, 5))}
  if name == "lengths":
    return {"is_causal": True,
            "query_seq_lengths": jnp.asarray(rng.integers(1, t + 1, b),
                                             jnp.int32),
            "key_value_seq_lengths": jnp.asarray(rng.integers(1, t + 1, b),
                                                 jnp.int32)}
  if name == "softcap":
    return {"logits_soft_cap": 5.0}
  raise AssertionError(name)


def _sharded_fn(mesh, axis, cp, kwargs, seq_spec=P(None, "c")):
  """``(q, k, v, segment ids) -> (out, lse)`` inside a shard_map whose
  sequence axes are split over ``axis``; the segment ids are used only
  when ``kwargs`` has them."""
  lengths = {n: kwargs[n] for n in ("query_seq_lengths",
                                    "key_value_seq_lengths") if n in kwargs}
  static = {n: v for n, v in kwargs.items()
            if n not in lengths and n != "segment_ids"}

  segmented = "segment_ids" in kwargs

  def body(q, k, v, ids, lengths):
    return jflash.dot_product_attention(
        q, k, v, segment_ids=ids if segmented else None, **lengths, **static,
        implementation="xla", return_residual=True, context_parallel=cp)

  def run(q, k, v, ids):
    return jax.shard_map(
        body, mesh=mesh, in_specs=(seq_spec,) * 4 + (P(),),
        out_specs=(seq_spec, seq_spec))(q, k, v, ids, lengths)
  return run


def _check(rng, strategy, layout, mask_name, n=4, b=2, t=64, heads=(4, 2)):
  mesh = _mesh((n,), ("c",))
  q, k, v = random_qkv(rng, b=b, t=t, s=t, n=heads[0], k=heads[1], h=16)
  kwargs = _mask_kwargs(rng, mask_name, b, t)
  case = Case(q, k, v, kwargs=kwargs)
  ref_out, ref_lse = case.call_reference(q, k, v, None)
  ids = kwargs.get("segment_ids", jnp.zeros((b, t), jnp.int32))
  cp = jflash.ContextParallel(strategy=strategy, layout=layout,
                              axis_name="c")
  run = _sharded_fn(mesh, "c", cp, kwargs)
  arrange = ((lambda x: jflash.load_balance(x, n)) if layout == "zigzag"
             else (lambda x: x))
  restore = ((lambda x: jflash.restore_order(x, n)) if layout == "zigzag"
             else (lambda x: x))
  out, lse = jax.jit(run)(*(arrange(x) for x in (q, k, v, ids)))
  assert rel_err(restore(out), ref_out) < TOL
  assert lse_err(restore(lse), ref_lse) < TOL

  cotangent = jnp.asarray(rng.standard_normal(q.shape, np.float32))

  def loss(q, k, v):
    out, _ = run(*(arrange(x) for x in (q, k, v, ids)))
    return jnp.sum(restore(out) * cotangent)

  def ref_loss(q, k, v):
    return jnp.sum(case.call_reference(q, k, v, None, jit=False)[0]
                   * cotangent)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  ref_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(grads, ref_grads):
    assert rel_err(g, r) < TOL


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_causal_segments_every_strategy_and_layout(strategy, layout):
  _check(fresh_rng(), strategy, layout, "segments")


@pytest.mark.parametrize("strategy,layout,mask_name", [
    ("ring", "contiguous", "window"),
    ("ring", "zigzag", "causal_window"),
    ("all_gather", "zigzag", "window"),
    ("ring", "contiguous", "lengths"),
    ("all_gather", "zigzag", "lengths"),
    ("ring", "zigzag", "softcap"),
])
def test_mask_features(strategy, layout, mask_name):
  _check(fresh_rng(), strategy, layout, mask_name)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_odd_local_lengths(strategy):
  # 60 positions on 4 shards: 15 each, no tile-aligned block anywhere.
  _check(fresh_rng(), strategy, "contiguous", "segments", t=60)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("heads", [(8, 1), (4, 4)])
def test_gqa_mqa_and_eight_shards(strategy, heads):
  _check(fresh_rng(), strategy, "contiguous", "causal", n=8, b=1, t=64,
         heads=heads)


def test_two_mesh_axes_as_one_sequence_axis():
  rng = fresh_rng()
  mesh = _mesh((2, 2), ("a", "b"))
  q, k, v = random_qkv(rng, b=2, t=32, s=32, n=4, k=2, h=16)
  kwargs = _mask_kwargs(rng, "segments", 2, 32)
  cp = jflash.ContextParallel(strategy="ring", axis_name=("a", "b"))
  run = _sharded_fn(mesh, ("a", "b"), cp, kwargs,
                    seq_spec=P(None, ("a", "b")))
  out, lse = jax.jit(run)(q, k, v, kwargs["segment_ids"])
  ref_out, ref_lse = Case(q, k, v, kwargs=kwargs).call_reference(q, k, v,
                                                                  None)
  assert rel_err(out, ref_out) < TOL
  assert lse_err(lse, ref_lse) < TOL


@pytest.mark.parametrize("axes", ["data_context", "context_heads"])
def test_explicit_two_axis_mesh_needs_no_shard_map(axes):
  rng = fresh_rng()
  if axes == "data_context":
    mesh = _mesh((2, 4), ("d", "c"), AxisType.Explicit)
    spec = P("d", "c")
  else:
    mesh = _mesh((4, 2), ("c", "h"), AxisType.Explicit)
    spec = P(None, "c", "h")
  q, k, v = random_qkv(rng, b=2, t=64, s=64, n=4, k=2, h=16)
  ids = jnp.asarray(random_segments(rng, 2, 64, 4))
  sharding = NamedSharding(mesh, spec)
  ids_sharding = NamedSharding(mesh, P(*tuple(spec)[:2]))
  qs, ks, vs = (jax.device_put(x, sharding) for x in (q, k, v))
  ids_s = jax.device_put(ids, ids_sharding)
  case = Case(q, k, v, kwargs={"is_causal": True, "segment_ids": ids})
  cotangent = jnp.asarray(rng.standard_normal(q.shape, np.float32))

  def loss(q, k, v, ids):
    out = jflash.dot_product_attention(q, k, v, is_causal=True,
                                       segment_ids=ids)
    return jnp.sum(out * cotangent), out

  with jax.set_mesh(mesh):
    (_, out), grads = jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True))(qs, ks, vs, ids_s)
    assert jflash.selected_implementation(
        qs, ks, vs, is_causal=True, segment_ids=ids_s) == "xla"
  want_spec = tuple(spec) + (None,) * (4 - len(spec))
  assert tuple(out.sharding.spec) == want_spec
  assert all(tuple(g.sharding.spec) == want_spec for g in grads)
  assert rel_err(out, case.call_reference(q, k, v, None)[0]) < TOL
  ref_grads = jax.grad(lambda q, k, v: jnp.sum(
      case.call_reference(q, k, v, None, jit=False)[0] * cotangent),
      argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(grads, ref_grads):
    assert rel_err(g, r) < TOL


# ------------------------------------------------------------ compiled form
def _compiled(strategy, n, local, kwargs, grad=False, heads=(4, 4)):
  mesh = _mesh((n,), ("c",))
  cp = jflash.ContextParallel(strategy=strategy, axis_name="c")
  run = _sharded_fn(mesh, "c", cp, kwargs)
  if grad:
    fn = jax.grad(lambda q, k, v, i: jnp.sum(run(q, k, v, i)[0]),
                  argnums=(0, 1, 2))
  else:
    fn = lambda q, k, v, i: run(q, k, v, i)[0]  # noqa: E731
  seq = NamedSharding(mesh, P(None, "c"))
  qs = jax.ShapeDtypeStruct((1, n * local, heads[0], 32), jnp.float32,
                            sharding=seq)
  kvs = jax.ShapeDtypeStruct((1, n * local, heads[1], 32), jnp.float32,
                             sharding=seq)
  ids = jax.ShapeDtypeStruct((1, n * local), jnp.int32, sharding=seq)
  return jax.jit(fn).lower(qs, kvs, kvs, ids).compile()


def _count(text, op):
  return len(re.findall(rf"= [^=]*\b{op}\(", text))


@pytest.mark.parametrize("grad", [False, True])
def test_ring_passes_blocks_and_all_gather_gathers(grad):
  ring = _compiled("ring", 4, 32, {"is_causal": True}, grad).as_text()
  gather = _compiled("all_gather", 4, 32, {"is_causal": True},
                     grad).as_text()
  assert _count(ring, "collective-permute") > 0
  assert _count(ring, "all-gather") == 0
  assert _count(gather, "all-gather") > 0
  assert _count(gather, "collective-permute") == 0
  if grad:
    assert _count(gather, "reduce-scatter") > 0


def test_ring_skips_blocks_outside_the_window():
  # Local blocks of 32 positions: a window reaching 8 keys back needs only
  # the previous shard's block; looking 8 ahead as well, the next one too.
  # Diagonal-only attention needs no other shard.
  counts = {}
  for window in ((8, 0), (8, 8), (0, 0)):
    text = _compiled("ring", 8, 32, {"local_window_size": window}).as_text()
    counts[window] = (_count(text, "collective-permute"),
                      _count(text, "while"))
  # Key and value blocks move once per needed step, with no loop.
  assert counts[(8, 0)] == (2, 0)
  assert counts[(8, 8)] == (4, 0)
  assert counts[(0, 0)] == (0, 0)


@pytest.mark.parametrize("grad", [False, True])
def test_ring_memory_is_flat_in_the_number_of_shards(grad):
  # Same local length on 4 and 8 shards: the ring holds one block at a
  # time; all-gather holds the whole sequence.
  def temp(strategy, n):
    compiled = _compiled(strategy, n, 128, {"is_causal": True}, grad)
    return compiled.memory_analysis().temp_size_in_bytes
  assert temp("ring", 8) <= 1.1 * temp("ring", 4)
  # All-gather holds 4 more shards' K and V blocks [1, 128, 4, 32] float32.
  more_blocks = 2 * 4 * 128 * 4 * 32 * 4
  assert temp("all_gather", 8) - temp("all_gather", 4) >= more_blocks


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_reruns_are_bitwise_equal(strategy):
  rng = fresh_rng()
  mesh = _mesh((4,), ("c",))
  q, k, v = random_qkv(rng, b=1, t=64, s=64, n=4, k=2, h=16)
  ids = jnp.zeros((1, 64), jnp.int32)
  cp = jflash.ContextParallel(strategy=strategy, axis_name="c")
  run = _sharded_fn(mesh, "c", cp, {"is_causal": True})
  fn = jax.jit(jax.value_and_grad(
      lambda q, k, v: jnp.sum(run(q, k, v, ids)[0] ** 2), argnums=(0, 1, 2)))
  first, second = fn(q, k, v), fn(q, k, v)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ layout
def test_load_balance_round_trip():
  rng = fresh_rng()
  x = jnp.asarray(rng.standard_normal((2, 48, 3)), jnp.float32)
  for n in (1, 2, 3, 4):
    y = jflash.load_balance(x, n)
    assert not n > 1 or not np.array_equal(np.asarray(y), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(jflash.restore_order(y, n)),
                                  np.asarray(x))


def _causal_tile_pairs(positions: np.ndarray, tile: int) -> int:
  """Query tiles x key tiles of one device with a visible pair, a device
  holding queries at ``positions`` against every key."""
  total = 0
  for start in range(0, len(positions), tile):
    last_query = positions[start:start + tile].max()
    total += last_query // tile + 1
  return total


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_layout_evens_causal_work(n):
  length, tile = 2048, 16
  local = length // n
  order = np.asarray(jflash.load_balance(np.arange(length)[None], n))[0]
  zigzag = [_causal_tile_pairs(order[i * local:(i + 1) * local], tile)
            for i in range(n)]
  contiguous = [_causal_tile_pairs(np.arange(i * local, (i + 1) * local),
                                   tile) for i in range(n)]
  assert max(zigzag) <= 1.1 * np.mean(zigzag)
  assert max(contiguous) > 1.3 * np.mean(contiguous)


# ------------------------------------------------------------------ errors
def test_errors_name_what_is_wrong():
  rng = fresh_rng()
  mesh = _mesh((4,), ("c",))
  q, k, v = random_qkv(rng, b=1, t=12, s=12, n=2, k=2, h=8)
  with pytest.raises(ValueError, match="zigzag.*even"):
    cp = jflash.ContextParallel(layout="zigzag", axis_name="c")
    jax.jit(_sharded_fn(mesh, "c", cp, {}))(q, k, v,
                                            jnp.zeros((1, 12), jnp.int32))
  with pytest.raises(ValueError, match="axis_name"):
    jflash.dot_product_attention(
        q, k, v, context_parallel=jflash.ContextParallel(axis_name="c"))
  with pytest.raises(ValueError, match="bias"):
    cp = jflash.ContextParallel(axis_name="c")
    bias = jnp.zeros((1, 2, 12, 12))
    jax.jit(jax.shard_map(
        lambda q, k, v: jflash.dot_product_attention(
            q, k, v, bias, context_parallel=cp),
        mesh=mesh, in_specs=(P(None, "c"),) * 3, out_specs=P(None, "c")))(
            q, k, v)
  for bad in ({"strategy": "tree"}, {"layout": "striped"},
              {"axis_name": 3}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      jflash.ContextParallel(**bad)
  with pytest.raises(ValueError, match="num_shards"):
    jflash.load_balance(q, 0)
  with pytest.raises(ValueError, match="2 \\* num_shards"):
    jflash.load_balance(q, 4)


def test_explicit_sequence_that_does_not_divide():
  # Queries of 12 positions on 4 devices; keys of 6 cannot follow them.
  mesh = _mesh((4,), ("c",), AxisType.Explicit)
  rng = fresh_rng()
  q = jax.device_put(random_qkv(rng, b=1, t=12, s=12, n=2, k=2, h=8)[0],
                     NamedSharding(mesh, P(None, "c")))
  kv = jax.device_put(jnp.zeros((1, 6, 2, 8)), NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="key sequence S = 6"):
      jax.jit(jflash.dot_product_attention)(q, kv, kv)


def test_demo_model_on_a_data_by_context_mesh_matches_one_device():
  # The example's model: tokens, positions and targets in zigzag order on
  # a 2 x 4 mesh give the loss and gradients of the model on one device.
  import optax
  from flax import nnx

  from examples.model import Config, TransformerLM
  rng = fresh_rng()
  n, b, t = 4, 2, 64
  mesh = _mesh((2, n), ("data", "context"), AxisType.Explicit)
  tokens = rng.integers(0, 50, (b, t + 1)).astype(np.int32)
  x, y = tokens[:, :-1], tokens[:, 1:]
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  cfg = Config(vocab_size=50, seq_len=t, num_layers=1, d_model=32,
               num_heads=2, context_parallel=jflash.ContextParallel(
                   layout="zigzag"))
  model = TransformerLM(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  graphdef, params = nnx.split(model)

  def loss(params, x, positions, y):
    logits = nnx.merge(graphdef, params)(x, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(
      params, x, positions, y)
  sharding = NamedSharding(mesh, P("data", "context"))
  placed = [jax.device_put(np.asarray(jflash.load_balance(a, n)), sharding)
            for a in (x, positions, y)]
  with jax.set_mesh(mesh):
    params_on_mesh = jax.device_put(params, NamedSharding(mesh, P()))
    got_loss, grads = jax.jit(jax.value_and_grad(loss))(params_on_mesh,
                                                        *placed)
  assert abs(float(got_loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert rel_err(g, r) < 1e-4


# ---------------------------------------------------------------- kernels
@pytest.mark.parametrize("strategy,layout", [("ring", "zigzag"),
                                             ("all_gather", "contiguous")])
def test_blocks_on_the_tpu_kernels(strategy, layout):
  # Pallas's interpret mode cannot evaluate its index maps on values that
  # vary across a checked shard_map's axes, hence check_vma=False here.
  from jflash.backends.mosaic_tpu import MosaicTpuBackend, MosaicTpuConfig
  small = MosaicTpuBackend(MosaicTpuConfig(block_q=16, block_kv=16))
  rng = fresh_rng()
  n, b, t = 4, 1, 64
  mesh = _mesh((n,), ("c",))
  q, k, v = random_qkv(rng, b=b, t=t, s=t, n=4, k=2, h=16)
  ids = jnp.asarray(random_segments(rng, b, t, 4))
  cp = jflash.ContextParallel(strategy=strategy, layout=layout,
                              axis_name="c")
  arrange = ((lambda x: jflash.load_balance(x, n)) if layout == "zigzag"
             else (lambda x: x))
  restore = ((lambda x: jflash.restore_order(x, n)) if layout == "zigzag"
             else (lambda x: x))
  spec = P(None, "c")
  run = jax.shard_map(
      lambda q, k, v, ids: jflash.dot_product_attention(
          q, k, v, is_causal=True, segment_ids=ids, implementation=small,
          interpret=True, context_parallel=cp),
      mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False)
  case = Case(q, k, v, kwargs={"is_causal": True, "segment_ids": ids})
  cotangent = jnp.asarray(rng.standard_normal(q.shape, np.float32))

  def loss(q, k, v):
    out = restore(run(*(arrange(x) for x in (q, k, v, ids))))
    return jnp.sum(out * cotangent), out

  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert rel_err(out, case.call_reference(q, k, v, None)[0]) < TOL
  ref_grads = jax.grad(lambda q, k, v: jnp.sum(
      case.call_reference(q, k, v, None, jit=False)[0] * cotangent),
      argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(grads, ref_grads):
    assert rel_err(g, r) < TOL


def test_export_for_tpu_runs_the_tpu_kernels_per_block():
  # The backend of each block follows the platform of the mesh: a mesh of
  # TPU devices gets the TPU kernels from this CPU host, a mesh of CPU
  # devices the xla backend.
  from jax.sharding import AbstractDevice, AbstractMesh
  tpu = AbstractMesh((4,), ("c",), (AxisType.Explicit,),
                     abstract_device=AbstractDevice(
                         device_kind="TPU v5 lite", num_cores=None,
                         platform="tpu"))
  for mesh, platform in ((tpu, "tpu"),
                         (_mesh((4,), ("c",), AxisType.Explicit), "cpu")):
    spec = P(None, "c")
    cp = jflash.ContextParallel(strategy="ring", axis_name="c")
    fn = jax.jit(jax.shard_map(
        lambda q, k, v: jflash.dot_product_attention(
            q, k, v, is_causal=True, context_parallel=cp),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    x = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, spec))
    text = jax.export.export(fn, platforms=[platform])(x, x, x).mlir_module()
    assert ("tpu_custom_call" in text) == (platform == "tpu")
    assert "collective_permute" in text


def test_x64_wide_ids_lengths_and_unbounded_window():
  # 64-bit segment ids (renumbered across the whole sharded sequence),
  # 64-bit lengths and a window wider than any sequence, under x64.
  rng = fresh_rng()
  mesh = _mesh((4,), ("c",), AxisType.Explicit)
  with jax.enable_x64(True):
    q, k, v = random_qkv(rng, b=2, t=64, s=64, n=4, k=2, h=16)
    ids = jnp.asarray(random_segments(rng, 2, 64, 4).astype(np.int64)
                      * 2**33)
    lengths = jnp.asarray(rng.integers(1, 65, 2), jnp.int64)
    kwargs = {"is_causal": True, "local_window_size": (2**40, 0),
              "key_value_seq_lengths": lengths}
    sharding = NamedSharding(mesh, P(None, "c"))
    for strategy in ("ring", "all_gather"):
      cp = jflash.ContextParallel(strategy=strategy)
      with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v, ids, cp=cp: jflash.dot_product_attention(
            q, k, v, segment_ids=ids, context_parallel=cp, **kwargs))(
                *(jax.device_put(x, sharding) for x in (q, k, v, ids)))
      want = jflash.dot_product_attention(
          q, k, v, segment_ids=ids, implementation="xla", **kwargs)
      assert rel_err(out, want) < 1e-5


def test_explicit_sequence_sharding_needs_no_ambient_mesh():
  """Inputs sharded over an Explicit mesh axis carry their mesh: no
  ``jax.set_mesh`` is needed around the call (the reshards inside name
  that mesh), forward, gradients, and 64-bit ids ranked across shards."""
  rng = fresh_rng()
  mesh = _mesh((4,), ("c",), AxisType.Explicit)
  sharding = NamedSharding(mesh, P(None, "c"))
  with jax.enable_x64(True):
    q, k, v = random_qkv(rng, b=2, t=64, s=64, n=4, k=2, h=16)
    ids = jnp.asarray(random_segments(rng, 2, 64, 4).astype(np.int64)
                      * 2**33)
    args = [jax.device_put(x, sharding) for x in (q, k, v, ids)]

    def loss(q, k, v, ids):
      return jflash.dot_product_attention(q, k, v, is_causal=True,
                                          segment_ids=ids).sum()

    out = jax.jit(lambda q, k, v, ids: jflash.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids))(*args)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    want = jflash.dot_product_attention(q, k, v, is_causal=True,
                                        segment_ids=ids, implementation="xla")
    want_grads = jax.grad(lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids,
        implementation="xla").sum(), argnums=(0, 1, 2))(q, k, v)
  assert rel_err(out, want) < 1e-5
  for g, w in zip(grads, want_grads):
    assert rel_err(g, w) < 1e-5
