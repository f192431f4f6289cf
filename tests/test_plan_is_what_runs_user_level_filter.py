"""Issue 47.1 for paper 000 (FILTER): the registered runners execute the plan they are handed.

A plan is made first; then every function of the family that plans, charges a ledger,
calibrates or reads a config is made to raise, and ``api.execute`` still runs the plan and
reports its guarantee (before, the runner planned the whole config again). The audit hook
plans through the registered planner and iterates the run's own phases (same release)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import api
from dpsco_jax.algorithms.user_level_filter import driver as ulf
from dpsco_jax.algorithms.user_level_filter import plan as ulf_plan
from dpsco_jax.config.types import Schema
from dpsco_jax.problems import make
from plan_guard import forbid_planning

# explicit noise multipliers: no calibration (not what is tested here), tiny sizes
CASES = {
    # epsilon 50: the Laplace test passes at 60 users (a halt would release the fallback)
    "user_level_phased_sgd": {"epsilon": 50.0, "delta": 1e-6, "num_phases": 1, "num_groups": 6,
                              "sensitivity": "typical", "clip_norm": True,
                              "noise_multiplier": 30.0},
    "user_level_accelerated_erm": {"epsilon": 2.0, "delta": 1e-6, "num_phases": 1,
                                   "batch_size": 20, "max_steps": 2, "sensitivity": "typical",
                                   "clip_norm": 0.5, "noise_multiplier": 30.0},
}
PLANNING = ("plan_phased_sgd", "plan_accelerated_erm", "plan_alg1", "plan_alg3", "charge",
            "read_options", "config_view", "calibrate_noise_multiplier")


@pytest.fixture(scope="module")
def problem():
  return make("logistic", n_users=60, m=2, d=2, key=jax.random.key(0), n_eval=200)


def _forbid_planning(monkeypatch) -> None:
  forbid_planning(monkeypatch, (ulf, ulf_plan, ulf_plan.FilterPlan), PLANNING,
                  schemas=(Schema,))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_plan_runs_with_every_planning_function_refused(monkeypatch, problem, name):
  plan = api.plan_problem(name, CASES[name], problem)
  _forbid_planning(monkeypatch)
  res = api.execute(plan, problem, jax.random.key(1))
  assert res.privacy == plan.privacy
  phases = plan.detail.phases
  if name == "user_level_phased_sgd":
    assert res.record["sigma"] == [ph.sigma for ph in phases]
    assert res.record["clip_norm"] == problem.lipschitz        # clip_norm: true, read in the plan
  else:
    assert [ph["sigma"] for ph in res.record["phases"]] == [ph.sigma for ph in phases]
  assert np.all(np.isfinite(np.asarray(res.params)))


def test_the_audit_hook_releases_what_the_run_releases(problem):
  """One path: the hook's last release, projected as the run projects it, is the run's
  output (same plan, same keys, same phases)."""
  cfg, key = CASES["user_level_phased_sgd"], jax.random.key(3)
  res = api.solve("user_level_phased_sgd", cfg, problem, key)
  assert res.record["halted_phase"] is None                  # a trained point, not the fallback
  rel = ulf.user_level_phased_sgd_releases(problem, cfg, key)
  assert len(rel) == 1 and rel[0]["passed"]
  want = ulf.project_l2_ball(rel[0]["release"], problem.radius)
  np.testing.assert_allclose(np.asarray(res.params), np.asarray(want), atol=1e-6)
  assert float(jnp.linalg.norm(res.params)) > 0
