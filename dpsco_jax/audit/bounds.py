"""Empirical privacy lower bounds from two samples of attack scores.

An audit runs a mechanism on neighbouring datasets ``D`` (canary "in") and ``D'`` ("out") and
turns one score per run into the test "canary present?". For the rejection region
``{score >= t}`` every (epsilon, delta)-DP mechanism satisfies (Kairouz, Oh, Viswanath 2015,
Thm 2.1; as in Jagielski et al. 2020, Nasr et al. 2021/2023)

    FPR + e^eps FNR >= 1 - delta    and    FNR + e^eps FPR >= 1 - delta,

so with one-sided Clopper-Pearson upper bounds ``FPR_u``, ``FNR_u`` (each at level
``alpha/2``: joint confidence ``1 - alpha``)

    eps_lb(t) = max( log((1 - delta - FNR_u) / FPR_u),  log((1 - delta - FPR_u) / FNR_u) )

(0 when both arguments are <= 1) is a lower bound on every true epsilon with confidence
``1 - alpha``. ``t`` is chosen on a selection split and the bound evaluated on the rest
(``method="split"``), or the bound is the maximum over a data-independent grid of ``k``
thresholds, each interval at level ``alpha/(2k)`` (``method="bonferroni"``).

The mu-GDP fit (Dong, Roth, Su 2022; Nasr et al. 2023) uses the same intervals:
``mu_lb(t) = -Phi^{-1}(FPR_u) - Phi^{-1}(FNR_u)``. Its epsilon at delta refutes Gaussian
claims only; it is reported beside the distribution-free bound, never instead of it.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
from scipy import optimize, stats

from dpsco_jax._checks import check_delta, check_nonnegative

__all__ = [
    "clopper_pearson_upper",
    "epsilon_lower_bound",
    "gdp_mu_lower_bound",
    "gdp_epsilon",
    "ThresholdBound",
]

METHODS = ("split", "bonferroni")
_MAX_CANDIDATES = 2048  # thresholds tried on the selection split


def _as_scores(x, name: str) -> np.ndarray:
  arr = np.asarray(x, dtype=np.float64).reshape(-1)
  if arr.size < 2:
    raise ValueError(f"{name} needs at least 2 trials, got {arr.size}")
  if not np.all(np.isfinite(arr)):
    raise ValueError(f"{name} contains NaN or Inf scores")
  return arr


def clopper_pearson_upper(successes: np.ndarray | int, trials: int, alpha: float
                          ) -> np.ndarray:
  """One-sided ``1 - alpha`` Clopper-Pearson upper bound ``Beta^{-1}(1 - alpha; k + 1, n - k)``
  on a binomial proportion (1 when ``k = n``; exact, conservative coverage).

  Args:
    successes: ``k``, the successes (an int or an array).
    trials: ``n``, the trials.
    alpha: the miss probability.

  Returns:
    The upper bounds, shaped as ``successes``.
  """
  k = np.asarray(successes, dtype=np.float64)
  n = float(trials)
  safe_b = np.maximum(n - k, 1.0)
  up = stats.beta.ppf(1.0 - alpha, k + 1.0, safe_b)
  return np.where(k >= n, 1.0, up)


def _bounds_at(scores_in, scores_out, thresholds, alpha_each, delta, kind):
  """The bound (``kind``: ``"eps"`` or ``"mu"``) of the test ``score >= t`` at each ``t``."""
  s_in, s_out = np.sort(scores_in), np.sort(scores_out)
  fn = np.searchsorted(s_in, thresholds, side="left")
  fp = s_out.size - np.searchsorted(s_out, thresholds, side="left")
  fnr_u = clopper_pearson_upper(fn, scores_in.size, alpha_each)
  fpr_u = clopper_pearson_upper(fp, scores_out.size, alpha_each)
  if kind != "eps":
    return np.maximum(-stats.norm.ppf(fpr_u) - stats.norm.ppf(fnr_u), 0.0)
  with np.errstate(divide="ignore", invalid="ignore"):
    a = np.log(np.maximum(1.0 - delta - fnr_u, 0.0) / fpr_u)
    b = np.log(np.maximum(1.0 - delta - fpr_u, 0.0) / fnr_u)
  return np.maximum(np.nan_to_num(np.maximum(a, b), nan=0.0, neginf=0.0), 0.0)


def _candidates(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  pooled = np.unique(np.concatenate([a, b]))
  if pooled.size > _MAX_CANDIDATES:
    pooled = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, _MAX_CANDIDATES)))
  return pooled


class ThresholdBound(NamedTuple):
  """A lower bound and the threshold it was evaluated at (``score >= threshold`` = "in")."""
  value: float
  threshold: float
  confidence: float
  method: str


def _lower_bound(scores_in, scores_out, *, delta, confidence, method, selection_fraction,
                 thresholds, kind) -> ThresholdBound:
  s_in = _as_scores(scores_in, "scores_in")
  s_out = _as_scores(scores_out, "scores_out")
  conf = check_delta(confidence, "confidence")
  alpha = 1.0 - conf
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if method == "bonferroni":
    if thresholds is None:
      raise ValueError("thresholds: method='bonferroni' needs a data-independent grid of "
                       "thresholds (or use method='split')")
    grid = np.asarray(thresholds, dtype=np.float64).reshape(-1)
    if grid.size == 0 or not np.all(np.isfinite(grid)):
      raise ValueError("thresholds must be a non-empty array of finite numbers")
    vals = _bounds_at(s_in, s_out, grid, alpha / (2.0 * grid.size), delta, kind)
    i = int(np.argmax(vals))
    return ThresholdBound(float(vals[i]), float(grid[i]), conf, method)
  frac = check_delta(selection_fraction, "selection_fraction")
  k_in = max(1, int(round(frac * s_in.size)))
  k_out = max(1, int(round(frac * s_out.size)))
  if k_in >= s_in.size or k_out >= s_out.size:
    raise ValueError("selection_fraction leaves no trials for evaluation")
  sel_in, ev_in = s_in[:k_in], s_in[k_in:]
  sel_out, ev_out = s_out[:k_out], s_out[k_out:]
  cands = _candidates(sel_in, sel_out)
  # choose where the *bound* (not the point estimate) is largest on the selection split
  sel_vals = _bounds_at(sel_in, sel_out, cands, alpha / 2.0, delta, kind)
  t = cands[int(np.argmax(sel_vals))]
  val = _bounds_at(ev_in, ev_out, np.asarray([t]), alpha / 2.0, delta, kind)[0]
  return ThresholdBound(float(val), float(t), conf, method)


def epsilon_lower_bound(scores_in: Sequence[float] | np.ndarray,
                        scores_out: Sequence[float] | np.ndarray, *, delta: float,
                        confidence: float = 0.95, method: str = "split",
                        selection_fraction: float = 0.25,
                        thresholds: Sequence[float] | None = None) -> ThresholdBound:
  """Distribution-free empirical epsilon lower bound at ``delta`` (module docstring).

  Args:
    scores_in: scores of runs on ``D`` (canary present); larger means "more canary-like".
    scores_out: scores of runs on the neighbour ``D'``.
    delta: the delta of the claim being audited.
    confidence: ``1 - alpha``; the bound is below the true epsilon with at least this
      probability (for ``"split"``: whatever threshold the selection split picked).
    method: ``"split"`` (threshold chosen on the first ``selection_fraction`` of each
      i.i.d. sample, bound evaluated on the rest) or ``"bonferroni"`` (max over
      ``thresholds``, each at level ``alpha/(2k)``).
    selection_fraction: the fraction of each sample that picks the threshold (default 0.25).
    thresholds: the data-independent grid of ``"bonferroni"`` (default none).

  Returns:
    A ``ThresholdBound`` (``value``, ``threshold``, ``confidence``, ``method``).

  Raises:
    ValueError: ``delta``, ``confidence`` or ``selection_fraction`` not in ``(0, 1)``; an
      unknown ``method``; ``"bonferroni"`` without a non-empty finite grid; a split that
      leaves no trials for evaluation.
  """
  return _lower_bound(scores_in, scores_out, delta=check_delta(delta, "delta"),
                      confidence=confidence, method=method,
                      selection_fraction=selection_fraction, thresholds=thresholds,
                      kind="eps")


def gdp_mu_lower_bound(scores_in, scores_out, *, confidence: float = 0.95,
                       method: str = "split", selection_fraction: float = 0.25,
                       thresholds: Sequence[float] | None = None) -> ThresholdBound:
  """Lower bound on ``mu`` for a mechanism claimed ``mu``-GDP (module docstring).

  Args:
    scores_in: scores of runs on the dataset with the canary.
    scores_out: scores of runs on its neighbour.
    confidence: in ``(0, 1)`` (default 0.95).
    method: ``"split"`` (default) or ``"bonferroni"``.
    selection_fraction: see :func:`epsilon_lower_bound` (default 0.25).
    thresholds: see :func:`epsilon_lower_bound`.

  Returns:
    A ``ThresholdBound`` whose ``value`` is the bound on ``mu`` (errors as
    :func:`epsilon_lower_bound`).
  """
  return _lower_bound(scores_in, scores_out, delta=0.5, confidence=confidence, method=method,
                      selection_fraction=selection_fraction, thresholds=thresholds,
                      kind="mu")


def gdp_epsilon(mu: float, delta: float) -> float:
  """Epsilon of a ``mu``-GDP mechanism at ``delta`` (Dong, Roth, Su 2022, Cor. 2.13): the root
  of ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta``, 0 if none is positive.

  Args:
    mu: the GDP parameter, finite and >= 0.
    delta: in ``(0, 1)``.

  Returns:
    The epsilon, a float (TypeError, ValueError: ``mu`` or ``delta`` out of range).
  """
  delta = check_delta(delta, "delta")
  mu = check_nonnegative(mu, "mu")
  if mu == 0.0:
    return 0.0
  if not math.isfinite(mu * mu):   # epsilon ~ mu^2/2 is past float range (brentq saw NaN)
    return math.inf

  def excess(eps: float) -> float:
    # log-space second term: e^eps Phi(.) overflows for large eps otherwise
    second = math.exp(eps + stats.norm.logcdf(-eps / mu - mu / 2.0))
    return stats.norm.cdf(-eps / mu + mu / 2.0) - second - delta

  if excess(0.0) <= 0.0:
    return 0.0
  hi = max(1.0, mu * mu)
  while excess(hi) > 0.0:
    hi *= 2.0
  return float(optimize.brentq(excess, 0.0, hi, xtol=1e-10))
