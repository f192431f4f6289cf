"""Adaptive clipping (issue 48.2; Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021): the
pair's split of z, the quantile tracker, both noise scales (KS), the step's sensitivity at
C_t, jit / user_mask / keys, the DP-SGD config and plan, its refusals, and an end-to-end fit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpsco_jax import api
from dpsco_jax.algorithms.dpsgd.config import DpSgdConfig
from dpsco_jax.algorithms.dpsgd.driver import dp_sgd_releases
from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.config.types import ConfigError
from dpsco_jax.privacy.sensitivity import AdaptiveClipSplit, adaptive_clip_split
from dpsco_jax.problems import make
from dpsco_jax.transforms.adaptive_clipping import adaptive_clip_and_noise

D = 40.0
QUIET = AdaptiveClipSplit(0.0, 0.0, 0.0)   # no noise: the tracker alone


def _stage(split, *, c0=1.0, gamma=0.5, eta=0.2, denominator=D, key=0):
  return adaptive_clip_and_noise(c0, target_quantile=gamma, clip_learning_rate=eta,
                           denominator=denominator, split=split, key=key)


def _scan(tx, grads, steps, mask=None):
  """``steps`` updates on fixed ``grads`` under jit + lax.scan: (outputs, C_t before each
  step, the released fractions)."""
  @jax.jit
  def run(state):
    def body(state, _):
      out, new = tx.update(grads, state, user_mask=mask)
      return new, (out, state.clip_norm, new.fraction)
    return jax.lax.scan(body, state, None, length=steps)
  _, (outs, clips, fractions) = run(tx.init(None))
  return outs, np.asarray(clips, np.float64), np.asarray(fractions, np.float64)


def _rows_with_norms(norms, d=3):
  """One row per norm, along a random direction."""
  v = np.random.default_rng(0).normal(size=(len(norms), d))
  v /= np.linalg.norm(v, axis=1, keepdims=True)
  return jnp.asarray(v * np.asarray(norms)[:, None], jnp.float32)


# ------------------------------------------------------------------------- the pair's split

def test_split_composes_to_z_and_refuses_a_count_noise_too_small():
  for z, sigma_b in ((1.0, 1.0), (0.7, 2.0), (3.0, 50.0)):
    s = adaptive_clip_split(z, sigma_b)
    assert (s.sum_multiplier ** -2 + s.count_multiplier ** -2) ** -0.5 == pytest.approx(z,
                                                                                     rel=1e-12)
    assert s.sum_multiplier > z and s.count_stage().std == pytest.approx(sigma_b)
  assert adaptive_clip_split(0.0, 2.0).sum_multiplier == 0.0   # non-private reference
  for sigma_b in (0.5, 0.4, 0.0):   # 2 sigma_b <= z = 1: z_Delta would be imaginary
    with pytest.raises(ValueError, match=r"count_stddev=.* is too small .* 2 count_stddev > z"):
      adaptive_clip_split(1.0, sigma_b)


# --------------------------------------------------------------------------- the tracker

NORMS = np.linspace(0.1, 10.0, 40)   # known distribution: the gamma-quantile is ~10 gamma


@pytest.mark.parametrize("gamma", [0.3, 0.7])
def test_tracker_converges_to_the_target_quantile_noise_free(gamma):
  _, clips, fractions = _scan(_stage(QUIET, gamma=gamma, eta=0.1), _rows_with_norms(NORMS),
                              600)
  late = clips[-100:]
  # the fraction of users at most C_t oscillates around gamma, within one user of it
  assert np.mean(NORMS[None, :] <= late[:, None]) == pytest.approx(gamma, abs=1.5 / len(NORMS))
  assert np.quantile(NORMS, gamma) == pytest.approx(np.median(late), rel=0.08)
  assert np.all(np.abs(fractions[-100:] - gamma) <= 0.5)


def test_tracker_converges_with_noise():
  split = adaptive_clip_split(1.0, D / 20)    # the paper's default sigma_b = D / 20
  _, clips, _ = _scan(_stage(split, gamma=0.5, eta=0.1), _rows_with_norms(NORMS), 1500)
  late = clips[-800:]
  assert np.mean(np.mean(NORMS[None, :] <= late[:, None], axis=1)) == pytest.approx(0.5,
                                                                                    abs=0.06)
  assert np.median(late) == pytest.approx(np.quantile(NORMS, 0.5), rel=0.15)


# ------------------------------------------------------------------------ the noise scales

@pytest.mark.statistical
def test_count_noise_scale_ks_accepts_sigma_b_rejects_1_3x():
  """The released fraction minus its noiseless value, over many steps: N(0, (sigma_b/D)^2).
  Norms far on either side of C and a tiny eta keep the noiseless count fixed (half the
  users unclipped: centred count 0); the fractions are public state, no hook needed."""
  sigma_b = 3.0
  norms = np.r_[np.full(20, 0.01), np.full(20, 100.0)]
  split = adaptive_clip_split(1.0, sigma_b)
  _, clips, fractions = _scan(_stage(split, eta=1e-6), _rows_with_norms(norms), 4000)
  assert np.all((clips > 0.5) & (clips < 2.0))   # C_t stayed between the two groups
  dev = (fractions - 0.5) * D       # noiseless fraction: 0 / D + 1/2
  assert stats.kstest(dev, stats.norm(0.0, sigma_b).cdf).pvalue > 1e-3
  for wrong in (1.3, 1 / 1.3):
    assert stats.kstest(dev, stats.norm(0.0, wrong * sigma_b).cdf).pvalue < 1e-6


@pytest.mark.statistical
def test_sum_noise_is_z_delta_times_c_t_not_z():
  """Zero gradients: the noisy mean is the noise alone, std z_Delta C_t / D with C_t moving."""
  z, sigma_b = 1.0, 1.0                 # z_Delta = 1.155 z
  split = adaptive_clip_split(z, sigma_b)
  zeros = jnp.zeros((int(D), 50), jnp.float32)
  outs, clips, _ = _scan(_stage(split, eta=0.5), zeros, 200)
  assert clips.max() / clips.min() > 2     # the norm moved: the std must follow it
  unit = np.asarray(outs, np.float64) * D / clips[:, None]
  assert stats.kstest(unit.ravel(), stats.norm(0.0, split.sum_multiplier).cdf).pvalue > 1e-3
  assert stats.kstest(unit.ravel(), stats.norm(0.0, z).cdf).pvalue < 1e-6


# ------------------------------------------------------------------------- the sensitivity

def test_one_user_moves_the_sum_by_at_most_c_t():
  """Noiseless stage: remove (mask) or replace one user adversarially, at several C_t."""
  rng = np.random.default_rng(1)
  base = jnp.asarray(rng.normal(size=(16, 6)) * 3, jnp.float32)
  tx = _stage(QUIET, denominator=16.0)
  step = jax.jit(lambda g, m, c: tx.update(g, tx.init(None)._replace(clip_norm=c), user_mask=m))
  everyone = jnp.ones(16, bool)
  for c in map(jnp.float32, (0.3, 1.0, 7.0)):
    out, st = step(base, everyone, c)
    worst_remove, worst_replace = 0.0, 0.0
    for i in range(16):
      o2, st2 = step(base, everyone.at[i].set(False), c)
      worst_remove = max(worst_remove, float(jnp.linalg.norm(o2 - out)) * 16)
      assert abs(float(st2.fraction - st.fraction)) * 16 <= 0.5 + 1e-5   # count: 1/2
      for g in (base[i] * -1e3, jnp.full((6,), jnp.nan), jnp.full((6,), 1e30)):
        o3, _ = step(base.at[i].set(g), everyone, c)
        worst_replace = max(worst_replace, float(jnp.linalg.norm(o3 - out)) * 16)
    assert worst_remove <= c * (1 + 1e-5)
    assert worst_replace <= 2 * c * (1 + 1e-5)
    assert worst_replace > 1.5 * c       # the adversary does reach the bound


# ----------------------------------------------------------------- jit, user_mask, keys

def test_jit_equals_eager_mask_excludes_padded_slots_and_keys_are_fresh():
  split = adaptive_clip_split(1.0, 2.0)
  tx = _stage(split, key=jax.random.key(5))
  rows = _rows_with_norms(np.r_[NORMS[:8], 1e6, 1e6])   # two padded slots, huge norms
  mask = jnp.arange(10) < 8
  state = tx.init(None)
  eager, s_eager = tx.update(rows, state, user_mask=mask)
  jitted, s_jit = jax.jit(lambda r, s, m: tx.update(r, s, user_mask=m))(rows, state, mask)
  np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(s_jit.clip_norm, s_eager.clip_norm, rtol=1e-6)
  # padded slots change nothing: same output and fraction as the 8 real rows alone
  alone, s_alone = tx.update(rows[:8], state, user_mask=jnp.ones(8, bool))
  np.testing.assert_allclose(alone, eager, rtol=1e-6)
  assert float(s_alone.fraction) == pytest.approx(float(s_eager.fraction), abs=1e-6)
  # step t draws with fold_in(key, t): a new step, new noise; the repr hides the key
  second, _ = tx.update(rows, s_eager, user_mask=mask)
  assert not np.allclose(second, eager)
  assert "redacted" in repr(s_eager) and int(s_eager.count) == 1
  with pytest.raises(ValueError, match="user_mask must have shape"):
    tx.update(rows, state, user_mask=jnp.ones(3, bool))


def test_stage_refuses_bad_arguments():
  with pytest.raises(ValueError, match="target_quantile must lie in the open interval"):
    _stage(QUIET, gamma=1.0)
  with pytest.raises(ValueError, match="clip_learning_rate"):
    _stage(QUIET, eta=0.0)
  with pytest.raises(ValueError, match="initial_clip_norm"):
    _stage(QUIET, c0=-1.0)
  with pytest.raises(TypeError, match="AdaptiveClipSplit"):
    _stage((1.0, 2.0))


# --------------------------------------------------------------------- config, plan, fit

BASE = dict(noise_multiplier=1.0, delta=1e-5, n_users=200, batch_size=20, num_steps=150)


@pytest.fixture(scope="module")
def problem():
  return make("least_squares", n_users=200, m=4, d=5, key=jax.random.key(0))


def _plan(problem, level="dp_sgd_user", **cfg):
  typed = algorithms()[level].config.of({**BASE, **cfg})
  return api.plan_problem(level, typed, problem)


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -0.2])
def test_config_refuses_target_quantile_outside_the_open_unit_interval(bad):
  with pytest.raises(ConfigError, match=r"target_quantile must lie in the open interval \(0, 1\)"):
    DpSgdConfig(**BASE, clip_norm="adaptive", target_quantile=bad)


def test_config_refuses_adaptive_keys_without_adaptive_and_bad_values():
  with pytest.raises(ConfigError, match="count_stddev is read only with clip_norm: adaptive"):
    DpSgdConfig(**BASE, clip_norm=1.0, count_stddev=3.0)
  with pytest.raises(ConfigError, match="clip_learning_rate must be a finite number > 0"):
    DpSgdConfig(**BASE, clip_norm="adaptive", clip_learning_rate=0.0)
  with pytest.raises(ConfigError, match="clip_norm must be"):
    DpSgdConfig(**BASE, clip_norm="adaptiv")


def test_plan_refusals_name_the_key_and_why(problem):
  with pytest.raises(ValueError, match="count_stddev=0.4 is too small"):
    _plan(problem, clip_norm="adaptive", count_stddev=0.4)
  with pytest.raises(ValueError, match="refused for dp_sgd_group"):
    _plan(problem, "dp_sgd_group", clip_norm="adaptive")
  with pytest.raises(ValueError, match="refused with noise_mechanism='banded'.* fixed clip"):
    _plan(problem, clip_norm="adaptive", sampling="cyclic", noise_mechanism="banded",
          relation="zero_out", n_users=None)


def test_cli_refuses_a_bad_target_quantile_in_one_line(tmp_path, dpsco):
  cfg = tmp_path / "run.yaml"
  cfg.write_text("algorithm: dp_sgd_user\nproblem: least_squares\nn_users: 50\nm: 2\nd: 2\n"
                 "noise_multiplier: 1.0\ndelta: 1.0e-5\nclip_norm: adaptive\n"
                 "target_quantile: 1.5\nnum_steps: 2\n")
  out = dpsco("run", str(cfg), "--quiet")
  assert out.returncode == 2, out.stderr
  err = out.stderr.strip().splitlines()
  assert len(err) == 1 and "target_quantile must lie in the open interval (0, 1)" in err[0]


def test_fit_adaptive_same_epsilon_as_fixed_and_converges(problem):
  fixed = _plan(problem, clip_norm=1.0)
  adaptive = _plan(problem, clip_norm="adaptive", initial_clip_norm=1.0, learning_rate=0.5)
  assert adaptive.privacy.epsilon == fixed.privacy.epsilon   # the same Gaussian event at z
  notes = adaptive.privacy.notes
  assert "adaptive clipping" in notes and "gamma=0.5" in notes and "z_Delta=1.155" in notes
  assert "sigma_b=1," in notes                     # default max(D / 20, z) at D = 20
  result = api.execute(adaptive, problem, jax.random.key(1))
  assert result.privacy.epsilon == fixed.privacy.epsilon
  assert result.record["clip_norm"] == "adaptive"
  start = problem.excess_risk(problem.init_params())
  assert problem.excess_risk(result.params) < 0.1 * start, (start,
                                                           problem.excess_risk(result.params))


def test_item_level_and_audit_hook_run_adaptive(problem):
  p = _plan(problem, "dp_sgd_item", clip_norm="adaptive", n_users=200, batch_size=40,
            num_steps=5)
  assert "item-level DP-SGD" in p.privacy.mechanisms[0] and "adaptive clipping" in p.privacy.notes
  assert np.all(np.isfinite(api.execute(p, problem, jax.random.key(3)).params))
  cfg = {**BASE, "clip_norm": "adaptive", "num_steps": 5}
  noisy = dp_sgd_releases(problem, cfg, jax.random.key(2))
  quiet = dp_sgd_releases(problem, cfg, jax.random.key(2), noise=False)
  assert noisy.shape == quiet.shape == (5, 5) and not np.allclose(noisy, quiet)
  # noiseless: each step's mean is a sum of <= D users clipped at C_t, D = 20
  assert np.all(np.isfinite(quiet))


def test_paths_that_would_drop_the_adaptive_stage_refuse():
  """Host streaming and the multi-process path build the fixed-clip chain: refused, not run
  silently at C_0."""
  from dpsco_jax import UserData, fit
  rng = np.random.default_rng(0)
  data = UserData.from_arrays({"x": rng.normal(size=(60, 3)).astype(np.float32)},
                              np.repeat(np.arange(30), 2))
  loss = lambda w, ex: jnp.sum((w - ex["x"]) ** 2)
  cfg = {**BASE, "n_users": 30, "batch_size": 5, "num_steps": 2, "clip_norm": "adaptive",
         "learning_rate": 0.1, "initial_clip_norm": 1.0}
  with pytest.raises(ValueError, match="adaptive does not stream rows from the host"):
    fit("dp_sgd_user", cfg, loss, jnp.zeros(3), data, jax.random.key(0), data_placement="host")
  with pytest.raises(ValueError, match="adaptive does not run across processes"):
    fit("dp_sgd_user", cfg, loss, jnp.zeros(3), data, jax.random.key(0), distributed=True)
  ok = fit("dp_sgd_user", cfg, loss, jnp.zeros(3), data, jax.random.key(0))
  assert ok.record["clip_norm"] == "adaptive"
