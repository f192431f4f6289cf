"""Private selection on your own problem (issue 48, item 1, ``problem: user``): a YAML sweep
with ``select: {..., private: {...}}`` scores each candidate on the problem's ``eval_data``,
declared public (``eval_data_public: true``), and releases only the best, with the guarantee
of training and selection that ``dpsco_jax.private_select_cost`` gives for the same plans.
Refused with one line before any run: no eval_data, eval_data not declared public, a metric
that is not the problem's, an algorithm without a plan."""

import json
import textwrap

import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import runner
from dpsco_jax.__main__ import main
from dpsco_jax.config.types import ConfigError
from dpsco_jax.data import UserData
from dpsco_jax.privacy import selection as selection_module
from dpsco_jax.runner import tuning

# the metric says which data it was given (its users) and returns a distinct value per call,
# so an unreleased candidate's score is recognizable in any output
USER_MODULE = '''
import jax.numpy as jnp
import numpy as np

SEEN = []


def table(n_users, seed):
  rng = np.random.default_rng(seed)
  users = np.repeat(np.arange(n_users), 2)
  x = rng.normal(size=(users.size, 2)).astype(np.float32)
  return users, x, (x[:, 0] > 0).astype(np.int32)


def init_params():
  return {"w": jnp.zeros(2)}


def logistic(params, ex):
  z = jnp.dot(params["w"], ex["x"])
  return jnp.logaddexp(0.0, z) - ex["y"] * z


def score(params, data):
  SEEN.append(int(data.n_users))
  return 0.25 + 1e-4 * len(SEEN)


def other(params, data):
  return 0.0


def make(held_out: bool):
  from dpsco_jax.data import UserData
  users, x, y = table(24, 0)
  data = UserData.from_arrays({"x": x, "y": y}, users, max_items_per_user=2)
  return {"loss": logistic, "model": init_params(), "data": data, "metrics": {"score": score},
          "eval_data": data if held_out else None}   # (a test: not really held out)
'''

LRS = [0.5, 2.0]
ALGORITHM = {"name": "dp_sgd_user", "epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0,
             "num_steps": 4, "sampling_rate": 0.25, "learning_rate": LRS}
LAW = {"distribution": "geometric", "gamma": 0.5}


@pytest.fixture
def mod(tmp_path, monkeypatch):
  """The user's module (a unique name per test) with 24 training and 10 held-out users."""
  name = f"selmod_{abs(hash(str(tmp_path))) % 10**8}"
  (tmp_path / f"{name}.py").write_text(USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  module = __import__(name)
  for file, n, seed in (("train.npz", 24, 0), ("held_out.npz", 10, 1)):
    users, x, y = module.table(n, seed)
    np.savez(tmp_path / file, user_ids=users, x=x, y=y)
  monkeypatch.chdir(tmp_path)
  return module


def _config(mod, **problem) -> dict:
  base = {"model": f"{mod.__name__}:init_params", "loss": f"{mod.__name__}:logistic",
          "data": {"path": "train.npz", "max_items_per_user": 2}, "eval_data": "held_out.npz",
          "eval_data_public": True, "n_users": 24,
          "metric": {"score": f"{mod.__name__}:score", "other": f"{mod.__name__}:other"}}
  base.update(problem)
  return {"name": "user selection", "eval_seeds": [0],
          "problem": {k: v for k, v in base.items() if v is not None},
          "algorithm": dict(ALGORITHM),
          "select": {"over": ["learning_rate"], "metric": "score", "rule": "max_mean",
                     "private": dict(LAW)}}


def _write(tmp_path, config: dict) -> str:
  import yaml
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(config))
  return str(path)


def _candidate_plans() -> list:
  """The candidates planned from the training data's spec, as a Python user would."""
  users = np.repeat(np.arange(24), 2)
  data = UserData.from_arrays({"x": np.zeros((48, 2), np.float32),
                               "y": np.zeros(48, np.int32)}, users, max_items_per_user=2)
  algo = {k: v for k, v in ALGORITHM.items() if k != "name"}
  return [dpsco_jax.plan("dp_sgd_user", {**algo, "learning_rate": lr, "n_users": 24},
                         data.spec, num_params=2) for lr in LRS]


def test_user_private_selection_releases_the_winner_scored_on_eval_data(tmp_path, mod,
                                                                       monkeypatch, capsys):
  # K fixed at 2 runs: the second call of the metric scores highest (rule max) and wins
  monkeypatch.setattr(selection_module.SelectionLaw, "sample",
                      lambda self, key, shape=(): np.asarray(2))
  out = tmp_path / "o.json"
  records = runner.main_run(_write(tmp_path, _config(mod)), out=str(out), progress=True)
  printed = capsys.readouterr()
  assert mod.SEEN == [10, 10]     # every score read the 10 held-out users, never training
  (record,) = records                 # the winner only
  assert record["status"] == "ok" and record["problem"] == "user"
  assert record["score"] == pytest.approx(0.2502) and record["learning_rate"] in LRS
  cost = dpsco_jax.private_select_cost(_candidate_plans(), LAW)
  assert record["epsilon"] == pytest.approx(cost.epsilon, rel=1e-12)
  assert record["candidate_epsilon"] == pytest.approx(cost.candidate_epsilon, rel=1e-12)
  assert record["provenance"] == "theorem" and record["epsilon"] > record["candidate_epsilon"]
  assert record["selection"] == "private" and record["selection_metric"] == "score"
  assert "eval_data_public" in record["selection_metric_source"]
  assert "expected runs 2 over 2 candidates" in printed.out   # the cost, before the runs
  saved = out.read_text()
  (kept,) = json.loads(saved)["results"]
  for where in (saved, printed.out, printed.err, repr(records)):
    assert "0.2501" not in where  # the unreleased candidate's score
  for rec in (record, kept):          # no run's time, no count of runs
    assert not set(tuning.UNCOVERED) & set(rec)
    assert not {"K", "k", "runs", "candidates"} & set(rec)


@pytest.mark.parametrize("problem,select,match", [
    ({"eval_data": None, "eval_data_public": None}, {},
     "select.private on a user problem scores each candidate on its eval_data declared public, "
     "and this problem has no eval_data"),
    ({"eval_data_public": None}, {},
     "select.private on a user problem: problem.eval_data is not declared public"),
    ({"eval_data_public": False}, {},
     "select.private on a user problem: problem.eval_data is not declared public"),
    ({}, {"metric": "accuracy"},
     r"select.metric: 'accuracy' is not one of the problem's metrics \(other, score\)"),
    ({"eval_data": None}, {}, "problem.eval_data_public declares eval_data public, but the "
     "problem has no eval_data"),
])
def test_refused_before_any_run(tmp_path, mod, monkeypatch, problem, select, match):
  monkeypatch.setattr(runner, "run_one", lambda *a, **k: pytest.fail("a run started"))
  config = _config(mod, **problem)
  config["select"].update(select)
  with pytest.raises(ConfigError, match=match):
    runner.run_config(config, progress=False)
  assert mod.SEEN == []


@pytest.mark.parametrize("algorithm,match", [
    ({**ALGORITHM, "name": "flax.DPTrainer"},
     "select.private: flax.DPTrainer has no data-free plan exposing its privacy event"),
    ({"name": "nonprivate_sgd", "num_steps": 4, "learning_rate": LRS},
     "select.private: nonprivate_sgd's plan does not expose one privacy event"),
])
def test_a_candidate_without_a_privacy_event_is_refused(mod, monkeypatch, algorithm, match):
  monkeypatch.setattr(runner, "run_one", lambda *a, **k: pytest.fail("a run started"))
  config = {**_config(mod), "algorithm": algorithm}
  with pytest.raises(ConfigError, match=match):
    runner.run_config(config, progress=False)


def test_a_refused_candidate_plan_is_one_config_error(mod, monkeypatch):
  # the sweep's validation plans no user row: the selection's planning refuses, before a run
  monkeypatch.setattr(runner, "run_one", lambda *a, **k: pytest.fail("a run started"))
  config = _config(mod)
  config["algorithm"].update(clip_norm="adaptive", initial_clip_norm=1.0,
                             noise_mechanism="tree", sampling="cyclic", batch_size=6)
  config["algorithm"].pop("sampling_rate")
  with pytest.raises(ConfigError, match="select.private: dp_sgd_user: clip_norm: adaptive is "
                                        "refused with noise_mechanism='tree'"):
    runner.run_config(config, progress=False)


@pytest.mark.parametrize("held_out,public,match", [
    (False, True, "problem.eval_data_public declares eval_data public, but the problem has no "
                  "eval_data"),
    (True, False, "problem.eval_data is not declared public"),
    (False, False, "this problem has no eval_data"),
])
def test_a_factorys_problem_is_checked_once_built(mod, monkeypatch, held_out, public, match):
  monkeypatch.setattr(runner, "run_one", lambda *a, **k: pytest.fail("a run started"))
  config = _config(mod)
  config["problem"] = {"factory": f"{mod.__name__}:make", "args": {"held_out": held_out},
                       "eval_data_public": public, "n_users": 24}
  with pytest.raises(ConfigError, match=match):
    runner.run_config(config, progress=False)


def test_cli_refusal_is_one_line_and_exit_2(tmp_path, mod, capsys):
  config = _config(mod, eval_data_public=None)
  out = tmp_path / "o.json"
  assert main(["run", _write(tmp_path, config), "--quiet", "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "problem.eval_data is not declared public" in err[0], err
  assert not out.exists() and mod.SEEN == []
