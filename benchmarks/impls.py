"""The implementations the grid compares, as attention functions of a cell.

Each implementation turns a :class:`~benchmarks.cells.Cell` into
``attend(q, k, v, segment_ids) -> out`` (``segment_ids`` is None or int32
``[B, S]``), or raises :class:`Unsupported` when it cannot express the cell
at all; errors raised while tracing, compiling or running are the grid's to
record.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.cells import Cell

Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None],
                  jax.Array]


class Unsupported(Exception):
  """The implementation has no way to express this cell."""


@dataclasses.dataclass(frozen=True)
class Impl:
  """A named implementation.

  Attributes:
    name: the column name in the results.
    build: ``cell -> attend``; may raise :class:`Unsupported`.
    note: what exactly is called, for the results' metadata.
  """

  name: str
  build: Callable[[Cell], Attend]
  note: str


def _jflash(backend: str | None) -> Callable[[Cell], Attend]:
  def build(cell: Cell) -> Attend:
    import jflash

    def attend(q, k, v, segment_ids):
      return jflash.dot_product_attention(
          q, k, v, is_causal=cell.causal,
          local_window_size=cell.local_window_size, segment_ids=segment_ids,
          implementation=backend)
    return attend
  return build


def _segment_mask(segment_ids: jax.Array) -> jax.Array:
  """``[B, 1, S, S]`` bool: same segment."""
  return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def _jax_nn(implementation: str, max_logits_gib: float
            ) -> Callable[[Cell], Attend]:
  def build(cell: Cell) -> Attend:
    if cell.segments and implementation == "cudnn":
      raise Unsupported("jax.nn has no segment ids, and its cuDNN path is "
                        "not given a dense mask here")
    if cell.segments:
      gib = (cell.batch * cell.num_heads * cell.seq_len ** 2 * 4) / 2 ** 30
      if gib > max_logits_gib:
        raise Unsupported(f"segments as a dense mask: float32 logits of "
                          f"{gib:.0f} GiB exceed --xla-max-logits-gib")

    def attend(q, k, v, segment_ids):
      mask = None if segment_ids is None else _segment_mask(segment_ids)
      return jax.nn.dot_product_attention(
          q, k, v, mask=mask, is_causal=cell.causal,
          local_window_size=cell.local_window_size,
          implementation=implementation)
    return attend
  return build


def _placeholder_xprof() -> None:
  """Registers empty ``xprof.cli.tools`` modules.

  tokamax 0.0.17 imports ``xprof.cli.tools.get_kernel_stats_tool`` (xprof
  >= 2.23.1) at import time, for its own benchmarking helpers only; its
  attention does not use it.  Where that xprof release cannot be installed
  (the wheel is 25 MB and needs a newer index than some machines have),
  the placeholder lets tokamax import; calling the tool raises."""
  def get_kernel_stats_tool(*args, **kwargs):
    raise NotImplementedError("xprof is not installed; this is jflash's "
                              "benchmark placeholder")
  for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    sys.modules.setdefault(name, types.ModuleType(name))
  sys.modules["xprof.cli.tools"].get_kernel_stats_tool = get_kernel_stats_tool


def tokamax_module():
  """``tokamax`` when it can be imported, else None (it is optional)."""
  try:
    return importlib.import_module("tokamax")
  except ModuleNotFoundError as err:
    if err.name is None or not err.name.startswith("xprof"):
      return None
  except Exception:  # pylint: disable=broad-except
    return None
  _placeholder_xprof()
  for name in [m for m in sys.modules if m.startswith("tokamax")]:
    del sys.modules[name]  # drop the half-imported package
  try:
    return importlib.import_module("tokamax")
  except Exception:  # pylint: disable=broad-except
    return None


def _tokamax(cell: Cell) -> Attend:
  tokamax = tokamax_module()
  if tokamax is None:
    raise Unsupported("tokamax is not installed (pip install "
                      "'jflash[tokamax]')")
  if cell.segments:
    raise Unsupported("tokamax has no segment ids on the GPU")
  extra = {}
  if cell.window is not None:
    extra["local_window_size"] = cell.local_window_size

  def attend(q, k, v, segment_ids):
    del segment_ids
    return tokamax.dot_product_attention(q, k, v, is_causal=cell.causal,
                                         **extra)
  return attend


def _splash(interpret: bool) -> Callable[[Cell], Attend]:
  """JAX's splash attention (Pallas TPU), the TPU peer: queries scaled by
  ``1 / sqrt(H)`` (splash does not scale), one mask per head, 512-row
  blocks (the sequence's length when shorter); run on a TPU, or with
  ``interpret`` on the CPU to check the wiring."""
  def build(cell: Cell) -> Attend:
    if not interpret and jax.default_backend() != "tpu":
      raise Unsupported("splash attention runs on TPUs")
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib)
    shape = (cell.seq_len, cell.seq_len)
    if cell.window is not None:
      mask = mask_lib.LocalMask(shape, window_size=(cell.window, 0),
                                offset=0)
    elif cell.causal:
      mask = mask_lib.CausalMask(shape)
    else:
      mask = mask_lib.FullMask(shape)
    block = min(512, cell.seq_len)
    sizes = kernel_lib.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block)
    kernel = kernel_lib.make_splash_mha(
        mask_lib.MultiHeadMask([mask] * cell.num_heads), block_sizes=sizes,
        head_shards=1, q_seq_shards=1, interpret=interpret)
    scale = cell.head_dim ** -0.5

    def attend(q, k, v, segment_ids):
      q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q * scale, k, v))
      if segment_ids is None:
        out = jax.vmap(kernel)(q, k, v)
      else:
        out = jax.vmap(lambda q, k, v, ids: kernel(
            q, k, v, segment_ids=kernel_lib.SegmentIds(q=ids, kv=ids)))(
                q, k, v, segment_ids)
      return jnp.swapaxes(out, 1, 2)
    return attend
  return build


def _jflash_backend_name(text: str):
  """The ``implementation=`` value for ``jflash:<text>``: a backend name,
  None for jflash's own choice, ``mosaic_gpu_fused`` (the Hopper kernels
  with ``MosaicGpuConfig(fuse_dq=True)``), or ``mosaic_gpu+field=value...``
  (the Hopper kernels with those ``MosaicGpuConfig`` fields, e.g.
  ``mosaic_gpu+overlap_sdp=true+dq_slots=2``; ``true``/``false`` are
  booleans, anything else an integer), so that a configuration is timed
  interleaved with the default and the peers in one run."""
  if text in ("", "default", "none", "None"):
    return None
  if text == "mosaic_gpu_fused":
    from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
    return MosaicGpuBackend(MosaicGpuConfig(fuse_dq=True),
                            name="mosaic_gpu_fused")
  backend, _, fields = text.partition("+")
  if fields:
    if backend != "mosaic_gpu":
      raise ValueError(f"configuration fields are read for mosaic_gpu only, "
                       f"got jflash:{text!r}")
    from jflash.backends.mosaic_gpu import MosaicGpuBackend, MosaicGpuConfig
    return MosaicGpuBackend(MosaicGpuConfig(**config_fields(
        fields.split("+"))), name=text)
  return text


def config_fields(items: list[str]) -> dict:
  """``["overlap_sdp=true", "dq_slots=2"]`` -> ``MosaicGpuConfig`` keyword
  arguments (``true``/``false`` are booleans, anything else an integer);
  the command-line form of a configuration, shared with ``tools/``."""
  from jflash.backends.mosaic_gpu import MosaicGpuConfig
  known = {f.name for f in dataclasses.fields(MosaicGpuConfig)}
  fields = {}
  for item in items:
    key, eq, value = item.partition("=")
    if not eq or key not in known:
      raise ValueError(f"expected MosaicGpuConfig fields as name=value, "
                       f"got {item!r} (fields: "
                       f"{', '.join(sorted(known))})")
    low = value.lower()
    try:
      fields[key] = (low == "true") if low in ("true", "false") else int(
          value)
    except ValueError:
      raise ValueError(f"MosaicGpuConfig.{key} takes true, false or an "
                       f"integer, got {value!r}") from None
  return fields


def make_impls(names: list[str], *, jflash_impl: str = "mosaic_gpu",
               max_logits_gib: float = 64.0) -> list[Impl]:
  """The implementations named in ``names``.

  Names: ``jflash`` (backend ``jflash_impl``; ``default`` lets jflash
  choose), ``jflash:<backend>`` for a specific backend (or
  ``jflash:mosaic_gpu_fused``, the one-pass backward, or
  ``jflash:mosaic_gpu+field=value+...``, a configuration), ``jax_nn_cudnn``,
  ``jax_nn_xla``, ``tokamax``, ``splash`` (JAX's splash attention, on a
  TPU; ``splash_interpret`` runs it in interpret mode anywhere).
  """
  impls = []
  for name in names:
    if name == "jflash" or name.startswith("jflash:"):
      backend = _jflash_backend_name(
          name.partition(":")[2] if ":" in name else jflash_impl)
      shown = getattr(backend, "name", backend)
      impls.append(Impl(name, _jflash(backend),
                        f"jflash.dot_product_attention(implementation="
                        f"{shown!r})"))
    elif name in ("jax_nn_cudnn", "jax_nn_xla"):
      which = name.rpartition("_")[2]
      impls.append(Impl(name, _jax_nn(which, max_logits_gib),
                        f"jax.nn.dot_product_attention(implementation="
                        f"{which!r})"))
    elif name == "tokamax":
      impls.append(Impl(name, _tokamax,
                        "tokamax.dot_product_attention (default choice)"))
    elif name in ("splash", "splash_interpret"):
      impls.append(Impl(name, _splash(name == "splash_interpret"),
                        "jax.experimental.pallas.ops.tpu.splash_attention "
                        "make_splash_mha"))
    else:
      raise ValueError(f"unknown implementation {name!r}; known: jflash, "
                       "jflash:<backend>, jax_nn_cudnn, jax_nn_xla, tokamax, "
                       "splash")
  return impls


def default_impl_names() -> list[str]:
  """jflash, both jax.nn paths, and tokamax when it is installed."""
  names = ["jflash", "jax_nn_cudnn", "jax_nn_xla"]
  if tokamax_module() is not None:
    names.append("tokamax")
  return names


def pass_function(attend: Attend, pass_name: str) -> Callable:
  """The jitted function timed for a pass, ``f(q, k, v, segment_ids, ct)``.

  ``fwd`` returns ``(out,)``; ``fwdbwd`` returns ``(out, dq, dk, dv)`` from
  ``jax.vjp`` applied to the cotangent ``ct``.
  """
  if pass_name == "fwd":
    def fwd(q, k, v, segment_ids, ct):
      del ct
      return (attend(q, k, v, segment_ids),)
    return jax.jit(fwd)
  if pass_name == "fwdbwd":
    def fwdbwd(q, k, v, segment_ids, ct):
      out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids),
                              q, k, v)
      return (out,) + tuple(pullback(ct.astype(out.dtype)))
    return jax.jit(fwdbwd)
  raise ValueError(f"unknown pass {pass_name!r}")


def random_inputs(key: jax.Array, cell: Cell, dtype) -> tuple[jax.Array, ...]:
  """Fresh standard-normal ``q, k, v`` and cotangent, in ``dtype``."""
  kq, kk, kv, kc = jax.random.split(key, 4)
  q_shape = (cell.batch, cell.seq_len, cell.num_heads, cell.head_dim)
  kv_shape = (cell.batch, cell.seq_len, cell.kv_heads, cell.head_dim)

  def normal(k, shape):
    return jax.random.normal(k, shape, jnp.float32).astype(dtype)
  return (normal(kq, q_shape), normal(kk, kv_shape), normal(kv, kv_shape),
          normal(kc, q_shape))
