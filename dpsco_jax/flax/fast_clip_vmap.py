"""The vmap (reference) path of :class:`~dpsco_jax.flax.fast_clip.FastClippedGrad`, in chunks
of users.

A user's weight ``min(1, C / ||g_u||)`` needs only its own gradient, so the clipped sum is
formed a chunk of users at a time (one chunk's per-user gradients alive at once), the chunks'
sums added in float32 or wider: every contribution is still ``w_u g_u``, ``||w_u g_u|| <= C``;
only the order of float additions differs. Chunks are static slices, unrolled (a ``fori_loop``
ran 4-8x slower on XLA:CPU), each ordered after the previous (:func:`_after`). How many:
:func:`vmap_chunks`, from shapes only.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dpsco_jax._checks import check_int
from dpsco_jax.grads import per_user_grads
from dpsco_jax.transforms.clipping import clip_and_aggregate, tree_global_norms

#: Chunks of the ``"auto"`` rule on CPU (each chunk is unrolled: more cost compile time).
AUTO_CHUNKS = 4
#: Per-user gradients below this many bytes are never chunked.
MIN_GRAD_BYTES = 8 << 20
#: Chunk only when the per-user gradients hold this many times the batch's elements.
GRAD_TO_BATCH = 2
#: Fewest users in a chunk of the ``"auto"`` rule (small chunks run small matmuls slowly).
MIN_CHUNK_USERS = 8

__all__ = ["AUTO_CHUNKS", "MIN_GRAD_BYTES", "GRAD_TO_BATCH", "MIN_CHUNK_USERS",
           "check_vmap_chunks", "vmap_chunks", "chunked_norms", "chunked_clipped_sum"]


def check_vmap_chunks(value: int | str) -> int | str:
  """``"auto"`` or a positive int (a bool is not a count)."""
  if isinstance(value, str):
    if value != "auto":
      raise ValueError(f"vmap_chunks must be 'auto' or a positive int, got {value!r}")
    return value
  return check_int(value, "vmap_chunks")


def vmap_chunks(rule: int | str, params: Any, users: Any, backend: str | None = None
                ) -> tuple[int, str]:
  """``(chunks, reason)`` for per-user batches ``users`` (leaves ``[U, m, ...]``): a given
  int: that many (at most one user each); ``"auto"`` on one CPU device: :data:`AUTO_CHUNKS`
  when the per-user gradients hold more than :data:`MIN_GRAD_BYTES` and :data:`GRAD_TO_BATCH`
  times the batch's elements (slicing copies the batch), fewer where a chunk would hold under
  :data:`MIN_CHUNK_USERS` users; else 1 (sharded users would be gathered)."""
  n_users = int(jax.tree.leaves(users)[0].shape[0])
  if rule != "auto":
    return min(int(rule), n_users), f"vmap_chunks={rule}"
  backend = backend or jax.default_backend()
  if backend != "cpu":
    return 1, f"auto ({backend}): all users at once"
  if jax.device_count(backend) > 1:   # users may be sharded: a slice of them would gather
    return 1, f"auto (cpu, {jax.device_count(backend)} devices): all users at once"
  per_user = sum(math.prod(jnp.shape(p)) for p in jax.tree.leaves(params))
  grad_bytes = 4 * n_users * per_user
  batch = sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(users))
  if grad_bytes < MIN_GRAD_BYTES or n_users * per_user < GRAD_TO_BATCH * batch:
    return 1, (f"auto (cpu): per-user gradients {grad_bytes / 2**20:.1f} MiB, "
               f"{n_users * per_user / max(batch, 1):.2g}x the batch: all users at once")
  chunks = max(1, min(AUTO_CHUNKS, n_users // MIN_CHUNK_USERS))
  if chunks == 1:
    return 1, (f"auto (cpu): {n_users} users, under {2 * MIN_CHUNK_USERS} for two chunks of "
               f"{MIN_CHUNK_USERS}: all users at once")
  return chunks, (f"auto (cpu): {chunks} chunks (per-user gradients {grad_bytes / 2**20:.1f} "
                  f"MiB, {n_users * per_user / max(batch, 1):.2g}x the batch)")


def _slices(n_users: int, chunks: int) -> list[tuple[int, int]]:
  size = -(-n_users // chunks)
  return [(i, min(i + size, n_users)) for i in range(0, n_users, size)]


def _after(params: Any, done: Any) -> Any:
  """``params`` unchanged, bit for bit (``x - 0.0``; the zero is ``0 * [s != s]`` of a sum of
  ``done``, 0 even for NaN), but data-dependent on ``done`` (the previous chunks' results), so
  XLA computes one chunk's per-user gradients at a time (an ``optimization_barrier`` did not
  order them; the batch may hold no float leaf to carry the dependence)."""
  s = sum(jnp.sum(x) for x in jax.tree.leaves(done))
  zero = (s != s).astype(jnp.float32) * 0.0
  return jax.tree.map(lambda x: x - zero.astype(x.dtype)
                      if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def chunked_norms(model_loss: Callable, params: Any, users: Any, chunks: int) -> jax.Array:
  """Exact per-user gradient norms ``[U]``, a chunk of users at a time."""
  n_users = jax.tree.leaves(users)[0].shape[0]
  return jnp.concatenate([
      tree_global_norms(per_user_grads(model_loss, params,
                                       jax.tree.map(lambda x, a=a, b=b: x[a:b], users)))
      for a, b in _slices(n_users, chunks)])


def chunked_clipped_sum(model_loss: Callable, params: Any, users: Any, clip_norm: float,
                        user_mask: jax.Array | None, chunks: int
                        ) -> tuple[Any, jax.Array]:
  """``(sum_u w_u g_u, norms [U])`` over kept users: the core's ``per_user_grads`` +
  ``clip_and_aggregate(C, "sum")`` on each chunk, summed in float32 or wider."""
  n_users = jax.tree.leaves(users)[0].shape[0]
  chain = clip_and_aggregate(clip_norm, "sum")
  total, norms = None, []
  for a, b in _slices(n_users, chunks):
    part_users = jax.tree.map(lambda x: x[a:b], users)
    part_params = params if total is None else _after(params, (total, norms))
    grads = per_user_grads(model_loss, part_params, part_users)
    norms.append(tree_global_norms(grads))
    mask = None if user_mask is None else user_mask[a:b]
    part, _ = chain.update(grads, chain.init(params), params, user_mask=mask)
    total = part if total is None else jax.tree.map(jnp.add, total, part)
  return total, jnp.concatenate(norms)
