"""The runner's ``devices`` key: every run's users sharded over a mesh.

``devices: N`` (top level; ``all``: every local device) runs every run with its users sharded
over a one-dimensional ``"users"`` mesh of the first ``N`` local devices, the YAML spelling of
``dp.fit(..., mesh=)``: params equal the one-device run's to float tolerance and the privacy
report is the same. A run whose algorithm cannot shard (not in
:data:`dpsco_jax.api.MESH_READY`, nor ``flax.DPTrainer``) is refused before anything runs,
never run on one device behind the key's back. Seeds of a row run one program each.
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import numpy as np

from dpsco_jax.algorithms.common import mesh_context  # noqa: F401 (re-exported)
from dpsco_jax.config.schema import ConfigError

AXIS = "users"
#: config-only algorithms that shard over the mesh the runner sets around a user-problem run
TRAINERS = frozenset({"flax.DPTrainer"})
#: ``batch_note`` of the records of a row whose seeds ran one by one because of the mesh.
BATCH_NOTE = "devices: on a mesh the seeds of a row run one program each"


def devices_option(config: dict) -> int | None:
  """The top-level ``devices`` key: ``None`` (one device), a positive int, or ``"all"``;
  anything else, more devices than this process has, or the key in an experiments entry is
  refused."""
  for entry in config.get("experiments") or []:
    if isinstance(entry, dict) and "devices" in entry:
      raise ConfigError("devices is a top-level runner key (every run of the sweep shards its "
                        "users over the same mesh); move it out of the experiments entry")
  value = config.get("devices")
  if value is None:
    return None
  available = jax.local_device_count()
  if value == "all":
    return available
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ConfigError(f"devices must be a positive int or 'all' (shard each run's users over "
                      f"that many local devices), got {value!r}")
  if value > available:
    raise ConfigError(f"devices={value}: this process has {available} local device(s) "
                      f"({jax.devices()[0].platform}); on CPU, XLA_FLAGS="
                      f"--xla_force_host_platform_device_count={value} forces host devices")
  return value


def check_runs(runs: list[dict], devices: int | None) -> None:
  """Every run's algorithm must shard over a mesh when ``devices`` is set (before any runs)."""
  if devices is None:
    return
  from dpsco_jax.api import MESH_READY, MESH_UNSUPPORTED
  for cfg in runs:
    name = cfg["algorithm"]
    if name not in MESH_READY and name not in TRAINERS:
      reason = MESH_UNSUPPORTED.get(name, "not a registered per-user gradient algorithm")
      raise ConfigError(f"devices={devices}: {name} does not shard users over a mesh: "
                        f"{reason}. Mesh-ready: {', '.join(sorted(MESH_READY))}")


def make_mesh(devices: int | None) -> jax.sharding.Mesh | None:
  """The one-dimensional users mesh of the first ``devices`` local devices (None: none)."""
  if devices is None:
    return None
  return jax.sharding.Mesh(np.array(jax.local_devices()[:devices]), (AXIS,))


def on_mesh(problem: Any, mesh: jax.sharding.Mesh | None) -> Any:
  """A shallow copy of a registered problem with ``mesh`` set (the cached one stays
  mesh-free)."""
  if mesh is None:
    return problem
  shard = copy.copy(problem)
  shard.mesh = mesh
  return shard
