"""tools/sass_turn_gap.py: the turn waits of a kernel's SASS and what
follows each up to the next HGMMA, on listings built here in the format of
``nvdisasm -c`` with random instruction mixes."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

_PATH = pathlib.Path(__file__).parents[2] / "tools" / "sass_turn_gap.py"
_SPEC = importlib.util.spec_from_file_location("sass_turn_gap", _PATH)
sass_turn_gap = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("sass_turn_gap", sass_turn_gap)  # for its dataclass
_SPEC.loader.exec_module(sass_turn_gap)

_FILLER = ("FMUL R4, R4, R9 ;", "MUFU.EX2 R5, R5 ;", "FFMA.FTZ R6, R1, R2, R6 ;",
           "F2FP.BF16.F32.PACK_AB R7, R8, R9 ;", "@!P0 BRA `(.L_x_3) ;")


def _listing(rng, gaps):
  """SASS text: for each entry of ``gaps`` (a list of filler indices), a
  warpgroup sync, a turn wait, the fillers and an HGMMA; returns the text
  and the expected opcode counts per turn wait."""
  lines, address, expected = [], 0, []

  def emit(text):
    nonlocal address
    lines.append(f"        /*{address:04x}*/                   {text}")
    address += 16
  for picks in gaps:
    emit("BAR.SYNC.DEFER_BLOCKING R11, 0x80 ;")  # not a turn: 128 threads
    emit("MUFU.EX2 R3, R3 ;")  # before the turn: not counted
    emit(f"{'@!P2 ' if rng.random() < 0.5 else ''}"
         "BAR.SYNC.DEFER_BLOCKING R170, 0x100 ;")
    counts = {}
    for pick in picks:
      emit(_FILLER[pick])
      name = ("MUFU.EX2" if pick == 1 else _FILLER[pick].split()[
          1 if pick == 4 else 0].split(".")[0])
      counts[name] = counts.get(name, 0) + 1
    emit("HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR8].tnspB, R24 ;")
    expected.append(counts)
  return "\n".join(lines) + "\n", expected


@pytest.mark.parametrize("seed", range(5))
def test_turn_gaps_count_what_follows_each_turn_wait(seed):
  rng = np.random.default_rng(seed)
  gaps = [list(rng.integers(0, len(_FILLER), rng.integers(0, 40)))
          for _ in range(rng.integers(1, 4))]
  text, expected = _listing(rng, gaps)
  found = sass_turn_gap.turn_gaps(text)
  assert [g.opcodes for g in found] == expected
  assert [g.instructions for g in found] == [len(p) for p in gaps]
  assert [g.exp2 for g in found] == [p.count(1) for p in gaps]
  assert all(g.next_hgmma == "HGMMA.64x256x16.F32.BF16" for g in found)


def test_a_turn_wait_with_no_hgmma_after_it_says_so(tmp_path):
  text = ("        /*0000*/  BAR.SYNC.DEFER_BLOCKING 0x5, 0x100 ;\n"
          "        /*0010*/  MUFU.EX2 R1, R1 ;\n"
          "        /*0020*/  EXIT ;\n")
  (gap,) = sass_turn_gap.turn_gaps(text)
  assert gap.next_hgmma is None and gap.instructions == 2 and gap.exp2 == 1
  path = tmp_path / "k.sass"
  path.write_text(text)
  assert sass_turn_gap.main([str(path), "--max-exp2", "1"]) == 0
  assert sass_turn_gap.main([str(path), "--max-exp2", "0"]) == 1
