"""Replayable random inputs: every test's seed comes from its node id.

A test's seed is ``zlib.crc32`` of its pytest node id (for example
``tests/test_masks.py::test_tile_classes[causal-window]``), the same in every
process, on every machine and under ``pytest -n``; or, when the environment
sets ``JFLASH_TEST_SEED``, that number for every test (``random`` draws a
new seed per test, for runs that look for new failing inputs).  The n-th
generator a test asks for (:func:`fresh_rng`, :func:`seeded_rng`) is seeded
with the test's seed for n = 0 and with a seed derived from (seed, n) after
that, so a test's inputs depend only on its node id and its own code, not
on which tests ran before it in the same process.

A failing test that used its seed names it in its report, with the command
that runs it again on the same inputs::

    seed=2954437392 (replay: JFLASH_TEST_SEED=2954437392 python -m pytest
    'tests/test_masks.py::test_tile_classes[causal-window]')

``tests/conftest.py`` installs the hooks below.  Generators are asked for
while a test runs (its setup, call or teardown); asking outside a test, for
example at import, is an error, because what it returned would depend on
the order in which modules were collected.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import zlib

import numpy as np
import pytest

ENV = "JFLASH_TEST_SEED"


def seed_for(nodeid: str, override: str | None = None) -> int:
  """The seed of the test with node id ``nodeid``: ``override`` (by default
  ``$JFLASH_TEST_SEED``) when it is set, else a stable 32-bit hash of the
  node id (``zlib.crc32``, not Python's salted ``hash``)."""
  if override is None:
    override = os.environ.get(ENV, "")
  override = override.strip()
  if override.lower() == "random":
    return int.from_bytes(os.urandom(4), "little")
  if override:
    try:
      seed = int(override, 0)
    except ValueError:
      seed = -1
    if not 0 <= seed < 2**32:
      raise ValueError(f"{ENV}={override!r}: give an integer in [0, 2**32) "
                       "or 'random'")
    return seed
  return zlib.crc32(nodeid.encode("utf-8"))


@dataclasses.dataclass
class _Running:
  nodeid: str
  seed: int
  generators: int = 0  # seeds handed out so far
  used: bool = False   # whether the test's inputs depend on its seed


_running: _Running | None = None
_KEY = pytest.StashKey[_Running]()


def _current() -> _Running:
  if _running is None:
    raise RuntimeError(
        "random test inputs are drawn inside a test (its setup, call or "
        "teardown), so that they depend only on the test's node id; see "
        "tests/_seeds.py")
  return _running


def current_seed() -> int:
  """The running test's seed (what a failure report prints)."""
  running = _current()
  running.used = True
  return running.seed


def next_seed() -> int:
  """A seed for the running test's next generator: the test's own seed the
  first time, then one derived from it and the number of seeds handed out
  before.  For inputs made elsewhere, such as in a subprocess."""
  running = _current()
  running.used = True
  n, running.generators = running.generators, running.generators + 1
  if n == 0:
    return running.seed
  return int(np.random.SeedSequence([running.seed, n]).generate_state(1)[0])


def seeded_rng() -> tuple[np.random.Generator, int]:
  """A generator for the running test and the seed it was made from."""
  seed = next_seed()
  return np.random.default_rng(seed), seed


def fresh_rng() -> np.random.Generator:
  """A generator for the running test (see the module docstring)."""
  return seeded_rng()[0]


def replay_line(nodeid: str, seed: int) -> str:
  return (f"seed={seed} (replay: {ENV}={seed} python -m pytest "
          f"{shlex.quote(nodeid)})")


# Hooks, installed by tests/conftest.py.


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  global _running
  _running = item.stash[_KEY] = _Running(item.nodeid, seed_for(item.nodeid))
  try:
    return (yield)
  finally:
    _running = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  running = item.stash.get(_KEY, None)
  if running is not None and running.used and report.failed:
    line = replay_line(item.nodeid, running.seed)
    longrepr = report.longrepr
    # Into the failure's own text where it has one, so that it shows
    # whatever --show-capture says and travels with pytest-xdist's reports.
    if hasattr(longrepr, "addsection"):
      longrepr.addsection("seed", line)
    elif isinstance(longrepr, str):
      report.longrepr = f"{longrepr}\n{line}"
    else:
      report.sections.append(("seed", line))
  return report
