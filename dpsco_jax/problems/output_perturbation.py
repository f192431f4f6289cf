"""Paper 001's strongly convex problem ``l2_logistic``: L2-regularized logistic regression."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dpsco_jax._checks import check_positive
from dpsco_jax.cache import bounded_cache
from dpsco_jax.config.families import L2LogisticProblem
from dpsco_jax.problems.synthetic import SCOProblem, make_problem
from dpsco_jax.transforms.steps import project_l2_ball

__all__ = ["l2_logistic", "l2_regularized_loss"]


def l2_logistic(cfg: dict, key: jax.Array) -> SCOProblem:
  """The core logistic problem plus ``(l2/2)||θ||²`` per item: Lipschitz ``1 + l2 R``,
  smoothness ``1/4 + l2``, strong convexity ``l2``; excess risk on the regularised risk."""
  l2 = check_positive(L2LogisticProblem.of(cfg).l2, "l2")
  base = make_problem({**cfg, "problem": "logistic"}, key)
  R = base.radius
  loss = l2_regularized_loss(base.loss_fn, l2)
  risk0 = base.risk_fn
  risk = jax.jit(lambda w: risk0(w) + 0.5 * l2 * jnp.sum(jnp.square(w)))
  w = _regularized_optimum(risk, jnp.asarray(base.x_opt, jnp.float32), R, 0.25 + l2)
  return dataclasses.replace(base, name="l2_logistic", loss_fn=loss,
                             lipschitz=float(base.lipschitz + l2 * R),
                             smoothness=float(base.smoothness + l2), x_opt=w, risk_fn=risk,
                             opt_risk=float(risk(w)),
                             meta={**(base.meta or {}), "strong_convexity": l2, "l2": l2})


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _regularized_optimum(risk, w0, radius, smoothness):
  """Newton's method (interior optimum) then projected gradient (active ball), jitted."""
  grad, hess = jax.grad(risk), jax.hessian(risk)
  w = jax.lax.fori_loop(0, 30, lambda _, w: w - jnp.linalg.solve(hess(w), grad(w)), w0)
  w = project_l2_ball(w, radius)
  return jax.lax.fori_loop(
      0, 300, lambda _, w: project_l2_ball(w - grad(w) / smoothness, radius), w)


@bounded_cache()
def l2_regularized_loss(loss_fn, l2: float):
  """``loss_fn(w, ex) + (l2/2)||w||²``; cached: one function object per ``(loss_fn, l2)``
  (jit caches key on it)."""
  def loss(w, ex):
    return loss_fn(w, ex) + 0.5 * l2 * jnp.sum(jnp.square(w))
  return loss


