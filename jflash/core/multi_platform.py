"""One program for several lowering platforms, each running its own backend.

Taken only when ``implementation=`` maps platforms to implementations.
Each platform's function is traced once, and one primitive holds them all:
its lowering rule for a platform lowers that platform's function alone,
with the lowering restricted to that platform, as Pallas kernels need (each
has a lowering for its own platform only, and ``lax.platform_dependent``
lowers every branch it keeps for all of the module's platforms).

The primitive is never differentiated: it appears inside the rules of a
``jax.custom_vjp`` (:func:`joined`), whose forward pass saves the target
platform's residuals; on another platform the backward pass recomputes its
forward from the inputs, so that a program lowered for the target carries
the same residuals as its backend alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.interpreters import batching, mlir

from jflash.core.platform import PLATFORMS

Array = jax.Array
Fn = Callable[..., tuple[Array, Array]]

_per_platform_p = jax.extend.core.Primitive("jflash_per_platform")
_per_platform_p.multiple_results = True


def _index(platforms: tuple[str, ...], platform: str) -> int:
  if platform not in platforms:
    raise NotImplementedError(
        f"jflash: this call was traced for the platforms {list(platforms)} "
        f"(implementation=...), not for {platform!r}; name it there too")
  return platforms.index(platform)


def _impl(*args, jaxprs, platforms):
  host = jax.export.default_export_platform()
  return jax.extend.core.jaxpr_as_fun(jaxprs[_index(platforms, host)])(*args)


def _abstract_eval(*args, jaxprs, platforms):
  del args, platforms
  return jaxprs[0].out_avals


def _batch(args, dims, *, jaxprs, platforms):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  batched = tuple(
      jax.make_jaxpr(jax.vmap(jax.extend.core.jaxpr_as_fun(closed),
                              in_axes=tuple(dims), axis_size=size))(*args)
      for closed in jaxprs)
  outs = _per_platform_p.bind(*args, jaxprs=batched, platforms=platforms)
  return outs, [0] * len(outs)


def _lowering(ctx, *args, jaxprs, platforms, lowering):
  closed = jaxprs[_index(platforms, lowering)]
  return mlir.lower_fun(jax.extend.core.jaxpr_as_fun(closed),
                        multiple_results=True)(ctx, *args)


_per_platform_p.def_impl(_impl)
_per_platform_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[_per_platform_p] = _batch
for _platform in PLATFORMS:
  mlir.register_lowering(_per_platform_p, functools.partial(
      _lowering, lowering=_platform), platform=_platform)


def per_platform(functions: Mapping[str, Callable], *args):
  """``functions[p](*args)`` for the platform ``p`` the program is lowered
  for; the functions return pytrees of the same structure, shapes and
  dtypes."""
  traced = [jax.make_jaxpr(fn, return_shape=True)(*args)
            for fn in functions.values()]
  outs = _per_platform_p.bind(*jax.tree.leaves(args),
                              jaxprs=tuple(c for c, _ in traced),
                              platforms=tuple(functions))
  return jax.tree.unflatten(jax.tree.structure(traced[0][1]), outs)


def joined(functions: Mapping[str, tuple[Fn, Fn]], target: str,
           diff: Sequence[bool]) -> Fn:
  """A function of a call's leaves returning ``(out, lse)`` from the
  lowered platform's functions ``(inference, training)``: ``inference``
  where no derivative is taken, ``training`` (forward and backward) where
  one is.  ``diff`` says which leaves are differentiated; the residuals
  kept are ``target``'s."""
  diff = tuple(diff)

  def vjp(training: Fn, leaves):
    """``jax.vjp`` of ``training`` with respect to the floating leaves."""
    def of_inexact(*inexact):
      it = iter(inexact)
      return training(*(next(it) if d else x for x, d in zip(leaves, diff)))
    return jax.vjp(of_inexact, *(x for x, d in zip(leaves, diff) if d))

  @jax.custom_vjp
  def run(*leaves):
    return per_platform({p: fns[0] for p, fns in functions.items()},
                        *leaves)

  # The target's residuals: those that are inputs are saved as the inputs
  # themselves (no copy); the others come out of the per-platform call,
  # as zeros from the other platforms' functions.
  layout = {}

  def fwd(*leaves):
    closed, shape = jax.make_jaxpr(
        lambda *l: vjp(functions[target][1], l), return_shape=True)(*leaves)
    invars = closed.jaxpr.invars
    inputs = [invars.index(v) if v in invars else None
              for v in closed.jaxpr.outvars[2:]]
    kept = [a for a, i in zip(closed.out_avals[2:], inputs) if i is None]
    layout.update(tree=jax.tree.structure(shape[1]), inputs=inputs)

    def target_fn(*leaves):
      outs = jax.extend.core.jaxpr_as_fun(closed)(*leaves)
      return (tuple(outs[:2]),
              tuple(x for x, i in zip(outs[2:], inputs) if i is None))

    def other_fn(training):
      def fn(*leaves):
        zeros = tuple(jnp.zeros(a.shape, a.dtype) for a in kept)
        return tuple(training(*leaves)), zeros
      return fn

    outs, saved = per_platform(
        {p: target_fn if p == target else other_fn(fns[1])
         for p, fns in functions.items()}, *leaves)
    return outs, (leaves, saved)

  def bwd(residual, cotangents):
    leaves, saved = residual

    def target_fn(leaves, saved, cotangents):
      it = iter(saved)
      res = [next(it) if i is None else leaves[i] for i in layout["inputs"]]
      return jax.tree.unflatten(layout["tree"], res)(cotangents)

    def other_fn(training):
      return lambda leaves, saved, ct: vjp(training, leaves)[1](ct)

    grads = iter(per_platform(
        {p: target_fn if p == target else other_fn(fns[1])
         for p, fns in functions.items()}, leaves, saved, cotangents))
    return tuple(next(grads) if d else None for d in diff)

  run.defvjp(fwd, bwd)
  return run
