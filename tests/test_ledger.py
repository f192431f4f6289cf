"""Ledger: equals direct dp_accounting, calibration round trip, budget, parallel composition."""

import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpsco_jax.privacy import (PrivacyBudgetExceeded, PrivacyLedger, PrivacyReport,
                               calibrate_noise_multiplier, epsilon_of, gaussian_sigma_analytic,
                               gaussian_sigma_classic, pure_dp_event)
from dpsco_jax.privacy.ledger import PLD_DISCRETIZATION

DELTA = 1e-5


def poisson_sgd(z, q=0.05, steps=50):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)


def direct_pld(events, relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE):
  acc = pld_privacy_accountant.PLDAccountant(relation, PLD_DISCRETIZATION)
  for e in events:
    acc.compose(e)
  return acc.get_epsilon(DELTA)


def test_ledger_equals_direct_dp_accounting():
  ledger = PrivacyLedger(delta=DELTA)
  ledger.compose(poisson_sgd(1.1), label="sgd")
  ledger.compose(dp_accounting.GaussianDpEvent(3.0), label="release", count=2)
  ledger.compose(pure_dp_event(0.1), label="laplace test")
  want = direct_pld([poisson_sgd(1.1),
                     dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 2)])
  # the pure eps-DP test adds by basic composition (a Laplace PLD would under-count an
  # arbitrary eps-DP mechanism such as AboveThreshold)
  assert ledger.epsilon(exact=True) == pytest.approx(want + 0.1, rel=1e-9)
  assert epsilon_of(pure_dp_event(0.1), delta=DELTA) == 0.1
  # the coarse PLD grid is an upper bound and close to the default (finer) grid
  fine = pld_privacy_accountant.PLDAccountant()
  fine.compose(poisson_sgd(1.1))
  assert epsilon_of(poisson_sgd(1.1), delta=DELTA) >= fine.get_epsilon(DELTA) - 1e-9
  assert epsilon_of(poisson_sgd(1.1), delta=DELTA) == pytest.approx(fine.get_epsilon(DELTA),
                                                                     rel=1e-2)


def test_replace_one_and_rdp_fallback():
  ev = dp_accounting.SampledWithoutReplacementDpEvent(1000, 50, dp_accounting.GaussianDpEvent(1.0))
  ledger = PrivacyLedger(delta=DELTA, relation="replace_one")
  ledger.compose(ev, label="swor", count=20)
  acc = rdp_privacy_accountant.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  # dp_accounting's RDP reads the multiplier relative to the replace-one sensitivity 2C
  acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(
      1000, 50, dp_accounting.GaussianDpEvent(0.5)), 20)
  assert ledger.epsilon(exact=True) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
  with pytest.raises(ValueError, match="cannot account"):
    PrivacyLedger(delta=DELTA, accountant="pld").compose(ev, label="x").epsilon(exact=True)


def test_replace_one_gaussian_reads_the_same_in_pld_and_rdp():
  """dp_accounting's PLD doubles a Gaussian's sensitivity under replace-one, its RDP does not;
  the ledger rewrites events for RDP so both read z = sigma / C (RDP slightly looser)."""
  for z in (0.5, 2.0):
    e_pld = epsilon_of(dp_accounting.GaussianDpEvent(z), delta=DELTA, relation="replace_one",
                       accountant="pld")
    e_rdp = epsilon_of(dp_accounting.GaussianDpEvent(z), delta=DELTA, relation="replace_one",
                       accountant="rdp")
    assert e_pld <= e_rdp <= 1.3 * e_pld, (z, e_pld, e_rdp)
    e_ar = epsilon_of(dp_accounting.GaussianDpEvent(z), delta=DELTA, accountant="pld")
    assert e_pld > 1.5 * e_ar  # replace-one is the stronger adjacency
  swor = lambda z: dp_accounting.SampledWithoutReplacementDpEvent(
      50, 50, dp_accounting.GaussianDpEvent(z))  # no subsampling: a plain Gaussian
  ledger = PrivacyLedger(delta=DELTA, relation="replace_one")
  ledger.compose(swor(2.0), label="swor")
  assert ledger.epsilon(exact=True) == pytest.approx(
      epsilon_of(dp_accounting.GaussianDpEvent(2.0), delta=DELTA, relation="replace_one",
                 accountant="rdp"), rel=1e-6)


def test_calibration_round_trips():
  z = calibrate_noise_multiplier(poisson_sgd, epsilon=2.0, delta=DELTA)
  assert epsilon_of(poisson_sgd(z), delta=DELTA) == pytest.approx(2.0, rel=1e-3)
  assert epsilon_of(poisson_sgd(0.97 * z), delta=DELTA) > 2.0
  z_rdp = calibrate_noise_multiplier(poisson_sgd, epsilon=2.0, delta=DELTA, accountant="rdp")
  assert z <= z_rdp  # PLD is the tighter accountant
  # a plain Gaussian under replace-one (PLD only): sensitivity doubles, so z doubles
  gauss = lambda z: dp_accounting.GaussianDpEvent(z)
  z_ar = calibrate_noise_multiplier(gauss, epsilon=1.0, delta=DELTA)
  z_ro = calibrate_noise_multiplier(gauss, epsilon=1.0, delta=DELTA, relation="replace_one")
  assert z_ro == pytest.approx(2 * z_ar, rel=1e-2)


def test_budget_raises_before_release():
  ledger = PrivacyLedger(delta=DELTA, epsilon_budget=1.0)
  eps = ledger.spend(dp_accounting.GaussianDpEvent(5.0), label="first")
  assert 0 < eps < 1.0
  released = []
  with pytest.raises(PrivacyBudgetExceeded, match="nothing was released"):
    ledger.spend(dp_accounting.GaussianDpEvent(1.0), label="second")
    released.append("second")  # never reached
  assert released == [] and [e[0] for e in ledger.events] == ["first"]
  assert ledger.epsilon(exact=True) == pytest.approx(eps)


def test_parallel_composition_over_disjoint_groups():
  ledger = PrivacyLedger(delta=DELTA)
  ledger.compose(pure_dp_event(0.3), label="phase 1", group="p1")
  ledger.compose(pure_dp_event(0.5), label="phase 2", group="p2")
  assert ledger.epsilon(exact=True) == pytest.approx(0.5, rel=1e-12)
  ledger.compose(pure_dp_event(0.2), label="everyone", count=2)
  assert ledger.epsilon(exact=True) == pytest.approx(0.9, rel=1e-12)
  ledger.compose(dp_accounting.GaussianDpEvent(4.0), label="gauss", group="p1")
  gauss = epsilon_of(dp_accounting.GaussianDpEvent(4.0), delta=DELTA)
  assert ledger.epsilon(exact=True) == pytest.approx(max(0.9, 0.7 + gauss), rel=1e-9)


def test_gaussian_closed_forms():
  s = gaussian_sigma_analytic(1.0, 1.0, DELTA)
  assert epsilon_of(dp_accounting.GaussianDpEvent(s), delta=DELTA) == pytest.approx(1.0, rel=2e-2)
  assert s < gaussian_sigma_classic(1.0, 1.0, DELTA)
  assert gaussian_sigma_classic(2.0, 0.5, DELTA) == pytest.approx(
      math.sqrt(2 * math.log(1.25 / DELTA)) * 4.0)


@pytest.mark.parametrize("kwargs,name", [
    (dict(delta=0.0), "delta"), (dict(delta=1.0), "delta"), (dict(delta=-1), "delta"),
    (dict(delta=1e-5, epsilon_budget=0.0), "epsilon_budget"),
    (dict(delta=1e-5, relation="swap"), "relation"),
    (dict(delta=1e-5, accountant="moments"), "accountant")])
def test_invalid_ledger_arguments(kwargs, name):
  with pytest.raises(ValueError, match=name):
    PrivacyLedger(**kwargs)


def test_invalid_calibration_and_report_arguments():
  with pytest.raises(ValueError, match="epsilon"):
    calibrate_noise_multiplier(poisson_sgd, epsilon=-1.0, delta=DELTA)
  with pytest.raises(ValueError, match="delta"):
    calibrate_noise_multiplier(poisson_sgd, epsilon=1.0, delta=2.0)
  with pytest.raises(ValueError, match="epsilon"):
    pure_dp_event(0.0)
  with pytest.raises(ValueError, match="provenance"):
    PrivacyReport(epsilon=1.0, delta=DELTA, provenance="trust me")
