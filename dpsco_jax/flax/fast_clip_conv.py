"""Per-user convolution kernel norms and releases in chunks of users (bounded memory).

Private helper of :mod:`dpsco_jax.flax.fast_clip`. A tapped ``nnx.Conv`` forms its per-user
weight gradient from im2col patches (``kh kw c_in`` copies of every input position: 9x the
layer's activations for a 3x3 kernel) so that the per-user gradients are batched matmuls,
which a GPU runs at matmul rate (a user-grouped convolution, vmap's form, ran ~70x slower on
an H200; see :data:`~dpsco_jax.flax.fast_clip_cost.GROUPED_CONV_WEIGHT`). Patches for all
users at once held the CNNs' private step at ~2x the non-private step's memory
(``experiments/bench_cost.md``), so here they are formed for one chunk of users at a time in
a ``fori_loop``: only one chunk's patches are ever alive.

The chunk is static, from shapes only (:func:`chunk_users`): the users whose patches (and
per-user gradients and row norms) fit in ``budget`` times the layer's own activations (its
inputs plus outputs over the whole batch, which the non-private step holds anyway): by
default 0.25 on CPU, and on an accelerator 1.0 capped by a fraction of the device's memory
(:func:`chunk_rule`: loop trips cost time there). The
arithmetic per user is exactly the unchunked one (the same :func:`~dpsco_jax.flax.
fast_clip_norms.kernel_bound` on the same patches), so the certified bounds are unchanged.

Chunks are taken with ``dynamic_slice`` (no copy of the batch); when the chunk does not divide
the number of users the last chunk is clamped to end at the last user and overlaps the one
before: per-user outputs are then written twice with the same values, and the summed release
masks the users an earlier chunk already added.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from dpsco_jax.flax import fast_clip_norms as fn

_F32 = jnp.float32

#: Default chunk budget: one chunk's temporaries (patches, row norms, per-user gradients) at
#: most this fraction of the layer's activations (inputs + outputs, all users). The
#: non-private step holds every layer's activations, so a quarter of the largest layer's
#: stays well inside the issue's 1.2x target (bench_cost.md has the measurements).
CONV_CHUNK_BUDGET = 0.25

#: ``conv_budget="auto"`` on an accelerator (:func:`chunk_rule`): one chunk's temporaries at
#: most this fraction of the layer's activations (4x the CPU's: 4x fewer loop trips), and ...
ACCEL_CHUNK_BUDGET = 1.0
#: ... at most this fraction of the device's memory (patches, row norms, per-user gradients:
#: float32). A sixteenth leaves room for the model's activations and for XLA holding two
#: layers' temporaries at once.
ACCEL_MEMORY_FRACTION = 1 / 16
_BYTES = 4  # the patches and per-user gradients are float32

#: A conv's per-user gradient buffer is created after the backward pass reaches the layer (not
#: as constant zeros, which XLA allocates at the start of the step) when it holds more than
#: this fraction of the layer's activations (see :func:`conv_bound`).
LATE_BUFFER = 0.5


def per_user_elements(conv: nnx.Conv, n: int, direct: bool) -> int:
  """Temporaries of one user in a chunk, in elements: its patches ``n k`` (``k = kh kw
  c_in``), the Gram matrices ``2 n^2`` per group (Gram form) or its gradient ``k q`` (direct
  form), and the output gradient rows it reads ``n c_out``."""
  groups = int(conv.feature_group_count)
  k = fn._prod(conv.kernel_size) * int(conv.in_features)
  out = int(conv.out_features)
  form = k * out // groups if direct else 2 * groups * n * n
  return n * k + form + n * out


def layer_elements(in_shapes: Sequence[tuple], out_shapes: Sequence[tuple]) -> int:
  """The layer's activations over the batch: every call's inputs and outputs."""
  return sum(fn._prod(s) for s in in_shapes) + sum(fn._prod(s) for s in out_shapes)


def chunk_users(n_users: int, per_user: int, layer: int, budget: float | None,
                limit: int | None = None) -> int:
  """Users per chunk: as many as fit in ``budget * layer`` elements and in ``limit`` elements
  (at least 1); the largest divisor of ``n_users`` not above that when it is at least half of
  it (no overlapping last chunk). Both ``None``: all users in one chunk (the unchunked
  form)."""
  caps = ([int(budget * layer)] if budget is not None else []) + (
      [int(limit)] if limit is not None else [])
  if not caps:
    return n_users
  fit = max(1, min(n_users, min(caps) // max(1, per_user)))
  if fit >= n_users:
    return n_users
  div = max(d for d in range(1, fit + 1) if n_users % d == 0)
  return div if 2 * div >= fit else fit


class ChunkRule(NamedTuple):
  """How every conv of a step sizes its chunk of users (:func:`chunk_rule`): one chunk's
  temporaries at most ``budget`` times the layer's activations and at most ``limit``
  elements (``None``: no such cap; both ``None``: all users at once)."""
  budget: float | None
  limit: int | None
  reason: str  # why: reported by FastClippedGrad.plan()


def device_memory(backend: str) -> int | None:
  """Bytes the first local device of ``backend`` may allocate (``memory_stats()``'s
  ``bytes_limit``: after XLA's preallocation fraction on a GPU); None where unknown (CPU, a
  backend that does not report it, or no such backend here)."""
  if backend == "cpu":
    return None
  try:
    stats = jax.local_devices(backend=backend)[0].memory_stats() or {}
  except (RuntimeError, ValueError, IndexError):  # no such backend on this machine
    return None
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def chunk_rule(conv_budget: float | str | None, backend: str,
               device_bytes: int | None) -> ChunkRule:
  """The chunking of ``FastClippedGrad(conv_budget=...)`` on ``backend``.

  A number or ``None`` is taken as given on every backend. ``"auto"`` (the default) is the
  backend's trade-off, from shapes and the device's memory only:

  * CPU: :data:`CONV_CHUNK_BUDGET` of the layer's
    activations. Chunking cost no time there (bench_cost.md: the item CNN's fast step went
    from 2.23x to 1.89x the non-private step's CPU time when chunked) and the patches of all
    users at once held the step at ~2x the non-private step's memory.
  * an accelerator: :data:`ACCEL_CHUNK_BUDGET` (1.0) of the layer's activations, and never
    more than :data:`ACCEL_MEMORY_FRACTION` of the device's memory (where known). There each loop trip is
    a handful of kernel launches on a small batched matmul, so the CPU budget's 88 trips
    cost time, while all users at once gave up what chunks gain there. Measured on an H100
    (jax 0.11.2, fp32 highest; ``experiments/results/gpu/conv_budget_h100.log``,
    ``conv_budget_default_h100.log``), item-level CNN step as a ratio to the non-private
    step: budget 0.25 (88 trips) 4.22x / 4.48x, **1.0 (22 trips) 2.39x**, 4.0 (1 to 2
    trips) 2.59x, all users at once 2.57x / 2.59x; user-level CNN: 0.25 (56 trips) 2.09x,
    all users at once 2.34x (1.0 not yet measured there: between the two, 14 trips)."""
  if conv_budget is None:
    return ChunkRule(None, None, "conv_budget=None: all users at once")
  if conv_budget != "auto":
    return ChunkRule(float(conv_budget), None,
                     f"conv_budget={conv_budget:g} of each conv's activations")
  if backend == "cpu":
    return ChunkRule(CONV_CHUNK_BUDGET, None,
                     f"auto (cpu): {CONV_CHUNK_BUDGET:g} of each conv's activations")
  reason = f"auto ({backend}): {ACCEL_CHUNK_BUDGET:g} of each conv's activations"
  if device_bytes is None:  # the budget alone: a multiple of activations that already fit
    return ChunkRule(ACCEL_CHUNK_BUDGET, None, reason + " (device memory unknown)")
  limit = int(ACCEL_MEMORY_FRACTION * device_bytes) // _BYTES
  return ChunkRule(ACCEL_CHUNK_BUDGET, limit, reason + f", at most {ACCEL_MEMORY_FRACTION:g} "
                   f"of the device's {device_bytes / 2**30:.1f} GiB")


def _direct(conv: nnx.Conv, n: int, ghost: str) -> bool:
  groups = int(conv.feature_group_count)
  k = fn._prod(conv.kernel_size) * int(conv.in_features) // groups
  return not fn.use_gram(n, k, int(conv.out_features) // groups, ghost)


def _chunk(x: jax.Array, i, b: int) -> jax.Array:
  return lax.dynamic_slice_in_dim(x, i, b, axis=0)


def _starts(n_users: int, b: int) -> int:
  return -(-n_users // b)


def _patches_and_grads(conv, xs, gs):
  """Grouped patches ``[b, N, G, k]`` and output gradients ``[b, N, G, o]`` of a chunk."""
  b = xs[0].shape[0]
  ag = [fn.conv_grouped(conv, x, g, b) for x, g in zip(xs, gs)]
  return jnp.concatenate([a for a, _ in ag], 1), jnp.concatenate([g for _, g in ag], 1)


def _bound_chunk(conv, xs, gs, ghost, recomputed):
  """``(sq [b], M [b, *kernel] or None)`` for a chunk: the per-group bounds' squares summed
  (``M`` None in the Gram form and when the release is recomputed)."""
  a, g = _patches_and_grads(conv, xs, gs)
  bm = [fn.kernel_bound(a[:, :, j], g[:, :, j], ghost, recomputed)
        for j in range(a.shape[2])]
  sq = sum(jnp.square(b) for b, _ in bm)
  if bm[0][1] is None or recomputed:
    return sq, None
  return sq, fn.conv_layout(conv, jnp.stack([mj for _, mj in bm], axis=1))


def conv_bound(conv: nnx.Conv, xs: Sequence[jax.Array], gs: Sequence[jax.Array], ghost: str,
               chunk: int, recomputed: bool = False):
  """Per-user squared norm bounds ``[U]`` and, in the direct form unless ``recomputed``, the
  per-user kernel gradients ``[U, *kernel]`` (released as is), from every call's recorded
  inputs ``xs`` ``[U, ...]`` and output gradients ``gs``, ``chunk`` users at a time; with
  ``recomputed`` (or in the Gram form) the bounds cover :func:`conv_release` instead."""
  n_users = xs[0].shape[0]
  if chunk >= n_users:
    return _bound_chunk(conv, xs, gs, ghost, recomputed)
  shapes = jax.eval_shape(lambda x, g: _bound_chunk(conv, x, g, ghost, recomputed),
                          [_chunk(x, 0, chunk) for x in xs], [_chunk(g, 0, chunk) for g in gs])
  sq0 = jnp.zeros((n_users,), shapes[0].dtype)
  m0 = None
  if shapes[1] is not None:
    # The per-user gradients' buffer. As constant zeros XLA:CPU allocates it before the
    # forward pass; made from a value of the layer's output gradient (``g * 0``: whatever it
    # is, every user's slot is overwritten below) it cannot be allocated before the backward
    # pass reaches the layer. That also constrains XLA's order, and measured on the item-level
    # CNN (bench_cost.md) it pays only for a buffer large against the layer's activations:
    # convs/2's (72 MiB, 0.75x) took the peak 1.247x -> 1.193x the non-private step; convs/1's
    # as well (36 MiB, 0.23x) made XLA run the backward pass below it before its loop (1.30x).
    m_shape = (n_users,) + shapes[1].shape[1:]
    if fn._prod(m_shape) > LATE_BUFFER * layer_elements([x.shape for x in xs],
                                                          [g.shape for g in gs]):
      z = jnp.reshape(gs[0], (-1,))[0].astype(shapes[1].dtype) * 0
      m0 = jnp.full(m_shape, z, shapes[1].dtype)
    else:
      m0 = jnp.zeros(m_shape, shapes[1].dtype)

  def body(c, carry):
    i = jnp.minimum(c * chunk, n_users - chunk)  # the last chunk ends at the last user
    sq, m = _bound_chunk(conv, [_chunk(x, i, chunk) for x in xs],
                         [_chunk(g, i, chunk) for g in gs], ghost, recomputed)
    out_sq = lax.dynamic_update_slice_in_dim(carry[0], sq, i, 0)
    out_m = None if m is None else lax.dynamic_update_slice_in_dim(carry[1], m, i, 0)
    return out_sq, out_m

  return lax.fori_loop(0, _starts(n_users, chunk), body, (sq0, m0))


def conv_release(conv: nnx.Conv, xs: Sequence[jax.Array], gs: Sequence[jax.Array],
                 w: jax.Array, kept: jax.Array, chunk: int) -> jax.Array:
  """The release ``sum_{u,t} a_{ut} (w_u g_{ut})^T`` in the kernel's layout (Gram form, or a
  direct form whose per-user gradients were not kept), ``chunk`` users at a time: a dropped
  user's inputs and gradients (maybe non-finite) are replaced by zeros, whose patches are
  zeros, so it adds an exact zero. (Not a kept user's inputs, as for the other layers: XLA
  hoisted that row's slice out of the loop and recomputed it from the layer's
  pre-activation, keeping an activation-sized buffer alive to the end of the step.)"""
  n_users = xs[0].shape[0]

  def chunk_sum(i, b, fresh):
    keep = _chunk(kept, i, b) & fresh
    ws = jnp.where(keep, _chunk(w, i, b), 0.0).astype(_F32)
    xc = [jnp.where(_bcast(keep, x), x, 0.0) for x in [_chunk(x, i, b) for x in xs]]
    gc = [jnp.where(_bcast(keep, g), g.astype(_F32) * _bcast(ws, g), 0.0)
          for g in [_chunk(g, i, b) for g in gs]]
    a, wg = _patches_and_grads(conv, xc, gc)
    return jnp.einsum("ungk,ungo->gko", a, wg, precision=fn._HI)

  if chunk >= n_users:
    return fn.conv_layout(conv, chunk_sum(0, n_users, jnp.ones((n_users,), bool)))
  total0 = jax.eval_shape(lambda: chunk_sum(0, chunk, jnp.ones((chunk,), bool)))

  def body(c, total):
    i = jnp.minimum(c * chunk, n_users - chunk)
    fresh = (i + jnp.arange(chunk)) >= c * chunk  # not added by an earlier chunk
    return total + chunk_sum(i, chunk, fresh)

  total = lax.fori_loop(0, _starts(n_users, chunk), body,
                        jnp.zeros(total0.shape, total0.dtype))
  return fn.conv_layout(conv, total)


def _bcast(v, x):
  return jnp.reshape(v, v.shape + (1,) * (x.ndim - v.ndim))


class ConvPlan(NamedTuple):
  chunk: int        # users whose patches are formed at once
  direct: bool      # per-user gradients instantiated (else the Gram form)
  recomputed: bool  # release recomputed from inputs and output gradients (else dense M)
  held: int         # elements held per user from the bound to the release


def plan_conv(conv: nnx.Conv, in_shapes: Sequence[tuple], out_shapes: Sequence[tuple],
              n_users: int, ghost: str, rule: ChunkRule) -> ConvPlan:
  """How a conv layer is clipped, from its calls' batched shapes (``[U, ...]``): the chunk,
  the form, and what is held until the weights are known: the per-user gradients (``k q``
  per user) or, when smaller (a late layer: few positions, many weights), the inputs and
  output gradients, from which the release is recomputed chunk by chunk (``n k q`` more
  multiply-adds per user: peak memory is what the issue asks of this path)."""
  n = sum(fn._prod(s[1:-1]) for s in out_shapes)  # positions per user, over its items and calls
  direct = _direct(conv, n, ghost)
  per_user = per_user_elements(conv, n, direct)
  chunk = chunk_users(n_users, per_user, layer_elements(in_shapes, out_shapes), rule.budget,
                      rule.limit)
  acts = layer_elements(in_shapes, out_shapes) // max(1, n_users)
  dense = fn._prod(conv.kernel_size) * int(conv.in_features) * int(conv.out_features) // int(
      conv.feature_group_count)
  if not direct:
    return ConvPlan(chunk, False, True, acts)
  recomputed = acts < dense
  return ConvPlan(chunk, True, recomputed, acts if recomputed else dense)
