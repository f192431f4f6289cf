"""Baselines over the engine: noise-off convergence to the known optimum, risk vs epsilon,
group-privacy targets, Poisson truncation accounting."""

import math

import jax
import numpy as np
import pytest

from dpsco_jax import problems
from dpsco_jax import api
from dpsco_jax.api import solve
from dpsco_jax.algorithms.dpsgd import driver as baselines
from dpsco_jax.algorithms.dpsgd.config import SgdSchedule
from dpsco_jax.algorithms.common import (poisson_capacity, poisson_truncation_probability,
                                         sample_users)


@pytest.fixture(scope="module")
def lsq():
  return problems.make("least_squares", n_users=200, m=4, d=5, radius=2.0, noise=0.3,
                       key=jax.random.key(0))


# n_users: declared public (the runner passes the problem's n_users)
BASE = dict(epsilon=1.0, delta=1e-5, epochs=30, batch_size=20, learning_rate=2.0,
            averaging="none", n_users=200)


@pytest.mark.parametrize("name", ["nonprivate_sgd", "dp_sgd_user", "dp_sgd_item"])
def test_noise_off_reaches_known_optimum(lsq, name):
  """Full-batch, noise off: every baseline converges to the exact ERM minimizer (lstsq)."""
  x = np.asarray(lsq.data["x"]).reshape(-1, 5)
  y = np.asarray(lsq.data["y"]).reshape(-1)
  w_erm = np.linalg.lstsq(x, y, rcond=None)[0]
  # noise off is only allowed without an epsilon budget (an epsilon is a budget, never exceeded)
  cfg = dict(BASE, epsilon=None, noise_multiplier=0.0, clip_norm=100.0, sampling="full",
             num_steps=400, learning_rate=4.0)
  if name == "nonprivate_sgd":   # it reads the schedule's keys only (any other is refused)
    cfg = {k: v for k, v in cfg.items() if k in SgdSchedule.__dataclass_fields__}
  res = solve(name, cfg, lsq, jax.random.key(1))
  np.testing.assert_allclose(np.asarray(res.params), w_erm, atol=2e-3)
  # and the ERM minimizer is within the statistical error of the population optimum
  assert lsq.excess_risk(res.params) < 1e-2 * lsq.excess_risk(lsq.init_params())
  assert res.privacy.provenance == "none" and math.isinf(res.privacy.epsilon)


@pytest.mark.slow
def test_excess_risk_falls_as_epsilon_grows(lsq):
  risks = []
  for eps in (0.1, 1.0, 10.0):
    cfg = dict(BASE, epsilon=eps, clip_norm=1.0, epochs=10, averaging="uniform",
               learning_rate=1.0)
    # one plan (one calibration search) per epsilon, run with two seeds
    plan = api.plan_problem("dp_sgd_user", cfg, lsq)
    first, again = (api.execute(plan, lsq, jax.random.key(s)) for s in (0, 1))
    risks.append(float(np.mean([lsq.excess_risk(r.params) for r in (first, again)])))
  assert risks[0] > risks[1] > risks[2], risks


def test_reports_guarantee_and_group_privacy(lsq):
  cfg = dict(BASE, epsilon=2.0, clip_norm=1.0, epochs=2)
  res = solve("dp_sgd_user", cfg, lsq, jax.random.key(0))
  assert res.privacy.provenance == "accountant" and res.privacy.level == "user"
  assert res.privacy.epsilon == pytest.approx(2.0, rel=1e-3)
  assert res.privacy.delta >= 1e-5 and res.privacy.delta < 1.1e-5
  assert res.debug is None
  grp = solve("dp_sgd_group", cfg, lsq, jax.random.key(0))
  assert grp.privacy.level == "user" and grp.privacy.epsilon <= 2.0
  assert grp.privacy.epsilon == pytest.approx(2.0, rel=1e-3)
  assert "group privacy" in grp.privacy.notes
  # the item-level run behind it is noisier: eps/m per item
  assert grp.record["noise_multiplier"] > res.record["noise_multiplier"]
  eps_i, delta_i = baselines.group_privacy_targets(2.0, 1e-5, 4)
  assert eps_i == 0.5
  # group privacy: (k eps', k e^{(k-1) eps'} delta') = (eps, delta)
  assert 4 * math.exp(3 * eps_i) * delta_i == pytest.approx(1e-5)


def test_poisson_sampling_capacity_and_truncation():
  n, q = 1000, 0.05
  cap = poisson_capacity(n, q)
  assert poisson_truncation_probability(n, q, cap, steps=1000) < 1e-9
  idx, mask = jax.jit(lambda k: sample_users(k, n, sampling="poisson", batch=50,
                                             capacity=cap))(jax.random.key(3))
  assert idx.shape == (cap,) and mask.shape == (cap,)
  chosen = np.asarray(idx)[np.asarray(mask)]
  assert len(set(chosen.tolist())) == len(chosen)  # no user twice in one step
  sizes = [int(sample_users(jax.random.key(s), n, sampling="poisson", batch=50,
                            capacity=cap)[1].sum()) for s in range(30)]
  assert abs(np.mean(sizes) - 50) < 5


@pytest.mark.parametrize("cfg,name", [
    (dict(epsilon=0.0, delta=1e-5, n_users=200), "epsilon"),
    (dict(epsilon=1.0, delta=1.5, n_users=200), "delta"),
    (dict(epsilon=1.0, delta=1e-5, clip_norm=-1.0, n_users=200), "clip_norm"),
    (dict(epsilon=1.0, delta=1e-5, batch_size=10_000, n_users=200), "batch_size"),
    (dict(epsilon=1.0, n_users=200), "delta is required"),  # no silent default delta
    (dict(epsilon=1.0, delta=1e-5, sampling="fixed", relation="add_remove"), "relation"),
    (dict(epsilon=1.0, delta=1e-5, sampling="bootstrap"), "sampling"),
    (dict(epsilon=True, delta=1e-5, n_users=200), "epsilon"),  # a bool is not a number
    (dict(epsilon=1.0, delta=1e-5), "n_users"),  # add_remove needs a declared n_users
    (dict(noise_multiplier=1.0, delta=1e-5, n_users=100), "n_users"),  # fewer than the data
    (dict(epsilon=1.0, delta=1e-5, n_users=200, sampling_rate=1.5), "sampling_rate"),
    (dict(delta=1e-5, n_users=200), "epsilon"),  # neither epsilon nor noise_multiplier
    (dict(epsilon=1.0, delta=1e-5, n_users=200, noise_multiplier=-1.0), "noise_multiplier"),
    (dict(epsilon=1.0, delta=1e-5, sampling="full", relation="adjacent"), "relation")])
def test_invalid_configs_raise(lsq, cfg, name):
  with pytest.raises((ValueError, TypeError), match=name):
    solve("dp_sgd_user", cfg, lsq, jax.random.key(0))
