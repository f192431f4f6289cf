"""dpsco_jax.audit: the bounds are valid and tight on exact Gaussians, ~0 on identical
distributions; every audited stage stays below its claim and every broken twin is flagged."""

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax.audit import (AuditResult, audit_mechanism, clopper_pearson_upper, dirac_canary,
                             epsilon_lower_bound, gdp_epsilon, gdp_mu_lower_bound,
                             neighbouring_pair, run_audit, sample_scores)
from dpsco_jax.audit import mechanisms as M
from dpsco_jax.privacy.ledger import epsilon_of

DELTA = 1e-5


def _gauss(mu, n, seed):
  rng = np.random.default_rng(seed)
  return rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)


# ----------------------------------------------------------------------------- statistics
def test_clopper_pearson_closed_form_and_coverage():
  # k = 0: the one-sided upper bound is 1 - alpha^(1/n)
  assert clopper_pearson_upper(0, 100, 0.05) == pytest.approx(1 - 0.05 ** (1 / 100))
  assert clopper_pearson_upper(100, 100, 0.05) == 1.0
  rng = np.random.default_rng(0)
  p, n = 0.03, 500
  k = rng.binomial(n, p, size=4000)
  cover = np.mean(clopper_pearson_upper(k, n, 0.05) >= p)
  assert cover >= 0.95  # exact (conservative) coverage


def test_gdp_epsilon_matches_the_ledger():
  for mu in (0.5, 1.0, 2.0):
    ledger = epsilon_of(dp_accounting.GaussianDpEvent(1.0 / mu), delta=DELTA)
    assert gdp_epsilon(mu, DELTA) == pytest.approx(ledger, rel=2e-3)
  assert gdp_epsilon(0.0, DELTA) == 0.0


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_gaussian_pairs_bound_below_truth(mu):
  s_in, s_out = _gauss(mu, 40_000, seed=int(mu * 10))
  eps = epsilon_lower_bound(s_in, s_out, delta=DELTA)
  m = gdp_mu_lower_bound(s_in, s_out)
  assert 0.0 < eps.value <= gdp_epsilon(mu, DELTA)
  assert 0.0 < m.value <= mu
  assert m.value >= 0.8 * mu  # the GDP fit is nearly tight already


def test_gaussian_bound_approaches_truth_with_samples():
  # at delta = 0.05 the optimal test sits at moderate error rates, so the distribution-free
  # bound can reach the true epsilon; it grows with the sample size and stays below it
  mu, delta = 1.0, 0.05
  truth = gdp_epsilon(mu, delta)
  small = epsilon_lower_bound(*_gauss(mu, 2_000, 1), delta=delta).value
  big = epsilon_lower_bound(*_gauss(mu, 1_000_000, 2), delta=delta).value
  assert small < big <= truth
  assert big >= 0.9 * truth
  assert gdp_mu_lower_bound(*_gauss(mu, 1_000_000, 3)).value >= 0.9 * mu


def test_identical_distributions_give_about_zero():
  rng = np.random.default_rng(5)
  a, b = rng.normal(size=50_000), rng.normal(size=50_000)
  assert epsilon_lower_bound(a, b, delta=DELTA).value <= 0.05
  assert gdp_mu_lower_bound(a, b).value <= 0.05
  bits_a, bits_b = rng.integers(0, 2, 50_000), rng.integers(0, 2, 50_000)
  assert epsilon_lower_bound(bits_a, bits_b, delta=DELTA, method="bonferroni",
                             thresholds=[0.5]).value <= 0.05


def test_bound_is_valid_at_the_stated_confidence():
  # repeated small audits of mu = 1: the GDP lower bound exceeds the truth rarely (<= 5%)
  exceed = 0
  for seed in range(200):
    exceed += gdp_mu_lower_bound(*_gauss(1.0, 1_000, 100 + seed)).value > 1.0
  assert exceed <= 0.05 * 200 + 6  # binomial slack around the nominal 5%


def test_bonferroni_grid_and_split_agree_roughly():
  s_in, s_out = _gauss(1.0, 50_000, 7)
  split = epsilon_lower_bound(s_in, s_out, delta=DELTA).value
  grid = epsilon_lower_bound(s_in, s_out, delta=DELTA, method="bonferroni",
                             thresholds=np.linspace(1.0, 4.0, 13)).value
  assert 0.7 * split < grid < 1.5 * split


def test_bad_inputs_name_the_parameter():
  a, b = _gauss(1.0, 100, 0)
  with pytest.raises(TypeError, match="delta"):
    epsilon_lower_bound(a, b, delta=True)
  with pytest.raises(TypeError, match="delta"):
    epsilon_lower_bound(a, b, delta="1e-5")
  with pytest.raises(ValueError, match="confidence"):
    epsilon_lower_bound(a, b, delta=DELTA, confidence=1.5)
  with pytest.raises(ValueError, match="method"):
    epsilon_lower_bound(a, b, delta=DELTA, method="best")
  with pytest.raises(ValueError, match="thresholds"):
    epsilon_lower_bound(a, b, delta=DELTA, method="bonferroni")
  with pytest.raises(ValueError, match="scores_in"):
    epsilon_lower_bound([np.nan, 1.0], b, delta=DELTA)
  with pytest.raises(TypeError, match="mu"):
    gdp_epsilon(True, DELTA)
  spec = M.build("tdlap_bottom", "replace_one")
  with pytest.raises(TypeError, match="trials"):
    run_audit(spec, trials=1e4)
  with pytest.raises(ValueError, match="relation"):
    audit_mechanism(spec.release, spec.dataset_in, spec.dataset_out, score=spec.score,
                    claimed_epsilon=1.0, delta=DELTA, relation="swap", trials=100)
  with pytest.raises(TypeError, match="claimed_epsilon"):
    audit_mechanism(spec.release, spec.dataset_in, spec.dataset_out, score=spec.score,
                    claimed_epsilon=True, delta=DELTA, relation="replace_one", trials=100)
  with pytest.raises(ValueError, match="broken"):
    M.build("gaussian_chain", "replace_one", "realized_count")
  with pytest.raises(ValueError, match="name"):
    M.build("nope", "add_remove")


# ----------------------------------------------------------------------------- canaries, harness
def test_neighbouring_pairs_per_relation():
  bg = jnp.ones((3, 2))
  c = dirac_canary(2, 10.0)
  d, ar = neighbouring_pair(bg, c, "add_remove")
  assert bool(d.mask.all()) and not bool(ar.mask[0]) and bool(ar.mask[1:].all())
  _, ro = neighbouring_pair(bg, c, "replace_one")
  np.testing.assert_array_equal(ro.grads[0], -c)
  _, zo = neighbouring_pair(bg, c, "zero_out")
  np.testing.assert_array_equal(zo.grads[0], jnp.zeros(2))
  assert bool(zo.mask.all())
  for other in (ar, ro, zo):  # only the canary's slot differs
    np.testing.assert_array_equal(other.grads[1:], d.grads[1:])


def test_sample_scores_reproducible_and_fresh_keys():
  release = lambda k, x: x + jax.random.normal(k, ())  # noqa: E731
  key = jax.random.key(3)
  a = sample_scores(release, jnp.float32(0.0), lambda r: r, key, 1000, batch=300)
  b = sample_scores(release, jnp.float32(0.0), lambda r: r, key, 1000, batch=300)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (1000,) and np.unique(a).size == 1000  # no key reused across chunks
  assert abs(a.mean()) < 0.1 and abs(a.std() - 1.0) < 0.1


# ----------------------------------------------------------------------------- stage audits
# (name, relation, twin, trials): each honest audit stays below its claim, each twin is caught
CASES = [
    ("gaussian_chain", "add_remove", "noise_halved", 50_000),
    ("gaussian_chain", "add_remove", "realized_count", 50_000),
    ("gaussian_chain", "replace_one", "noise_halved", 50_000),
    ("gaussian_chain", "replace_one", "no_clipping", 20_000),
    ("gaussian_chain", "zero_out", "noise_halved", 50_000),
    ("tree_noise", "add_remove", "independent_accounting", 50_000),
    ("laplace_test", "replace_one", "noise_halved", 50_000),
    ("above_threshold", "replace_one", "threshold_redrawn", 100_000),
    ("output_perturbation", "replace_one", "noise_halved", 50_000),
    ("tdlap_bottom", "replace_one", "eps_not_split", 50_000),
]


@pytest.mark.parametrize("name,relation,twin,trials", CASES)
def test_honest_below_claim_and_broken_twin_flagged(name, relation, twin, trials):
  honest = run_audit(M.build(name, relation), trials=trials, key=11)
  broken = run_audit(M.build(name, relation, twin), trials=trials, key=12)
  assert isinstance(honest, AuditResult) and honest.relation == relation
  assert 0.5 <= honest.claimed_epsilon <= 4.5
  assert honest.lower_bound <= honest.claimed_epsilon, honest
  assert not honest.violated
  assert broken.lower_bound > broken.claimed_epsilon, broken
  assert broken.violated


def test_cli_prints_the_table(capsys):
  from dpsco_jax.audit.__main__ import main
  rows = main(["--trials", "4000", "--mechanism", "tdlap_bottom"])
  out = capsys.readouterr().out
  assert "tdlap_bottom" in out and "eps_not_split" in out and "claim" in out
  assert rows[0]["twins"]["eps_not_split"]["flagged"]
  assert rows[0]["lower_bound"] <= rows[0]["claimed_epsilon"]
