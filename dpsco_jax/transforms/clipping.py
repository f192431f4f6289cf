"""Per-user clipping and aggregation with a stated sensitivity.

Chain input convention (used by every stage in ``dpsco_jax.transforms``): the updates entering a
DP chain are **stacked per-user gradients**, a pytree whose leaves have a leading user axis
``U`` (one row per user, or per example at item level). :func:`clip_per_user` keeps the axis;
an aggregating stage (:func:`aggregate` here, or the FILTER stage of paper 000) reduces it, so
later stages (noise, prox, step) see ordinary params-shaped pytrees. Padded slots are
identified by the extra argument ``user_mask`` (bool ``[U]``) that ``optax.chain`` forwards.

Sensitivity. After clipping every row to L2 norm ``<= C`` (global norm over the pytree), the
masked sum over users changes by at most ``C`` when one user is added or removed and by at most
``2C`` when one user is replaced by another; dividing by a *fixed* denominator ``D`` (never the
data-dependent count) gives ``C/D`` and ``2C/D``. A user whose gradient contains NaN or Inf is
dropped (contributes exactly zero) — which is itself a bounded change, so the bounds hold for
arbitrary, adversarial inputs.

Reference: Abadi et al. 2016 (DP-SGD); the user-level variant clips the user's mean gradient
(Levy et al. 2021; paper 000 §1).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import check_choice, check_positive

PyTree = Any
RELATIONS = ("add_remove", "replace_one")


def _row_sqnorm(g: jax.Array) -> jax.Array:
  return jnp.sum(jnp.reshape(jnp.square(g), (g.shape[0], -1)), axis=1)


def tree_global_norms(stacked: PyTree) -> jax.Array:
  """L2 norm of each row (leading axis) over all leaves of ``stacked``: shape ``[U]``."""
  return jnp.sqrt(sum(_row_sqnorm(g) for g in jax.tree.leaves(stacked)))


def _weighted_row_sum(stacked: PyTree, weights: jax.Array, keep: jax.Array) -> PyTree:
  """``sum_u weights_u * g_u`` over the leading axis, rows with ``keep_u = False`` excluded.

  Written as one ``tensordot`` per leaf rather than a scaled copy plus ``sum(axis=0)``: XLA:CPU
  (jaxlib 0.10) lowers a reduce over the major axis of a large ``[U, ...]`` array to a fusion
  that is ~50x slower than the equivalent GEMV (``experiments/bench_core.py``), and a dot is
  the natural form on GPU/TPU too. Dropped rows are zeroed with ``where`` first because
  ``0 * NaN = NaN``; the optimization barrier stops XLA from fusing that ``where`` into the
  dot operand (measured faster)."""
  def f(g):
    k = keep.reshape((-1,) + (1,) * (g.ndim - 1))
    safe = jax.lax.optimization_barrier(jnp.where(k, g, jnp.zeros_like(g)))
    return jnp.tensordot(weights.astype(g.dtype), safe, axes=1)
  return jax.tree.map(f, stacked)


def _scale_rows(stacked: PyTree, scale: jax.Array, keep: jax.Array) -> PyTree:
  def f(g):
    s = scale.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)
    k = keep.reshape((-1,) + (1,) * (g.ndim - 1))
    return jnp.where(k, g * s, jnp.zeros_like(g))
  return jax.tree.map(f, stacked)


def clip_rows(stacked: PyTree, max_norm: float | jax.Array, *,
              per_layer: bool = False) -> tuple[PyTree, jax.Array]:
  """Clips every row to L2 norm ``<= max_norm``; non-finite rows become zero.

  ``per_layer=True`` clips each leaf separately at ``max_norm / sqrt(num_leaves)`` so the
  global norm stays ``<= max_norm`` (same sensitivity, different bias).

  Returns ``(clipped, finite)`` where ``finite`` is the bool ``[U]`` mask of kept rows.
  """
  # a row with NaN/Inf entries has a non-finite norm (so does a finite row whose squared norm
  # overflows: dropping it is still a change of norm <= C, the sensitivity is unchanged)
  norms = tree_global_norms(stacked)
  finite = jnp.isfinite(norms)
  leaves, treedef = jax.tree.flatten(stacked)
  if per_layer:
    c = max_norm / jnp.sqrt(float(len(leaves)))
    out = []
    for g in leaves:
      norm = jnp.sqrt(_row_sqnorm(g))
      scale = jnp.minimum(1.0, c / jnp.maximum(norm, 1e-30))
      out.append(_scale_rows(g, scale, finite))
    return jax.tree.unflatten(treedef, out), finite
  return _scale_rows(stacked, _clip_factors(norms, max_norm), finite), finite


def _clip_factors(norms: jax.Array, max_norm) -> jax.Array:
  return jnp.minimum(1.0, max_norm / jnp.maximum(jnp.where(jnp.isfinite(norms), norms, 1.0),
                                                 1e-30))


class ClipState(NamedTuple):
  """``dropped`` counts non-finite users; it is data-dependent, so it stays 0 unless the
  transformation was built with ``debug=True``."""
  dropped: jax.Array


def clip_per_user(max_norm: float, *, per_layer: bool = False,
                  debug: bool = False) -> optax.GradientTransformationExtraArgs:
  """Clips each user's (row's) gradient to global L2 norm ``<= max_norm``.

  ``g_u <- g_u * min(1, C / ||g_u||_2)``; rows with NaN/Inf become 0 (dropped). Keeps the
  leading user axis. Masked (padded) users are zeroed as well.
  """
  check_positive(max_norm, "max_norm")

  def init_fn(params):
    del params
    return ClipState(dropped=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del params, extra
    clipped, finite = clip_rows(updates, max_norm, per_layer=per_layer)
    if user_mask is not None:
      chex.assert_shape(user_mask, finite.shape)
      clipped = _scale_rows(clipped, jnp.ones_like(finite, jnp.float32), user_mask)
      finite = finite | ~user_mask  # padded slots are not "dropped" users
    dropped = state.dropped + (jnp.sum(~finite).astype(jnp.int32) if debug else 0)
    return clipped, ClipState(dropped=dropped)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def aggregate(mode: str = "mean", denominator: float | None = None
              ) -> optax.GradientTransformationExtraArgs:
  """Reduces the leading user axis: masked sum, or sum divided by a fixed ``denominator``.

  ``mode="mean"`` requires ``denominator`` (the nominal batch size, e.g. ``q*n`` under Poisson
  sampling or ``K`` for fixed-size batches): dividing by the realized count would make the
  denominator itself data-dependent and break the sensitivity bound.
  """
  check_choice(mode, "mode", ("mean", "sum"))
  if mode == "mean":
    if denominator is None:
      raise ValueError("denominator is required for mode='mean' (use the fixed, nominal "
                       "batch size; never the realized count)")
    check_positive(denominator, "denominator")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del params, extra
    n = _num_rows(updates)
    keep = jnp.ones((n,), bool) if user_mask is None else user_mask
    scale = 1.0 / denominator if mode == "mean" else 1.0
    return _weighted_row_sum(updates, jnp.full((n,), scale, jnp.float32), keep), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def aggregation_sensitivity(clip_norm: float, *, mode: str = "mean",
                            denominator: float | None = None,
                            relation: str = "add_remove") -> float:
  """L2 sensitivity of ``aggregate`` after clipping at ``clip_norm``.

  add/remove one user: ``C`` (sum) or ``C/D`` (mean); replace one user: twice that.
  """
  check_positive(clip_norm, "clip_norm")
  check_choice(mode, "mode", ("mean", "sum"))
  check_choice(relation, "relation", RELATIONS)
  sens = float(clip_norm)
  if mode == "mean":
    sens /= check_positive(denominator, "denominator")
  return 2.0 * sens if relation == "replace_one" else sens


def clip_and_aggregate(clip_norm: float, mode: str = "mean",
                       denominator: float | None = None, *, per_layer: bool = False,
                       debug: bool = False) -> optax.GradientTransformationExtraArgs:
  """``clip_per_user`` followed by ``aggregate``, fused; sensitivity via
  :func:`aggregation_sensitivity` with the same arguments.

  One norm pass gives row weights ``w_u = keep_u min(1, C/||g_u||) / D`` and one weighted sum
  per leaf produces the aggregate: no clipped copy of the ``[U, ...]`` gradients is written.
  Equal (to float rounding) to ``optax.chain(clip_per_user(C), aggregate(mode, D))``; the
  state is :class:`ClipState`."""
  if per_layer:
    return optax.chain(clip_per_user(clip_norm, per_layer=True, debug=debug),
                       aggregate(mode, denominator))
  check_positive(clip_norm, "clip_norm")
  aggregate(mode, denominator)  # validates mode / denominator
  scale = 1.0 / denominator if mode == "mean" else 1.0

  def init_fn(params):
    del params
    return ClipState(dropped=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, *, user_mask=None, **extra):
    del params, extra
    norms = tree_global_norms(updates)
    finite = jnp.isfinite(norms)
    keep = finite if user_mask is None else finite & user_mask
    weights = jnp.where(keep, _clip_factors(norms, clip_norm) * scale, 0.0)
    out = _weighted_row_sum(updates, weights, keep)
    if debug:
      real = jnp.ones_like(finite) if user_mask is None else user_mask
      state = ClipState(dropped=state.dropped + jnp.sum(real & ~finite).astype(jnp.int32))
    return out, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _num_rows(stacked: PyTree) -> int:
  sizes = {g.shape[0] for g in jax.tree.leaves(stacked)}
  if len(sizes) != 1:
    raise ValueError(f"stacked leaves disagree on the user axis: {sorted(sizes)}")
  return sizes.pop()
