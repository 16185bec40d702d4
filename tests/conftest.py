"""Test configuration: four virtual CPU devices for the sharding tests.

The flag must be set before JAX initializes its backends.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


def pytest_collection_modifyitems(config, items):
  import jax
  import pytest
  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
