"""The benchmark grid's core on tiny cells (CPU): FLOP counting, the checked
and timed rows, and the written results."""

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import check, grid, impls, report
from benchmarks.cells import (FULL, TINY, Cell, count_visible_bruteforce,
                              dense_flops, filter_cells, forward_flops,
                              make_segment_ids, visible_pairs)
from benchmarks import timing
from benchmarks.timing import TimerConfig
from jflash.masks import AttentionMask
from tests._support import fresh_rng, next_seed

# The repository root (this file is tests/tools/test_benchmarks.py).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# A budget no call reaches, so that the calls per group stay as configured
# however loaded the machine is (a slow call would otherwise get fewer).
FAST = TimerConfig(calls=2, repeats=2, warmup=1, max_seconds=1e6)


def _materialized_count(cell, seg):
  seg = None if seg is None else jnp.asarray(seg)
  mask = AttentionMask(batch=cell.batch, q_len=cell.seq_len,
                       kv_len=cell.seq_len, is_causal=cell.causal,
                       window=cell.local_window_size, q_segment_ids=seg,
                       kv_segment_ids=seg)
  return int(mask.visibility().sum())


@pytest.mark.parametrize("cell,segments", [
    (Cell(2, 50, 2, 8, causal=False), False),
    (Cell(2, 50, 2, 8, causal=True), False),
    (Cell(1, 70, 2, 8, causal=True, window=16), False),
    (Cell(1, 10, 2, 8, causal=True, window=16), False),
    (Cell(3, 70, 2, 8, causal=False, segments=5), True),
    (Cell(2, 70, 2, 8, causal=True, segments=4), True),
    (Cell(2, 70, 2, 8, causal=True, window=7, segments=3), True),
])
def test_visible_pairs_match_the_mask(cell, segments):
  seg = (make_segment_ids(fresh_rng(), cell.batch, cell.seq_len,
                          cell.segments) if segments else None)
  expected = _materialized_count(cell, seg)
  assert visible_pairs(cell, seg) == expected
  assert count_visible_bruteforce(cell, seg, chunk=16) == expected


def test_segment_ids_are_packed_and_sum_to_length():
  seg = make_segment_ids(fresh_rng(), 3, 100, 8)
  for row in seg:
    lengths = np.bincount(row)
    assert len(lengths) == 8 and lengths.min() >= 1 and lengths.sum() == 100
    assert np.all(np.diff(row) >= 0)


def test_flop_convention():
  dense = Cell(16, 1024, 16, 128, causal=False)
  assert dense_flops(dense) == 4 * 16 * 16 * 1024 * 1024 * 128
  causal = Cell(16, 1024, 16, 128, causal=True)
  assert forward_flops(causal) == dense_flops(dense) / 2
  window = Cell(1, 16384, 16, 128, causal=True, window=1024)
  pairs = visible_pairs(window)
  assert pairs == 1025 * 1026 // 2 + (16384 - 1025) * 1025
  assert forward_flops(window, pairs) == 4 * 16 * 128 * pairs
  assert dense_flops(window) == 4 * 16 * 16384 ** 2 * 128 / 2


def test_grid_definitions_and_filter():
  cells = FULL.cells()
  assert len(cells) == 20
  for c in cells:
    assert c.batch * c.seq_len == 16384 and c.num_heads * c.head_dim == 2048
  assert {c.kind for c in cells} == {"dense", "window", "segments"}
  picked = filter_cells(cells, "H=128,S=16384")
  assert {c.name for c in picked} == {
      "S16384-H128-full", "S16384-H128-causal", "S16384-H128-causal-w1024",
      "S16384-H128-full-seg8"}
  assert len(filter_cells(cells, "S=1024,S=4096,causal=1")) == 6
  assert [c.kind for c in filter_cells(cells, "kind=window")] == ["window"]
  with pytest.raises(ValueError):
    filter_cells(cells, "Q=1")
  assert len(TINY.quick_cells()) == 5


def test_runner_rows_checked_and_timed(tmp_path):
  chosen = impls.make_impls(["jflash:xla", "jax_nn_xla", "jax_nn_cudnn"])
  runner = grid.CellRunner(chosen, FAST, dtype=jnp.float32, input_sets=2,
                           seed=3)
  cells = [Cell(2, 64, 2, 16, causal=True, window=16),
           Cell(1, 64, 2, 16, causal=False, segments=3)]
  rows = [r for i, c in enumerate(cells) for r in runner.run(c, i)]
  assert [(r["name"], r["pass"]) for r in rows] == [
      ("S64-H16-causal-w16", "fwd"), ("S64-H16-causal-w16", "fwdbwd"),
      ("S64-H16-full-seg3", "fwd"), ("S64-H16-full-seg3", "fwdbwd")]
  for row in rows:
    cell = cells[0] if row["kind"] == "window" else cells[1]
    factor = 1.0 if row["pass"] == "fwd" else 3.5
    assert row["flops"] == pytest.approx(
        factor * 4 * cell.num_heads * cell.head_dim * row["visible_pairs"])
    for name in ("jflash:xla", "jax_nn_xla"):
      e = row["impls"][name]
      assert e["tflops"] == pytest.approx(
          row["flops"] / (e["ms"] * 1e-3) / 1e12)
      assert e["tflops_dense_equiv"] > e["tflops"]
      want = ["out"] if row["pass"] == "fwd" else list(check.QUANTITIES)
      assert list(e["errors"]) == want
      assert max(e["errors"].values()) < 1e-5
      assert e["calls"] == 2 and len(e["ms_groups"]) == 2
    cudnn = row["impls"]["jax_nn_cudnn"]
    assert ("unsupported" if row["kind"] == "segments" else "error") in cudnn
  assert rows[2]["segment_lengths"][0] and sum(
      rows[2]["segment_lengths"][0]) == 64

  doc = dict(meta=dict(report.run_metadata("abc123"), dtype="float32",
                       timer=FAST.describe(), input_sets=2,
                       impls=[i.name for i in chosen]), rows=rows)
  assert doc["meta"]["commit"] == "abc123"
  report.write_outputs(doc, tmp_path, png=False)
  loaded = json.loads((tmp_path / "grid.json").read_text())
  assert loaded["rows"][1]["impls"]["jflash:xla"]["errors"]["dv"] < 1e-5
  md = (tmp_path / "grid.md").read_text()
  assert "| `S64-H16-full-seg3` B=1 N=2 |" in md and "n/a" in md


def test_timing_groups_are_interleaved_and_failures_contained():
  """time_functions warms every function up, then runs group r of each
  before group r + 1 of any; a function that raises is reported and not
  called again, and the others are still timed."""
  calls = []

  def make(name, fail_at=None):
    def fn(x):
      calls.append(name)
      if fail_at is not None and len(calls) > fail_at:
        raise RuntimeError(f"{name} failed")
      return jnp.asarray(x) + 1
    return fn

  cfg = TimerConfig(calls=2, repeats=3, warmup=1, max_seconds=60.0)
  a, b = make("a"), make("b")
  results = timing.time_functions([a, b], [(1.0,), (2.0,)], cfg)
  assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3
  for r in results:
    assert r["calls"] == 2 and len(r["ms_groups"]) == 3
    assert r["ms"] == sorted(r["ms_groups"])[1]
  calls.clear()
  # "c" fails on the first call of its second timed group (the seventh
  # call overall), after which only "d" runs.
  c, d = make("c", fail_at=5), make("d")
  results = timing.time_functions([c, d], [(1.0,)], cfg)
  assert isinstance(results[0]["error"], RuntimeError)
  assert len(results[1]["ms_groups"]) == 3
  assert calls.count("c") == 4 and calls.count("d") == 7
  with pytest.raises(RuntimeError, match="failed"):
    calls.clear()
    timing.time_function(make("e", fail_at=0), [(1.0,)], cfg)


def test_ratio_to_cudnn():
  row = {"impls": {
      "jax_nn_cudnn": {"errors": {"out": 2e-3, "dq": 4e-3}},
      "jflash": {"errors": {"out": 2e-3, "dq": 8e-3}},
      "other": {"error": "boom"}}}
  grid._add_ratios(row)
  j = row["impls"]["jflash"]
  assert j["ratio_to_cudnn"] == {"out": 1.0, "dq": 2.0}
  assert j["max_ratio_to_cudnn"] == 2.0 and j["accuracy_ok"] is False
  assert row["impls"]["jax_nn_cudnn"]["accuracy_ok"] is True


def test_tuner_candidates_include_the_defaults_and_fit():
  from benchmarks import tune_mosaic_gpu
  from jflash.backends.mosaic_gpu import tuned_config
  for head_dim in (64, 128, 256):
    candidates = tune_mosaic_gpu.forward_candidates(head_dim)
    default = tuned_config(head_dim)
    assert any((c.block_q, c.block_kv, c.stages) ==
               (default.block_q, default.block_kv, default.stages)
               for c in candidates), head_dim
    for c in candidates:
      smem = 2 * (2 * c.block_q * head_dim + 2 * c.stages * c.block_kv *
                  head_dim)
      assert smem <= 227 * 1024
    # Every switch and backward group entry is a valid config for the head
    # dim (the fused backward is offered only where it serves).
    for fields in tune_mosaic_gpu.forward_switches() + [
        f for group in tune_mosaic_gpu.backward_groups(head_dim)
        for f in group]:
      dataclasses.replace(default, **fields).resolved(head_dim)


def _fake_measure(speed, seen=None):
  """A tuner measure from ``speed(config, mask)``: the ratio is the
  candidate's speed over the incumbent's, as interleaved timing gives."""
  def measure(candidate, incumbent, pass_name):
    if seen is not None:
      seen.append((candidate, incumbent, pass_name))
    ratio = {m: speed(candidate, m) / speed(incumbent, m)
             for m in ("dense", "causal")}
    return dict(ratio=ratio, tflops=dict(ratio),
                incumbent_tflops={m: 1.0 for m in ratio})
  return measure


def test_tuner_acceptance_rule():
  from benchmarks.tune_mosaic_gpu import accepted, speedup
  assert speedup({"dense": 1.21, "causal": 1.0}) == pytest.approx(1.1)
  assert accepted({"dense": 1.05, "causal": 1.03}, 0.02)
  assert not accepted({"dense": 1.01, "causal": 1.015}, 0.02)  # noise
  # Faster on one mask, clearly slower on the other: the table serves both.
  assert not accepted({"dense": 1.3, "causal": 0.95}, 0.02)


def test_tuner_keeps_the_default_when_no_candidate_clears_the_margin():
  from benchmarks import tune_mosaic_gpu
  from jflash.backends.mosaic_gpu import tuned_config
  rng = fresh_rng()
  noise = {}

  def speed(config, mask):  # every configuration within 1.5% of another
    return noise.setdefault((config, mask), 1 + 0.015 * rng.random())
  best, rows = tune_mosaic_gpu.tune(_fake_measure(speed), 128, 16384,
                                    lambda row: None, min_gain=0.02)
  assert best == tuned_config(128, 16384)
  assert rows and not any(row.get("accepted") for row in rows)


def test_tuner_takes_clear_winners_and_builds_on_them():
  from benchmarks import tune_mosaic_gpu
  from jflash.backends.mosaic_gpu import tuned_config
  default = tuned_config(128, 16384)

  def speed(config, mask):
    s = 1.0
    if config.block_kv == 192 and config.stages == 2:
      # Much faster without a mask, slower with one: rejected.
      s *= 1.3 if mask == "dense" else 0.9
    if config.block_q_dq == 128 and config.block_kv_dq == 64:
      s *= 1.05  # a clear winner in the dQ group
    if config.block_q_dq == 64 and config.block_kv_dq == 64:
      s *= 1.08  # a clearer one
    if config.stages_dkv == 3:
      s *= 1.1   # wins in a later group, on top of the dQ winner
    return s
  seen = []
  best, rows = tune_mosaic_gpu.tune(_fake_measure(speed, seen), 128, 16384,
                                    lambda row: None, min_gain=0.02)
  assert (best.block_q, best.block_kv, best.stages) == (
      default.block_q, default.block_kv, default.stages)
  assert (best.block_q_dq, best.block_kv_dq) == (64, 64)
  assert best.stages_dkv == 3 and best.fuse_dq is False
  # The ring-depth group was timed against the dQ group's winner.
  ring = [(c, i) for c, i, _ in seen if c.stages_dkv == 3]
  assert ring and all(i.block_kv_dq == 64 for _, i in ring)
  # The incumbent itself is never timed against itself.
  assert all(c != i for c, i, _ in seen)


def test_tuner_length_differences():
  """The row is the longest length's best; each shorter length whose best
  differs from it gets exactly the differing fields."""
  from benchmarks.tune_mosaic_gpu import length_differences
  from jflash.backends.mosaic_gpu import tuned_config
  row = tuned_config(128)
  best = {16384: dataclasses.replace(row, stages=3),
          1024: dataclasses.replace(row, block_kv_dq=64, stages=3),
          4096: dataclasses.replace(row, stages=3)}
  table_row, differences = length_differences(best)
  assert table_row == best[16384]
  assert differences == {1024: dict(block_kv_dq=64)}
  assert length_differences({1024: row, 16384: row}) == (row, {})
  assert length_differences({4096: row}) == (row, {})


def test_tuner_combines_runs_into_a_table(tmp_path):
  """--combine prints the row and the shorter lengths' differences from
  --out files of separate runs (one length per device call), without
  running anything."""
  from jflash.backends.mosaic_gpu import tuned_config
  row = tuned_config(128)
  short = dataclasses.replace(row, stages_dq=1)
  for name, seq, best in (("long", 16384, row), ("short", 1024, short)):
    (tmp_path / f"{name}.json").write_text(json.dumps(dict(results=[dict(
        head_dim=128, seq=seq, best=dataclasses.asdict(best))])))
  done = subprocess.run(
      [sys.executable, "-m", "benchmarks.tune_mosaic_gpu", "--combine",
       str(tmp_path / "long.json"), str(tmp_path / "short.json")],
      capture_output=True, text=True, check=True,
      cwd=_ROOT)
  assert "128: MosaicGpuConfig(" in done.stdout
  assert "# the default, kept" in done.stdout
  assert "head dim 128, S=1024 differs from the row in: stages_dq=1" in (
      done.stdout)


def test_tuner_records_configurations_that_fail():
  from benchmarks import tune_mosaic_gpu
  from jflash.backends.mosaic_gpu import tuned_config

  def measure(candidate, incumbent, pass_name):
    if candidate.stages == 4:
      return dict(error="ValueError: exceeds available shared memory")
    return _fake_measure(lambda c, m: 1.0)(candidate, incumbent, pass_name)
  best, rows = tune_mosaic_gpu.tune(measure, 64, 4096, lambda row: None,
                                    min_gain=0.02)
  assert best == tuned_config(64, 4096)
  assert any("error" in row for row in rows)


def test_tuner_measures_candidate_against_incumbent(monkeypatch):
  """The device-side measure on the CPU, with the xla backend standing in
  for the kernels: a checked, interleaved timing per mask."""
  from benchmarks import tune_mosaic_gpu
  from jflash.backends.mosaic_gpu import tuned_config
  monkeypatch.setattr(tune_mosaic_gpu, "make_backend", lambda config: "xla")
  tuner = tune_mosaic_gpu.Tuner(64, 32, ("dense", "causal"), FAST,
                                tokens=64, width=128, seed=next_seed())
  incumbent = tuned_config(64, 32)
  candidate = dataclasses.replace(incumbent, block_kv_dq=64)
  for pass_name in ("fwd", "fwdbwd"):
    row = tuner.measure(candidate, incumbent, pass_name)
    assert "error" not in row, row
    assert set(row["ratio"]) == {"dense", "causal"}
    for mask in row["ratio"]:
      assert row["tflops"][mask] > 0 and row["incumbent_tflops"][mask] > 0
      assert row["ratio"][mask] == pytest.approx(
          row["tflops"][mask] / row["incumbent_tflops"][mask])


def test_xprof_placeholder_only_fills_missing_modules():
  """The placeholder that lets tokamax import without xprof registers the
  one name tokamax imports, raises when called, and leaves a real xprof
  alone (run in a fresh process: it edits sys.modules)."""
  code = (
      "import sys, types\n"
      "from benchmarks import impls\n"
      "real = types.ModuleType('xprof')\n"
      "sys.modules['xprof'] = real\n"
      "impls._placeholder_xprof()\n"
      "assert sys.modules['xprof'] is real\n"
      "from xprof.cli.tools import get_kernel_stats_tool\n"
      "try:\n"
      "  get_kernel_stats_tool()\n"
      "except NotImplementedError:\n"
      "  print('raised')\n")
  done = subprocess.run([sys.executable, "-c", code], cwd=_ROOT,
                        capture_output=True, text=True, check=False,
                        env=dict(os.environ, PYTHONPATH=_ROOT))
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "raised"


def test_fused_backward_column_uses_the_fused_config():
  (impl,) = impls.make_impls(["jflash:mosaic_gpu_fused"])
  assert "mosaic_gpu_fused" in impl.note
  backend = impls._jflash_backend_name("mosaic_gpu_fused")
  assert backend.config.fuse_dq is True
  assert impls._jflash_backend_name("default") is None
  assert impls._jflash_backend_name("xla") == "xla"


def test_configured_column_passes_its_fields_to_the_hopper_kernels():
  (impl,) = impls.make_impls(["jflash:mosaic_gpu+overlap_sdp=true+block_kv=64"])
  assert "mosaic_gpu+overlap_sdp=true+block_kv=64" in impl.note
  backend = impls._jflash_backend_name("mosaic_gpu+overlap_sdp=true+block_kv=64")
  assert backend.config.overlap_sdp is True
  assert backend.config.block_kv == 64
  assert backend.config.stages is None  # the rest left to the defaults
  assert backend.name == "mosaic_gpu+overlap_sdp=true+block_kv=64"


@pytest.mark.parametrize("text,named", [
    ("mosaic_gpu+no_such_field=1", "no_such_field"),
    ("mosaic_gpu+block_kv", "block_kv"),
    ("mosaic_gpu+block_kv=wide", "wide"),
    ("xla+block_kv=64", "mosaic_gpu only"),
])
def test_configured_column_rejects_bad_fields_by_name(text, named):
  with pytest.raises(ValueError, match=named):
    impls.make_impls([f"jflash:{text}"])


def test_grid_md_compares_sparse_cells_with_dense_causal():
  """Windowed and segment cells are shown as a share of the dense causal
  cell of the same shape and pass, per implementation; a cell without its
  dense causal twin in the run is left out."""
  def row(name, kind, causal, passname, tflops, S=64):
    return dict(name=name, kind=kind, causal=causal, B=1, T=S, S=S, N=2,
                K=2, H=16, window=None, segments=0, **{"pass": passname},
                impls={"a": {"tflops": tflops[0], "ms": 1.0},
                       "b": ({"tflops": tflops[1], "ms": 1.0}
                             if tflops[1] else {"unsupported": "no"})})
  rows = [row("S64-causal", "dense", True, "fwd", (400.0, 500.0)),
          row("S64-causal", "dense", True, "fwdbwd", (300.0, 200.0)),
          row("S64-w16", "window", True, "fwd", (300.0, 250.0)),
          row("S64-w16", "window", True, "fwdbwd", (270.0, None)),
          row("S128-seg3", "segments", False, "fwd", (100.0, 100.0), S=128)]
  doc = dict(meta=dict(report.run_metadata("abc123"), dtype="bfloat16",
                       timer=FAST.describe(), input_sets=1,
                       impls=["a", "b"]), rows=rows)
  md = report.markdown(doc)
  section = md[md.index("## Sparse cells against dense causal"):]
  assert "| `S64-w16` B=1 N=2 | fwd | 75% | 50% |" in section
  assert "| `S64-w16` B=1 N=2 | fwd+bwd | 90% |  |" in section
  assert "S128-seg3" not in section
  dense_only = dict(doc, rows=rows[:2])
  assert "## Sparse cells" not in report.markdown(dense_only)


def test_tuner_masks_feature_masks_are_tuned_alone():
  from benchmarks import tune_mosaic_gpu as tuner
  assert tuner.parse_masks("dense,causal") == ("dense", "causal")
  assert tuner.parse_masks("segments") == ("segments",)
  assert tuner.mask_features(("softcap",)) == dict(soft_cap=True,
                                                   causal=True)
  assert tuner.mask_features(("dense", "causal")) == {}
  with pytest.raises(ValueError, match="alone.*'segments,dense'"):
    tuner.parse_masks("segments,dense")
  with pytest.raises(ValueError, match="'bogus'"):
    tuner.parse_masks("bogus")
  with pytest.raises(ValueError, match="--masks"):
    tuner.parse_masks("")


def test_tuner_mask_cells_credit_the_grid_flops():
  """The tuner's masks map to the grid's cells: causal ones at half the
  dense flops, packed segments at their visible pairs (brute force)."""
  from benchmarks import tune_mosaic_gpu as tuner
  from benchmarks.cells import forward_flops, make_segment_ids
  rng = fresh_rng()
  ids = make_segment_ids(rng, 3, 200, tuner.SEGMENTS)
  seg = tuner.mask_cell("segments", 3, 200, 2, 64)
  assert seg.segments == tuner.SEGMENTS and not seg.causal
  same = ids[:, :, None] == ids[:, None, :]
  assert forward_flops(seg, count_visible_bruteforce(seg, ids)) == (
      4.0 * 2 * 64 * same.sum())
  dense = 4.0 * 3 * 2 * 200 ** 2 * 64
  assert forward_flops(tuner.mask_cell("dense", 3, 200, 2, 64)) == dense
  for mask in ("causal", "softcap"):
    assert forward_flops(tuner.mask_cell(mask, 3, 200, 2, 64)) == dense / 2


@pytest.mark.parametrize("mask", ["segments", "softcap"])
def test_tuner_feature_mask_calls_carry_the_feature(mask, monkeypatch):
  """The tuner's timed functions pass the feature to the call: with the
  xla backend substituted, their output and gradients match the float32
  reference under the same segment ids or soft cap."""
  import jax
  from benchmarks import tune_mosaic_gpu as tuner
  from jflash.backends.mosaic_gpu import MosaicGpuConfig
  from jflash.reference import reference_attention
  monkeypatch.setattr(tuner, "make_backend", lambda config: "xla")
  t = tuner.Tuner(64, 256, (mask,), TimerConfig(calls=1, repeats=1,
                                                 warmup=0),
                  tokens=512, width=128, seed=next_seed())
  q, k, v, cot, seg = t.inputs[0]
  assert len(np.unique(np.asarray(seg[0]))) == tuner.SEGMENTS
  got = t._function(MosaicGpuConfig(), mask, "fwdbwd")(*t.inputs[0])
  seg_ids = jnp.asarray(seg) if mask == "segments" else None
  attention_mask = AttentionMask(batch=q.shape[0], q_len=256, kv_len=256,
                                 is_causal=mask == "softcap",
                                 q_segment_ids=seg_ids,
                                 kv_segment_ids=seg_ids)

  def ref(*a):
    return reference_attention(
        *(x.astype(jnp.float32) for x in a), None, attention_mask,
        scale=64 ** -0.5,
        logits_soft_cap=tuner.SOFT_CAP if mask == "softcap" else None)[0]
  out, vjp = jax.vjp(ref, q, k, v)
  want = (out, *vjp(cot.astype(jnp.float32)))
  for g, w in zip(got, want):
    w = np.asarray(w, np.float32)
    err = np.linalg.norm(np.asarray(g, np.float32) - w) / np.linalg.norm(w)
    assert err < 2e-2, (mask, err)
  dense = 4.0 * q.shape[0] * q.shape[2] * 256 ** 2 * 64
  if mask == "softcap":
    assert t.flops[mask] == dense / 2
  else:
    pairs = [(np.asarray(s[4])[:, :, None] == np.asarray(s[4])[:, None, :]
              ).sum() for s in t.inputs]
    assert t.flops[mask] == pytest.approx(4.0 * q.shape[2] * 64
                                          * np.mean(pairs))


def test_tuner_feature_search_starts_from_the_feature_default():
  """With a feature mask the search starts where such a call starts by
  default (feature rules applied), resolves candidates with the feature,
  and reports the winner as the fields the rule would change."""
  from benchmarks import tune_mosaic_gpu as tuner
  from jflash.backends.mosaic_gpu.config import default_config
  features = tuner.FEATURES["segments"]
  start = default_config(128, 16384, **features)
  assert not start.qk_after_pv and not start.overlap_sdp

  def speed(config, mask):
    s = 1.0
    if config.block_kv == 64 and config.stages == start.stages:
      s *= 1.1
    if config.qk_after_pv:
      s *= 1.05
    return s
  seen = []
  best, rows = tuner.tune(_fake_measure(speed, seen), 128, 16384,
                          lambda row: None, min_gain=0.02,
                          features=features)
  assert seen[0][1] == start
  assert best.block_kv == 64 and best.qk_after_pv
  assert tuner.feature_fields(128, 16384, "segments", best) == dict(
      block_kv=64, qk_after_pv=True)
  # Without the feature the search starts from the table.
  _, _ = tuner.tune(_fake_measure(speed, seen := []), 128, 16384,
                    lambda row: None, min_gain=0.02)
  assert seen[0][1] == tuner.start_config(128, 16384)
  assert seen[0][1].qk_after_pv


@pytest.mark.parametrize("cell", [
    Cell(batch=2, seq_len=256, num_heads=2, head_dim=64, causal=True,
         window=64),
    Cell(batch=2, seq_len=256, num_heads=2, head_dim=64, causal=False,
         segments=4)], ids=lambda c: c.name)
def test_splash_peer_computes_the_cells_attention(cell):
  """The TPU peer (JAX's splash attention, in interpret mode here) is
  given the cell's mask, scale and segments: it agrees with jflash."""
  import jax  # noqa: PLC0415
  rng = fresh_rng()
  q, k, v = (jnp.asarray(rng.standard_normal(
      (cell.batch, cell.seq_len, cell.num_heads, cell.head_dim)),
      jnp.float32) for _ in range(3))
  ids = None
  if cell.segments:
    ids = jnp.asarray(np.repeat(np.arange(cell.segments),
                                cell.seq_len // cell.segments)[None].repeat(
                                    cell.batch, 0), jnp.int32)
  splash, = impls.make_impls(["splash_interpret"])
  ours, = impls.make_impls(["jflash:xla"])
  got = jax.jit(splash.build(cell))(q, k, v, ids)
  want = jax.jit(ours.build(cell))(q, k, v, ids)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5,
                             rtol=2e-5)
  with pytest.raises(impls.Unsupported, match="TPU"):
    impls.make_impls(["splash"])[0].build(cell)
