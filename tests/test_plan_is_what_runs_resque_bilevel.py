"""Issue 47.1 for papers 002 (ReSQue) and 004 (DP-Loc-(S)GD, DP bilevel): a run executes its
plan and plans nothing. Every algorithm of the two packages has a data-free planner; once a
plan is made, the family's planning, charging and calibrating functions and the config schema's
``of`` are made to raise, and ``api.execute(plan, problem, key)`` still runs and reports the
plan's guarantee (the registered runner reads ``plan.detail`` and ``plan.privacy`` only)."""

import importlib

import jax
import pytest

from dpsco_jax import api, problems
from dpsco_jax.config.types import Schema
from dpsco_jax.problems import bilevel as bilevel_problems
from plan_guard import forbid_planning

#: every module of the two families (a forbidden name is patched wherever it is bound)
MODULES = [importlib.import_module(f"dpsco_jax.algorithms.{m}") for m in (
    "resque.plan", "resque.private", "resque.parallel", "resque.driver", "bilevel.plan",
    "bilevel.localized_gd_plan", "bilevel.localized_gd", "bilevel.driver")]
#: the family plans, whose ``charge()`` a run must not call
PLANS = [getattr(importlib.import_module(f"dpsco_jax.algorithms.{m}"), c) for m, c in (
    ("resque.plan", "ResquePrivatePlan"), ("resque.parallel", "ParallelPlan"),
    ("resque.parallel", "MinibatchPlan"), ("bilevel.plan", "BilevelPlan"),
    ("bilevel.plan", "PenaltyPlan"), ("bilevel.localized_gd_plan", "LocGDRunPlan"))]
#: the planning / charging / calibrating names a runner must not call
FORBIDDEN = ("resque_private_plan", "resque_private_planner", "phase_plan", "config_view",
             "_target", "resque_parallel_planner", "minibatch_sgd_planner", "bilevel_config",
             "bilevel_planner", "bilevel_minibatch_planner", "bilevel_population_planner",
             "nonprivate_penalty_planner", "loc_gd_plan_for_problem", "plan_dp_loc_gd",
             "loc_gd_planner", "calibrate_noise_multiplier", "with_calibrated_noise",
             "charge")   # the plan classes' charge (PLANS)

RESQUE = {"epsilon": 1.0, "delta": 1e-5, "constants": "c_priv", "rho": 0.05, "rho_over_r": 2.0,
          "max_iter": 1, "max_bisection": 1, "phases": 1, "T_frac": 1 / 4}
LOC = {"epsilon": 2.0, "delta": 1e-6, "mu": 0.5, "num_steps": 5, "rounds": 1}
BILEVEL = {"epsilon": 2.0, "delta": 1e-6, "num_steps": 2, "inner_num_steps": 5,
           "inner_rounds": 1}
CASES = {
    "resque_private_sco": ("absolute", RESQUE),
    "resque_parallel_sco": ("absolute", {"max_iter": 1}),
    "minibatch_sgd": ("absolute", {"num_steps": 4, "batch_size": 2, "eval_every": 2}),
    "dp_loc_gd": ("least_squares", LOC),
    "dp_loc_sgd": ("least_squares", {**LOC, "batch_size": 8}),
    "dp_bilevel": ("ridge", BILEVEL),
    "dp_bilevel_minibatch": ("ridge", BILEVEL),
    "dp_bilevel_population": ("ridge", BILEVEL),
    "nonprivate_penalty": ("ridge", {"num_steps": 2, "newton_steps": 2}),
}


def _problem(kind: str):
  key = jax.random.key(0)
  if kind == "ridge":
    return bilevel_problems.synthetic_ridge_problem(key, d=2, n_train=20, n_val=20)
  make = getattr(problems, kind)
  return make(n_users=32, m=1, d=3, key=key, radius=1.0, n_eval=50)


def test_every_algorithm_of_papers_002_and_004_is_covered():
  table = api.algorithms()
  assert {n for n, e in table.items() if e.paper in ("002", "004")} == set(CASES)
  assert all(table[n].planner is not None for n in CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_plan_runs_without_planning_again(name, monkeypatch):
  kind, cfg = CASES[name]
  problem = _problem(kind)
  plan = api.plan_problem(name, cfg, problem)
  assert plan.privacy is not None and plan.detail is not None or name == "nonprivate_penalty"
  forbid_planning(monkeypatch, MODULES + PLANS, FORBIDDEN, schemas=(Schema,))
  res = api.execute(plan, problem, jax.random.key(1))
  assert res.privacy == plan.privacy
