"""DPTrainer on a mesh: each step's users sharded over a ``"users"`` axis.

Each device differentiates and clips its own users, XLA reduces the clipped sums; params,
optimizer and noise states and keys are replicated, so the noise is drawn once from the one
key. Plan, sampling and ledger are the one-device run's; the params equal its params to float
rounding. Micro-batches are rounded up to a multiple of the devices (extra slots masked).
:meth:`DPTrainer.release_fn` stays a one-device function.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpsco_jax.algorithms.common import _on_mesh, auto_axes, mesh_context, mesh_users_axis

PyTree = Any
AXIS = "users"


class UsersMesh:
  """The trainer's placement: identity without a mesh (``mesh``, else ``jax.set_mesh``'s,
  auto-typed; refused without a ``"users"`` axis), users sharded with one."""

  def __init__(self, mesh: Mesh | None):
    if mesh is None:
      current = jax.sharding.get_mesh()
      mesh = current if isinstance(current, Mesh) and not current.empty else None
    self.devices = 1 if mesh is None else mesh_users_axis(mesh, AXIS)
    self.mesh = auto_axes(mesh)
    if self.mesh is not None:
      self._users = NamedSharding(self.mesh, PartitionSpec(AXIS))
      self._replicated = NamedSharding(self.mesh, PartitionSpec())

  def context(self):
    """The (auto-typed) mesh the jitted steps run in, over a caller's ``jax.set_mesh``."""
    return mesh_context(self.mesh)

  def micro_batch(self, size: int) -> int:
    """``size`` rounded up to a multiple of the devices (the extra slots are masked)."""
    return -(-int(size) // self.devices) * self.devices

  def place_data(self, data: PyTree) -> PyTree:
    return data if self.mesh is None else _on_mesh(data, self.mesh, AXIS)[0]

  def place(self, tree: PyTree) -> PyTree:
    """``tree`` (params, optimizer and noise state, keys) replicated over the mesh."""
    return tree if self.mesh is None else jax.device_put(tree, self._replicated)

  def spread(self, tree: PyTree) -> PyTree:
    """Inside jit: ``tree``'s leading (user) axis sharded over the users axis."""
    return tree if self.mesh is None else jax.lax.with_sharding_constraint(tree, self._users)

  def gather(self, tree: PyTree) -> PyTree:
    """Inside jit: ``tree`` (the reduced clipped sum) replicated over the mesh."""
    return tree if self.mesh is None else jax.lax.with_sharding_constraint(tree, self._replicated)

  def check_clipper(self, clipper: Any, stand_in: PyTree) -> None:
    """Refuses fast clipping of a convolution chunked over users (``method`` is resolved;
    ``stand_in``: a zero micro-batch, the plan reads shapes only)."""
    if self.mesh is None or clipper.method != "fast":
      return
    micro_batch = jax.tree.leaves(stand_in)[0].shape[0]
    rows = clipper.plan(clipper.params, stand_in).layers
    chunked = [f"{r.layer} ({r.chunk} of {micro_batch} users at a time)" for r in rows
               if r.kind == "conv" and 0 < r.chunk < micro_batch]
    if chunked:
      raise ValueError(f"method='fast' with convolutions chunked over users ({'; '.join(chunked)}"
                       ") does not shard over a mesh yet: their per-user patches are formed in "
                       "a loop over chunks of the whole batch, which would gather every "
                       "device's users on each device; use method='vmap' on a mesh, or no mesh")

  def __repr__(self) -> str:
    return "UsersMesh(none)" if self.mesh is None else f"UsersMesh({self.devices} devices)"

