"""Issue 47.1 for paper 001 (output perturbation): the registered runners execute the plan
they are handed.

A plan is made first; then every function of the family that plans, charges a ledger,
calibrates or reads a config is made to raise, and ``api.execute`` still runs the plan and
reports its guarantee (before, the runner planned the whole config again). Algorithms 5-6
re-planned their second half after a ⊥ warm start inside the run: the plan now holds that
half too (at ``R' = diam K``), and the run only selects it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import api
from dpsco_jax.algorithms.output_perturbation import base, naive, phased
from dpsco_jax.algorithms.output_perturbation import driver as op
from dpsco_jax.algorithms.output_perturbation import plan as op_plan
from dpsco_jax.config.types import Schema
from dpsco_jax.problems.output_perturbation import l2_logistic
from plan_guard import forbid_planning

# exact stability test with an explicit Delta: tiny n (as tests/test_api_planners.py)
EXACT = {"epsilon": 1.0, "delta": 1e-3, "stability_test": "exact", "Delta": 0.05,
         "max_exact_users": 4}
PLANNING = ("sc_output_pert_plan", "phased_plan", "sc_reduction_plan", "naive_plan",
            "planner_of", "naive_planner", "charge", "settings_from_cfg",
            "calibrate_noise_multiplier", "plan_sc_output_pert", "naive_sigma")


def _problem(n: int, m: int):
  return l2_logistic({"n_users": n, "m": m, "d": 2, "l2": 0.5, "radius": 2.0, "n_eval": 10},
                     jax.random.key(0))


def _forbid_planning(monkeypatch) -> None:
  forbid_planning(monkeypatch, (op, naive, phased, op_plan, base, base.OutputPertPlan,
                               op_plan.NaivePlan), PLANNING, schemas=(Schema,))


@pytest.mark.parametrize("name, n, m, cfg", [
    ("naive_output_pert", 6, 3, {"epsilon": 1.0, "delta": 1e-3}),
    ("sc_output_pert", 4, 2, EXACT)])
def test_a_plan_runs_with_every_planning_function_refused(monkeypatch, name, n, m, cfg):
  problem = _problem(n, m)
  plan = api.plan_problem(name, cfg, problem)
  _forbid_planning(monkeypatch)
  res = api.execute(plan, problem, jax.random.key(1))
  assert res.privacy == plan.privacy
  assert np.all(np.isfinite(np.asarray(res.params)))
  if name == "naive_output_pert":
    assert res.record["sigma"] == plan.detail.sigma
  else:   # the baseline's sigma, recorded beside the run's, comes from the plan too
    assert res.record["sigma"] == plan.detail.infos[0].sigma
    assert res.record["sigma_naive"] == plan.detail.schedule["sigma_naive"] > 0


def _after_bottom_lam(problem, sco: bool) -> float:
  """Algs 5-6's lambda at localization radius diam K = 2R (spec §2.7 [A])."""
  G, n, m, d, r = problem.lipschitz, problem.n_users, problem.m, problem.d, 2 * problem.radius
  if sco:
    return (G / r) * max(math.sqrt(d) / (n * math.sqrt(m)), 1.0 / math.sqrt(n * m))
  return G * math.sqrt(d) / (r * n * math.sqrt(m))


@pytest.mark.parametrize("bottom", [True, False], ids=["bottom", "released"])
@pytest.mark.parametrize("name, n, m, cfg", [
    ("sc_erm_output_pert", 4, 2, EXACT),
    ("sc_sco_output_pert", 80, 4, {"epsilon": 16.0, "delta": 0.1,
                                   "on_certificate_failure": "raise"})])
def test_a_bottom_warm_start_selects_the_planned_second_half(monkeypatch, name, n, m, cfg,
                                                             bottom):
  """The release itself is stubbed (its ⊥ flag forced; each call records the planned call it
  ran): which second half runs is what is tested, not the solver."""
  problem = _problem(n, m)
  plan = api.plan_problem(name, cfg, problem)
  detail = plan.detail
  calls = []

  def release(loss_fn, data, key, *, info, lam, anchor, **kw):
    calls.append((info, lam))
    return anchor, jnp.asarray(bottom and len(calls) == 1), None, None
  monkeypatch.setattr(phased, "sc_output_pert_release", release)
  _forbid_planning(monkeypatch)
  res = api.execute(plan, problem, jax.random.key(2))
  sch, phases, infos = (detail.schedule["after_bottom"] if bottom else
                        (detail.schedule["schedule"], detail.schedule["phases"],
                         detail.infos[1:]))
  assert calls[0] == (detail.infos[0], 0.0)                  # the warm start
  assert calls[1:] == [(i, lam) for i, (lam, _) in zip(infos, phases)]
  assert res.record["bottom0"] is bottom and res.record["lam"] == sch["lam"]
  assert res.privacy == plan.privacy                         # the same blocks either way
  if bottom:   # the half a ⊥ warm start restarts: K's fixed point and R' = diam K
    assert sch["lam"] == pytest.approx(_after_bottom_lam(problem, "sco" in name), rel=1e-12)
    assert sch["lam"] != detail.schedule["lam"]
    assert [i.epsilon for i in infos] == [i.epsilon for i in detail.infos[1:]]
