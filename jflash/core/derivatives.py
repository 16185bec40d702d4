"""Derivatives of every mode and order for a served call.

The backends differentiate in one way only: each serves a call as a
``jax.custom_vjp`` whose backward pass recomputes the probabilities from
the saved logsumexp.  JAX cannot apply forward mode (``jax.jvp``,
``jax.linearize``, ``jax.jacfwd``, ``jax.hessian``) to a ``custom_vjp``,
and cannot differentiate a backward kernel.  :func:`differentiable` wraps
the served call so that every transformation works, whatever its nesting
and whether or not it is applied through ``jax.jit``:

* The value is the served one (the backends' forward kernels).
* Its derivative is a linear primitive of the tangents,
  ``jflash_attention_linear``.  Evaluated (forward mode), it is the JVP of
  the ``xla`` backend's formulation JAX differentiates
  (:meth:`XlaBackend.differentiable`); transposed (reverse mode), it is the
  backends' own backward pass, run on the residuals their forward pass
  saved, so that ``jax.grad`` runs the same kernels as the ``custom_vjp``
  alone.
* The forward pass with its residuals, and the backward pass, are again
  functions whose derivatives are defined here (the residuals count as
  functions of the inputs; the backward pass's derivative is that of the
  ``xla`` formulation's), so that derivatives of derivatives work in any
  order: Hessian-vector products, ``jax.hessian``, ``jax.grad`` of
  ``jax.grad``.

The served value, the forward pass and the backward pass are each one
``jflash_attention_call`` primitive holding the traced function and its
JVP rule.  Unlike a ``jax.custom_jvp`` it is never inlined by partial
evaluation (which JAX does to a ``custom_jvp`` whose inputs are partly
unknown, as when a ``lax.scan`` is linearized under an outer ``jax.jvp``):
the kernels inside have no JVP of their own.

No tracer is inspected: which derivative is taken is left to JAX's rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

from jflash.core.call import AttentionCall
from jflash.backends.xla import XlaBackend

Array = jax.Array
Serve = Callable[[AttentionCall], tuple[Array, Array]]


def differentiable(call: AttentionCall, serve: Serve,
                   xla: XlaBackend | None, unavailable: str = "",
                   value: Serve | None = None) -> tuple[Array, Array]:
  """``serve(call)`` (``(out [B, T, N, H], lse [B, T, N])``) with
  derivatives of every mode and order.

  Args:
    call: the call, whose floating arrays (query, key, value, bias) are
      differentiated.
    serve: the chosen backends; ``jax.vjp`` of it runs their forward and
      backward passes whenever a derivative is taken.
    value: the backends that compute the value where no derivative is
      taken (default: ``serve``).
    xla: the backend whose formulation gives forward-mode tangents and the
      derivatives of the backward pass; None where they are not available
      (evaluating them raises ``NotImplementedError`` with ``unavailable``
      as the reason).
  """
  leaves, diff, rebuild = call.flatten()
  if not any(isinstance(x, jax.core.Tracer) for x in leaves):
    # No transformation applies to concrete inputs.
    return (value or serve)(call)
  return _Derivatives(rebuild, diff, serve, value or serve, xla,
                      unavailable).top(leaves)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where the backward pass's residuals lie: the pullback's pytree;
  ``outputs``, the positions in the forward pass's ``(out, lse, *saved)``
  of those it reads; for each of the pullback's leaves an index into
  ``(*leaves, *read)``, ``read`` being those outputs.

  Residuals that are the call's inputs or outputs are not saved again (a
  ``jax.jit``, ``lax.scan`` or ``shard_map`` boundary would otherwise keep
  a second copy of them).  An output the pullback does not read (``out``
  and ``lse`` of a per-platform call, whose backward pass recomputes them
  on a platform other than the host's) is not an operand of the
  derivative: as a residual of a ``jax.jit`` or ``shard_map`` it would
  keep the forward kernel alive under ``jax.grad``, which the backward
  pass then runs a second time."""

  tree: Any
  outputs: tuple[int, ...]
  indices: tuple[int, ...]

  @classmethod
  def of(cls, tree: Any, num_leaves: int,
         indices: Sequence[int]) -> "_Layout":
    """The layout of a pullback whose leaves are ``indices`` into
    ``(*leaves, out, lse, *saved)`` (``num_leaves`` leaves)."""
    outputs = tuple(sorted({i - num_leaves for i in indices
                            if i >= num_leaves}))
    where = {num_leaves + j: num_leaves + k for k, j in enumerate(outputs)}
    return cls(tree, outputs, tuple(where.get(i, i) for i in indices))

  def read(self, outs: Sequence[Array]) -> list[Array]:
    """The forward pass's outputs that the pullback reads."""
    return [outs[j] for j in self.outputs]

  def pullback(self, pool: Sequence[Array]) -> Callable:
    """The pullback from ``pool``, ``(*leaves, *read)``."""
    return jax.tree.unflatten(self.tree, [pool[i] for i in self.indices])


@dataclasses.dataclass(eq=False)
class _Derivatives:
  """The differentiable functions of one call's leaves (query, key, value,
  bias, the mask's arrays and the ALiBi slopes), each a ``jflash_attention_call``:

  * :meth:`top`: ``(out, lse)``, served;
  * :meth:`forward`: ``(out, lse, *saved)``, the served forward pass with
    the residuals its backward pass reads (:class:`_Layout`);
  * :meth:`backward`: the served backward pass on those residuals.

  JVP rules take ``(primals, tangents, rebind)``, a tangent None where it
  is zero, ``rebind()`` giving the primitive's own outputs; they return
  ``(outputs, tangents)``.
  """

  rebuild: Callable[[Sequence[Array]], AttentionCall]  # leaves -> call
  diff: tuple[bool, ...]  # which leaves are differentiated
  serve: Serve
  value: Serve
  xla: XlaBackend | None
  unavailable: str

  # ------------------------------------------------------------ helpers
  def of_diff(self, fn: Callable[[AttentionCall], Any],
              leaves: Sequence[Array]) -> Callable:
    """``fn`` of the call as a function of the differentiated leaves, the
    other leaves fixed to those of ``leaves``."""
    def on(*diff_leaves):
      it = iter(diff_leaves)
      return fn(self.rebuild([next(it) if d else x
                              for x, d in zip(leaves, self.diff)]))
    return on

  def diff_leaves(self, leaves: Sequence[Any]) -> list[Any]:
    return [x for x, d in zip(leaves, self.diff) if d]

  def formulation(self, call: AttentionCall) -> tuple[Array, Array]:
    """The ``xla`` formulation JAX differentiates."""
    if self.xla is None:
      raise NotImplementedError(
          "jflash.dot_product_attention: forward-mode derivatives (jax.jvp, "
          "jax.linearize, jax.jacfwd, jax.hessian) and derivatives of the "
          "backward pass (jax.grad of jax.grad, Hessian-vector products) "
          f"are not available {self.unavailable}; reverse mode (jax.grad, "
          "jax.vjp) is")
    with jax.named_scope(f"jflash/{self.xla.name}"):
      return self.xla.differentiable(call)

  # ---------------------------------------------------------------- top
  def top(self, leaves: Sequence[Array]) -> tuple[Array, Array]:
    return tuple(_call(lambda *l: tuple(self.value(self.rebuild(l))),
                       self._top_jvp, leaves))

  def _top_jvp(self, primals, tangents, rebind):
    del rebind  # the forward pass gives the value
    outs, layout = self.forward(primals)
    return outs[:2], self._tangents(layout, primals, outs, tangents)

  # ------------------------------------------------------------ forward
  def forward(self, leaves: Sequence[Array]) -> tuple[list, _Layout]:
    """``(out, lse, *saved)`` and the layout of the residuals."""
    layouts = []

    def run(*leaves):
      outs, pullback = jax.vjp(self.of_diff(self.serve, leaves),
                               *self.diff_leaves(leaves))
      residuals, tree = jax.tree.flatten(pullback)
      pool, indices = [*leaves, *outs], []
      for x in residuals:
        index = next((i for i, y in enumerate(pool) if y is x), None)
        if index is None:
          index = len(pool)
          pool.append(x)
        indices.append(index)
      layouts.append(_Layout.of(tree, len(leaves), indices))
      return (*outs, *pool[len(leaves) + 2:])

    def jvp(primals, tangents, rebind):
      outs = rebind()
      # The saved residuals are functions of the inputs read only by the
      # backward pass, whose derivative is taken with respect to the
      # inputs.
      return outs, [*self._tangents(layouts[0], primals, outs, tangents),
                    *[None] * (len(outs) - 2)]

    # ``run`` is traced (and ``layouts`` set) before ``jvp`` may be called.
    outs = _call(run, jvp, leaves)
    return outs, layouts[0]

  def _tangents(self, layout: _Layout, primals, outs, tangents
                ) -> tuple[Array, Array]:
    """The tangents of ``(out, lse)`` (``outs[:2]``, followed by the
    residuals saved): the linear primitive of the differentiated leaves'
    tangents.  Its fixed operands are the leaves and the outputs the
    backward pass reads, nothing else: every one of them is a residual of
    reverse mode."""
    read = layout.read(outs)
    rule = _LinearRule(
        forward=self._linear_forward,
        transpose=lambda nonlinear, cts: self.backward(layout, nonlinear, cts),
        num_nonlinear=len(primals) + len(read), num_read=len(primals),
        out_avals=tuple(jax.typeof(x).to_tangent_aval() for x in outs[:2]))
    linear = [_zeros_for(p) if t is None else t
              for p, t in zip(self.diff_leaves(primals),
                              self.diff_leaves(tangents))]
    return tuple(linear_p.bind(*primals, *read, *linear, rule=rule))

  def _linear_forward(self, nonlinear, linear) -> tuple[Array, Array]:
    """The JVP of the ``xla`` formulation at the call's leaves."""
    leaves = nonlinear[:len(self.diff)]
    fn = self.of_diff(self.formulation, leaves)
    return tuple(jax.jvp(fn, tuple(self.diff_leaves(leaves)),
                         tuple(linear))[1])

  # ----------------------------------------------------------- backward
  def backward(self, layout: _Layout, nonlinear: Sequence[Array],
               cotangents: Sequence[Array]) -> list[Array]:
    """The cotangents of the differentiated leaves from those of ``(out,
    lse)``, ``nonlinear`` being the leaves followed by the forward pass's
    outputs the pullback reads (:class:`_Layout`): the backends' backward
    pass on the residuals.  Its own derivative is that
    of the ``xla`` formulation's backward pass."""
    num_leaves = len(self.diff)

    def run(*args):
      pool, cts = args[:-2], args[-2:]
      return tuple(layout.pullback(pool)(tuple(cts)))

    def jvp(primals, tangents, rebind):
      leaves, cts = primals[:num_leaves], primals[-2:]
      d_leaves = [_zeros_for(p) if t is None else t
                  for p, t in zip(self.diff_leaves(leaves),
                                  self.diff_leaves(tangents))]
      d_cts = [_zeros_for(p) if t is None else t
               for p, t in zip(cts, tangents[-2:])]

      def formulation_backward(diff_leaves, cts):
        fn = self.of_diff(self.formulation, leaves)
        return jax.vjp(fn, *diff_leaves)[1](tuple(cts))

      return rebind(), list(jax.jvp(
          formulation_backward, (tuple(self.diff_leaves(leaves)), tuple(cts)),
          (tuple(d_leaves), tuple(d_cts)))[1])

    return _call(run, jvp, (*nonlinear, *cotangents))


def _zeros_for(x: Array) -> Array:
  return jnp.zeros(x.shape, x.dtype)


# --------------------------------------------------- the opaque call
@dataclasses.dataclass(frozen=True, eq=False)
class _CallRule:
  """The JVP rule of one ``jflash_attention_call`` (hashed by identity):
  ``jvp(primals, tangents, rebind) -> (outputs, tangents)``, tangents None
  where zero."""

  jvp: Callable


call_p = jax.extend.core.Primitive("jflash_attention_call")
call_p.multiple_results = True


def _call(fn: Callable, jvp: Callable, args: Sequence[Array]) -> list:
  """``fn(*args)`` (a tuple of arrays) as one ``jflash_attention_call``
  whose JVP rule is ``jvp``."""
  body = jax.make_jaxpr(fn)(*args)
  return call_p.bind(*args, body=body, rule=_CallRule(jvp))


def _call_impl(*args, body, rule):
  del rule
  return jax.extend.core.jaxpr_as_fun(body)(*args)


def _call_abstract_eval(*avals, body, rule):
  del avals, rule
  return body.out_avals, body.effects


def _call_lowering(ctx, *args, body, rule):
  del rule
  return mlir.lower_fun(jax.extend.core.jaxpr_as_fun(body),
                        multiple_results=True)(ctx, *args)


def _call_jvp(primals, tangents, *, body, rule):
  outs, out_tangents = rule.jvp(
      primals, [None if type(t) is ad.Zero else t for t in tangents],
      lambda: call_p.bind(*primals, body=body, rule=rule))
  return outs, [ad.Zero(jax.typeof(x).to_tangent_aval()) if t is None else t
                for x, t in zip(outs, out_tangents)]


def _call_batch(args, dims, *, body, rule):
  """vmap: the traced function vmapped, and its JVP rule vmapped."""
  # An operand not batched has dimension None.
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  dims = tuple(dims)
  batched = jax.make_jaxpr(jax.vmap(jax.extend.core.jaxpr_as_fun(body),
                                    in_axes=dims, axis_size=size))(*args)

  def jvp(primals, tangents, rebind):
    del rebind
    def one(primals, tangents):
      return rule.jvp(primals, tangents, lambda: call_p.bind(
          *primals, body=body, rule=rule))
    return jax.vmap(one, in_axes=(dims, dims), axis_size=size)(
        tuple(primals), tuple(tangents))

  outs = call_p.bind(*args, body=batched, rule=_CallRule(jvp))
  return outs, [0] * len(outs)


call_p.def_impl(_call_impl)
call_p.def_effectful_abstract_eval(_call_abstract_eval)
mlir.register_lowering(call_p, _call_lowering)
ad.primitive_jvps[call_p] = _call_jvp
batching.primitive_batchers[call_p] = _call_batch


# ------------------------------------------------- the linear primitive
@dataclasses.dataclass(frozen=True, eq=False)
class _LinearRule:
  """What ``jflash_attention_linear`` computes (hashed by identity).

  Operands: ``(*nonlinear, *linear)``, the first ``num_nonlinear`` fixed.
  ``forward(nonlinear, linear)`` evaluates the outputs (of avals
  ``out_avals``), linear in ``linear`` and reading ``nonlinear[:num_read]``
  only; ``transpose(nonlinear, cotangents)`` gives the cotangents of
  ``linear`` from those of the outputs.
  """

  forward: Callable[[tuple, tuple], tuple]
  transpose: Callable[[tuple, tuple], tuple]
  num_nonlinear: int
  num_read: int
  out_avals: tuple


linear_p = jax.extend.core.Primitive("jflash_attention_linear")
linear_p.multiple_results = True


def _split(operands, rule: _LinearRule) -> tuple[tuple, tuple]:
  return (tuple(operands[:rule.num_nonlinear]),
          tuple(operands[rule.num_nonlinear:]))


def _linear_impl(*operands, rule: _LinearRule):
  return rule.forward(*_split(operands, rule))


def _linear_abstract_eval(*avals, rule: _LinearRule):
  del avals
  return rule.out_avals


def _linear_lowering(ctx, *operands, rule: _LinearRule):
  return mlir.lower_fun(lambda *ops: rule.forward(*_split(ops, rule)),
                        multiple_results=True)(ctx, *operands)


def _linear_transpose(cotangents, *operands, rule: _LinearRule):
  nonlinear, linear = _split(operands, rule)
  assert not any(ad.is_undefined_primal(x) for x in nonlinear)
  if all(type(ct) is ad.Zero for ct in cotangents):
    return [None] * len(nonlinear) + [None] * len(linear)
  cotangents = tuple(ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct
                     for ct in cotangents)
  return [None] * len(nonlinear) + list(rule.transpose(nonlinear, cotangents))


def _linear_jvp(primals, tangents, *, rule: _LinearRule):
  """Linear in the linear operands (the primitive again); the derivative
  with respect to the fixed ones is that of ``forward``."""
  outs = linear_p.bind(*primals, rule=rule)
  nonlinear, linear = _split(primals, rule)
  d_nonlinear, d_linear = _split(tangents, rule)
  parts = []
  if any(type(t) is not ad.Zero for t in d_linear):
    parts.append(linear_p.bind(*nonlinear, *map(ad.instantiate_zeros,
                                                 d_linear), rule=rule))
  moved = [i for i, t in enumerate(d_nonlinear[:rule.num_read])
           if type(t) is not ad.Zero and jnp.issubdtype(t.dtype, jnp.inexact)]
  if moved:
    def forward_of(*xs):
      fixed = list(nonlinear)
      for i, x in zip(moved, xs):
        fixed[i] = x
      return rule.forward(tuple(fixed), linear)
    parts.append(jax.jvp(forward_of, tuple(nonlinear[i] for i in moved),
                         tuple(d_nonlinear[i] for i in moved))[1])
  if not parts:
    return outs, [ad.Zero(a) for a in rule.out_avals]
  return outs, [sum(ts[1:], ts[0]) for ts in zip(*parts)]


def _linear_batch(operands, dims, *, rule: _LinearRule):
  """vmap: the rule's functions vmapped; the linear operands (and so
  their cotangents) batched at axis 0."""
  # An operand not batched has dimension None.
  size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
  nonlinear, linear = _split(operands, rule)
  axes = tuple(dims[:rule.num_nonlinear])
  linear = tuple(batching.bdim_at_front(x, d, size)
                 for x, d in zip(linear, dims[rule.num_nonlinear:]))
  batched = _LinearRule(
      forward=jax.vmap(rule.forward, in_axes=(axes, 0), axis_size=size),
      transpose=jax.vmap(rule.transpose, in_axes=(axes, 0), axis_size=size),
      num_nonlinear=rule.num_nonlinear, num_read=rule.num_read,
      out_avals=tuple(jax.core.ShapedArray((size, *a.shape), a.dtype)
                      for a in rule.out_avals))
  outs = linear_p.bind(*nonlinear, *linear, rule=batched)
  return outs, [0] * len(outs)


linear_p.def_impl(_linear_impl)
linear_p.def_abstract_eval(_linear_abstract_eval)
mlir.register_lowering(linear_p, _linear_lowering)
ad.primitive_jvps[linear_p] = _linear_jvp
ad.primitive_transposes[linear_p] = _linear_transpose
batching.primitive_batchers[linear_p] = _linear_batch
