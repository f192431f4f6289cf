"""DPTrainer on a mesh (issue 24.2): users sharded over a ``"users"`` axis.

``DPTrainer(..., mesh=m)`` (or a mesh set with ``jax.set_mesh`` around the constructor) runs
each step's micro-batches with their user axis sharded over ``m``'s ``"users"`` axis: each
device differentiates and clips its own users, XLA reduces the clipped sums across the axis,
and the sum, the params, the optimizer state, the noise stage and the keys are replicated, so
the noise is drawn once from the one key and added once. Nothing of the plan changes: the
sampling (on the sampling key), the accounting and the ledger are the one-device run's, and
the released params equal its params to float rounding (the clipped sums are added in another
order).

* A micro-batch is rounded up to a multiple of the axis' devices (public: from shapes only);
  the extra slots are masked exactly as the trainer's padded slots already are, so a batch
  size the devices do not divide runs as is.
* The data's user axis is sharded too (padded to a multiple of the devices with copies of
  row 0 that are never indexed: the trainer samples over its ``n`` real rows only), so no
  device holds the whole table.
* Refused rather than run gathered on every device: fast clipping of a convolution whose
  per-user patches are formed in chunks of users (a ``fori_loop`` of ``dynamic_slice``s over
  the whole batch, :mod:`~dpsco_jax.flax.fast_clip_conv`, would gather every device's users
  onto each device); ``method="vmap"`` shards.
* :meth:`DPTrainer.release_fn` (the audit hook) stays a one-device pure function.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpsco_jax.algorithms.common import _on_mesh, auto_axes, mesh_context, mesh_users_axis

PyTree = Any
AXIS = "users"


def current_mesh(mesh: Mesh | None) -> Mesh | None:
  """``mesh``, else the one set with ``jax.set_mesh`` (if any), as ``dpsco_jax.fit`` reads
  it; a mesh without a ``"users"`` axis is refused, naming the axis. A mesh with explicit
  axes (``jax.make_mesh``'s default) is replaced by its auto-typed twin
  (:func:`~dpsco_jax.algorithms.common.auto_axes`)."""
  if mesh is None:
    current = jax.sharding.get_mesh()
    mesh = current if isinstance(current, Mesh) and not current.empty else None
  if mesh is not None:
    mesh_users_axis(mesh, AXIS)
  return auto_axes(mesh)


class UsersMesh:
  """The trainer's placement: identity without a mesh, users sharded with one."""

  def __init__(self, mesh: Mesh | None):
    self.mesh = current_mesh(mesh)
    self.devices = 1 if self.mesh is None else mesh_users_axis(self.mesh, AXIS)
    if self.mesh is not None:
      self._users = NamedSharding(self.mesh, PartitionSpec(AXIS))
      self._replicated = NamedSharding(self.mesh, PartitionSpec())

  def context(self):
    """The context the trainer's jitted steps run in: its (auto-typed) mesh, over a caller's
    explicit ``jax.set_mesh`` context; nothing without a mesh."""
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
    if self.mesh is None:
      return tree
    return jax.lax.with_sharding_constraint(tree, self._replicated)

  def check_clipper(self, clipper: Any, data: PyTree, micro_batch: int) -> None:
    """Refuses fast clipping of a convolution chunked over users (module docstring).
    ``clipper.method`` is the resolved one (``"auto"`` was resolved at this shape)."""
    if self.mesh is None or clipper.method != "fast":
      return
    # the plan reads shapes only: a zero micro-batch stands in (as for autotune)
    stand_in = jax.tree.map(lambda x: jnp.zeros((micro_batch, *x.shape[1:]), x.dtype), data)
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


def zeros_like_sum(params: PyTree) -> PyTree:
  # The clipped sum is accumulated in float32 or wider, whatever the params' dtype.
  return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(p.dtype,
                                                                           jnp.float32)),
                      params)
