"""Issue 11 for papers 002 (ReSQue) and 004 (DP-Loc-(S)GD, DP bilevel): relations, plans,
per-step sensitivity, independent accounting, budgets.

What is pinned:
  * replace-one per-step sensitivity (adaptive view): the neighbouring dataset D' (example 0
    replaced by a huge vector opposite to the others) is replayed on D's release history
    (``forced=``) with the same key and the noise off; every per-step release differs by at
    most ``2 C / denominator`` and the adversary gets close to it (the test has power); the
    plan (event, noise std, sampling rate, steps) is identical for D and D'; with the noise on,
    the noise draws coincide (same keys, same Poisson masks);
  * the reported epsilon equals an independent dp_accounting PLD computation (REPLACE_ONE)
    from the released parameters, full batch and Poisson minibatches;
  * ReSQue's approximate-RDP plan: the ledger's epsilon equals Lemma 3 + Corollary 1 by hand,
    and the one calibrator's ``beta`` meets the phase budget;
  * an explicit noise multiplier above the budget raises before anything runs; relations
    other than replace-one are refused with an error naming the relation.
"""

import dataclasses
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant

from dpsco_jax.algorithms.bilevel import driver as bl
from dpsco_jax.algorithms.bilevel import localized_gd as lg
from dpsco_jax.algorithms.resque import driver as rq
from dpsco_jax.algorithms.resque import plan as rq_plan
from dpsco_jax.api import solve
from dpsco_jax.privacy import PrivacyBudgetExceeded, PrivacyLedger

REPLACE = dp_accounting.NeighboringRelation.REPLACE_ONE


def _data(n=24, d=3, seed=0):
  ka, kb = jax.random.split(jax.random.key(seed))
  return {"a": jax.random.normal(ka, (n, d)) + 1.0, "b": jax.random.normal(kb, (n,))}


def _adversarial(data):
  """Replace example 0 by a huge example whose gradient opposes the others'."""
  d = data["a"].shape[1]
  return {"a": data["a"].at[0].set(-1e4 * jnp.ones(d)), "b": data["b"].at[0].set(1e4)}


def _loss(y, ex):
  return 0.5 * jnp.square(jnp.dot(ex["a"], y) - ex["b"])


def _independent_pld(parts, delta):
  """epsilon of ``[(event, count)]`` by a PLD accountant built here (not the ledger)."""
  acc = pld_privacy_accountant.PLDAccountant(REPLACE, 1e-4)
  for ev, c in parts:
    acc.compose(ev, c)
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("batch", [None, 8])
def test_loc_gd_per_step_replace_one_sensitivity(batch):
  n, clip = 24, 1.5
  cfg = lg.LocGDConfig(mu=1.0, clip_norm=clip, noise_multiplier=0.0, rounds=2, steps=12,
                       radius0=3.0, batch_size=batch, step_rule="smooth", smoothness=20.0)
  d0, d1 = _data(n), _adversarial(_data(n))
  rel = jax.jit(lambda data, key, forced: lg.dp_loc_gd_releases(
      _loss, jnp.zeros(3), data, key, cfg, forced=forced))
  key = jax.random.key(1)
  r0 = rel(d0, key, None)
  r1 = rel(d1, key, r0)  # D' queried at D's points (post-processing of D's releases)
  diff = np.linalg.norm(np.asarray(r1 - r0).reshape(-1, 3), axis=1)
  sens = 2 * clip / (n if batch is None else batch)
  assert diff.max() <= sens * (1 + 1e-5)
  assert diff.max() >= 0.35 * sens  # the adversary gets within 3x of the bound (power)
  # The plan is a function of public numbers only: identical for D and D'.
  assert lg.loc_gd_stddev(cfg, n) == lg.loc_gd_stddev(cfg, n)
  z_cfg = dataclasses.replace(cfg, noise_multiplier=2.0)
  assert lg.loc_gd_event(z_cfg, n) == lg.loc_gd_event(z_cfg, n)
  if batch is not None:
    assert lg.loc_gd_event(z_cfg, n).event.sampling_probability == batch / n
  # With the noise on and the same key, D and D' get the same draws and Poisson masks.
  noisy = jax.jit(lambda data, forced: lg.dp_loc_gd_releases(
      _loss, jnp.zeros(3), data, key, z_cfg, forced=forced))
  n0 = noisy(d0, r0)
  n1 = noisy(d1, r0)
  np.testing.assert_allclose(np.asarray(n1 - n0), np.asarray(r1 - r0), atol=1e-4)


def _bilevel_problem(data):
  def f_ex(x, y, ex):
    return 0.5 * jnp.sum(jnp.square(y - ex["a"])) + jnp.dot(x, ex["a"])

  def g_ex(x, y, ex):
    return 0.5 * jnp.sum(jnp.square(y - x - ex["a"]))

  consts = bl.ProblemConstants(l0f=2.0, l1f=1.0, l0g=2.0, l1g=1.0, l2g=1.0, mu_g=1.0)
  return bl.BilevelProblem(name="toy", f_ex=f_ex, g_ex=g_ex, data=data, x0=jnp.zeros(3),
                           y0=jnp.zeros(3), consts=consts, x_radius=5.0,
                           x_center=jnp.zeros(3), y_radius=5.0)


@pytest.mark.parametrize("batch_out", [None, 8])
def test_bilevel_outer_per_step_replace_one_sensitivity(batch_out):
  n, c_out = 24, 2.0
  inner = lg.LocGDConfig(mu=1.0, clip_norm=3.0, noise_multiplier=1.0, rounds=1, steps=5,
                         radius0=5.0)
  bcfg = bl.BilevelConfig(lam=5.0, eta=0.2, steps=10, clip_out=c_out, outer_noise_multiplier=0.0,
                          inner_y=inner, inner_lam=inner, batch_out=batch_out)
  p0, p1 = _bilevel_problem(_data(n)), _bilevel_problem(_adversarial(_data(n)))
  key = jax.random.key(2)
  r0 = jax.jit(lambda k: bl.dp_bilevel_releases(p0, bcfg, k))(key)
  r1 = jax.jit(lambda k, f: bl.dp_bilevel_releases(p1, bcfg, k, forced=f))(key, r0)
  diff = np.linalg.norm(np.asarray(r1.outer - r0.outer), axis=1)
  sens = 2 * c_out / (n if batch_out is None else batch_out)
  assert diff.max() <= sens * (1 + 1e-5)
  assert diff.max() >= 0.35 * sens
  # The plan (events) is built from bcfg and the public n only.
  noisy = dataclasses.replace(bcfg, outer_noise_multiplier=1.0)
  assert bl.bilevel_events(noisy, n) == bl.bilevel_events(noisy, n)
  with pytest.raises(ValueError, match="not private"):
    bl.bilevel_events(bcfg, n)  # a zero outer multiplier has no privacy event


@pytest.mark.parametrize("batch", [None, 20])
def test_loc_gd_reported_epsilon_matches_independent_pld(batch):
  from dpsco_jax.problems import least_squares
  prob = least_squares(n_users=50, m=2, d=3, key=jax.random.key(0), radius=2.0, n_eval=100)
  cfg = {"epsilon": 2.0, "delta": 1e-6, "mu": 0.5, "clip_norm": 2.0, "num_steps": 40, "rounds": 2,
         "batch_size": batch}
  res = solve("dp_loc_gd", cfg, prob, jax.random.key(1))
  z, n = res.record["noise_multiplier"], 100
  step = dp_accounting.GaussianDpEvent(z)
  if batch is not None:
    step = dp_accounting.PoissonSampledDpEvent(batch / n, step)
  indep = _independent_pld([(step, 80)], 1e-6)
  assert res.privacy.epsilon == pytest.approx(indep, rel=1e-2)
  assert res.privacy.epsilon <= 2.0 * (1 + 1e-6) and res.privacy.relation == "replace_one"


def test_bilevel_reported_epsilon_matches_independent_pld():
  prob = bl.synthetic_ridge_problem(jax.random.key(0), d=3, n_train=40, n_val=40)
  cfg = {"epsilon": 2.0, "delta": 1e-6, "num_steps": 3, "inner_num_steps": 20,
         "inner_rounds": 1, "outer_noise": True, "inner_batch_size": 16, "outer_batch_size": 16}
  bcfg, _ = bl.bilevel_config(prob, cfg)
  res = solve("dp_bilevel", cfg, prob, jax.random.key(1))
  n, rec = 80, res.record
  zy = rec["inner_y_noise_std"] * 16 / bcfg.inner_y.clip_norm
  zl = rec["inner_lam_noise_std"] * 16 / bcfg.inner_lam.clip_norm
  zo = rec["outer_noise_std"] * 16 / bcfg.clip_out
  ps = lambda z: dp_accounting.PoissonSampledDpEvent(16 / n, dp_accounting.GaussianDpEvent(z))
  indep = _independent_pld([(ps(zy), 60), (ps(zl), 60), (ps(zo), 3)], 1e-6)
  assert res.privacy.epsilon == pytest.approx(indep, rel=1e-2)
  assert res.privacy.epsilon <= 2.0 * (1 + 1e-6)


def test_resque_plan_epsilon_is_lemma3_plus_corollary1():
  kw = dict(n_i=2048, i=1, eps_i=1.0, delta_i=1e-5, d=3, L=1.0, R=1.0, eta_loc=0.01,
            ratio=2.0, constants="c_priv", c_priv=1.0)
  p = rq_plan.phase_plan({"epsilon": 1.0, "delta": 1e-5, "rho": 0.05, "max_iter": 2,
                           "max_bisection": 1, "T_frac": 1 / 64}, **kw)
  events = rq.approx_rdp_events(p["plan"], beta=p["beta"], **p["kw"])
  ledger = PrivacyLedger(delta=1e-9, epsilon_budget=1.0, relation="replace_one")
  for ev in events:
    ledger.spend(ev, label="alg4")
  alpha, dprime = p["alpha"], p["delta_prime"]
  eps_hand = sum(ev.epsilon_rdp for ev in events) + math.log(1 / dprime) / (alpha - 1)
  assert ledger.epsilon(exact=True) == pytest.approx(eps_hand, rel=1e-12)
  assert 1.0 * (1 - 1e-5) <= ledger.epsilon(exact=True) <= 1.0 * (1 + 1e-9)  # calibrated to the phase
  delta_hand = dprime + (1 + math.exp(eps_hand)) * len(events) * p["delta_call"]
  assert ledger.extra_delta() == pytest.approx(delta_hand, rel=1e-9)
  assert ledger.extra_delta() <= 1e-5


def test_budget_and_relation_are_enforced_before_release():
  from dpsco_jax.problems import least_squares
  prob = least_squares(n_users=20, m=2, d=3, key=jax.random.key(0), radius=2.0, n_eval=10)
  base = {"epsilon": 1.0, "delta": 1e-6, "mu": 0.5, "num_steps": 20, "rounds": 1}
  with pytest.raises(PrivacyBudgetExceeded):
    solve("dp_loc_gd", dict(base, noise_multiplier=0.5), prob, jax.random.key(1))
  ok = solve("dp_loc_gd", dict(base, noise_multiplier=500.0), prob, jax.random.key(1))
  assert ok.privacy.epsilon < 1.0 and ok.record["noise_multiplier"] == 500.0
  for rel in ("add_remove", "zero_out"):
    with pytest.raises(ValueError, match="relation"):
      solve("dp_loc_gd", dict(base, relation=rel), prob, jax.random.key(1))
  ridge = bl.synthetic_ridge_problem(jax.random.key(0), d=2, n_train=20, n_val=20)
  bcfg = {"epsilon": 1.0, "delta": 1e-6, "num_steps": 2, "inner_num_steps": 10,
          "inner_rounds": 1}
  with pytest.raises(PrivacyBudgetExceeded):
    solve("dp_bilevel", dict(bcfg, noise_multiplier=0.3), ridge, jax.random.key(1))
  with pytest.raises(ValueError, match="relation"):
    bl.bilevel_config(ridge, dict(bcfg, relation="add_remove"))
  with pytest.raises(ValueError, match="relation"):
    solve("resque_private_sco", {"epsilon": 1.0, "delta": 1e-5, "relation": "zero_out"}, prob,
          jax.random.key(1))
