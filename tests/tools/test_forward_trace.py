"""tools/forward_trace.py: per-role region cycles from a Mosaic GPU
profile, on random traces built here in the profiler's Chrome format."""

import importlib.util
import pathlib

import numpy as np
import pytest

_PATH = pathlib.Path(__file__).parents[2] / "tools" / "forward_trace.py"
_SPEC = importlib.util.spec_from_file_location("forward_trace", _PATH)
forward_trace = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(forward_trace)

_NAMES = ("qk", "softmax", "turn_wait", "pv", "epilogue")


def _trace(rng, ctas):
  """Events of ``ctas`` CTAs x 3 warpgroups with random regions and gaps;
  returns them with the expected cycles, runs and spans per role."""
  events = []
  expected = {role: {"cycles": {}, "runs": {}, "spans": []}
              for role in forward_trace._ROLES}
  for cta in range(ctas):
    for wg in range(3):
      role = expected[forward_trace._ROLES[wg]]
      tid = 1 + 3 * cta + wg
      start = float(rng.integers(0, 10_000))
      time = 0
      per_region, first_begin = {}, None
      for _ in range(int(rng.integers(1, 30))):
        time += int(rng.integers(0, 500))  # a gap outside any region
        if first_begin is None:
          first_begin = time
        name = _NAMES[rng.integers(len(_NAMES))]
        length = int(rng.integers(1, 3000))
        events.append(dict(name=name, ph="B", ts=(start + time) / 1e3,
                           pid=1, tid=tid))
        time += length
        events.append(dict(name=name, ph="E", ts=(start + time) / 1e3,
                           pid=1, tid=tid))
        per_region[name] = per_region.get(name, 0) + length
        role["runs"][name] = role["runs"].get(name, 0) + 1
      role["spans"].append(time - first_begin)  # first begin to last end
      for name, cycles in per_region.items():
        role["cycles"].setdefault(name, []).append(cycles)
  rng.shuffle(events)  # the dump sorts traces, not events across traces
  events.sort(key=lambda e: (e["tid"], e["ts"], e["ph"] == "B"))
  return events, expected


@pytest.mark.parametrize("seed", range(5))
def test_region_cycles_match_the_regions_built(seed):
  rng = np.random.default_rng(seed)
  ctas = int(rng.integers(1, 6))
  events, expected = _trace(rng, ctas)
  got = forward_trace.region_cycles(events)
  for role, want in expected.items():
    np.testing.assert_allclose(got[role]["spans"], want["spans"], atol=1e-6)
    assert dict(got[role]["runs"]) == want["runs"]
    assert set(got[role]["cycles"]) == set(want["cycles"])
    for name, cycles in want["cycles"].items():
      np.testing.assert_allclose(got[role]["cycles"][name], cycles,
                                 atol=1e-6)
