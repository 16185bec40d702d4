"""Every TPU kernel compiled by the real TPU compiler, for each generation.

With ``libtpu`` installed (``pip install '.[tpu]'``; ``make test`` installs
it), ``jax.experimental.topologies`` gives TPU devices on a CPU host, and
``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",)).compile()`` on
arguments sharded over them runs libtpu's full compilation, Mosaic kernels
included: what a TPU accepts (block shapes, layouts, VMEM, dtype rules),
where interpret mode only checks the arithmetic.  Each case asserts that
the compiled program holds jflash's kernels (no fallback to ``xla``) and
that its compiled memory fits the chip.  Speed still needs a TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jflash
from jflash import masks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="needs libtpu (pip install '.[tpu]'; make test installs it)")

GIB = 1 << 30
GENERATIONS = {
    # topology, HBM per chip (one JAX device)
    "v4": ("v4:2x2x1", 32 * GIB),
    "v5e": ("v5e:2x2", 16 * GIB),
    "v5p": ("v5p:2x2x1", 95 * GIB),
    "v6e": ("v6e:2x2", 32 * GIB),
}


@functools.cache
def _devices(generation: str) -> tuple:
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  topology = topologies.get_topology_desc(GENERATIONS[generation][0], "tpu")
  return tuple(topology.devices)


def _mesh(generation: str, size: int = 1, name: str = "x"):
  return jax.sharding.Mesh(np.array(_devices(generation)[:size]), (name,))


@dataclasses.dataclass(frozen=True)
class Compiled:
  kernels: tuple[str, ...]   # jflash Mosaic kernels, in program order
  memory: object             # CompiledMemoryStats


@functools.cache
def _compile(fn, specs) -> Compiled:
  # Lowered under the chips' abstract mesh, as an export for a TPU from
  # another host is: Pallas reads the TPU generation from it (for lax.sign,
  # which a mask function's floor division or remainder may use).
  mesh = specs[0].sharding.mesh
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(fn).trace(*specs).lower(
        lowering_platforms=("tpu",)).compile()
  # One Mosaic custom call per kernel, named after the kernel.
  kernels = tuple(
      re.match(r"\s*%(jflash_mosaic_tpu_[a-z]+)", line).group(1)
      for line in compiled.as_text().splitlines()
      if 'custom_call_target="tpu_custom_call"' in line
      and re.match(r"\s*%jflash_mosaic_tpu_", line))
  return Compiled(kernels, compiled.memory_analysis())


def _fits(generation: str, memory) -> bool:
  used = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  return used <= GENERATIONS[generation][1]


def _spec(generation, shape, dtype, mesh=None, spec=P()):
  mesh = mesh or _mesh(generation)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


# ---------------------------------------------------------------- attention
@dataclasses.dataclass(frozen=True)
class Case:
  """One attention call: shapes, dtype and features."""

  name: str
  t: int
  s: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str
  kwargs: tuple = ()   # (name, value) pairs of dot_product_attention
  grad: bool = True
  batch: int = 2

  def arrays(self, generation):
    dt = jnp.dtype(self.dtype)
    q = _spec(generation, (self.batch, self.t, self.heads, self.head_dim), dt)
    kv = _spec(generation, (self.batch, self.s, self.kv_heads,
                            self.head_dim), dt)
    return q, kv, kv


def _int_spec(generation, shape):
  return _spec(generation, shape, jnp.int32)


CASES = (
    # Every mask feature and dtype, head dims 64/128/256 and a padded one,
    # GQA and MQA, T != S, odd lengths; the long cell's forward only.
    Case("causal-bf16-h128", 1024, 1024, 8, 8, 128, "bfloat16",
         (("is_causal", True),)),
    Case("window-lengths-f32-h64-gqa", 1000, 1000, 8, 2, 64, "float32",
         (("local_window_size", (255, 0)), ("is_causal", True),
          ("lengths", True))),
    Case("segments-softcap-f16-h256", 768, 768, 4, 4, 256, "float16",
         (("segments", True), ("logits_soft_cap", 30.0))),
    Case("cross-mqa-bf16-h96", 1000, 1536, 8, 1, 96, "bfloat16",
         (("lengths", True), ("local_window_size", (300, 200)))),
    # ALiBi: standard slopes as constants, and per-batch slopes as an
    # operand together with offsets-free lengths.
    Case("alibi-causal-bf16-h128-gqa", 1024, 1024, 8, 2, 128, "bfloat16",
         (("is_causal", True), ("alibi", "heads"))),
    Case("alibi-window-f32-h64", 1000, 1000, 4, 4, 64, "float32",
         (("local_window_size", (255, 255)), ("alibi", "batch"),
          ("lengths", True))),
    # Mask functions with integer division and remainder in the kernels.
    Case("chunked-causal-bf16-h128", 2048, 2048, 4, 4, 128, "bfloat16",
         (("mask_fn", masks.ChunkedCausal(512)),)),
    Case("dilated-global-f32-h64", 1000, 1000, 4, 2, 64, "float32",
         (("mask_fn", masks.Dilated(64, 3)), ("lengths", True))),
    Case("long-causal-bf16-h128", 2048, 131072, 4, 1, 128, "bfloat16",
         (("is_causal", False), ("lengths", True)), grad=False, batch=1),
)


def _attention_fn(case: Case):
  kwargs = dict(case.kwargs)
  lengths = kwargs.pop("lengths", False)
  segments = kwargs.pop("segments", False)
  alibi = kwargs.pop("alibi", None)

  def attend(q, k, v, *extra):
    extra = list(extra)
    if lengths:
      kwargs_ = dict(kwargs, query_seq_lengths=extra.pop(0),
                     key_value_seq_lengths=extra.pop(0))
    else:
      kwargs_ = dict(kwargs)
    if segments:
      kwargs_["segment_ids"] = (extra.pop(0), extra.pop(0))
    if alibi == "heads":
      kwargs_["alibi_slopes"] = jflash.alibi_slopes(case.heads)
    elif alibi == "batch":
      kwargs_["alibi_slopes"] = extra.pop(0)
    return jflash.dot_product_attention(q, k, v, **kwargs_)

  def extra_specs(generation):
    out = []
    if lengths:
      out += [_int_spec(generation, (case.batch,))] * 2
    if segments:
      out += [_int_spec(generation, (case.batch, case.t)),
              _int_spec(generation, (case.batch, case.s))]
    if alibi == "batch":
      out.append(_spec(generation, (case.batch, case.heads), jnp.float32))
    return tuple(out)

  if not case.grad:
    return attend, extra_specs

  def grad(q, k, v, *extra):
    def loss(q, k, v):
      return attend(q, k, v, *extra).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  return grad, extra_specs


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_attention_kernels_compile(generation, case):
  fn, extra_specs = _attention_fn(case)
  compiled = _compile(fn, case.arrays(generation) + extra_specs(generation))
  want = (["jflash_mosaic_tpu_dkv", "jflash_mosaic_tpu_dq",
           "jflash_mosaic_tpu_forward"] if case.grad
          else ["jflash_mosaic_tpu_forward"])
  assert sorted(compiled.kernels) == want, compiled.kernels
  assert _fits(generation, compiled.memory), compiled.memory


# ------------------------------------------------- context-parallel blocks
@pytest.mark.parametrize("generation", sorted(GENERATIONS))
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_blocks_compile(generation, strategy):
  """A sequence sharded over 4 chips: each chip's blocks at their global
  offsets run the TPU kernels (forward and both backward kernels per
  block, ALiBi at global positions), with the collectives of the
  strategy."""
  mesh = jax.sharding.Mesh(np.array(_devices(generation)[:4]), ("c",),
                           axis_types=(jax.sharding.AxisType.Explicit,))
  spec = _spec(generation, (1, 4096, 8, 128), jnp.bfloat16, mesh,
               P(None, "c"))
  parallel = jflash.ContextParallel(strategy=strategy)

  def grad(q, k, v):
    def loss(q, k, v):
      return jflash.dot_product_attention(
          q, k, v, is_causal=True, local_window_size=(1500, 0),
          alibi_slopes=jflash.alibi_slopes(8),
          context_parallel=parallel).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  compiled = _compile(grad, (spec, spec, spec))
  assert set(compiled.kernels) == {"jflash_mosaic_tpu_forward",
                                   "jflash_mosaic_tpu_dq",
                                   "jflash_mosaic_tpu_dkv"}, compiled.kernels
  assert _fits(generation, compiled.memory), compiled.memory


# ------------------------------------------------------------------ decode
DECODE_CASES = (
    # name, new tokens, heads, kv heads, head dim, dtype, page size, window
    # [, ALiBi and a mask function]
    ("t1-bf16-h128-contig", 1, 32, 8, 128, "bfloat16", None, None),
    ("t4-f32-h128-paged64", 4, 16, 4, 128, "float32", 64, (512, 0)),
    ("t2-f32-h64-mqa-paged128", 2, 8, 1, 64, "float32", 128, None),
    ("t8-bf16-h256-contig-long", 8, 8, 2, 256, "bfloat16", None, (4096, 0)),
    ("t4-bf16-h128-paged64-alibi-chunked", 4, 16, 4, 128, "bfloat16", 64,
     None, True),
)


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c[0])
def test_decode_kernel_compiles(generation, case):
  _, t, heads, kv_heads, head_dim, dtype, page, window, *variants = case
  variants = dict(alibi_slopes=jflash.alibi_slopes(heads),
                  mask_fn=masks.ChunkedCausal(1024)) if variants else {}
  batch, capacity = 4, 131072 if "long" in case[0] else 8192
  dt = jnp.dtype(dtype)
  query = _spec(generation, (batch, t, heads, head_dim), dt)
  if page is None:
    cache = _spec(generation, (batch, capacity, kv_heads, head_dim), dt)
    extra = ()
  else:
    pages = batch * capacity // page
    cache = _spec(generation, (pages, page, kv_heads, head_dim), dt)
    extra = (_int_spec(generation, (batch, capacity // page)),)
  lengths = _int_spec(generation, (batch,))

  def decode(q, k, v, lengths, *table):
    return jflash.decode_attention(
        q, k, v, lengths, block_table=table[0] if table else None,
        local_window_size=window, implementation="mosaic_tpu", **variants)

  compiled = _compile(decode, (query, cache, cache, lengths) + extra)
  assert compiled.kernels == ("jflash_mosaic_tpu_decode",), compiled.kernels
  assert _fits(generation, compiled.memory), compiled.memory


@pytest.mark.parametrize("generation", ["v5e"])
def test_decode_kernel_declines_float16_on_a_tpu(generation):
  """float16 caches: the kernel declines on a TPU (no float16 vector
  loads in Mosaic) and the default's ``xla`` decode compiles."""
  spec = _spec(generation, (2, 1, 8, 128), jnp.float16)
  cache = _spec(generation, (2, 1024, 2, 128), jnp.float16)
  lengths = _int_spec(generation, (2,))
  with pytest.raises(NotImplementedError, match="float16"):
    jax.jit(lambda q, k, v, n: jflash.decode_attention(
        q, k, v, n, implementation="mosaic_tpu")).trace(
            spec, cache, cache, lengths)
  compiled = _compile(lambda q, k, v, n: jflash.decode_attention(q, k, v, n),
                      (spec, cache, cache, lengths))
  assert compiled.kernels == ()


# ------------------------------------------------------ the export route
def test_explicit_mosaic_tpu_exports_for_a_tpu_from_this_host():
  """``jax.export`` for a TPU from this host with the kernels named, with
  no TPU devices at hand: traced inside ``jflash.lowering_for``."""
  q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)

  def attend(q, k, v):
    return jflash.dot_product_attention(q, k, v, is_causal=True,
                                        implementation="mosaic_tpu")

  with jflash.lowering_for("tpu", "TPU v6 lite"):
    exported = jax.export.export(jax.jit(attend), platforms=["tpu"])(q, q, q)
  assert "tpu_custom_call" in exported.mlir_module()


# ------------------------------------------------------- default tilings
@pytest.mark.parametrize("generation", sorted(GENERATIONS))
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_blocks_compile(generation, head_dim, dtype):
  """Each generation's default tiling (config.BLOCKS) compiles with the
  kernels' largest footprint, segment ids and a soft cap, at sequences
  longer than one tile."""
  from jflash.backends.mosaic_tpu import config  # pylint: disable=import-outside-toplevel
  gen = config.generation_of(_devices(generation)[0].device_kind)
  assert gen.name == generation
  blocks = config.default_blocks(gen, head_dim, jnp.dtype(dtype).itemsize)
  case = Case(f"default-{generation}", 2048, 2048, 4, 4, head_dim, dtype,
              (("segments", True), ("logits_soft_cap", 30.0),
               ("is_causal", True)), batch=1)
  fn, extra_specs = _attention_fn(case)
  compiled = _compile(fn, case.arrays(generation) + extra_specs(generation))
  assert sorted(compiled.kernels) == ["jflash_mosaic_tpu_dkv",
                                      "jflash_mosaic_tpu_dq",
                                      "jflash_mosaic_tpu_forward"], blocks
