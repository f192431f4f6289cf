"""Learning-rate grids as one vmapped program (issue 24 part 4, "Sweeps that use the
hardware"): runs that differ only in seed and step size (``learning_rate``; SRGD's ``beta``)
run as one program, each with its own key and report, equal to the runs one by one; a
privacy-relevant key is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax as dp
from dpsco_jax import api, runner, sweep
from dpsco_jax.algorithms.common import hparam

#: record fields that legitimately differ between a batched and a one-by-one run
TIMING = ("wall_time_s", "batched", "batch_runs", "batch_wall_time_s", "batch_note",
          "batch_grid")


def _datas(count: int = 2):
  """``count`` same-shape data sets (seeds of a synthetic draw): 60 users x 4 items."""
  rng = np.random.default_rng(0)
  out = []
  for s in range(count):
    x = rng.normal(size=(240, 3)).astype(np.float32)
    out.append(dp.UserData.from_arrays({"x": x, "y": x @ np.ones(3, np.float32)},
                                       np.arange(240) % 60, max_items_per_user=4, seed=s))
  return out


def _loss(w, ex):
  return 0.5 * jnp.square(jnp.dot(ex["x"], w["w"]) - ex["y"])


PARAMS = {"w": jnp.zeros(3)}
#: an explicit noise multiplier within the epsilon budget (checked, not calibrated: fast)
DPSGD = {"epsilon": 2.0, "delta": 1e-6, "noise_multiplier": 4.0, "clip_norm": 1.0,
         "learning_rate": 0.5, "num_steps": 15, "batch_size": 20, "n_users": 60}
SRGD = {"epsilon": 1.0, "delta": 1e-8, "clip_norm": 1.0, "batch_size": 10, "beta": 3.0,
        "relation": "zero_out"}


def _grid(algorithm: str, base: dict, key: str, values: list, datas: list):
  """Plans, datas and keys of ``values x datas`` (one plan, data set and key per run)."""
  by_value = [dp.plan(algorithm, {**base, key: v}, datas[0].spec, num_params=3) for v in values]
  plans, ds, keys = [], [], []
  for s, d in enumerate(datas):
    assert d.spec == datas[0].spec
    plans += by_value
    ds += [d] * len(values)
    keys += [jax.random.key(s)] * len(values)
  return plans, ds, keys


@pytest.mark.parametrize("algorithm,base,key,values", [
    ("dp_sgd_user", DPSGD, "learning_rate", [0.1, 0.5, 2.0]),
    ("single_epoch_dp_sgd", SRGD, "learning_rate", [0.3, 1.0, 3.0]),
    ("accelerated_dp_srgd", SRGD, "beta", [1.0, 3.0, 10.0]),
], ids=["dp_sgd_user-lr", "single_epoch_dp_sgd-lr", "accelerated_dp_srgd-beta"])
def test_run_grid_equals_runs_one_by_one(algorithm, base, key, values):
  plans, datas, keys = _grid(algorithm, base, key, values, _datas())
  assert all(p.privacy == plans[0].privacy for p in plans)   # a step size: one guarantee
  batched = dp.run_grid(plans, _loss, PARAMS, datas, keys)
  alone = [dp.run(p, _loss, PARAMS, d, k) for p, d, k in zip(plans, datas, keys)]
  for b, a, p in zip(batched, alone, plans):
    np.testing.assert_allclose(b.params["w"], a.params["w"], atol=2e-6, rtol=1e-6)
    assert b.privacy == a.privacy == p.privacy
    assert b.record == {**a.record, "batched": True}
    assert b.gradient_evaluations == a.gradient_evaluations
  assert len({id(r.privacy) for r in batched}) == len(batched)   # each run its own report
  w = [np.asarray(r.params["w"]) for r in batched]
  # the runs' own step sizes and keys: another value or another key, other params
  assert not np.allclose(w[0], w[1]) and not np.allclose(w[0], w[len(values)])


def test_dp_sgd_records_carry_their_own_learning_rate():
  plans, datas, keys = _grid("dp_sgd_user", DPSGD, "learning_rate", [0.1, 2.0], _datas(1))
  out = dp.run_grid(plans, _loss, PARAMS, datas, keys)
  assert [r.record["learning_rate"] for r in out] == [0.1, 2.0]
  assert all(r.record["batched"] is True for r in out)


@pytest.mark.parametrize("key,value", [("epsilon", 4.0), ("clip_norm", 2.0),
                                       ("batch_size", 10), ("num_steps", 5),
                                       ("delta", 1e-7), ("noise_multiplier", 5.0)])
def test_a_privacy_or_schedule_key_is_refused_by_name(key, value):
  d = _datas(1)[0]
  plans = [dp.plan("dp_sgd_user", DPSGD, d.spec, num_params=3),
           dp.plan("dp_sgd_user", {**DPSGD, key: value}, d.spec, num_params=3)]
  with pytest.raises(sweep.NotBatchable, match=f"differ in '{key}'"):
    dp.run_grid(plans, _loss, PARAMS, [d, d], [jax.random.key(0), jax.random.key(1)])
  assert key in sweep.grid_refusal("dp_sgd_user", [p.config for p in plans])


def test_plans_of_other_algorithms_or_shapes_are_refused():
  d = _datas(1)[0]
  p = dp.plan("dp_sgd_user", DPSGD, d.spec, num_params=3)
  q = dp.plan("dp_sgd_item", {**DPSGD, "epsilon": None, "n_users": 240}, d.spec, num_params=3)
  with pytest.raises(sweep.NotBatchable, match="differ in algorithm"):
    dp.run_grid([p, q], _loss, PARAMS, [d, d], [jax.random.key(0)] * 2)
  with pytest.raises(ValueError, match="one key per run"):
    dp.run_grid([p, p], _loss, PARAMS, [d, d], [jax.random.key(0)])
  # SRGD: beta is a step size, epsilon is not
  s = [dp.plan("accelerated_dp_srgd", {**SRGD, **kv}, d.spec, num_params=3)
       for kv in ({}, {"epsilon": 2.0})]
  with pytest.raises(sweep.NotBatchable, match="differ in 'epsilon'"):
    dp.run_grid(s, _loss, PARAMS, [d, d], [jax.random.key(0)] * 2)


def test_the_program_check_refuses_a_key_that_is_not_a_step_size():
  """The safety net under GRID: a grid that claims clip_norm (same report here: epsilon from
  an explicit noise multiplier) is refused, as the traced programs differ beyond the step."""
  algorithms, problems = runner.registry()
  cfg = dict(problem="least_squares", n_users=100, m=2, d=3, algorithm="dp_sgd_user",
             num_steps=10, batch_size=10, learning_rate=0.5, noise_multiplier=1.0,
             epsilon=None, delta=1e-6)
  inst = problems["least_squares"](cfg, jax.random.key(0))
  schema = api.algorithms()["dp_sgd_user"].config
  plans = [api.plan_problem("dp_sgd_user", schema.of({**cfg, "clip_norm": c}), inst)
           for c in (1.0, 2.0)]
  fake = sweep.Grid(frozenset({"clip_norm", "learning_rate"}), ("learning_rate",))
  with pytest.raises(sweep.NotBatchable, match="differ beyond"):
    sweep.run_stacked(algorithms["dp_sgd_user"], inst, [inst.data] * 2, plans,
                      [jax.random.key(0), jax.random.key(1)], grid=fake)
  with pytest.raises(sweep.NotBatchable, match="'clip_norm'"):   # the real grid: by name
    sweep.run_stacked(algorithms["dp_sgd_user"], inst, [inst.data] * 2, plans,
                      [jax.random.key(0), jax.random.key(1)], grid=sweep.GRID["dp_sgd_user"])


def test_a_single_run_reads_its_own_numbers():
  class Problem:
    pass
  assert hparam(Problem(), "learning_rate", 0.25) == 0.25   # no grid: the value itself


def test_seed_groups_merge_step_sizes_only_where_the_algorithm_batches_them():
  base = {"problem": "least_squares", "n_users": 40, "m": 2, "d": 3}
  runs = ([{**base, "algorithm": "dp_sgd_user", "seed": s, "learning_rate": lr, "epsilon": 1.0}
           for s in (0, 1) for lr in (0.1, 1.0)]
          + [{**base, "algorithm": "dp_sgd_user", "seed": s, "learning_rate": 0.1,
              "epsilon": 2.0} for s in (0, 1)]
          + [{**base, "algorithm": "user_level_phased_sgd", "seed": 0, "learning_rate": lr}
             for lr in (0.1, 1.0)])
  assert sweep.seed_groups(runs) == [[0, 1, 2, 3], [4, 5], [6], [7]]


def test_runner_yaml_grid_runs_as_one_program_per_row():
  cfg = {"problem": "least_squares", "n_users": 100, "m": 2, "d": 3, "seed": [0, 1],
         "experiments": [
             {"algorithm": "dp_sgd_user", "num_steps": 10, "batch_size": 10, "clip_norm": 1.0,
              "noise_multiplier": 1.0, "epsilon": None, "delta": 1e-6,
              "learning_rate": [0.1, 0.3, 1.0]},
             {"algorithm": "single_epoch_dp_sgd", "clip_norm": 0.5, "noise_multiplier": 1.0,
              "epsilon": None, "delta": 1e-10, "learning_rate": [1.0, 3.0]}]}
  batched = runner.run_config(cfg, progress=False)
  alone = runner.run_config({**cfg, "batch_seeds": False}, progress=False)
  assert len(batched) == len(alone) == 10
  for b, a in zip(batched, alone):
    assert b["status"] == a["status"] == "ok"
    assert b["batched"] is True and a["batched"] is False
    assert b["excess_risk"] == pytest.approx(a["excess_risk"], abs=1e-6)
    assert b["epsilon"] == a["epsilon"]
    assert ({k: v for k, v in b.items() if k not in TIMING + ("excess_risk",)}
            == {k: v for k, v in a.items() if k not in TIMING + ("excess_risk",)})
  dpsgd = [r for r in batched if r["algorithm"] == "dp_sgd_user"]
  assert {r["batch_runs"] for r in dpsgd} == {6}
  assert all(r["batch_grid"] == {"learning_rate": [0.1, 0.3, 1.0]} for r in dpsgd)
  assert len({r["batch_wall_time_s"] for r in dpsgd}) == 1   # one program for the row
  assert {r["batch_runs"] for r in batched if r["algorithm"] != "dp_sgd_user"} == {4}
  # each (seed, learning rate) its own run: no two released points alike
  assert len({round(r["excess_risk"], 12) for r in dpsgd}) == 6
