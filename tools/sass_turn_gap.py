"""What a forward consumer computes between taking its turn and issuing
``P V``, read from the kernel's SASS.

The forward's two consumer warpgroups alternate on the tensor cores: each
waits for its turn (a ``bar.sync`` of 256 threads on a named barrier,
``common.wait_turn``) and then issues ``P V``.  Whatever the compiler
schedules between that ``bar.sync`` and the ``HGMMA`` of ``P V`` runs while
the tensor cores have only the other consumer's queued products to work
on.  The rescale of ``O`` (``FMUL``) and the packing of ``P`` belong there
and hide behind them; the softmax's exponentials (``MUFU.EX2``) do not
(at head dim 256 they once sank there and cost 10% of the forward).

Usage, on SASS from ``nvdisasm -c`` (``tools/ptxas_report.py --turn-gap``
produces it for the forward kernels)::

  python3 tools/sass_turn_gap.py kernel.sass [--max-exp2 4]

prints one line per turn wait; with ``--max-exp2`` exits with status 1 when
a wait is followed by more exponentials than that before its ``HGMMA``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys

# An instruction line of `nvdisasm -c`: "/*3630*/  [@P0] OPCODE operands ;".
_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)"
                          r"([^;]*);")
# The turn: bar.sync of 256 (0x100) threads; warpgroup syncs use 0x80.
_TURN_THREADS = "0x100"


@dataclasses.dataclass(frozen=True)
class TurnGap:
  """The instructions between one turn wait and the next ``HGMMA``.

  Attributes:
    address: the ``bar.sync``'s address in the kernel (hex, as printed).
    instructions: how many instructions follow it before the ``HGMMA``.
    opcodes: their count per opcode (without modifiers, e.g. ``MUFU.EX2``
      stays whole, ``FMUL.FTZ`` counts as ``FMUL``).
    next_hgmma: the ``HGMMA`` that ends the gap (its shape), or None when
      the kernel ends first.
  """

  address: str
  instructions: int
  opcodes: dict[str, int]
  next_hgmma: str | None

  @property
  def exp2(self) -> int:
    """Exponentials on the special-function unit in the gap."""
    return self.opcodes.get("MUFU.EX2", 0)


def _opcode_name(opcode: str) -> str:
  if opcode.startswith("MUFU."):
    return ".".join(opcode.split(".")[:2])
  return opcode.split(".")[0]


def turn_gaps(sass: str) -> list[TurnGap]:
  """Every turn wait of ``sass`` (``nvdisasm -c`` text of one kernel) with
  what follows it up to the next ``HGMMA``."""
  instructions = [(m.group(1), m.group(3), m.group(4))
                  for m in _INSTRUCTION.finditer(sass)]
  gaps = []
  for index, (address, opcode, operands) in enumerate(instructions):
    if not (opcode.startswith("BAR.SYNC")
            and operands.strip().endswith(_TURN_THREADS)):
      continue
    counts: collections.Counter[str] = collections.Counter()
    end = None
    for _, later, _ in instructions[index + 1:]:
      if later.startswith("HGMMA"):
        end = later
        break
      counts[_opcode_name(later)] += 1
    gaps.append(TurnGap(address, sum(counts.values()), dict(counts), end))
  return gaps


def describe(gap: TurnGap) -> str:
  """One line: address, size, the exponentials and the leading opcodes."""
  common = ", ".join(f"{name} {n}" for name, n in
                     sorted(gap.opcodes.items(), key=lambda kv: -kv[1])[:5])
  end = gap.next_hgmma or "no HGMMA after it"
  return (f"turn wait at {gap.address}: {gap.instructions} instructions "
          f"before {end}; MUFU.EX2 {gap.exp2} ({common})")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("sass", nargs="+", help="nvdisasm -c output files")
  parser.add_argument("--max-exp2", type=int, default=None,
                      help="fail when a turn wait is followed by more "
                      "MUFU.EX2 than this before its HGMMA")
  args = parser.parse_args(argv)
  worst = 0
  for path in args.sass:
    with open(path) as f:
      gaps = turn_gaps(f.read())
    print(f"== {path}: {len(gaps)} turn waits")
    for gap in gaps:
      print("  " + describe(gap))
      worst = max(worst, gap.exp2)
  if args.max_exp2 is not None and worst > args.max_exp2:
    print(f"at most {args.max_exp2} MUFU.EX2 allowed after a turn wait, "
          f"found {worst}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
