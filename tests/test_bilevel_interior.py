"""Issue 28 (study 004): the ``noisy_inputs`` ridge-tuning family keeps its optimal penalty
interior as n grows, and its declared constants hold on sampled data.

Why these checks: the well-specified synthetic family's optimum runs into the box's lower edge
(``omega* ~ sigma^2 d / n``), which made the study's large-n private gaps meaningless; and the
bilevel driver derives its clips, strong-convexity steps and radii from the problem's declared
constants, so a constant that the data violates silently changes what the runs solve.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from dpsco_jax.config.schema import ConfigError, validate
from dpsco_jax.problems.ridge_tuning import ridge_tuning
from dpsco_jax.problems.bilevel_noisy_inputs import (noisy_inputs_constants,
                                                     noisy_inputs_ridge_problem)

TAU = math.sqrt(0.5)
BOX = (1e-3, 5.0)


def _interior(omega, lo, hi, margin=0.05):
  """Not within ``margin`` (5%) of the box's width of either edge."""
  return lo + margin * (hi - lo) < omega < hi - margin * (hi - lo)


def _problem(n, seed, d=10):
  cfg = {"dataset": "noisy_inputs", "d": d, "n_train": n, "n_val": n, "label_noise": 1.0,
         "input_noise": TAU}
  return ridge_tuning(cfg, jax.random.fold_in(jax.random.key(seed), 0))


@pytest.mark.parametrize("n", [1000, 20000])
def test_optimal_penalty_is_interior_and_near_tau_squared(n):
  for seed in (0, 1, 2):
    p = _problem(n, seed)
    om = p.meta["omega_star"]
    assert p.meta["omega_star_interior"] and _interior(om, *BOX), (n, seed, om)
    # the population optimum is tau^2 at every n; the empirical one concentrates around it
    assert abs(om - TAU ** 2) < (0.25 if n == 1000 else 0.06), (n, seed, om)
    # its closed-form gap is zero at omega* and positive at the box midpoint (the default)
    assert p.excess_risk(p.x_opt) == pytest.approx(0.0, abs=1e-9)
    assert p.excess_risk(np.array([sum(BOX) / 2])) > 0.05


def test_the_interior_check_fails_on_the_well_specified_family_at_large_n():
  """The same assertion on the Gaussian synthetic family (optimum ~ 90 / n_train here) fails at
  n = 2e4: the check can tell the two families apart."""
  p = ridge_tuning({"dataset": "synthetic", "d": 10, "n_train": 20000, "n_val": 20000,
                    "label_noise": 3.0}, jax.random.fold_in(jax.random.key(0), 0))
  assert not _interior(p.meta["omega_star"], *BOX)


def _worst_case_grad_norms(a, b, weight, radius):
  """``max_{||theta|| <= R} ||weight (a.theta - b) a||`` per example, exactly: the residual's
  largest magnitude on the ball is ``||a|| R + |b|``."""
  na = np.linalg.norm(a, axis=1)
  return weight * na * (na * radius + np.abs(b))


@pytest.mark.parametrize("n,d", [(200, 5), (2000, 10)])
def test_declared_constants_hold_on_sampled_data(n, d):
  for seed in (0, 1, 2, 3):
    p = noisy_inputs_ridge_problem(jax.random.key(seed), d=d, n_train=n, n_val=n,
                                   label_noise=1.0, input_noise=TAU, omega_bounds=BOX)
    c = p.consts
    data = {k: np.asarray(v, np.float64) for k, v in p.data.items()}
    tr, val = data["val"] == 0, data["val"] == 1
    a_tr, b_tr, a_val, b_val = data["a"][tr], data["b"][tr], data["a"][val], data["b"][val]
    # curvature: mu_g <= omega_min + lambda_min(H_tr); smoothness bounds the largest eigenvalues
    h_tr = np.linalg.eigvalsh(a_tr.T @ a_tr / n)
    h_val = np.linalg.eigvalsh(a_val.T @ a_val / n)
    assert c.mu_g <= BOX[0] + h_tr[0], (seed, c.mu_g, h_tr[0])
    assert h_tr[-1] + BOX[1] <= c.l1g and h_val[-1] <= c.l1f, (seed, h_tr[-1], h_val[-1])
    # Y: every lower-level solution theta*(omega), omega in X, lies in the declared ball
    theta = p.meta["_closed_form"][0]
    norms = [np.linalg.norm(theta(om)) for om in np.geomspace(*BOX, 50)]
    assert max(norms) <= p.y_radius, (seed, max(norms), p.y_radius)
    # Lipschitz on Y: the exact worst case over the ball, per example (weights n/n_tr, n/n_val)
    assert _worst_case_grad_norms(a_tr, b_tr, 2.0, p.y_radius).max() <= c.l0g
    assert _worst_case_grad_norms(a_val, b_val, 2.0, p.y_radius).max() <= c.l0f
    # ... and the per-example gradients the driver clips, at theta*(omega), agree with it
    grads = jax.vmap(jax.grad(p.g_ex, argnums=1), in_axes=(None, None, 0))(
        p.x0, theta(0.5).astype(np.float32), p.data)
    assert float(np.max(np.linalg.norm(np.asarray(grads), axis=1))) <= c.l0g


def test_declared_constants_are_data_free_and_the_default_clips():
  from dpsco_jax.algorithms.bilevel.plan import bilevel_config
  p0, p1 = (noisy_inputs_ridge_problem(jax.random.key(s), d=5, n_train=200, n_val=200)
            for s in (0, 1))
  assert p0.consts == p1.consts and p0.y_radius == p1.y_radius   # read from no data value
  c = noisy_inputs_constants(d=5, n_train=200, n_val=200, label_noise=1.0, input_noise=TAU)
  assert (p0.consts.l0g, p0.consts.l0f) == (c["l0g"], c["l0f"])
  bcfg, _ = bilevel_config(p0, {"epsilon": 1.0, "delta": 1e-6, "lam": 3.0})
  assert bcfg.inner_y.clip_norm == c["l0g"]                        # clip = declared bound
  assert bcfg.inner_lam.clip_norm == pytest.approx(c["l0f"] / 3.0 + c["l0g"])


def test_config_keys_are_validated():
  base = {"algorithm": "dp_bilevel", "problem": "ridge_tuning", "epsilon": 1.0,
          "delta": 1e-6}
  validate(dict(base, dataset="noisy_inputs", input_noise=0.5))
  with pytest.raises(ConfigError, match="input_noise"):
    validate(dict(base, dataset="noisy_inputs", input_noise="0.5"))
  with pytest.raises(ConfigError, match="dataset"):
    validate(dict(base, dataset="noisy"))
  with pytest.raises(ValueError, match="input_noise is read only by"):
    ridge_tuning({"dataset": "synthetic", "input_noise": 0.5, "n_train": 50, "n_val": 50},
                 jax.random.key(0))
  with pytest.raises(ValueError, match=r"n_train, n_val >= 4 d = 40"):
    ridge_tuning({"dataset": "noisy_inputs", "d": 10, "n_train": 30, "n_val": 400},
                 jax.random.key(0))
  with pytest.raises(ValueError, match="input_noise"):
    noisy_inputs_ridge_problem(jax.random.key(0), d=5, n_train=200, n_val=200,
                               input_noise=-1.0)
