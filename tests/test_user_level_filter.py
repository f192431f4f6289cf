"""Paper 000 drivers: Algorithm 1, Algorithms 2-3, the smoothed variant, schedules, accounting.

Spec 000 §6.4 tests 7, 9, 10, 14, 15, 17. Runs share jit compilations (same static phase
configuration) through module-scoped fixtures.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpsco_jax.algorithms.user_level_filter.driver import (_filter_release,
                                                    corrupt_users, hinge_problem)
from dpsco_jax.api import solve
from dpsco_jax.algorithms.user_level_filter.schedules import (alg1_schedule, alg3_schedule,
                                                       certified_sensitivity,
                                                       flip_count_bound, hoeffding_tau,
                                                       phase_sizes)
from dpsco_jax.problems import make

N, M, D = 600, 16, 4
BASE = {"epsilon": 2.0, "delta": 1e-6, "num_phases": 1, "sensitivity": "typical",
        "debug": True}


@pytest.fixture(scope="module")
def clean():
  return make("logistic", n_users=N, m=M, d=D, key=jax.random.key(0))


@pytest.fixture(scope="module")
def alg3_runs(clean):
  """Same seed, same static config (one compile): clean, 5% flipped, 5% huge, 30% huge."""
  out = {}
  probs = {
      "clean": clean,
      "flip5": corrupt_users(clean, 0.05, mode="flip", key=jax.random.key(5)),
      "huge5": corrupt_users(clean, 0.05, mode="huge", key=jax.random.key(6)),
      "huge30": corrupt_users(clean, 0.30, mode="huge", key=jax.random.key(7)),
  }
  for name, prob in probs.items():
    out[name] = (prob, solve("user_level_accelerated_erm", BASE, prob, jax.random.key(42)))
  return out


# ------------------------------------------------------------------------------ schedules

@pytest.mark.filterwarnings("ignore::UserWarning")
def test_alg1_theory_schedule_matches_closed_forms():
  n, m, d, eps, delta, L, R = 10 ** 6, 100, 10, 1.0, 1e-8, 1.0, 1.0
  s = alg1_schedule(n=n, m=m, d=d, epsilon=eps, delta=delta, lipschitz=L, radius=R,
                    smoothness=1.0, preset="theory", q_exp=0.1)
  c = math.floor(100 * math.log(20 * n * m * math.e / delta))
  assert s.num_groups == c and 4000 < c < 4200           # spec 000 §2.2 scale check: ~4084
  assert s.laplace_scale == 20.0 and s.threshold == pytest.approx(0.8 * c)
  eta = R / (L * math.sqrt(d * m * n * eps))
  assert s.eta == pytest.approx(eta)
  p = 1.5 + 1.0                                           # J = max(1, log m / log n) = 1
  assert len(s.phases) == 19                              # floor(log2 1e6)
  for ph in s.phases[:3]:
    n_i = math.floor((1 - 2 ** -0.1) * n / 2 ** (0.1 * ph.index))
    assert ph.n_users == n_i and ph.users_per_group == n_i // c
    assert ph.steps == (n_i // c) * m
    assert ph.eta == pytest.approx(eta / 2 ** (p * ph.index))
    tau = 1000 * ph.eta * L * math.sqrt(ph.steps) * math.log(n * d * m)
    assert ph.tau == pytest.approx(tau)
    assert ph.sigma_paper == pytest.approx(100 * tau * math.log(n / delta) ** 2 / (eps * c))
  assert sum(ph.n_users for ph in s.phases) <= n * 2 ** -0.1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_theory_preconditions_raise_with_the_condition_named():
  kw = dict(m=16, d=5, delta=1e-6, lipschitz=1.0, radius=2.0, smoothness=0.25,
            preset="theory")
  with pytest.raises(ValueError, match="N_i >= 1"):    # C ~ 100 log(m) outgrows n_i / 1
    alg1_schedule(n=10 ** 6, epsilon=1.0, **{**kw, "m": 10 ** 80})
  with pytest.raises(ValueError, match=r"n\^\(1-q_exp\)"):
    alg1_schedule(n=2_000, epsilon=1.0, **kw)
  with pytest.raises(ValueError, match="epsilon <= 10"):
    alg3_schedule(n=10 ** 6, epsilon=11.0, **kw)
  with pytest.raises(ValueError, match="K_i <= n_i"):
    alg3_schedule(n=10 ** 6, epsilon=1.0, **kw)
  with pytest.raises(ValueError, match="preset"):
    alg3_schedule(n=10 ** 6, epsilon=1.0, **{**kw, "preset": "fast"})


def test_practical_schedules_and_helpers():
  assert phase_sizes(1000, 3, 1.0, use_all=True) == [571, 285, 142]
  assert phase_sizes(1000, 2, 1.0, use_all=False) == [250, 125]   # paper: n_i, q = 1
  s = alg3_schedule(n=2000, m=64, d=10, epsilon=1.0, delta=1e-6, lipschitz=1.0, radius=2.0,
                    smoothness=0.25, batch_size=300)
  lam = 0.5 * (1 / math.sqrt(2000 * 64) + math.sqrt(10) / (2000 * 8))
  assert s.lam == pytest.approx(lam)
  for ph in s.phases:
    assert ph.lam == pytest.approx(lam * 2 ** ph.index)
    assert ph.batch == min(300, ph.n_users)
    assert ph.steps == math.ceil((1 + math.sqrt(0.25 / ph.lam)) * math.log(2000 * 10 * 64))
  assert (s.threshold_scale, s.query_scale) == (8.0, 16.0)
  # tau shrinks like 1/sqrt(m) and is capped at L.
  assert hoeffding_tau(1.0, 1, 1e5, 1e-3) == 1.0
  assert hoeffding_tau(1.0, 400, 1e5, 1e-3, 0.25) == pytest.approx(
      2 * hoeffding_tau(1.0, 1600, 1e5, 1e-3, 0.25))
  sm = alg3_schedule(n=2000, m=64, d=10, epsilon=1.0, delta=1e-6, lipschitz=1.0, radius=2.0,
                     smoothness=math.inf)
  r = math.sqrt(10) * 2.0 / (2000 * 8)                     # Thm D.3
  assert sm.smoothing_radius == pytest.approx(r) and sm.smoothness == pytest.approx(
      math.sqrt(10) / r)


def test_flip_count_and_certified_sensitivity():
  for zeta in (1e-3, 1e-9):
    k = flip_count_bound(zeta)
    # exact tail of a sum of 400 Bernoulli(6/400) (total mean 6) at the returned k
    assert stats.binom.sf(k - 1, 400, 6 / 400) <= zeta
    assert stats.binom.sf(k - 3, 400, 6 / 400) > zeta / 1e3   # and not absurdly loose
  k = flip_count_bound(1e-6)
  assert certified_sensitivity(1.0, 600, 1e-6, min_kept_fraction=0.1) == pytest.approx(
      4 * (1 + k) / 60)
  with pytest.raises(ValueError, match="num_points"):
    certified_sensitivity(1.0, 50, 1e-6, min_kept_fraction=0.1)


# -------------------------------------------------------------------- statistical / noise

@pytest.mark.slow
def test_output_perturbation_has_the_stated_scale():
  """Alg. 1 line 25 through the driver's jitted release: std = sigma; rejects 0.5x / 1.5x."""
  pts = jnp.ones((30, 3)) * 0.2
  sigma = 0.7
  keys = jax.random.split(jax.random.key(3), 1500)
  passed, x, _ = jax.vmap(lambda k: _filter_release(pts, k, tau=0.1, lap_scale=8.0,
                                                    threshold=24.0, sigma=sigma))(keys)
  noise = np.asarray(x - 0.2).ravel()
  # P(pass) = 1 - P(Lap(8) < -6) = 1 - exp(-6/8)/2 (score 30 vs threshold 24)
  assert abs(np.mean(np.asarray(passed)) - (1 - 0.5 * math.exp(-0.75))) < 0.05
  chi = stats.chi2(noise.size)
  for factor, ok in ((1.0, True), (0.5, False), (1.5, False)):
    stat = np.sum(noise ** 2) / (factor * sigma) ** 2
    assert (chi.cdf(stat) > 1e-4 and chi.sf(stat) > 1e-4) == ok


# ------------------------------------------------------------------- Algorithm 3 behaviour

@pytest.mark.slow
def test_iid_users_keep_everyone_and_never_halt(alg3_runs):
  prob, res = alg3_runs["clean"]
  d = res.debug["phases"][0]
  assert res.record["halted_phase"] is None and not d["halted"]
  assert d["steps_run"] == res.record["phases"][0]["num_steps"]
  assert d["steps_all_kept"] / d["steps_run"] > 0.99
  assert float(jnp.linalg.norm(res.params)) <= prob.radius + 1e-5
  assert res.privacy.provenance == "heuristic"           # typical sensitivity: never a proof
  assert res.privacy.epsilon == pytest.approx(BASE["epsilon"], abs=1e-6)


@pytest.mark.slow
def test_five_percent_adversarial_users_are_removed(alg3_runs):
  _, ref = alg3_runs["clean"]
  for name in ("flip5", "huge5"):
    prob, res = alg3_runs[name]
    assert res.record["halted_phase"] is None
    d = res.debug["phases"][0]
    if name == "huge5":
      assert d["steps_all_kept"] == 0                     # the outliers were dropped
    # flipped labels move a user's mean gradient by ~0.3 < 2 tau: kept, and harmless
    dist = float(jnp.linalg.norm(res.params - ref.params))
    assert dist < 0.1 * prob.radius, (name, dist)
    assert prob.excess_risk(res.params) <= prob.excess_risk(ref.params) + 5e-3


@pytest.mark.slow
def test_thirty_percent_adversarial_users_halt_to_fallback(alg3_runs):
  prob, res = alg3_runs["huge30"]
  assert res.record["halted_phase"] == 1
  chex.assert_trees_all_close(res.params, jnp.zeros(D))
  assert res.debug["phases"][0]["steps_run"] <= 1


@pytest.mark.slow
def test_noise_free_alg3_reaches_optimum(clean):
  res = solve("user_level_accelerated_erm", {**BASE, "privacy_noise": False}, clean,
              jax.random.key(1))
  gap = clean.excess_risk(res.params)
  assert 0 <= gap + 1e-6 and gap <= 1.0 / math.sqrt(N * M), gap
  assert float(jnp.linalg.norm(res.params)) <= clean.radius + 1e-5
  assert res.privacy.epsilon == math.inf and res.privacy.provenance == "none"
  assert res.gradient_evaluations == res.record["phases"][0]["num_steps"] * N * M


@pytest.mark.slow
def test_smoothed_alg3_on_hinge_noise_free():
  prob = hinge_problem(n_users=200, m=4, d=3, key=jax.random.key(2), n_eval=800)
  cfg = {**BASE, "privacy_noise": False, "smoothing_radius": 0.05, "max_steps": 80}
  res = solve("user_level_accelerated_erm_smoothed", cfg, prob, jax.random.key(3))
  assert res.record["smoothness"] == pytest.approx(math.sqrt(3) / 0.05)   # L sqrt(d) / r
  assert res.record["phases"][0]["num_steps"] == 80
  gap = prob.excess_risk(res.params)
  assert gap <= 1.0 / math.sqrt(200 * 4) + 0.05, gap                    # + L r bias
  assert gap < 0.25 * prob.excess_risk(jnp.zeros(3))


# --------------------------------------------------------------------------- Algorithm 1

@pytest.mark.slow
def test_alg1_iid_keeps_all_groups_and_30_percent_halts(clean):
  """Lemma 2.3 empirically (independent group iterates within tau_i); with 30% huge users
  ~88% of the groups are corrupted and the one-shot Laplace test halts to the fallback."""
  cfg = {**BASE, "num_groups": 100, "learning_rate": 0.05}          # 6 users per group
  res = solve("user_level_phased_sgd", cfg, clean, jax.random.key(4))
  assert res.record["halted_phase"] is None
  assert res.debug["scores"] == [100.0]                   # every pair of iterates within tau
  assert res.gradient_evaluations <= N * M                 # linear time
  assert float(jnp.linalg.norm(res.params)) <= clean.radius + 1e-5
  assert clean.excess_risk(res.params) < clean.excess_risk(jnp.zeros(D))
  bad = corrupt_users(clean, 0.30, mode="huge", key=jax.random.key(8))
  res_bad = solve("user_level_phased_sgd", cfg, bad, jax.random.key(4))
  assert res_bad.record["halted_phase"] == 1
  chex.assert_trees_all_close(res_bad.params, jnp.zeros(D))


# ------------------------------------------------------------------- accounting and inputs

def test_accounting_events_and_provenance_rules():
  """Subsampling without replacement (K of n_i) amplifies; the provenance rule says
  'accountant' only when the bad events fit in delta/2, with the reason otherwise."""
  from dpsco_jax.algorithms.user_level_filter.plan import gauss_event, provenance_note
  from dpsco_jax.algorithms.user_level_filter.schedules import good_event_failure
  from dpsco_jax.privacy.ledger import epsilon_of
  kw = dict(delta=5e-7, relation="replace_one", accountant="rdp")
  full = epsilon_of(gauss_event(10.0, 600, 600, 60), **kw)
  sub = epsilon_of(gauss_event(10.0, 600, 30, 60), **kw)
  assert sub < 0.5 * full
  # Lemma C.2's event at K = 600 (eps = 1): far from negligible -> heuristic
  bad = good_event_failure(600, 8.0, 16.0, 60, 1 / 20)
  assert bad > 0.1 and provenance_note(bad, 5e-7)[0] == "heuristic"
  # at K = 2e5 the margins K/20 dwarf the noise -> accountant
  bad = good_event_failure(200_000, 8.0, 16.0, 60, 1 / 20)
  assert bad < 1e-9 and provenance_note(bad, 5e-7)[0] == "accountant"


def test_bad_inputs_raise_named_errors(clean):
  with pytest.raises(ValueError, match="epsilon"):
    solve("user_level_accelerated_erm", {**BASE, "epsilon": 0.0}, clean, jax.random.key(0))
  with pytest.raises(ValueError, match="delta"):
    solve("user_level_phased_sgd", {**BASE, "delta": 1.5}, clean, jax.random.key(0))
  with pytest.raises(ValueError, match="sensitivity"):
    solve("user_level_accelerated_erm", {**BASE, "sensitivity": "exact"}, clean,
          jax.random.key(0))
  with pytest.raises(ValueError, match="preset"):
    solve("user_level_accelerated_erm", {**BASE, "preset": "fast"}, clean, jax.random.key(0))
  with pytest.raises(ValueError, match="N_i >= 1"):
    solve("user_level_phased_sgd", {**BASE, "num_groups": 1000}, clean, jax.random.key(0))
  with pytest.raises(ValueError, match="num_points"):       # certified Delta needs K >> flips
    solve("user_level_accelerated_erm", {**BASE, "sensitivity": "certified",
                                         "batch_size": 100}, clean, jax.random.key(0))
  with pytest.raises(ValueError, match="fraction"):
    corrupt_users(clean, 1.2, key=jax.random.key(0))
  from dpsco_jax.algorithms.registry import algorithms
  from dpsco_jax.problems import problems
  assert {n for n, e in algorithms().items() if e.paper == "000"} == {
      "user_level_phased_sgd", "user_level_accelerated_erm", "user_level_accelerated_erm_smoothed"}
  assert {"logistic_corrupted", "hinge"} <= set(problems())
