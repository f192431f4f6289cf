"""Per-example and per-user gradients: the engine that feeds every chain.

A user-level batch has leaves ``[U, m, ...]`` (``U`` user slots, possibly padded, ``m`` items
each). A user's gradient is that of its *mean* loss, ``g_u(x) = (1/m) sum_j grad_x loss(x,
z_{u,j})``: ``grad`` of the mean (no per-item gradients materialized), vmapped over users.
Item level is ``m = 1`` (or :func:`per_example_grads`). Options the papers need: ``user_mask``
(padded slots give exactly zero, so shapes stay static), ``offsets`` (per-item points ``x +
xi_{u,j}``: smoothing, paper 000 §4; ReSQue, paper 002 §2), ``chunk_size`` (``lax.map`` over
user chunks), two points on one batch (SRG differences, paper 003 §7.1) and
:func:`shard_users` (the user axis over a mesh; same result). Non-finite gradients pass
through: the clip stage drops such users, keeping that decision (and its accounting) in one
place.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpsco_jax._checks import check_int, check_user_mask

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


def _check_offsets(offsets: PyTree | None, params: PyTree, lead: tuple[int, ...],
                   layout: str) -> None:
  """Every offset leaf is ``lead + param.shape``: a leaf missing an axis would be mapped
  over the wrong one and broadcast against the params (wrong gradients, no error)."""
  if offsets is None:
    return
  def check(path, p, off):
    want = tuple(lead) + tuple(jnp.shape(p))
    if tuple(jnp.shape(off)) != want:
      raise ValueError(f"offsets{jax.tree_util.keystr(path)} must be shaped {layout} = "
                       f"{want}, got {tuple(jnp.shape(off))}")
  jax.tree_util.tree_map_with_path(check, params, offsets)


def per_example_grads(loss_fn: LossFn, params: PyTree, batch: PyTree, *,
                      offsets: PyTree | None = None) -> PyTree:
  """Gradients of ``loss_fn`` for every example of ``batch`` (leaves ``[B, ...]``).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar``.
    params: the point (a pytree).
    batch: the examples, leaves ``[B, ...]``.
    offsets: optional params-shaped leaves ``[B, *p.shape]``: example ``b`` is
      differentiated at ``params + offsets[b]``.

  Returns:
    The gradients: ``params``-shaped leaves with a leading ``B`` axis.

  Raises:
    ValueError: ``batch`` has no arrays, a scalar leaf, or ``B = 0``.
  """
  leaves = jax.tree.leaves(batch)
  if not leaves or any(jnp.ndim(x) == 0 for x in leaves):
    raise ValueError("batch must be a pytree of arrays shaped [B, ...]")
  if any(x.shape[0] == 0 for x in leaves):
    raise ValueError("empty batch: B = 0 examples")
  _check_offsets(offsets, params, leaves[0].shape[:1], "[B, *param.shape]")
  grad_fn = jax.grad(loss_fn)
  if offsets is None:
    return jax.vmap(grad_fn, in_axes=(None, 0))(params, batch)
  return jax.vmap(lambda off, ex: grad_fn(jax.tree.map(jnp.add, params, off), ex))(offsets, batch)


def _one_user(loss_fn: LossFn, params: PyTree, items: PyTree, offsets: PyTree | None,
              reduce_items: bool) -> PyTree:
  if offsets is None and reduce_items:
    return jax.grad(lambda p: jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0))(p, items)))(params)
  per_item = per_example_grads(loss_fn, params, items, offsets=offsets)
  if reduce_items:
    return jax.tree.map(lambda g: jnp.mean(g, axis=0), per_item)
  return per_item


def per_user_grads(loss_fn: LossFn, params: PyTree, batch: PyTree, *,
                   user_mask: jax.Array | None = None, offsets: PyTree | None = None,
                   chunk_size: int | None = None, reduce_items: bool = True) -> PyTree:
  """Per-user mean gradients for a batch with leaves ``[U, m, ...]``.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one item.
    params: the evaluation point (query point of the optimizer).
    batch: pytree with leaves ``[U, m, ...]``.
    user_mask: optional bool ``[U]`` (exactly; checked): False slots return exactly zero.
      Without it every slot is a real user.
    offsets: optional params-shaped pytree with leaves ``[U, m, *p.shape]``; item ``(u, j)``
      is differentiated at ``params + offsets[u, j]``.
    chunk_size: a positive int: users ``chunk_size`` at a time with ``lax.map``.
    reduce_items: False returns per-item gradients ``[U, m, ...]`` instead of the mean.

  Returns:
    A params-shaped pytree whose leaves carry a leading ``U`` axis (and ``m`` when
    ``reduce_items=False``).
  """
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("batch must contain at least one array")
  if any(leaf.ndim < 2 for leaf in leaves):
    raise ValueError("batch leaves must be shaped [users, m, ...]; use per_example_grads "
                     "for a flat [B, ...] batch")
  n_users = leaves[0].shape[0]
  if any(leaf.shape[0] != n_users for leaf in leaves):
    raise ValueError("batch leaves disagree on the number of users (leading axis)")
  if n_users == 0:
    raise ValueError("empty batch: 0 users (pad with a user_mask instead)")
  if any(leaf.shape[1] == 0 for leaf in leaves):
    raise ValueError("every user needs m >= 1 items; got a batch with m = 0 (the mean "
                     "gradient over zero items is undefined)")
  user_mask = check_user_mask(user_mask, n_users)
  _check_offsets(offsets, params, leaves[0].shape[:2], "[U, m, *param.shape]")
  if chunk_size is not None:
    chunk_size = check_int(chunk_size, "chunk_size", minimum=1)

  def one(args):
    return _one_user(loss_fn, params, *args, reduce_items)

  xs = (batch, offsets)
  grads = (jax.vmap(one)(xs) if chunk_size is None
           else jax.lax.map(one, xs, batch_size=chunk_size))
  if user_mask is None:
    return grads
  # where, not *, so a NaN in a padded slot vanishes
  return jax.tree.map(lambda g: jnp.where(user_mask.reshape((-1,) + (1,) * (g.ndim - 1)), g,
                                          jnp.zeros_like(g)), grads)


def per_user_grads_two_points(loss_fn: LossFn, params_a: PyTree, params_b: PyTree,
                              batch: PyTree, **kwargs) -> tuple[PyTree, PyTree]:
  """Per-user gradients at two points on one batch, fused (SRG differences ``g(x_t) -
  g(x_{t-1})``, paper 003).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar``.
    params_a: the first point (e.g. ``x_t``).
    params_b: the second point (e.g. ``x_{t-1}``), with ``params_a``'s structure.
    batch: leaves ``[U, m, ...]`` (see :func:`per_user_grads`).
    **kwargs: :func:`per_user_grads`'s keyword arguments (``user_mask``, ``chunk_size``, ...).

  Returns:
    ``(grads_a, grads_b)``, each params-shaped with a leading ``U`` axis.
  """
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params_a, params_b)
  both = jax.vmap(lambda p: per_user_grads(loss_fn, p, batch, **kwargs))(stacked)
  return (jax.tree.map(lambda g: g[0], both), jax.tree.map(lambda g: g[1], both))


def user_mesh(axis_name: str = "users", devices: list | None = None) -> Mesh:
  """A one-dimensional mesh over all (or the given) devices, for the user axis.

  Args:
    axis_name: the axis name (default ``"users"``).
    devices: the devices (default: ``jax.devices()``).

  Returns:
    A ``jax.sharding.Mesh`` with one axis, ``axis_name``.
  """
  return Mesh(np.array(devices if devices is not None else jax.devices()), (axis_name,))


def shard_users(tree: PyTree, mesh: Mesh | None = None, axis_name: str = "users") -> PyTree:
  """Places the leading (user) axis of every leaf across ``mesh``: jitted code on it runs
  data-parallel over users and equals the one-device numbers (up to summation order).

  Args:
    tree: a pytree whose leaves have a leading user axis.
    mesh: the mesh (default: :func:`user_mesh` over all devices).
    axis_name: the mesh axis of the users (default ``"users"``).

  Returns:
    ``tree`` with every leaf placed ``NamedSharding(mesh, P(axis_name))``.

  Raises:
    ValueError: a leaf's user axis is not divisible by the axis's device count.
  """
  mesh = mesh if mesh is not None else user_mesh(axis_name)
  n_dev = mesh.shape[axis_name]
  def put(x):
    if x.shape[0] % n_dev:
      raise ValueError(f"the user axis ({x.shape[0]}) must be divisible by the number of "
                       f"devices on mesh axis {axis_name!r} ({n_dev}); pad with a user_mask")
    spec = PartitionSpec(axis_name, *([None] * (x.ndim - 1)))
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(put, tree)
