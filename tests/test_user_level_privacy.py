"""Privacy contracts of papers 000 (FILTER drivers) and 001 (output perturbation), issue 11.

(a) neighbouring datasets (replace-one user, adversarially) move every per-phase / per-step
release, noise off and keys fixed, by at most the planned sensitivity, and the plan (noise,
sizes, steps) is the same for both; (b) the noise and the reported epsilon equal an
independent dp_accounting computation built here from the mechanism's parameters;
(c) unsupported relations and explicit noise multipliers above the budget are refused before
any release. Independent computations use this convention-free fact: a Gaussian release of
l2 shift ``Delta`` and std ``sigma`` has the privacy curve of ``GaussianDpEvent(sigma/Delta)``
under add/remove (sensitivity 1).
"""

from __future__ import annotations

import dataclasses
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from dpsco_jax.algorithms.output_perturbation import driver as op
from dpsco_jax.algorithms.user_level_filter import driver as ulf
from dpsco_jax.algorithms.user_level_filter.plan import (PublicSpec, plan_accelerated_erm,
                                                          plan_phased_sgd)
from dpsco_jax.api import solve
from dpsco_jax.privacy import PrivacyBudgetExceeded
from dpsco_jax.problems import make

AR = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
N, M, D = 300, 4, 3
ALG1 = {"epsilon": 2.0, "delta": 1e-6, "num_phases": 1, "num_groups": 30, "learning_rate": 0.05,
        "sensitivity": "typical"}
ALG3 = {"epsilon": 2.0, "delta": 1e-6, "num_phases": 1, "batch_size": 100, "max_steps": 3,
        "sensitivity": "typical"}


@pytest.fixture(scope="module")
def clean():
  return make("logistic", n_users=N, m=M, d=D, key=jax.random.key(0))


def _replace_user(problem, u: int):
  """Replace user ``u`` adversarially: features x -> -100 x (a huge opposite gradient)."""
  x = problem.data["x"].at[u].multiply(-100.0)
  return dataclasses.replace(problem, data={**problem.data, "x": x})


def _pld_eps(event, delta):
  acc = pld_privacy_accountant.PLDAccountant(AR, 1e-4)
  return acc.compose(event).get_epsilon(delta)


def _pld_sigma(sens, eps, delta):
  """Independent calibration: smallest sigma with eps(Gaussian(sigma/sens), add/remove) <=
  eps, by bisection on dp_accounting's PLD."""
  lo, hi = 0.5, 50.0
  for _ in range(24):                                    # relative precision ~3e-7
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if _pld_eps(dp_accounting.GaussianDpEvent(mid), delta) > eps else (lo,
                                                                                           mid)
  return hi * sens


# ------------------------------------------------------------- (b) noise and epsilon, paper 000

def test_alg1_noise_is_z_times_half_the_replace_one_shift(clean):
  """Issue 11 point 4: sigma = z * Delta/2 under replace-one, not z * Delta (2x too much)."""
  cfg = {**ALG1, "sensitivity": "certified", "num_groups": 60}
  plan = plan_phased_sgd(PublicSpec.of(clean), cfg)
  ph = plan.phases[0]
  eps_test = 2.0 / plan.schedule.laplace_scale                  # score sensitivity 2
  want = _pld_sigma(ph.sensitivity, 2.0 - eps_test, 1e-6 / 2)
  assert ph.sigma == pytest.approx(want, rel=0.01), (ph.sigma, want)
  rep = plan.charge()
  indep = eps_test + _pld_eps(dp_accounting.GaussianDpEvent(ph.sigma / ph.sensitivity),
                              1e-6 / 2)
  assert rep.epsilon == pytest.approx(indep, rel=0.01) and rep.epsilon <= 2.0 * (1 + 1e-9)
  assert rep.delta == pytest.approx(1e-6) and rep.relation == "replace_one"


def test_alg3_subsampled_noise_and_epsilon_match_independent_rdp(clean):
  """K_i of n_i without replacement, T_i steps: RDP (Wang et al., stated for the replace-one
  shift) of Gaussian(sigma/Delta) + AboveThreshold's pure epsilon = the reported epsilon."""
  plan = plan_accelerated_erm(PublicSpec.of(clean), ALG3)
  ph, sched = plan.phases[0], plan.schedule.phases[0]
  assert (sched.batch, ph.steps) == (100, 3)
  eps_at = 2.0 / plan.schedule.threshold_scale + 4.0 / plan.schedule.query_scale
  ev = dp_accounting.SelfComposedDpEvent(dp_accounting.SampledWithoutReplacementDpEvent(
      N, 100, dp_accounting.GaussianDpEvent(ph.sigma / ph.sensitivity)), 3)
  rdp = rdp_privacy_accountant.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  indep = eps_at + rdp.compose(ev).get_epsilon(1e-6 / 2)
  rep = plan.charge()
  assert rep.epsilon == pytest.approx(indep, rel=1e-6) and indep == pytest.approx(2.0, rel=1e-3)


# --------------------------------------------------- (a) sensitivity under replace-one, 000

def test_alg1_release_moves_by_at_most_delta_when_one_user_is_replaced(clean):
  key = jax.random.key(4)
  plan = plan_phased_sgd(PublicSpec.of(clean), ALG1)
  users = ulf._phase_users(plan, jax.random.split(key)[0], N)[0]
  bad = _replace_user(clean, int(users[0]))
  assert plan_phased_sgd(PublicSpec.of(bad), ALG1) == plan
  r0 = ulf.user_level_phased_sgd_releases(clean, ALG1, key, add_noise=False)
  r1 = ulf.user_level_phased_sgd_releases(bad, ALG1, key, add_noise=False,
                                          anchors=[r["anchor"] for r in r0])
  shift = float(jnp.linalg.norm(r0[0]["release"] - r1[0]["release"]))
  assert 0.0 < shift <= plan.phases[0].sensitivity, (shift, plan.phases[0].sensitivity)
  assert r0[0]["passed"] and r1[0]["passed"]


def test_alg3_every_step_moves_by_at_most_delta_when_one_user_is_replaced(clean):
  key = jax.random.key(5)
  plan = plan_accelerated_erm(PublicSpec.of(clean), ALG3)
  users = ulf._phase_users(plan, jax.random.split(key)[0], N)[0]
  bad = _replace_user(clean, int(users[0]))
  assert plan_accelerated_erm(PublicSpec.of(bad), ALG3) == plan
  r0 = ulf.user_level_accelerated_erm_releases(clean, ALG3, key, add_noise=False)
  r1 = ulf.user_level_accelerated_erm_releases(   # same query points: replay D's releases
      bad, ALG3, key, add_noise=False, given=[r["updates"] for r in r0],
      anchors=[r["anchor"] for r in r0])
  assert not r0[0]["halted"].any() and not r1[0]["halted"].any()
  shifts = np.linalg.norm(np.asarray(r0[0]["updates"] - r1[0]["updates"]), axis=-1)
  assert shifts.max() <= plan.phases[0].sensitivity, (shifts, plan.phases[0].sensitivity)


def test_alg1_release_noise_has_the_planned_scale(clean):
  """The release's noise std is the plan's sigma (accepts 1x, rejects 0.5x and 1.5x)."""
  key = jax.random.key(6)
  sigma = plan_phased_sgd(PublicSpec.of(clean), ALG1).phases[0].sigma
  pts = jnp.zeros((30, 50))
  keys = jax.random.split(key, 40)
  noise = np.concatenate([np.asarray(ulf._filter_release(
      pts, k, tau=0.1, lap_scale=8.0, threshold=24.0, sigma=sigma)[1]) for k in keys])
  chi = stats.chi2(noise.size)
  for factor, ok in ((1.0, True), (0.5, False), (1.5, False)):
    stat = np.sum(noise ** 2) / (factor * sigma) ** 2
    assert (chi.cdf(stat) > 1e-4 and chi.sf(stat) > 1e-4) == ok


# ------------------------------------------------------------ (c) refusals, paper 000

@pytest.mark.parametrize("rel", ["add_remove", "zero_out", "swap"])
def test_filter_drivers_refuse_other_relations(clean, rel):
  for plan in (plan_phased_sgd, plan_accelerated_erm):
    with pytest.raises(ValueError, match="relation"):
      plan(PublicSpec.of(clean), {**ALG1, "relation": rel})
  with pytest.raises(ValueError, match="relation"):
    solve("user_level_phased_sgd", {**ALG1, "relation": rel}, clean, jax.random.key(0))


def test_explicit_noise_multiplier_over_budget_raises_before_release(clean):
  for name, cfg in (("user_level_phased_sgd", ALG1), ("user_level_accelerated_erm", ALG3)):
    with pytest.raises(PrivacyBudgetExceeded, match="nothing was released"):
      solve(name, {**cfg, "noise_multiplier": 0.5}, clean, jax.random.key(0))
  plan = plan_phased_sgd(PublicSpec.of(clean), {**ALG1, "noise_multiplier": 50.0})
  assert plan.phases[0].sigma == pytest.approx(50.0 * plan.phases[0].sensitivity / 2)
  plan.charge()                                           # well under budget: fine
  with pytest.raises(TypeError, match="debug"):
    plan_phased_sgd(PublicSpec.of(clean), {**ALG1, "debug": "false"})


# ------------------------------------------------------------------------------ paper 001

@pytest.fixture(scope="module")
def sc_problem():
  return op.l2_logistic({"n_users": 120, "m": 8, "d": 2, "l2": 0.5, "radius": 2.0,
                         "n_eval": 500}, jax.random.key(0))


def _flip_user(problem, u):
  y = problem.data["y"].at[u].set(1.0 - problem.data["y"][u])
  return dataclasses.replace(problem, data={**problem.data, "y": y})


def test_naive_noise_and_epsilon_match_the_exact_gaussian_profile(sc_problem):
  res = solve("naive_output_pert", {"epsilon": 1.0, "delta": 1e-5}, sc_problem,
              jax.random.key(1))
  sigma, sens = res.record["sigma"], res.record["sensitivity"]
  assert sigma == pytest.approx(res.record["noise_multiplier"] * sens / 2)

  def profile(s, eps=1.0):   # Balle & Wang: exact delta(eps) of a Gaussian, shift sens
    a, b = sens / (2 * s), eps * s / sens
    return stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b)
  assert profile(sigma) <= 1e-5 < profile(0.97 * sigma)   # (1, 1e-5)-DP, and nearly tight
  indep = _pld_eps(dp_accounting.GaussianDpEvent(sigma / sens), 1e-5)
  assert res.privacy.epsilon == pytest.approx(indep, rel=0.01)
  assert res.privacy.relation == "replace_one" and res.privacy.provenance == "accountant"


def test_naive_release_moves_by_at_most_its_sensitivity(sc_problem):
  cfg = {"epsilon": 1.0, "delta": 1e-5}
  key = jax.random.key(2)
  r0 = op.output_perturbation_releases("naive_output_pert", sc_problem, cfg, key,
                                       add_noise=False)
  r1 = op.output_perturbation_releases("naive_output_pert", _flip_user(sc_problem, 7), cfg,
                                       key, add_noise=False)
  assert r0[0]["sigma"] == r1[0]["sigma"] and r0[0]["sensitivity"] == r1[0]["sensitivity"]
  shift = float(jnp.linalg.norm(r0[0]["release"] - r1[0]["release"]))
  assert 0.0 < shift <= r0[0]["sensitivity"]
  noisy = op.output_perturbation_releases("naive_output_pert", sc_problem, cfg, key)
  res = solve("naive_output_pert", cfg, sc_problem, key)
  np.testing.assert_allclose(np.asarray(op.project_l2_ball(noisy[0]["release"], 2.0)),
                             np.asarray(res.params), atol=1e-6)


def test_output_perturbation_refusals(sc_problem):
  base = {"epsilon": 4.0, "delta": 1e-5, "on_certificate_failure": "raise"}
  for rel in ("add_remove", "zero_out"):
    with pytest.raises(ValueError, match="relation"):
      solve("sc_output_pert", {**base, "relation": rel}, sc_problem, jax.random.key(0))
    with pytest.raises(ValueError, match="relation"):
      solve("naive_output_pert", {**base, "relation": rel}, sc_problem, jax.random.key(0))
  with pytest.raises(PrivacyBudgetExceeded):
    solve("naive_output_pert", {**base, "noise_multiplier": 0.2}, sc_problem,
          jax.random.key(0))
  with pytest.raises(TypeError, match="debug"):
    op.settings_from_cfg({**base, "debug": 1})


def test_sc_output_pert_block_and_release_hook(sc_problem):
  cfg = {"epsilon": 4.0, "delta": 1e-5, "on_certificate_failure": "raise"}
  rel = op.output_perturbation_releases("sc_output_pert", sc_problem, cfg, jax.random.key(3))
  res = solve("sc_output_pert", cfg, sc_problem, jax.random.key(3))
  assert len(rel) == 1 and not rel[0]["bottom"] and rel[0]["sigma"] == res.record["sigma"]
  np.testing.assert_allclose(np.asarray(op.project_l2_ball(rel[0]["release"], 2.0)),
                             np.asarray(res.params), atol=1e-6)
  assert (res.privacy.epsilon, res.privacy.delta) == (4.0, 1e-5)   # Thm 3.3 block
