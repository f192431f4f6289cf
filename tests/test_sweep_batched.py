"""Seed sweeps as one vmapped program (issue 24 part 4): the same records, params and
guarantees as the seeds run one by one; shape-changing keys, opt-out and bad values."""

import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax as dp
from dpsco_jax import api, runner, sweep
from dpsco_jax.config.schema import ConfigError
from dpsco_jax.result import Result

#: record fields that legitimately differ between a batched and a one-by-one run
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
TIMING = ("wall_time_s", "batched", "batch_runs", "batch_wall_time_s", "batch_note")


def _quickstart() -> dict:
  """configs/quickstart.yaml, shrunk so both paths run in a few seconds (same structure:
  problem section, both experiments; one epsilon and two seeds, as each one-by-one private
  run calibrates its noise, the costly part here)."""
  cfg = runner.load_config(str(CONFIGS / "quickstart.yaml"))
  cfg.pop("compare")
  cfg["seed"] = [0, 1]
  cfg["problem"].update(n_users=200)
  for entry in cfg["experiments"]:
    entry["algorithm"]["epochs"] = 2
    if "epsilon" in entry["algorithm"]:
      entry["algorithm"]["epsilon"] = 2.0
  return cfg


def _srgd() -> dict:
  """configs/srgd.yaml at n = 1000, epsilon = 1: an accelerated DP-SRGD row, an
  ill-conditioned single-epoch DP-SGD row, two seeds."""
  cfg = runner.load_config(str(CONFIGS / "srgd.yaml"))
  cfg.update(n_users=1000, epsilon=1.0, seed=[0, 1])
  cfg["experiments"] = [cfg["experiments"][0], cfg["experiments"][-1]]
  return cfg


def _digest(record: dict) -> str:
  """A digest of a record's guarantee: every privacy field, exactly."""
  keys = ("epsilon", "epsilon_kind", "delta", "provenance", "privacy_level", "relation",
          "paper_epsilon", "privacy_notes", "noise_multiplier")
  return hashlib.sha256(json.dumps({k: record.get(k) for k in keys}, sort_keys=True,
                                   default=str).encode()).hexdigest()


def _same_records(batched: list[dict], alone: list[dict]) -> None:
  assert len(batched) == len(alone)
  for b, a in zip(batched, alone):
    assert b["status"] == a["status"] == "ok"
    assert b["batched"] is True and a["batched"] is False
    assert (b["algorithm"], b["seed"]) == (a["algorithm"], a["seed"])   # same order
    assert b["excess_risk"] == pytest.approx(a["excess_risk"], abs=1e-6)
    assert b["epsilon"] == a["epsilon"] and _digest(b) == _digest(a)
    rest_b = {k: v for k, v in b.items() if k not in TIMING + ("excess_risk",)}
    rest_a = {k: v for k, v in a.items() if k not in TIMING + ("excess_risk",)}
    assert rest_b == rest_a


@pytest.mark.parametrize("row", [0, 1], ids=["nonprivate_sgd", "dp_sgd_user"])
def test_quickstart_batched_equals_one_by_one(row):
  cfg = _quickstart()
  cfg["experiments"] = [cfg["experiments"][row]]   # one row per test: each stays short
  batched = runner.run_config(cfg, progress=False)
  alone = runner.run_config({**cfg, "batch_seeds": False}, progress=False)
  _same_records(batched, alone)
  assert {r["batch_runs"] for r in batched} == {2}


def test_srgd_batched_equals_one_by_one():
  cfg = _srgd()
  batched = runner.run_config(cfg, progress=False)
  alone = runner.run_config({**cfg, "batch_seeds": False}, progress=False)
  _same_records(batched, alone)
  assert {r["algorithm"] for r in batched} == {"accelerated_dp_srgd", "single_epoch_dp_sgd"}


@pytest.mark.parametrize("algorithm,extra", [
    ("accelerated_dp_srgd", dict(preset="practical", beta_scale=0.03, clip_norm=0.5,
                                 epsilon=1.0, delta=1e-10)),
    ("dp_sgd_user", dict(num_steps=20, batch_size=20, learning_rate=1.0, clip_norm=1.0,
                         noise_multiplier=1.0, epsilon=None, delta=1e-6)),
])
def test_run_stacked_params_and_reports_equal_one_by_one(algorithm, extra):
  algorithms, problems = runner.registry()
  cfg = dict(problem="least_squares", n_users=200, m=2, d=4, algorithm=algorithm, **extra)
  keys = [jax.random.key(s) for s in (0, 1, 7)]
  insts = [problems["least_squares"](cfg, jax.random.fold_in(k, 0)) for k in keys]
  assert sweep.refusal(insts) is None
  driver = algorithms[algorithm]
  plan = api.plan_problem(algorithm, api.algorithms()[algorithm].config.of(cfg), insts[0])
  alone = [api.execute(plan, p, jax.random.fold_in(k, 1)) for p, k in zip(insts, keys)]
  batched = sweep.run_stacked(driver, insts[0], [p.data for p in insts], plan,
                              [jax.random.fold_in(k, 1) for k in keys])
  for b, a in zip(batched, alone):
    np.testing.assert_allclose(b.params, a.params, atol=1e-6, rtol=0)
    assert b.privacy == a.privacy
    assert b.record == {**a.record, "batched": True}
    assert b.gradient_evaluations == a.gradient_evaluations
  assert len({id(r.privacy) for r in batched}) == len(batched)   # each run its own report
  # the seeds' own keys: different seeds, different params
  assert not np.allclose(batched[0].params, batched[1].params)


def test_run_seeds_on_user_data_equals_run():
  rng = np.random.default_rng(0)
  datas = []
  for s in range(3):   # three data sets of the same shape (e.g. three synthetic draws)
    x = rng.normal(size=(240, 3)).astype(np.float32)
    datas.append(dp.UserData.from_arrays({"x": x, "y": x @ np.ones(3, np.float32)},
                                         np.arange(240) % 60, max_items_per_user=4, seed=s))
  def loss(w, ex):
    return 0.5 * jnp.square(jnp.dot(ex["x"], w["w"]) - ex["y"])
  params = {"w": jnp.zeros(3)}
  p = dp.plan("dp_sgd_user", {"epsilon": 2.0, "delta": 1e-6, "clip_norm": 1.0,
                              "learning_rate": 0.5, "num_steps": 15, "batch_size": 20,
                              "n_users": 60}, datas[0].spec, num_params=3)
  keys = [jax.random.key(s) for s in range(3)]
  batched = api.run_seeds(p, loss, params, datas, keys)
  for b, d, k in zip(batched, datas, keys):
    a = api.run(p, loss, params, d, k)
    np.testing.assert_allclose(b.params["w"], a.params["w"], atol=1e-6, rtol=0)
    assert b.privacy == a.privacy == p.privacy and b.record["batched"] is True
  with pytest.raises(ValueError, match="one key per data set"):
    api.run_seeds(p, loss, params, datas, keys[:2])


def test_a_shape_key_splits_groups_and_different_shapes_are_refused():
  cfg = {"problem": "least_squares", "n_users": [60, 80], "m": 2, "d": 3, "seed": [0, 1],
         "algorithm": "nonprivate_sgd", "num_steps": 5, "batch_size": 10}
  runs = runner.expand(cfg)
  groups = sweep.seed_groups(runs)
  assert len(groups) == 2 and all({runs[i]["n_users"] for i in g} != {60, 80} for g in groups)
  records = runner.run_config(cfg, progress=False)
  assert all(r["batched"] and r["batch_runs"] == 2 for r in records)
  walls = {r["n_users"]: r["batch_wall_time_s"] for r in records}
  assert len(walls) == 2   # one program per shape
  _, problems = runner.registry()
  small, large = (problems["least_squares"]({**runs[0], "n_users": n}, jax.random.key(0))
                  for n in (60, 80))
  assert "n_users" in sweep.refusal([small, large])
  with pytest.raises(sweep.NotBatchable, match="shape"):
    sweep.run_stacked(runner.registry()[0]["nonprivate_sgd"], small, [small.data, large.data],
                      api.plan_problem("nonprivate_sgd", api.algorithms()["nonprivate_sgd"]
                                       .config.of(runs[0]), small),
                      [jax.random.key(0), jax.random.key(1)])


def test_opt_out_and_unbatched_groups_say_so():
  cfg = {"problem": "least_squares", "n_users": 40, "m": 2, "d": 3, "seed": [0, 1],
         "algorithm": "nonprivate_sgd", "num_steps": 3, "batch_size": 10,
         "batch_seeds": False}
  records = runner.run_config(cfg, progress=False)
  assert [r["batched"] for r in records] == [False, False]
  assert not any("batch_runs" in r or "batch_note" in r for r in records)
  algorithms, problems = runner.registry()
  runs = runner.expand({**cfg, "batch_seeds": None, "algorithm": "minibatch_sgd"})
  out, note = runner._batch_records(runs, algorithms, problems, {})
  assert out is None and "minibatch_sgd" in note


def test_a_driver_that_does_not_trace_falls_back(monkeypatch):
  """Python control flow on the data: the batch is abandoned and every seed runs alone."""
  def peeking(problem, cfg, key):
    scale = float(jnp.sum(problem.data["y"]))   # concrete only one seed at a time
    return Result(params=jnp.zeros(problem.d) + scale, privacy=api.PrivacyReport(
        epsilon=float("inf"), delta=1.0, provenance="none", level="none"),
        gradient_evaluations=0)
  monkeypatch.setattr(api, "BATCHED", api.BATCHED | {"peeking"})
  algorithms, problems = runner.registry()
  runs = [{"problem": "least_squares", "n_users": 20, "m": 1, "d": 2, "seed": s,
           "algorithm": "peeking"} for s in (0, 1)]
  monkeypatch.setattr(runner, "_checked_typed", lambda cfg, a, p: (dict(cfg), None))
  out, note = runner._batch_records(runs, {**algorithms, "peeking": peeking}, problems, {})
  assert out is None and "batching failed" in note


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_bad_batch_seeds_value_is_a_config_error(value):
  cfg = {"problem": "least_squares", "n_users": 20, "m": 1, "d": 2, "seed": [0, 1],
         "algorithm": "nonprivate_sgd", "batch_seeds": value}
  with pytest.raises(ConfigError, match="batch_seeds"):
    runner.run_config(cfg, progress=False)


def test_batch_seeds_inside_an_experiment_is_refused():
  cfg = {"problem": "least_squares", "n_users": 20, "m": 1, "d": 2, "seed": [0, 1],
         "experiments": [{"algorithm": "nonprivate_sgd", "batch_seeds": False}]}
  with pytest.raises(ConfigError, match="batch_seeds is a top-level"):
    runner.run_config(cfg, progress=False)
