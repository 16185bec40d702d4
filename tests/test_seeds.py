"""Replayable test inputs (``tests/_seeds.py``): a test's seed depends only
on its node id, the same in every process; ``JFLASH_TEST_SEED`` overrides
it; and a failing test prints the seed and a command that draws the same
inputs again, also under pytest-xdist."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from tests import _seeds

ROOT = pathlib.Path(__file__).resolve().parents[1]
NODE = "tests/test_masks.py::test_tile_classes[causal-window]"


def _env(**extra):
  env = {k: v for k, v in os.environ.items()
         if k not in (_seeds.ENV, "PYTEST_ADDOPTS")}
  env["PYTHONPATH"] = os.pathsep.join(
      filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  env.update(extra)
  return env


def test_the_seed_is_a_stable_hash_of_the_node_id():
  # Pinned: a different hash, or Python's salted hash(), changes it.
  assert _seeds.seed_for(NODE, "") == 2954437392
  assert _seeds.seed_for(NODE + "x", "") != _seeds.seed_for(NODE, "")
  # The same in other processes, whatever their hash salt.
  code = f"from tests._seeds import seed_for; print(seed_for({NODE!r}))"
  for salt in ("1", "2"):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, env=_env(PYTHONHASHSEED=salt),
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == 2954437392


def test_the_environment_overrides_the_seed():
  assert _seeds.seed_for(NODE, "1234") == 1234
  assert _seeds.seed_for(NODE, " 0x10 ") == 16
  assert _seeds.seed_for(NODE, str(2**32 - 1)) == 2**32 - 1
  drawn = {_seeds.seed_for(NODE, "random") for _ in range(4)}
  assert len(drawn) > 1 and all(0 <= s < 2**32 for s in drawn)
  for bad in ("-1", str(2**32), "seven"):
    with pytest.raises(ValueError, match=_seeds.ENV):
      _seeds.seed_for(NODE, bad)


def test_generators_are_refused_outside_a_test():
  code = "from tests._seeds import fresh_rng; fresh_rng()"
  done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, env=_env(), check=False)
  assert done.returncode != 0 and "inside a test" in done.stderr


_CASES = """
import pytest
from tests._seeds import fresh_rng


def test_draws():
  first, second = (int(fresh_rng().integers(1 << 62)) for _ in range(2))
  assert first == second, f"draws {first} {second}"


def test_fails_without_drawing():
  assert False


def test_fails_without_a_traceback():
  fresh_rng()
  pytest.fail("plain", pytrace=False)


def test_passes_after_drawing():
  fresh_rng()
"""

_CONFTEST = """
from tests._seeds import pytest_runtest_makereport, pytest_runtest_protocol
"""


def _pytest(tmp_path, *args, **env):
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "--show-capture=no", *args], cwd=tmp_path, capture_output=True,
      text=True, env=_env(**env), check=False, timeout=120)
  return done.stdout + done.stderr


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failure_prints_a_seed_that_replays(tmp_path, workers):
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  (tmp_path / "conftest.py").write_text(_CONFTEST)
  (tmp_path / "test_cases.py").write_text(_CASES)
  xdist = ["-n", str(workers)] if workers else []
  draws_node = "test_cases.py::test_draws"

  def run(*args, **env):
    """(seeds printed per test, test_draws's two draws)"""
    out = _pytest(tmp_path, *xdist, *args, **env)
    seeds = {node: int(seed) for seed, node in re.findall(
        r"seed=(\d+) \(replay: JFLASH_TEST_SEED=\1 python -m pytest "
        r"(test_cases\.py::\w+)\)", out)}
    draws = re.search(r"draws (\d+) (\d+)", out)
    assert draws, out[-4000:]
    return seeds, [int(x) for x in draws.groups()], out

  seeds, draws, out = run()
  assert "3 failed, 1 passed" in out, out[-4000:]
  # Only the failing tests that drew inputs name a seed.
  assert sorted(seeds) == [draws_node,
                           "test_cases.py::test_fails_without_a_traceback"
                           ], out[-4000:]
  seed = seeds[draws_node]
  assert seed == _seeds.seed_for(draws_node, "")
  # The first generator is seeded with the printed seed, the next ones
  # with seeds derived from it.
  assert draws[0] == np.random.default_rng(seed).integers(1 << 62)
  assert draws[0] != draws[1]
  # Another process, another hash salt: the same inputs.
  assert run(PYTHONHASHSEED="7")[:2] == (seeds, draws)
  # The printed command: the same inputs.
  assert run(draws_node, JFLASH_TEST_SEED=str(seed))[:2] == (
      {draws_node: seed}, draws)
  # Another seed: other inputs, and that seed printed.
  other, other_draws, _ = run(draws_node, JFLASH_TEST_SEED=str(seed ^ 1))
  assert other == {draws_node: seed ^ 1} and other_draws[0] != draws[0]
