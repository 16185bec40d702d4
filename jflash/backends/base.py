"""What a backend receives and the contract it follows.

A backend is a callable that takes one :class:`AttentionCall` (inputs already
validated and put in canonical 4-D form by :mod:`jflash.attention`) and
returns ``(out, logsumexp)``, differentiable with respect to query, key,
value and bias.

Contract:
  * ``NotImplementedError``: "I cannot serve this call" (platform, dtype,
    feature, shape); dispatch tries the next backend.  The message says why.
  * Anything it accepts it computes exactly as :mod:`jflash.reference`
    defines; it never drops an argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

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
    returns_residual: the caller asked for the logsumexp (which must then be
      differentiable).
    interpret: run Pallas kernels through the Pallas interpreter (on the
      CPU).  A backend with Pallas kernels that cannot be interpreted
      declines; a backend with no kernels of its own (``xla``) is unaffected.
    platform: the platform this call is lowered for (``"cpu"``,
      ``"cuda"``, ``"rocm"``, ``"tpu"``), set when ``implementation=None``
      traces one branch per platform; None for the platform of the trace
      (an abstract mesh's device, else the default backend).
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
  returns_residual: bool = False
  interpret: bool = False
  platform: str | None = None
  context_parallel: Any = None

  @property
  def dtype(self):
    return self.query.dtype

  @property
  def shape_description(self) -> str:
    b, t, n, h = self.query.shape
    s, k = self.key.shape[1], self.key.shape[2]
    return f"B={b} T={t} S={s} N={n} K={k} H={h} dtype={self.dtype}"


class Backend(Protocol):
  """An attention implementation behind :func:`jflash.dot_product_attention`."""

  name: str

  def __call__(self, call: AttentionCall) -> tuple[Array, Array]:
    """Returns ``(out [B, T, N, H], logsumexp [B, T, N] float32)`` or raises
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

