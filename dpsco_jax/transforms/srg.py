"""Stochastic recursive gradients (SRG) and the accelerated projected (y, z, x) step.

Paper 003 (Choquette-Choo, Ganesh, Thakurta 2024), Algorithm 1; spec 003 §2.2 and §7.2.

SRG differences (Alg. 1 line 4): ``delta_t(d) = eta_t grad f(x_t, d) - eta_{t-1} grad
f(x_{t-1}, d)``, ``eta_t = t + 1`` (AMBIG-1). The chain clips each *difference* (spec §3.4: the
one changed increment moves by ``C/B`` for any loss), averages over a fixed denominator, and a
prefix-sum noise stage releases ``g_hat_t``; ``grad~_t = g_hat_t / eta_t`` (line 5,
:func:`scale_by_srg_weight`) is unbiased for ``grad F(x_t)`` (the sum telescopes).

The accelerated step (Alg. 1 lines 7–9, with ``b_t = -N_t/beta``, spec §2.2 / AMBIG-5):

    z_{t+1} = Pi_C(z_t - z_scale * (eta_t / beta) grad~_t)
    y_{t+1} = Pi_C(x_t - grad~_t / beta)
    x_{t+1} = (1 - tau_{t+1}) y_{t+1} + tau_{t+1} z_{t+1},   tau_{t+1} = 2/(t+3)  (AMBIG-3)

``z_scale = 1`` is the literal line 7; Lemma 5.2's proof is consistent with ``0.5`` and
``0.25`` (AMBIG-4). The released model is ``y_T`` (``released``); ``params`` is ``x_t``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpsco_jax._checks import _traced, check_nonnegative, check_positive
from dpsco_jax.grads import per_example_grads, per_user_grads_two_points
from dpsco_jax.transforms.steps import cast_into_ball, cast_like, project_l2_ball

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


def srg_weight(step: jax.Array | int) -> jax.Array:
  """``eta_t = t + 1`` (0-indexed; Eq. 19, AMBIG-1)."""
  return jnp.asarray(step, jnp.float32) + 1.0


def coupling_weight(step: jax.Array | int) -> jax.Array:
  """``tau_t = eta_t / eta_{0:t} = 2/(t+2)`` (so ``tau_0 = 1``)."""
  return 2.0 / (jnp.asarray(step, jnp.float32) + 2.0)


def srg_differences(loss_fn: LossFn, params: PyTree, prev_params: PyTree, batch: PyTree,
                    step: jax.Array | int, *, per_example: bool = False,
                    **grad_kwargs) -> PyTree:
  """Stacked ``delta_t(d) = (t+1) grad f(x_t, d) - t grad f(x_{t-1}, d)`` (Alg. 1 line 4).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar``.
    params: ``x_t``, the current query point.
    prev_params: ``x_{t-1}`` (irrelevant at ``t = 0``, where its weight is 0).
    batch: leaves ``[U, m, ...]`` (users x items; item level is ``m = 1``), or ``[B, ...]``
      with ``per_example=True``.
    step: ``t`` (may be traced).
    per_example: ``batch`` is ``[B, ...]`` examples, one gradient each (default False).
    **grad_kwargs: forwarded to :func:`~dpsco_jax.grads.per_user_grads_two_points`
      (``user_mask``, ``chunk_size``); masked users give exactly 0.

  Returns:
    A params-shaped pytree with a leading user/example axis, ready for ``clip_per_user``.
  """
  if per_example:
    if grad_kwargs:
      raise ValueError(f"per_example=True accepts no extra arguments, got {sorted(grad_kwargs)}")
    g_now = per_example_grads(loss_fn, params, batch)
    g_prev = per_example_grads(loss_fn, prev_params, batch)
  else:
    g_now, g_prev = per_user_grads_two_points(loss_fn, params, prev_params, batch,
                                              **grad_kwargs)
  t = jnp.asarray(step, jnp.float32)
  return jax.tree.map(lambda a, b: (t + 1.0).astype(a.dtype) * a - t.astype(b.dtype) * b,
                      g_now, g_prev)


class ScaleBySRGWeightState(NamedTuple):
  count: jax.Array


def scale_by_srg_weight() -> optax.GradientTransformationExtraArgs:
  """``grad~_t = g_hat_t / eta_t`` with ``eta_t = t + 1`` (Alg. 1 line 5).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (state: the step count).
  """
  def update_fn(updates, state, params=None, **extra):
    del params, extra
    inv = 1.0 / srg_weight(state.count)
    out = jax.tree.map(lambda u: u * inv.astype(u.dtype), updates)
    return out, ScaleBySRGWeightState(count=state.count + 1)

  return optax.GradientTransformationExtraArgs(
      lambda params: ScaleBySRGWeightState(count=jnp.zeros((), jnp.int32)), update_fn)


class AcceleratedStepState(NamedTuple):
  """``z``: the aggressive (mirror-descent) sequence; ``released``: ``y_t``, the output."""
  count: jax.Array
  z: PyTree
  released: PyTree


def accelerated_projected_step(beta: float, *, radius: float | None = None,
                               center: PyTree | None = None, z_scale: float = 1.0
                               ) -> optax.GradientTransformationExtraArgs:
  """The (y, z, x) step of Algorithm 1 (lines 7–9) fed with ``grad~_t``.

  Args:
    beta: inverse step size; the analysis needs ``beta >= M`` (Thm 5.1), and
      ``beta >= 2 M T`` for the no-assumption sensitivity bound (Lemma 5.9).
    radius: ``C = B(center, radius)`` (``None``: unconstrained; the paper's C is bounded).
    center: ball center (default 0; ``x_0`` must lie in C).
    z_scale: multiplier of the z step (1.0 literal line 7; 0.5 proof-consistent; AMBIG-4).

  Returns:
    An ``optax.GradientTransformationExtraArgs``: ``init`` sets ``y_0 = z_0 = x_0 = params``
    (AMBIG-2); ``update`` needs ``params`` (``x_t``) and returns ``x_{t+1} - x_t``.
  """
  beta = check_positive(beta, "beta")
  z_scale = check_z_scale(z_scale)
  if radius is not None:
    check_positive(radius, "radius")

  def init_fn(params):
    return AcceleratedStepState(count=jnp.zeros((), jnp.int32), z=params, released=params)

  def update_fn(updates, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError("accelerated_projected_step needs params (the query point x_t)")
    eta = srg_weight(state.count)
    z_step = z_scale * eta / beta
    z = project_l2_ball(jax.tree.map(lambda zi, g: zi - z_step.astype(g.dtype) * g,
                                     state.z, updates), radius, center)
    y = project_l2_ball(jax.tree.map(lambda x, g: x - g / beta, params, updates),
                        radius, center)
    tau = coupling_weight(state.count + 1)
    x_next = jax.tree.map(lambda yi, zi: yi + tau.astype(yi.dtype) * (zi - yi), y, z)
    z, y = ((t if radius is None else cast_into_ball(t, params, center)) for t in (z, y))
    z, y, x_next = (cast_like(t, params) for t in (z, y, x_next))
    disp = optax.tree.sub(x_next, params)
    return disp, AcceleratedStepState(count=state.count + 1, z=z, released=y)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_z_scale(z_scale: float) -> float:
  """``z_scale`` in ``(0, 1]``: above 1 is outside every reading of AMBIG-4."""
  z_scale = check_nonnegative(z_scale, "z_scale")
  # traced under optax.inject_hyperparams + jit: checked by the caller while concrete
  if not _traced(z_scale) and not 0.0 < z_scale <= 1.0:
    raise ValueError(f"z_scale must lie in (0, 1] (1.0 literal Alg. 1 line 7, 0.5 "
                     f"proof-consistent), got {z_scale!r}")
  return z_scale
