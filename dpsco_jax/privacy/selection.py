"""Private hyper-parameter selection: the law of the number of runs, its RDP bound, its report.

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR 2022). The
candidate algorithm ``Q`` trains one configuration of a grid drawn uniformly (public
randomness); its RDP curve is at most the order-wise maximum of the candidates' (Renyi
divergence is jointly quasi-convex). The selection ``A`` runs ``Q`` ``K ~`` a public law times
and releases only the best output; ``K``, the candidates drawn and their scores are secret.

* Truncated negative binomial ``D_{eta,gamma}`` (``eta > -1``, ``0 < gamma < 1``; Section 2):
  ``P[K=k] = (1-gamma)^k / (gamma^-eta - 1) * prod_{l<k} (l+eta)/(l+1)`` for ``k >= 1``;
  ``eta = 0`` is the logarithmic law ``(1-gamma)^k / (k log(1/gamma))``. Theorem 2: if ``Q``
  is ``(l, eps)``- and ``(l_hat, eps_hat)``-RDP, ``A`` is ``(l, eps')``-RDP with ``eps' = eps
  + (1+eta)(1-1/l_hat) eps_hat + (1+eta) log(1/gamma)/l_hat + log(E[K])/(l-1)``, minimized
  over ``l_hat`` on the order grid.
* Geometric (``eta = 1``; Liu & Talwar, STOC 2019): ``P[K=k] = gamma (1-gamma)^(k-1)``.
* Poisson (Theorem 6) is refused: its condition on ``Q``'s ``(eps_hat, delta_hat)`` is not
  checked here.

The curve is converted by dp_accounting's RDP conversion into an ``(epsilon, delta)`` block,
provenance ``theorem`` (:func:`selection_report`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.special import gammaln

from dpsco_jax._checks import check_above, check_choice, check_delta, check_int
from dpsco_jax.privacy.accountant import make_accountant
from dpsco_jax.privacy.events import (OUTSIDE_ACCOUNTANT, ApproxDpEvent, for_accountant,
                                      validate_event)
from dpsco_jax.privacy.ledger import PrivacyLedger, PrivacyReport, epsilon_of
from dpsco_jax.privacy.relations import check_relation

__all__ = ["DISTRIBUTIONS", "SelectionLaw", "SelectionCost", "law_for_grid", "candidate_rdp",
           "grid_rdp", "selection_rdp", "selection_epsilon", "selection_report",
           "selection_cost"]

DISTRIBUTIONS = ("truncated_negative_binomial", "geometric", "poisson")
#: the default shape: the logarithmic law (eta = 0), the paper's cheapest in log E[K] terms
DEFAULT_ETA = 0.0
# the sampler's CDF table stops growing once the tail is below the uniform's resolution
_TAIL = 2.0 ** -53


@dataclasses.dataclass(frozen=True)
class SelectionLaw:
  """The public law of the number of runs ``K`` (see the module docstring).

  Attributes:
    distribution: ``"truncated_negative_binomial"`` or ``"geometric"`` (``poisson`` is
      refused).
    gamma: the law's ``gamma``, in ``(0, 1)``.
    eta: the law's ``eta``, > -1 (default ``None``: the default eta, 1 for ``geometric``).
  """
  distribution: str
  gamma: float
  eta: float | None = None

  def __post_init__(self):
    check_choice(self.distribution, "distribution", DISTRIBUTIONS)
    if self.distribution == "poisson":
      raise ValueError("distribution: poisson is not implemented (Papernot & Steinke's "
                       "Theorem 6 needs each run's (epsilon, delta)-DP under a condition on "
                       "the order that is not checked here); use truncated_negative_binomial "
                       "or geometric")
    object.__setattr__(self, "gamma", check_delta(self.gamma, "gamma"))  # in (0, 1)
    eta = self.eta
    if eta is None:
      eta = 1.0 if self.distribution == "geometric" else DEFAULT_ETA
    eta = check_above(eta, "eta", -1.0)
    if self.distribution == "geometric" and eta != 1.0:
      raise ValueError(f"eta: the geometric law is eta = 1; give only gamma (got eta "
                       f"{self.eta!r}) or use truncated_negative_binomial")
    object.__setattr__(self, "eta", eta)

  def log_pmf(self, k: np.ndarray) -> np.ndarray:
    """``log P[K = k]``.

    Args:
      k: integers >= 1.

    Returns:
      ``log P[K = k]``, float64, shaped as ``k``.
    """
    k = np.asarray(k, dtype=np.float64)
    g, eta = self.gamma, self.eta
    if eta == 0.0:
      return k * math.log1p(-g) - np.log(k) - math.log(math.log(1.0 / g))
    # prod_{l<k} (l+eta)/(l+1) = eta Gamma(k+eta) / (Gamma(1+eta) k!); for eta < 0 its sign
    # and that of gamma^-eta - 1 are both negative, so the ratio of magnitudes is the pmf
    log_prod = math.log(abs(eta)) + gammaln(k + eta) - gammaln(1.0 + eta) - gammaln(k + 1.0)
    return k * math.log1p(-g) + log_prod - math.log(abs(math.expm1(eta * math.log(1.0 / g))))

  def pmf(self, k: np.ndarray) -> np.ndarray:
    """``P[K = k]``.

    Args:
      k: integers >= 1.

    Returns:
      The probabilities, float64, shaped as ``k``.
    """
    return np.exp(self.log_pmf(k))

  def mean(self) -> float:
    """``E[K]``: ``eta (1-gamma) / (gamma (1 - gamma^eta))``; ``(1/gamma - 1) / log(1/gamma)``
    at ``eta = 0``.

    Returns:
      The expected number of runs, a float.
    """
    g, eta = self.gamma, self.eta
    if eta == 0.0 and math.isinf(1.0 / g):   # inf / inf: as (1-g) / (g log(1/g)), in logs
      with np.errstate(over="ignore"):   # inf past ~1e308 runs
        return float(np.exp(math.log1p(-g) - math.log(g) - math.log(-math.log(g))))
    if eta == 0.0:
      return (1.0 / g - 1.0) / math.log(1.0 / g)
    return eta * (1.0 - g) / (g * -math.expm1(eta * math.log(g)))

  def cdf_table(self, top: float = 1.0) -> np.ndarray:
    """The CDF at ``k = 1..N``, ``N`` grown until it exceeds ``top`` or the tail is below
    ``2^-53``.

    Args:
      top: grow the table until its CDF exceeds this value (default 1.0).

    Returns:
      The CDF at ``k = 1..N``, float64.
    """
    n = 1024
    while True:
      cdf = np.cumsum(self.pmf(np.arange(1, n + 1)))
      # past the mode the pmf falls geometrically: pmf(n) / gamma bounds the tail
      if (cdf[-1] > top or 1.0 - cdf[-1] < _TAIL
          or (n > 4 * self.eta and self.pmf(np.array([n]))[0] / self.gamma < _TAIL)):
        return cdf
      n *= 4

  def sample(self, key: Any, shape: tuple[int, ...] = ()) -> np.ndarray:
    """``K`` drawn by inverting the CDF at 53-bit uniforms.

    Args:
      key: a JAX PRNG key used for nothing else.
      shape: the shape of the draws (default: a scalar).

    Returns:
      The numbers of runs, integers >= 1 of ``shape`` (secret: never release them).
    """
    import jax
    import jax.numpy as jnp
    n = int(np.prod(shape, dtype=np.int64))
    bits = np.asarray(jax.random.bits(key, (max(n, 1), 2), dtype=jnp.uint32), np.uint64)
    u = ((bits[:, 0] >> 5) * 2.0 ** 26 + (bits[:, 1] >> 6)) / 2.0 ** 53
    cdf = self.cdf_table(float(u.max()))
    k = np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1) + 1
    return k[:n].reshape(shape)

  def describe(self) -> dict:
    """Returns:
      The law's public description: ``{"distribution", "eta", "gamma", "expected_runs"}``.
    """
    return {"distribution": self.distribution, "eta": self.eta, "gamma": self.gamma,
            "expected_runs": self.mean()}


def law_for_grid(n_candidates: int, distribution: str = "truncated_negative_binomial", *,
                 eta: float | None = None, gamma: float | None = None) -> SelectionLaw:
  """The law of a selection over ``n_candidates``; without ``gamma``, ``E[K] = n_candidates``."""
  n = check_int(n_candidates, "n_candidates", minimum=1)
  if gamma is not None:
    return SelectionLaw(distribution, gamma, eta)
  SelectionLaw(distribution, 0.5, eta)  # the other parameters' errors first
  if n < 2:
    raise ValueError("gamma: give it explicitly for a grid of one candidate (E[K] = 1 would "
                     "need gamma = 1)")
  lo, hi = 1e-12, 1.0 - 1e-12   # E[K] decreases in gamma: bisect on log gamma
  for _ in range(200):
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if SelectionLaw(distribution, mid, eta).mean() > n else (lo, mid)
  return SelectionLaw(distribution, hi, eta)


def candidate_rdp(event: Any, relation: str = "add_remove"
                  ) -> tuple[np.ndarray, np.ndarray]:
  """``(orders, rdp)``: one candidate's RDP curve on dp_accounting's default orders."""
  validate_event(event)
  if isinstance(event, OUTSIDE_ACCOUNTANT):
    raise ValueError(f"a candidate's privacy must be an accountant event with an RDP curve, "
                     f"got {type(event).__name__}")
  relation = check_relation(relation)
  acc = make_accountant("rdp", relation, event)
  converted = for_accountant(event, "rdp", relation)
  if not acc.supports(converted):
    raise ValueError(f"the RDP accountant cannot account for {event} under "
                     f"relation={relation!r}")
  acc.compose(converted)
  return np.asarray(acc.orders, dtype=np.float64), np.asarray(acc.rdp, dtype=np.float64)


def grid_rdp(events: Sequence[Any], relation: str = "add_remove"
             ) -> tuple[np.ndarray, np.ndarray]:
  """The curve of ``Q``: the order-wise max of the candidates' curves."""
  if not events:
    raise ValueError("events: a grid needs at least one candidate")
  curves = [candidate_rdp(e, relation) for e in events]
  orders = curves[0][0]
  return orders, np.max(np.stack([rdp for _, rdp in curves]), axis=0)


def selection_rdp(law: SelectionLaw, orders: np.ndarray, rdp: np.ndarray) -> np.ndarray:
  """The selection's RDP at each of ``orders`` (Theorem 2), given ``Q``'s curve ``rdp``."""
  orders, rdp = np.asarray(orders, np.float64), np.asarray(rdp, np.float64)
  if orders.shape != rdp.shape or orders.ndim != 1 or np.any(orders <= 1.0):
    raise ValueError("orders and rdp: one RDP value per order, every order > 1")
  c = 1.0 + law.eta
  with np.errstate(invalid="ignore"):
    hat = c * (1.0 - 1.0 / orders) * rdp + c * math.log(1.0 / law.gamma) / orders
  hat = np.where(np.isnan(hat), np.inf, hat)
  return rdp + np.min(hat) + math.log(law.mean()) / (orders - 1.0)


def selection_epsilon(law: SelectionLaw, orders: np.ndarray, rdp: np.ndarray,
                      delta: float) -> tuple[float, float]:
  """``(epsilon, order)`` of the selection at ``delta`` by dp_accounting's conversion."""
  delta = check_delta(delta)
  eps, order = rdp_privacy_accountant.compute_epsilon(
      orders, selection_rdp(law, orders, rdp), delta)
  return float(eps), float(order)


def selection_report(law: SelectionLaw, events: Sequence[Any], *, delta: float,
                     relation: str = "add_remove", level: str = "user",
                     metric: str = "public", tv_distance: float = 0.0) -> PrivacyReport:
  """The guarantee of training *and* selection (the best of ``K ~ law`` runs of ``Q``).

  Args:
    law: the law of the number of runs ``K``.
    events: one planned event per candidate of the grid.
    delta: the target delta, in ``(0, 1)``.
    relation: the neighbouring relation (default ``"add_remove"``).
    level: ``"user"`` (default) or ``"item"``.
    metric: what the score read, ``"public"`` (default) or ``"private"``, for the notes.
    tv_distance: each run's total variation distance to its accounted mechanism (default 0);
      over ``K`` runs it adds ``(1 + e^eps) E[K] tv`` to delta.

  Returns:
    The :class:`PrivacyReport`: one ``(epsilon, delta)`` block, provenance ``theorem``, the
    law and ``E[K]`` (never ``K``) in the notes.
  """
  orders, rdp = grid_rdp(events, relation)
  eps, order = selection_epsilon(law, orders, rdp, delta)
  if not math.isfinite(eps) or eps <= 0:
    raise ValueError(f"the selection's epsilon is {eps!r}: the candidates' RDP gives no "
                     "finite guarantee")
  ledger = PrivacyLedger(delta=delta, relation=relation)
  ledger.compose(ApproxDpEvent(eps, delta), label="private_selection")
  eta = "" if law.distribution == "geometric" else f"eta={law.eta:g}, "
  notes = (f"private selection (Papernot & Steinke 2022, Theorem 2): best of K runs by a "
           f"{metric} metric, K ~ {law.distribution}({eta}gamma={law.gamma:.6g}), "
           f"E[K] = {law.mean():.4g}, each run a candidate drawn uniformly from "
           f"{len(events)}; RDP converted at order {order:g}")
  return ledger.report(provenance="theorem", level=level, notes=notes,
                       tv_distance=law.mean() * tv_distance)


@dataclasses.dataclass(frozen=True)
class SelectionCost:
  """What a private selection costs, known before anything runs.

  Attributes:
    expected_runs: ``E[K]`` (never ``K``).
    candidates: the number of candidates of the grid.
    candidate_epsilon: the largest epsilon of one candidate alone.
    epsilon: the epsilon of training and selection together (Theorem 2).
    delta: the delta of that guarantee.
    law: the law of ``K``.
    report: the guarantee of training and selection (:func:`selection_report`).
  """
  expected_runs: float
  candidates: int
  candidate_epsilon: float
  epsilon: float
  delta: float
  law: SelectionLaw
  report: PrivacyReport | None = None

  def line(self, where: str = "") -> str:
    """The cost in words (``where``: what the selection is of, shown in parentheses).

    Args:
      where: e.g. the group and seed of a sweep's selection (default: nothing).

    Returns:
      One line: the law, ``E[K]``, one candidate's epsilon, the epsilon with selection.
    """
    where = f" ({where})" if where else ""
    return (f"private selection{where}: {self.law.distribution} (gamma {self.law.gamma:.4g}"
            + ("" if self.law.distribution == "geometric" else f", eta {self.law.eta:g}")
            + f"), expected runs {self.expected_runs:.3g} over {self.candidates} candidates; "
            f"epsilon of one candidate {self.candidate_epsilon:.4g}, with selection "
            f"{self.epsilon:.4g} (delta {self.delta:.3g})")


def selection_cost(law: SelectionLaw, events: Sequence[Any], *, delta: float,
                   relation: str = "add_remove", level: str = "user",
                   tv_distance: float = 0.0, candidate_epsilon: float | None = None
                   ) -> SelectionCost:
  """The cost of private selection over the grid ``events``, from the plans alone.

  Args:
    law: the law of the number of runs.
    events: one planned event per candidate of the grid.
    delta: the target delta, in ``(0, 1)``.
    relation: the neighbouring relation (default ``"add_remove"``).
    level: ``"user"`` (default) or ``"item"``, for the report.
    tv_distance: as in :func:`selection_report` (default 0).
    candidate_epsilon: one candidate's epsilon as its plan reports it (default ``None``: the
      largest of ``events``' epsilons at ``delta``).

  Returns:
    A ``SelectionCost``.
  """
  report = selection_report(law, events, delta=delta, relation=relation, level=level,
                            tv_distance=tv_distance)
  one = (max(epsilon_of(e, delta=delta, relation=relation) for e in events)
         if candidate_epsilon is None else candidate_epsilon)
  return SelectionCost(law.mean(), len(events), float(one), report.epsilon, report.delta, law,
                       report)
