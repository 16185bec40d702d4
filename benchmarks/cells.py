"""The benchmark grid: cell specifications, filters and FLOP counting.

FLOPs follow the FlashAttention convention: the forward pass of a dense cell
counts ``4 * B * N * T * S * H``, halved when causal; forward+backward counts
3.5 times the forward.  Windowed and packed-segment cells count only the
visible ``(query, key)`` pairs: ``4 * N * H * pairs``; their dense
equivalent (the convention's figure for the same shape, causal or not) is
reported next to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

PASSES = ("fwd", "fwdbwd")
"""Forward only, and forward+backward (``jax.vjp`` on a random cotangent)."""

PASS_FLOP_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5}
"""Multiples of the forward FLOPs: the backward counts 2.5 forwards."""


@dataclasses.dataclass(frozen=True)
class Cell:
  """One self-attention problem: ``q [B, S, N, H]``, ``k, v [B, S, K, H]``.

  Attributes:
    batch: ``B``.
    seq_len: ``S`` (= ``T``).
    num_heads: ``N`` query heads.
    head_dim: ``H``.
    causal: keys after the query are hidden.
    window: left window size (``local_window_size=(window, 0)``), or None.
    segments: packed segments per row (0: none).
    num_kv_heads: ``K``; None means ``N`` (plain multi-head attention).
  """

  batch: int
  seq_len: int
  num_heads: int
  head_dim: int
  causal: bool
  window: int | None = None
  segments: int = 0
  num_kv_heads: int | None = None

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def kind(self) -> str:
    """``dense``, ``window`` or ``segments``."""
    if self.segments:
      return "segments"
    return "window" if self.window is not None else "dense"

  @property
  def local_window_size(self) -> tuple[int, int] | None:
    return None if self.window is None else (self.window, 0)

  @property
  def name(self) -> str:
    parts = [f"S{self.seq_len}", f"H{self.head_dim}",
             "causal" if self.causal else "full"]
    if self.window is not None:
      parts.append(f"w{self.window}")
    if self.segments:
      parts.append(f"seg{self.segments}")
    return "-".join(parts)

  def describe(self) -> dict:
    """The JSON fields of the cell."""
    return dict(name=self.name, kind=self.kind, B=self.batch,
                T=self.seq_len, S=self.seq_len, N=self.num_heads,
                K=self.kv_heads, H=self.head_dim, causal=self.causal,
                window=None if self.window is None else [self.window, 0],
                segments=self.segments)


@dataclasses.dataclass(frozen=True)
class GridSpec:
  """A grid: ``B * S = tokens`` and ``N * H = width`` in every cell."""

  tokens: int
  width: int
  seq_lens: tuple[int, ...]
  head_dims: tuple[int, ...]
  window: int
  segments: int
  special_seq: int
  special_head_dims: tuple[int, ...]

  def cell(self, seq_len: int, head_dim: int, causal: bool,
           **extra) -> Cell:
    if self.tokens % seq_len or self.width % head_dim:
      raise ValueError(f"S={seq_len} must divide {self.tokens} tokens and "
                       f"H={head_dim} must divide width {self.width}")
    return Cell(self.tokens // seq_len, seq_len, self.width // head_dim,
                head_dim, causal, **extra)

  def cells(self) -> list[Cell]:
    """Every cell, most important first (a run cut short by a time budget
    loses the tail): for each head dim (the special ones first), dense cells
    by length, non-causal then causal, then that head dim's windowed and
    segment cells."""
    heads = list(dict.fromkeys(self.special_head_dims + self.head_dims))
    out = []
    for h in heads:
      if h in self.head_dims:
        out += [self.cell(s, h, c) for s in self.seq_lens
                for c in (False, True)]
      if h in self.special_head_dims:
        out.append(self.cell(self.special_seq, h, True, window=self.window))
        out.append(self.cell(self.special_seq, h, False,
                             segments=self.segments))
    return out

  def quick_cells(self) -> list[Cell]:
    """A few small cells plus the windowed and segment ones."""
    h = 128 if 128 in self.head_dims else self.special_head_dims[0]
    small, mid = self.seq_lens[0], self.seq_lens[min(1, len(self.seq_lens) - 1)]
    out = [self.cell(small, h, False), self.cell(small, h, True),
           self.cell(mid, h, True)]
    out.append(self.cell(self.special_seq, h, True, window=self.window))
    out.append(self.cell(self.special_seq, h, False, segments=self.segments))
    return list(dict.fromkeys(out))


FULL = GridSpec(tokens=16384, width=2048, seq_lens=(1024, 4096, 16384),
                head_dims=(64, 128, 256), window=1024, segments=8,
                special_seq=16384, special_head_dims=(128,))
"""The published grid (20 cells)."""

TINY = GridSpec(tokens=512, width=128, seq_lens=(128, 256),
                head_dims=(32, 64), window=64, segments=4, special_seq=256,
                special_head_dims=(64,))
"""Small shapes for the CPU and for tests."""

_KEYS = {"B": "batch", "S": "seq_len", "T": "seq_len", "N": "num_heads",
         "H": "head_dim", "causal": "causal", "kind": "kind",
         "window": "window", "segments": "segments", "name": "name"}


def _value(cell: Cell, key: str) -> str:
  v = getattr(cell, _KEYS[key])
  if isinstance(v, bool):
    return "1" if v else "0"
  return str(v)


def _norm(key: str, text: str) -> str:
  if key == "causal":
    return {"true": "1", "false": "0", "yes": "1", "no": "0"}.get(
        text.lower(), text)
  return text


def filter_cells(cells: Sequence[Cell], expr: str | None) -> list[Cell]:
  """Cells matching ``expr``: comma-separated ``key=value`` terms (keys B,
  S, N, H, causal, kind, window, segments, name).  Terms on the same key are
  alternatives, different keys must all match: ``S=1024,S=4096,H=128``.  A
  bare term matches a substring of the cell name."""
  if not expr:
    return list(cells)
  wanted: dict[str, set[str]] = {}
  for term in filter(None, (t.strip() for t in expr.split(","))):
    key, sep, value = term.partition("=")
    if not sep:
      key, value = "substr", term
    elif key not in _KEYS:
      raise ValueError(f"--cells: unknown key {key!r} in {term!r}; known: "
                       f"{sorted(_KEYS)}")
    wanted.setdefault(key, set()).add(_norm(key, value))

  def match(cell: Cell) -> bool:
    for key, values in wanted.items():
      if key == "substr":
        if not any(v in cell.name for v in values):
          return False
      elif _value(cell, key) not in values:
        return False
    return True
  return [c for c in cells if match(c)]


def make_segment_ids(rng: np.random.Generator, batch: int, length: int,
                     segments: int) -> np.ndarray:
  """``[B, length]`` int32: ``segments`` contiguous packed segments per row
  with random lengths (each at least 1) that sum to ``length``."""
  ids = np.zeros((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), size=segments - 1,
                              replace=False))
    for c in cuts:
      ids[b, c:] += 1
  return ids


def _pairs_in_run(length: int, causal: bool, window: int | None) -> int:
  """Visible pairs of self-attention over ``length`` positions."""
  if window is not None and not causal:
    raise ValueError("only causal windows are counted in closed form")
  if not causal:
    return length * length
  if window is None or length <= window + 1:
    return length * (length + 1) // 2
  return (window + 1) * (window + 2) // 2 + (length - window - 1) * (
      window + 1)


def _runs(row: np.ndarray) -> list[int]:
  """Lengths of the runs of equal ids of one row (which must not repeat an
  id after a different one: packed documents)."""
  change = np.flatnonzero(np.diff(row)) + 1
  bounds = np.concatenate([[0], change, [len(row)]])
  starts = row[bounds[:-1]]
  if len(set(starts.tolist())) != len(starts):
    raise ValueError("segment ids must form contiguous runs")
  return np.diff(bounds).tolist()


def visible_pairs(cell: Cell, segment_ids: np.ndarray | None = None) -> int:
  """Exact number of visible ``(query, key)`` pairs over all batch rows."""
  if not cell.segments:
    return cell.batch * _pairs_in_run(cell.seq_len, cell.causal, cell.window)
  if segment_ids is None:
    raise ValueError(f"{cell.name} needs its segment ids")
  return sum(_pairs_in_run(n, cell.causal, cell.window)
             for row in np.asarray(segment_ids) for n in _runs(row))


def count_visible_bruteforce(cell: Cell,
                             segment_ids: np.ndarray | None = None,
                             chunk: int = 512) -> int:
  """The same count from :class:`jflash.masks.AttentionMask`, summed over
  query chunks (slow; for tests and for masks without a closed form)."""
  import jax.numpy as jnp
  from jflash.masks import AttentionMask
  seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  mask = AttentionMask(batch=cell.batch, q_len=cell.seq_len,
                       kv_len=cell.seq_len, is_causal=cell.causal,
                       window=cell.local_window_size, q_segment_ids=seg,
                       kv_segment_ids=seg).padded(
                           -(-cell.seq_len // chunk) * chunk, cell.seq_len)
  total = 0
  for start in range(0, cell.seq_len, chunk):
    vis = mask.block_visibility(start, chunk, 0, cell.seq_len)
    vis = jnp.broadcast_to(vis, (cell.batch,) + vis.shape[1:])
    total += int(vis.sum())
  return total


def dense_flops(cell: Cell) -> float:
  """Forward FLOPs by the FlashAttention convention for the full shape."""
  flops = 4.0 * cell.batch * cell.num_heads * cell.seq_len * cell.seq_len * \
      cell.head_dim
  return flops / 2 if cell.causal else flops


def forward_flops(cell: Cell, pairs: int | None = None) -> float:
  """Forward FLOPs credited to the cell: the convention for dense cells,
  visible pairs only for windowed and segment cells."""
  if cell.kind == "dense":
    return dense_flops(cell)
  if pairs is None:
    raise ValueError(f"{cell.name}: pass the visible pair count")
  return 4.0 * cell.num_heads * cell.head_dim * pairs


def tflops(flops: float, ms: float) -> float:
  return flops / (ms * 1e-3) / 1e12
