"""Paper 000's Algorithms 1-3 with users sharded over a mesh's ``"users"`` axis.

Algorithm 1 (:func:`place_groups`): a phase's ``C`` groups run their SGD independently, so the
groups are split over the axis (padded with copies of group 0, sliced off), each with the key
the one-device run gives it; FILTER then sees the one-device run's ``C`` points (replicated).

Algorithms 2-3: each sampled user's mean gradient is computed by the device owning its slot
(the step's ``K_i`` slots padded to a multiple of the devices); the gradients are gathered
into the step's ``K_i x d`` matrix and FILTER's ``O(K^2 d)`` pair counts are split by rows
(``filter_points(rows=)``; the decisions are per pair, so the counts are the one-device ones).
The rest (coins, score, AboveThreshold, kept mean, noise) runs replicated from the one-device
keys. Padding never reaches FILTER (pad slots are exact zero rows, sliced off before it), so
FILTER sees the one-device run's rows, slot count and keys, and the plan is the same object.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpsco_jax.algorithms.common import _on_mesh
from dpsco_jax.grads import per_user_grads

PyTree = Any

__all__ = ["place_groups", "place_phase", "step_user_grads"]


def place_groups(items: PyTree, keys: jax.Array, mesh: Mesh, axis: str = "users"
                 ) -> tuple[PyTree, jax.Array]:
  """Algorithm 1's groups (leaves ``[C, T, ...]``) and their ``[C]`` keys, padded to a
  multiple of ``mesh``'s ``axis`` (copies of group 0 and its key: their outputs are sliced off
  by the caller) and placed with the group axis sharded, so each device runs its own groups'
  SGD."""
  placed, c = _on_mesh(items, mesh, axis)
  pad = jax.tree.leaves(placed)[0].shape[0] - c
  keys = jnp.concatenate([keys, jnp.repeat(keys[:1], pad, 0)]) if pad else keys
  return placed, jax.device_put(keys, NamedSharding(mesh, PartitionSpec(axis)))


def place_phase(data: PyTree, mesh: Mesh, axis: str = "users"
                ) -> tuple[PyTree, int, NamedSharding]:
  """A phase's users (leaves ``[n_i, m, ...]``) padded to a multiple of ``mesh``'s ``axis``
  (copies of the phase's first user, never sampled: the driver samples over the real
  ``n_i``) and placed with that axis sharded. Returns ``(data, n_i, users sharding)``; a mesh
  without ``axis`` is refused by ``mesh_users_axis`` with a message naming it."""
  placed, n_real = _on_mesh(data, mesh, axis)
  return placed, n_real, NamedSharding(mesh, PartitionSpec(axis))


def step_user_grads(loss_fn: Callable, params: PyTree, data: PyTree, idx: jax.Array | None,
                    offsets: PyTree | None, *, n_users: int, users: NamedSharding | None
                    ) -> PyTree:
  """Per-user mean gradients ``[K, ...]`` of one step's users: ``data[idx]`` (``K = len(idx)``)
  or, with ``idx=None``, the phase's first ``n_users`` rows (``K = n_users``); ``offsets``
  (smoothing, leaves ``[K, m, ...]``) as drawn by the one-device run.

  ``users`` (a mesh's users sharding): the ``K`` slots are padded to a multiple of its
  devices with masked slots (exact zero rows, then sliced off) and each device computes its
  own slots; the result is the one-device run's ``[K, ...]`` (to float tolerance)."""
  if users is None:
    rows = data if idx is None else jax.tree.map(lambda a: a[idx], data)
    return per_user_grads(loss_fn, params, rows, offsets=offsets)
  n_dev = users.mesh.shape[users.spec[0]]
  if idx is None:   # every user: the placed rows are already padded and sharded
    rows = data
    k = n_users
    slots = jax.tree.leaves(data)[0].shape[0]
  else:
    k = idx.shape[0]
    slots = -(-k // n_dev) * n_dev
    # pad slots read user idx[0] (any real row: they are masked to zero below)
    idx = jnp.concatenate([idx, jnp.broadcast_to(idx[:1], (slots - k,))])
    rows = jax.tree.map(lambda a: a[idx], data)
  mask = jnp.arange(slots) < k
  if offsets is not None:
    offsets = jax.tree.map(
        lambda o: jnp.pad(o, ((0, slots - k),) + ((0, 0),) * (o.ndim - 1)), offsets)
  rows, mask, offsets = jax.lax.with_sharding_constraint((rows, mask, offsets), users)
  grads = per_user_grads(loss_fn, params, rows, user_mask=mask, offsets=offsets)
  return jax.tree.map(lambda g: g[:k], grads)
