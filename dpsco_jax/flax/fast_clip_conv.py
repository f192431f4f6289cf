"""Per-user convolution kernel norms and releases in chunks of users (bounded memory).

A tapped ``nnx.Conv`` forms its per-user weight gradients from im2col patches as batched
matmuls, one static chunk of users at a time in a ``fori_loop`` (:func:`chunk_users`,
:func:`chunk_rule`: shapes only); the arithmetic per user is the unchunked one, so the certified
bounds are unchanged. A last chunk that does not fit is clamped to end at the last user: its
outputs are written twice with the same values, and the release masks the users an earlier
chunk already added.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from dpsco_jax.flax import fast_clip_norms as fn

_F32 = jnp.float32

#: CPU chunk budget: one chunk's temporaries at most this fraction of the layer's activations
#: (inputs + outputs, all users), which the non-private step holds anyway.
CONV_CHUNK_BUDGET = 0.25
#: The accelerator's budget (fewer loop trips), capped at this fraction of the device's memory.
ACCEL_CHUNK_BUDGET = 1.0
ACCEL_MEMORY_FRACTION = 1 / 16
_BYTES = 4  # the patches and per-user gradients are float32
#: Per-user gradient buffers larger than this fraction of the layer's activations are created
#: once the backward pass reaches the layer (:func:`conv_bound`).
LATE_BUFFER = 0.5


def conv_dims(conv: nnx.Conv) -> tuple[int, int, int]:
  """``(p, q, groups)``: a feature group's inputs (patch length) and outputs, the groups."""
  groups = int(conv.feature_group_count)
  return (fn.prod(conv.kernel_size) * int(conv.in_features) // groups,
          int(conv.out_features) // groups, groups)


def per_user_elements(conv: nnx.Conv, n: int, direct: bool) -> int:
  """One user's temporaries in a chunk, in elements: patches, Gram or gradient, output rows."""
  p, q, groups = conv_dims(conv)
  return groups * (n * p + (p * q if direct else 2 * n * n) + n * q)


def layer_elements(in_shapes: Sequence[tuple], out_shapes: Sequence[tuple]) -> int:
  """The layer's activations over the batch: every call's inputs and outputs."""
  return sum(fn.prod(s) for s in in_shapes) + sum(fn.prod(s) for s in out_shapes)


def chunk_users(n_users: int, per_user: int, layer: int, budget: float | None,
                limit: int | None = None) -> int:
  """Users per chunk: as many as fit in ``budget * layer`` and ``limit`` elements (at least
  1), preferring a divisor of ``n_users`` at least half that; both ``None``: all users."""
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
  """A chunk's temporaries: at most ``budget`` times the layer's activations and ``limit``
  elements (``None``: no such cap)."""
  budget: float | None
  limit: int | None
  reason: str  # why: reported by FastClippedGrad.plan()


def device_memory(backend: str) -> int | None:
  """Bytes the first local device of ``backend`` may allocate, or None where unknown."""
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
  """The chunking of ``FastClippedGrad(conv_budget=...)`` on ``backend``: a number or
  ``None`` as given; ``"auto"``: :data:`CONV_CHUNK_BUDGET` on CPU (chunking costs no time
  there), else :data:`ACCEL_CHUNK_BUDGET` (each loop trip costs kernel launches) capped at
  :data:`ACCEL_MEMORY_FRACTION` of the device's memory."""
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


def _chunk(x: jax.Array, i, b: int) -> jax.Array:
  return lax.dynamic_slice_in_dim(x, i, b, axis=0)


def _patches_and_grads(conv, xs, gs):
  """Grouped patches ``[b, N, G, (in/G) * kvol]`` and output gradients ``[b, N, G, out/G]``
  of a chunk of ``b`` users."""
  b, groups = xs[0].shape[0], conv.feature_group_count
  grouped = lambda y: jnp.reshape(y.astype(_F32), (b, -1, groups, y.shape[-1] // groups))
  return (jnp.concatenate([grouped(fn.conv_patches(conv, x)) for x in xs], 1),
          jnp.concatenate([grouped(g) for g in gs], 1))


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
  per-user kernel gradients ``[U, *kernel]`` (released as is), ``chunk`` users at a time;
  with ``recomputed`` (or in the Gram form) the bounds cover :func:`conv_release`."""
  n_users = xs[0].shape[0]
  if chunk >= n_users:
    return _bound_chunk(conv, xs, gs, ghost, recomputed)
  shapes = jax.eval_shape(lambda x, g: _bound_chunk(conv, x, g, ghost, recomputed),
                          [_chunk(x, 0, chunk) for x in xs], [_chunk(g, 0, chunk) for g in gs])
  sq0 = jnp.zeros((n_users,), shapes[0].dtype)
  m0 = None
  if shapes[1] is not None:
    # Constant zeros would be allocated before the forward pass; ``g * 0`` (every slot is
    # overwritten) waits for the backward pass. Worth it only for a large buffer.
    m_shape = (n_users,) + shapes[1].shape[1:]
    if fn.prod(m_shape) > LATE_BUFFER * layer_elements([x.shape for x in xs],
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

  return lax.fori_loop(0, -(-n_users // chunk), body, (sq0, m0))


def conv_release(conv: nnx.Conv, xs: Sequence[jax.Array], gs: Sequence[jax.Array],
                 w: jax.Array, kept: jax.Array, chunk: int) -> jax.Array:
  """The release ``sum_{u,t} a_{ut} (w_u g_{ut})^T`` in the kernel's layout, ``chunk`` users
  at a time; a dropped user's (maybe non-finite) inputs and gradients are zeroed (not a kept
  user's stand-in: XLA then kept an activation-sized buffer alive)."""
  n_users = xs[0].shape[0]

  def chunk_sum(i, b, fresh):
    keep = _chunk(kept, i, b) & fresh
    ws = jnp.where(keep, _chunk(w, i, b), 0.0).astype(_F32)
    xc = [jnp.where(fn.bcast(keep, x), x, 0.0) for x in [_chunk(x, i, b) for x in xs]]
    gc = [jnp.where(fn.bcast(keep, g), g.astype(_F32) * fn.bcast(ws, g), 0.0)
          for g in [_chunk(g, i, b) for g in gs]]
    a, wg = _patches_and_grads(conv, xc, gc)
    return jnp.einsum("ungk,ungo->gko", a, wg, precision=fn.HI)

  if chunk >= n_users:
    return fn.conv_layout(conv, chunk_sum(0, n_users, jnp.ones((n_users,), bool)))
  total0 = jax.eval_shape(lambda: chunk_sum(0, chunk, jnp.ones((chunk,), bool)))

  def body(c, total):
    i = jnp.minimum(c * chunk, n_users - chunk)
    fresh = (i + jnp.arange(chunk)) >= c * chunk  # not added by an earlier chunk
    return total + chunk_sum(i, chunk, fresh)

  total = lax.fori_loop(0, -(-n_users // chunk), body,
                        jnp.zeros(total0.shape, total0.dtype))
  return fn.conv_layout(conv, total)


class ConvPlan(NamedTuple):
  chunk: int        # users whose patches are formed at once
  direct: bool      # per-user gradients instantiated (else the Gram form)
  recomputed: bool  # release recomputed from inputs and output gradients (else dense M)
  held: int         # elements held per user from the bound to the release


def plan_conv(conv: nnx.Conv, in_shapes: Sequence[tuple], out_shapes: Sequence[tuple],
              n_users: int, ghost: str, rule: ChunkRule) -> ConvPlan:
  """How a conv is clipped, from its calls' batched shapes: the chunk, the form, and what is
  held until the weights are known: the per-user gradients or, when smaller, the inputs and
  output gradients, from which the release is recomputed chunk by chunk."""
  n = sum(fn.prod(s[1:-1]) for s in out_shapes)  # positions per user, over its items and calls
  p, q, groups = conv_dims(conv)
  direct = not fn.use_gram(n, p, q, ghost)
  layer = layer_elements(in_shapes, out_shapes)
  chunk = chunk_users(n_users, per_user_elements(conv, n, direct), layer, rule.budget,
                      rule.limit)
  acts, dense = layer // max(1, n_users), groups * p * q
  if not direct:
    return ConvPlan(chunk, False, True, acts)
  recomputed = acts < dense
  return ConvPlan(chunk, True, recomputed, acts if recomputed else dense)
