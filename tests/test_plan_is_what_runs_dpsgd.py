"""Issue 47.1: the DP-SGD baselines' runners execute the plan they are handed. With every
planning function of the family made to raise after the plan is made, the run still succeeds
and reports the plan's guarantee and numbers (the old drivers planned, calibrated and charged
again from the config)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import api, problems
from dpsco_jax.algorithms.dpsgd import driver, plan as dpsgd_plan
from dpsco_jax.algorithms.dpsgd.config import DpSgdConfig, SgdSchedule
from dpsco_jax.algorithms.dpsgd.plan import DpSgdPlan, SgdPlan
from plan_guard import forbid_planning

N, M, D = 24, 2, 3
PRIVATE = {"delta": 1e-5, "num_steps": 3, "batch_size": 6, "clip_norm": 1.0,
           "learning_rate": 0.1, "n_users": N}
CASES = {
    # a calibrated z: the calibrator must not run again
    "dp_sgd_user": dict(PRIVATE, epsilon=2.0, sampling="full", relation="zero_out"),
    "dp_sgd_item": dict(PRIVATE, noise_multiplier=1.0),
    "dp_sgd_group": dict(PRIVATE, noise_multiplier=2.0, sampling="full"),
    "nonprivate_sgd": {"num_steps": 3, "batch_size": 6},   # default step size: reads L
}


def _forbid_planning(monkeypatch) -> None:
  # where they are defined and where the driver imports them
  forbid_planning(monkeypatch, (dpsgd_plan, driver, dpsgd_plan.DpSgdPlan),
                  ("dp_sgd_plan", "plan_dp_sgd", "charge", "config_view",
                   "calibrate_noise_multiplier", "sampling_setup"),
                  schemas=(DpSgdConfig, SgdSchedule))


@pytest.fixture(scope="module")
def lsq():
  return problems.make("least_squares", n_users=N, m=M, d=D, radius=2.0, noise=0.3,
                       key=jax.random.key(0))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_built_in_problem_runs_its_plan_without_planning(lsq, monkeypatch, name):
  plan = api.plan_problem(name, CASES[name], lsq)
  _forbid_planning(monkeypatch)
  res = api.execute(plan, lsq, jax.random.key(1))
  assert res.privacy == plan.privacy
  assert np.all(np.isfinite(np.asarray(res.params)))
  detail = plan.detail
  assert isinstance(detail, SgdPlan if name == "nonprivate_sgd" else DpSgdPlan)
  assert (res.record["num_steps"], res.record["learning_rate"]) == (detail.steps, detail.lr)
  if name != "nonprivate_sgd":
    assert res.record["noise_std"] == detail.noise_std
    assert res.record["noise_multiplier"] == plan.noise_multiplier


def test_nonprivate_sgd_plans_its_schedule(lsq):
  """Its plan holds what its runner reads (it used to plan nothing: ``detail`` None)."""
  plan = api.plan_problem("nonprivate_sgd", {"epochs": 2.0, "batch_size": 6}, lsq)
  assert plan.detail == SgdPlan("fixed", 6, 6, 8, plan.detail.lr, "uniform")
  assert plan.detail.lr == pytest.approx(lsq.radius / (lsq.lipschitz * np.sqrt(8)))
  assert plan.schedule["num_steps"] == 8


@pytest.mark.parametrize("name", ["dp_sgd_user", "nonprivate_sgd"])
def test_a_users_data_runs_its_plan_without_planning(monkeypatch, name):
  """``dpsco_jax.plan`` on a ``UserData``'s spec (the planner reads ``PublicFacts``)."""
  x = np.asarray(jax.random.normal(jax.random.key(2), (N * M, D)))
  data = dpsco_jax.UserData.from_arrays({"x": x, "y": x[:, 0]}, np.repeat(np.arange(N), M),
                                        max_items_per_user=M)
  loss = lambda w, ex: 0.5 * (jnp.dot(w, ex["x"]) - ex["y"]) ** 2
  cfg = dict(CASES[name], learning_rate=0.1)
  plan = dpsco_jax.plan(name, cfg, data.spec, num_params=D,
                        constants={"lipschitz": 1.0, "radius": 1.0})
  _forbid_planning(monkeypatch)
  res = dpsco_jax.run(plan, loss, jnp.zeros(D), data, jax.random.key(3))
  assert res.privacy == plan.privacy and res.record["num_steps"] == 3
