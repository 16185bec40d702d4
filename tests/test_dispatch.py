"""Backend choice: per lowering platform, named in the HLO, logged."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jflash
from jflash.backends import mosaic_gpu
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
def test_export_for_tpu_from_this_host_gets_the_tpu_kernels():
  case = _case(fresh_rng(), is_causal=True)
  exported = export.export(jax.jit(_attention(case)),
                           platforms=["tpu"])(*case.arrays[:3])
  assert "tpu_custom_call" in _custom_calls(exported.mlir_module())


@pytest.mark.parametrize("features", ["causal", "segments"])
def test_multi_platform_export_runs_here_and_holds_the_tpu_kernels(features):
  """One module for CPU and TPU: the TPU branch holds the Mosaic kernels
  (forward and both backward kernels for the gradient), and the module
  called on the CPU computes the reference's output and gradients."""
  rng = fresh_rng()
  kwargs = dict(is_causal=True)
  if features == "segments":
    kwargs["segment_ids"] = jnp.asarray(random_segments(rng, 2, 40))
  case = _case(rng, **kwargs)
  f = _attention(case)
  q, k, v = case.arrays[:3]
  exported = export.export(jax.jit(f), platforms=["cpu", "tpu"])(q, k, v)
  assert "tpu_custom_call" in _custom_calls(exported.mlir_module())
  ref_out, _ = case.call_reference(q, k, v, None)
  assert rel_err(exported.call(q, k, v), ref_out) < 1e-5

  cotangent = jnp.asarray(rng.standard_normal(q.shape), q.dtype)

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

  grad = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))
  exported = export.export(grad, platforms=["cpu", "tpu"])(q, k, v)
  assert exported.mlir_module().count("tpu_custom_call") == 3
  want = jax.grad(loss(lambda q, k, v: case.call_reference(
      q, k, v, None, jit=False)[0]), argnums=(0, 1, 2))(q, k, v)
  for got, ref in zip(exported.call(q, k, v), want):
    assert rel_err(got, ref) < 1e-5


def test_export_for_cuda_gets_the_hopper_kernels(monkeypatch):
  """With the host's GPU taken for a Hopper (cuDNN's lowering needs a real
  GPU and declines here), a CUDA export holds Mosaic GPU kernels, and a
  three-platform export holds each platform's kernels."""
  monkeypatch.setattr(mosaic_gpu, "_is_hopper", lambda: True)
  rng = fresh_rng()
  q, k, v = random_qkv(rng, t=128, s=128, n=2, k=2, h=64,
                       dtype=jnp.bfloat16)
  case = Case(q, k, v, kwargs=dict(is_causal=True))
  exported = export.export(jax.jit(_attention(case)),
                           platforms=["cuda"])(q, k, v)
  assert "mosaic_gpu_v2" in _custom_calls(exported.mlir_module())
  exported = export.export(jax.jit(_attention(case)),
                           platforms=["cpu", "cuda", "tpu"])(q, k, v)
  assert {"mosaic_gpu_v2", "tpu_custom_call"} <= _custom_calls(
      exported.mlir_module())
  ref_out, _ = case.call_reference(q, k, v, None)
  assert rel_err(exported.call(q, k, v), ref_out) < 2e-2


def test_host_lowering_is_the_host_backend_alone():
  """Lowered for this host only, the program holds no other platform's
  kernels and no conditional: the same program as the host's backend
  named explicitly."""
  from jflash.backends import dispatch
  case = _case(fresh_rng(), is_causal=True)
  q, k, v = case.arrays[:3]
  host = dispatch.host_platform()
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
  from jflash.backends import dispatch
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
  assert "T=40" in records[0].getMessage()
  assert "causal" in records[0].getMessage()
  assert "tpu -> mosaic_tpu" in records[0].getMessage()
  assert "T=24" in records[1].getMessage()

  dispatch._logged.clear()
  caplog.clear()
  monkeypatch.setenv(dispatch.LOG_LEVEL_ENV, "INFO")
  with caplog.at_level(logging.INFO, logger="jflash"):
    jflash.dot_product_attention(q2, k2, v2)
  assert [r.levelno for r in caplog.records if r.name == "jflash"] == [
      logging.INFO]


def test_log_memo_is_bounded():
  from jflash.backends import dispatch
  dispatch._logged.clear()
  q, k, v = random_qkv(fresh_rng(), t=4, s=4)
  call, _ = jflash.attention._canonicalize(
      q, k, v, None, None, scale=None, is_causal=False,
      query_seq_lengths=None, key_value_seq_lengths=None,
      local_window_size=None, segment_ids=None, logits_soft_cap=None)
  for i in range(dispatch._LOG_MEMO_SIZE + 5):
    dispatch._log_choice(call, {"cpu": f"backend{i}"})
  assert len(dispatch._logged) == dispatch._LOG_MEMO_SIZE
