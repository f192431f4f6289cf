"""Projection and optimizer steps whose query point may differ from the released iterate.

``update(g, state, params)`` gets the gradient at ``params`` (the *query point*) and returns
``x_next - params``; a released iterate that differs from it (averaging, AC-SA's ``x_ag``,
SRGD's ``y``) lives in the state field ``released`` (:func:`released_params`). All of it
post-processes privatized gradients (paper 000 §2.4, paper 003 §7.2).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import check_int, check_nonnegative, check_positive
from dpsco_jax.transforms.noise import noise_dtype

PyTree = Any
Schedule = Callable[[jax.Array], jax.Array]


def _wide(x: jax.Array) -> jax.Array:
  return x.astype(noise_dtype(x.dtype))


def tree_l2_norm(tree: PyTree) -> jax.Array:
  """Global L2 norm over all leaves (``optax.tree.norm``) in float32 or wider.

  Args:
    tree: a pytree of arrays.

  Returns:
    The norm, a float32 (or wider) scalar.
  """
  return optax.tree.norm(jax.tree.map(_wide, tree))


def cast_like(tree: PyTree, ref: PyTree) -> PyTree:
  """``tree`` with the dtypes of ``ref`` (iterates keep the params' dtype)."""
  return jax.tree.map(lambda x, r: x.astype(jnp.result_type(r)), tree, ref)


def _toward_center(x: jax.Array, dtype, c: jax.Array | None) -> jax.Array:
  """``x`` cast to ``dtype``; a bfloat16/float16 coordinate that rounding moved away from
  ``c`` (default 0) is stepped one ulp back toward it, so the cast never lengthens ``x - c``
  (rounding to nearest put projected low-precision points ~0.5% outside the ball)."""
  y = x.astype(dtype)
  if not (jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32):
    return y
  w = _wide(x)
  cw = jnp.zeros((), w.dtype) if c is None else _wide(c).astype(w.dtype)
  away = jnp.abs(y.astype(w.dtype) - cw) > jnp.abs(w - cw)
  return jnp.where(away, jnp.nextafter(y, jnp.broadcast_to(cw, y.shape).astype(dtype)), y)


def cast_into_ball(tree: PyTree, ref: PyTree, center: PyTree | None = None) -> PyTree:
  """:func:`cast_like`, a bfloat16/float16 leaf rounded toward ``center`` (default 0): a
  point inside the ball stays inside once cast (when ``center`` is representable in ``ref``'s
  dtype; else to within its rounding)."""
  if center is None:
    return jax.tree.map(lambda x, r: _toward_center(x, jnp.result_type(r), None), tree, ref)
  return jax.tree.map(lambda x, r, c: _toward_center(x, jnp.result_type(r), c), tree, ref,
                      center)


# Guarantees rest on ``||x - c|| <= R``, but ``c + (v - c) R / ||v - c||`` in float32 can land
# a few ulps outside: projected points go on the sphere ``R' = R (1 - 2^-20) - 2 eps sqrt(D)
# max|c|`` (rounding of norm, division, product, and of ``c + d``).
_PROJ_MARGIN = 2.0 ** -20


def _centre_slack(center: PyTree | None) -> jax.Array | float:
  if center is None:
    return 0.0
  leaves = [_wide(c) for c in jax.tree.leaves(center)]
  size = sum(int(c.size) for c in leaves)
  biggest = jnp.max(jnp.stack([jnp.max(jnp.abs(c)) if c.size else jnp.zeros((), c.dtype)
                               for c in leaves]))
  eps = jnp.finfo(biggest.dtype).eps
  return 2.0 * eps * (size ** 0.5) * biggest


def project_l2_ball(tree: PyTree, radius: float | jax.Array | None,
                    center: PyTree | None = None, *, like: PyTree | None = None) -> PyTree:
  """Euclidean projection onto ``{x : ||x - center||_2 <= radius}`` (global norm), onto a
  radius ``R'`` slightly below ``R`` so that the float32 result is inside the ball; computed
  in float32 or wider, a bfloat16/float16 result rounded toward the center.

  Args:
    tree: the point (a pytree).
    radius: the ball's radius, or ``None`` (no projection).
    center: the ball's center (default 0).
    like: the tree whose dtypes the result takes (default: those of ``tree - center``).

  Returns:
    The projected pytree.
  """
  if radius is None:
    return tree if like is None else cast_like(tree, like)
  if center is None:
    dtypes = jax.tree.map(jnp.result_type, tree)
    diff = jax.tree.map(_wide, tree)
  else:
    dtypes = jax.tree.map(jnp.result_type, tree, center)
    diff = jax.tree.map(lambda x, c: _wide(x) - _wide(c), tree, center)
  if like is not None:
    dtypes = jax.tree.map(jnp.result_type, like)
  norm = tree_l2_norm(diff)
  target = jnp.maximum(radius * (1.0 - _PROJ_MARGIN) - _centre_slack(center), 0.0)
  scale = jnp.where(norm > target, target / jnp.maximum(norm, 1e-30), 1.0)
  if center is None:
    return jax.tree.map(lambda d, t: _toward_center(d * scale.astype(d.dtype), t, None),
                        diff, dtypes)
  return jax.tree.map(lambda c, d, t: _toward_center(_wide(c) + d * scale.astype(d.dtype), t, c),
                      center, diff, dtypes)


def _lerp(a: PyTree, b: PyTree, w: jax.Array) -> PyTree:  # (1 - w) a + w b
  return jax.tree.map(lambda x, y: x + w.astype(x.dtype) * (y - x), a, b)


def projection(radius: float, center: PyTree | None = None
               ) -> optax.GradientTransformationExtraArgs:
  """Turns an additive update into ``Pi(params + u) - params`` (projected step).

  Args:
    radius: the ball's radius, > 0.
    center: the ball's center (default 0).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``.
  """
  check_positive(radius, "radius")

  def update_fn(updates, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError("projection needs params")
    new = project_l2_ball(optax.apply_updates(params, updates), radius, center, like=params)
    return optax.tree.sub(new, params), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


class ProjectedSGDState(NamedTuple):
  """The state of :func:`projected_sgd`.

  Attributes:
    count: the steps taken (int32).
    released: the released iterate (the last, or the running mean).
  """
  count: jax.Array
  released: PyTree


def projected_sgd(learning_rate: float | Schedule, *, radius: float | None = None,
                  center: PyTree | None = None, averaging: str = "none"
                  ) -> optax.GradientTransformationExtraArgs:
  """Projected SGD ``x_{t+1} = Pi(x_t - eta_t g_t)``; ``released`` is the last iterate or the
  running mean of ``x_1..x_t`` (paper 000 Alg. 1 subroutine SGD, paper 004 DP-Loc-GD).

  Args:
    learning_rate: ``eta`` (> 0) or an optax schedule ``step -> eta``.
    radius: the constraint ball's radius (default ``None``: unconstrained).
    center: the ball's center (default 0).
    averaging: ``"none"`` (default) or ``"uniform"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`ProjectedSGDState`;
    ``update`` needs ``params``.
  """
  if not callable(learning_rate):
    check_positive(learning_rate, "learning_rate")
  if radius is not None:
    check_positive(radius, "radius")
  if averaging not in ("none", "uniform"):
    raise ValueError(f"averaging must be 'none' or 'uniform', got {averaging!r}")

  def init_fn(params):
    return ProjectedSGDState(count=jnp.zeros((), jnp.int32), released=params)

  def update_fn(updates, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError("projected_sgd needs params")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    new = project_l2_ball(jax.tree.map(lambda x, g: x - lr * g, params, updates), radius,
                          center, like=params)
    count = state.count + 1
    released = (_lerp(state.released, new, 1.0 / count.astype(jnp.float32))
                if averaging == "uniform" else new)
    return optax.tree.sub(new, params), ProjectedSGDState(count=count, released=released)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class AcsaState(NamedTuple):
  """The state of :func:`acsa`.

  Attributes:
    count: iterations done in the current stage.
    stage: completed restarts.
    x: ``x_{t-1}``, the prox sequence.
    released: ``x_ag_{t-1}``, the output sequence.
  """
  count: jax.Array
  stage: jax.Array
  x: PyTree
  released: PyTree


def _acsa_coeffs(t: jax.Array, gamma: float):
  """``alpha_t = 2/(t+1)``, ``gamma_t = 4 gamma/(t(t+1))`` (EXT A.3a)."""
  t = t.astype(jnp.float32)
  return 2.0 / (t + 1.0), 4.0 * gamma / (t * (t + 1.0))


def acsa(smoothness: float, *, strong_convexity: float = 0.0, radius: float | None = None,
         center: PyTree | None = None, stage_length: int | None = None,
         gamma: float | None = None) -> optax.GradientTransformationExtraArgs:
  """AC-SA (Ghadimi & Lan 2012), Euclidean, with optional projection and multi-stage restarts.

  ``params`` is the query point ``x_md_t``. With ``alpha_t = 2/(t+1)``, ``gamma_t = 4
  gamma/(t(t+1))`` (EXT A.3(a)) and ``mu`` = ``strong_convexity``:

      s_t    = a mu/(mu+g) x_md + (1 - a mu/(mu+g)) x_{t-1}
      x_t    = Pi_X(s_t - a/(mu+g) G_t)
      x_ag_t = a x_t + (1 - a) x_ag_{t-1}
      c      = (1-a')(mu+g') / (g' + (1-a'^2) mu)        (next-step a', g')
      x_md   = c x_ag_t + (1 - c) x_t

  (EXT spec A.2; the weights sum to one, unlike the printed ReSQue Alg. 2). With
  ``stage_length`` it restarts from ``x_ag`` every ``stage_length`` iterations (multi-stage,
  GL13; EXT A.4: ``ceil(4 sqrt(2 L / mu))``).

  Args:
    smoothness: ``L``, > 0.
    strong_convexity: ``mu``, >= 0 (default 0).
    radius: the constraint ball's radius (default ``None``: unconstrained).
    center: the ball's center (default 0).
    stage_length: iterations per stage of the multi-stage restart (default ``None``: none).
    gamma: the step parameter ``gamma`` (default ``L``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`AcsaState`;
    ``update`` needs ``params``.
  """
  check_positive(smoothness, "smoothness")
  mu = check_nonnegative(strong_convexity, "strong_convexity")
  gam0 = smoothness if gamma is None else check_positive(gamma, "gamma")
  if radius is not None:
    check_positive(radius, "radius")
  if stage_length is not None:
    check_int(stage_length, "stage_length", minimum=1)

  def init_fn(params):
    return AcsaState(count=jnp.zeros((), jnp.int32), stage=jnp.zeros((), jnp.int32),
                     x=params, released=params)

  def update_fn(updates, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError("acsa needs params (the query point x_md)")
    t = state.count + 1
    a, g = _acsa_coeffs(t, gam0)
    w = a * mu / (mu + g)
    s = _lerp(state.x, params, w)
    step = a / (mu + g)
    x_new = project_l2_ball(jax.tree.map(lambda si, gi: si - step * gi, s, updates), radius,
                            center, like=params)
    x_ag = _lerp(state.released, x_new, a)
    restart = jnp.zeros((), bool) if stage_length is None else t >= stage_length
    count = jnp.where(restart, 0, t)
    x_prev = jax.tree.map(lambda ag, xn: jnp.where(restart, ag, xn), x_ag, x_new)
    a2, g2 = _acsa_coeffs(count + 1, gam0)
    c = (1.0 - a2) * (mu + g2) / (g2 + (1.0 - a2 * a2) * mu)
    x_md = cast_like(_lerp(x_prev, x_ag, c), params)
    new_state = AcsaState(count=count, stage=state.stage + restart.astype(jnp.int32),
                          x=x_prev, released=x_ag)
    return optax.tree.sub(x_md, params), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class ProxToAnchorState(NamedTuple):
  """The state of :func:`add_prox_to_anchor`.

  Attributes:
    anchor: the anchor point.
  """
  anchor: PyTree


def add_prox_to_anchor(lam: float, anchor: PyTree | None = None
                       ) -> optax.GradientTransformationExtraArgs:
  """Adds ``lam * (params - anchor)`` (paper 000 Alg. 3, paper 001 Alg. 3), after the noise.

  Args:
    lam: ``lambda``, >= 0.
    anchor: the anchor point (default ``None``: the params given to ``init``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is :class:`ProxToAnchorState`;
    ``update`` needs ``params``.
  """
  check_nonnegative(lam, "lam")

  def init_fn(params):
    return ProxToAnchorState(anchor=params if anchor is None else anchor)

  def update_fn(updates, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError("add_prox_to_anchor needs params")
    out = jax.tree.map(lambda u, p, a: u + lam * (p - a), updates, params, state.anchor)
    return out, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_released(state: Any) -> Any:
  if "released" in getattr(state, "_fields", ()):
    return state.released
  if not isinstance(state, (tuple, list)):
    return None
  for child in reversed(state):  # the step stage is last in a chain
    found = _find_released(child)
    if found is not None:
      return found
  return None


def released_params(opt_state: Any, params: PyTree) -> PyTree:
  """The chain's released iterate: the last stage state's ``released``, else ``params``.

  Args:
    opt_state: the chain's state.
    params: the current params.

  Returns:
    The released iterate (a params pytree).
  """
  found = _find_released(opt_state)
  return params if found is None else found
