"""Private hyper-parameter selection (issue 48, deliverable 1): the law of the number of runs
K, its mean, the RDP bound of Papernot & Steinke's Theorem 2, the cost before anything runs,
the refusals, and the runner's ``select: private`` (K never recorded)."""

import math

import dp_accounting
import jax
import numpy as np
import pytest
from scipy import stats

from dpsco_jax.privacy.selection import (SelectionLaw, candidate_rdp, law_for_grid,
                                         selection_cost, selection_epsilon, selection_rdp,
                                         selection_report)

DRAWS = 20_000
TNB = "truncated_negative_binomial"


def _chi2_pvalue(sample: np.ndarray, law: SelectionLaw) -> float:
  """Goodness of fit of ``sample`` against ``law``'s pmf: bins k = 1..B-1 and a tail k >= B,
  B the first k whose expected count drops below 20."""
  k = np.arange(1, 100_000)
  expected = law.pmf(k) * len(sample)
  top = int(np.argmax(expected < 20)) + 1
  exp_bins = np.append(expected[:top - 1], len(sample) - expected[:top - 1].sum())
  obs = np.bincount(np.minimum(sample, top), minlength=top + 1)[1:]
  return stats.chisquare(obs, exp_bins).pvalue


@pytest.mark.parametrize("eta,gamma", [(0.0, 0.1), (1.0, 0.2), (0.5, 0.05), (-0.5, 0.1)])
def test_sampler_follows_the_law_and_not_a_neighbouring_one(eta, gamma):
  law = SelectionLaw(TNB, gamma, eta)
  sample = law.sample(jax.random.key(7), (DRAWS,))
  assert _chi2_pvalue(sample, law) > 1e-3
  # the test has power: gamma off by 15% is rejected
  assert _chi2_pvalue(sample, SelectionLaw(TNB, gamma * 1.15, eta)) < 1e-4
  assert _chi2_pvalue(sample, SelectionLaw(TNB, gamma / 1.15, eta)) < 1e-4


@pytest.mark.parametrize("eta,gamma", [(0.0, 0.1), (1.0, 0.2), (2.0, 0.05), (-0.5, 0.1)])
def test_mean_matches_pmf_and_sample(eta, gamma):
  law = SelectionLaw(TNB, gamma, eta)
  k = np.arange(1, 200_000)
  assert law.pmf(k).sum() == pytest.approx(1.0, abs=1e-12)
  assert (k * law.pmf(k)).sum() == pytest.approx(law.mean(), rel=1e-10)
  sample = law.sample(jax.random.key(3), (DRAWS,))
  se = sample.std() / math.sqrt(DRAWS)
  assert abs(sample.mean() - law.mean()) < 4 * se


def test_closed_forms():
  assert SelectionLaw("geometric", 0.2, 1.0).mean() == pytest.approx(5.0)
  geo = SelectionLaw("geometric", 0.2)
  assert geo.eta == 1.0
  assert geo.pmf(np.array([1, 2, 3])) == pytest.approx([0.2, 0.16, 0.128])
  log = SelectionLaw(TNB, 0.1, 0.0)
  assert log.pmf(np.array([2]))[0] == pytest.approx(0.9 ** 2 / (2 * math.log(10)))
  assert log.mean() == pytest.approx(9 / math.log(10))


def test_rdp_bound_reproduces_hand_computation():
  # Q (lambda)-RDP eps = lambda / 2 (a Gaussian of multiplier 1); geometric gamma = 1/2:
  # 1 + eta = 2, log(1/gamma) = log 2, E[K] = 2; the best l_hat is 2 (hat term 1 + log 2)
  law = SelectionLaw("geometric", 0.5)
  orders = np.array([2.0, 3.0, 4.0])
  got = selection_rdp(law, orders, orders / 2)
  ln2 = math.log(2)
  assert got == pytest.approx([2 + 2 * ln2, 2.5 + 1.5 * ln2, 3 + 4 / 3 * ln2], rel=1e-12)


def test_candidate_curve_is_the_accountants():
  orders, rdp = candidate_rdp(dp_accounting.GaussianDpEvent(2.0))
  assert rdp == pytest.approx(orders / 8, rel=1e-9)   # lambda / (2 z^2)


def _dpsgd_event(z=1.0, q=0.01, steps=1000):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)


def test_epsilon_monotone_in_expected_runs_and_noise():
  event = _dpsgd_event()
  eps = [selection_report(SelectionLaw(TNB, g, 0.0), [event], delta=1e-6).epsilon
         for g in (0.5, 0.1, 0.01, 0.001)]
  assert all(a < b for a, b in zip(eps, eps[1:]))
  law = SelectionLaw(TNB, 0.1, 0.0)
  by_noise = [selection_report(law, [_dpsgd_event(z)], delta=1e-6).epsilon
              for z in (2.0, 1.0, 0.8)]
  assert all(a < b for a, b in zip(by_noise, by_noise[1:]))
  # the grid's curve is the worst candidate's: adding a noisier candidate changes nothing
  one = selection_report(law, [_dpsgd_event(1.0)], delta=1e-6).epsilon
  two = selection_report(law, [_dpsgd_event(1.0), _dpsgd_event(3.0)], delta=1e-6).epsilon
  assert two == pytest.approx(one)


def test_report_is_a_ledger_theorem_block_with_the_law_not_k():
  law = SelectionLaw(TNB, 0.1, 0.0)
  report = selection_report(law, [_dpsgd_event()] * 3, delta=1e-6)
  assert report.provenance == "theorem" and report.delta == pytest.approx(1e-6)
  assert "truncated_negative_binomial(eta=0, gamma=0.1)" in report.notes
  assert "E[K] = 3.909" in report.notes
  orders, rdp = candidate_rdp(_dpsgd_event())
  assert report.epsilon == pytest.approx(selection_epsilon(law, orders, rdp, 1e-6)[0])


def test_cost_of_a_4_and_a_16_candidate_grid_at_the_defaults():
  """Defaults: eta = 0, gamma such that E[K] = the number of candidates. DP-SGD candidate:
  q = 0.01, z = 1, 1000 steps, delta 1e-6 (one candidate: epsilon 2.125)."""
  costs = {n: selection_cost(law_for_grid(n), [_dpsgd_event()] * n, delta=1e-6)
           for n in (4, 16)}
  for n, c in costs.items():
    assert c.expected_runs == pytest.approx(n, rel=1e-9)
    assert c.candidate_epsilon == pytest.approx(2.125, abs=0.005)
  assert costs[4].epsilon == pytest.approx(3.475, abs=0.005)
  assert costs[16].epsilon == pytest.approx(4.022, abs=0.005)
  assert "expected runs 4 over 4 candidates" in costs[4].line()


@pytest.mark.parametrize("kwargs,match", [
    (dict(distribution=TNB, gamma=0.1, eta=-1.0), "eta must be a finite number > -1"),
    (dict(distribution=TNB, gamma=0.1, eta=float("nan")), "eta must be a finite number"),
    (dict(distribution=TNB, gamma=0.1, eta=float("inf")), "eta must be a finite number"),
    (dict(distribution=TNB, gamma=0.1, eta=True), "eta must be a finite number"),
    (dict(distribution=TNB, gamma=0.0, eta=0.0), "gamma must lie in the open interval"),
    (dict(distribution=TNB, gamma=1.0, eta=0.0), "gamma must lie in the open interval"),
    (dict(distribution=TNB, gamma=float("nan"), eta=0.0), "gamma must lie"),
    (dict(distribution=TNB, gamma=True, eta=0.0), "gamma must be a number"),
    (dict(distribution=TNB, gamma="0.1", eta=0.0), "gamma must be a number"),
    (dict(distribution="geometric", gamma=0.1, eta=2.0), "eta: the geometric law is eta = 1"),
    (dict(distribution="poisson", gamma=0.1), "poisson is not implemented"),
    (dict(distribution="uniform", gamma=0.1), "distribution must be one of"),
])
def test_bad_law_refused_naming_the_parameter(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SelectionLaw(**kwargs)
