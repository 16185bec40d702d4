"""Backend choice: per lowering platform, named in the HLO, logged."""

from __future__ import annotations

import json
import logging
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

import jflash
from tests._support import Case, fresh_rng, random_qkv, random_segments, \
    rel_err


def _custom_calls(module_text: str) -> set[str]:
  return set(re.findall(r"custom_call @([\w.]+)", module_text))


def _case(rng, **kwargs) -> Case:
  q, k, v = random_qkv(rng, t=40, s=40, n=4, k=2, h=32)
  return Case(q, k, v, kwargs=kwargs)


def _attention(case: Case):
  """A fresh function (so that no trace is reused from another test)."""
  def f(q, k, v):
    return jflash.dot_product_attention(q, k, v, **case.kwargs)
  return f


# ---------------------------------------------------------------- platforms
def _count(module_text: str, name: str) -> int:
  return len(re.findall(rf"custom_call @{name}\b", module_text))


def test_a_default_call_traces_the_target_platform_only(monkeypatch):
  """On this host the default call never reaches another platform's
  backend: its program is the same as with the host's backend named, and
  no Pallas kernel is traced."""
  from jflash.backends import mosaic_gpu, mosaic_tpu
  reached = []

  def spy(self, call):
    reached.append(self.name)
    raise NotImplementedError("spy")
  for backend in (mosaic_tpu.MosaicTpuBackend, mosaic_gpu.MosaicGpuBackend):
    monkeypatch.setattr(backend, "__call__", spy)
  case = _case(fresh_rng(), is_causal=True)
  q, k, v = case.arrays[:3]

  def grad_of(**kwargs):
    def loss(q, k, v):
      return jflash.dot_product_attention(q, k, v, is_causal=True,
                                          **kwargs).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  default = str(grad_of().trace(q, k, v).jaxpr)
  named = str(grad_of(implementation=jflash.default_order()[0]).trace(
      q, k, v).jaxpr)
  assert reached == []
  assert "pallas_call" not in default
  assert default == named


def test_export_for_tpu_takes_lowering_for():
  """From this host a TPU export holds the TPU kernels when traced for a
  TPU (``jflash.lowering_for``), with the default and with the backend
  named; traced for this host it holds the portable program."""
  case = _case(fresh_rng(), is_causal=True)
  q, k, v = case.arrays[:3]

  def attention(**kwargs):
    return jax.jit(lambda q, k, v: jflash.dot_product_attention(
        q, k, v, is_causal=True, **kwargs))

  host = jax.export.default_export_platform()
  for kwargs in ({}, {"implementation": "mosaic_tpu"}):
    with jflash.lowering_for("tpu", "TPU v5 lite"):
      exported = export.export(attention(**kwargs), platforms=["tpu"])(
          q, k, v)
    assert "tpu_custom_call" in _custom_calls(exported.mlir_module())
  if host != "tpu":
    exported = export.export(attention(), platforms=["tpu"])(q, k, v)
    assert "tpu_custom_call" not in _custom_calls(exported.mlir_module())
    with pytest.raises(NotImplementedError, match="needs a TPU"):
      attention(implementation="mosaic_tpu").trace(q, k, v)


def test_lowering_for_rejects_unknown_platforms():
  with pytest.raises(ValueError, match="platform must be one of.*'gpu'"):
    jflash.lowering_for("gpu")
  with pytest.raises(ValueError, match="device_kind must be a str"):
    jflash.lowering_for("tpu", 5)


@pytest.mark.parametrize("features", ["causal", "segments"])
def test_multi_platform_program_runs_here_and_holds_the_tpu_kernels(
    features):
  """``implementation={"cpu": None, "tpu": None}``: one module for CPU and
  TPU whose TPU branch holds the Mosaic kernels, and which, called on the
  CPU, computes the reference's output and gradients."""
  rng = fresh_rng()
  kwargs = dict(is_causal=True,
                implementation={"cpu": None, "tpu": None})
  if features == "segments":
    kwargs["segment_ids"] = jnp.asarray(random_segments(rng, 2, 40))
  case = _case(rng, **kwargs)
  f = _attention(case)
  q, k, v = case.arrays[:3]
  exported = export.export(jax.jit(f), platforms=["cpu", "tpu"])(q, k, v)
  assert _count(exported.mlir_module(), "tpu_custom_call") == 1
  ref_out, _ = case.call_reference(q, k, v, None)
  assert rel_err(exported.call(q, k, v), ref_out) < 1e-5
  assert rel_err(jax.jit(f)(q, k, v), ref_out) < 1e-5

  cotangent = jnp.asarray(rng.standard_normal(q.shape), q.dtype)

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

  grad = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))
  exported = export.export(grad, platforms=["cpu", "tpu"])(q, k, v)
  # Forward and both backward kernels; traced on this host, the TPU's
  # backward recomputes its forward (the residuals kept are the host's).
  assert _count(exported.mlir_module(), "tpu_custom_call") == 4
  want = jax.grad(loss(lambda q, k, v: case.call_reference(
      q, k, v, None, jit=False)[0]), argnums=(0, 1, 2))(q, k, v)
  for got, ref in zip(exported.call(q, k, v), want):
    assert rel_err(got, ref) < 1e-5
  # Lowered for a platform the mapping does not name, JAX refuses.
  with pytest.raises(Exception, match="cuda"):
    export.export(jax.jit(f), platforms=["cuda"])(q, k, v)


def test_implementation_mapping_is_validated():
  q, k, v = random_qkv(fresh_rng(), t=8, s=8, n=2, k=2, h=16)
  for bad, match in (({"gpu": None}, "'gpu' is not a lowering platform"),
                     ({}, "empty mapping"),
                     ({"cpu": "banana"}, "unknown backend name"),
                     ({"cpu": 3}, "got 3")):
    with pytest.raises(ValueError, match=match):
      jflash.dot_product_attention(q, k, v, implementation=bad)


def test_export_under_a_tpu_mesh_keeps_the_tpu_residuals():
  """Traced for a TPU (an abstract mesh of TPU devices), the gradient's
  backward uses the forward's residuals: three kernels, as with the TPU
  backend named."""
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType
  mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                      abstract_device=AbstractDevice(
                          device_kind="TPU v5 lite", num_cores=1,
                          platform="tpu"))
  case = _case(fresh_rng(), is_causal=True)
  q, k, v = case.arrays[:3]
  f = _attention(case)
  grad = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1,
                                                                     2)))
  with jax.sharding.use_abstract_mesh(mesh):
    exported = export.export(grad, platforms=["tpu"])(q, k, v)
  assert _count(exported.mlir_module(), "tpu_custom_call") == 3


def test_inputs_sharded_on_a_platform_are_traced_for_it():
  """Arguments whose sharding names another platform's devices (an
  abstract mesh of TPU devices) are traced for that platform."""
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType
  mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                      abstract_device=AbstractDevice(
                          device_kind="TPU v6 lite", num_cores=1,
                          platform="tpu"))
  case = _case(fresh_rng(), is_causal=True)
  specs = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=jax.NamedSharding(mesh, jax.P()))
           for x in case.arrays[:3]]
  jaxpr = str(jax.jit(_attention(case)).trace(*specs).jaxpr)
  assert "pallas_call" in jaxpr


def test_export_for_cuda_gets_the_hopper_kernels():
  """Traced for a Hopper GPU from this host (cuDNN's lowering needs a real
  GPU and declines here), a CUDA export holds Mosaic GPU kernels, and a
  three-platform program holds each platform's kernels."""
  rng = fresh_rng()
  q, k, v = random_qkv(rng, t=128, s=128, n=2, k=2, h=64,
                       dtype=jnp.bfloat16)
  case = Case(q, k, v, kwargs=dict(is_causal=True))
  every = Case(q, k, v, kwargs=dict(
      is_causal=True, implementation=dict.fromkeys(("cpu", "cuda", "tpu"))))
  with jflash.lowering_for("cuda", "NVIDIA H100 80GB HBM3"):
    exported = export.export(jax.jit(_attention(case)),
                             platforms=["cuda"])(q, k, v)
    assert "mosaic_gpu_v2" in _custom_calls(exported.mlir_module())
    exported = export.export(jax.jit(_attention(every)),
                             platforms=["cpu", "cuda", "tpu"])(q, k, v)
  assert {"mosaic_gpu_v2", "tpu_custom_call"} <= _custom_calls(
      exported.mlir_module())
  ref_out, _ = case.call_reference(q, k, v, None)
  assert rel_err(exported.call(q, k, v), ref_out) < 2e-2
  # An unknown or non-Hopper GPU gets the portable program.
  with jflash.lowering_for("cuda", "NVIDIA A100-SXM4-80GB"):
    exported = export.export(jax.jit(_attention(case)),
                             platforms=["cuda"])(q, k, v)
  assert "mosaic_gpu_v2" not in _custom_calls(exported.mlir_module())


def test_host_lowering_is_the_host_backend_alone():
  """Lowered for this host only, the program holds no other platform's
  kernels and no conditional: the same program as the host's backend
  named explicitly."""
  case = _case(fresh_rng(), is_causal=True)
  q, k, v = case.arrays[:3]
  host = jax.export.default_export_platform()
  explicit = jflash.default_order()[0]

  def named(q, k, v):
    return jflash.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=explicit)

  compiled = jax.jit(_attention(case)).lower(q, k, v).compile().as_text()
  assert "conditional" not in compiled
  if host != "tpu":
    assert "tpu_custom_call" not in compiled
  def instructions(text):  # shape and opcode of every instruction
    return sorted(re.findall(r"= (\S+) ([\w-]+)\(", text))
  assert len(instructions(compiled)) > 10
  assert instructions(compiled) == instructions(
      jax.jit(named).lower(q, k, v).compile().as_text())
  # The gradient too: the backward keeps the host backend's residuals.
  grads = [jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(),
                            argnums=(0, 1, 2))).lower(q, k, v).compile()
           for fn in (_attention(case), named)]
  assert "tpu_custom_call" not in grads[0].as_text() or host == "tpu"
  assert instructions(grads[0].as_text()) == instructions(grads[1].as_text())


def test_selected_implementation_per_platform():
  q, k, v = random_qkv(fresh_rng(), dtype=jnp.bfloat16)
  assert jflash.selected_implementation(q, k, v, platform="tpu") == \
      "mosaic_tpu"
  assert jflash.selected_implementation(q, k, v, platform="cpu") == "xla"
  # A dense mask is declined by the TPU kernels for that platform only.
  mask = jnp.ones((12, 12), bool)
  assert jflash.selected_implementation(q, k, v, mask=mask,
                                        platform="tpu") == "xla"
  with pytest.raises(ValueError, match="platform.*'banana'.*known"):
    jflash.selected_implementation(q, k, v, platform="banana")


def test_default_order_rejects_unknown_platforms():
  with pytest.raises(ValueError, match=r"'banana'.*known.*cpu.*cuda.*tpu"):
    jflash.default_order("banana")
  assert jflash.default_order("gpu") == jflash.default_order("cuda")
  assert jflash.default_order("tpu") == ("mosaic_tpu", "xla")


# ---------------------------------------------------------- which backend
def test_backend_is_named_in_the_hlo():
  case = _case(fresh_rng(), is_causal=True)
  q, k, v = case.arrays[:3]
  lowered = jax.jit(_attention(case)).lower(q, k, v)
  name = jflash.selected_implementation(q, k, v, is_causal=True)
  assert f"jflash/{name}" in lowered.as_text(debug_info=True)
  assert f"jflash/{name}" in lowered.compile().as_text()

  def explicit(q, k, v):
    return jflash.dot_product_attention(q, k, v, implementation="xla")
  assert "jflash/xla" in jax.jit(explicit).lower(q, k, v).compile().as_text()


def test_choice_logged_once_per_signature(caplog, monkeypatch):
  from jflash.core import dispatch
  dispatch._logged.clear()
  rng = fresh_rng()
  first = _case(rng, is_causal=True)
  q, k, v = first.arrays[:3]
  q2, k2, v2 = random_qkv(rng, t=24, s=24, n=4, k=2, h=32)
  with caplog.at_level(logging.DEBUG, logger="jflash"):
    for _ in range(2):
      jax.jit(_attention(first))(q, k, v)  # traced twice, logged once
      jflash.dot_product_attention(q2, k2, v2)  # eager, twice
  records = [r for r in caplog.records if r.name == "jflash"]
  assert len(records) == 2, [r.getMessage() for r in records]
  assert all(r.levelno == logging.DEBUG for r in records)
  host = jax.export.default_export_platform()
  assert "T=40" in records[0].getMessage()
  assert "causal" in records[0].getMessage()
  assert f"{host} -> {jflash.default_order()[0]}" in records[0].getMessage()
  assert "T=24" in records[1].getMessage()

  dispatch._logged.clear()
  caplog.clear()
  monkeypatch.setenv(dispatch.LOG_LEVEL_ENV, "INFO")
  with caplog.at_level(logging.INFO, logger="jflash"):
    jflash.dot_product_attention(q2, k2, v2)
  assert [r.levelno for r in caplog.records if r.name == "jflash"] == [
      logging.INFO]


def test_log_memo_is_bounded():
  from jflash.core import dispatch
  dispatch._logged.clear()
  q, k, v = random_qkv(fresh_rng(), t=4, s=4)
  call, _ = jflash.attention._canonicalize(
      q, k, v, None, None, scale=None, is_causal=False,
      query_seq_lengths=None, key_value_seq_lengths=None,
      local_window_size=None, segment_ids=None, logits_soft_cap=None)
  for i in range(dispatch._LOG_MEMO_SIZE + 5):
    dispatch._log_choice(call, f"backend{i}")
  assert len(dispatch._logged) == dispatch._LOG_MEMO_SIZE


# ------------------------------------------------ per-call choice on Hopper
def _canonical(q, k, v, **kwargs):
  call, _ = jflash.attention._canonicalize(
      q, k, v, None, None, scale=None,
      is_causal=kwargs.get("is_causal", False),
      query_seq_lengths=None,
      key_value_seq_lengths=kwargs.get("key_value_seq_lengths"),
      local_window_size=kwargs.get("local_window_size"), segment_ids=None,
      logits_soft_cap=None)
  return call


def _shapes(t, h, n=4, kv_heads=4, dtype=jnp.bfloat16):
  q = jax.ShapeDtypeStruct((1, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((1, t, kv_heads, h), dtype)
  return q, kv, kv


def test_gpu_model_of_device_kinds():
  from jflash.core import gpu_table
  assert gpu_table.gpu_model("NVIDIA H100 80GB HBM3") == "H100"
  assert gpu_table.gpu_model("NVIDIA H200") == "H200"
  assert gpu_table.gpu_model("TPU v5 lite") is None
  assert gpu_table.gpu_model("cpu") is None


def test_table_lookup_buckets_and_fallbacks():
  from jflash.core import gpu_table
  E = gpu_table.Entry
  table = (E("H100", 128, 1024, "causal", False, "bfloat16", "cudnn",
             "mosaic_gpu", "a"),
           E("H100", 128, 4096, "causal", False, "bfloat16", "mosaic_gpu",
             "cudnn", "b"),
           E("H100", 64, 4096, "none", False, "bfloat16", "mosaic_gpu",
             "mosaic_gpu", "c"))

  def find(gpu, t, h, **kwargs):
    n_kv = kwargs.pop("kv_heads", 4)
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    q, k, v = (jnp.zeros(s.shape, s.dtype)
               for s in _shapes(t, h, kv_heads=n_kv, dtype=dtype))
    entry = gpu_table.lookup(gpu, _canonical(q, k, v, **kwargs), table)
    return entry and entry.source

  assert find("H100", 1024, 128, is_causal=True) == "a"
  assert find("H100", 4096, 128, is_causal=True) == "b"
  assert find("H100", 3000, 128, is_causal=True) == "b"  # log-nearest
  assert find("H100", 1500, 128, is_causal=True) == "a"
  assert find("H100", 64, 128, is_causal=True) == "a"
  assert find("H100", 65536, 128, is_causal=True) == "b"
  assert find("H100", 1024, 96, is_causal=True) == "a"  # runs at 128
  assert find("H100", 1024, 40) == "c"  # runs at 64
  assert find("H100", 1024, 64, is_causal=True) is None  # not measured
  assert find("H100", 64, 264) is None  # above 256
  assert find("H200", 1024, 128, is_causal=True) is None  # other model
  assert find(None, 1024, 128, is_causal=True) is None
  assert find("H100", 1024, 128, is_causal=True, kv_heads=2) is None  # GQA
  assert find("H100", 1024, 128, is_causal=True, dtype=jnp.float16) is None
  assert find("H100", 1024, 128, is_causal=True,
              local_window_size=(100, 0)) is None  # window not measured
  assert find("H100", 1024, 128, is_causal=True,
              key_value_seq_lengths=jnp.ones(1, jnp.int32)) is None


def test_call_orders_follow_the_table_on_that_gpu_only():
  from jflash.core import gpu_table, registry
  from jflash.core.platform import Target
  names = lambda order: tuple(b.name for b in order)
  q, k, v = (jnp.zeros(s.shape, s.dtype) for s in _shapes(16384, 128))
  causal = _canonical(q, k, v, is_causal=True)
  entry = gpu_table.lookup("H100", causal)
  assert entry is not None and entry.seq_len == 16384
  call_orders = registry.call_orders
  h100 = "NVIDIA H100 80GB HBM3"
  inference, training = call_orders(causal, Target("cuda", h100))
  assert names(inference)[0] == entry.inference
  assert names(training)[0] == entry.training
  for order in (inference, training):
    assert sorted(names(order)) == sorted(jflash.default_order("cuda"))
  for p in ("cpu", "tpu"):  # nothing changes off CUDA, whatever the kind
    orders = call_orders(causal, Target(p, h100))
    assert orders[0] == orders[1]
    assert names(orders[0]) == jflash.default_order(p)
  # A model with no entries, or a call no entry covers, keeps the order.
  for kind in ("NVIDIA A100-SXM4-80GB", ""):
    orders = call_orders(causal, Target("cuda", kind))
    assert orders[0] == orders[1]
    assert names(orders[0]) == jflash.default_order("cuda")


def test_forward_only_and_training_calls_reach_their_backends(monkeypatch):
  """Two CPU stand-ins: a call whose derivative is not taken runs the
  inference backend, one under jax.grad runs the training backend's
  forward and backward, and both compute the reference's values."""
  from jflash.backends import XlaBackend, XlaConfig
  inference = XlaBackend(XlaConfig(block_q=8, block_kv=8),
                         name="xla_for_inference")
  training = XlaBackend(XlaConfig(block_q=16, block_kv=8),
                        name="xla_for_training")
  from jflash.core import registry
  default = registry.call_orders

  def call_orders(call, target):
    if target.platform != "cpu":
      return default(call, target)
    fallback = (XlaBackend(),)
    return (inference,) + fallback, (training,) + fallback

  monkeypatch.setattr(registry, "call_orders", call_orders)
  rng = fresh_rng()
  case = _case(rng, is_causal=True)
  q, k, v = case.arrays[:3]
  cotangent = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  f = _attention(case)
  loss = lambda q, k, v: jnp.sum(f(q, k, v) * cotangent)

  forward = jax.jit(f).lower(q, k, v).compile().as_text()
  assert "jflash/xla_for_inference" in forward
  assert "jflash/xla_for_training" not in forward
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  text = grad.lower(q, k, v).compile().as_text()
  assert "jflash/xla_for_training" in text
  assert "jflash/xla_for_inference" not in text

  ref_out, _ = case.call_reference(q, k, v, None)
  assert rel_err(jax.jit(f)(q, k, v), ref_out) < 1e-5
  value, grads = grad(q, k, v)
  ref_loss = lambda q, k, v: jnp.sum(
      case.call_reference(q, k, v, None, jit=False)[0] * cotangent)
  ref_value, ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(
      q, k, v)
  assert rel_err(value, ref_value) < 1e-5
  for got, want in zip(grads, ref_grads):
    assert rel_err(got, want) < 1e-5
  # vmap of the training call.
  batched = jax.vmap(jax.grad(loss))(jnp.stack([q, -q]), jnp.stack([k, k]),
                                     jnp.stack([v, v]))
  assert rel_err(batched[1], jax.grad(ref_loss)(-q, k, v)) < 1e-5

  assert jflash.selected_implementation(q, k, v, is_causal=True) == \
      "xla_for_inference"
  assert jflash.selected_implementation(
      q, k, v, is_causal=True, for_training=True) == "xla_for_training"


def test_table_is_what_the_builder_makes_of_the_checked_in_results():
  from benchmarks import dispatch_table
  from jflash.core import gpu_table
  from pathlib import Path
  results = Path(__file__).parent.parent / "benchmarks" / "results"
  kind, h100_rows = dispatch_table.read(
      results / "2026-12-07-h100-grid-6704647" / "grid.json")
  assert gpu_table.gpu_model(kind) == "H100"
  kind, h200_rows = dispatch_table.read(
      results / "2026-12-04-h200-grid-2dfdde0" / "grid.json")
  assert gpu_table.gpu_model(kind) == "H200"
  built = (dispatch_table.build(h100_rows, "H100", gpu_table._H100)
           + dispatch_table.build(h200_rows, "H200", gpu_table._H200))
  assert tuple(built) == gpu_table.TABLE


def test_builder_picks_the_faster_backend_per_pass(tmp_path):
  from benchmarks import dispatch_table
  rng = fresh_rng()
  rows, want = [], {}
  for s in (1024, 4096):
    fwd = {"cudnn": rng.uniform(300, 600), "jflash:mosaic_gpu":
           rng.uniform(300, 600)}
    bwd = {"cudnn": rng.uniform(300, 600), "jflash:mosaic_gpu":
           rng.uniform(300, 600)}
    for impl in fwd:
      rows.append(dict(impl=impl, B=1, S=s, H=16, D=128, causal=True,
                       fwd_tflops=fwd[impl], fwdbwd_tflops=bwd[impl]))
    rows.append(dict(impl="tokamax_mosaic", B=1, S=s, H=16, D=128,
                     causal=True, fwd_tflops=900.0, fwdbwd_tflops=900.0))
    pick = lambda d: ("mosaic_gpu" if d["jflash:mosaic_gpu"] > 1.01
                      * d["cudnn"] else "cudnn")
    want[s] = (pick(fwd), pick(bwd))
  path = tmp_path / "runs.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows))
  entries = dispatch_table.build(dispatch_table.read(path)[1], "H100", "x")
  assert {e.seq_len: (e.inference, e.training) for e in entries} == want
  assert all((e.head_dim, e.mask, e.gqa) == (128, "causal", False)
             for e in entries)


def test_a_crash_of_the_target_platforms_backend_propagates(monkeypatch):
  """A backend that fails (other than by declining) raises its error:
  traced for a TPU, a broken TPU kernel is not replaced silently."""
  from jflash.backends import mosaic_tpu

  def broken(self, call):
    raise TypeError("broken kernel")
  monkeypatch.setattr(mosaic_tpu.MosaicTpuBackend, "__call__", broken)
  case = _case(fresh_rng(), is_causal=True)
  q, k, v = case.arrays[:3]
  jax.jit(_attention(case)).trace(q, k, v)  # not traced for a TPU here
  with jflash.lowering_for("tpu", "TPU v5 lite"), \
      pytest.raises(TypeError, match="broken kernel"):
    jax.jit(_attention(case)).trace(q, k, v)


def test_builder_merge_keeps_each_cell_of_the_later_run():
  from benchmarks import dispatch_table
  cell = (128, 4096, "none", False, "bfloat16")
  other = (64, 4096, "none", False, "bfloat16")
  earlier = dispatch_table.build(
      [(cell, "cudnn", "fwd", 500.0), (cell, "mosaic_gpu", "fwd", 600.0),
       (cell, "cudnn", "fwdbwd", 500.0), (cell, "mosaic_gpu", "fwdbwd", 400.0),
       (other, "cudnn", "fwd", 500.0), (other, "mosaic_gpu", "fwd", 400.0),
       (other, "cudnn", "fwdbwd", 500.0),
       (other, "mosaic_gpu", "fwdbwd", 400.0)], "H100", "a")
  later = dispatch_table.build(
      [(cell, "cudnn", "fwd", 600.0), (cell, "mosaic_gpu", "fwd", 500.0),
       (cell, "cudnn", "fwdbwd", 400.0), (cell, "mosaic_gpu", "fwdbwd", 500.0)],
      "H100", "b")
  merged = {(e.head_dim, e.seq_len): e
            for e in dispatch_table.merge(earlier, later)}
  assert (merged[128, 4096].inference, merged[128, 4096].training,
          merged[128, 4096].source) == ("cudnn", "mosaic_gpu", "b")
  assert merged[64, 4096].source == "a"
