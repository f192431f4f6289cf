"""YAML sweeps reach your code and data (issue 25.1): a ``problem:`` section names a factory or
a model + loss + data file by import path, ``algorithm: flax.DPTrainer`` trains an nnx model,
records carry your metrics (``select`` / ``compare`` read them), and every error in the user
part of a config is one line with exit code 2 before anything runs."""

import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import yaml

from dpsco_jax import runner
from dpsco_jax.runner import user as runner_user
from dpsco_jax.__main__ import main
from dpsco_jax.runner.stats import paired_comparison

ROOT = pathlib.Path(__file__).resolve().parents[1]

USER_MODULE = '''
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpsco_jax.data import UserData

W = np.array([1.5, -1.0, 0.5], np.float32)


def table(n_users, seed=0):
  rng = np.random.default_rng(seed)
  users = np.repeat(np.arange(n_users), 3)
  x = rng.normal(size=(users.size, 3)).astype(np.float32)
  y = (x @ W > 0).astype(np.int32)
  return users, x, y


def init_params(dim: int = 3):
  return {"w": jnp.zeros(dim), "b": jnp.zeros(())}


def logistic(params, ex):
  z = jnp.dot(params["w"], ex["x"]) + params["b"]
  return jnp.logaddexp(0.0, z) - ex["y"] * z


def accuracy(params, data):
  items = data.items()
  z = items["x"] @ np.asarray(params["w"]) + float(params["b"])
  return float(np.mean((z > 0) == (items["y"] > 0)))


class Tiny(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, dim: int = 3):
    self.lin = nnx.Linear(dim, 2, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)


def tiny_loss(model, ex):
  return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])


def tiny_accuracy(model, data):
  items = data.items()
  pred = jnp.argmax(model(jnp.asarray(items["x"])), -1)
  return float(jnp.mean(pred == jnp.asarray(items["y"])))


def make_problem(n_users: int = 40, seed: int = 0):
  users, x, y = table(n_users)
  data = UserData.from_arrays({"x": x, "y": y}, users, max_items_per_user=3)
  return logistic, init_params(), data, accuracy


def make_flipped(n_users: int = 40):
  return {"loss": logistic, "model": init_params(), "data": None}


def make_synthetic(n_users: int, key):
  from dpsco_jax.problems import make_problem
  return make_problem({"problem": "logistic", "n_users": n_users, "m": 2, "d": 3}, key)
'''


@pytest.fixture
def user_mod(tmp_path, monkeypatch):
  """A user's module on the import path (a unique name per test) and data files beside it."""
  name = f"usermod_{abs(hash(str(tmp_path))) % 10**8}"
  (tmp_path / f"{name}.py").write_text(USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  mod = __import__(name)
  users, x, y = mod.table(40)
  np.savez(tmp_path / "train.npz", user_ids=users, x=x, y=y)
  te_users, te_x, te_y = mod.table(20, seed=1)
  np.savez(tmp_path / "test.npz", user_ids=te_users, x=te_x, y=te_y)
  lines = ["uid,f0,f1,f2,label"] + [f"u{u},{a:.6f},{b:.6f},{c:.6f},{lab}"
                                    for u, (a, b, c), lab in zip(users, x, y)]
  (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
  monkeypatch.chdir(tmp_path)
  return name


def _write(tmp_path, text: str) -> str:
  path = tmp_path / "c.yaml"
  path.write_text(textwrap.dedent(text))
  return str(path)


NPZ_PROBLEM = """\
problem:
  model: "{m}:init_params"
  loss: "{m}:logistic"
  data: {{path: train.npz, max_items_per_user: 3}}
  eval_data: test.npz
  metric: "{m}:accuracy"
  n_users: 40
"""


def test_npz_model_loss_data_runs_end_to_end_with_metric_select_and_compare(
    tmp_path, user_mod, capsys):
  cfg = _write(tmp_path, NPZ_PROBLEM.format(m=user_mod) + """\
tuning_seeds: [0]
eval_seeds: [10, 11]
select: {metric: accuracy, over: [learning_rate], rule: max_mean}
compare: {baseline: nonprivate_sgd, metric: accuracy, better: higher, resamples: 200}
experiments:
  - algorithm: {name: nonprivate_sgd, num_steps: 60, batch_size: 10, learning_rate: [0.001, 2.0]}
  - algorithm: {name: dp_sgd_user, epsilon: 2.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 20,
                sampling_rate: 0.25, learning_rate: 1.0}
""")
  out = tmp_path / "res.json"
  records = runner.main_run(cfg, out=str(out), progress=True)
  captured = capsys.readouterr()
  assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
  evals = [r for r in records if r["phase"] == "eval"]
  assert {r["problem"] for r in records} == {"user"}
  assert all("excess_risk" not in r and 0.0 <= r["accuracy"] <= 1.0 for r in records)
  assert all(r["d"] == 4 and r["n_users"] == 40 and r["m"] == 3 for r in records)
  np_runs = [r for r in evals if r["algorithm"] == "nonprivate_sgd"]
  lrs = {r.get("learning_rate", r["config"].get("learning_rate")) for r in np_runs}
  assert lrs == {2.0}  # the selection read the accuracy
  assert min(r["accuracy"] for r in np_runs) > 0.85  # held-out users of a separable problem
  dp = [r for r in evals if r["algorithm"] == "dp_sgd_user"]
  assert all(r["provenance"] == "accountant" and abs(r["epsilon"] - 2.0) < 1e-2 for r in dp)
  summary = json.loads(out.read_text())["summary"]
  base, row = summary
  assert base["compare_role"] == "baseline" and row["compare_metric"] == "accuracy"
  assert row["paired_seeds"] == 2 and row["accuracy_mean"] == pytest.approx(
      np.mean([r["accuracy"] for r in dp]))
  assert "accuracy_mean" in captured.out and "excess_risk" not in captured.out
  assert "higher accuracy" in captured.out
  assert "step 20/20 eps" in captured.err  # progress of a user run: steps and epsilon so far


def test_csv_table_and_flax_dptrainer_from_a_config(tmp_path, user_mod):
  cfg = _write(tmp_path, f"""\
problem:
  model: "{user_mod}:Tiny"
  loss: "{user_mod}:tiny_loss"
  data: {{path: train.csv, user_column: uid, columns: {{x: [f0, f1, f2], y: label}},
          max_items_per_user: 3}}
  metric: {{train_accuracy: "{user_mod}:tiny_accuracy"}}
  n_users: 40
seed: [0, 1]
algorithm: {{name: flax.DPTrainer, epsilon: 3.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 10,
             sampling_rate: 0.25, learning_rate: 0.5, optimizer: adam}}
""")
  records = runner.main_run(cfg, progress=False)
  assert [r["status"] for r in records] == ["ok", "ok"], records
  for r in records:
    assert r["algorithm"] == "flax.DPTrainer" and r["provenance"] == "accountant"
    assert r["relation"] == "add_remove" and r["epsilon"] <= 3.0 + 1e-9
    assert r["epsilon"] == pytest.approx(3.0, rel=1e-2) and r["epsilon_kind"] == "exact"
    assert r["expected_batch_size"] == pytest.approx(0.25 * 40)  # q x the declared n_users
    assert r["d"] == 3 * 2 + 2 and r["n_users"] == 40 and 0 <= r["train_accuracy"] <= 1
    assert r["user_metrics"] == ["train_accuracy"] and r["config"]["optimizer"] == "adam"


def test_flax_dptrainer_cyclic_banded_from_a_config(tmp_path, user_mod):
  """The DPTrainer's cyclic schedule and MF noise keys reach it from YAML: the record says
  which noise ran (and its strategy), on the cyclic plan's relation and schedule."""
  cfg = _write(tmp_path, f"""\
problem:
  model: "{user_mod}:Tiny"
  loss: "{user_mod}:tiny_loss"
  data: {{path: train.npz, max_items_per_user: 3}}
  metric: {{train_accuracy: "{user_mod}:tiny_accuracy"}}
algorithm: {{name: flax.DPTrainer, epsilon: 3.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 8,
             learning_rate: 0.5, sampling: cyclic, batch_size: 10,
             noise_mechanism: banded, bands: 2, mf_strategy: sqrt}}
""")
  [r] = runner.main_run(cfg, progress=False)
  assert r["status"] == "ok", r
  assert r["noise_mechanism"] == "banded" and r["sampling"] == "cyclic" and r["bands"] == 2
  assert r["batch_size"] == 10 and r["expected_batch_size"] == 10.0  # D = B
  assert r["relation"] == "zero_out" and r["mf_strategy"] and r["mf_sensitivity"] > 0
  assert r["epsilon"] == pytest.approx(3.0, rel=1e-2) and r["epsilon"] <= 3.0 + 1e-9


def test_a_run_trains_a_copy_of_the_problems_model(user_mod):
  from flax import nnx
  mod = sys.modules[user_mod]
  model = mod.Tiny(nnx.Rngs(0))
  users, x, y = mod.table(40)
  from dpsco_jax.data import UserData
  data = UserData.from_arrays({"x": x, "y": y}, users, max_items_per_user=3)
  problem = runner_user.UserProblem(mod.tiny_loss, model, data, n_users=40,
                                    metrics={"acc": mod.tiny_accuracy})
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  cfg = {"algorithm": "nonprivate_sgd", "problem": "user", "num_steps": 30, "batch_size": 10,
         "learning_rate": 1.0, "seed": 0}
  record = runner_user.run(problem, cfg, jax.random.key(0))
  after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  assert jax.tree.all(jax.tree.map(np.array_equal, before, after))  # rows share the problem
  assert record["acc"] > mod.tiny_accuracy(model, data)  # the trained copy is better


def test_a_factory_returning_a_tuple_with_its_metric(tmp_path, user_mod):
  cfg = _write(tmp_path, f"""\
problem: {{factory: "{user_mod}:make_problem", args: {{n_users: 40}}, n_users: 40}}
seed: 3
algorithm: {{name: nonprivate_sgd, num_steps: 40, batch_size: 10, learning_rate: 2.0}}
""")
  (record,) = runner.main_run(cfg, progress=False)
  assert record["status"] == "ok" and record["source"] == f"{user_mod}:make_problem"
  assert record["user_metrics"] == ["accuracy"] and record["accuracy"] > 0.85
  # the factory's problem failing at run time is one failed record, not a crash
  bad = _write(tmp_path, f"""\
problem: {{factory: "{user_mod}:make_flipped"}}
algorithm: {{name: nonprivate_sgd, num_steps: 5}}
""")
  (failed,) = runner.main_run(bad, progress=False)
  assert failed["status"] == "failed" and "data must be a dpsco_jax.data.UserData" in (
      failed["error"])
  # a factory may return a problem object with a known optimum: it runs like the registered
  # problems and its records have excess_risk (the default metric of select and compare)
  synthetic = _write(tmp_path, f"""\
problem: {{factory: "{user_mod}:make_synthetic", args: {{n_users: 50}}}}
seed: [0, 1]
compare: {{baseline: slow}}
experiments:
  - {{label: slow, algorithm: {{name: nonprivate_sgd, num_steps: 20, learning_rate: 0.001}}}}
  - {{label: fast, algorithm: {{name: nonprivate_sgd, num_steps: 20, learning_rate: 1.0}}}}
""")
  records = runner.main_run(synthetic, progress=False)
  assert [r["status"] for r in records] == ["ok"] * 4
  assert all(r["problem"] == "user" and r["n_users"] == 50 and r["excess_risk"] >= 0
             for r in records)
  fast = [r["excess_risk"] for r in records if r["label"] == "fast"]
  slow = [r["excess_risk"] for r in records if r["label"] == "slow"]
  assert max(fast) < min(slow)


@pytest.mark.parametrize("problem,algorithm,extra,match", [
    ('factory: "no_such_module_xyz:make"', "nonprivate_sgd", "",
     r"problem.factory: cannot import module 'no_such_module_xyz' \(ModuleNotFoundError"),
    ('factory: "{m}:make_problm"', "nonprivate_sgd", "",
     r"has no 'make_problm' \(did you mean 'make_problem'\?\)"),
    ('factory: "{m}:make_problem"\n  args: {{n_user: 3}}', "nonprivate_sgd", "",
     r"make_problem takes no argument 'n_user' \(did you mean 'n_users'\?\)"),
    ('factory: "{m}:make_problem"\n  args: {{seed: 3}}', "nonprivate_sgd", "",
     r"args.seed: the runner passes seed itself"),
    ('factory: "{m}:W"', "nonprivate_sgd", "", r"'.*:W' is a ndarray, not a callable"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"', "nonprivate_sgd", "",
     r"needs factory, or model, loss and data \(missing: data\)"),
    ('factory: "{m}:make_problem"\n  data: train.npz', "nonprivate_sgd", "",
     r"problem.data: a factory builds the whole problem"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"\n  data: nope.npz', "nonprivate_sgd", "",
     r"problem.data: no such file .*nope.npz"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"\n  data: {{path: train.csv}}',
     "nonprivate_sgd", "", r"a .csv table needs user_column"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"\n'
     '  data: {{path: train.csv, user_column: user}}', "nonprivate_sgd", "",
     r"problem.data.user_column: .*train.csv has no column 'user'; its columns: uid, f0"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"\n'
     '  data: {{path: train.csv, user_column: uid, columns: {{x: [f0], y: labl}}}}',
     "nonprivate_sgd", "",
     r"problem.data.columns: .*has no column 'labl' \(did you mean 'label'\?\)"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"\n'
     '  data: {{path: train.npz, max_item_per_user: 3}}', "nonprivate_sgd", "",
     r"problem.data: unknown key 'max_item_per_user' \(did you mean 'max_items_per_user'\?\)"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"\n'
     '  data: {{path: train.npz, max_items_per_user: "3"}}', "nonprivate_sgd", "",
     r"problem.data.max_items_per_user must be an integer, got '3'"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"\n  data: train.npz', "dp_sgd_item",
     ", epsilon: 1.0, delta: 1.0e-5", r"dp_sgd_item's guarantee reads m"),
    ('model: "{m}:Tiny"\n  loss: "{m}:tiny_loss"\n  data: train.npz', "flax.DPTrainer",
     ", epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, sampling_rate: 0.1, num_steps: 3, "
     "learning_rate: 0.1", r"flax.DPTrainer under relation add_remove needs expected_batch_size"),
    ('model: "{m}:Tiny"\n  loss: "{m}:tiny_loss"\n  data: train.npz\n  n_users: 40',
     "flax.DPTrainer", ", epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, sampling_rate: 0.1, "
     "num_steps: 3, lr: 0.1", r"unknown key 'lr' .*\(did you mean 'learning_rate'\?\)"),
    ('model: "{m}:Tiny"\n  loss: "{m}:tiny_loss"\n  data: train.npz', "flax.DPTrainer",
     ", epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 3, learning_rate: 0.1, "
     "sampling: cyclic, batch_size: 10, noise_mechanism: bandd",
     r"noise_mechanism must be one of .*'banded'"),
    ('model: "{m}:Tiny"\n  loss: "{m}:tiny_loss"\n  data: train.npz', "flax.DPTrainer",
     ", epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 3, learning_rate: 0.1, "
     "sampling: cyclic, batch_size: 10, noise_mechanism: banded, bands: two",
     r"bands must be an integer, got 'two'"),
    ('model: "{m}:Tiny"\n  loss: "{m}:tiny_loss"\n  data: train.npz\n  n_users: 40',
     "flax.DPTrainer", ", epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 3, "
     "learning_rate: 0.1, sampling_rate: 0.1, noise_mechanism: blt",
     r"flax.DPTrainer: noise_mechanism='blt' is priced for a bounded-participation schedule"),
    ('model: "{m}:Tiny"\n  loss: "{m}:tiny_loss"\n  data: train.npz', "flax.DPTrainer",
     ", epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 3, learning_rate: 0.1, "
     "sampling: cyclic, batch_size: 10, sampling_rate: 0.1",
     r"sampling_rate is a Poisson-sampling argument"),
    ('model: "{m}:Tiny"\n  loss: "{m}:tiny_loss"\n  data: train.npz', "flax.DPTrainer",
     ", epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 3, learning_rate: 0.1, "
     "sampling: cyclic", r"with sampling cyclic needs batch_size"),
    ('name: logistic\n  n_users: 10\n  m: 1\n  d: 2', "flax.DPTrainer",
     ", epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, sampling_rate: 0.1, num_steps: 3, "
     "learning_rate: 0.1", r"flax.DPTrainer trains your nnx model: it runs on a user problem"),
    ('model: "{m}:init_params"\n  loss: "{m}:logistic"\n  data: train.npz\n'
     '  metric: {{epsilon: "{m}:accuracy"}}', "nonprivate_sgd", "",
     r"problem.metric: 'epsilon' is a field every record has"),
    ('factory: "{m}:make_problem"', "dp_bilevel", ", epsilon: 1.0, delta: 1.0e-5",
     r"dp_bilevel cannot run on your model and data: it is a bilevel method"),
])
def test_each_error_in_the_user_part_is_one_line_and_exit_2(tmp_path, user_mod, capsys,
                                                           problem, algorithm, extra, match):
  import re
  cfg = _write(tmp_path, f"problem:\n  {problem.format(m=user_mod)}\n"
                         f"algorithm: {{name: {algorithm}{extra}}}\n")
  assert main(["run", cfg, "--quiet"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("dpsco: error: "), err
  assert re.search(match, err[0]), err[0]


@pytest.mark.parametrize("text,match", [
    ("data: logistic\nalgorithm: nonprivate_sgd\n",
     r"data: must be a mapping .* or a data file \(a path ending in .npz, .csv, .parquet"),
    (NPZ_PROBLEM + "algorithm: {{name: nonprivate_sgd, num_steps: 5}}\n"
     "compare: {{baseline: nonprivate_sgd, better: more}}\n", r"compare.better must be lower or "
     "higher"),
    (NPZ_PROBLEM + "seed: [0, 1]\nalgorithm: {{name: nonprivate_sgd, num_steps: 5}}\n"
     "compare: {{baseline: nonprivate_sgd}}\n",
     r"compare.metric is excess_risk \(the default\), but your problem has no known optimum: "
     r"name one of its metrics \(accuracy\)"),
])
def test_config_level_errors_of_user_problems_are_one_line(tmp_path, user_mod, capsys, text,
                                                           match):
  import re
  cfg = _write(tmp_path, text.format(m=user_mod))
  assert main(["run", cfg, "--quiet"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and re.search(match, err[0]), err


def test_the_cli_process_exits_2_on_an_import_error(tmp_path):
  cfg = _write(tmp_path, 'problem: {factory: "not_a_module_zz:make"}\n'
                         "algorithm: nonprivate_sgd\n")
  proc = subprocess.run([sys.executable, "-m", "dpsco_jax", "run", cfg, "--quiet"],
                        capture_output=True, text=True, timeout=600, cwd=tmp_path)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "dpsco: error: problem.factory: cannot import module 'not_a_module_zz' "
      "(ModuleNotFoundError: No module named 'not_a_module_zz')"]
  assert proc.stdout == ""  # nothing ran


def test_paired_wins_follow_the_direction_of_the_metric():
  row, base = {0: 0.9, 1: 0.8, 2: 0.7}, {0: 0.8, 1: 0.8, 2: 0.9}
  lower = paired_comparison(row, base, resamples=200)
  higher = paired_comparison(row, base, resamples=200, better="higher")
  assert lower["wins"] == 1 and higher["wins"] == 1 and lower["ratio"] == higher["ratio"]
  assert paired_comparison({0: 1.0, 1: 1.0}, {0: 0.5, 1: 0.5}, better="higher")["wins"] == 2
  with pytest.raises(ValueError, match="better"):
    paired_comparison(row, base, better="up")


def test_the_digits_config_runs_as_a_sweep_on_a_tiny_seed_list(tmp_path, monkeypatch):
  """configs/digits_user_level.yaml (the README's digits comparison) on one tuning and one
  evaluation seed, 30 steps per run: every algorithm runs, the table reads test accuracy."""
  monkeypatch.chdir(ROOT)
  monkeypatch.syspath_prepend(str(ROOT))
  config = yaml.safe_load((ROOT / "configs" / "digits_user_level.yaml").read_text())
  assert config["problem"]["factory"] == "experiments.digits_problem:make_digits"
  config.update(tuning_seeds=[0], eval_seeds=[100])
  for entry in config["experiments"]:
    entry["algorithm"]["num_steps"] = 30
  path = tmp_path / "digits_tiny.yaml"
  path.write_text(yaml.safe_dump(config))
  out = tmp_path / "digits.json"
  records = runner.main_run(str(path), out=str(out), progress=False)
  assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
  evals = {r["algorithm"]: r for r in records if r["phase"] == "eval"}
  assert set(evals) == {"nonprivate_sgd", "dp_sgd_user", "flax.DPTrainer"}
  assert all(r["n_users"] == 144 and r["m"] == 16 for r in evals.values())
  assert evals["nonprivate_sgd"]["test_accuracy"] > 0.6  # 10 classes: chance is 0.1
  for name in ("dp_sgd_user", "flax.DPTrainer"):
    assert evals[name]["epsilon"] == pytest.approx(4.0, rel=1e-3)
    assert evals[name]["relation"] == "add_remove" and evals[name]["test_accuracy"] > 0.1
  summary = json.loads(out.read_text())["summary"]
  assert [r["algorithm"] for r in summary] == ["nonprivate_sgd", "dp_sgd_user",
                                               "flax.DPTrainer"]
  assert all("test_accuracy_mean" in r for r in summary)


def test_the_record_holds_the_public_sizes_only(tmp_path, user_mod):
  """Under add_remove the realized number of users is private: the record says the declared
  n_users (here 60, the data holds 40), and a measured m (the largest user's item count) is
  not recorded under any relation; a declared m is."""
  run = """\
seed: 0
experiments:
  - algorithm: {name: dp_sgd_user, epsilon: 2.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 3,
                learning_rate: 1.0, %s}
"""
  measured = NPZ_PROBLEM.format(m=user_mod).replace(
      "{path: train.npz, max_items_per_user: 3}", "train.npz")
  (poisson,) = runner.main_run(_write(tmp_path, measured.replace("n_users: 40", "n_users: 60")
                                      + run % "sampling_rate: 0.25"), progress=False)
  assert poisson["status"] == "ok" and poisson["relation"] == "add_remove", poisson
  assert poisson["n_users"] == 60 and "m" not in poisson
  (fixed,) = runner.main_run(_write(tmp_path, NPZ_PROBLEM.format(m=user_mod)
                                    + run % "batch_size: 8, sampling: fixed"), progress=False)
  assert fixed["status"] == "ok" and fixed["relation"] == "replace_one", fixed
  assert fixed["n_users"] == 40 and fixed["m"] == 3     # public there, and m declared
  # the metrics say what they read: here eval_data, not declared public
  assert fixed["metrics_data"].startswith("eval_data (held-out users")
  no_eval = NPZ_PROBLEM.format(m=user_mod).replace("  eval_data: test.npz\n", "")
  (train,) = runner.main_run(_write(tmp_path, no_eval + run % "batch_size: 8, sampling: fixed"),
                             progress=False)
  assert train["status"] == "ok" and "not covered" in train["metrics_data"]
  assert train["metrics_data"].startswith("the training users")
