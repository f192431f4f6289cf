"""Approximate-RDP ledger at a single order, for mechanisms dp_accounting cannot express.

ReSQue's private solver (paper 002, Lemma 3 / Lemma 7 / Corollary 1) is
``(alpha, eps_rdp, delta)``-approximately RDP: RDP at one order up to a total-variation slack
``delta``. Such charges add up; Corollary 1 converts the sum to
``(eps_rdp + log(1/delta')/(alpha-1), delta' + (1 + e^eps) delta_tv)``-DP. This is the only
accounting outside :mod:`dpsco_jax.privacy.ledger`; it enforces its budget the same way
(``spend`` raises :class:`PrivacyBudgetExceeded` before recording).
"""

from __future__ import annotations

import math

from dpsco_jax._checks import check_delta, check_epsilon, check_positive
from dpsco_jax.privacy.ledger import PrivacyBudgetExceeded


class ApproxRdpLedger:
  """Additive approximate-RDP ledger at one order ``alpha`` (Lemma 3, Corollary 1).

  ``spend(eps_rdp, delta, label, conditions)`` raises ``PrivacyBudgetExceeded`` BEFORE
  recording when the converted ``(eps, delta)`` would exceed the budget; call it before the
  mechanism runs. ``delta_prime`` is Corollary 1's conversion slack.
  """

  def __init__(self, *, alpha: float, epsilon_budget: float, delta_budget: float,
               delta_prime: float):
    self.alpha = check_positive(alpha, "alpha")
    if alpha <= 1:
      raise ValueError(f"alpha must be > 1, got {alpha}")
    self.epsilon_budget = check_epsilon(epsilon_budget, "epsilon_budget")
    self.delta_budget = check_delta(delta_budget, "delta_budget")
    self.delta_prime = check_delta(delta_prime, "delta_prime")
    self.eps_rdp = 0.0
    self.delta_tv = 0.0
    self.calls = 0
    self.violations: dict[str, int] = {}

  def converted(self, eps_rdp: float, delta_tv: float) -> tuple[float, float]:
    eps = eps_rdp + math.log(1.0 / self.delta_prime) / (self.alpha - 1.0)
    return eps, self.delta_prime + (1.0 + math.exp(min(eps, 700.0))) * delta_tv

  def spend(self, eps_rdp: float, delta: float, label: str, conditions: dict) -> None:
    eps, dlt = self.converted(self.eps_rdp + eps_rdp, self.delta_tv + delta)
    if eps > self.epsilon_budget * (1 + 1e-9) or dlt > self.delta_budget * (1 + 1e-9):
      raise PrivacyBudgetExceeded(
          f"{label}: (eps={eps:.4g}, delta={dlt:.3g}) would exceed the budget "
          f"(eps={self.epsilon_budget:.4g}, delta={self.delta_budget:.3g})")
    self.eps_rdp += eps_rdp
    self.delta_tv += delta
    self.calls += 1
    for name, ok in conditions.items():
      if not ok:
        self.violations[name] = self.violations.get(name, 0) + 1

  def epsilon_delta(self) -> tuple[float, float]:
    return self.converted(self.eps_rdp, self.delta_tv)
