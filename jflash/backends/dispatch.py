"""Running a call on the first backend that serves it, per lowering platform.

With ``implementation=None`` the backend is chosen for each platform the
program may be lowered for, not for the host: the call is traced once per
distinct choice, and one call lowers each platform's function for that
platform only (a program lowered for one platform holds its function
alone).  ``jax.export`` for a TPU from a CPU host, or a multi-platform
export, thus gets each platform's kernels.  A backend that declines for one
platform falls to the next for that platform only.

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
from jax.interpreters import batching, mlir

import jflash.backends as registry
from jflash.backends import derivatives
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


def target_platform() -> str:
  """The platform a trace is meant for: the device of an active
  ``jax.sharding.use_abstract_mesh`` when it names one (as when exporting
  for another platform), else :func:`host_platform`."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is None:
    return host_platform()
  platform = device.platform
  return {"gpu": "cuda"}.get(platform, platform)


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
  # A context-parallel backend is as portable as the backend of its blocks.
  return isinstance(getattr(backend, "inner", backend), XlaBackend)


Orders = tuple[tuple[Backend, ...], tuple[Backend, ...]]
"""``(inference, training)`` backend orders of one platform."""


def default_orders(call: AttentionCall, platform: str) -> Orders:
  """The default orders of ``call`` on ``platform``
  (:func:`jflash.backends.call_orders`)."""
  return registry.call_orders(call, platform)


def run_per_platform(call: AttentionCall, orders: Mapping[str, Orders]
                     ) -> tuple[Array, Array, dict[str, str]]:
  """``implementation=None``: for each platform of ``orders`` (keys from
  :data:`PLATFORMS`), the first backend of its order that serves the call
  on that platform, joined in one per-platform call.  Where a
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

  target = target_platform()
  target = target if target in orders else "cpu"

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
      except Exception as err:  # pylint: disable=broad-except
        if platform == target:
          raise
        # A failure while tracing for another platform must not break the
        # call where it runs: that platform takes its next backend.
        _warn_failed(backend, platform, err)
        reasons.append(f"{backend.name}: {type(err).__name__}: {err}")
        continue
      return backend, key
    raise NotImplementedError(
        f"no backend in {[b.name for b in orders[platform][0]]} can serve "
        f"this call on {platform} ({call.shape_description}):\n  "
        + "\n  ".join(reasons))

  diff = tuple(jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves)
  names: dict[str, str] = {}
  members: dict[tuple, list[str]] = {}  # group key -> its platforms
  functions: dict[tuple, tuple[Callable, Callable]] = {}
  for platform in orders:
    backend, jaxpr_key = choose(platform)
    inference, training = orders[platform]
    if training != inference and training[0] != backend:
      # The inference choice serves calls without a derivative; the
      # training order is tried (and may decline) when one is taken.
      key = (jaxpr_key, training)
      train = functools.partial(serve, training, platform)
      names[platform] = f"{backend.name} (training: {training[0].name} first)"
    else:
      key = (jaxpr_key, None)
      train = functools.partial(branch, backend, platform)
      names[platform] = backend.name
    members.setdefault(key, []).append(platform)
    functions.setdefault(key, (_replay(jaxprs[jaxpr_key]), train))
  _log_choice(call, names)

  if len(members) == 1 and next(iter(members))[1] is None:
    # One backend for every platform: its program, as if it were named.
    out, lse = functions[next(iter(members))][0](*leaves)
    return out, lse, names
  # The residuals of the backward pass are those of the target's group.
  groups = tuple(
      # The CPU's group also serves every platform not named.
      _Group(None if "cpu" in platforms else tuple(platforms),
             *functions[key],
             fallback=functools.partial(branch, orders[platforms[0]][1][-1],
                                        platforms[0]))
      for key, platforms in members.items())
  host_index = next(i for i, platforms in enumerate(members.values())
                    if target in platforms)
  out, lse = _joined(groups, host_index, diff)(*leaves)
  return out, lse, names


# ------------------------------------------------------------ derivatives
def serve(call: AttentionCall, backends: tuple[Backend, ...] | None,
          platform: str | None = None, for_training: bool = False
          ) -> tuple[Array, Array, str]:
  """``(out, lse, name of the backend chosen)``, differentiable in every
  mode and to any order (:mod:`jflash.backends.derivatives`): reverse mode
  runs the chosen backend's own backward pass, forward mode and the
  derivatives of a backward pass differentiate the ``xla`` formulation
  (the first :class:`XlaBackend` of ``backends``, else the default one).

  ``backends=None`` (``implementation=None``): each lowering platform's
  default orders joined in one per-platform call
  (:func:`run_per_platform`), the name reported being the host's choice;
  with ``platform``, only that platform's order is traced, its training
  order with ``for_training``.
  """
  names = []

  def served(call: AttentionCall) -> tuple[Array, Array]:
    if backends is not None:
      out, lse, name = run(call, backends)
    elif platform is not None:
      inference, training = default_orders(call, platform)
      out, lse, name = run(call, training if for_training else inference)
    else:
      orders = {p: default_orders(call, p) for p in PLATFORMS}
      out, lse, chosen = run_per_platform(call, orders)
      name = chosen.get(host_platform(), chosen.get("cpu"))
    names.append(name)
    return out, lse

  xla = next((b for b in backends or () if isinstance(b, XlaBackend)),
             XlaBackend())
  out, lse = derivatives.differentiable(call, served, xla)
  return out, lse, names[0]


def serve_reverse_only(call: AttentionCall, served: derivatives.Serve,
                       what: str) -> tuple[Array, Array]:
  """``served(call)`` differentiable in reverse mode (its own backward
  pass); forward mode and derivatives of the backward pass raise
  ``NotImplementedError`` saying that they are not available ``what``
  (e.g. "for a context-parallel call") when they are evaluated."""
  return derivatives.differentiable(call, served, None, what)


# ------------------------------------------------------ per-platform calls
# One traced function per group of platforms, as a primitive whose lowering
# rule for each platform lowers only that platform's function, through
# JAX's per-platform lowering (which, lowering for several platforms, emits
# a switch on the platform and lowers each function for its platforms only:
# Pallas kernels have no lowering but their own platform's).  Unlike a
# ``lax.platform_dependent`` conditional it is never differentiated: it
# appears only inside the rules of a ``jax.custom_vjp``, so that the
# residuals saved for the backward pass are the lowered platform's alone.
_per_platform_p = jax.extend.core.Primitive("jflash_per_platform")
_per_platform_p.multiple_results = True

Groups = tuple[tuple[str, ...] | None, ...]
"""The platforms of each function; None for every platform not named."""


def _index_for(platforms: Groups, platform: str) -> int:
  return next((i for i, ps in enumerate(platforms)
               if ps is not None and platform in ps),
              platforms.index(None) if None in platforms else 0)


def _per_platform_impl(*args, jaxprs, platforms):
  closed = jaxprs[_index_for(platforms, host_platform())]
  return jax.extend.core.jaxpr_as_fun(closed)(*args)


def _per_platform_abstract_eval(*args, jaxprs, platforms):
  del args, platforms
  return jaxprs[0].out_avals


def _per_platform_batch(args, dims, *, jaxprs, platforms):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  batched = tuple(
      jax.make_jaxpr(jax.vmap(jax.extend.core.jaxpr_as_fun(closed),
                              in_axes=tuple(dims), axis_size=size))(*args)
      for closed in jaxprs)
  outs = _per_platform_p.bind(*args, jaxprs=batched, platforms=platforms)
  return outs, [0] * len(outs)


def _per_platform_lowering(ctx, *args, jaxprs, platforms, lowering):
  closed = jaxprs[_index_for(platforms, lowering)]
  return mlir.lower_fun(jax.extend.core.jaxpr_as_fun(closed),
                        multiple_results=True)(ctx, *args)


_per_platform_p.def_impl(_per_platform_impl)
_per_platform_p.def_abstract_eval(_per_platform_abstract_eval)
batching.primitive_batchers[_per_platform_p] = _per_platform_batch
# The rule for a platform outside PLATFORMS takes the default function.
mlir.register_lowering(_per_platform_p, functools.partial(
    _per_platform_lowering, lowering=""))
for _platform in PLATFORMS:
  mlir.register_lowering(_per_platform_p, functools.partial(
      _per_platform_lowering, lowering=_platform), platform=_platform)


def _per_platform(functions: Mapping[tuple[str, ...] | None,
                                     tuple[Callable, Callable | None]],
                  *args):
  """``functions[group][0](*args)`` for the group of the lowered platform;
  the functions return pytrees of the same structure, shapes and dtypes.
  Where a function fails to trace, ``functions[group][1]`` (if not None)
  replaces it."""
  platforms = tuple(functions)
  traced = []
  for group, (fn, fallback) in functions.items():
    try:
      traced.append(jax.make_jaxpr(fn, return_shape=True)(*args))
    except Exception as err:  # pylint: disable=broad-except
      if fallback is None:
        raise
      _warn_failed(None, group, err)
      traced.append(jax.make_jaxpr(fallback, return_shape=True)(*args))
  shapes = {tuple((a.shape, a.dtype) for a in closed.out_avals)
            for closed, _ in traced}
  assert len(shapes) == 1, shapes
  outs = _per_platform_p.bind(*jax.tree.leaves(args),
                              jaxprs=tuple(c for c, _ in traced),
                              platforms=platforms)
  return jax.tree.unflatten(jax.tree.structure(traced[0][1]), outs)


def _replay(closed: jax.extend.core.ClosedJaxpr) -> Callable:
  """The function ``closed`` was traced from, as ``(out, lse)``."""
  def run(*leaves):
    return tuple(jax.extend.core.jaxpr_as_fun(closed)(*leaves))
  return run


@dataclasses.dataclass(frozen=True)
class _Group:
  """The backends of some platforms: ``inference`` runs a call whose
  derivative is not taken, ``training`` (forward and backward) one whose
  derivative is; ``fallback`` replaces ``training`` where it fails to
  trace for a platform other than the target."""

  platforms: tuple[str, ...] | None
  inference: Callable
  training: Callable
  fallback: Callable  # the last (xla) backend of the training order


def _joined(groups: tuple[_Group, ...], host: int,
            diff: tuple[bool, ...]) -> Callable:
  """A function of the call's leaves returning ``(out, lse)`` from the
  lowered platform's group.  The backward pass keeps the residuals of the
  host's group (``groups[host]``); another group's backward recomputes its
  forward from the inputs, so that a program lowered for the host carries
  the same residuals as its backend alone."""

  def vjp(training: Callable, leaves):
    """``jax.vjp`` of ``training`` with respect to the floating leaves."""
    def of_inexact(*inexact):
      it = iter(inexact)
      return training(*(next(it) if d else x for x, d in zip(leaves, diff)))
    return jax.vjp(of_inexact, *(x for x, d in zip(leaves, diff) if d))

  @jax.custom_vjp
  def run(*leaves):
    return _per_platform({g.platforms: (g.inference, None) for g in groups},
                         *leaves)

  # The host's residuals: those that are inputs are saved as the inputs
  # themselves (no copy); the others come out of the per-platform call,
  # as zeros from the other groups' functions.
  layout = {}

  def fwd(*leaves):
    closed, shape = jax.make_jaxpr(
        lambda *l: vjp(groups[host].training, l), return_shape=True)(*leaves)
    (_, pullback_shape) = shape
    invars = closed.jaxpr.invars
    res_vars = closed.jaxpr.outvars[2:]
    inputs = [invars.index(v) if v in invars else None for v in res_vars]
    kept = [a for a, i in zip(closed.out_avals[2:], inputs) if i is None]
    layout.update(tree=jax.tree.structure(pullback_shape), inputs=inputs)

    def host_fn(*leaves):
      outs = jax.extend.core.jaxpr_as_fun(closed)(*leaves)
      return (tuple(outs[:2]),
              tuple(x for x, i in zip(outs[2:], inputs) if i is None))

    def other_fn(training):
      def fn(*leaves):
        zeros = tuple(jnp.zeros(a.shape, a.dtype) for a in kept)
        return tuple(training(*leaves)), zeros
      return fn

    outs, saved = _per_platform(
        {g.platforms: (host_fn, None) if i == host else
         (other_fn(g.training), other_fn(g.fallback))
         for i, g in enumerate(groups)}, *leaves)
    return outs, (leaves, saved)

  def bwd(residual, cotangents):
    leaves, saved = residual

    def host_fn(leaves, saved, cotangents):
      it = iter(saved)
      res = [next(it) if i is None else leaves[i] for i in layout["inputs"]]
      return jax.tree.unflatten(layout["tree"], res)(cotangents)

    def other_fn(training):
      return lambda leaves, saved, ct: vjp(training, leaves)[1](ct)

    grads = iter(_per_platform(
        {g.platforms: (host_fn, None) if i == host else
         (other_fn(g.training), other_fn(g.fallback))
         for i, g in enumerate(groups)}, leaves, saved, cotangents))
    return tuple(next(grads) if d else None for d in diff)

  run.defvjp(fwd, bwd)
  return run


def _warn_failed(backend: Backend | None, platforms, err: Exception) -> None:
  what = f"{backend.name} " if backend is not None else "the backend "
  logger.warning(
      "jflash.dot_product_attention: %sfailed to trace for %s (%s: %s); "
      "that platform's branch uses the next backend (xla)", what,
      platforms or "the default platforms", type(err).__name__, err)


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
