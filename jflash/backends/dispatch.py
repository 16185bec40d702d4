"""Running a call on the first backend that serves it, per lowering platform.

With ``implementation=None`` the backend is chosen for each platform the
program may be lowered for, not for the host: the call is traced once per
distinct choice and the branches are joined with ``lax.platform_dependent``,
which keeps only the lowered platform's branch.  ``jax.export`` for a TPU
from a CPU host, or a multi-platform export, thus gets each platform's
kernels.  A backend that declines for one platform falls to the next for
that platform only.

Every backend's operations run under the name scope ``jflash/<name>``
(visible in the HLO's op metadata and in profiles), and the choice is
logged once per distinct call signature on the ``jflash`` logger.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching, mlir, partial_eval

import jflash.backends as registry
from jflash.backends.base import AttentionCall, Backend
from jflash.backends.xla import XlaBackend

Array = jax.Array

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
"""The lowering platforms the default dispatch traces a branch for; any
other platform gets the ``cpu`` branch."""

LOG_LEVEL_ENV = "JFLASH_LOG_LEVEL"
"""Environment variable naming the level of the backend-choice records
(``DEBUG`` when unset), e.g. ``INFO`` to see them with
``logging.basicConfig(level=logging.INFO)``."""

logger = logging.getLogger("jflash")

_LOG_MEMO_SIZE = 1024
_logged: collections.OrderedDict[tuple, None] = collections.OrderedDict()


def host_platform() -> str:
  """The platform a ``jax.jit`` on this host lowers for by default
  (``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``)."""
  return jax.export.default_export_platform()


def _serve(call: AttentionCall, backends: tuple[Backend, ...]
           ) -> tuple[Array, Array, Backend]:
  """``backends[i](call)`` for the first ``i`` that does not decline."""
  reasons = []
  for backend in backends:
    try:
      with jax.named_scope(f"jflash/{backend.name}"):
        out, lse = backend(call)
    except NotImplementedError as err:
      reasons.append(str(err))
      continue
    return out, lse, backend
  raise NotImplementedError(
      f"no backend in {[b.name for b in backends]} can serve this call "
      f"({call.shape_description}):\n  " + "\n  ".join(reasons))


def run(call: AttentionCall, backends: tuple[Backend, ...]
        ) -> tuple[Array, Array, str]:
  """An explicit ``implementation``: the first of ``backends`` that serves
  the call on the platform of the trace."""
  out, lse, backend = _serve(call, backends)
  _log_choice(call, {call.platform or host_platform(): backend.name})
  return out, lse, backend.name


def _portable(backend: Backend) -> bool:
  """A backend in plain ``jax.numpy`` traces alike for every platform."""
  return isinstance(backend, XlaBackend)


Orders = tuple[tuple[Backend, ...], tuple[Backend, ...]]
"""``(inference, training)`` backend orders of one platform."""


def orders(call: AttentionCall, platform: str) -> Orders:
  """The default orders of ``call`` on ``platform``
  (:func:`jflash.backends.call_orders`)."""
  return registry.call_orders(call, platform)


def run_per_platform(call: AttentionCall, orders: Mapping[str, Orders]
                     ) -> tuple[Array, Array, dict[str, str]]:
  """``implementation=None``: for each platform of ``orders`` (keys from
  :data:`PLATFORMS`), the first backend of its order that serves the call
  on that platform, joined with ``lax.platform_dependent``.  Where a
  platform's training order differs from its inference order, a call whose
  derivative is taken runs the training order's backend (forward and
  backward), any other call the inference order's.  Returns
  ``(out, lse, {platform: description of the choice})``.

  Concrete inputs run where they are, on the host's platform only.
  """
  arrays = (call.query, call.key, call.value, call.bias, call.mask)
  leaves, tree = jax.tree.flatten(arrays)
  if not any(isinstance(x, jax.core.Tracer) for x in leaves):
    host = host_platform()
    out, lse, backend = _serve(dataclasses.replace(call, platform=host),
                               orders[host if host in orders else "cpu"][0])
    _log_choice(call, {host: backend.name})
    return out, lse, {host: backend.name}

  # A portable backend is traced once, for the first platform that takes
  # it; any other once per platform.
  jaxprs: dict[tuple, jax.extend.core.ClosedJaxpr] = {}

  def on(platform: str, leaves) -> AttentionCall:
    q, k, v, bias, mask = jax.tree.unflatten(tree, leaves)
    return dataclasses.replace(call, query=q, key=k, value=v, bias=bias,
                               mask=mask, platform=platform)

  def branch(backend: Backend, platform: str, *leaves):
    with jax.named_scope(f"jflash/{backend.name}"):
      return backend(on(platform, leaves))

  def serve(order: tuple[Backend, ...], platform: str, *leaves):
    return _serve(on(platform, leaves), order)[:2]

  def choose(platform: str) -> tuple[Backend, tuple]:
    reasons = []
    for backend in orders[platform][0]:
      key = (backend,) if _portable(backend) else (backend, platform)
      if key in jaxprs:
        return backend, key
      try:
        jaxprs[key] = jax.make_jaxpr(
            functools.partial(branch, backend, platform))(*leaves)
      except NotImplementedError as err:
        reasons.append(str(err))
        continue
      return backend, key
    raise NotImplementedError(
        f"no backend in {[b.name for b in orders[platform][0]]} can serve "
        f"this call on {platform} ({call.shape_description}):\n  "
        + "\n  ".join(reasons))

  diff = tuple(jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves)
  names: dict[str, str] = {}
  branches: dict[tuple, Callable] = {}
  branch_of: dict[str, tuple] = {}
  for platform in orders:
    backend, key = choose(platform)
    inference, training = orders[platform]
    split = training != inference and training[0] != backend
    if split:
      # The inference choice serves calls without a derivative; the
      # training order is tried (and may decline) when one is taken.
      portable = _portable(backend) and all(map(_portable, training))
      key = (key, training, None if portable else platform)
      names[platform] = f"{backend.name} (training: {training[0].name} first)"
    else:
      names[platform] = backend.name
    branch_of[platform] = key
    if key in branches:
      continue
    replay = _replay(jaxprs[key[0] if split else key])
    if split:
      branches[key] = split_call(
          key[2], replay, functools.partial(serve, training, platform), diff)
    elif _portable(backend):
      branches[key] = replay
    else:
      branches[key] = split_call(
          platform, replay, functools.partial(branch, backend, platform),
          diff)
  _log_choice(call, names)

  if len(branches) == 1:
    (only,) = branches.values()
    out, lse = only(*leaves)
    return out, lse, names
  default_key = branch_of["cpu"]
  per_platform = {p: branches[key] for p, key in branch_of.items()
                  if key != default_key}
  out, lse = lax.platform_dependent(*leaves, default=branches[default_key],
                                    **per_platform)
  return out, lse, names


# ------------------------------------------------ derivatives JAX computes
def needs_jax_derivatives(call: AttentionCall) -> bool:
  """True when the call is traced under forward-mode differentiation
  (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``, Hessian-vector products)
  or under two nested reverse-mode ones (``jax.grad`` of ``jax.grad``).
  The backends' own backward passes (``jax.custom_vjp``) serve one level of
  reverse mode only."""
  arrays = (call.query, call.key, call.value, call.bias, call.mask)
  forward, reverse = False, set()
  for x in jax.tree.leaves(arrays):
    while isinstance(x, jax.core.Tracer):
      if hasattr(x, "primal") and hasattr(x, "tangent"):
        # A JVP tracer whose tangent is being staged out belongs to a
        # linearization (reverse mode), not to forward mode.
        if (isinstance(x, ad.JVPTracer)
            and not isinstance(x.tangent, partial_eval.JaxprTracer)):
          forward = True
        else:
          reverse.add(id(x._trace))
        x = x.primal
      else:
        x = getattr(x, "val", None)
  return forward or len(reverse) > 1


def run_differentiable(call: AttentionCall,
                       backends: tuple[Backend, ...] | None
                       ) -> tuple[Array, Array, str]:
  """The ``xla`` formulation JAX differentiates itself (see
  :func:`needs_jax_derivatives`): the first ``xla`` backend of
  ``backends``, or the default one when ``backends`` is None."""
  xla = next((b for b in (backends or (XlaBackend(),))
              if isinstance(b, XlaBackend)), None)
  if xla is None:
    raise NotImplementedError(
        "jflash.dot_product_attention: forward-mode derivatives (jax.jvp, "
        "jax.jacfwd, jax.hessian) and reverse mode over reverse mode are "
        "computed by the 'xla' backend's formulation, and implementation="
        f"{[b.name for b in backends]} holds no 'xla' backend; pass "
        "implementation=None or add 'xla'")
  with jax.named_scope(f"jflash/{xla.name}"):
    out, lse = xla.differentiable(call)
  _log_choice(call, {"any platform": f"{xla.name} (derivatives by JAX)"})
  return out, lse, xla.name


# ------------------------------------------------- platform-restricted calls
# Inside a ``lax.platform_dependent`` branch JAX lowers every operation for
# every platform of a multi-platform lowering, and Pallas kernels have no
# lowering but their own platform's.  ``_platform_call_p`` runs a traced
# function lowered for one platform only; on any other platform it lowers to
# zeros, never executed because the enclosing branch is that platform's.
_platform_call_p = jax.extend.core.Primitive("jflash_platform_call")
_platform_call_p.multiple_results = True


def _platform_call_impl(*args, jaxpr, platform):
  del platform
  return jax.extend.core.jaxpr_as_fun(jaxpr)(*args)


def _platform_call_abstract_eval(*args, jaxpr, platform):
  del args, platform
  return jaxpr.out_avals


def _platform_call_batch(args, dims, *, jaxpr, platform):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  batched = jax.make_jaxpr(jax.vmap(jax.extend.core.jaxpr_as_fun(jaxpr),
                                    in_axes=tuple(dims), axis_size=size))(*args)
  outs = _platform_call_p.bind(*args, jaxpr=batched, platform=platform)
  return outs, [0] * len(outs)


def _platform_call_lowering(ctx, *args, jaxpr, platform, lowering):
  if lowering == platform:
    run = jax.extend.core.jaxpr_as_fun(jaxpr)
  else:
    def run(*args):
      del args
      return [jnp.zeros(a.shape, a.dtype) for a in jaxpr.out_avals]
  return mlir.lower_fun(run, multiple_results=True)(ctx, *args)


_platform_call_p.def_impl(_platform_call_impl)
_platform_call_p.def_abstract_eval(_platform_call_abstract_eval)
batching.primitive_batchers[_platform_call_p] = _platform_call_batch
mlir.register_lowering(_platform_call_p, functools.partial(
    _platform_call_lowering, lowering=None))
for _p in PLATFORMS:
  mlir.register_lowering(_platform_call_p, functools.partial(
      _platform_call_lowering, lowering=_p), platform=_p)


def _on_platform(platform: str | None, fn: Callable, *args):
  """``fn(*args)`` (a pytree of arrays), lowered for ``platform`` only
  (for any platform when None)."""
  if platform is None:
    return fn(*args)
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  outs = _platform_call_p.bind(*jax.tree.leaves(args), jaxpr=closed,
                               platform=platform)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _replay(closed: jax.extend.core.ClosedJaxpr) -> Callable:
  """The function ``closed`` was traced from, as ``(out, lse)``."""
  def run(*leaves):
    return tuple(jax.extend.core.jaxpr_as_fun(closed)(*leaves))
  return run


def split_call(platform: str | None, primal: Callable, train: Callable,
               diff: tuple[bool, ...]) -> Callable:
  """A function of the call's leaves returning ``(out, lse)``: ``primal``
  when no derivative is taken, and the forward and backward of ``train``
  when one is (``jax.custom_vjp`` runs its forward rule only then); both
  lowered for ``platform`` only (None: for any).  ``diff`` marks the
  differentiable (floating) leaves."""

  @jax.custom_vjp
  def run(*leaves):
    return _on_platform(platform, primal, *leaves)

  def fwd(*leaves):
    def forward(*leaves):
      def of_inexact(*inexact):
        it = iter(inexact)
        return train(*(next(it) if d else x for x, d in zip(leaves, diff)))
      return jax.vjp(of_inexact, *(x for x, d in zip(leaves, diff) if d))

    return _on_platform(platform, forward, *leaves)

  def bwd(vjp, cotangents):
    grads = iter(_on_platform(platform, lambda vjp, ct: vjp(ct), vjp,
                              cotangents))
    return tuple(next(grads) if d else None for d in diff)

  run.defvjp(fwd, bwd)
  return run


def _signature(call: AttentionCall, names: Mapping[str, str]) -> tuple:
  mask = call.mask
  features = tuple(name for name, present in (
      ("causal", mask.is_causal), ("window", mask.window is not None),
      ("q_lengths", mask.q_lengths is not None),
      ("kv_lengths", mask.kv_lengths is not None),
      ("segment_ids", mask.q_segment_ids is not None),
      ("mask", mask.dense is not None), ("bias", call.bias is not None),
      ("soft_cap", call.logits_soft_cap is not None),
      ("residual", call.returns_residual),
      ("interpret", call.interpret)) if present)
  return (call.shape_description, features, tuple(sorted(names.items())))


def _log_level() -> int:
  value = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
  level = logging.getLevelName(value) if value else logging.DEBUG
  return level if isinstance(level, int) else logging.DEBUG


def _log_choice(call: AttentionCall, names: Mapping[str, str]) -> None:
  """Logs the backend chosen for each platform, once per distinct call
  signature (the most recent signatures are remembered)."""
  key = _signature(call, names)
  if key in _logged:
    _logged.move_to_end(key)
    return
  _logged[key] = None
  if len(_logged) > _LOG_MEMO_SIZE:
    _logged.popitem(last=False)
  shape, features, choices = key
  logger.log(_log_level(), "jflash.dot_product_attention %s%s: %s", shape,
             "".join(f" {f}" for f in features),
             ", ".join(f"{p} -> {n}" for p, n in choices))
