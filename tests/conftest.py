"""Test configuration, applied before JAX initializes its backends.

* Eight virtual CPU devices for the sharding and context-parallel tests.
* CPU code generation at XLA's default optimization level.  A lighter level
  (``--xla_backend_optimization_level=1``) compiled the suite's many small
  programs faster, but on hosts with AVX-512 LLVM's instruction selection
  aborted the process for about one program in a hundred of
  ``tiles.tile_classes`` ("Cannot select: X86ISD::SUBV_BROADCAST_LOAD" in a
  select/convert fusion; shapes such as T=16, S=48 with 11 x 9 tiles);
  the default level compiled 2,400 random cases of the same test without
  one.  Tests that time or run large programs compile with
  ``compiler_options=OPTIMIZED``.
* On a GPU, memory allocated as needed rather than most of it reserved up
  front, unless the caller chose: ``pytest -n 8`` runs eight processes on
  one GPU, and with JAX's default each reserves three quarters of its
  memory, leaving the others too little.
* With libtpu installed (``make test`` installs it for the TPU compile
  tests, ``tests/test_tpu_compile.py``) and no TPU here: JAX's default
  backend stays the CPU (``JAX_PLATFORMS=cpu``; libtpu's compiler is still
  reached through ``jax.experimental.topologies``), libtpu is told the
  chip type instead of probing the host for it, and several test
  processes may load it at once.
* Replayable random inputs (``tests/_seeds.py``): each test's generators
  (``fresh_rng()`` and friends) are seeded from its node id, or from
  ``JFLASH_TEST_SEED`` when set (``random`` for a new seed per test), and a
  failing test that drew inputs prints its seed and the command that runs
  it again on the same inputs::

      JFLASH_TEST_SEED=<seed> python -m pytest '<node id>'
"""

import glob
import importlib.util
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if (importlib.util.find_spec("libtpu") is not None
    and not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*")
    and not glob.glob("/dev/nvidia[0-9]*")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

OPTIMIZED = {"xla_backend_optimization_level": 3}

_FLAGS = ("--xla_force_host_platform_device_count=8",)
_existing = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_existing] + [f for f in _FLAGS if f.split("=")[0] not in _existing]).strip()

# The seed of each test: set before its setup, printed when it fails.
from tests._seeds import (pytest_runtest_makereport,  # noqa: E402,F401
                          pytest_runtest_protocol)


def pytest_collection_modifyitems(config, items):
  import jax
  import pytest
  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
