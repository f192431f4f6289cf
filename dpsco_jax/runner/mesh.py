"""The runner's ``devices`` key: a sweep whose users are sharded over a mesh (issue 24.2).

``devices: N`` (a top-level runner key, like ``batch_seeds``) runs every run of the sweep with
its users sharded over a one-dimensional ``"users"`` mesh of the first ``N`` local devices
(``devices: all``: every local device). It is the YAML spelling of ``dp.fit(..., mesh=)``: each
device differentiates and clips its own users, the clipped sums are reduced across the axis and
the noise is drawn once, so a run's params equal its one-device run's to float tolerance and
its privacy report is the same (``tests/test_runner_mesh.py``).

Checked before anything runs (a :class:`ConfigError`, exit 2): the value, the number of local
devices, and every run's algorithm, which must be in :data:`dpsco_jax.api.MESH_READY` (or be
``flax.DPTrainer``, which shards its micro-batches over the mesh the runner sets); a run
whose algorithm cannot shard is refused with the reason of
:data:`dpsco_jax.api.MESH_UNSUPPORTED`, never run on one device behind the key's back. Seeds of
a row are not vmapped together on a mesh (one program per seed; their records say why).
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import numpy as np

# ``jax.set_mesh(mesh)`` around a user-problem run (``dp.fit`` / ``fit_model`` read it): the
# drivers' own context helper, re-exported under the runner's name
from dpsco_jax.algorithms.common import mesh_context  # noqa: F401
from dpsco_jax.config.schema import ConfigError

#: The mesh axis users are sharded over (the one every mesh-ready driver reads).
AXIS = "users"
#: Config-only algorithms of a user problem that read the mesh set with ``jax.set_mesh`` (the
#: runner sets it around the run): ``DPTrainer`` shards each micro-batch's users over it.
TRAINERS = frozenset({"flax.DPTrainer"})
#: ``batch_note`` of the records of a row whose seeds ran one by one because of the mesh.
BATCH_NOTE = "devices: on a mesh the seeds of a row run one program each"


def devices_option(config: dict) -> int | None:
  """The top-level ``devices`` key: ``None`` (one device, the default), a positive int, or
  ``"all"``; refuses a bool, a float, a string other than ``"all"``, more devices than this
  process has, and the key inside an experiments entry."""
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
  """A registered (synthetic) problem whose drivers read ``problem.mesh``: a shallow copy with
  the mesh set (the cached problem itself stays mesh-free for the runs of other sweeps)."""
  if mesh is None:
    return problem
  shard = copy.copy(problem)
  shard.mesh = mesh
  return shard
