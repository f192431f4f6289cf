"""The accountant: epsilon of a composition of dp_accounting events, without state.

:func:`accountant_epsilon` composes ``(event, count)`` parts with dp_accounting's PLD (tight)
or RDP, plain Gaussian compositions exactly (:func:`gaussian_epsilon`). Every answer is an
:class:`Epsilon`: the accountant's value (``exact``) or, where it cannot answer (PLD too large
to build, delta below PLD's truncated tails, RDP's float64 series cancelling), a valid
``upper_bound``: the smaller of RDP's (where sound) and the dominating Gaussian's (Poisson
sampling only lowers the loss). :func:`epsilon_lower_bound` lets a budget check refuse early.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpsco_jax._checks import check_choice
from dpsco_jax.privacy.events import for_accountant
from dpsco_jax.privacy.relations import accountant_relation

# RDP drops orders whose series does not converge and says so once per order: noise, not news.
logging.getLogger("absl").setLevel(logging.ERROR)

ACCOUNTANTS = ("pld", "rdp", "auto")
EPSILON_KINDS = ("exact", "upper_bound")
# dp_accounting's PLD rounds losses up, so a coarser grid still gives a valid upper bound;
# 1e-3 moves epsilon in the 5th digit on DP-SGD and is ~10x faster than the 1e-4 default.
PLD_DISCRETIZATION = 1e-3
#: ratio of the ledger's geometric grid of counts (:func:`grid_count`)
GRID_RATIO = 2.0 ** 0.25
# Past these, dp_accounting's PLD is not attempted (minutes, or memory it cannot have): the
# answer is the bound labelled ``upper_bound``.
#: most composed steps (RDP composes any count in O(1))
MAX_PLD_COUNT = 2 ** 20
#: most grid points of one step's loss range (~1 s to build)
MAX_PLD_STEP_POINTS = 5 * 10 ** 5
#: most grid points of the composed loss range (memory of the FFT composition)
MAX_PLD_POINTS = 2 * 10 ** 7
#: dp_accounting's PLD tail truncation: losses beyond this mass are not represented
PLD_TAIL_MASS = 1e-15
#: RDP of a Poisson-sampled Gaussian sums binomial terms to ``1 + O((q/z)^2)``; below this
#: ``(q/z)^2`` float64 rounding swamps the excess (dp_accounting then reports epsilon 0)
RDP_MIN_RATIO2 = 1e-10


class Epsilon(float):
  """A ``float`` whose ``kind`` is ``"exact"`` (the accountant's epsilon of the recorded
  counts) or ``"upper_bound"`` (a cheaper number at or above it). Arithmetic gives plain
  floats; ``repr`` and ``str`` name the kind, a format spec gives the number alone."""

  def __new__(cls, value: float, kind: str) -> "Epsilon":
    obj = super().__new__(cls, value)
    obj.kind = check_choice(kind, "kind", EPSILON_KINDS)
    return obj

  @property
  def is_exact(self) -> bool:
    return self.kind == "exact"

  def __reduce__(self):
    return (Epsilon, (float(self), self.kind))

  def __repr__(self) -> str:
    return f"Epsilon({float(self)!r}, kind={self.kind!r})"

  def __str__(self) -> str:
    return f"{float(self)!r} ({self.kind.replace('_', ' ')})"


def grid_count(count: int) -> int:
  """Smallest point of the geometric grid ``1, 2, 3, 4, ceil(4 r^k)`` that is >= ``count``."""
  if count <= 4:
    return count
  k = math.ceil(math.log(count / 4.0) / math.log(GRID_RATIO) - 1e-9)
  return max(count, math.ceil(4.0 * GRID_RATIO ** k - 1e-9))


def make_accountant(kind: str, relation: str, event: Any = None):
  """A fresh dp_accounting accountant of ``kind`` (``pld``/``rdp``) for ``relation``."""
  rel = accountant_relation(relation, event)
  if kind == "pld":
    return pld_privacy_accountant.PLDAccountant(rel, PLD_DISCRETIZATION)
  return rdp_privacy_accountant.RdpAccountant(neighboring_relation=rel)


def supports(kind: str, relation: str, event: Any) -> bool:
  """Whether accountant ``kind`` can account ``event`` under ``relation``."""
  return make_accountant(kind, relation, event).supports(for_accountant(event, kind, relation))


def grid_floor(count: int) -> int:
  """Largest point of the geometric grid that is <= ``count`` (fewer steps, lower epsilon)."""
  if count <= 4:
    return count
  k = math.floor(math.log(count / 4.0) / math.log(GRID_RATIO) + 1e-9)
  while k > 0 and math.ceil(4.0 * GRID_RATIO ** k - 1e-9) > count:
    k -= 1
  return min(count, math.ceil(4.0 * GRID_RATIO ** k - 1e-9))


def _inverse_square(z: float) -> float:
  """``1 / z^2``, ``inf`` where it overflows (z below ~1e-154: epsilon is unbounded)."""
  z2 = float(z) * float(z)
  return math.inf if z2 == 0.0 else 1.0 / z2


def _gaussian_mu2(event: Any, *, dominate: bool = False) -> float | None:
  """``sum 1/z_i^2`` if ``event`` composes plain Gaussians (else None): exactly one Gaussian
  mechanism of ``mu = sqrt(sum 1/z_i^2)``. With ``dominate``, a Poisson-sampled Gaussian of any
  rate counts as its Gaussian, which dominates it (joint convexity of the hockey-stick
  divergence), so the epsilon of that mu is an upper bound."""
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return _inverse_square(event.noise_multiplier)
  if isinstance(event, dp_accounting.PoissonSampledDpEvent) and (
      dominate or float(event.sampling_probability) == 1.0):
    return _gaussian_mu2(event.event, dominate=dominate)
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    inner = _gaussian_mu2(event.event, dominate=dominate)
    return None if inner is None else inner * event.count
  if isinstance(event, dp_accounting.ComposedDpEvent):
    parts = [_gaussian_mu2(e, dominate=dominate) for e in event.events]
    return None if any(p is None for p in parts) else float(sum(parts))
  return None


def _log_normal_mass(center: float, width: float) -> float:
  """``log P[|N(0, 1) - center| < width / 2]`` by 8-point Gauss-Legendre (no tail difference)."""
  import numpy as np
  from scipy import special
  nodes, weights = np.polynomial.legendre.leggauss(8)
  x = center + width * nodes / 2.0
  return (float(special.logsumexp(-x * x / 2.0, b=weights)) + math.log(width / 2.0)
          - 0.5 * math.log(2.0 * math.pi))


def gaussian_epsilon(mu: float, delta: float) -> float:
  """Exact epsilon of a mu-GDP mechanism at ``delta`` (Balle & Wang 2018, Thm 8): the smallest
  eps with ``Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) <= delta``, in log space (below
  ``mu = 1e-3`` as a normal mass less ``(e^eps - 1)`` times the upper tail)."""
  from scipy import optimize, special
  if mu <= 0:
    return 0.0
  # z so small that 1/z^2 overflows, or mu^2 does (epsilon ~ mu^2/2 + O(mu) past 1.8e308;
  # brentq's bracket would be inf: "Failed to converge"): no finite bound
  if not math.isfinite(mu * mu):
    return math.inf
  log_delta = math.log(delta)
  def gap(eps: float) -> float:  # log delta(eps) - log delta, decreasing in eps
    t = eps / mu
    if mu < 1e-3:
      a = _log_normal_mass(t, mu)
      b = (math.log(math.expm1(eps)) + float(special.log_ndtr(-mu / 2 - t)) if eps > 0
           else -math.inf)
    else:
      a = float(special.log_ndtr(mu / 2 - t))
      b = eps + float(special.log_ndtr(-mu / 2 - t))
    return (a + math.log(-math.expm1(b - a)) if b < a else -1e300) - log_delta
  if gap(0.0) <= 0:
    return 0.0
  hi = mu * mu / 2 + mu * math.sqrt(-2 * log_delta) + 1.0  # 1/delta overflows at 5e-324
  while gap(hi) > 0:
    hi *= 2
  # a relative tolerance (an absolute one of 1e-12 is 1e-4 of an epsilon of 1e-8), and the
  # root's feasible side: brentq may return a point a hair below it, i.e. below the truth
  eps = float(optimize.brentq(gap, 0.0, hi, xtol=min(1e-12, 1e-15 * hi), rtol=1e-12))
  step = max(eps * 1e-12, 1e-300)
  while gap(eps) > 0:
    eps, step = eps + step, 2 * step
  return eps


def accountant_epsilon(parts: list[tuple[Any, int]], delta: float, *, relation: str,
                       accountant: str = "auto") -> Epsilon:
  """Epsilon of the composition of dp_accounting ``(event, count)`` parts at ``delta``: plain
  Gaussians exactly (:func:`gaussian_epsilon`), the rest by PLD or RDP, or the bound."""
  if not parts:
    return Epsilon(0.0, "exact")
  whole = dp_accounting.ComposedDpEvent([e for e, _ in parts])
  counted = dp_accounting.ComposedDpEvent(
      [dp_accounting.SelfComposedDpEvent(e, c) for e, c in parts])
  factor = 2.0 if accountant_relation(relation, whole) == (
      dp_accounting.NeighboringRelation.REPLACE_ONE) else 1.0
  mu2 = _gaussian_mu2(counted)
  if mu2 is not None and accountant in ("auto", "pld"):
    return Epsilon(gaussian_epsilon(factor * math.sqrt(mu2), delta), "exact")
  kind = accountant
  if kind == "auto":
    kind = "pld" if supports("pld", relation, whole) else "rdp"
  bound = lambda: Epsilon(_cheap_bound(parts, delta, relation, whole, counted, factor),
                          "upper_bound")
  if kind == "rdp":
    return (Epsilon(_composed_epsilon(parts, delta, "rdp", relation, whole), "exact")
            if _rdp_sound(counted) else bound())
  if _pld_blocked(parts, relation, whole, counted, factor):
    return bound()
  eps = _composed_epsilon(parts, delta, "pld", relation, whole)
  # PLD truncates its tails at PLD_TAIL_MASS: within 1e3 of it its epsilon is loose (the
  # truncated mass counts as infinite loss), at and below it inf; "auto" asks RDP too there.
  # The dominating Gaussian (milliseconds) can beat PLD where its grid is coarse for the loss.
  cheap = _cheap_bound(parts, delta, relation, whole, counted, factor,
                       rdp=accountant == "auto" and delta < 1e3 * PLD_TAIL_MASS)
  return Epsilon(cheap, "upper_bound") if cheap < eps else Epsilon(eps, "exact")


def _rdp_sound(counted: Any) -> bool:
  """Whether RDP's float64 series is sound for every sampled Gaussian of ``counted``."""
  for q, z, _ in _sampled_gaussians(counted, 1):
    inv2 = _inverse_square(z)
    if math.isinf(inv2) or (q < 1 and q * q * inv2 < RDP_MIN_RATIO2):
      return False
  return True


def _cheap_bound(parts: list[tuple[Any, int]], delta: float, relation: str, whole: Any,
                 counted: Any, factor: float, rdp: bool = True) -> float:
  """The smaller of RDP's bound (with ``rdp``, where sound) and the dominating Gaussian's;
  ``inf`` when neither applies. Milliseconds at any size."""
  bounds = [math.inf]
  mu2 = _gaussian_mu2(counted, dominate=True)
  if mu2 is not None:
    bounds.append(gaussian_epsilon(factor * math.sqrt(mu2), delta))
  if rdp and _rdp_sound(counted) and supports("rdp", relation, whole):
    bounds.append(_composed_epsilon(parts, delta, "rdp", relation, whole))
  return min(bounds)


def pld_step_blocked(event: Any, relation: str) -> bool:
  """Whether one step of ``event`` is degenerate for dp_accounting's PLD or too large to build
  (:func:`_step_blocked`), for a caller that builds its own accountant."""
  whole = dp_accounting.ComposedDpEvent([event])
  factor = 2.0 if accountant_relation(relation, whole) == (
      dp_accounting.NeighboringRelation.REPLACE_ONE) else 1.0
  return _step_blocked(whole, factor)


_TAIL_QUANTILE = math.sqrt(2.0 * math.log(1.0 / PLD_TAIL_MASS))


def _width(mu2: float) -> float:
  """Grid points of a Gaussian loss range of ``mu^2``: ``mu^2/2 + c mu`` either way, ``c`` the
  Gaussian quantile of the tail mass."""
  return 2.0 * (mu2 / 2.0 + _TAIL_QUANTILE * math.sqrt(mu2)) / PLD_DISCRETIZATION


def _step_blocked(counted: Any, factor: float) -> bool:
  """Whether a step's loss range is too wide or below one grid step."""
  for q, z, _ in _sampled_gaussians(counted, 1):
    points = _width(factor * factor * _inverse_square(z))
    # q^2 underflowing breaks dp_accounting's subsampled PLD ("a must be greater than b")
    if not 1.0 <= points <= MAX_PLD_STEP_POINTS or q < 1e-150:
      return True
  # a Laplace's loss spans +-factor/b: past the step grid dp_accounting's PLD answers inf
  # (labelled exact) from b ~ 1e-3, takes minutes below, and cannot allocate at b ~ 1e-300
  return any(2.0 * factor / b / PLD_DISCRETIZATION > MAX_PLD_STEP_POINTS
             for b in _laplace_scales(counted))


def _pld_blocked(parts: list[tuple[Any, int]], relation: str, whole: Any, counted: Any,
                 factor: float) -> bool:
  """Whether the PLD of ``parts`` would take more than about a second, or be degenerate: too
  many steps, a step blocked (:func:`_step_blocked`), or too wide a composed range."""
  if sum(n for _, _, n in _sampled_gaussians(counted, 1)) > MAX_PLD_COUNT:
    return True
  if _step_blocked(counted, factor):
    return True
  mu2 = _gaussian_mu2(counted, dominate=True)
  if mu2 is None or _width(factor * factor * mu2) <= MAX_PLD_POINTS:
    return False
  if not (_rdp_sound(counted) and supports("rdp", relation, whole)):
    return True
  return 2.0 * _composed_epsilon(parts, PLD_TAIL_MASS, "rdp", relation, whole) / (
      PLD_DISCRETIZATION) > MAX_PLD_POINTS


def _composed_epsilon(parts: list[tuple[Any, int]], delta: float, kind: str, relation: str,
                      whole: Any) -> float:
  acc = make_accountant(kind, relation, whole)
  for event, count in parts:
    converted = for_accountant(event, kind, relation)
    if not acc.supports(converted):
      raise ValueError(f"{type(acc).__name__} cannot account for {event} under "
                       f"relation={relation!r}")
    acc.compose(converted, count)
  return float(acc.get_epsilon(delta))


def _sampled_gaussians(event: Any, count: int):
  """``(q, z, count)`` of every Poisson-sampled (or plain, q = 1) Gaussian inside ``event``."""
  d = dp_accounting
  if isinstance(event, d.GaussianDpEvent):
    yield 1.0, float(event.noise_multiplier), count
  elif isinstance(event, d.PoissonSampledDpEvent) and isinstance(event.event, d.GaussianDpEvent):
    yield float(event.sampling_probability), float(event.event.noise_multiplier), count
  elif isinstance(event, d.SelfComposedDpEvent):
    yield from _sampled_gaussians(event.event, count * int(event.count))
  elif isinstance(event, d.ComposedDpEvent):
    for e in event.events:
      yield from _sampled_gaussians(e, count)


def _laplace_scales(event: Any):
  """The scale ``b`` of every Laplace inside ``event`` (sampled or not)."""
  if isinstance(event, dp_accounting.LaplaceDpEvent):
    yield float(event.noise_multiplier)
  inner = getattr(event, "event", None)
  if inner is not None:
    yield from _laplace_scales(inner)
  for e in getattr(event, "events", None) or ():
    yield from _laplace_scales(e)


def _log_tail_upper(k, steps: int, log_p):
  """Upper bound on ``log P[Binomial(steps, p) >= k]``: the smaller of the union bound
  ``C(steps, k) p^k`` and Chernoff's ``exp(-steps KL(k/steps || p))`` (where ``k/steps > p``)."""
  import numpy as np
  from scipy import special
  union = (special.gammaln(steps + 1.0) - special.gammaln(k + 1.0)
           - special.gammaln(steps - k + 1.0) + k * log_p)
  a = k / steps
  with np.errstate(divide="ignore", invalid="ignore"):
    tail = np.where(a < 1, (1 - a) * (np.log1p(-np.minimum(a, 1 - 1e-16))
                                      - np.log1p(-np.exp(log_p))), 0.0)
    kl = a * (np.log(a) - log_p) + tail
    chernoff = np.where(a > np.exp(log_p), -steps * kl, 0.0)
  return np.minimum(np.minimum(union, chernoff), 0.0)


def _sampled_gaussian_lower_bound(q: float, z: float, steps: int, delta: float) -> float:
  """Lower bound on the epsilon of ``steps`` Poisson-sampled Gaussians (add/remove): for the
  event S "at least ``k`` outputs exceed ``t``", ``eps >= log((P[S] - delta) / Q[S])`` with
  ``P`` the user-present law ``(1-q) N(0,1) + q N(1/z, 1)`` per step and ``Q = N(0,1)``,
  maximized over a small grid of ``(t, k)``."""
  import numpy as np
  from scipy import special, stats
  mu = 1.0 / z
  if mu > 1e150:  # the test's grid overflows; 0 is a valid bound (the accountant answers inf)
    return 0.0
  t = np.linspace(-3.0, mu + 8.0, 96)[:, None]
  log_p0 = special.log_ndtr(-t)
  log_hit = special.log_ndtr(mu - t)
  log_p1 = log_hit if q >= 1 else np.logaddexp(math.log1p(-q) + log_p0, math.log(q) + log_hit)
  p1 = np.exp(log_p1)
  spread = np.sqrt(steps * p1 * (1 - p1))
  ks = np.concatenate([np.ones_like(p1)] + [steps * p1 - c * spread for c in (0, 1, 2, 3)],
                      axis=1)
  ks = np.clip(np.floor(ks), 1, steps)
  log_present = stats.binom.logsf(ks - 1, steps, p1) + math.log1p(-1e-9)  # a hair low
  log_absent = _log_tail_upper(ks, steps, log_p0)
  with np.errstate(divide="ignore", invalid="ignore"):
    margin = np.log(-np.expm1(math.log(delta) - log_present))  # log(1 - delta / P[S])
    eps = np.where(log_present > math.log(delta), log_present + margin - log_absent, 0.0)
  eps = eps[np.isfinite(eps)]
  return float(max(0.0, eps.max())) if eps.size else 0.0


def epsilon_lower_bound(event: Any, *, delta: float, relation: str = "add_remove",
                        count: int = 1) -> float:
  """A closed-form lower bound on the epsilon of ``count`` compositions of ``event``: the
  largest of its Poisson-sampled Gaussian parts' (0 when none, or not read as add/remove)."""
  if accountant_relation(relation, event) != dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE:
    return 0.0
  return max([_sampled_gaussian_lower_bound(q, z, c, delta)
              for q, z, c in _sampled_gaussians(event, count)], default=0.0)
