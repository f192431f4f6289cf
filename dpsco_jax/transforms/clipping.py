"""Per-user clipping and aggregation with a stated sensitivity.

Chain input convention (every stage in ``dpsco_jax.transforms``): **stacked per-user
gradients**, leaves with a leading user axis ``U`` (:func:`num_user_slots`); padded slots are
marked by the extra argument ``user_mask`` (bool ``[U]``, :func:`real_users`); without it every
slot is a real user. An aggregating stage (:func:`aggregate`, FILTER) reduces the axis.

Sensitivity: rows clipped to L2 norm ``<= C`` (global over the pytree) make the masked sum
move by ``C`` (add/remove, zero-out) or ``2C`` (replace-one); a *fixed* denominator ``D``
(never the realized count) gives ``C/D``. A non-finite row is dropped (contributes exactly
zero), itself a bounded change. Abadi et al. 2016; user level: Levy et al. 2021.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import (_traced, check_bool, check_choice, check_positive,
                               check_user_mask)

from dpsco_jax.privacy.relations import RELATIONS
from dpsco_jax.privacy.sensitivity import clipped_mean_sensitivity
from dpsco_jax.transforms.noise import noise_dtype

PyTree = Any


# Precision (a clip factor is part of the guarantee): norms, factors and aggregates in float32
# or wider (elementwise squares, never a matmul); a low-precision row is cast back rounding
# toward zero, and every factor has a relative margin 2^-20, so the realized norm stays <= C.
_CLIP_MARGIN = 2.0 ** -20
_TINY = 1e-30  # floor on the norm in C / ||g|| (the factor is 1 for such rows anyway)
_F32_MAX = float(jnp.finfo(jnp.float32).max)


def _is_low_precision(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def _out_dtype(dtype) -> jnp.dtype:
  """Dtype of a clipped row: the input's if it is a float, else float32 (ints promoted)."""
  return jnp.dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(jnp.float32)


def _round_toward_zero(y: jax.Array, dtype) -> jax.Array:
  """float32 ``y`` cast to the low-precision ``dtype`` with ``|result| <= |y|`` entrywise, on
  the bits (XLA:GPU optimizes away a comparison of f32 -> bf16 -> f32 round trips); float16
  subnormals are floored onto their spacing."""
  fi = jnp.finfo(dtype)
  y = y.astype(jnp.float32)
  drop = 23 - int(fi.nmant)
  bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
  keep = jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
  t = jax.lax.bitcast_convert_type(bits & keep, jnp.float32)
  if float(fi.smallest_normal) > float(jnp.finfo(jnp.float32).smallest_normal):
    inv_sub = float(1.0 / float(fi.smallest_subnormal))  # 2^24 for float16: a normal float32
    sub_grid = jnp.sign(t) * (jnp.floor(jnp.abs(t) * inv_sub) / inv_sub)
    t = jnp.where(jnp.abs(t) < float(fi.smallest_normal), sub_grid, t)
  return t.astype(dtype)


def _row_sqnorm(g: jax.Array) -> jax.Array:
  x = g.astype(noise_dtype(g.dtype))
  return jnp.sum(jnp.reshape(x * x, (g.shape[0], -1)), axis=1)


def tree_global_norms(stacked: PyTree) -> jax.Array:
  """L2 norm of each row over all leaves, in float32 or wider whatever the leaves' dtype.

  Args:
    stacked: a pytree whose leaves share a leading row axis ``U``.

  Returns:
    The ``[U]`` row norms.
  """
  return jnp.sqrt(sum(_row_sqnorm(g) for g in jax.tree.leaves(stacked)))


def _weighted_row_sum(stacked: PyTree, weights: jax.Array, keep: jax.Array) -> PyTree:
  """``sum_u weights_u * g_u`` over kept rows, one float32+ HIGHEST dot per leaf; dropped rows
  add exact zeros (``0 * NaN = NaN``): on CPU :func:`_guarded_row_sum`, else zeroed first."""
  leaves, treedef = jax.tree.flatten(stacked)
  if not leaves:
    return stacked
  out = jax.lax.platform_dependent(
      leaves, weights, keep, cpu=_guarded_row_sum, default=_zeroed_row_sum)
  return jax.tree.unflatten(treedef, out)


def _zeroed_row_sum(leaves: list, weights: jax.Array, keep: jax.Array,
                    barrier: bool = False) -> list:
  """Dropped rows zeroed, then one HIGHEST dot per leaf (``barrier``: materialised first)."""
  def f(g):
    wide = noise_dtype(g.dtype)
    k = keep.reshape((-1,) + (1,) * (g.ndim - 1))
    safe = jnp.where(k, g, jnp.zeros_like(g))
    if barrier:
      safe = jax.lax.optimization_barrier(safe)
    return jnp.tensordot(weights.astype(wide), safe.astype(wide), axes=1,
                         precision=jax.lax.Precision.HIGHEST)
  return [f(g) for g in leaves]


def _guarded_row_sum(leaves: list, weights: jax.Array, keep: jax.Array) -> list:
  """CPU: vector leaves by a dot of the rows as they are (dropped rows weighted 0), kept when
  finite, else :func:`_blocked_zeroed_sum`; other leaves by :func:`_zeroed_row_sum`."""
  vec = [_one_vector_per_user(g) for g in leaves]
  rest = iter(_zeroed_row_sum([g for g, v in zip(leaves, vec) if not v], weights, keep,
                              barrier=True))
  flat = [jnp.reshape(g, (g.shape[0], -1)) for g, v in zip(leaves, vec) if v]
  guarded = iter(())
  if flat:
    def f(g):
      wide = noise_dtype(g.dtype)
      wk = jnp.where(keep, weights, 0).astype(wide)
      return jnp.tensordot(wk, g.astype(wide), axes=1, precision=jax.lax.Precision.HIGHEST)
    direct = [f(g) for g in flat]
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(d)) for d in direct]))
    guarded = iter(jax.lax.cond(finite, lambda: direct,
                                lambda: [_blocked_zeroed_sum(g, weights, keep) for g in flat]))
  return [jnp.reshape(next(guarded), g.shape[1:]) if v else next(rest)
          for g, v in zip(leaves, vec)]


#: Bytes of one block of rows in :func:`_blocked_zeroed_sum` (its only temporary).
ZEROED_BLOCK_BYTES = 1 << 20


def _blocked_zeroed_sum(g: jax.Array, weights: jax.Array, keep: jax.Array) -> jax.Array:
  """The zeroed sum of a ``[U, D]`` leaf a block of rows at a time (no ``[U, D]`` copy)."""
  u, d = g.shape
  wide = noise_dtype(g.dtype)
  b = max(1, min(u, ZEROED_BLOCK_BYTES // max(1, d * jnp.dtype(wide).itemsize)))
  blocks = -(-u // b)
  rows = jnp.arange(b)

  def body(i, acc):
    start = jnp.minimum(i * b, u - b)
    gb = jax.lax.dynamic_slice_in_dim(g, start, b)
    kb = jax.lax.dynamic_slice_in_dim(keep, start, b) & (start + rows >= i * b)
    wb = jnp.where(kb, jax.lax.dynamic_slice_in_dim(weights, start, b), 0).astype(wide)
    safe = jnp.where(kb[:, None], gb, jnp.zeros((), gb.dtype)).astype(wide)
    return acc + jnp.tensordot(wb, safe, axes=1, precision=jax.lax.Precision.HIGHEST)
  return jax.lax.fori_loop(0, blocks, body, jnp.zeros((d,), wide))


def _one_vector_per_user(g: jax.Array) -> bool:
  """At most one axis of ``g``'s per-user part is longer than 1 (``[U, D]``, ``[U, D, 1]``)."""
  return sum(1 for d in g.shape[1:] if d > 1) <= 1


def _scale_rows(stacked: PyTree, scale: jax.Array, keep: jax.Array) -> PyTree:
  """``g_u * scale_u`` (unkept rows zeroed) in float32+, back in :func:`_out_dtype`."""
  def f(g):
    wide = noise_dtype(g.dtype)
    s = scale.reshape((-1,) + (1,) * (g.ndim - 1)).astype(wide)
    k = keep.reshape((-1,) + (1,) * (g.ndim - 1))
    y = jnp.where(k, g.astype(wide) * s, jnp.zeros((), wide))
    out = _out_dtype(g.dtype)
    return _round_toward_zero(y, out) if _is_low_precision(out) else y.astype(out)
  return jax.tree.map(f, stacked)


def _clip_factors(norms: jax.Array, max_norm) -> jax.Array:
  """``min(1, C (1 - 2^-20) / ||g||)``; 1 for non-finite norms (dropped separately)."""
  c = max_norm * (1.0 - _CLIP_MARGIN)
  safe = jnp.maximum(jnp.where(jnp.isfinite(norms), norms, 1.0), _TINY)
  return jnp.minimum(1.0, c / safe)


def clip_rows(stacked: PyTree, max_norm: float | jax.Array, *,
              per_layer: bool = False) -> tuple[PyTree, jax.Array]:
  """Clips every row to L2 norm ``<= max_norm``; non-finite rows become zero.

  Args:
    stacked: a pytree whose leaves share a leading row axis ``U``.
    max_norm: ``C``, the row bound.
    per_layer: clip each leaf at ``C / sqrt(num_leaves)`` (same bound; default False).

  Returns:
    ``(clipped, finite)``: the clipped rows and the bool ``[U]`` mask of kept rows.
  """
  num_user_slots(stacked)
  norms = tree_global_norms(stacked)
  finite = jnp.isfinite(norms)
  if per_layer:
    c = max_norm / jnp.sqrt(float(len(jax.tree.leaves(stacked))))
    return jax.tree.map(lambda g: _scale_rows(g, _clip_factors(jnp.sqrt(_row_sqnorm(g)), c),
                                              finite), stacked), finite
  return _scale_rows(stacked, _clip_factors(norms, max_norm), finite), finite


class ClipState(NamedTuple):
  """The state of the clipping stages.

  Attributes:
    dropped: the count of non-finite users (int32; data-dependent, so 0 unless the stage was
      built with ``debug=True``).
  """
  dropped: jax.Array


def _init_clip_state(params) -> ClipState:
  del params
  return ClipState(dropped=jnp.zeros((), jnp.int32))


def num_user_slots(stacked: PyTree) -> int:
  """The leading user axis ``U >= 1`` every leaf shares (the chain input convention).

  Args:
    stacked: the stacked per-user updates.

  Returns:
    ``U``.

  Raises:
    ValueError: no leaves, a leaf without the axis, leaves that disagree, or ``U = 0``.
  """
  leaves = jax.tree.leaves(stacked)
  if not leaves:
    raise ValueError("the stacked per-user updates have no leaves (empty pytree)")
  if any(jnp.ndim(g) == 0 for g in leaves):
    raise ValueError("every leaf of the stacked per-user updates needs a leading user axis; "
                     f"got shapes {[jnp.shape(g) for g in leaves]}")
  sizes = {g.shape[0] for g in leaves}
  if len(sizes) != 1:
    raise ValueError(f"stacked leaves disagree on the user axis: {sorted(sizes)}")
  n = sizes.pop()
  if n == 0:
    raise ValueError("empty batch: the stacked per-user updates have 0 user slots (pad with "
                     "a user_mask instead of passing an empty batch)")
  return n


def real_users(user_mask: Any, n: int) -> jax.Array:
  """The checked ``user_mask`` (bool ``[n]``), or all True without one.

  Args:
    user_mask: the chain's extra argument, or ``None``.
    n: the number of user slots.

  Returns:
    A bool ``[n]`` array.
  """
  mask = check_user_mask(user_mask, n)
  return jnp.ones((n,), bool) if mask is None else mask


def clip_per_user(max_norm: float, *, per_layer: bool = False,
                  debug: bool = False) -> optax.GradientTransformationExtraArgs:
  """Clips each user's (row's) gradient: ``g_u <- g_u min(1, C / ||g_u||_2)``, non-finite rows
  and padded slots (``user_mask``) to 0. Keeps the user axis and float dtypes (integer rows
  come back float32).

  Args:
    max_norm: ``C``, the per-user L2 bound, > 0.
    per_layer: clip each leaf at ``C / sqrt(num_leaves)`` instead (default False).
    debug: count non-finite users in the state (data-dependent; default False).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` on stacked ``[U, ...]`` updates; its state is
    :class:`ClipState`.
  """
  check_positive(max_norm, "max_norm")
  check_bool(per_layer, "per_layer")
  debug = check_bool(debug, "debug")

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del params, extra
    real = real_users(user_mask, num_user_slots(updates))
    clipped, finite = clip_rows(updates, max_norm, per_layer=per_layer)
    if user_mask is not None:
      clipped = _scale_rows(clipped, jnp.ones_like(finite, jnp.float32), real)
    dropped = state.dropped
    if debug:  # padded slots are not "dropped" users
      dropped = dropped + jnp.sum(real & ~finite).astype(jnp.int32)
    return clipped, ClipState(dropped=dropped)

  return optax.GradientTransformationExtraArgs(_init_clip_state, update_fn)


def _check_mean(mode: str, denominator) -> float:
  check_choice(mode, "mode", ("mean", "sum"))
  if mode == "sum":
    return 1.0
  if denominator is None:
    raise ValueError("denominator is required for mode='mean' (use the fixed, nominal "
                     "batch size; never the realized count)")
  scale = 1.0 / check_positive(denominator, "denominator")
  if not _traced(scale) and not (math.isfinite(scale) and scale <= _F32_MAX):
    raise ValueError(f"denominator={denominator!r} is so small that 1/denominator overflows "
                     "float32; use the nominal batch size")
  return scale


def _check_bounded(clip_norm, scale, n: int) -> None:
  """Refuses a ``D`` that lets the clipped aggregate (``<= n C / D``) overflow float32."""
  if _traced(clip_norm) or _traced(scale):
    return
  if not float(clip_norm) * float(scale) * n <= _F32_MAX:
    raise ValueError(f"denominator=1/{scale!r} is too small: the aggregate of {n} rows "
                     f"clipped at {clip_norm!r} would overflow float32 (n C / D > 3.4e38); use "
                     "the nominal batch size")


def aggregate(mode: str = "mean", denominator: float | None = None
              ) -> optax.GradientTransformationExtraArgs:
  """Reduces the user axis: the masked sum, or the sum over a fixed ``denominator``.

  ``D`` is the nominal batch size (``q n`` under Poisson sampling), never the realized count,
  which would make the sensitivity data-dependent. The result is float32 or wider.

  Args:
    mode: ``"mean"`` (default) or ``"sum"``.
    denominator: the fixed, nominal denominator ``D`` (> 0), required for ``"mean"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``: stacked ``[U, ...]`` updates in, the
    params-shaped sum (or sum / ``D``) out.
  """
  scale = _check_mean(mode, denominator)

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del params, extra
    n = num_user_slots(updates)
    keep = real_users(user_mask, n)
    return _weighted_row_sum(updates, jnp.full((n,), scale, jnp.float32), keep), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def aggregation_sensitivity(clip_norm: float, *, mode: str = "mean",
                            denominator: float | None = None,
                            relation: str = "add_remove") -> float:
  """L2 sensitivity of ``aggregate`` after clipping: ``C`` (sum) or ``C/D`` (mean), twice
  that under replace-one (:meth:`~dpsco_jax.privacy.Sensitivity.under`).

  Args:
    clip_norm: ``C``, > 0.
    mode: ``"mean"`` (default) or ``"sum"``.
    denominator: ``D`` (> 0), required for ``"mean"``.
    relation: ``add_remove`` (default), ``replace_one`` or ``zero_out``.

  Returns:
    The L2 sensitivity, a float.
  """
  check_positive(clip_norm, "clip_norm")
  check_choice(mode, "mode", ("mean", "sum"))
  check_choice(relation, "relation", RELATIONS)
  denom = check_positive(denominator, "denominator") if mode == "mean" else 1.0
  if not math.isfinite(float(clip_norm) / denom):
    raise ValueError(f"clip_norm / denominator overflows ({clip_norm!r} / {denominator!r})")
  return clipped_mean_sensitivity(float(clip_norm), denom).under(relation)


def clip_and_aggregate(clip_norm: float, mode: str = "mean",
                       denominator: float | None = None, *, per_layer: bool = False,
                       debug: bool = False) -> optax.GradientTransformationExtraArgs:
  """``clip_per_user`` then ``aggregate``, fused (equal to float rounding; sensitivity:
  :func:`aggregation_sensitivity`): row weights ``keep_u min(1, C/||g_u||) / D`` and one
  weighted sum per leaf, no clipped copy of the gradients.

  Args:
    clip_norm: ``C``, the per-user L2 bound, > 0.
    mode: ``"mean"`` (default) or ``"sum"``.
    denominator: the fixed, nominal denominator ``D`` (> 0), required for ``"mean"``.
    per_layer: clip each leaf separately (see :func:`clip_per_user`; default False).
    debug: count non-finite users in the state (default False).

  Returns:
    An ``optax.GradientTransformationExtraArgs``: stacked updates in, the clipped aggregate
    out; its state is :class:`ClipState`.
  """
  if check_bool(per_layer, "per_layer"):
    return optax.chain(clip_per_user(clip_norm, per_layer=True, debug=debug),
                       aggregate(mode, denominator))
  check_positive(clip_norm, "clip_norm")
  debug = check_bool(debug, "debug")
  scale = _check_mean(mode, denominator)

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del params, extra
    n = num_user_slots(updates)
    _check_bounded(clip_norm, scale, n)
    real = real_users(user_mask, n)
    norms = tree_global_norms(updates)
    finite = jnp.isfinite(norms)
    keep = finite & real
    factors = _clip_factors(norms, clip_norm)
    out = _weighted_row_sum(updates, jnp.where(keep, factors * scale, 0.0), keep)
    if debug:
      state = ClipState(dropped=state.dropped + jnp.sum(real & ~finite).astype(jnp.int32))
    return out, state

  return optax.GradientTransformationExtraArgs(_init_clip_state, update_fn)
