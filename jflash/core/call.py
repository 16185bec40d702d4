"""What a backend receives and the contract it follows.

An attention backend is a callable with a ``name`` that takes one
:class:`AttentionCall` (inputs already validated and put in canonical 4-D
form by :mod:`jflash.attention`) and returns ``(out, logsumexp)``,
differentiable with respect to query, key, value and bias.  A decode
backend takes one :class:`DecodeCall` (from :mod:`jflash.decode`) and
returns the same pair; decoding is inference, so it needs no derivative.

Contract, for both:
  * ``NotImplementedError``: "I cannot serve this call" (platform, dtype,
    feature, shape); dispatch tries the next backend.  The message says why.
  * Anything it accepts it computes exactly as :mod:`jflash.reference` and
    :mod:`jflash.masks` define; it never drops an argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jflash.core.platform import Target, target
from jflash.masks import AttentionMask

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  """One canonical attention call.

  Attributes:
    query: ``[B, T, N, H]``.
    key: ``[B, S, K, H]``, ``N % K == 0``.
    value: ``[B, S, K, H]``.
    bias: ``[B|1, N|1, T|1, S|1]`` floating, or None.
    mask: every visibility rule (causal, window, lengths, segment ids and
      the dense boolean mask).
    scale: multiplies ``query . key`` before the bias is added.
    logits_soft_cap: ``cap * tanh(logits / cap)`` after scale and bias, or
      None.
    alibi_slopes: ``[B|1, N]`` in the softmax's dtype, or None: ALiBi's
      ``-slope * |distance|`` added after the soft cap at the mask's
      positions (:mod:`jflash.core.alibi`); constants, never differentiated.
    returns_residual: the caller asked for the logsumexp (which must then be
      differentiable).
    interpret: run Pallas kernels through the Pallas interpreter (on the
      CPU).  A backend with Pallas kernels that cannot be interpreted
      declines; a backend with no kernels of its own (``xla``) is unaffected.
    platform: the platform this call is traced for (``"cpu"``,
      ``"cuda"``, ``"rocm"``, ``"tpu"``), set by the dispatcher; None
      for :func:`jflash.core.platform.target` of the inputs.
    device_kind: the target device's ``jax.Device.device_kind`` (``""``
      when unknown); read with ``platform``.
    context_parallel: the caller's ``jflash.ContextParallel`` (strategy
      and layout) for kernels that find the sequence sharded while XLA
      partitions them (``Auto`` mesh axes); None for the defaults.
  """

  query: Array
  key: Array
  value: Array
  bias: Array | None
  mask: AttentionMask
  scale: float
  logits_soft_cap: float | None
  alibi_slopes: Array | None = None
  returns_residual: bool = False
  interpret: bool = False
  platform: str | None = None
  device_kind: str = ""
  context_parallel: Any = None

  def target(self) -> Target:
    """The platform and device this call is traced for."""
    if self.platform is not None:
      return Target(self.platform, self.device_kind)
    return target(self.query)

  @property
  def dtype(self):
    return self.query.dtype

  @property
  def shape_description(self) -> str:
    return describe_shapes(self.query, self.key, f"S={self.key.shape[1]}")

  def arrays(self) -> tuple:
    """The call's arrays as one pytree, ``(query, key, value, bias, mask,
    alibi_slopes)``: the operands of a primitive or a ``shard_map`` that
    carries the call (see :meth:`with_arrays`)."""
    return (self.query, self.key, self.value, self.bias, self.mask,
            self.alibi_slopes)

  def with_arrays(self, arrays: tuple) -> "AttentionCall":
    """The call with :meth:`arrays` replaced."""
    q, k, v, bias, mask, slopes = arrays
    return dataclasses.replace(self, query=q, key=k, value=v, bias=bias,
                               mask=mask, alibi_slopes=slopes)

  def flatten(self) -> tuple[list, tuple[bool, ...], Any]:
    """``(leaves, differentiated, rebuild)``: the leaves of
    :meth:`arrays`, whether each is differentiated (the floating inputs;
    never the mask's integers or the constant ALiBi slopes), and the
    function from a list of leaves to the call holding them."""
    arrays = self.arrays()
    leaves, tree = jax.tree.flatten(arrays)
    flags = []
    for entry, differentiable in zip(arrays, (True,) * 4 + (False, False)):
      flags += [differentiable and bool(jnp.issubdtype(jnp.result_type(x),
                                                       jnp.inexact))
                for x in jax.tree.leaves(entry)]
    # The function keeps the call's static part only, not its arrays.
    bare = self.with_arrays((None,) * len(arrays))
    return (leaves, tuple(flags),
            lambda leaves: bare.with_arrays(jax.tree.unflatten(tree, leaves)))


def describe_shapes(query: Array, key: Array, keys: str) -> str:
  """``B=.. T=.. <keys> N=.. K=.. H=.. dtype=..`` for messages and logs."""
  b, t, n, h = query.shape
  return (f"B={b} T={t} {keys} N={n} K={key.shape[2]} H={h} "
          f"dtype={query.dtype}")


class Backend(Protocol):
  """An attention implementation behind :func:`jflash.dot_product_attention`."""

  name: str

  def __call__(self, call: AttentionCall) -> tuple[Array, Array]:
    """Returns ``(out [B, T, N, H], logsumexp [B, T, N])``, the logsumexp
    float32 (float64 for float64 inputs), or raises
    ``NotImplementedError``."""
    ...


def varying_result(shape: tuple[int, ...], dtype, inputs) -> jax.ShapeDtypeStruct:
  """The type of a kernel's output computed from ``inputs``: inside a
  ``jax.shard_map`` that checks how values vary across mesh axes
  (``check_vma``), it varies over every axis any input varies over, as an
  element-wise function of them would."""
  varying = frozenset()
  for x in jax.tree.leaves(inputs):
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    if mat is not None:
      varying |= mat.varying
  return jax.ShapeDtypeStruct(
      shape, dtype,
      manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def vary_as_inputs(outputs, inputs):
  """``outputs`` (a pytree) cast to vary over every mesh axis that any of
  ``inputs`` varies over, for kernels whose outputs' types cannot say so
  (Mosaic GPU's): inside a ``jax.shard_map`` that checks how values vary
  (``check_vma``), an element-wise function of the inputs varies as they
  do, and a ``custom_vjp``'s cotangents must match its primal inputs'
  types.  Outside a ``shard_map`` nothing varies and nothing changes."""
  varying = frozenset()
  for x in jax.tree.leaves(inputs):
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    if mat is not None:
      varying |= mat.varying

  def cast(x):
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    missing = varying - (mat.varying if mat is not None else frozenset())
    if not missing:
      return x
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying")
  return jax.tree.map(cast, outputs)


def check_config(config, positive_ints: tuple[str, ...],
                 optional: tuple[str, ...] = ()) -> None:
  """``ValueError`` naming the field unless each of ``positive_ints`` (or
  of ``optional``, which may also be None) of the frozen dataclass
  ``config`` is a positive int and its ``matmul_inputs`` (where it has
  one) is ``"auto"`` or ``"float32"``."""
  kind = type(config).__name__
  matmul_inputs = getattr(config, "matmul_inputs", "auto")
  if matmul_inputs not in ("auto", "float32"):
    raise ValueError(f"{kind}.matmul_inputs must be 'auto' or 'float32', "
                     f"got {matmul_inputs!r}")
  for name in positive_ints + optional:
    value = getattr(config, name)
    if name in optional and value is None:
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{kind}.{name} must be a positive int, got "
                       f"{value!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """One canonical decode call.

  Attributes:
    query: ``[B, T, N, H]``, the ``T`` new tokens' queries.
    key, value: the cache: ``[B, S, K, H]`` (contiguous), or pages
      ``[P, page_size, K, H]`` when ``block_table`` is given; same dtype as
      ``query``; ``N % K == 0``.
    lengths: int32 ``[B]`` in ``[0, capacity]``: valid cache slots of each
      sequence, the ``T`` new tokens included.
    block_table: int32 ``[B, max_pages]`` or None: slot ``s`` of sequence
      ``b`` is row ``s % page_size`` of page ``block_table[b, s //
      page_size]``.
    scale: multiplies ``query . key``.
    logits_soft_cap: ``cap * tanh(logits / cap)`` after scaling, or None.
    window: ``(left, right)`` or None: query at position ``p`` sees slots
      ``p - left .. p`` (the right side cannot reach past ``p``).
    interpret: run Pallas kernels through the Pallas interpreter (on the
      CPU); a backend without kernels (``xla``) is unaffected.
    platform, device_kind: what the call is traced for, as in
      :class:`AttentionCall`.
    alibi_slopes: ``[B|1, N]`` in the softmax's dtype, or None: ALiBi's
      ``-slope * |p - s|`` for the query at position ``p`` and cache slot
      ``s``, after the soft cap (:mod:`jflash.core.alibi`).
    mask_fn: ``mask_fn(position, slot) -> bool`` ANDed with the rule of
      :func:`jflash.masks.decode_row_bounds`, or None.
  """

  query: Array
  key: Array
  value: Array
  lengths: Array
  block_table: Array | None
  scale: float = dataclasses.field(metadata=dict(static=True))
  logits_soft_cap: float | None = dataclasses.field(
      metadata=dict(static=True))
  window: tuple[int, int] | None = dataclasses.field(
      metadata=dict(static=True))
  interpret: bool = dataclasses.field(default=False,
                                      metadata=dict(static=True))
  platform: str | None = dataclasses.field(default=None,
                                           metadata=dict(static=True))
  device_kind: str = dataclasses.field(default="",
                                       metadata=dict(static=True))
  alibi_slopes: Array | None = None
  mask_fn: Any = dataclasses.field(default=None, metadata=dict(static=True))

  def target(self) -> Target:
    """The platform and device this call is traced for."""
    if self.platform is not None:
      return Target(self.platform, self.device_kind)
    return target(self.query)

  @property
  def paged(self) -> bool:
    return self.block_table is not None

  @property
  def page_size(self) -> int | None:
    return self.key.shape[1] if self.paged else None

  @property
  def capacity(self) -> int:
    """``S``: cache slots per sequence (``max_pages * page_size`` when
    paged)."""
    if self.paged:
      return self.block_table.shape[1] * self.key.shape[1]
    return self.key.shape[1]

  @property
  def num_new(self) -> int:
    return self.query.shape[1]

  @property
  def dtype(self):
    return self.query.dtype

  @property
  def shape_description(self) -> str:
    layout = (f"paged P={self.key.shape[0]} page_size={self.page_size} "
              f"max_pages={self.block_table.shape[1]}" if self.paged
              else f"S={self.capacity}")
    return describe_shapes(self.query, self.key, layout)
