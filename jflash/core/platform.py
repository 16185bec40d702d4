"""The platform a call is traced for: one rule for every backend.

A jitted program is traced before it is lowered, and the platform it will
be lowered for is not known while tracing.  jflash takes it from, in order:

1. the device of the inputs' mesh (``jax.typeof(x).sharding.mesh``): arrays
   or ``jax.ShapeDtypeStruct`` arguments sharded over TPU devices are
   traced for a TPU, whatever this host is;
2. the device of the ambient abstract mesh (``jax.set_mesh``,
   ``jax.sharding.use_abstract_mesh``, or :func:`lowering_for`);
3. this host's default platform and first device.

Only that platform's backends are traced.  To lower for another platform
from this host (``jax.export.export(..., platforms=["tpu"])``,
``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))``), trace inside
:func:`lowering_for`; a program for several platforms names an
implementation per platform (``implementation={"cpu": None, "tpu": None}``).
"""

from __future__ import annotations

import dataclasses

import jax

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
"""The lowering platforms jflash knows (``jax.export`` names)."""


@dataclasses.dataclass(frozen=True)
class Target:
  """What a call is traced for.

  Attributes:
    platform: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"`` (or another
      lowering platform, which only ``xla`` serves).
    device_kind: ``jax.Device.device_kind`` of the target device (e.g.
      ``"NVIDIA H100 80GB HBM3"``, ``"TPU v5 lite"``), or ``""`` when
      unknown.
  """

  platform: str
  device_kind: str = ""


def _lowering_name(platform: str) -> str:
  """A device platform (``"gpu"``) as a lowering platform (``"cuda"``)."""
  if platform != "gpu":
    return platform
  host = jax.export.default_export_platform()
  return host if host in ("cuda", "rocm") else "cuda"


def _mesh_device(x) -> jax.sharding.AbstractDevice | None:
  sharding = getattr(jax.typeof(x), "sharding", None)
  return getattr(getattr(sharding, "mesh", None), "abstract_device", None)


def target(*arrays) -> Target:
  """The :class:`Target` of a call on ``arrays`` (see the module
  docstring for the rule)."""
  device = None
  for x in jax.tree.leaves(arrays):
    device = _mesh_device(x)
    if device is not None:
      break
  if device is None:
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device",
                     None)
  if device is not None:
    return Target(_lowering_name(device.platform), device.device_kind or "")
  return host_target()


def host_target() -> Target:
  """This host's default platform and first device."""
  platform = jax.export.default_export_platform()
  try:
    kind = jax.devices()[0].device_kind
  except RuntimeError:  # no backend for the default platform
    kind = ""
  return Target(platform, kind)


def is_hopper(device_kind: str) -> bool:
  """Whether ``device_kind`` names a Hopper GPU (compute capability 9.x).

  This host's GPUs answer from their compute capability; any other kind
  (a target named by :func:`lowering_for`) by its model name."""
  try:
    devices = jax.devices()
  except RuntimeError:
    devices = []
  for device in devices:
    if device.platform == "gpu" and device.device_kind == device_kind:
      return str(getattr(device, "compute_capability", "")).startswith("9")
  return any(model in device_kind.split()
             for model in ("H100", "H200", "H800", "H20", "GH200"))


def lowering_for(platform: str, device_kind: str = ""):
  """A context in which jflash traces calls for ``platform``'s device
  ``device_kind``, whatever this host is: the route to lower or export
  for another platform.

  It is ``jax.sharding.use_abstract_mesh`` with an empty mesh of that
  device, so JAX's caches tell a trace made inside it from one made
  outside.  ``device_kind`` is a ``jax.Device.device_kind``: it picks
  generation-specific kernels (``"TPU v5 lite"``, ``"TPU v6 lite"``; the
  Hopper kernels need a Hopper GPU such as ``"NVIDIA H100 80GB HBM3"``).
  Unknown, TPU kernels take the tiling that fits every generation and a
  CUDA target gets the portable ``xla`` backend.

  Example::

    with jflash.lowering_for("tpu", "TPU v5 lite"):
      exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*args)

  Raises:
    ValueError: ``platform`` is not a lowering platform name.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"lowering_for: platform must be one of {PLATFORMS}, "
                     f"got {platform!r}")
  if not isinstance(device_kind, str):
    raise ValueError("lowering_for: device_kind must be a str (a "
                     f"jax.Device.device_kind), got {device_kind!r}")
  device = jax.sharding.AbstractDevice(device_kind=device_kind,
                                       num_cores=None, platform=platform)
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), (), abstract_device=device))
