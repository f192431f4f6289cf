"""Shifted truncated discrete Laplace and the calculators of DelOutputPert (paper 001).

Ghazi, Kamath, Kumar, Manurangsi, Meka, Zhang, "On User-Level Private Convex Optimization",
ICML 2023 (arXiv 2305.04912); spec ``shared/specs/001_ghazi_user_level.md``.

**TDLap(eps, delta)** (Definition 3.4, spec §2.1), ``kappa = ceil(1 + ln(1/delta)/eps)`` (the
paper does not round; spec §7 item 1): support ``{0, ..., 2 kappa}``, ``Pr[R = r] ∝ exp(-eps |r
- kappa|)``. Thm 3.3 uses (P1) ``Pr[R = 0] = Pr[R = 2 kappa] <= delta`` and (P2) ``Pr[R = r] <=
e^eps Pr[R = r +- 1]``.

**Exact sampling**: a float32 inverse CDF cannot represent atoms below ``2^-24`` (breaking P1),
so the CDF is computed in 60-digit decimals and rounded to 64-bit fixed point, the end atoms
*inward* (P1 holds exactly for the realized law); a draw compares 64 uniform bits with the
thresholds (jittable, no x64).

**Calculators** (Alg. 1 lines 1-2, spec §2.2-2.3): ``eps' = eps/2``, ``delta' = delta/(e^eps +
2)``, ``kappa(eps', delta')``, deletion depth ``4 kappa + 1``, minimum users ``2 (4 kappa +
1)``, ``sigma = sqrt(2 ln(2/delta')) 8 kappa Delta / eps'``.
"""

from __future__ import annotations

import decimal
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax._checks import (check_choice, check_delta, check_epsilon, check_int, check_key,
                               check_positive)
from dpsco_jax.cache import bounded_cache

_TWO64 = 1 << 64
_MASK32 = (1 << 32) - 1


def kappa(epsilon: float, delta: float) -> int:
  """``kappa(eps, delta) = ceil(1 + ln(1/delta)/eps)`` (Def. 3.4)."""
  eps = check_epsilon(epsilon)
  dl = check_delta(delta)
  return int(math.ceil(1.0 + math.log(1.0 / dl) / eps))


class DelOutputPertParams(NamedTuple):
  """The internal split of one DelOutputPert call (Alg. 1 line 1)."""
  epsilon_prime: float   # eps' = eps / 2
  delta_prime: float     # delta' = delta / (e^eps + 2)
  kappa: int             # kappa(eps', delta')
  depth: int             # 4 kappa: deletion budget of the stability test
  max_r1: int            # 2 kappa: largest R1


def delta_prime(epsilon: float, delta: float) -> float:
  """``delta' = delta / (e^eps + 2)`` (Alg. 1 line 1, [R])."""
  eps, dl = check_epsilon(epsilon), check_delta(delta)
  # e^eps overflows past eps ~ 709 ("math range error"), and below 1e-300 kappa's and
  # sigma's ln(1/delta') overflow: refused naming the numbers
  log_dp = math.log(dl) - eps - math.log1p(2.0 * math.exp(-eps))
  if log_dp < math.log(1e-300):
    raise ValueError(f"epsilon={epsilon!r}, delta={delta!r}: DelOutputPert's delta' = delta / "
                     f"(e^epsilon + 2) = e^{log_dp:.6g} is below 1e-300, outside the float "
                     "range of its calculators; use a smaller epsilon")
  return dl / (math.exp(eps) + 2.0)


def del_output_pert_params(epsilon: float, delta: float) -> DelOutputPertParams:
  """``(eps', delta', kappa, 4 kappa, 2 kappa)`` of DelOutputPert at target ``(eps, delta)``."""
  eps = check_epsilon(epsilon)
  dp = delta_prime(eps, delta)
  k = kappa(eps / 2.0, dp)
  return DelOutputPertParams(eps / 2.0, dp, k, 4 * k, 2 * k)


def deletion_depth(epsilon: float, delta: float) -> int:
  """Users deleted in the deepest sub-dataset the test touches: ``4 kappa + 1`` (spec §2.2)."""
  return del_output_pert_params(epsilon, delta).depth + 1


def min_users(epsilon: float, delta: float) -> int:
  """``2 (4 kappa + 1)``: the users Alg. 2 needs (spec §2.3: ``n - 4 kappa - 1 >= n/2``)."""
  return 2 * deletion_depth(epsilon, delta)


def chain_distance(Delta: float, epsilon: float, delta: float) -> float:
  """``8 kappa Delta``: the distance of the means paired in Thm 3.3's proof (eq. (3)-(4))."""
  return 8.0 * del_output_pert_params(epsilon, delta).kappa * check_positive(Delta, "Delta")


def sigma(Delta: float, epsilon: float, delta: float, calibration: str = "paper") -> float:
  """Gaussian scale of DelOutputPert (Alg. 1 line 2): ``"paper"`` (Dwork-Roth, needs ``eps' <
  1``) or ``"analytic"`` (Balle & Wang 2018: smaller, any epsilon) for distance ``8 kappa
  Delta`` at ``(eps', delta')``."""
  check_choice(calibration, "calibration", ("paper", "analytic"))
  p = del_output_pert_params(epsilon, delta)
  dist = chain_distance(Delta, epsilon, delta)
  if calibration == "paper":
    if p.epsilon_prime >= 1.0:
      raise ValueError(
          f"epsilon={epsilon} gives eps'={p.epsilon_prime} >= 1, outside the classic Gaussian "
          "mechanism (paper assumes epsilon <= 1); use calibration='analytic'")
    return math.sqrt(2.0 * math.log(2.0 / p.delta_prime)) * dist / p.epsilon_prime
  from dpsco_jax.privacy.mechanisms import gaussian_sigma_analytic
  return gaussian_sigma_analytic(dist, p.epsilon_prime, p.delta_prime)


def _check_tdlap(epsilon: float, kappa_: int) -> tuple[float, int]:
  eps = check_epsilon(epsilon)
  return eps, check_int(kappa_, "kappa", minimum=1)


@bounded_cache(256)
def _exact_cdf(epsilon: float, kappa_: int) -> tuple[decimal.Decimal, ...]:
  ctx = decimal.Context(prec=60)
  eps = ctx.create_decimal(repr(float(epsilon)))
  w = [ctx.exp(-eps * abs(r - kappa_)) for r in range(2 * kappa_ + 1)]
  z = ctx.add(decimal.Decimal(0), sum(w, decimal.Decimal(0)))
  out, acc = [], decimal.Decimal(0)
  for wi in w:
    acc = ctx.add(acc, wi)
    out.append(ctx.divide(acc, z))
  return tuple(out)


def tdlap_pmf_from_kappa(epsilon: float, kappa_: int) -> np.ndarray:
  """Exact pmf of TDLap with scale ``epsilon`` and centre ``kappa_`` (float64, host)."""
  eps, k = _check_tdlap(epsilon, kappa_)
  cdf = _exact_cdf(eps, k)
  return np.asarray([float(b - a) for a, b in zip((decimal.Decimal(0),) + cdf, cdf)], np.float64)


def tdlap_pmf(epsilon: float, delta: float) -> np.ndarray:
  """Exact pmf of ``TDLap(epsilon, delta)`` on ``{0, ..., 2 kappa(epsilon, delta)}``.

  Args:
    epsilon: the privacy parameter, > 0.
    delta: the truncation's delta, in ``(0, 1)``.

  Returns:
    A float64 array of length ``2 kappa + 1``.
  """
  return tdlap_pmf_from_kappa(epsilon, kappa(epsilon, delta))


@bounded_cache(256)
def _thresholds(epsilon: float, kappa_: int) -> tuple[int, ...]:
  cdf = _exact_cdf(epsilon, kappa_)
  thr = []
  for r in range(2 * kappa_):  # R >= r+1  <=>  U >= thr_r, with U uniform on [0, 2^64)
    scaled = cdf[r] * _TWO64
    t = int(scaled.to_integral_value(
        rounding=decimal.ROUND_FLOOR if r < kappa_ else decimal.ROUND_CEILING))
    thr.append(min(max(t, 0), _TWO64 - 1))
  return tuple(thr)


def tdlap_realized_pmf(epsilon: float, kappa_: int) -> np.ndarray:
  """The law the sampler realizes exactly (64-bit fixed point), as float64 masses."""
  eps, k = _check_tdlap(epsilon, kappa_)
  edges = [0, *_thresholds(eps, k), _TWO64]
  return np.asarray([(b - a) / _TWO64 for a, b in zip(edges[:-1], edges[1:])], np.float64)


def tdlap_sample_from_kappa(key: jax.Array, epsilon: float, kappa_: int,
                            shape: tuple[int, ...] = ()) -> jax.Array:
  """Draws of TDLap(epsilon; centre kappa_), int32 in ``{0..2 kappa_}`` (jittable in key)."""
  eps, k = _check_tdlap(epsilon, kappa_)
  check_key(key, "key")
  thr = _thresholds(eps, k)
  thr_hi = np.asarray([t >> 32 for t in thr], np.uint32)
  thr_lo = np.asarray([t & _MASK32 for t in thr], np.uint32)
  bits = jax.random.bits(key, tuple(shape) + (2,), jnp.uint32)
  hi, lo = bits[..., 0], bits[..., 1]
  count = jnp.zeros(tuple(shape), jnp.int32)
  for th, tl in zip(thr_hi.tolist(), thr_lo.tolist()):  # 2 kappa static compares, fused
    th = jnp.uint32(th)
    tl = jnp.uint32(tl)
    ge = (hi > th) | ((hi == th) & (lo >= tl))
    count = count + ge.astype(jnp.int32)
  return count


def tdlap_sample(key: jax.Array, epsilon: float, delta: float,
                 shape: tuple[int, ...] = ()) -> jax.Array:
  """``R ~ TDLap(epsilon, delta)`` (Def. 3.4): int32 draws in ``{0..2 kappa}``.

  Args:
    key: a JAX PRNG key.
    epsilon: the privacy parameter, > 0.
    delta: the truncation's delta, in ``(0, 1)``.
    shape: the shape of the draws (default: a scalar).

  Returns:
    An int32 array of ``shape``.
  """
  return tdlap_sample_from_kappa(key, epsilon, kappa(epsilon, delta), shape)
