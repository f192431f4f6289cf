"""Issue 47.1-2: the plan is what runs. Once ``dpsco_jax.plan`` has made a plan, ``run`` plans,
calibrates, charges and validates nothing again: every registered runner executes the plan it
is handed (``plan.detail``, ``plan.privacy``).

Counted with ``sys.setprofile`` during ``dpsco_jax.run(plan, ...)`` of every algorithm that runs
on a loss and ``UserData`` (the cases of ``test_progress_all_drivers``):

* planning: a call of the algorithm's registered planner, of a function of
  ``dpsco_jax/algorithms/`` whose name says it plans, charges a ledger or calibrates
  (``*plan*``, ``*charge*``, ``*calibrat*``), or of anything in ``privacy/calibrate.py``;
* validation: a call of a function of ``dpsco_jax/config/`` other than the typed config's read
  accessors (``get``, ``[]``, iteration, ``in``, ``len``).

Both must be 0. The broken twin: the same count on a runner that plans again (as every driver
did before issue 47: ``driver(problem, plan.config, key)``) is not 0, so the count can fail.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

import dpsco_jax
from dpsco_jax import api
from dpsco_jax.algorithms import registration

from test_progress_all_drivers import CASES, CONSTANTS, FAST, _data
from test_api_planners import CASES as PAPER_CASES
from test_api_planners import CONSTANTS as PAPER_CONSTANTS
from test_api_planners import PARAMS as PAPER_PARAMS
from test_api_planners import _users
from test_api_planners import loss as paper_loss

PKG = os.path.dirname(os.path.abspath(dpsco_jax.__file__)) + os.sep
ALGORITHMS = PKG + "algorithms" + os.sep
CONFIG = PKG + "config" + os.sep
CALIBRATE = PKG + os.path.join("privacy", "calibrate.py")
#: the typed config's read accessors: reading a field is not validating it
ACCESSORS = {"get", "__getitem__", "__iter__", "__contains__", "__len__"}
PLANNING_WORDS = ("plan", "charge", "calibrat")
#: ReSQue's private SCO is adaptive (Alg. 4 is called until a stopping rule, a realized count):
#: each realized call gets its step schedule (``alg4_plan``: lengths and step sizes from its T,
#: no privacy number) and passes a per-phase guard that refuses a call outside the plan's
#: worst case before it runs (``charge``; the report stays the plan's)
ALLOWED = {"algorithms/resque/solvers.py:alg4_plan",
           "algorithms/resque/private.py:_run_phase.<locals>.charge",
           "algorithms/resque/plan.py:PhasePlan.planned_calls"}


def _counting(planner) -> tuple[dict, callable]:
  counts = {"planning": [], "validation": []}

  def prof(frame, event, arg):
    if event != "call":
      return
    code = frame.f_code
    path, name = code.co_filename, code.co_name
    if path.startswith(CONFIG) and name not in ACCESSORS:
      counts["validation"].append(f"{path[len(PKG):]}:{code.co_qualname}")
    elif (path == CALIBRATE or code is getattr(planner, "__code__", None)
          or (path.startswith(ALGORITHMS) and any(w in name.lower() for w in PLANNING_WORDS))):
      counts["planning"].append(f"{path[len(PKG):]}:{code.co_qualname}")
  return counts, prof


def _plan_and_inputs(case: str):
  name, n, m, cfg = CASES[case]
  cfg = {k: v for k, v in cfg.items() if v is not None}
  if name in PAPER_CASES:
    data = _users(n, m, even=True)
    p = api.plan(name, cfg, data.spec, num_params=5, constants=PAPER_CONSTANTS)
    return p, paper_loss, PAPER_PARAMS, data
  data = _data(n, m)
  p = api.plan(name, cfg, data.spec, num_params=3, constants=CONSTANTS)
  return p, lambda w, ex: jnp.sum(ex["x"] * w) ** 2 + 0.25 * jnp.sum(w ** 2), jnp.zeros(3), data


def calls_during_run(case: str) -> dict:
  """The planning and validation calls made by ``dpsco_jax.run`` of ``case``'s plan."""
  p, loss, params, data = _plan_and_inputs(case)
  counts, prof = _counting(api.algorithms()[p.algorithm].planner)
  sys.setprofile(prof)
  try:
    res = api.run(p, loss, params, data, jax.random.key(0))
  finally:
    sys.setprofile(None)
  assert res.privacy == p.privacy
  return counts


def _case_param(case: str):
  return pytest.param(case, marks=[] if case in FAST else [pytest.mark.slow])


@pytest.mark.parametrize("case", [_case_param(c) for c in CASES])
def test_a_run_plans_and_validates_nothing(case):
  counts = calls_during_run(case)
  assert not set(counts["planning"]) - ALLOWED, sorted(set(counts["planning"]) - ALLOWED)
  assert not counts["validation"], sorted(set(counts["validation"]))


def test_the_count_catches_a_runner_that_plans_again(monkeypatch):
  """The broken twin: ``dp_sgd_user`` registered through the transition adapter, which runs
  the old driver on ``plan.config`` (it plans, charges and validates again)."""
  import dataclasses
  from dpsco_jax.algorithms.dpsgd import plan as dpsgd_plan
  from dpsco_jax.result import Result

  def replanning(problem, cfg, key):
    p = dpsgd_plan.dp_sgd_plan(problem, cfg, level="user")   # a second plan
    report = p.charge()
    return Result(params=problem.init_params(), privacy=report, gradient_evaluations=0)

  entry = registration.registered()["dp_sgd_user"]
  monkeypatch.setitem(registration._REGISTRY, "dp_sgd_user", dataclasses.replace(
      entry, driver=lambda plan, problem, key: replanning(problem, plan.config, key)))
  counts = calls_during_run("dp_sgd_user")
  assert counts["planning"] and counts["validation"]


def test_a_sweep_validates_each_run_once_and_plans_each_row_once(monkeypatch):
  """The runner's path: every run's algorithm config is built (validated) once, every row
  (seeds share it) planned once, and nothing is validated or planned while the runs run (a
  seed batch included)."""
  from dpsco_jax import runner
  from dpsco_jax.config import types
  built, planned = [], []
  schema = api.algorithms()["dp_sgd_user"].config
  real_check, real_plan = types.check_instance, api.plan_problem
  monkeypatch.setattr(types, "check_instance", lambda obj: (
      built.append(type(obj)), real_check(obj))[1])
  monkeypatch.setattr(api, "plan_problem", lambda *a, **k: (
      planned.append(a[0]), real_plan(*a, **k))[1])
  config = {"problem": "logistic", "n_users": 40, "m": 2, "d": 3, "seed": [0, 1, 2],
            "experiments": [{"algorithm": "dp_sgd_user", "epsilon": [1.0, 2.0],
                             "delta": 1e-5, "clip_norm": 1.0, "num_steps": 3,
                             "batch_size": 8}]}
  records = runner.run_config(config, progress=False)
  assert [r["status"] for r in records] == ["ok"] * 6
  assert all(r["batched"] for r in records)        # two rows, three seeds each, one program
  assert built.count(schema) == 6                  # one validation per run
  assert planned == ["dp_sgd_user"] * 2            # one plan per row
