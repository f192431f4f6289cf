"""Paper 000's Algorithms 1-3 with users sharded over a mesh (issue 24.2).

Algorithm 1 (:func:`place_groups`): a phase's ``C`` groups run their one-pass SGD
independently (a ``vmap`` over groups), so the groups are split over the mesh's ``"users"``
axis, padded to a multiple of the devices with copies of group 0 whose outputs are sliced
off, each group with the key the one-device run gives it; the FILTER then sees the very
``C`` points of the one-device run (it is ``O(C^2 d)`` on ``C`` points, replicated).

Algorithms 2-3:

Per step, each sampled user's mean gradient over its ``m`` items (``O(K m d)``) is computed by
the device that owns the user's slot: a phase's users are placed with their
leading axis split over the mesh's ``"users"`` axis, each step's ``K_i`` slots are padded to a
multiple of the devices and constrained to that axis, so every device differentiates only its
own slots. The FILTER needs every pair of users of the step (a score is a count over
pairs, not a sum of per-user terms): the per-user gradients are gathered into the step's
``K_i x d`` matrix, and the pair counts, FILTER's ``O(K^2 d)`` part (``K_i`` is usually well
above ``m``, so it outweighs the gradients), are split by rows over the same axis, each device
counting its rows against the whole matrix (``filter_points(rows=)``; the decisions are per
pair, so the counts are the one-device ones). Everything after the counts (coins, score,
AboveThreshold, the kept mean, the Gaussian noise) is ``O(K d)`` and runs replicated from the
one-device run's keys: the same draw on every device, i.e. drawn once.

Padding never reaches the FILTER: the pad slots are masked in the gradient computation (exact
zero rows) and sliced off before it, so the FILTER sees the very rows, slot count and keys of
the one-device run: no pad slot counts toward a neighbour count, is kept, or moves the
score's dyadic rounding (which depends on the slot count), and the ledger, planned from public
numbers only, is the same object. (The row split of the pair counts pads its own layout to a
multiple of the devices with rows that are no column and count nothing, as its row blocks
always did.)
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
