"""Turn measured grid results into entries of the Hopper dispatch table.

    PYTHONPATH=. python -m benchmarks.dispatch_table [--gpu H100] \\
        [--source TEXT] [--source-name NAME] [--margin 0.01] RESULTS...

Each ``RESULTS`` file is either a ``grid.json`` written by
:mod:`benchmarks.grid` (the ``jflash`` column counts as ``mosaic_gpu`` when
the run forced that backend, as ``--jflash-impl mosaic_gpu`` does by default;
``jax_nn_cudnn`` as ``cudnn``) or a JSON-lines file of rows with ``impl``
(``jflash:mosaic_gpu`` or ``cudnn``), ``S``, ``H`` (heads), ``D`` (head
dim), ``causal``, ``fwd_tflops`` and ``fwdbwd_tflops``, such as the anchor
runs.  For every cell measured for both backends, the entry names the
faster backend for the forward pass alone (inference) and for forward plus
backward (training).  The GPU model comes from ``grid.json``'s device kind
or ``--gpu``.  The output is Python source for
``jflash/core/gpu_table.py``'s ``TABLE``, printed to stdout.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from jflash.core import gpu_table

_MOSAIC = "mosaic_gpu"
_CUDNN = "cudnn"
_JSONL_IMPLS = {"jflash:mosaic_gpu": _MOSAIC, "cudnn": _CUDNN}
_GRID_IMPLS = {"jax_nn_cudnn": _CUDNN, "jflash:mosaic_gpu": _MOSAIC,
               "jflash:cudnn": _CUDNN}

Cell = tuple[int, int, str, bool, str]  # head dim, S, mask kind, GQA, dtype

MARGIN = 0.01
"""``mosaic_gpu`` replaces ``cudnn`` only when faster by more than this
fraction: closer than that, repeated runs of one cell disagree."""


def _mask_kind(causal: bool, window, segments: int) -> str:
  if segments:
    return "other"
  if window is not None:
    return "window"
  return "causal" if causal else "none"


def _grid_rows(data: dict) -> tuple[str | None, list[tuple[Cell, str, str,
                                                            float]]]:
  """``(device kind, [(cell, backend, pass, TFLOP/s)])`` of a grid.json."""
  meta = data.get("meta", {})
  impls = dict(_GRID_IMPLS)
  if "mosaic_gpu" in str(meta.get("impl_notes", {}).get("jflash", "")):
    impls["jflash"] = _MOSAIC
  dtype = meta.get("dtype", "bfloat16")
  out = []
  for row in data["rows"]:
    cell = (row["H"], row["S"],
            _mask_kind(row["causal"], row.get("window"),
                       row.get("segments", 0)),
            row["N"] != row["K"], dtype)
    for name, result in row["impls"].items():
      if name in impls and result.get("tflops"):
        out.append((cell, impls[name], row["pass"], result["tflops"]))
  return meta.get("device", {}).get("kind"), out


def _jsonl_rows(lines: list[str]) -> list[tuple[Cell, str, str, float]]:
  out = []
  for line in lines:
    if not line.strip():
      continue
    row = json.loads(line)
    backend = _JSONL_IMPLS.get(row.get("impl"))
    if backend is None:
      continue
    cell = (row["D"], row["S"], _mask_kind(row["causal"], row.get("window"),
                                           row.get("segments", 0)),
            row.get("K", row["H"]) != row["H"], row.get("dtype", "bfloat16"))
    for name in ("fwd", "fwdbwd"):
      if row.get(f"{name}_tflops"):
        out.append((cell, backend, name, row[f"{name}_tflops"]))
  return out


def read(path: Path) -> tuple[str | None, list[tuple[Cell, str, str, float]]]:
  """The device kind (None when the file does not say) and the measured
  rows of one results file."""
  text = path.read_text()
  if path.suffix == ".json":
    return _grid_rows(json.loads(text))
  return None, _jsonl_rows(text.splitlines())


def build(rows, gpu: str, source: str,
          margin: float = MARGIN) -> list[gpu_table.Entry]:
  """One entry per cell that both backends served in both passes: per
  pass, ``mosaic_gpu`` when it is faster than ``cudnn`` by more than
  ``margin`` (a fraction), else ``cudnn`` (the default order's first)."""
  best: dict[Cell, dict[str, dict[str, float]]] = collections.defaultdict(
      lambda: collections.defaultdict(dict))
  for cell, backend, pass_name, value in rows:
    best[cell][pass_name][backend] = max(
        value, best[cell][pass_name].get(backend, 0.0))
  entries = []
  for cell in sorted(best):
    passes = best[cell]
    if not all(len(passes.get(p, {})) == 2 for p in ("fwd", "fwdbwd")):
      continue
    head_dim, seq_len, mask, gqa, dtype = cell
    fastest = {p: _MOSAIC if passes[p][_MOSAIC] > (1 + margin)
               * passes[p][_CUDNN] else _CUDNN for p in ("fwd", "fwdbwd")}
    entries.append(gpu_table.Entry(
        gpu=gpu, head_dim=head_dim, seq_len=seq_len, mask=mask, gqa=gqa,
        dtype=dtype, inference=fastest["fwd"], training=fastest["fwdbwd"],
        source=source))
  return entries


def merge(*tables: list[gpu_table.Entry]) -> list[gpu_table.Entry]:
  """The entries of several runs on one GPU model, a later run's entry
  replacing an earlier one's for the same cell (each cell decided within
  one run, never by comparing numbers across runs)."""
  cells = {}
  for table in tables:
    for e in table:
      cells[(e.head_dim, e.seq_len, e.mask, e.gqa, e.dtype)] = e
  return [cells[cell] for cell in sorted(cells)]


def to_source(entries: list[gpu_table.Entry],
              source_name: str | None = None) -> str:
  """Python source of the entries, one per line; ``source_name``: an
  identifier to cite in place of each entry's source text."""
  lines = []
  for e in entries:
    source = source_name or repr(e.source)
    lines.append(
        f"    Entry({e.gpu!r}, {e.head_dim}, {e.seq_len}, {e.mask!r}, "
        f"{e.gqa}, {e.dtype!r},\n"
        f"          {e.inference!r}, {e.training!r}, {source}),")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("results", nargs="+", type=Path,
                 help="grid.json or JSON-lines files of one GPU model; a "
                 "later file's cell replaces an earlier one's")
  p.add_argument("--gpu", default=None,
                 help="GPU model (e.g. H100) for files that do not name it")
  p.add_argument("--source", default=None,
                 help="what each entry cites (default: the file names)")
  p.add_argument("--source-name", default=None,
                 help="an identifier to print in place of the source text")
  p.add_argument("--margin", type=float, default=MARGIN,
                 help="fraction by which mosaic_gpu must beat cudnn")
  args = p.parse_args(argv)
  runs, kinds = [], set()
  for path in args.results:
    kind, found = read(path)
    if kind:
      kinds.add(gpu_table.gpu_model(kind))
    runs.append(found)
  models = kinds | ({args.gpu} if args.gpu else set())
  if len(models) != 1 or None in models:
    p.error(f"the results must come from one GPU model, named by the files "
            f"or --gpu; got {sorted(map(str, models))}")
  gpu = models.pop()
  sources = ([args.source] * len(runs) if args.source
             else [str(path) for path in args.results])
  print(to_source(merge(*(build(rows, gpu, source, args.margin)
                          for rows, source in zip(runs, sources))),
                  args.source_name))
  return 0


if __name__ == "__main__":
  sys.exit(main())
