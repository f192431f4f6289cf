"""The runner runs a built-in problem as the API runs a user's: plan, then that plan (issue 25).

``runner.run_one`` (one by one) and ``runner.batch.batch_records`` (seeds in one
program) make the data-free plan (:func:`dpsco_jax.api.plan_problem`) and hand it to
:func:`dpsco_jax.api.execute`: the registered runner receives the plan itself (it does not plan
or calibrate again), and a run whose guarantee differs from its plan is refused.
"""

import dataclasses

import pytest

from dpsco_jax import api, runner
from dpsco_jax.privacy import calibrate
from dpsco_jax.algorithms import registration
from dpsco_jax.algorithms.registration import registered

BASE = {"algorithm": "dp_sgd_user", "problem": "least_squares", "n_users": 32, "m": 2, "d": 3,
        "epsilon": 1.7, "delta": 1e-5, "clip_norm": 1.0, "num_steps": 3, "batch_size": 8}


def _spy_driver(monkeypatch, name: str) -> list:
  """Records the plan the registered runner of ``name`` receives (then runs it)."""
  entry = registered()[name]
  seen = []

  def spy(plan, problem, key):
    seen.append(plan)
    return real(plan, problem, key)
  real = entry.driver
  monkeypatch.setitem(registration._REGISTRY, name, dataclasses.replace(entry, driver=spy))
  return seen


def _counting_calibrator(monkeypatch) -> list:
  # the bisections the calibrator runs (its keyed memo answers the others); an earlier test
  # may have calibrated this plan
  calibrate._keyed_calibration.cache_clear()
  calls = []
  real = calibrate._calibrate
  monkeypatch.setattr(calibrate, "_calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
  return calls


@pytest.mark.parametrize("seeds", [[0], [0, 1]], ids=["one_run", "seed_batch"])
def test_the_plan_is_what_runs_one_calibration(monkeypatch, seeds):
  calls = _counting_calibrator(monkeypatch)
  seen = _spy_driver(monkeypatch, "dp_sgd_user")
  algorithms, problems = runner.registry()
  records = runner.execute([dict(BASE, seed=s) for s in seeds], algorithms=algorithms,
                           problems=problems, progress=False)
  assert [r["status"] for r in records] == ["ok"] * len(seeds), records
  assert [r["batched"] for r in records] == [len(seeds) > 1] * len(seeds)
  assert len(calls) == 1                      # the plan's calibration, and no other
  # the runner ran the plan: its calibrated z, not a request to calibrate again
  problem = problems["least_squares"](runner.batch.problem_config(runner._checked(
      dict(BASE, seed=0), algorithms, problems)), runner.batch.run_keys(0)[0])
  p = api.plan_problem("dp_sgd_user", registered()["dp_sgd_user"].config.of(BASE), problem)
  assert seen and all(s.noise_multiplier == p.noise_multiplier and s.privacy == p.privacy
                      for s in seen)
  assert all(r["epsilon"] == pytest.approx(p.privacy.epsilon, rel=1e-9) for r in records)
  assert p.spec.measured == frozenset() and p.num_params == 3


@pytest.mark.parametrize("seeds", [[0], [0, 1]], ids=["one_run", "seed_batch"])
def test_a_run_that_spends_other_than_its_plan_is_refused(monkeypatch, seeds):
  """The broken twin: a runner that reports a guarantee other than its plan's (10% below).
  The check catches the difference and nothing is recorded as a result."""
  entry = registered()["dp_sgd_user"]

  def lying(plan, problem, key):
    result = entry.driver(plan, problem, key)
    return dataclasses.replace(result, privacy=dataclasses.replace(
        result.privacy, epsilon=0.9 * result.privacy.epsilon))
  monkeypatch.setitem(registration._REGISTRY, "dp_sgd_user",
                      dataclasses.replace(entry, driver=lying))
  algorithms, problems = runner.registry()
  records = runner.execute([dict(BASE, seed=s) for s in seeds], algorithms=algorithms,
                           problems=problems, progress=False)
  assert all(r["status"] == "failed" and "differs from its plan" in r["error"]
             for r in records), records
  assert not any("excess_risk" in r for r in records)


def test_every_algorithm_has_a_planner_and_a_non_private_one_runs_its_plan():
  algorithms, problems = runner.registry()
  assert all(e.planner is not None for e in registered().values())
  cfg = {"algorithm": "minibatch_sgd", "problem": "least_squares", "n_users": 16, "m": 2,
         "d": 2, "seed": 0}
  record = runner.run_one(cfg, algorithms=algorithms, problems=problems)
  assert record["algorithm"] == "minibatch_sgd" and "excess_risk" in record


def test_a_halted_release_is_a_record_field(monkeypatch):
  """A built-in problem's record says when the release is the public fallback point (it was
  only ``halted_phase`` before): the same words as ``Result.fallback``."""
  import warnings
  from dpsco_jax.result import FallbackRelease, Result
  from dpsco_jax.runner.batch import result_record
  from dpsco_jax.privacy.ledger import PrivacyReport
  algorithms, problems = runner.registry()
  cfg = runner._checked(dict(BASE, seed=0), algorithms, problems)
  problem = problems["least_squares"](runner.batch.problem_config(cfg),
                                      runner.batch.run_keys(0)[0])
  report = PrivacyReport(epsilon=1.0, delta=1e-5, provenance="accountant")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", FallbackRelease)
    halted = Result(problem.init_params(), report, 0, record={"halted_phase": 2})
  rec = result_record(problem, cfg, halted, 0.0)
  assert "AboveThreshold halted in phase 2" in rec["fallback"]
  trained = Result(problem.init_params(), report, 0, record={})
  assert "fallback" not in result_record(problem, cfg, trained, 0.0)


def test_execute_refuses_a_problem_the_plan_was_not_made_for():
  algorithms, problems = runner.registry()
  make = lambda n, d: problems["least_squares"](runner.batch.problem_config(runner._checked(
      dict(BASE, seed=0, n_users=n, d=d), algorithms, problems)), runner.batch.run_keys(0)[0])
  typed = registered()["dp_sgd_user"].config.of(BASE)
  p = api.plan_problem("dp_sgd_user", typed, make(32, 3))
  import jax
  for other in (make(64, 3), make(32, 4)):
    with pytest.raises(ValueError, match="plan again"):
      api.execute(p, other, jax.random.key(0))
  with pytest.raises(TypeError, match="needs a Plan"):
    api.execute(typed, make(32, 3), jax.random.key(0))
  assert api.execute(p, make(32, 3), jax.random.key(0)).privacy == p.privacy


def test_an_explicit_noise_multiplier_over_the_budget_stops_the_sweep_before_any_run(
    monkeypatch):
  """The plan's refusal (PrivacyBudgetExceeded: nothing released) is the config's error: one
  ConfigError naming the row before any run, not a traceback or a failed row."""
  ran = []
  monkeypatch.setattr(runner, "execute", lambda *a, **k: ran.append(1))
  config = {"problem": "least_squares", "n_users": 32, "m": 2, "d": 3, "seed": 0,
            "experiments": [{"algorithm": "nonprivate_sgd", "num_steps": 3, "batch_size": 8},
                            {"algorithm": "dp_sgd_user", "epsilon": 0.5, "delta": 1e-5,
                             "noise_multiplier": 0.3, "num_steps": 3, "batch_size": 8}]}
  with pytest.raises(runner.ConfigError, match=r"^dp_sgd_user: .*epsilon"):
    runner.run_config(config, progress=False)
  assert not ran
