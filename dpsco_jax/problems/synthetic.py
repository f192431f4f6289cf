"""Synthetic SCO problems with a known optimum: n users x m items, optional heterogeneity.

Features are uniform on the unit sphere of R^d. User ``u`` has parameter ``w*_u = w* + zeta_u``,
``zeta_u ~ N(0, h^2 I/d)`` (``heterogeneity = h``), ``||w*|| = R/2``. Label noise is integrated
out, so population risks are exact up to the draw of the evaluation features:

* ``least_squares``: ``0.5 (<w,x> - y)^2``, ``y = <w*_u, x> + U[-s, s]``; risk
  ``0.5 (||w - w*||^2 + h^2)/d + s^2/6``, optimum ``w*``.
* ``logistic``: ``softplus(<w,x>) - y <w,x>``, ``y ~ Bernoulli(sigmoid(<w*_u, x>))``; the risk
  uses soft labels, its minimizer is ``w*`` when ``h = 0``, else found by Newton's method.
* ``absolute`` (non-smooth): ``|<w,x> - y|``, ``y = <w*_u,x> + Laplace(s)``; optimum ``w*``.

Each problem reports ``L`` (over the ball; a high-probability bound where the noise is
unbounded), ``beta`` (``inf`` for ``absolute``) and ``R``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax._checks import check_choice, check_int, check_nonnegative, check_positive
from dpsco_jax.config.families import NoisyProblem

PROBLEM_NAMES = ("least_squares", "logistic", "absolute")


@dataclasses.dataclass
class SCOProblem:
  """A synthetic convex problem with a known optimum (:func:`make_problem`).

  Attributes:
    name: the problem's name (``least_squares``, ``logistic``, ``absolute``).
    loss_fn: ``loss_fn(w, example) -> scalar``.
    data: the users' data, leaves ``[n_users, m, ...]``.
    d: the dimension.
    n_users: users.
    m: items per user.
    radius: R, the constraint ball's radius.
    lipschitz: L.
    smoothness: beta (``inf`` for the non-smooth ``absolute``).
    x_opt: the population risk's minimizer.
    risk_fn: the population risk (float32).
    opt_risk: ``risk_fn(x_opt)``.
    meta: problem-specific public facts (e.g. ``strong_convexity``).
    risk_fn64: the population risk in float64, where the problem has one.
  """
  name: str
  loss_fn: Callable[[jax.Array, dict], jax.Array]
  data: dict
  d: int
  n_users: int
  m: int
  radius: float
  lipschitz: float
  smoothness: float
  x_opt: jax.Array
  risk_fn: Callable[[jax.Array], jax.Array]
  opt_risk: float
  meta: dict = dataclasses.field(default_factory=dict)
  risk_fn64: Callable[[np.ndarray], float] | None = None
  _opt_risk64: float | None = dataclasses.field(default=None, init=False, repr=False,
                                                compare=False)

  def population_risk(self, params: Any) -> float:
    """The population risk at ``params``.

    Args:
      params: a vector of length ``d``.

    Returns:
      The risk, a float.
    """
    return float(self.risk_fn(params))

  def excess_risk(self, params: Any) -> float:
    """The population risk at ``params`` less the optimum's (in float32).

    Args:
      params: a vector of length ``d``.

    Returns:
      The excess risk, a float (see :meth:`excess_risk_f64` for its resolution).
    """
    return self.population_risk(params) - self.opt_risk

  def excess_risk_f64(self, params: Any) -> float | None:
    """``risk(params) - risk(x_opt)`` in float64 (None without ``risk_fn64``): the float32
    :meth:`excess_risk` moves in ulps of 6e-8, which is where good runs sit.

    Args:
      params: a vector of length ``d``.

    Returns:
      The excess risk in float64, or None.
    """
    if self.risk_fn64 is None:
      return None
    if self._opt_risk64 is None:
      self._opt_risk64 = float(self.risk_fn64(np.asarray(self.x_opt, np.float64)))
    w = np.asarray(params, np.float64).reshape(-1)
    return float(self.risk_fn64(w)) - self._opt_risk64

  def init_params(self) -> jax.Array:
    """The public starting point.

    Returns:
      Zeros of length ``d`` (float32).
    """
    return jnp.zeros((self.d,), jnp.float32)

  def describe(self) -> dict:
    """The problem's public facts, for records.

    Returns:
      ``{"problem", "n_users", "m", "d", "radius", "lipschitz", "smoothness"}``.
    """
    return {"problem": self.name, "n_users": self.n_users, "m": self.m, "d": self.d,
            "radius": self.radius, "lipschitz": self.lipschitz,
            "smoothness": self.smoothness}


def _sphere(key, shape):
  x = jax.random.normal(key, shape)
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def least_squares_loss(w, ex):
  return 0.5 * jnp.square(jnp.dot(ex["x"], w) - ex["y"])


def logistic_loss(w, ex):
  z = jnp.dot(ex["x"], w)
  return jax.nn.softplus(z) - ex["y"] * z


def absolute_loss(w, ex):
  return jnp.abs(jnp.dot(ex["x"], w) - ex["y"])


def _newton_logistic(x, p, w0, iters=30):
  def step(w, _):
    s = jax.nn.sigmoid(x @ w)
    g = x.T @ (s - p) / x.shape[0]
    h = (x * (s * (1 - s))[:, None]).T @ x / x.shape[0]
    return w - jnp.linalg.solve(h + 1e-9 * jnp.eye(w.shape[0]), g), None
  w, _ = jax.lax.scan(step, w0, None, length=iters)
  return w


def make(name: str, *, n_users: int, m: int, d: int, key: jax.Array,
         radius: float = NoisyProblem.radius, noise: float = NoisyProblem.noise,
         heterogeneity: float = NoisyProblem.heterogeneity,
         n_eval: int = NoisyProblem.n_eval) -> SCOProblem:
  """Builds one of :data:`PROBLEM_NAMES` with the schema's defaults (``NoisyProblem``)."""
  check_choice(name, "problem", PROBLEM_NAMES)
  for v, what in ((n_users, "n_users"), (m, "m"), (d, "d")):
    check_int(v, what)
  check_positive(radius, "radius")
  check_nonnegative(noise, "noise")
  check_nonnegative(heterogeneity, "heterogeneity")
  check_int(n_eval, "n_eval")
  k_plant, k_x, k_noise, k_eval, k_eval_u = jax.random.split(key, 5)
  k_dir, k_het = jax.random.split(k_plant)
  w_star = 0.5 * radius * _sphere(k_dir, (d,))
  w_users = w_star + heterogeneity / math.sqrt(d) * jax.random.normal(k_het, (n_users, d))
  x = _sphere(k_x, (n_users, m, d))
  t = jnp.einsum("umd,ud->um", x, w_users)
  x_eval = _sphere(k_eval, (n_eval, d))
  h, s = float(heterogeneity), float(noise)
  lip_margin = radius + 0.5 * radius + 3.0 * h  # |<w - w*_u, x>| <= R + R/2 + 3h w.h.p.

  if name == "least_squares":
    y = t + s * jax.random.uniform(k_noise, t.shape, minval=-1.0, maxval=1.0)
    risk = jax.jit(lambda w: 0.5 * (jnp.sum(jnp.square(w - w_star)) + h * h) / d
                   + s * s / 6.0)
    ws64 = np.asarray(w_star, np.float64)
    risk64 = lambda w: 0.5 * (float(np.sum(np.square(w - ws64))) + h * h) / d + s * s / 6.0
    return SCOProblem(name, least_squares_loss, {"x": x, "y": y}, d, n_users, m,
                      float(radius), lip_margin + s, 1.0, w_star, risk, float(risk(w_star)),
                      risk_fn64=risk64)

  if name == "logistic":
    y = jax.random.bernoulli(k_noise, jax.nn.sigmoid(t)).astype(jnp.float32)
    if h > 0:
      w_eval_users = w_star + h / math.sqrt(d) * jax.random.normal(k_eval_u, (n_eval, d))
      p = jax.nn.sigmoid(jnp.sum(x_eval * w_eval_users, axis=1))
    else:
      p = jax.nn.sigmoid(x_eval @ w_star)
    risk = jax.jit(lambda w: jnp.mean(jax.nn.softplus(x_eval @ w) - p * (x_eval @ w)))
    w_opt = w_star if h == 0 else _newton_logistic(x_eval, p, w_star)
    # float64: the same features and label probabilities, recomputed
    x64 = np.asarray(x_eval, np.float64)
    z64 = (np.sum(x64 * np.asarray(w_eval_users, np.float64), axis=1) if h > 0
           else x64 @ np.asarray(w_star, np.float64))
    p64 = 1.0 / (1.0 + np.exp(-z64))
    risk64 = lambda w: float(np.mean(np.logaddexp(0.0, x64 @ w) - p64 * (x64 @ w)))
    return SCOProblem(name, logistic_loss, {"x": x, "y": y}, d, n_users, m, float(radius),
                      1.0, 0.25, w_opt, risk, float(risk(w_opt)),
                      meta={"w_star": w_star}, risk_fn64=risk64)

  # absolute
  y = t + s * jax.random.laplace(k_noise, t.shape)
  sc = max(s, 1e-12)
  def risk(w):
    if h > 0:
      zeta = h / math.sqrt(d) * jax.random.normal(k_eval_u, (n_eval, d))
      tt = x_eval @ (w - w_star) - jnp.sum(x_eval * zeta, axis=1)
    else:
      tt = x_eval @ (w - w_star)
    return jnp.mean(jnp.abs(tt) + s * jnp.exp(-jnp.abs(tt) / sc))
  risk = jax.jit(risk)
  return SCOProblem(name, absolute_loss, {"x": x, "y": y}, d, n_users, m, float(radius),
                    1.0, math.inf, w_star, risk, float(risk(w_star)))


def least_squares(**kw) -> SCOProblem:
  return make("least_squares", **kw)


def logistic(**kw) -> SCOProblem:
  return make("logistic", **kw)


def absolute(**kw) -> SCOProblem:
  return make("absolute", **kw)


PROBLEM_KEYS = ("n_users", "m", "d", "radius", "noise", "heterogeneity", "n_eval")


def make_problem(cfg: dict, key: jax.Array) -> SCOProblem:
  """Builds the core problem named by ``cfg['problem']`` from the config's problem keys.

  Args:
    cfg: a config with ``problem`` and the problem keys (``n_users``, ``m``, ``d``,
      ``radius``, ``noise``, ``heterogeneity``, ``n_eval``).
    key: a JAX PRNG key for the data.

  Returns:
    The :class:`SCOProblem`.

  Raises:
    KeyError: ``cfg`` has no ``problem``.
    TypeError: ``cfg`` lacks ``n_users``, ``m`` or ``d``.
  """
  kw = {k: cfg[k] for k in PROBLEM_KEYS if k in cfg}
  return make(cfg["problem"], key=key, **kw)
