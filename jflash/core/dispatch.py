"""One dispatcher for attention and decode calls.

A call is traced for one platform, its target
(:func:`jflash.core.platform.target`), and runs the first backend that
serves it there: those named by ``implementation=``, or the registry's
default order for that platform (:mod:`jflash.core.registry`).  A backend
declines with ``NotImplementedError`` and the next is tried.  Only when
``implementation`` maps platforms to implementations is the call traced
once per platform named, joined into one multi-platform program
(:mod:`jflash.core.multi_platform`).

Attention calls are differentiable in every mode
(:mod:`jflash.core.derivatives`); where the measured table gives a call
another backend for training than for inference, the inference backend
computes values and the training backend runs whenever a derivative is
taken.  Calls over sharded sequences run context parallelism
(:mod:`jflash.parallel`) with the same backends per block.

Every backend's operations run under the name scope ``jflash/<name>``
(visible in the HLO's op metadata and in profiles), and each choice is
logged once per distinct call signature on the ``jflash`` logger.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jflash.backends.xla import XlaBackend
from jflash.core import derivatives, multi_platform, registry
from jflash.core.call import AttentionCall, Backend, DecodeCall
from jflash.core.platform import PLATFORMS, Target, target
from jflash.parallel import ContextParallel, context, sharding

Array = jax.Array
Call = AttentionCall | DecodeCall
Orders = tuple[tuple[Backend, ...], tuple[Backend, ...]]
"""``(inference, training)`` backend orders of one platform."""

Request = tuple[Backend, ...] | Mapping[str, tuple[Backend, ...] | None] | None
"""What ``implementation=`` asks for, parsed: None (the default order of
the target platform), the backends to try in order, or per platform one
of those (a multi-platform program)."""

LOG_LEVEL_ENV = "JFLASH_LOG_LEVEL"
"""Environment variable naming the level of the backend-choice records
(``DEBUG`` when unset), e.g. ``INFO`` to see them with
``logging.basicConfig(level=logging.INFO)``."""

logger = logging.getLogger("jflash")

_LOG_MEMO_SIZE = 1024
_logged: collections.OrderedDict[tuple, None] = collections.OrderedDict()


# ---------------------------------------------------------------- requests
class NoKernel:
  """A backend name without a kernel for this kind of call (``cudnn`` for
  decode): it declines every call."""

  def __init__(self, name: str, what: str):
    self.name, self.what = name, what

  def __call__(self, call) -> tuple[Array, Array]:
    raise NotImplementedError(f"{self.name} has no {self.what} kernel; the "
                              "'xla' backend serves every call")


def _is_backend(x: Any) -> bool:
  return (not isinstance(x, str) and callable(x)
          and isinstance(getattr(x, "name", None), str))


def _backends(entry: Any, names: Mapping[str, Backend], what: str,
              described: str) -> tuple[Backend, ...]:
  if isinstance(entry, str) or _is_backend(entry):
    entries = (entry,)
  elif isinstance(entry, Sequence):
    entries = tuple(entry)
  else:
    entries = ()
  if not entries or not all(isinstance(e, str) or _is_backend(e)
                            for e in entries):
    raise ValueError(f"implementation must be {described}, got {entry!r}")
  known = set(names) | set(registry.BACKENDS)
  unknown = [e for e in entries if isinstance(e, str) and e not in known]
  if unknown:
    raise ValueError(f"implementation: unknown backend name(s) {unknown}; "
                     f"known: {sorted(known)}")
  return tuple(e if not isinstance(e, str)
               else names.get(e) or NoKernel(e, what) for e in entries)


def parse_request(implementation: Any, decode: bool = False) -> Request:
  """``implementation=`` of :func:`jflash.dot_product_attention` (or, with
  ``decode``, of :func:`jflash.decode_attention`) as a :data:`Request`.

  Raises:
    ValueError: naming what was received and what is accepted.
  """
  names = registry.DECODE_BACKENDS if decode else registry.BACKENDS
  what = "decode" if decode else "attention"
  described = ("None, a backend name, a backend object (such as "
               "jflash.backends.XlaBackend(config)), a non-empty sequence "
               "of those, or a mapping from platforms "
               f"({', '.join(PLATFORMS)}) to any of those")
  if implementation is None:
    return None
  if isinstance(implementation, Mapping):
    if not implementation:
      raise ValueError(f"implementation must be {described}, got an empty "
                       "mapping")
    request = {}
    for platform, entry in implementation.items():
      if platform not in PLATFORMS:
        raise ValueError(f"implementation: {platform!r} is not a lowering "
                         f"platform; known: {list(PLATFORMS)} (a GPU is "
                         "'cuda' or 'rocm')")
      request[platform] = (None if entry is None
                           else _backends(entry, names, what, described))
    return request
  return _backends(implementation, names, what, described)


# ------------------------------------------------------------------ orders
def _orders(call: Call, request: Request, tgt: Target,
            for_training: bool) -> Orders:
  """The backends ``call`` tries on ``tgt``: ``(inference, training)``."""
  if isinstance(request, tuple):
    return request, request
  if isinstance(call, DecodeCall):
    order = registry.decode_order(tgt)
    return order, order
  inference, training = registry.call_orders(call, tgt)
  return (training, training) if for_training else (inference, training)


def first_that_serves(call: Call, backends: Sequence[Backend]
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
    _log_choice(call, backend.name)
    return out, lse, backend
  raise NotImplementedError(
      f"no backend in {[b.name for b in backends]} can serve this call on "
      f"{call.platform} ({call.shape_description}):\n  "
      + "\n  ".join(reasons))


def _leaves(call: Call) -> tuple[list, tuple[bool, ...],
                                  Callable[[list], Call]]:
  """A call's arrays as a flat list, whether each is differentiated, and
  the function rebuilding the call."""
  if isinstance(call, DecodeCall):
    leaves, tree = jax.tree.flatten(call)
    return (leaves, (False,) * len(leaves),
            lambda leaves: jax.tree.unflatten(tree, leaves))
  return call.flatten()


def _serve_on(call: Call, tgt: Target, request: Request, use: int,
              for_training: bool, wrap: Callable[[Backend], Backend],
              chosen: dict[str, str]) -> tuple[Array, Array]:
  """``call`` traced for ``tgt``, served by the first backend of the
  ``use``-th order (0 inference, 1 training) that serves it; the choice is
  recorded in ``chosen``."""
  call = dataclasses.replace(call, platform=tgt.platform,
                             device_kind=tgt.device_kind)
  order = _orders(call, request, tgt, for_training)[use]
  out, lse, backend = first_that_serves(call, tuple(map(wrap, order)))
  chosen.setdefault(tgt.platform, backend.name)
  return out, lse


def _served(call: Call, request: Request, use: int, for_training: bool,
            wrap: Callable[[Backend], Backend], chosen: dict[str, str]
            ) -> Callable[[Call], tuple[Array, Array]]:
  """The function serving ``call`` (with its arrays replaced) on its
  target platform from the ``use``-th order (0 inference, 1 training)."""
  tgt = target(call.query)
  return lambda c: _serve_on(c, tgt, request, use, for_training, wrap,
                             chosen)


def _multi_platform(call: Call, request: Mapping, for_training: bool,
                    wrap: Callable[[Backend], Backend],
                    chosen: dict[str, str]
                    ) -> Callable[[Call], tuple[Array, Array]]:
  """The function serving ``call`` on each platform ``request`` names,
  joined in one program (:mod:`jflash.core.multi_platform`)."""
  tgt = target(call.query)
  targets = {p: tgt if p == tgt.platform else Target(p) for p in request}
  keep = tgt.platform if tgt.platform in targets else next(iter(targets))

  def serve(c: Call) -> tuple[Array, Array]:
    leaves, diff, rebuild = _leaves(c)

    def on(platform: str, use: int):
      return lambda *l: _serve_on(rebuild(list(l)), targets[platform],
                                  request[platform], use, for_training, wrap,
                                  chosen)

    if isinstance(c, DecodeCall):
      return tuple(multi_platform.per_platform(
          {p: on(p, 0) for p in targets}, *leaves))
    return multi_platform.joined({p: (on(p, 0), on(p, 1)) for p in targets},
                                 keep, diff)(*leaves)
  return serve


# -------------------------------------------------------------- attention
def attention(call: AttentionCall, request: Request,
              parallel: ContextParallel | None = None, *,
              for_training: bool = False) -> tuple[Array, Array, str]:
  """``(out, lse, name of the backend that computes the value)`` of an
  attention call, differentiable in every mode.

  A call whose sequences are sharded (``parallel.axis_name`` inside a
  ``shard_map``, or an explicitly sequence-sharded query) runs context
  parallelism, each block served by the first backend of the order that
  serves it (reverse-mode derivatives only).

  Args:
    call: the canonical call.
    request: the parsed ``implementation=``.
    parallel: the caller's ``context_parallel``.
    for_training: take the training order for values too (what
      :func:`jflash.selected_implementation` reports for training).
  """
  if parallel is not None and parallel.axis_name is not None:
    return _context(call, request, parallel, parallel.axis_name,
                    parallel.axis_size(), for_training)
  if (sharding.sequence_axes(call) is not None and call.bias is None
      and call.mask.dense is None):
    parallel = parallel or ContextParallel()
    names = []

    def run_local(local, axis, size):
      out, lse, name = _context(local, request, parallel, axis, size,
                                for_training)
      names.append(name)
      return out, lse

    out, lse = sharding.run_sequence_sharded(call, run_local)
    return out, lse, names[0]
  if parallel is not None:
    # Unsharded, every layout is the contiguous one (one shard); under a
    # mesh of Auto axes the sharding is not known while tracing.
    if (parallel.layout != "contiguous"
        and jax.sharding.get_abstract_mesh().size > 1):
      raise ValueError(
          f"context_parallel.layout={parallel.layout!r} says where each "
          "shard's positions lie, which needs the sequence sharding known "
          "while tracing: shard the inputs over Explicit mesh axes, or call "
          "inside jax.shard_map with context_parallel.axis_name; with Auto "
          "mesh axes (or no sharded sequence) use layout='contiguous'")
    # The strategy, for kernels partitioned under Auto mesh axes that find
    # the sequence sharded (jflash.parallel.partitioning).
    call = dataclasses.replace(call, context_parallel=parallel)
  return _attention(call, request, for_training)


def _context(call: AttentionCall, request: Request,
             parallel: ContextParallel, axis, size: int, for_training: bool
             ) -> tuple[Array, Array, str]:
  """Context parallelism over ``axis`` (``size`` shards) on a call that
  holds one shard of each sequence."""
  if call.bias is not None or call.mask.dense is not None:
    raise ValueError(
        "context_parallel: a bias or a dense boolean mask cannot follow a "
        "sharded sequence; express the mask with is_causal, "
        "local_window_size, segment_ids and lengths")
  plan = parallel.plan(axis, size, call.query.shape[2], call.key.shape[2])
  plan.validate(call.query.shape[1], call.key.shape[1])
  return _attention(call, request, for_training,
                    wrap=lambda b: context.ContextBackend(b, plan),
                    reverse_only="for a context-parallel (sequence-sharded) "
                    "call")


def _attention(call: AttentionCall, request: Request, for_training: bool,
               wrap: Callable[[Backend], Backend] = lambda b: b,
               reverse_only: str = "") -> tuple[Array, Array, str]:
  """The served call, differentiable in every mode (reverse mode only,
  with ``reverse_only`` naming the calls for which); ``wrap`` is applied
  to each backend before it is tried."""
  chosen: dict[str, str] = {}
  if isinstance(request, Mapping):
    value = train = _multi_platform(call, request, for_training, wrap, chosen)
  else:
    value = _served(call, request, 0, for_training, wrap, chosen)
    train = _served(call, request, 1, for_training, wrap, {})
  xla = None
  if not reverse_only:
    xla = next((b for b in (request if isinstance(request, tuple) else ())
                if isinstance(b, XlaBackend)), registry.BACKENDS["xla"])
  out, lse = derivatives.differentiable(call, train, xla, reverse_only,
                                        value=value)
  return out, lse, _reported(call, chosen)


def _reported(call: Call, chosen: Mapping[str, str]) -> str:
  """The choice for the target platform (of several, the first traced)."""
  return chosen.get(target(call.query).platform, next(iter(chosen.values())))


# ----------------------------------------------------------------- decode
def decode(call: DecodeCall, request: Request) -> tuple[Array, Array, str]:
  """``(out, lse, name of the backend chosen)`` of a decode call."""
  chosen: dict[str, str] = {}
  if isinstance(request, Mapping):
    serve = _multi_platform(call, request, False, lambda b: b, chosen)
  else:
    serve = _served(call, request, 0, False, lambda b: b, chosen)
  out, lse = _inference(serve, call)
  return out, lse, _reported(call, chosen)


def _inference(serve, call: DecodeCall) -> tuple[Array, Array]:
  """``serve(call)``, whose derivative (forward or reverse mode, which
  goes through this rule) raises."""
  leaves, tree = jax.tree.flatten(call)

  @jax.custom_jvp
  def run(*leaves):
    return serve(jax.tree.unflatten(tree, leaves))

  @run.defjvp
  def _no_derivative(primals, tangents):
    raise NotImplementedError(
        "jflash.decode_attention is inference-only and has no derivative; "
        "differentiate jflash.dot_product_attention (with "
        "key_value_seq_lengths and is_causal) instead")

  return run(*leaves)


# ---------------------------------------------------------------- logging
def _signature(call: Call, name: str) -> tuple:
  if isinstance(call, DecodeCall):
    features = tuple(n for n, present in (
        ("paged", call.paged), ("window", call.window is not None),
        ("soft_cap", call.logits_soft_cap is not None),
        ("alibi", call.alibi_slopes is not None),
        ("mask_fn", call.mask_fn is not None),
        ("interpret", call.interpret)) if present)
    return ("decode", call.shape_description, features, call.platform, name)
  mask = call.mask
  features = tuple(n for n, present in (
      ("causal", mask.is_causal), ("window", mask.window is not None),
      ("q_lengths", mask.q_lengths is not None),
      ("kv_lengths", mask.kv_lengths is not None),
      ("segment_ids", mask.q_segment_ids is not None),
      ("offsets", mask.has_offsets),
      ("mask", mask.dense is not None), ("mask_fn", mask.mask_fn is not None),
      ("bias", call.bias is not None),
      ("soft_cap", call.logits_soft_cap is not None),
      ("alibi", call.alibi_slopes is not None),
      ("residual", call.returns_residual),
      ("interpret", call.interpret)) if present)
  return ("attention", call.shape_description, features, call.platform,
          name)


def _log_level() -> int:
  value = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
  level = logging.getLevelName(value) if value else logging.DEBUG
  return level if isinstance(level, int) else logging.DEBUG


def _log_choice(call: Call, name: str) -> None:
  """Logs the backend chosen, once per distinct call signature (the most
  recent signatures are remembered)."""
  key = _signature(call, name)
  if key in _logged:
    _logged.move_to_end(key)
    return
  _logged[key] = None
  if len(_logged) > _LOG_MEMO_SIZE:
    _logged.popitem(last=False)
  kind, shape, features, platform, _ = key
  logger.log(_log_level(), "jflash.%s %s%s: %s -> %s",
             "decode_attention" if kind == "decode"
             else "dot_product_attention", shape,
             "".join(f" {f}" for f in features), platform, name)
