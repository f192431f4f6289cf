"""Matrix-factorization (MF) noise: strategies, sensitivity under participation, events.

Denisov et al. 2022; Choquette-Choo et al. 2023 ("(Amplified) Banded MF"); McKenna et al.
2024 ("Scaling up the Banded MF Mechanism"); Dvijotham et al. 2024 (BLT). The increments ``x``
(``T`` rows of L2 sensitivity ``s`` per participation) are released as ``C x + Z``, ``Z_t ~
N(0, sigma^2 I)``, ``C`` a lower-triangular Toeplitz *strategy* (``c_0 > 0``); training reads
``x + C^{-1} Z`` (post-processing). Row ``t`` reads ``x_{<=t}`` only, so adaptive increments
keep the non-adaptive guarantee (Denisov et al. 2022, Thm 2.1). Strategies: banded ``"sqrt"``
(``c_k = binom(2k, k) / 4^k`` truncated to ``b`` bands, unit norm; McKenna et al. 2024 §4) or
``"optimized"`` (optional jax_privacy); BLT ``c_0 = 1``, ``c_k = sum_i w_i theta_i^{k-1}``.

Sensitivity per unit ``s`` (zero-out / add-remove of one participant at steps ``P``):
``||C 1_P||``-type bounds: one participation ``||c_{0..T-1}||``; ``k`` participations at
separation ``>= b`` (banded): disjoint columns, maximized at ``0, sep, 2 sep, ...`` whatever the
signs; overlapping ones only for nonnegative, nonincreasing coefficients (McKenna et al. 2024,
Thm 2), others refused. The run is one Gaussian mechanism of multiplier ``z / sens``
(:func:`mf_event`); replace-one doubles ``s`` (the ledger's convention). Amplification
(:func:`amplified_banded_event`; Choquette-Choo et al. 2023, Thm 4, b-min-sep sampling): with at
most ``b`` bands the run is ``ceil(T / b)`` Poisson-subsampled Gaussians of multiplier ``z /
||c||``; a BLT's overlapping columns have no such argument.
"""

from __future__ import annotations

from typing import NamedTuple

import dp_accounting
import numpy as np

from dpsco_jax._checks import check_choice, check_int, check_positive
from dpsco_jax.cache import bounded_cache

__all__ = ["STRATEGIES", "ERRORS", "MfStrategy", "BltStrategy", "jax_privacy_version",
           "sqrt_coefs", "banded_strategy", "blt_strategy", "blt_coefs", "toeplitz_matrix",
           "toeplitz_inverse_coefs", "blt_inverse_coefs", "participation_sensitivity",
           "participations_of", "mf_event", "amplified_banded_event", "gaussian_mu",
           "prefix_errors"]

STRATEGIES = ("auto", "sqrt", "optimized")
ERRORS = ("mean", "max")


class MfStrategy(NamedTuple):
  """Banded Toeplitz strategy: ``coefs`` (float64, ``c_0 > 0``, unit L2 norm) and where it
  came from (``"sqrt"`` or ``"jax_privacy <version> optimize_banded_toeplitz(...)"``)."""
  coefs: np.ndarray
  source: str


class BltStrategy(NamedTuple):
  """BLT strategy ``C``: ``c_0 = 1``, ``c_k = sum_i output_scale_i buf_decay_i^{k-1}``."""
  buf_decay: np.ndarray
  output_scale: np.ndarray
  source: str


def jax_privacy_version() -> str | None:
  """The installed jax_privacy's version, or ``None`` (an optional dependency)."""
  try:
    import importlib.metadata as md
    import jax_privacy.matrix_factorization  # noqa: F401
    return md.version("jax-privacy")
  except Exception:  # noqa: BLE001 - absent or broken: fall back to the built-in strategy
    return None


def sqrt_coefs(n: int) -> np.ndarray:
  """First ``n`` coefficients of ``(1 - x)^{-1/2}``: ``binom(2k, k) / 4^k`` (float64)."""
  n = check_int(n, "n")
  k = np.arange(1, n, dtype=np.float64)
  return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def toeplitz_matrix(coefs: np.ndarray, n: int) -> np.ndarray:
  """The dense ``n x n`` lower-triangular Toeplitz matrix of ``coefs`` (tests, small n)."""
  c = np.zeros(n)
  m = min(n, len(coefs))
  c[:m] = np.asarray(coefs, np.float64)[:m]
  i, j = np.indices((n, n))
  return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], 0.0)


def toeplitz_inverse_coefs(coefs: np.ndarray, n: int) -> np.ndarray:
  """Coefficients of ``C^{-1}`` for ``n`` steps, by the streaming stage's recurrence."""
  c = np.asarray(coefs, np.float64)
  n = check_int(n, "n")
  b = min(len(c), n)
  u = np.zeros(n)
  for t in range(n):
    lo = max(0, t - b + 1)
    acc = float(np.dot(c[1:t - lo + 1], u[lo:t][::-1])) if t > lo else 0.0
    u[t] = ((1.0 if t == 0 else 0.0) - acc) / c[0]
  return u


def blt_coefs(buf_decay: np.ndarray, output_scale: np.ndarray, n: int) -> np.ndarray:
  """Toeplitz coefficients ``[1, sum w theta^0, sum w theta^1, ...]`` of a BLT, length n."""
  th, om = np.asarray(buf_decay, np.float64), np.asarray(output_scale, np.float64)
  powers = th[None, :] ** np.arange(n - 1, dtype=np.float64)[:, None]
  return np.concatenate([[1.0], powers @ om])


def blt_inverse_coefs(buf_decay: np.ndarray, output_scale: np.ndarray, n: int) -> np.ndarray:
  """Coefficients of ``C^{-1}`` for a BLT, by the stage's recurrence."""
  th, om = np.asarray(buf_decay, np.float64), np.asarray(output_scale, np.float64)
  s = np.zeros_like(th)
  u = np.zeros(n)
  for t in range(n):
    u[t] = (1.0 if t == 0 else 0.0) - float(om @ s)
    s = th * s + u[t]
  return u


def prefix_errors(inverse_coefs: np.ndarray) -> np.ndarray:
  """Per-step variance of the prefix-sum noise ``(A C^{-1} Z)_t`` per unit ``sigma^2``."""
  b = np.cumsum(np.asarray(inverse_coefs, np.float64))
  return np.cumsum(b * b)


@bounded_cache(32)
def _optimized_banded(steps: int, bands: int, error: str) -> tuple[tuple[float, ...], str]:
  import jax
  import jax.numpy as jnp
  from jax_privacy.matrix_factorization import toeplitz
  with jax.enable_x64():
    init = jnp.asarray(sqrt_coefs(bands), jnp.float64)
    red = jnp.mean if error == "mean" else jnp.max
    c = toeplitz.optimize_banded_toeplitz(steps, bands, strategy_coef=init, reduction_fn=red)
    c = np.asarray(c, np.float64)
  return tuple(c / np.linalg.norm(c)), (f"jax_privacy {jax_privacy_version()} toeplitz."
                                        f"optimize_banded_toeplitz(n={steps}, bands={bands}, "
                                        f"{error} error)")


def banded_strategy(steps: int, bands: int, *, strategy: str = "auto",
                    error: str = "mean") -> MfStrategy:
  """The ``bands``-banded Toeplitz strategy for ``steps`` steps, unit L2 norm; ``"auto"``:
  optimized when jax_privacy imports, else sqrt (``"optimized"`` needs it)."""
  steps = check_int(steps, "steps")
  bands = check_int(bands, "bands")
  check_choice(strategy, "strategy", STRATEGIES)
  check_choice(error, "error", ERRORS)
  bands = min(bands, steps)  # bands past T are never used
  use_jp = strategy == "optimized" or (strategy == "auto" and jax_privacy_version())
  if use_jp and bands > 1:
    if jax_privacy_version() is None:
      raise ImportError("strategy='optimized' needs jax-privacy>=2.0 (pip install "
                        "'dpsco_jax[bench]' or 'jax-privacy'); strategy='sqrt' needs nothing")
    coefs, source = _optimized_banded(steps, bands, error)
    return MfStrategy(np.asarray(coefs), source)
  c = sqrt_coefs(bands)
  return MfStrategy(c / np.linalg.norm(c), "sqrt" if bands > 1 else "identity (bands=1)")


def _fit_blt_to_sqrt(steps: int, buffers: int) -> tuple[np.ndarray, np.ndarray]:
  """Built-in BLT: ``theta_i = 1 - 1/r_i`` (``r_i`` log-spaced in ``[1.5, 2 steps]``), NNLS
  ``w >= 0`` against the sqrt coefficients: positive, nonincreasing ``c_k``."""
  from scipy.optimize import nnls
  r = np.geomspace(1.5, 2.0 * max(steps, 2), buffers)
  theta = 1.0 - 1.0 / r
  target = sqrt_coefs(steps)[1:]
  k = np.arange(len(target), dtype=np.float64)
  basis = theta[None, :] ** k[:, None]
  omega, _ = nnls(basis / target[:, None], np.ones_like(target))
  if omega.sum() > 1.0:
    omega /= omega.sum()
  keep = omega > 0
  if not keep.any():
    keep[0], omega[0] = True, 0.5
  return theta[keep], omega[keep]


@bounded_cache(32)
def _optimized_blt(steps: int, buffers: int, participations: int, min_sep: int,
                   error: str) -> tuple[tuple, tuple, str]:
  import jax
  from jax_privacy.matrix_factorization import buffered_toeplitz as bt
  with jax.enable_x64():
    blt = bt.optimize(n=steps, min_sep=min_sep, max_participations=participations,
                      error=error, min_buffers=1, max_buffers=buffers)
    th, om = np.asarray(blt.buf_decay, np.float64), np.asarray(blt.output_scale, np.float64)
  return tuple(th), tuple(om), (f"jax_privacy {jax_privacy_version()} buffered_toeplitz."
                                f"optimize(n={steps}, buffers<={buffers}, k={participations}, "
                                f"min_sep={min_sep}, {error} error)")


def blt_strategy(steps: int, buffers: int, *, participations: int = 1, min_sep: int = 1,
                 strategy: str = "auto", error: str = "max") -> BltStrategy:
  """A BLT strategy with at most ``buffers`` buffers for ``steps`` steps; ``"auto"`` is the
  built-in fit, whose nonnegative, nonincreasing coefficients any participation can use."""
  steps = check_int(steps, "steps")
  buffers = check_int(buffers, "buffers")
  participations = check_int(participations, "participations")
  min_sep = check_int(min_sep, "min_sep")
  check_choice(strategy, "strategy", STRATEGIES)
  check_choice(error, "error", ERRORS)
  # jax_privacy's optimizer is too slow for a default, and a plan must not depend on installs
  use_jp = strategy == "optimized"
  if use_jp:
    if jax_privacy_version() is None:
      raise ImportError("strategy='optimized' needs jax-privacy>=2.0; strategy='sqrt' fits "
                        "a BLT to the sqrt coefficients without it")
    th, om, source = _optimized_blt(steps, min(buffers, 15), participations, min_sep, error)
    return BltStrategy(np.asarray(th), np.asarray(om), source)
  th, om = _fit_blt_to_sqrt(steps, buffers)
  return BltStrategy(th, om, f"built-in NNLS fit of {len(th)} buffers to the sqrt coefficients")


def participations_of(steps: int, min_sep: int, participations: int | None = None) -> int:
  """``ceil(steps / min_sep)``, capped by ``participations`` when given."""
  k = -(-check_int(steps, "steps") // check_int(min_sep, "min_sep"))
  return k if participations is None else min(k, check_int(participations, "participations"))


def participation_sensitivity(coefs: np.ndarray, steps: int, *, participations: int = 1,
                              min_sep: int = 1) -> float:
  """L2 sensitivity of ``C x`` per unit increment sensitivity ``s`` (module docstring).

  Args:
    coefs: the strategy's Toeplitz coefficients, at least ``steps`` long (a BLT's
      :func:`blt_coefs`).
    steps: the number of steps, an integer >= 1.
    participations: the most contributions of one participant (default 1).
    min_sep: the fewest steps between two contributions (default 1).

  Returns:
    The L2 sensitivity, in units of ``s``.
  """
  c = np.asarray(coefs, np.float64)
  steps = check_int(steps, "steps")
  c = c[:steps]
  k = participations_of(steps, min_sep, participations)
  if k == 1:
    return float(np.linalg.norm(c))
  support = int(np.max(np.nonzero(c)[0])) + 1 if np.any(c) else 1
  if min_sep < support and not (np.all(c >= 0) and np.all(np.diff(c) <= 0)):
    raise ValueError(f"participations {min_sep} steps apart overlap within the strategy's "
                     f"{support} bands, and its coefficients are not nonnegative and "
                     "nonincreasing: no exact sensitivity here; use bands <= min-separation")
  u = np.zeros(steps)
  u[np.arange(k) * min_sep] = 1.0
  col_sum = np.convolve(u, c)[:steps]   # C @ 1_{0, sep, ..., (k-1) sep}
  return float(np.linalg.norm(col_sum))


def mf_event(noise_multiplier: float, sensitivity: float) -> dp_accounting.DpEvent:
  """The whole MF run as one Gaussian event (noise ``z * s`` on sensitivity ``sensitivity * s``).

  Args:
    noise_multiplier: ``z``, > 0.
    sensitivity: the strategy's sensitivity (:func:`participation_sensitivity`), > 0.

  Returns:
    A ``dp_accounting.GaussianDpEvent`` of multiplier ``z / sensitivity``.
  """
  z = float(noise_multiplier)
  if not z > 0:
    raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier!r}")
  return dp_accounting.GaussianDpEvent(z / check_positive(sensitivity, "sensitivity"))


def amplified_banded_event(noise_multiplier: float, coefs: np.ndarray, steps: int, *,
                           sampling_rate: float, min_sep: int) -> dp_accounting.DpEvent:
  """A banded strategy under b-min-sep Poisson sampling (module docstring); refuses more bands
  than ``min_sep``."""
  z = float(noise_multiplier)
  if not z > 0:
    raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier!r}")
  steps = check_int(steps, "steps")
  min_sep = check_int(min_sep, "min_sep")
  p = float(sampling_rate)
  if not 0.0 < p <= 1.0:
    raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate!r}")
  c = np.asarray(coefs, np.float64)[:steps]
  bands = int(np.max(np.nonzero(c)[0])) + 1 if np.any(c) else 0
  if bands < 1 or c[0] == 0:
    raise ValueError("the strategy needs c_0 != 0")
  if bands > min_sep:
    raise ValueError(f"bands ({bands}) must be <= the min-separation b ({min_sep}) of b-min-sep "
                     "Poisson sampling: with more bands than groups a row's participations "
                     "overlap in C's columns and the amplified (per-round) accounting does not "
                     "hold; use bands <= min_separation")
  k = participations_of(steps, min_sep)
  gauss = dp_accounting.GaussianDpEvent(z / float(np.linalg.norm(c)))
  return dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(p, gauss), k)


def gaussian_mu(noise_multiplier: float, sensitivity: float) -> float:
  """GDP parameter of the run: ``sensitivity / z``."""
  return check_positive(sensitivity, "sensitivity") / check_positive(noise_multiplier,
                                                                     "noise_multiplier")

