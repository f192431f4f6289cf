"""dpsco_jax.private_select / private_select_cost (issue 48.1 from Python): the public-metric
rule, the cost before any run, the same guarantee as the YAML runner's select.private for the
same grid, K candidates run and only the best released (K never in the result)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import tuning as tuning_api
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.data import DataSpec, UserData
from dpsco_jax.privacy import selection as selection_module

USERS, M, D = 64, 2, 3
GRID = (0.5, 2.0)
LAW = {"distribution": "geometric", "gamma": 0.5}
# the grid of tests/test_private_selection.py's TINY (the YAML path), on your own data
CFG = {"epochs": 1, "batch_size": 32, "clip_norm": 1.0, "epsilon": 2.0, "delta": 1e-5,
       "n_users": USERS}
YAML = {"name": "private selection", "eval_seeds": [0],
        "problem": {"name": "logistic", "n_users": USERS, "m": M, "d": D, "radius": 2.0},
        "algorithm": {"name": "dp_sgd_user", "epochs": 1, "batch_size": 32,
                      "learning_rate": list(GRID), "clip_norm": 1.0, "epsilon": 2.0,
                      "delta": 1e-5},
        "select": {"over": ["learning_rate"], "metric": "excess_risk", "rule": "min_mean",
                   "private": LAW}}


def _users(n=USERS, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n * M, D)).astype(np.float32) / np.sqrt(D)
  y = (x @ np.array([1.0, -1.0, 0.5], np.float32) > 0).astype(np.float32)
  return {"x": x, "y": y}, np.repeat(np.arange(n), M)


def loss(p, ex):
  z = ex["x"] @ p["w"]
  return jax.nn.softplus(z) - ex["y"] * z


TRAIN = UserData.from_arrays(*_users(), max_items_per_user=M)
PUBLIC, _ = _users(seed=1)   # held-out public data: the score reads it, not TRAIN
PARAMS = {"w": jnp.zeros(D)}


def public_loss(params) -> float:
  return float(jnp.mean(jax.vmap(lambda e: loss(params, e))(
      jax.tree.map(jnp.asarray, PUBLIC))))


def _plans(spec=TRAIN.spec):
  return [dpsco_jax.plan("dp_sgd_user", {**CFG, "learning_rate": lr}, spec, num_params=D)
          for lr in GRID]


def _no_run(monkeypatch):
  monkeypatch.setattr(tuning_api, "run", lambda *a, **k: pytest.fail("a candidate ran"))


@pytest.mark.parametrize("metric_data", [None, "private", "training", True])
def test_a_score_not_declared_public_is_refused_before_any_run(metric_data, monkeypatch):
  _no_run(monkeypatch)
  with pytest.raises(ConfigError, match="metric_data: a private selection reads a score "
                                        "declared public"):
    dpsco_jax.private_select(_plans(), LAW, loss, PARAMS, TRAIN, jax.random.key(0),
                             score=public_loss, metric_data=metric_data)


@pytest.mark.parametrize("change,error,match", [
    (dict(plans=lambda: _plans(DataSpec(USERS + 1, M))), ValueError,
     r"plans\[0\] was made for 65 users"),
    (dict(plans=lambda: [dpsco_jax.plan("dp_sgd_user", {**CFG, "learning_rate": 0.5,
                                                       "delta": 1e-6}, TRAIN.spec,
                                        num_params=D)] + _plans()),
     ConfigError, "the candidates differ in delta"),
    (dict(law={"gamma": 0.5, "mu": 1}), ValueError, r"law: unknown key\(s\) mu"),
    (dict(law={"distribution": "geometric", "gamma": 1.5}), ValueError,
     "gamma must lie in the open interval"),
    (dict(rule="median"), ValueError, "rule must be one of"),
])
def test_bad_candidates_law_or_rule_refused_before_any_run(change, error, match, monkeypatch):
  _no_run(monkeypatch)
  plans = change.get("plans", _plans)()
  with pytest.raises(error, match=match):
    dpsco_jax.private_select(plans, change.get("law", LAW), loss, PARAMS, TRAIN,
                             jax.random.key(0), score=public_loss, metric_data="public",
                             rule=change.get("rule", "min"))


def test_cost_before_any_run_equals_the_release_and_the_yaml_runners_guarantee():
  from dpsco_jax import runner
  cost = dpsco_jax.private_select_cost(_plans(), LAW)
  assert cost.expected_runs == pytest.approx(2.0) and cost.candidates == 2
  assert cost.epsilon > cost.candidate_epsilon == pytest.approx(2.0)
  got = dpsco_jax.private_select(_plans(), LAW, loss, PARAMS, TRAIN, jax.random.key(0),
                                 score=public_loss, metric_data="public")
  (record,) = runner.run_config(YAML, progress=False)
  assert got.privacy.epsilon == pytest.approx(cost.epsilon, rel=1e-12)
  assert got.privacy.epsilon == pytest.approx(record["epsilon"], rel=1e-12)
  assert got.privacy.delta == pytest.approx(record["delta"])
  assert got.privacy.provenance == "theorem" == record["provenance"]
  assert "geometric(gamma=0.5)" in got.privacy.notes and "E[K] = 2" in got.privacy.notes
  assert got.config.learning_rate in GRID and got.plan.config == got.config
  assert got.score == pytest.approx(public_loss(got.params))
  assert np.all(np.isfinite(np.asarray(got.params["w"])))


SECRET_K = 4099


def _score(j: int) -> float:
  """A distinctive score of the j-th run (j >= 1), in no order of j."""
  return float(np.float32(0.3 + (j * 7919 % 10007) * 1e-5))


@pytest.mark.parametrize("rule", ["min", "max"])
def test_k_runs_with_keys_of_their_own_and_only_the_best_is_released(rule, monkeypatch):
  calls, sample_keys = [], []

  def fake_sample(self, key, shape=()):
    sample_keys.append(jax.random.key_data(key))
    return np.asarray(SECRET_K)

  def fake_run(p, loss_fn, params, data, key):
    calls.append((p.config.learning_rate, jax.random.key_data(key)))
    return dpsco_jax.Result({"w": jnp.full(D, _score(len(calls)))}, p.privacy, 0)

  monkeypatch.setattr(selection_module.SelectionLaw, "sample", fake_sample)
  monkeypatch.setattr(tuning_api, "run", fake_run)
  key = jax.random.key(3)
  got = dpsco_jax.private_select(_plans(), LAW, loss, PARAMS, TRAIN, key,
                                 score=lambda p: float(p["w"][0]), metric_data="public",
                                 rule=rule)
  assert len(calls) == SECRET_K and {lr for lr, _ in calls} == set(GRID)
  scores = [_score(j) for j in range(1, SECRET_K + 1)]
  best = int(np.argmin(scores) if rule == "min" else np.argmax(scores)) + 1
  assert got.score == pytest.approx(_score(best))
  assert got.config.learning_rate == calls[best - 1][0]
  # K's key is used for nothing else: not a run's key, not the caller's; runs' keys distinct
  run_keys = {bytes(np.asarray(k)) for _, k in calls}
  assert len(run_keys) == SECRET_K
  assert bytes(np.asarray(sample_keys[0])) not in run_keys | {
      bytes(np.asarray(jax.random.key_data(key)))}
  # only the release: no K, no other run's score, no time
  assert {f.name for f in dataclasses.fields(got)} == {"params", "config", "plan", "score",
                                                        "privacy", "cost"}
  text = repr(got)
  assert str(SECRET_K) not in text
  others = [j for j in range(1, SECRET_K + 1) if j != best][:50]
  assert all(f"{_score(j):.5f}" not in text for j in others)


def test_a_diverging_candidate_is_not_eligible(monkeypatch):
  def fake_run(p, loss_fn, params, data, key):
    if p.config.learning_rate == GRID[1]:
      raise dpsco_jax.result.NonFiniteRelease("diverged")
    return dpsco_jax.Result({"w": jnp.ones(D)}, p.privacy, 0)

  monkeypatch.setattr(selection_module.SelectionLaw, "sample",
                      lambda self, key, shape=(): np.asarray(6))
  monkeypatch.setattr(tuning_api, "run", fake_run)
  got = dpsco_jax.private_select(_plans(), LAW, loss, PARAMS, TRAIN, jax.random.key(0),
                                 score=public_loss, metric_data="public")
  assert got.config.learning_rate == GRID[0]
  monkeypatch.setattr(tuning_api, "run",
                      lambda p, *a: dpsco_jax.Result({"w": jnp.full(D, jnp.nan)}, p.privacy, 0))
  with pytest.raises(RuntimeError, match="no candidate run was eligible"):
    dpsco_jax.private_select(_plans(), LAW, loss, PARAMS, TRAIN, jax.random.key(0),
                             score=public_loss, metric_data="public")
