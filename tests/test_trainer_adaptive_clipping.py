"""Adaptive clipping in flax.DPTrainer (issue 48.2): the clip norm C_t in the trainer's noise
state tracks the target quantile, the ledger and epsilon are DP-SGD's adaptive plan's, C_t is
checkpointed and resumed, the refusals (Python and YAML), and the cyclic schedule / audit hook.

The data: every user's gradient norm is exactly 3 (a linear loss whose gradient is the input,
of norm 3), so the median of the users' norms is 3."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpsco_jax as dp
from dpsco_jax.__main__ import main
from dpsco_jax.flax import DPTrainer

N, D_IN, NORM = 40, 3, 3.0


class Lin(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.lin = nnx.Linear(D_IN, 1, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)


def linear_loss(model, ex):   # gradient wrt the kernel: the input x (norm NORM)
  return jnp.sum(model(ex[0]))


def _data():
  v = np.random.default_rng(0).normal(size=(N, D_IN))
  v = NORM * v / np.linalg.norm(v, axis=1, keepdims=True)
  return (jnp.asarray(v[:, None, :], jnp.float32),)   # [users, m=1, d]


DATA = _data()
BASE = dict(sampling_rate=1.0, expected_batch_size=float(N), noise_multiplier=1.0, delta=1e-5,
            key=1)


def _trainer(**kw):
  args = {**BASE, "clip_norm": "adaptive", "initial_clip_norm": 1.0,
          "clip_learning_rate": 0.5, **kw}
  return DPTrainer(Lin(nnx.Rngs(0)), linear_loss, optax.sgd(0.01), data=DATA, **args)


# ----------------------------------------------------------------------- the tracker


@pytest.mark.parametrize("c0", [0.1, 30.0])
def test_clip_norm_approaches_the_median_norm_from_below_and_above(c0):
  tr = _trainer(initial_clip_norm=c0)
  clips = np.array([r["clip_norm"] for r in tr.train(40, report_every=1)])
  assert clips[0] != c0 and (clips[0] > c0) == (c0 < NORM)   # the first step moves toward 3
  # steps of exp(+-eta/2) = 1.28 around 3 (plus the count's noise, sd sigma_b / D = 0.05)
  late = clips[-15:]
  assert np.median(late) == pytest.approx(NORM, rel=0.3), late
  assert np.all((late > NORM / 1.7) & (late < NORM * 1.7)), late
  assert tr.current_clip_norm == pytest.approx(clips[-1])
  assert tr.state.opt_state[0].clip_norm == pytest.approx(clips[-1])   # carried in the state


def test_fast_clipping_honours_the_adaptive_norm_as_vmap_does():
  """The fast path clips at C_t (not at C_0): the same run with method='vmap' (per-user
  gradients) gives the same clip norms and params."""
  fast, ref = _trainer(method="fast"), _trainer(method="vmap")
  cf = [r["clip_norm"] for r in fast.train(6, report_every=1)]
  cv = [r["clip_norm"] for r in ref.train(6, report_every=1)]
  np.testing.assert_allclose(cf, cv, rtol=1e-5)
  assert cf[-1] > 1.0 * 1.2   # it moved away from C_0 = 1 (all users clipped: C grows)
  np.testing.assert_allclose(fast.params["lin"]["kernel"].value,
                             ref.params["lin"]["kernel"].value, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------- accounting


def test_epsilon_and_split_equal_dp_sgd_adaptive_plan():
  q, z, steps, c0 = 0.25, 1.1, 6, 2.0
  tr = DPTrainer(Lin(nnx.Rngs(0)), linear_loss, optax.sgd(0.01), data=DATA,
                 clip_norm="adaptive", initial_clip_norm=c0, sampling_rate=q,
                 expected_batch_size=q * N, noise_multiplier=z, delta=1e-5, key=0)
  tr.train(steps, report_every=steps)
  plan = dp.plan("dp_sgd_user", {"noise_multiplier": z, "delta": 1e-5, "clip_norm": "adaptive",
                                 "initial_clip_norm": c0, "sampling_rate": q, "n_users": N,
                                 "num_steps": steps, "learning_rate": 0.01},
                 dp.data.UserData.from_arrays({"x": np.zeros((N, 3), np.float32)},
                                              np.arange(N)).spec, num_params=3)
  report = tr.privacy_report()
  assert report.epsilon == pytest.approx(plan.privacy.epsilon, rel=1e-9)
  # the same split (z_Delta, sigma_b = max(D / 20, z)) and note as the plan's
  note = [p for p in plan.privacy.notes.split("; ") if p.startswith("adaptive clipping")]
  assert note and note[0] in report.notes
  assert tr.adaptive.split == plan.detail.adaptive.split
  assert tr.denominator == plan.detail.denominator
  assert tr.noise_stddev == pytest.approx(tr.adaptive.split.sum_multiplier * c0 / (q * N))
  assert "adaptive clip (C_0=2" in report.mechanisms[0]


def test_calibrated_target_epsilon_is_met_as_with_a_fixed_clip():
  kw = dict(sampling_rate=0.5, expected_batch_size=20.0, delta=1e-5, target_epsilon=2.0,
            num_steps=4, key=0)
  fixed = DPTrainer(Lin(nnx.Rngs(0)), linear_loss, optax.sgd(0.01), data=DATA, clip_norm=1.0,
                    **kw)
  adaptive = DPTrainer(Lin(nnx.Rngs(0)), linear_loss, optax.sgd(0.01), data=DATA,
                       clip_norm="adaptive", initial_clip_norm=1.0, **kw)
  assert adaptive.noise_multiplier == fixed.noise_multiplier
  assert adaptive.adaptive.split.noise_multiplier == fixed.noise_multiplier
  assert adaptive.event == fixed.event


# ----------------------------------------------------------------------- checkpoints


def test_resume_continues_with_the_saved_clip_norm_bit_identically(tmp_path):
  whole = _trainer()
  whole.train(8, report_every=2)
  first = _trainer()
  first.train(4, report_every=2, checkpoint_dir=tmp_path)
  saved = first.current_clip_norm
  assert saved != 1.0
  resumed = _trainer().restore(tmp_path)
  assert resumed.current_clip_norm == saved   # the saved C_4, not the initial C_0 = 1
  resumed.train(4, report_every=2)
  assert resumed.current_clip_norm == whole.current_clip_norm
  np.testing.assert_array_equal(resumed.params["lin"]["kernel"].value,
                                whole.params["lin"]["kernel"].value)
  assert resumed.epsilon() == whole.epsilon()
  assert [r["clip_norm"] for r in resumed.history] == [r["clip_norm"] for r in whole.history]


def test_adaptive_and_fixed_checkpoints_refuse_each_other_in_one_line(tmp_path):
  adaptive, fixed = _trainer(), _trainer(clip_norm=1.0, initial_clip_norm=None,
                                         clip_learning_rate=None)
  adaptive.train(2, report_every=2, checkpoint_dir=tmp_path / "a")
  fixed.train(2, report_every=2, checkpoint_dir=tmp_path / "f")
  fresh_fixed = _trainer(clip_norm=1.0, initial_clip_norm=None, clip_learning_rate=None)
  with pytest.raises(ValueError, match=r"adaptive clipping .* fixed clip_norm=1") as err:
    fresh_fixed.restore(tmp_path / "a")
  assert "\n" not in str(err.value)
  with pytest.raises(ValueError, match=r"fixed clip_norm=1\.0; this trainer uses adaptive") as err:
    _trainer().restore(tmp_path / "f")
  assert "\n" not in str(err.value)
  # another adaptive configuration is the fingerprint's refusal
  with pytest.raises(ValueError, match="privacy configuration"):
    _trainer(target_quantile=0.7).restore(tmp_path / "a")


# ----------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw,match", [
    ({"target_quantile": 0.0}, r"target_quantile must lie in the open interval \(0, 1\)"),
    ({"target_quantile": 1.0}, r"target_quantile must lie in the open interval \(0, 1\)"),
    ({"target_quantile": 1.5}, r"target_quantile must lie in the open interval \(0, 1\)"),
    ({"initial_clip_norm": 0.0}, r"initial_clip_norm must be"),
    ({"initial_clip_norm": -1.0}, r"initial_clip_norm must be"),
    ({"initial_clip_norm": None}, r"clip_norm='adaptive' needs initial_clip_norm"),
    ({"clip_learning_rate": 0.0}, r"clip_learning_rate must be"),
    ({"count_stddev": 0.4}, r"count_stddev=0.4 is too small for noise_multiplier"),
    ({"clip_norm": "adaptiv"}, r"clip_norm must be a number > 0 or 'adaptive'"),
    ({"clip_norm": 1.0, "initial_clip_norm": None, "clip_learning_rate": None,
      "count_stddev": 3.0}, r"count_stddev is read only with clip_norm: adaptive"),
    ({"sampling": "cyclic", "batch_size": 10, "num_steps": 8, "noise_mechanism": "banded",
      "sampling_rate": None, "expected_batch_size": None},
     r"refused with noise_mechanism='banded'.*fixed clip norm"),
])
def test_bad_adaptive_arguments_are_refused_at_construction(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    _trainer(**kw)
  assert "\n" not in str(err.value)


# ----------------------------------------------------------------------- cyclic, audit hook


def test_cyclic_independent_adaptive_prices_as_fixed_and_tracks():
  kw = dict(sampling="cyclic", batch_size=20, num_steps=10, noise_multiplier=1.0, delta=1e-5,
            key=2)
  fixed = DPTrainer(Lin(nnx.Rngs(0)), linear_loss, optax.sgd(0.01), data=DATA, clip_norm=1.0,
                    **kw)
  tr = DPTrainer(Lin(nnx.Rngs(0)), linear_loss, optax.sgd(0.01), data=DATA,
                 clip_norm="adaptive", initial_clip_norm=0.5, clip_learning_rate=0.5, **kw)
  clips = [r["clip_norm"] for r in tr.train(10, report_every=1)]
  fixed.train(10, report_every=10)
  assert tr.epsilon() == pytest.approx(fixed.epsilon(), rel=1e-12)
  assert clips[0] > 0.5 and NORM / 1.7 < clips[-1] < NORM * 1.7, clips
  assert "adaptive clipping" in tr.privacy_report().notes


def test_release_fn_runs_the_adaptive_mechanism():
  tr = _trainer()
  noisy = tr.release_fn(3)(jax.random.key(5), DATA)
  quiet = tr.release_fn(3, noise=False)(jax.random.key(5), DATA)
  g = np.asarray(quiet["lin"]["kernel"].value)[:, :, 0]   # [T, d]
  mean_x = np.asarray(DATA[0][:, 0, :]).mean(0)
  # noiseless: every user clipped at C_t (C_0 = 1, then exp(0.5 * 0.5) larger: all clipped)
  c = np.array([1.0, np.exp(0.25), np.exp(0.5)])
  np.testing.assert_allclose(g, c[:, None] * mean_x[None] / NORM, rtol=1e-5)
  assert not np.allclose(np.asarray(noisy["lin"]["kernel"].value), g[..., None])


# ----------------------------------------------------------------------- YAML


USER_MODULE = '''
import jax.numpy as jnp
import optax
from flax import nnx


class Tiny(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.lin = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)


def tiny_loss(model, ex):
  return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])
'''


@pytest.fixture
def yaml_run(tmp_path, monkeypatch):
  """Writes a flax.DPTrainer config of a tiny user module and data file; returns its path."""
  name = f"adaptive_usermod_{abs(hash(str(tmp_path))) % 10**8}"
  (tmp_path / f"{name}.py").write_text(USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  rng = np.random.default_rng(0)
  users = np.repeat(np.arange(20), 2)
  x = rng.normal(size=(40, 3)).astype(np.float32)
  np.savez(tmp_path / "train.npz", user_ids=users, x=x, y=(x[:, 0] > 0).astype(np.int32))
  monkeypatch.chdir(tmp_path)

  def write(algorithm: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(f"""\
        problem:
          model: "{name}:Tiny"
          loss: "{name}:tiny_loss"
          data: {{path: train.npz, max_items_per_user: 2}}
          n_users: 20
        algorithm: {{name: flax.DPTrainer, delta: 1.0e-5, num_steps: 4, sampling_rate: 0.5,
                     learning_rate: 0.1, {algorithm}}}
        """))
    return str(path)
  return write


def test_yaml_adaptive_runs_and_records_its_constants(yaml_run):
  from dpsco_jax import runner
  [r] = runner.main_run(yaml_run("noise_multiplier: 1.0, clip_norm: adaptive, "
                                 "initial_clip_norm: 0.5, target_quantile: 0.7"),
                        progress=False)
  assert r["status"] == "ok", r
  assert r["clip_norm"] == "adaptive" and r["target_quantile"] == 0.7
  assert r["initial_clip_norm"] == 0.5 and r["count_stddev"] == 1.0   # max(D / 20, z)
  assert r["sum_noise_multiplier"] > 1.0   # z_Delta > z = 1: the pair composes to z


@pytest.mark.parametrize("algorithm,match", [
    ("noise_multiplier: 1.0, clip_norm: adaptive, initial_clip_norm: 0.5, target_quantile: 1.5",
     r"target_quantile must lie in the open interval \(0, 1\)"),
    ("noise_multiplier: 1.0, clip_norm: adaptive",
     r"flax.DPTrainer: clip_norm='adaptive' needs initial_clip_norm"),
    ("noise_multiplier: 1.0, clip_norm: 1.0, clip_learning_rate: 0.3",
     r"clip_learning_rate is read only with clip_norm: adaptive"),
    ("noise_multiplier: 1.0, clip_norm: adaptive, initial_clip_norm: 0.5, count_stddev: 0.3",
     r"count_stddev=0.3 is too small for noise_multiplier"),
    ("epsilon: 1.0, clip_norm: adaptive, initial_clip_norm: 0.5, count_stddev: 0.01",
     r"count_stddev=0.01 is too small for noise_multiplier"),   # the calibrated z
])
def test_yaml_refuses_bad_adaptive_values_in_one_line_exit_2(yaml_run, capsys, algorithm,
                                                             match):
  import re
  assert main(["run", yaml_run(algorithm), "--quiet"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and re.search(match, err[0]), err
