"""The runner's outputs (issue 46, "Outputs"): an existing results file or plot is replaced only
with ``--force``, checked before anything runs; a ``--quick`` smoke never replaces a full run's
results; a run whose released params or released numbers are not finite is a failed run."""

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import runner
from dpsco_jax.config.schema import ConfigError

TINY = """\
problem: {name: least_squares, n_users: 16, m: 1, d: 2}
algorithm: {name: nonprivate_sgd, num_steps: 2, batch_size: 4, learning_rate: [0.1, 0.2]}
"""


def _config(tmp_path, text: str = TINY) -> str:
  path = tmp_path / "c.yaml"
  path.write_text(textwrap.dedent(text))
  return str(path)


@pytest.fixture
def nothing_runs(monkeypatch):
  """Any run reached is a failure of the test: the refusal must come before it."""
  def ran(*args, **kwargs):
    raise AssertionError("a run started before the output check")
  monkeypatch.setattr(runner, "run_phases", ran)


def _full_results(path) -> str:
  text = json.dumps({"results": [{"algorithm": "dp_sgd_user", "seed": s, "status": "ok"}
                                 for s in range(3)]})
  path.write_text(text)
  return text


def test_an_existing_results_file_is_kept_without_force(tmp_path, nothing_runs):
  out = tmp_path / "results.json"
  before = _full_results(out)
  with pytest.raises(ConfigError, match=r"results.json already exists: pass --force"):
    runner.main_run(_config(tmp_path), out=str(out), progress=False)
  assert out.read_text() == before


@pytest.mark.parametrize("force", [False, True])
def test_quick_never_replaces_a_full_runs_results(tmp_path, nothing_runs, force):
  out = tmp_path / "results.json"
  before = _full_results(out)
  with pytest.raises(ConfigError, match=r"holds the records of a full run .* even with --force"):
    runner.main_run(_config(tmp_path), out=str(out), progress=False, quick=True, force=force)
  assert out.read_text() == before


def test_quick_refuses_a_file_that_is_not_a_quick_results_file(tmp_path):
  out = tmp_path / "results.json"
  out.write_text('{"results": [{"quick": true}, {"seed": 0')   # a full run, cut short
  with pytest.raises(ConfigError, match="not a --quick results file"):
    runner.check_outputs(str(out), [], quick=True, force=True)
  out.write_text(json.dumps({"results": [{"quick": True}]}))
  runner.check_outputs(str(out), [], quick=True, force=True)   # a smoke replaces a smoke
  with pytest.raises(ConfigError, match="already exists"):
    runner.check_outputs(str(out), [], quick=True, force=False)


def test_existing_plots_are_kept_without_force(tmp_path, nothing_runs):
  out = tmp_path / "res.json"
  png = tmp_path / "res_learning_rate.png"
  png.write_bytes(b"a plot of a full run")
  assert runner.plot_paths("epsilon", ["algorithm", "target_epsilon"], str(out), {}) == [
      str(tmp_path / "res_epsilon.png"), str(tmp_path / "res_epsilon_ratio.png")]
  assert runner.plot_paths("seed", ["algorithm"], str(out), None) == []   # not drawn
  with pytest.raises(ConfigError, match=r"res_learning_rate.png already exists"):
    runner.main_run(_config(tmp_path), out=str(out), plot_field="learning_rate",
                    progress=False)
  assert png.read_bytes() == b"a plot of a full run" and not out.exists()


def test_force_replaces_the_results_file(tmp_path):
  out = tmp_path / "results.json"
  _full_results(out)
  records = runner.main_run(_config(tmp_path), out=str(out), progress=False, force=True)
  written = json.loads(out.read_text())["results"]
  assert [r["status"] for r in records] == ["ok", "ok"] and len(written) == 2
  assert {r["algorithm"] for r in written} == {"nonprivate_sgd"}


def test_the_cli_exits_2_with_one_line_before_running(tmp_path, dpsco):
  out = tmp_path / "results.json"
  before = _full_results(out)
  proc = dpsco("run", _config(tmp_path), "--quick", "--out", str(out), "--quiet")
  assert proc.returncode == 2
  [line] = proc.stderr.strip().splitlines()
  assert line.startswith(f"dpsco: error: {out} holds the records of a full run"), line
  assert out.read_text() == before and proc.stdout == ""


# ------------------------------------------------------------------------------- non-finite

NAN_MODULE = '''
import jax.numpy as jnp
import numpy as np
from dpsco_jax.data import UserData


def nan_loss(params, ex):
  return jnp.dot(params["w"], ex["x"]) * jnp.nan


def mean_loss(params, data):
  items = data.items()
  return float(np.mean(items["x"] @ np.asarray(params["w"]) * np.nan))


def make(n_users: int = 20):
  users = np.repeat(np.arange(n_users), 2)
  x = np.random.default_rng(0).normal(size=(users.size, 3)).astype(np.float32)
  data = UserData.from_arrays({"x": x}, users, max_items_per_user=2)
  return nan_loss, {"w": jnp.zeros(3)}, data, mean_loss


def make_no_metric(n_users: int = 20):
  return make(n_users)[:3]


def some_nan_loss(params, ex):   # not finite where the first feature exceeds 1
  return jnp.where(ex["x"][0] > 1.0, jnp.nan, jnp.dot(params["w"], ex["x"]) ** 2)


def make_partial(n_users: int = 20):
  return (some_nan_loss,) + make(n_users)[1:3]
'''


def test_a_nan_loss_is_a_failed_run_saying_why(tmp_path, monkeypatch):
  """A loss that is NaN everywhere: nonprivate_sgd released NaN params, DP-SGD (whose clipping
  drops non-finite users) released pure noise with a NaN loss; both were ``status: ok``."""
  name = f"nanmod_{abs(hash(str(tmp_path))) % 10**8}"
  (tmp_path / f"{name}.py").write_text(NAN_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  cfg = _config(tmp_path, f"""\
problem: {{factory: "{name}:make", n_users: 20}}
experiments:
  - algorithm: {{name: nonprivate_sgd, num_steps: 2, batch_size: 5, learning_rate: 0.1}}
  - algorithm: {{name: dp_sgd_user, epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 2,
                 sampling_rate: 0.5, learning_rate: 0.1}}
""")
  plain, dp = runner.main_run(cfg, progress=False)
  assert plain["status"] == "failed" and dp["status"] == "failed"
  # refused before training, by the pre-run probe of the loss on the owner's data
  for record in (plain, dp):
    assert record["error"] == (
        "NonFiniteRelease: the loss is not finite (NaN or infinity) at the initial point for "
        "every one of the 20 users: a private run would release its noise alone; check the "
        "loss and the data"), record["error"]


def _nan_module(tmp_path, monkeypatch) -> str:
  name = f"nanmod_{abs(hash(str(tmp_path))) % 10**8}"
  (tmp_path / f"{name}.py").write_text(NAN_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  return name


def test_a_private_run_on_a_nan_loss_without_a_metric_fails_before_training(tmp_path,
                                                                            monkeypatch):
  """No metric, so no released number to find the NaN in: DP-SGD's clipping dropped every
  user, the released params were finite noise, and the run was ``status: ok``."""
  name = _nan_module(tmp_path, monkeypatch)
  cfg = _config(tmp_path, f"""\
problem: {{factory: "{name}:make_no_metric", n_users: 20}}
algorithm: {{name: dp_sgd_user, epsilon: 1.0, delta: 1.0e-5, clip_norm: 1.0, num_steps: 2,
            sampling_rate: 0.5, learning_rate: 0.1}}
""")
  [record] = runner.main_run(cfg, progress=False)
  assert record["status"] == "failed", record
  assert "every one of the 20 users" in record["error"]


def test_users_whose_loss_is_not_finite_are_counted_for_the_owner_before_training(
    tmp_path, monkeypatch):
  from dpsco_jax.runner import user as runner_user
  name = _nan_module(tmp_path, monkeypatch)
  mod = __import__(name)
  loss, params, data = mod.make_partial()
  x = np.asarray(data.examples["x"])
  expected = int(np.sum(np.any((x[..., 0] > 1.0) & data.item_mask, axis=1)))
  assert 0 < expected < data.n_users
  for width in (3, 64):   # chunks that wrap at the end, and one chunk
    problem = runner_user.UserProblem(loss=loss, model=params, data=data)   # probed once each
    monkeypatch.setattr(runner_user, "PROBE_USERS", width)
    with pytest.warns(UserWarning, match=rf"^{expected} of 20 users have a loss that is not "
                      "finite at the initial point"):
      runner_user.check_loss_finite(problem)


def test_a_batched_seed_with_a_non_finite_excess_risk_fails_alone(monkeypatch):
  """Seeds in one program: the record check runs inside the batch's try, so the group runs
  one by one and each seed is failed by itself (it was recorded ok, excess_risk "nan")."""
  algorithms, problems = runner.registry()
  real = problems["least_squares"]

  def broken(cfg, key):
    problem = real(cfg, key)
    if cfg["seed"] == 1:
      problem.excess_risk = lambda params: float("nan")
    return problem
  probs = dict(problems, least_squares=broken)
  runs = [runner._checked({"algorithm": "nonprivate_sgd", "problem": "least_squares",
                           "n_users": 16, "m": 1, "d": 2, "num_steps": 2, "batch_size": 4,
                           "seed": s}, algorithms, probs) for s in (0, 1)]
  ok, bad = runner.execute(runs, algorithms=algorithms, problems=probs, progress=False)
  assert ok["status"] == "ok" and np.isfinite(ok["excess_risk"])
  assert bad["status"] == "failed" and "excess_risk = nan" in bad["error"], bad
  assert ok["batch_note"] == "batching failed (NonFiniteRelease); ran one by one"


def test_a_flax_dptrainer_run_whose_params_are_not_finite_fails(tmp_path, monkeypatch):
  """``algorithm: flax.DPTrainer`` trains outside dpsco_jax.run, whose check of the released
  params it skipped: a run releasing inf params was ``status: ok``."""
  from flax import nnx
  from dpsco_jax.runner import user as runner_user
  from dpsco_jax.result import NonFiniteRelease
  name = _nan_module(tmp_path, monkeypatch)
  data = __import__(name).make()[2]

  class Lin(nnx.Module):   # a parameter that starts (and so stays) infinite
    def __init__(self):
      self.w = nnx.Param(jnp.full(3, jnp.inf))
      self.b = nnx.Param(jnp.zeros(()))

  def loss(model, ex):   # finite: it never reads w
    return (model.b - jnp.sum(ex["x"])) ** 2
  problem = runner_user.UserProblem(loss=loss, model=Lin(), data=data, n_users=20)
  cfg = {"algorithm": "flax.DPTrainer", "problem": "user", "epsilon": 1.0, "delta": 1e-5,
         "clip_norm": 1.0, "num_steps": 2, "sampling_rate": 0.5, "learning_rate": 0.1,
         "seed": 0}
  with pytest.raises(NonFiniteRelease, match=r"flax\.DPTrainer: the released params are not"):
    runner_user.run(problem, cfg, jax.random.key(0))


def test_the_loss_probe_runs_once_per_problem(tmp_path, monkeypatch):
  """The rows of a sweep share a problem: each run probed the whole table again."""
  from dpsco_jax.runner import user as runner_user
  name = _nan_module(tmp_path, monkeypatch)
  loss, params, data = __import__(name).make_partial()
  problem = runner_user.UserProblem(loss=loss, model=params, data=data)
  with pytest.warns(UserWarning, match="users have a loss that is not finite"):
    runner_user.check_loss_finite(problem)
  calls = []
  monkeypatch.setattr(runner_user.jax, "jit", lambda f: calls.append(f) or f)
  runner_user.check_loss_finite(problem)   # no second probe, no second warning
  assert calls == [] and problem.loss_checked
