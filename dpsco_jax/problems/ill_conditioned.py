"""Paper 003's ill-conditioned least squares: the regime where acceleration pays (the core
problem is isotropic)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax._checks import check_int, check_nonnegative, check_positive
from dpsco_jax.config.families import IllConditionedProblem
from dpsco_jax.problems.synthetic import SCOProblem, least_squares_loss

__all__ = ["ill_conditioned_least_squares"]


def ill_conditioned_least_squares(cfg: dict, key: jax.Array):
  """Least squares with feature spectrum ``logspace(-log10 cond, 0, d)``.

  ``x = r * sqrt(lambda)``, Rademacher ``r``; ``y = <w*, x> + U[-s, s]``, ``||w*|| = R/2``.
  Risk ``0.5 sum_i lambda_i (w - w*)_i^2 + s^2/6``; smoothness ``M = sum lambda``; Lipschitz
  ``sqrt(M)(1.5 R sqrt(M) + s)``.
  """
  view = IllConditionedProblem.of(cfg)
  n = check_int(cfg["n_users"], "n_users")
  m = check_int(view.m, "m")
  d = check_int(view.d, "d")
  R = check_positive(view.radius, "radius")
  s = check_nonnegative(view.noise, "noise")
  cond = check_positive(view.condition, "condition")
  lam = jnp.logspace(-math.log10(cond), 0.0, d)
  k_w, k_x, k_y = jax.random.split(key, 3)
  w_star = jax.random.normal(k_w, (d,))
  w_star = 0.5 * R * w_star / jnp.linalg.norm(w_star)
  x = jax.random.rademacher(k_x, (n, m, d), jnp.float32) * jnp.sqrt(lam)
  y = jnp.einsum("umd,d->um", x, w_star) + s * jax.random.uniform(k_y, (n, m), minval=-1.0,
                                                                   maxval=1.0)
  smooth = float(jnp.sum(lam))
  risk = jax.jit(lambda w: 0.5 * jnp.sum(lam * jnp.square(w - w_star)) + s * s / 6.0)
  return SCOProblem("ill_conditioned_least_squares", least_squares_loss, {"x": x, "y": y}, d,
                    n, m, R, math.sqrt(smooth) * (1.5 * R * math.sqrt(smooth) + s), smooth,
                    w_star, risk, float(risk(w_star)), meta={"spectrum": np.asarray(lam)})

