"""Basic noise samplers and closed-form calibrations (paper-formula side of the ledger).

The accountant (``ledger.py``) is the primary source of (epsilon, delta); these closed forms
are what the papers state and are reported beside the accountant's numbers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpsco_jax._checks import check_delta, check_epsilon, check_positive


def laplace(key: jax.Array, shape: tuple[int, ...] = (), scale: float | jax.Array = 1.0,
            dtype=jnp.float32) -> jax.Array:
  """``Lap(scale)`` draws: density ``exp(-|x|/b)/(2b)``; ``scale/sensitivity`` = 1/epsilon."""
  return scale * jax.random.laplace(key, shape, dtype)


def gaussian_sigma_classic(sensitivity: float, epsilon: float, delta: float) -> float:
  """Dwork–Roth Thm A.1: ``sigma = sqrt(2 ln(1.25/delta)) * Delta / epsilon`` (valid for
  ``epsilon < 1``; reported as the papers' formula, not used for guarantees when
  ``epsilon >= 1``)."""
  check_positive(sensitivity, "sensitivity")
  check_epsilon(epsilon)
  check_delta(delta)
  return math.sqrt(2.0 * math.log(1.25 / delta)) * sensitivity / epsilon


def gaussian_sigma_analytic(sensitivity: float, epsilon: float, delta: float) -> float:
  """Smallest ``sigma`` for which the Gaussian mechanism is (epsilon, delta)-DP (Balle & Wang
  2018, analytic Gaussian mechanism), found by bisection on the exact privacy profile
  ``delta(eps) = Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D)``."""
  check_positive(sensitivity, "sensitivity")
  check_epsilon(epsilon)
  check_delta(delta)
  from scipy.stats import norm

  def profile(sigma: float) -> float:
    a = sensitivity / (2.0 * sigma)
    b = epsilon * sigma / sensitivity
    return norm.cdf(a - b) - math.exp(epsilon) * norm.cdf(-a - b)

  lo, hi = 1e-6 * sensitivity, sensitivity
  while profile(hi) > delta:
    hi *= 2.0
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if profile(mid) > delta:
      lo = mid
    else:
      hi = mid
  return hi
