"""Laplace noise and the papers' closed-form Gaussian calibrations (reported beside the
accountant's numbers, which are the primary source of (epsilon, delta))."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax._checks import (ArgumentTypeError, _traced, check_delta, check_epsilon,
                               check_key, check_positive)


def laplace(key: jax.Array, shape: tuple[int, ...] = (), scale: float | jax.Array = 1.0,
            dtype=jnp.float32) -> jax.Array:
  """``Lap(scale)`` draws (``epsilon = sensitivity / scale``), in float32 or wider whatever
  ``dtype`` asks (a bfloat16 Laplace is not the law the proof assumes).

  Args:
    key: a JAX PRNG key.
    shape: the shape of the draws (default: a scalar).
    scale: the Laplace scale ``b`` (default 1.0), > 0.
    dtype: the requested dtype (drawn in at least float32; default float32).

  Returns:
    The draws, an array of ``shape``.
  """
  check_key(key, "key")
  scale = _check_scale(scale)
  wide = jnp.promote_types(dtype, jnp.float32)
  return jnp.asarray(scale, wide) * jax.random.laplace(key, shape, wide)


def _check_scale(scale: Any) -> Any:
  """A finite real > 0 or an array of them (traced scales were checked while concrete)."""
  if _traced(scale):
    return scale
  if getattr(scale, "ndim", 0) == 0:
    return check_positive(scale, "scale")
  arr = np.asarray(scale)
  if arr.dtype.kind not in "iuf":
    raise ArgumentTypeError(f"scale must be an array of finite numbers > 0, got dtype "
                            f"{arr.dtype}")
  if not (np.all(np.isfinite(arr)) and np.all(arr > 0)):
    raise ValueError("scale must be an array of finite numbers > 0, got one that is not")
  return scale


def gaussian_sigma_classic(sensitivity: float, epsilon: float, delta: float) -> float:
  """Dwork-Roth Thm A.1: ``sigma = sqrt(2 ln(1.25/delta)) Delta / epsilon`` (for ``epsilon <= 1``).

  Args:
    sensitivity: the L2 sensitivity ``Delta``, > 0.
    epsilon: the target epsilon, in ``(0, 1]`` (beyond 1 the formula's sigma can miss the
      target: at epsilon = 10 its exact epsilon is 10.4; use :func:`gaussian_sigma_analytic`).
    delta: the target delta, in ``(0, 1)``.

  Returns:
    ``sigma``, the Gaussian noise std.
  """
  # the checked python floats: a float16 / 0-d jax input would round sigma below the formula
  sensitivity, epsilon = check_positive(sensitivity, "sensitivity"), check_epsilon(epsilon)
  if epsilon > 1.0:
    raise ValueError(f"epsilon={epsilon!r} > 1 is outside the classic Gaussian mechanism "
                     "(Dwork-Roth Thm A.1): use gaussian_sigma_analytic")
  delta = check_delta(delta)
  return math.sqrt(2.0 * math.log(1.25 / delta)) * sensitivity / epsilon


def gaussian_sigma_analytic(sensitivity: float, epsilon: float, delta: float) -> float:
  """Smallest ``sigma`` making the Gaussian mechanism (epsilon, delta)-DP (Balle & Wang 2018).

  Args:
    sensitivity: the L2 sensitivity ``D``, > 0.
    epsilon: the target epsilon, > 0.
    delta: the target delta, in ``(0, 1)``.

  Returns:
    ``sigma``, the Gaussian noise std (in the units of the sensitivity).
  """
  # the checked python floats: a float16 / 0-d jax input would bisect in its own precision
  # and could return a sigma below the smallest private one
  sensitivity = check_positive(sensitivity, "sensitivity")
  epsilon, delta = check_epsilon(epsilon), check_delta(delta)
  from scipy.special import log_ndtr
  log_delta = math.log(delta)

  def above(sigma: float) -> bool:
    """``delta(sigma) > delta`` in log space (at delta ~1e-300 both terms underflow)."""
    a = sensitivity / (2.0 * sigma)
    b = epsilon * sigma / sensitivity
    l1, l2 = float(log_ndtr(a - b)), epsilon + float(log_ndtr(-a - b))
    if l2 >= l1:
      return False
    return l1 + math.log1p(-math.exp(l2 - l1)) > log_delta

  lo, hi = 1e-6 * sensitivity, sensitivity
  while above(hi):
    hi *= 2.0
    if not math.isfinite(hi):
      raise ValueError(f"no finite sigma reaches delta={delta!r} at epsilon={epsilon!r}")
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if above(mid):
      lo = mid
    else:
      hi = mid
  return hi
