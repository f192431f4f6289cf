"""The vmap (reference) path of :class:`~dpsco_jax.flax.fast_clip.FastClippedGrad`, in chunks
of users.

A user's clip weight ``min(1, C / ||g_u||)`` needs only its own gradient, so the clipped sum
``sum_u w_u g_u`` can be formed a chunk of users at a time: per-user gradients of one chunk
(and that chunk's activations) alive at once, the chunks' sums added in float32 or wider.
The FLOPs are the same; the released value differs from the one-piece sum only by the order
of float additions across chunks, and every user's contribution is still ``w_u g_u`` with
``||w_u g_u|| <= C`` (the sensitivity does not move).

Why: on CPU ``method="auto"`` takes this path for convolutional models (the fast path's conv
loops are slower there, :mod:`~dpsco_jax.flax.fast_clip_cost`), and all users at once held
the item-level CNN of ``experiments/bench_cost.py`` at 1.41x the non-private step's peak
memory (every example's 66 k-parameter gradient, 270 MB, on top of the activations). Chunks
are static slices, unrolled: a ``fori_loop`` over chunks ran 4-8x slower on XLA:CPU
(convolutions in a loop body lose XLA:CPU's fast path; ``bench_cost.md``). Each chunk's parameters
is made data-dependent on the previous chunks' results (:func:`_after`), so XLA computes one
chunk's gradients at a time; unordered, it scheduled every chunk's gradients first on an MLP
(no saving) and kept 1.26x on the item CNN. Measured (bench_gpu's full sizes on this CPU,
``experiments/bench_cost_vmap_chunked.py``; ratios to the non-private step): item CNN peak
1.412 -> 0.377 and time 1.46 -> 1.09; user-level CNN peak 0.981 -> 0.269, time 1.40 -> 1.07
(each chunk holds a quarter of the batch's activations too, hence below the non-private
step).

The rule (:func:`vmap_chunks`), from shapes only:

* a given int: that many chunks (at most one user each);
* ``"auto"`` on CPU: :data:`AUTO_CHUNKS` chunks when the batch's per-user gradients hold more
  than :data:`MIN_GRAD_BYTES` and more than :data:`GRAD_TO_BATCH` times the batch's own
  elements (slicing the batch copies it: on bench_cost's GLM, whose 4 GiB batch dwarfs its
  64 MiB of gradients, four chunks tripled the peak), fewer where a chunk would hold under
  :data:`MIN_CHUNK_USERS` users, else 1;
* ``"auto"`` elsewhere: 1 (not measured on an accelerator, where ``auto`` takes the fast
  path for convolutions), and 1 where the backend has several devices (a batch whose users
  are sharded over a mesh would be gathered chunk by chunk).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dpsco_jax._checks import check_int
from dpsco_jax.grads import per_user_grads
from dpsco_jax.transforms.clipping import clip_and_aggregate, tree_global_norms

#: Chunks of the ``"auto"`` rule on CPU (more chunks hold less and cost more compile time,
#: each chunk being unrolled: the item CNN's step compiled in 10 s unchunked, 12 s in 4).
AUTO_CHUNKS = 4
#: Per-user gradients below this many bytes are never chunked (unrolled chunks cost compile
#: time, and small models gain nothing).
MIN_GRAD_BYTES = 8 << 20
#: Chunk only when the per-user gradients hold this many times the batch's elements.
GRAD_TO_BATCH = 2
#: Fewest users in a chunk of the ``"auto"`` rule. A chunk of a few users runs small matmuls
#: one after another: bench_cost's medium transformers (8 examples) in 4 chunks of 2 took
#: 1.54 / 1.92 of the non-private step's time against the fast path's 1.45 / 1.50, while at
#: full size (64 examples, chunks of 16) the chunked step was the faster (0.97 against 1.03).
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
  """``(chunks, reason)`` for per-user batches ``users`` (leaves ``[U, m, ...]``) and
  ``params``, from shapes only (see the module doc)."""
  n_users = int(jax.tree.leaves(users)[0].shape[0])
  if rule != "auto":
    return min(int(rule), n_users), f"vmap_chunks={rule}"
  backend = backend or jax.default_backend()
  if backend != "cpu":   # H100 transformer: 4 chunks 1.95x the non-private step, one piece 1.38x
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
  """``params`` unchanged, bit for bit, but data-dependent on ``done`` (the previous chunks'
  sum and norms): a chunk's forward pass reads these, so XLA cannot compute its per-user
  gradients before the previous chunk's are consumed, and only one chunk's are alive at a
  time (without it, XLA:CPU scheduled all chunks' gradients first on an MLP; an
  ``optimization_barrier`` did not order them). The parameters, not the batch, carry the
  dependence because a batch may hold no float leaf: a language model's int32 tokens carried
  none, and bench_gpu's transformer kept 1.39x the non-private peak in 16 chunks as in 4
  (0.45x with the parameters ordered). The gradient with respect to ``params - 0`` is the
  gradient with respect to ``params``. ``x - 0.0`` is ``x`` for every float, ``-0.0`` and NaN
  included; the zero is ``0 * [s != s]`` of a sum of ``done``, which is 0 whatever ``s`` is
  (NaN included)."""
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
  """``(sum_u w_u g_u, norms [U])`` over kept users (``user_mask``, finite gradients), the
  core's ``per_user_grads`` + ``clip_and_aggregate(C, "sum")`` on each chunk, the chunks' sums
  added in their (float32 or wider) dtype."""
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
