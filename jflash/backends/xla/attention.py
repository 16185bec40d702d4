"""The ``xla`` backend: blockwise exact attention in pure JAX.

The FlashAttention recurrence written with ``lax`` loops: the ``[T, S]``
score matrix is visited one ``block_q x block_kv`` tile at a time with an
online softmax, so memory stays linear in sequence length.  Tiles that
:func:`jflash.tiles.tile_schedule` marks empty are never computed.  The
backward pass (its own ``jax.custom_vjp``) recomputes probabilities tile by
tile from the saved logsumexp, in two passes (dQ; then dK and dV), neither
of which needs atomics, so results are deterministic.

Tiles span the whole batch and all heads, so inputs sharded over batch or
heads with ``NamedSharding`` stay sharded through the loops.  The softmax
and every accumulation are float32 (float64 for float64 inputs).  Tile
products of bfloat16/float16 inputs take operands in that dtype with
float32 accumulation, as FlashAttention does; float32 inputs (or
``XlaConfig(matmul_inputs="float32")``) multiply at
``Precision.HIGHEST``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jflash import masks, tiles
from jflash.core import alibi
from jflash.core.call import AttentionCall, check_config
from jflash.core.padding import pad_axis

Array = jax.Array
_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class XlaConfig:
  """Tiling of the ``xla`` backend.

  Attributes:
    block_q: query rows per tile (clipped to ``T``); None: the rule of
      :func:`default_block`.
    block_kv: keys per tile (clipped to ``S``); None: the same rule.
    max_tile_elements: upper bound on ``B * N * block_q * block_kv``, the
      size of one float32 score tile; blocks are halved (down to 16) until a
      tile fits, which bounds the loop's working memory.
    matmul_inputs: operands of the tile matrix products.  ``"auto"``:
      bfloat16/float16 inputs multiply in their own dtype with float32
      accumulation (the tensor-core path, as FlashAttention and cuDNN do;
      probabilities and score gradients are rounded to that dtype before
      their products), float32/float64 inputs at ``Precision.HIGHEST``.
      ``"float32"``: every product in float32 (float64 for float64 inputs)
      at ``Precision.HIGHEST``, for the smallest error at several times the
      cost on GPUs and TPUs.
  """

  block_q: int | None = None
  block_kv: int | None = None
  max_tile_elements: int = 1 << 24
  matmul_inputs: str = "auto"

  def __post_init__(self):
    check_config(self, ("max_tile_elements",), ("block_q", "block_kv"))

  def blocks_for(self, batch: int, heads: int, q_len: int, kv_len: int,
                 window_span: int | None = None) -> tuple[int, int]:
    """The ``(block_q, block_kv)`` used for one call's shapes;
    ``window_span``: how many keys a query sees at most (a window), or
    None."""
    block_q = self.block_q or default_block(window_span)
    block_kv = self.block_kv or default_block(window_span)
    block_q, block_kv = min(block_q, q_len), min(block_kv, kv_len)
    while batch * heads * block_q * block_kv > self.max_tile_elements:
      if block_kv >= block_q and block_kv > 16:
        block_kv = max(16, block_kv // 2)
      elif block_q > 16:
        block_q = max(16, block_q // 2)
      else:
        break
    return block_q, block_kv


def default_block(window_span: int | None) -> int:
  """512, or for a window of ``window_span`` keys the power of two at or
  below half of it, at least 64: tiles much wider than the band of visible
  keys compute mostly hidden pairs, and a sparser mask must not be
  slower than a denser one."""
  if window_span is None or window_span >= 1024:
    return 512
  return max(64, 1 << max(0, (window_span // 2).bit_length() - 1))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one call (hashable: a ``nondiff_argnums`` entry)."""

  scale: float
  soft_cap: float | None
  block_q: int
  block_kv: int
  num_q: int
  num_kv: int
  compute_dtype: np.dtype
  matmul_dtype: np.dtype  # operand dtype of the tile products


def _mm(plan: _Plan, subscripts: str, a: Array, b: Array) -> Array:
  """A tile product in ``plan.matmul_dtype``, accumulated in the compute
  dtype."""
  if plan.matmul_dtype == plan.compute_dtype:
    return jnp.einsum(subscripts, a, b, precision=_HIGHEST)
  return jnp.einsum(subscripts, a.astype(plan.matmul_dtype),
                    b.astype(plan.matmul_dtype),
                    preferred_element_type=plan.compute_dtype)


def _split_heads(x: Array, num_kv_heads: int) -> Array:
  """``[B', N|1, ...]`` -> ``[B', K|1, G|1, ...]`` (head n = k * G + g)."""
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], num_kv_heads, -1, *x.shape[2:])


def _merge_heads(x: Array) -> Array:
  """``[B, K, G, rows, ...]`` -> ``[B, rows, N, ...]``."""
  b, k, g, rows = x.shape[:4]
  x = x.reshape(b, k * g, rows, *x.shape[4:])
  return jnp.moveaxis(x, 1, 2)


class _Tiles:
  """Loads tiles of the padded operands and recomputes tile logits."""

  def __init__(self, q, k, v, bias, mask: masks.AttentionMask, slopes,
               plan: _Plan):
    self.plan = plan
    self.slopes = None if slopes is None else _split_heads(
        slopes.astype(plan.compute_dtype)[:, :, None, None], k.shape[2])
    self.num_kv_heads = k.shape[2]
    tq, tk = plan.num_q * plan.block_q, plan.num_kv * plan.block_kv
    self.mask = mask.padded(tq, tk)
    self.q = pad_axis(q, 1, tq)
    self.k = pad_axis(k, 1, tk)
    self.v = pad_axis(v, 1, tk)
    if bias is not None:
      if bias.shape[2] > 1:
        bias = pad_axis(bias, 2, tq)
      if bias.shape[3] > 1:
        bias = pad_axis(bias, 3, tk)
    self.bias = bias

  def rows(self, x: Array, qi: Array) -> Array:
    """Query-side rows of block ``qi`` as ``[B, bq, K, G, ...]``."""
    blk = lax.dynamic_slice_in_dim(x, qi * self.plan.block_q,
                                   self.plan.block_q, 1)
    blk = blk.astype(self.plan.compute_dtype)
    return blk.reshape(blk.shape[0], blk.shape[1], self.num_kv_heads, -1,
                       *blk.shape[3:])

  def query_stats(self, x: Array, qi: Array) -> Array:
    """Per-row statistics ``[B, Tp, N]`` of block ``qi`` as ``[B, K, G, bq]``."""
    blk = lax.dynamic_slice_in_dim(x, qi * self.plan.block_q,
                                   self.plan.block_q, 1)
    return _split_heads(jnp.moveaxis(blk, 2, 1), self.num_kv_heads)

  def keys(self, ki: Array) -> tuple[Array, Array]:
    start, size = ki * self.plan.block_kv, self.plan.block_kv
    kb = lax.dynamic_slice_in_dim(self.k, start, size, 1)
    vb = lax.dynamic_slice_in_dim(self.v, start, size, 1)
    cdt = self.plan.compute_dtype
    return kb.astype(cdt), vb.astype(cdt)

  def bias_slice(self, x: Array, qi: Array, ki: Array) -> Array:
    """The ``[B|1, N|1, bq|1, bk|1]`` window of a bias-shaped array."""
    if x.shape[2] > 1:
      x = lax.dynamic_slice_in_dim(x, qi * self.plan.block_q,
                                   self.plan.block_q, 2)
    if x.shape[3] > 1:
      x = lax.dynamic_slice_in_dim(x, ki * self.plan.block_kv,
                                   self.plan.block_kv, 3)
    return x

  def logits(self, qb: Array, kb: Array, qi: Array,
             ki: Array) -> tuple[Array, Array | None]:
    """Masked logits ``[B, K, G, bq, bk]`` of tile (qi, ki), and
    ``tanh(raw / cap)`` when a soft cap is set (for its derivative)."""
    plan = self.plan
    s = _mm(plan, "bqkgh,bskh->bkgqs", qb, kb)
    s = s * jnp.asarray(plan.scale, s.dtype)
    if self.bias is not None:
      bias = self.bias_slice(self.bias, qi, ki).astype(s.dtype)
      s = s + _split_heads(bias, self.num_kv_heads)
    tanh = None
    if plan.soft_cap is not None:
      cap = jnp.asarray(plan.soft_cap, s.dtype)
      tanh = jnp.tanh(s / cap)
      s = cap * tanh
    if self.slopes is not None:
      q_pos = (qi * plan.block_q + jnp.arange(plan.block_q, dtype=jnp.int32)
               + self.mask.diagonal_shift())
      k_pos = ki * plan.block_kv + jnp.arange(plan.block_kv, dtype=jnp.int32)
      s = s + alibi.penalty(self.slopes, q_pos[:, None] - k_pos[None, :])
    visible = self.mask.block_visibility(qi * plan.block_q, plan.block_q,
                                         ki * plan.block_kv, plan.block_kv)
    s = jnp.where(_split_heads(visible, self.num_kv_heads), s, -jnp.inf)
    return s, tanh


def _forward(q, k, v, bias, mask, slopes, sched: tiles.TileSchedule,
             plan: _Plan, static_trip: bool = False):
  """``(out, lse)``.  ``static_trip``: every query block's loop runs over
  all key blocks, skipping the ones not scheduled, so that it is a scan
  JAX can differentiate in reverse mode as well as forward."""
  tiles = _Tiles(q, k, v, bias, mask, slopes, plan)
  batch, _, num_heads, head_dim = q.shape

  def q_block(qi):
    qb = tiles.rows(tiles.q, qi)

    def body(j, carry):
      m, l, acc = carry
      ki = sched.kv_order[0, qi, j]
      kb, vb = tiles.keys(ki)
      s, _ = tiles.logits(qb, kb, qi, ki)
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      l = alpha * l + p.sum(-1)
      acc = alpha[..., None] * acc + _mm(plan, "bkgqs,bskh->bkgqh", p, vb)
      return m_new, l, acc

    # Built from qb so that they carry its sharding (explicit-sharding mode
    # needs loop carries typed like the values the body produces).
    acc0 = jnp.zeros_like(jnp.moveaxis(qb, 1, 3))  # [B, K, G, bq, H]
    init = (jnp.full_like(acc0[..., 0], -jnp.inf), jnp.zeros_like(acc0[..., 0]),
            acc0)
    count = sched.kv_count[0, qi]
    if static_trip:
      m, l, acc = lax.fori_loop(
          0, plan.num_kv, lambda j, carry: lax.cond(
              j < count, functools.partial(body, j), lambda c: c, carry),
          init)
    else:
      m, l, acc = lax.fori_loop(0, count, body, init)
    empty = l == 0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
    return _merge_heads(out), _merge_heads(lse)

  out, lse = lax.map(q_block, jnp.arange(plan.num_q, dtype=jnp.int32))
  # [nq, B, bq, N, ...] -> [B, T, N, ...]
  out = jnp.moveaxis(out, 0, 1).reshape(batch, -1, num_heads, head_dim)
  lse = jnp.moveaxis(lse, 0, 1).reshape(batch, -1, num_heads)
  q_len = q.shape[1]
  # The output stays in the compute dtype here: the backward pass takes
  # delta = rowsum(dO * O) from it, and an O rounded to bfloat16 would cost
  # dQ and dK several times the rounding error of the result.
  # The logsumexp in the compute dtype: float32, float64 for float64.
  return out[:, :q_len], lse[:, :q_len]


def _reduce_to(x: Array, shape: tuple[int, ...]) -> Array:
  """Sums ``x`` over the axes where ``shape`` has a broadcast 1."""
  axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape))
               if b == 1 and a != 1)
  return x.sum(axis=axes, keepdims=True) if axes else x


def _backward(q, k, v, bias, mask, slopes, sched, out, lse, d_out, d_lse,
              plan: _Plan):
  tiles = _Tiles(q, k, v, bias, mask, slopes, plan)
  cdt = plan.compute_dtype
  tq = plan.num_q * plan.block_q
  # delta_i = sum_h dO_ih O_ih - dlse_i: the row term of the softmax
  # derivative, including the logsumexp's own cotangent.
  delta = jnp.einsum("btnh,btnh->btn", d_out.astype(cdt), out.astype(cdt),
                     precision=_HIGHEST) - d_lse.astype(cdt)
  lse = jnp.where(jnp.isneginf(lse), 0.0, lse).astype(cdt)
  lse, delta = pad_axis(lse, 1, tq), pad_axis(delta, 1, tq)
  d_out_padded = pad_axis(d_out, 1, tq)
  scale = jnp.asarray(plan.scale, cdt)

  def logit_grads(qb, dob, lse_b, delta_b, kb, vb, qi, ki):
    s, tanh = tiles.logits(qb, kb, qi, ki)
    p = jnp.exp(s - lse_b[..., None])
    dp = _mm(plan, "bqkgh,bskh->bkgqs", dob, vb)
    ds = p * (dp - delta_b[..., None])
    if tanh is not None:
      ds = ds * (1.0 - tanh * tanh)
    return p, ds

  def query_side(qi):
    return (tiles.rows(tiles.q, qi), tiles.rows(d_out_padded, qi),
            tiles.query_stats(lse, qi), tiles.query_stats(delta, qi))

  # Pass 1: dQ (and dbias), one query block at a time.
  dbias0 = None
  if bias is not None:
    dbias0 = jnp.zeros(tiles.bias.shape, cdt)

  def dq_block(dbias, qi):
    qb, dob, lse_b, delta_b = query_side(qi)

    def body(j, carry):
      dq, dbias = carry
      ki = sched.kv_order[0, qi, j]
      kb, vb = tiles.keys(ki)
      _, ds = logit_grads(qb, dob, lse_b, delta_b, kb, vb, qi, ki)
      dq = dq + _mm(plan, "bkgqs,bskh->bqkgh", ds, kb)
      if dbias is not None:
        merged = ds.reshape(ds.shape[0], -1, *ds.shape[3:])  # [B, N, bq, bk]
        window = tiles.bias_slice(dbias, qi, ki)
        update = window + _reduce_to(merged, window.shape)
        zero = jnp.zeros((), jnp.int32)
        starts = (zero, zero,
                  qi * plan.block_q if dbias.shape[2] > 1 else zero,
                  ki * plan.block_kv if dbias.shape[3] > 1 else zero)
        dbias = lax.dynamic_update_slice(dbias, update, starts)
      return dq, dbias

    dq, dbias = lax.fori_loop(0, sched.kv_count[0, qi], body,
                              (jnp.zeros_like(qb), dbias))
    dq = dq * scale
    return dbias, dq.reshape(dq.shape[:2] + (-1, dq.shape[-1]))

  dbias, dq = lax.scan(dq_block, dbias0, jnp.arange(plan.num_q, dtype=jnp.int32))
  dq = jnp.moveaxis(dq, 0, 1).reshape(tiles.q.shape)[:, :q.shape[1]]  # [B,T,N,H]

  # Pass 2: dK and dV, one key block at a time; the query-head group of
  # each key/value head is summed inside the einsums.
  def dkv_block(ki):
    kb, vb = tiles.keys(ki)

    def body(j, carry):
      dk, dv = carry
      qi = sched.q_order[0, ki, j]
      qb, dob, lse_b, delta_b = query_side(qi)
      p, ds = logit_grads(qb, dob, lse_b, delta_b, kb, vb, qi, ki)
      dv = dv + _mm(plan, "bkgqs,bqkgh->bskh", p, dob)
      dk = dk + _mm(plan, "bkgqs,bqkgh->bskh", ds, qb)
      return dk, dv

    dk, dv = lax.fori_loop(0, sched.q_count[0, ki], body,
                           (jnp.zeros_like(kb), jnp.zeros_like(vb)))
    return dk * scale, dv

  dk, dv = lax.map(dkv_block, jnp.arange(plan.num_kv, dtype=jnp.int32))
  kv_len = k.shape[1]
  dk = jnp.moveaxis(dk, 0, 1).reshape(tiles.k.shape)[:, :kv_len]
  dv = jnp.moveaxis(dv, 0, 1).reshape(tiles.v.shape)[:, :kv_len]
  if dbias is not None:
    dbias = dbias[:, :, :bias.shape[2], :bias.shape[3]].astype(bias.dtype)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


def _schedule(mask, plan: _Plan) -> tiles.TileSchedule:
  # One schedule for the whole batch (a tile is visited if any row needs
  # it), so the loops stay batch-vectorized and batch sharding survives.
  return tiles.tile_schedule(mask, plan.block_q, plan.block_kv,
                             merge_batch=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, bias, mask, slopes, plan):
  out, lse = _forward(q, k, v, bias, mask, slopes, _schedule(mask, plan),
                      plan)
  return out.astype(q.dtype), lse


def _attention_fwd(q, k, v, bias, mask, slopes, plan):
  sched = _schedule(mask, plan)
  out, lse = _forward(q, k, v, bias, mask, slopes, sched, plan)
  return ((out.astype(q.dtype), lse),
          (q, k, v, bias, mask, slopes, sched, out, lse))


def _attention_bwd(plan, residuals, cotangents):
  q, k, v, bias, mask, slopes, sched, out, lse = residuals
  d_out, d_lse = cotangents
  dq, dk, dv, dbias = _backward(q, k, v, bias, mask, slopes, sched, out, lse,
                                d_out, d_lse, plan)
  # The slopes are constants (jflash.core.alibi): no cotangent.
  return dq, dk, dv, dbias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@dataclasses.dataclass(frozen=True)
class XlaBackend:
  """Serves every valid call on every platform."""

  config: XlaConfig = XlaConfig()
  name: str = "xla"

  def __call__(self, call: AttentionCall) -> tuple[Array, Array]:
    return _attention(call.query, call.key, call.value, call.bias, call.mask,
                      call.alibi_slopes, self._plan(call))

  def forward(self, call: AttentionCall) -> tuple[Array, Array]:
    """``(out, lse)`` without a derivative, ``out`` in the compute dtype
    (float32 or wider): one block of a context-parallel call."""
    plan = self._plan(call)
    return _forward(call.query, call.key, call.value, call.bias, call.mask,
                    call.alibi_slopes, _schedule(call.mask, plan), plan)

  def backward(self, call: AttentionCall, out: Array, lse: Array,
               d_out: Array, d_lse: Array) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of one block given the whole call's ``out`` and
    ``lse`` (FlashAttention's backward recomputes the block's probabilities
    from the final logsumexp, so blocks' gradients add up)."""
    if call.bias is not None:
      raise NotImplementedError(f"{self.name}: a block backward takes no bias")
    plan = self._plan(call)
    dq, dk, dv, _ = _backward(call.query, call.key, call.value, None,
                              call.mask, call.alibi_slopes,
                              _schedule(call.mask, plan), out, lse, d_out,
                              d_lse, plan)
    return dq, dk, dv

  def differentiable(self, call: AttentionCall) -> tuple[Array, Array]:
    """The same forward computation without the custom backward: JAX
    differentiates it in any mode and to any order (forward mode, as in
    ``jax.jvp``, in memory linear in sequence length; reverse mode through
    it stores every visited tile)."""
    plan = self._plan(call)
    sched = _schedule(call.mask, plan)
    out, lse = _forward(call.query, call.key, call.value, call.bias,
                        call.mask, call.alibi_slopes, sched, plan,
                        static_trip=True)
    return out.astype(call.dtype), lse

  def _plan(self, call: AttentionCall) -> _Plan:
    batch, q_len, num_heads, _ = call.query.shape
    kv_len = call.key.shape[1]
    mask, right = call.mask, call.mask.right_offset()
    span = (None if mask.window is None or right is None
            else mask.window[0] + right + 1)
    block_q, block_kv = self.config.blocks_for(batch, num_heads, q_len,
                                               kv_len, span)
    compute_dtype = np.dtype(jnp.promote_types(call.dtype, jnp.float32))
    low_precision = call.dtype in (jnp.bfloat16, jnp.float16)
    matmul_dtype = (np.dtype(call.dtype) if low_precision
                    and self.config.matmul_inputs == "auto" else compute_dtype)
    return _Plan(scale=float(call.scale), soft_cap=call.logits_soft_cap,
                 block_q=block_q, block_kv=block_kv,
                 num_q=-(-q_len // block_q), num_kv=-(-kv_len // block_kv),
                 compute_dtype=compute_dtype, matmul_dtype=matmul_dtype)
