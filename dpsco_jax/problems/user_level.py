"""Paper 000's experiment problems: corrupted users and a non-smooth hinge SVM (they build
data, they release nothing)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax._checks import check_choice
from dpsco_jax.config.families import CorruptedLogisticProblem, HingeProblem
from dpsco_jax.problems.synthetic import SCOProblem, make as make_core_problem, make_problem

__all__ = ["corrupt_users", "hinge_loss", "hinge_problem", "logistic_corrupted", "hinge"]


def corrupt_users(problem: SCOProblem, fraction: float, *,
                  mode: str = CorruptedLogisticProblem.corruption_mode, key: jax.Array,
                  scale: float = CorruptedLogisticProblem.corruption_scale) -> SCOProblem:
  """A copy of ``problem`` whose random ``floor(fraction n)`` users are adversarial: ``flip``
  (labels flipped), ``huge`` (features times ``scale``) or ``random`` (random ``scale``-norm
  features and labels). Risk and optimum stay the clean population's."""
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"fraction must lie in [0, 1), got {fraction}")
  check_choice(mode, "mode", ("flip", "huge", "random"))
  n = problem.n_users
  k = int(math.floor(fraction * n))
  bad = np.zeros(n, bool)
  bad[np.asarray(jax.random.permutation(key, n))[:k]] = True
  badj = jnp.asarray(bad)
  x, y = problem.data["x"], problem.data["y"]
  sel = lambda a, b: jnp.where(badj.reshape((-1,) + (1,) * (a.ndim - 1)), b, a)
  binary = bool(jnp.all((y == 0) | (y == 1)))
  if mode == "flip":
    y2 = sel(y, 1.0 - y if binary else -y)
    x2 = x
  elif mode == "huge":
    x2, y2 = sel(x, scale * x), y
  else:
    kx, ky = jax.random.split(jax.random.fold_in(key, 1))
    g = jax.random.normal(kx, x.shape)
    x2 = sel(x, scale * g / jnp.linalg.norm(g, axis=-1, keepdims=True))
    y2 = sel(y, jax.random.bernoulli(ky, 0.5, y.shape).astype(y.dtype) if binary
             else jax.random.normal(ky, y.shape))
  meta = dict(problem.meta, corrupted_fraction=k / n, corruption_mode=mode)
  return dataclasses.replace(problem, name=f"{problem.name}_corrupted", data={"x": x2, "y": y2},
                             meta=meta)


def hinge_loss(w: jax.Array, ex: dict) -> jax.Array:
  return jax.nn.relu(1.0 - ex["y"] * jnp.dot(ex["x"], w))


def hinge_problem(*, n_users: int, m: int, d: int, key: jax.Array,
                  radius: float = HingeProblem.radius,
                  n_eval: int = HingeProblem.n_eval) -> SCOProblem:
  """Non-smooth linear SVM (hinge loss, ``L = 1``) on the core logistic data model, labels in
  {-1, 1}. The risk integrates the label noise; its minimizer is exact by linear programming
  (HiGHS), and an optimum outside the ``R``-ball raises."""
  from scipy.optimize import linprog
  base = make_core_problem("logistic", n_users=n_users, m=m, d=d, key=key, radius=radius,
                           n_eval=n_eval)
  k_eval = jax.random.fold_in(key, 7)
  xe = jax.random.normal(k_eval, (n_eval, d))
  xe = xe / jnp.linalg.norm(xe, axis=1, keepdims=True)
  w_star = base.meta["w_star"]
  p = jax.nn.sigmoid(xe @ w_star)
  xn, pn = np.asarray(xe, np.float64), np.asarray(p, np.float64)
  # variables [w (d), u (n), v (n)]: u >= 1 - t, v >= 1 + t, u, v >= 0
  from scipy import sparse
  ne = n_eval
  cost = np.concatenate([np.zeros(d), pn / ne, (1 - pn) / ne])
  eye, zero = sparse.identity(ne, format="csr"), sparse.csr_matrix((ne, ne))
  a_ub = sparse.vstack([sparse.hstack([sparse.csr_matrix(-xn), -eye, zero]),
                        sparse.hstack([sparse.csr_matrix(xn), zero, -eye])], format="csr")
  sol = linprog(cost, A_ub=a_ub, b_ub=-np.ones(2 * ne),
                bounds=[(None, None)] * d + [(0, None)] * (2 * ne), method="highs")
  if not sol.success:
    raise RuntimeError(f"hinge optimum LP failed: {sol.message}")
  w_opt = jnp.asarray(sol.x[:d], jnp.float32)
  if float(jnp.linalg.norm(w_opt)) > radius:
    raise ValueError(f"radius={radius} is smaller than the hinge optimum's norm "
                     f"{float(jnp.linalg.norm(w_opt)):.3g}")

  def risk(w):
    t = xe @ w
    return jnp.mean(p * jax.nn.relu(1 - t) + (1 - p) * jax.nn.relu(1 + t))
  risk = jax.jit(risk)
  y_pm = 2.0 * base.data["y"] - 1.0
  return dataclasses.replace(base, name="hinge", loss_fn=hinge_loss,
                             data={"x": base.data["x"], "y": y_pm}, lipschitz=1.0,
                             smoothness=math.inf, x_opt=w_opt, risk_fn=risk,
                             opt_risk=float(risk(w_opt)), meta={"w_star": w_star})


def logistic_corrupted(cfg: dict, key: jax.Array) -> SCOProblem:
  """Factory of ``logistic_corrupted`` (:func:`corrupt_users` on the core logistic problem)."""
  k_prob, k_bad = jax.random.split(key)
  base = make_problem({**cfg, "problem": "logistic"}, k_prob)
  view = CorruptedLogisticProblem.of(cfg)
  return corrupt_users(base, float(view.corruption), mode=view.corruption_mode, key=k_bad,
                       scale=float(view.corruption_scale))


def hinge(cfg: dict, key: jax.Array) -> SCOProblem:
  """Factory of ``hinge`` (:func:`hinge_problem`)."""
  return hinge_problem(key=key, **{k: cfg[k] for k in ("n_users", "m", "d", "radius", "n_eval")
                                   if k in cfg})

