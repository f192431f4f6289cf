"""The calibrator's root finder (``privacy/calibrate._solve``): every answer meets the target,
is the smallest such multiplier to ``RTOL``, and costs few accountant evaluations."""
import math

import dp_accounting
import pytest

import dpsco_jax.privacy.calibrate as cal
from dpsco_jax.privacy import calibrate_noise_multiplier, epsilon_of

DELTA = 1e-6


def _counting(fn):
  calls = []
  def eps_fn(z):
    calls.append(z)
    return fn(z)
  return eps_fn, calls


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0, 7.0])
@pytest.mark.parametrize("target", [0.05, 1.0, 40.0])
def test_smooth_curves_meet_the_target_and_stop_within_rtol(power, target):
  root = (3.0 / target) ** (1.0 / power)           # eps(z) = 3 z^-power
  eps_fn, calls = _counting(lambda z: 3.0 * z ** -power)
  z, _ = cal._solve(cal._log_gap(eps_fn, target), 1e-3)
  assert eps_fn(z) <= target                        # feasible: never an interpolated point
  assert z in calls[:-1]                            # ... it was evaluated during the solve
  # the smallest, to the tolerance: z within RTOL of the root, or spending the target to
  # EPS_RTOL (then z is within EPS_RTOL / power of it)
  assert root <= z <= root * (1 + max(cal.RTOL, cal.EPS_RTOL / power))
  assert len(calls) <= 12


def test_a_staircase_curve_like_pld_still_closes_the_bracket():
  # PLD's epsilon moves in steps of its discretization: a decreasing staircase of 1/z
  step = 1e-3
  eps_fn, calls = _counting(lambda z: math.ceil((1.0 / z) / step) * step)
  z, _ = cal._solve(cal._log_gap(eps_fn, 0.5), 0.01)
  assert eps_fn(z) <= 0.5
  assert eps_fn(z / (1 + cal.RTOL)) > 0.5 or eps_fn(z) >= 0.5 * (1 - cal.EPS_RTOL)
  assert len(calls) <= 14


def test_the_floor_the_impossible_and_nan():
  # feasible at lo: lo itself
  assert cal._solve(cal._log_gap(lambda z: 0.1 / z, 1.0), 0.3)[0] == 0.3
  with pytest.raises(ValueError, match="no noise multiplier"):
    # a fixed part over the target
    cal._solve(cal._log_gap(lambda z: 1.5 + 1.0 / z, 1.0), 0.3)
  with pytest.raises(ValueError, match="NaN"):
    cal._solve(cal._log_gap(lambda z: float("nan"), 1.0), 0.3)


def test_dp_sgd_calibration_takes_few_pld_evaluations(monkeypatch):
  """About 7 PLD evaluations from RDP's answer, the first at RDP's z; Brent in
  [0.5, 1.01] z_rdp took 11-13, the first at 0.5 z_rdp (the costliest), so this fails on the
  old solver."""
  kinds = []
  real = cal.ledger_epsilon
  def counted(events, *, delta, relation, accountant="auto"):
    kinds.append(accountant)
    return real(events, delta=delta, relation=relation, accountant=accountant)
  monkeypatch.setattr(cal, "ledger_epsilon", counted)
  make = lambda z: dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(z)), 1000)
  z = calibrate_noise_multiplier(make, epsilon=1.0, delta=DELTA)
  fine = [k for k in kinds if k != "rdp"]
  assert 3 <= len(fine) <= 8, kinds
  monkeypatch.setattr(cal, "ledger_epsilon", real)
  assert 1.0 - cal.EPS_RTOL <= epsilon_of(make(z), delta=DELTA) <= 1.0   # spends the target
  assert epsilon_of(make(z * (1 - 1e-4)), delta=DELTA) > 1.0
