"""benchmarks/decode.py: the bytes a cell reads and one measured cell."""

import numpy as np

from benchmarks import decode
from benchmarks.timing import TimerConfig


def test_bytes_read_count_the_visible_slots_of_keys_and_values():
  cell = decode.Cell(batch=3, context=100, num_new=4, heads=8, kv_heads=2,
                     head_dim=16, dtype="bfloat16")
  assert cell.bytes_read == 2 * 3 * 100 * 2 * 16 * 2
  windowed = decode.Cell(batch=3, context=100, num_new=4, kv_heads=2,
                         head_dim=16, window=10, dtype="float32")
  assert windowed.bytes_read == 2 * 3 * 14 * 2 * 16 * 4


def test_one_cell_reports_positive_rates(tmp_path):
  cell = decode.Cell(batch=2, context=40, num_new=2, heads=4, kv_heads=2,
                     head_dim=16, page_size=8, dtype="float32")
  row = decode.measure(cell, None, TimerConfig(calls=2, repeats=2, warmup=1),
                       np.random.default_rng(0))
  for name in ("ms", "decode_gb_s", "copy_gb_s", "share_of_copy"):
    assert row[name] > 0, name
  assert row["bytes_read"] == cell.bytes_read
