"""The one calibrator: the smallest noise multiplier whose ledger epsilon meets a target.

Every driver calibrates through :func:`calibrate_noise_multiplier` (no calibrators, nudge loops
or hand-composed budgets elsewhere). It bisects on the epsilon that a fresh
:class:`~dpsco_jax.privacy.ledger.PrivacyLedger` reports for the events the mechanism will
spend, so the calibrated run spends exactly what the calibration promised; ``make_event`` may
return one event or a list (mixing dp_accounting events with pure-DP, (epsilon, delta) and
approximate-RDP blocks; ``fixed`` adds events that do not depend on the multiplier, e.g.
AboveThreshold's pure-DP budget).

Speed: when every event is a dp_accounting event that RDP supports, RDP (cheap) brackets the
answer first and PLD (tight, slower) refines it in ``[0.5, 1.01] z_rdp``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import dp_accounting
from scipy import optimize

from dpsco_jax.cache import bounded_cache

from dpsco_jax._checks import check_choice, check_delta, check_epsilon, check_positive
from dpsco_jax.privacy.events import OUTSIDE_ACCOUNTANT, for_accountant
from dpsco_jax.privacy.ledger import ACCOUNTANTS, PrivacyLedger, make_accountant
from dpsco_jax.privacy.relations import check_relation

__all__ = ["calibrate_noise_multiplier", "calibrate_poisson_sgd", "ledger_epsilon"]


def _as_list(x: Any) -> list:
  return list(x) if isinstance(x, (list, tuple)) else [x]


def ledger_epsilon(events: Sequence[Any], *, delta: float, relation: str,
                   accountant: str = "auto") -> float:
  """Epsilon of ``events`` composed by a fresh ledger (the calibrator's objective)."""
  ledger = PrivacyLedger(delta=delta, relation=relation, accountant=accountant)
  for i, e in enumerate(events):
    ledger.compose(e, label=f"event {i}")
  return ledger.epsilon(exact=True)


def _solve(eps_fn: Callable[[float], float], epsilon: float, lo: float, hi: float | None
           ) -> float:
  """Smallest z in [lo, inf) with eps_fn(z) <= epsilon (eps_fn decreasing), rel. tol 1e-6."""
  if eps_fn(lo) <= epsilon:
    return lo
  if hi is None or eps_fn(hi) > epsilon:
    hi = max(2.0 * lo, 1.0) if hi is None else hi
    for _ in range(40):
      if eps_fn(hi) <= epsilon:
        break
      lo, hi = hi, 2.0 * hi
    else:
      raise ValueError(f"no noise multiplier up to {hi:.3g} reaches epsilon={epsilon}")
  g = lambda logz: eps_fn(math.exp(logz)) - epsilon
  root = math.exp(optimize.brentq(g, math.log(lo), math.log(hi), xtol=1e-7))
  while eps_fn(root) > epsilon:  # brentq may land a hair on the wrong side
    root *= 1 + 1e-6
  return root


def calibrate_noise_multiplier(make_event: Callable[[float], Any], *, epsilon: float,
                               delta: float, relation: str = "add_remove",
                               accountant: str = "auto", lower: float = 0.3,
                               fixed: Sequence[Any] = ()) -> float:
  """Smallest noise multiplier ``z >= lower`` with ``epsilon(make_event(z) + fixed) <=
  epsilon`` at ``delta`` under ``relation``, as the ledger composes it.

  ``lower``: below ~0.3 the PLD of many composed steps becomes enormous, and such tiny noise is
  never the answer for a useful budget. Raises ``ValueError`` if ``fixed`` alone exceeds the
  target or no multiplier reaches it."""
  check_epsilon(epsilon)
  check_delta(delta)
  check_relation(relation)
  check_choice(accountant, "accountant", ACCOUNTANTS)
  check_positive(lower, "lower")
  fixed = _as_list(fixed)
  eps_at = lambda z, kind: ledger_epsilon(_as_list(make_event(z)) + fixed, delta=delta,
                                          relation=relation, accountant=kind)
  probe = _as_list(make_event(1.0)) + fixed
  plain = all(not isinstance(e, OUTSIDE_ACCOUNTANT) for e in probe)
  rdp_ok = plain and all(make_accountant("rdp", relation, e).supports(
      for_accountant(e, "rdp", relation)) for e in probe)
  pld_ok = plain and all(make_accountant("pld", relation, e).supports(
      for_accountant(e, "pld", relation)) for e in probe)
  # PLD (tight, slow) refines what RDP (cheap) brackets, when both can read the events
  if rdp_ok and (accountant == "pld" or (accountant == "auto" and pld_ok)):
    z_rdp = _solve(lambda z: eps_at(z, "rdp"), epsilon, lower, None)
    # "auto" refines as the ledger will account: PLD, or RDP where PLD's truncated tails
    # give no finite epsilon (delta below ~1e-15)
    fine = "pld" if accountant == "pld" else "auto"
    if z_rdp == lower:
      return _solve(lambda z: eps_at(z, fine), epsilon, lower, None)
    return _solve(lambda z: eps_at(z, fine), epsilon, max(lower, 0.5 * z_rdp), 1.01 * z_rdp)
  return _solve(lambda z: eps_at(z, accountant), epsilon, lower, None)


@bounded_cache()
def calibrate_poisson_sgd(sampling_rate: float, steps: int, *, epsilon: float, delta: float,
                          relation: str = "add_remove", accountant: str = "auto") -> float:
  """:func:`calibrate_noise_multiplier` of ``steps`` Poisson-sampled Gaussian steps (DP-SGD's
  event), memoized on these public numbers in the one cache: the seeds of a sweep and a
  trainer rebuilt on the same schedule calibrate once (the PLD bisection costs seconds)."""
  return calibrate_noise_multiplier(
      lambda z: dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(z)),
          steps),
      epsilon=epsilon, delta=delta, relation=relation, accountant=accountant)
