"""Paper 003 privacy contract (issue 11, point 3): relations, sensitivity, accounting, budget.

(a) neighbouring datasets per driver and relation: at the same (replayed) query points and with
    the noise switched off, every per-step release moves by at most the plan's sensitivity,
    only from the victim's batch on, and the bound is attained (zero-out C/B, replace-one
    2C/B); removal (add/remove) re-batches the stream and is refused;
(b) the reported epsilon equals an independent dp_accounting / exact GDP computation;
(c) an explicit noise multiplier above the budget (0 included) and unsupported relations raise.
"""

import dataclasses
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from scipy.stats import norm

from dpsco_jax import problems
from dpsco_jax.algorithms.srgd import driver as srgd
from dpsco_jax.algorithms.srgd.plan import plan_for_problem
from dpsco_jax.api import solve
from dpsco_jax.privacy import PrivacyBudgetExceeded

NAMES = tuple(srgd.VARIANTS)
N, D, B, T, C = 20, 3, 4, 5, 1e-3     # C tiny: every row is clipped, so bounds are attained
VICTIM = 2 * B + 1                    # lives in batch t = 2
PUBLIC = dict(n=N, p=D, lipschitz=1.0, smoothness=1.0, radius=1.0)


def _plan(name, relation, **extra):
  cfg = {"relation": relation, "batch_size": B, "num_steps": T, "clip_norm": C, "beta": 5.0,
         "noise_multiplier": 2.0, "delta": 1.0 / N ** 2, **extra}
  return srgd.plan_srgd(name, cfg, **PUBLIC)


def _data():
  kx, ky = jax.random.split(jax.random.key(3))
  return {"x": jax.random.normal(kx, (N, 1, D)), "y": jax.random.normal(ky, (N, 1))}


def _problem(n, d):
  return problems.make("least_squares", n_users=n, m=1, d=d, key=jax.random.key(n),
                       n_eval=64)


def _norms(a, b):
  return np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64), axis=1)


def _victim_direction(plan, data, query):
  """Sign of the victim's (unclipped) row at its step: rows are multiples of x (least
  squares), so an adversary flips that sign with a huge label."""
  x, y = data["x"][VICTIM, 0], data["y"][VICTIM, 0]
  t = VICTIM // B
  r = lambda w: float(jnp.dot(x, w) - y)
  if not plan.srg:
    return math.copysign(1.0, r(query[t]))
  return math.copysign(1.0, (t + 1) * r(query[t]) - t * r(query[max(t - 1, 0)]))


def _neighbour(relation, plan, data, query):
  if relation == "zero_out":
    return data, jnp.ones(N, bool).at[VICTIM].set(False)
  sign = _victim_direction(plan, data, query)   # replace: a huge example pointing the other way
  return {"x": data["x"], "y": data["y"].at[VICTIM, 0].add(sign * 1e4)}, None


@pytest.mark.parametrize("name", NAMES)
def test_every_release_moves_by_at_most_the_plans_sensitivity_and_the_bound_is_attained(name):
  data, x0, key = _data(), jnp.zeros(D), jax.random.key(0)
  loss = problems.least_squares_loss
  for relation, factor in (("zero_out", 1.0), ("replace_one", 2.0)):
    plan = _plan(name, relation)
    assert plan.sensitivity == pytest.approx(factor * C / B)
    assert plan.noise_std == pytest.approx(2.0 * C / B)   # the stage never doubles the noise
    ref = srgd.srgd_releases(plan, loss, data, x0, key, add_noise=False)
    other, mask = _neighbour(relation, plan, data, ref["query"])
    nb = srgd.srgd_releases(plan, loss, other, x0, key, user_mask=mask, points=ref["query"],
                            add_noise=False)
    np.testing.assert_array_equal(nb["query"], ref["query"])       # replayed, non-adaptive
    diff = _norms(ref["release"], nb["release"])
    t_v = VICTIM // B
    assert np.all(diff[:t_v] == 0.0), diff                         # nothing before its batch
    assert np.all(diff <= plan.sensitivity * (1 + 1e-4)), (relation, diff)
    assert diff[t_v] == pytest.approx(plan.sensitivity, rel=1e-3)  # the bound is tight
    if not plan.srg:                                               # DP-SGD: one increment
      assert np.all(diff[t_v + 1:] == 0.0)


def test_noise_is_data_independent_given_the_key():
  """Same key, neighbours, noise on: the releases differ exactly by the noiseless difference
  (the noise scale and stream do not depend on the data)."""
  plan, data, x0, key = _plan("accelerated_dp_srgd", "zero_out"), _data(), jnp.zeros(D), \
      jax.random.key(5)
  loss = problems.least_squares_loss
  mask = jnp.ones(N, bool).at[VICTIM].set(False)
  q = srgd.srgd_releases(plan, loss, data, x0, key, add_noise=False)["query"]
  run = lambda m, noisy: np.asarray(srgd.srgd_releases(
      plan, loss, data, x0, key, user_mask=m, points=q, add_noise=noisy)["release"], np.float64)
  noisy_diff = run(None, True) - run(mask, True)
  clean_diff = run(None, False) - run(mask, False)
  np.testing.assert_allclose(noisy_diff, clean_diff, atol=1e-5)
  noise = run(None, True) - run(None, False)                 # N_t: Var = popcount(t+1) std^2
  ratio = np.mean(noise ** 2) / (np.mean([bin(t + 1).count("1") for t in range(T)])
                                 * plan.noise_std ** 2)
  assert 0.3 < ratio < 3.0, ratio                           # the planned scale, really there


def test_removal_rebatches_the_stream_so_add_remove_is_refused():
  """The broken twin: removing one example (what add/remove means) from the consecutive
  batching changes every later batch, not one increment — the issue-11 bug. The drivers
  therefore refuse add_remove and point to zero_out."""
  plan, x0, key = _plan("single_epoch_dp_sgd", "zero_out"), jnp.zeros(D), jax.random.key(0)
  kx, ky = jax.random.split(jax.random.key(4))
  big = {"x": jax.random.normal(kx, (N + 1, 1, D)), "y": jax.random.normal(ky, (N + 1, 1))}
  removed = jax.tree.map(lambda a: jnp.delete(a, VICTIM, axis=0), big)
  loss = problems.least_squares_loss
  ref = srgd.srgd_releases(plan, loss, big, x0, key, add_noise=False)
  nb = srgd.srgd_releases(plan, loss, removed, x0, key, points=ref["query"], add_noise=False)
  diff = _norms(ref["release"], nb["release"])
  assert np.sum(diff > 0) >= 2 and diff.sum() > 2 * C / B   # several increments move
  prob = _problem(16, 2)
  for name in NAMES:
    with pytest.raises(ValueError, match="zero_out"):
      srgd.plan_srgd(name, {"relation": "add_remove", "epsilon": 1.0, "delta": 1e-6}, **PUBLIC)
    with pytest.raises(ValueError, match="add_remove"):
      solve(name, {"relation": "add_remove", "epsilon": 1.0, "delta": 1e-6}, prob,
            jax.random.key(0))


def test_the_plan_is_data_free_and_identical_on_neighbours():
  prob = _problem(64, 3)
  cfg = {"epsilon": 1.0, "delta": 1e-6, "relation": "replace_one"}
  plan = plan_for_problem("accelerated_dp_srgd", prob, cfg)
  no_data = dataclasses.replace(prob, data=None, loss_fn=None)     # data never read
  other = dataclasses.replace(prob, data=jax.tree.map(lambda a: a.at[5].set(1e3), prob.data))
  assert plan_for_problem("accelerated_dp_srgd", no_data, cfg) == plan
  assert plan_for_problem("accelerated_dp_srgd", other, cfg) == plan
  assert (plan.params.num_steps, plan.params.batch_size) == (8, 8)
  assert plan.relation == "replace_one" and "number of users" in plan.public


# ----------------------------------------------------------------------------- (b) epsilon
def _gdp_delta(eps, mu):
  return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("relation, dp_relation", [
    ("zero_out", dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE),
    ("replace_one", dp_accounting.NeighboringRelation.REPLACE_ONE)])
def test_reported_epsilon_matches_an_independent_accountant(relation, dp_relation):
  prob = _problem(100, 2)
  delta = 1e-6
  for name in ("accelerated_dp_srgd", "single_epoch_dp_sgd"):
    res = solve(name, {"epsilon": 1.0, "delta": delta, "relation": relation}, prob,
                jax.random.key(1))
    rec = res.record
    z, T = rec["noise_multiplier"], rec["num_steps"]
    levels = T.bit_length() if name == "accelerated_dp_srgd" else 1
    assert rec["tree_levels"] == levels and (T, rec["batch_size"]) == (10, 10)
    assert res.privacy.relation == relation and res.privacy.provenance == "accountant"
    acc = pld_privacy_accountant.PLDAccountant(dp_relation)
    acc.compose(dp_accounting.GaussianDpEvent(z / math.sqrt(levels)))
    independent = acc.get_epsilon(delta)
    assert res.privacy.epsilon == pytest.approx(independent, rel=2e-3)
    assert res.privacy.epsilon == pytest.approx(1.0, rel=1e-2)  # calibrated to the target
    mu = (2.0 if relation == "replace_one" else 1.0) * math.sqrt(levels) / z
    assert _gdp_delta(1.0, mu) == pytest.approx(delta, rel=5e-2)  # exact GDP curve agrees
    assert _gdp_delta(1.0, 1.1 * mu) > 1.5 * delta                # a wrong scale is rejected
    assert res.privacy.paper_epsilon >= 1.0                       # classical: conservative


def test_tree_noise_is_sqrt_levels_times_independent_at_equal_budget():
  kw = dict(PUBLIC, n=1024)
  cfg = {"epsilon": 2.0, "delta": 1e-6, "num_steps": 100, "batch_size": 10}
  z_tree = srgd.plan_srgd("accelerated_dp_srgd", cfg, **kw).params.noise_multiplier
  z_ind = srgd.plan_srgd("accelerated_dp_srgd_independent_noise", cfg, **kw
                         ).params.noise_multiplier
  assert z_tree / z_ind == pytest.approx(math.sqrt((100).bit_length()), rel=1e-3)


# ----------------------------------------------------------------------------- (c) refusals
@pytest.mark.parametrize("name", NAMES)
def test_explicit_noise_above_budget_or_zero_raises_before_release(name):
  for z in (0.3, 0.0):
    with pytest.raises(PrivacyBudgetExceeded):
      srgd.plan_srgd(name, {"epsilon": 1.0, "delta": 1e-6, "noise_multiplier": z}, **PUBLIC)
  plan = srgd.plan_srgd(name, {"epsilon": 1.0, "delta": 1e-6, "noise_multiplier": 50.0},
                        **PUBLIC)                                  # under budget: allowed
  assert plan.private and plan.params.noise_multiplier == 50.0


def test_driver_refuses_zero_noise_with_a_budget_and_reports_explicit_noise():
  prob = _problem(16, 2)
  run = lambda cfg: solve("accelerated_dp_srgd", cfg, prob, jax.random.key(0))
  with pytest.raises(PrivacyBudgetExceeded):
    run({"epsilon": 1.0, "delta": 1e-6, "noise_multiplier": 0.0})
  res = run({"delta": 1e-6, "noise_multiplier": 3.0})                # no budget: reported
  acc = pld_privacy_accountant.PLDAccountant()
  acc.compose(dp_accounting.GaussianDpEvent(3.0 / math.sqrt((4).bit_length())))
  assert res.privacy.epsilon == pytest.approx(acc.get_epsilon(1e-6), rel=2e-3)
  # non-private, said out loud and labelled; leaving epsilon out is refused (issue 46)
  assert run({"noise_multiplier": 0.0}).privacy.provenance == "none"
  from dpsco_jax.config.schema import ConfigError
  with pytest.raises(ConfigError, match="needs one of epsilon, noise_multiplier"):
    run({})


@pytest.mark.parametrize("cfg, match", [
    ({"relation": "swap"}, "relation"),
    ({"relation": 1}, "relation"),
    ({"preset": "theory", "relation": "replace_one"}, "zero-out"),
    ({"noise_mechanism": "tree", "name": "single_epoch_dp_sgd"}, "independent"),
])
def test_bad_relation_configuration_raises_naming_the_parameter(cfg, match):
  cfg = dict(cfg, epsilon=1.0, delta=1e-6)
  name = cfg.pop("name", "accelerated_dp_srgd")
  with pytest.raises(ValueError, match=match):
    srgd.plan_srgd(name, cfg, **dict(PUBLIC, n=10 ** 4))


def test_a_private_run_needs_delta_and_adjacency_is_retired():
  """No silent delta = 1/n^2 any more; a non-private run (noise_multiplier 0, no epsilon)
  reads none. The former alias ``adjacency`` is refused by validation, pointing at
  ``relation``."""
  for name, cfg in (("accelerated_dp_srgd", {"epsilon": 1.0}),
                    ("single_epoch_dp_sgd", {"noise_multiplier": 2.0})):
    with pytest.raises(ValueError, match="delta is required"):
      srgd.plan_srgd(name, cfg, **PUBLIC)
  assert not srgd.plan_srgd("accelerated_dp_srgd", {"noise_multiplier": 0.0}, **PUBLIC).private
  plan = srgd.plan_srgd("single_epoch_dp_sgd", {"relation": "replace_one", "delta": 1e-6,
                                                 "noise_multiplier": 2.0}, **PUBLIC)
  assert plan.relation == "replace_one" and plan.sensitivity == pytest.approx(2 * 1.0 / 4)
  from dpsco_jax.config.schema import ConfigError, validate
  with pytest.raises(ConfigError, match="unknown key 'adjacency'.*did you mean 'relation'"):
    validate({"algorithm": "single_epoch_dp_sgd", "problem": "least_squares", "n_users": 16,
              "m": 1, "d": 2, "delta": 1e-6, "adjacency": "replace_one"})
