"""benchmarks/decode.py on the CPU: the cells, the bytes a cell reads, the
small grid's rows and their bandwidth arithmetic, the peers' wiring (Pallas
in interpret mode) and the check that keeps a wrong result from being
timed."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest

from benchmarks import decode, decode_impls
from benchmarks.timing import TimerConfig

# A budget no call reaches, so the calls per group stay as configured.
FAST = TimerConfig(calls=2, repeats=2, warmup=1, max_seconds=1e6)
ROW_FIELDS = ("cell", "batch", "context", "num_new", "heads", "kv_heads",
              "head_dim", "page_size", "dtype", "layout", "impl", "status",
              "device", "bytes_read", "copy_gb_s", "input_sets", "us", "gb_s",
              "share_of_copy", "max_abs_err", "max_abs_ref")


def _rows(out) -> list[dict]:
  with open(out / "decode.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_bytes_read_count_the_visible_slots_of_keys_and_values():
  cell = decode.Cell(batch=3, context=100, num_new=4, heads=8, kv_heads=2,
                     head_dim=16, dtype="bfloat16")
  assert cell.bytes_read == 2 * 3 * 100 * 2 * 16 * 2
  windowed = decode.Cell(batch=3, context=100, num_new=4, kv_heads=2,
                         head_dim=16, window=10, dtype="float32")
  assert windowed.bytes_read == 2 * 3 * 14 * 2 * 16 * 4
  paged = decode.Cell(batch=2, context=100, num_new=1, kv_heads=2,
                      head_dim=16, page_size=64, dtype="float32")
  assert paged.cache_bytes == 2 * 2 * 128 * 2 * 16 * 4  # whole pages


def test_full_grid_is_the_issues_grid_with_one_token_first():
  cells = decode.grid(small=False)
  assert len(cells) == 3 * 3 * 2 * 2 + 2 * 3 * 2 * 2
  assert {(c.batch, c.context, c.num_new, c.page_size, c.ragged)
          for c in cells} == {
      (b, s, t, p, r) for b in (1, 8, 64) for s in (4096, 32768, 131072)
      for t in (1, 8) for p in (None, 64) for r in (False, True)
      if not (r and b == 1)}
  assert all((c.heads, c.kv_heads, c.head_dim, c.dtype)
             == (32, 8, 128, "bfloat16") for c in cells)
  first_t8 = [c.num_new for c in cells].index(8)
  assert all(c.num_new == 8 for c in cells[first_t8:])
  biggest = max(cells, key=lambda c: c.cache_bytes)
  assert biggest.cache_bytes == 2 * 64 * 131072 * 8 * 128 * 2  # 34 GB
  assert decode.input_set_count(biggest) == 1


def test_cell_filter():
  cells = decode.filter_cells(decode.grid(small=False),
                              "B=1,B=8,S=4096,layout=paged,lengths=full")
  assert sorted((c.batch, c.num_new) for c in cells) == [
      (1, 1), (1, 8), (8, 1), (8, 8)]
  assert all(c.context == 4096 and c.page_size == 64 for c in cells)
  with pytest.raises(ValueError, match="--cells"):
    decode.filter_cells(decode.grid(small=False), "Q=3")
  ragged = decode.filter_cells(decode.grid(small=False), "lengths=ragged")
  assert ragged and all(c.ragged and c.batch > 1 for c in ragged)


def test_ragged_lengths_and_the_bytes_of_valid_slots():
  """A ragged cell's lengths are drawn once per cell, uniformly from [S/8,
  S], and its bytes count the valid slots only."""
  cell = decode.Cell(batch=64, context=4096, num_new=1, kv_heads=8,
                     head_dim=128, ragged=True)
  lengths = cell.lengths()
  assert lengths.dtype == "int32" and lengths.shape == (64,)
  assert (lengths == cell.lengths()).all()
  assert lengths.min() >= 512 and lengths.max() <= 4096
  assert len(set(lengths.tolist())) > 32  # drawn, not constant
  assert cell.bytes_read == 2 * int(lengths.sum()) * 8 * 128 * 2
  full = dataclasses.replace(cell, ragged=False)
  assert (full.lengths() == 4096).all() and full.bytes_read > cell.bytes_read


def test_small_grid_rows_and_bandwidth_arithmetic(tmp_path):
  assert decode.main(["--small", "--impls", "jflash:xla",
                      "--out", str(tmp_path)]) == 0
  rows = _rows(tmp_path)
  assert len(rows) == len(decode.grid(small=True))
  meta = json.loads((tmp_path / "meta.json").read_text())
  assert meta["device"] == jax.devices()[0].device_kind
  assert math.isclose(meta["copy_gb_s"], 2 * meta["copy_bytes"]
                      / (meta["copy_ms"] * 1e-3) / 1e9, rel_tol=1e-9)
  for row in rows:
    assert row["status"] == "ok", row
    for name in ROW_FIELDS:
      assert name in row, name
    cell = decode.Cell(**{k: row[k] for k in (
        "batch", "context", "num_new", "heads", "kv_heads", "head_dim",
        "page_size", "window", "dtype")})
    assert row["bytes_read"] == cell.bytes_read
    assert row["us"] > 0 and row["copy_gb_s"] == meta["copy_gb_s"]
    assert math.isclose(row["gb_s"], row["bytes_read"] / (row["us"] * 1e-6)
                        / 1e9, rel_tol=1e-9)
    assert math.isclose(row["share_of_copy"], row["gb_s"] / row["copy_gb_s"],
                        rel_tol=1e-9)
    assert row["max_abs_err"] == 0  # the column is the reference itself
  table = (tmp_path / "table.md").read_text()
  assert sum(line.count("| jflash:xla |") for line in
             table.splitlines()) == len(rows)


def test_peers_agree_with_jflash_in_interpret_mode(tmp_path):
  """jax.nn and both Pallas ops (interpret mode) compute the cells'
  attention, T > 1 included (causal within the new block); the CPU-only
  columns are recorded as skipped with a reason."""
  names = ["jflash", "jax_nn_xla", "jax_nn_cudnn", "pallas_decode",
           "pallas_paged"]
  assert decode.main(["--small", "--cells", "B=2,T=4", "--pallas-interpret",
                      "--impls", ",".join(names), "--out",
                      str(tmp_path)]) == 0
  rows = _rows(tmp_path)
  by = {(r["layout"], r["impl"]): r for r in rows}
  expected_ok = {("contig", "jflash"), ("contig", "jax_nn_xla"),
                 ("contig", "pallas_decode"), ("paged16", "jflash"),
                 ("paged16", "pallas_paged")}
  for key, row in by.items():
    if key in expected_ok:
      assert row["status"] == "ok", row
      assert row["max_abs_err"] <= 1e-5 * row["max_abs_ref"] + 1e-6, row
      jflash_us = by[(key[0], "jflash")]["us"]
      assert math.isclose(row["vs_jflash"], row["us"] / jflash_us,
                          rel_tol=1e-9)
    else:
      assert row["status"] == "skipped" and row["reason"], row


def test_a_disagreeing_result_is_reported_and_not_timed():
  cell = decode.Cell(batch=1, context=32, num_new=2, heads=4, kv_heads=2,
                     head_dim=16, dtype="float32")
  sets = decode.make_inputs(cell, jax.random.key(3), 2)
  reference = decode_impls.reference_fn(cell)(*sets[0])
  good = decode_impls.make_impl("jflash:xla", cell, platform="cpu")
  bad = decode_impls.DecodeImpl(
      "bad", jax.jit(lambda *args: 1.01 * good.fn(*args)))
  config = decode.RunConfig(FAST, "cpu", "cpu", copy_gb_s=1.0)
  results = decode._check_and_time([good, bad], sets, reference, cell,
                                   config)
  assert results["jflash:xla"]["status"] == "ok"
  assert results["jflash:xla"]["us"] > 0
  assert results["bad"]["status"] == "wrong" and "us" not in results["bad"]
  assert results["bad"]["max_abs_err"] == pytest.approx(
      0.01 * float(jnp.max(jnp.abs(reference))), rel=1e-3)


def test_time_budget_records_cells_as_not_run(tmp_path):
  assert decode.main(["--small", "--impls", "jflash", "--time-budget", "0",
                      "--out", str(tmp_path)]) == 0
  rows = _rows(tmp_path)
  assert len(rows) == len(decode.grid(small=True))
  assert all(r["status"] == "not_run" and "time-budget" in r["reason"]
             for r in rows)
