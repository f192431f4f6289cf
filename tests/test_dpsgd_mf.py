"""User-level DP-SGD with the cyclic multi-epoch schedule and MF noise (issue #27)."""

import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax.algorithms.dpsgd.config import DpSgdConfig
from dpsco_jax import problems
from dpsco_jax.api import solve
from dpsco_jax.algorithms.dpsgd import driver as D
from dpsco_jax.algorithms.dpsgd.plan import dp_sgd_plan, plan_dp_sgd
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.privacy.ledger import epsilon_of


@pytest.fixture(scope="module")
def lsq():
  return problems.make("least_squares", n_users=60, m=3, d=4, radius=2.0, noise=0.3,
                       key=jax.random.key(0))


BASE = dict(epsilon=2.0, delta=1e-5, batch_size=10, learning_rate=0.5, averaging="none",
            n_users=60, sampling="cyclic", epochs=4)


def _plan(**kw):
  return plan_dp_sgd(dict(BASE, **kw), level="user", realized_rows=60, rows_per_user=1,
                     default_clip=1.0, radius=2.0)


def test_cyclic_plan_states_the_participation_schema():
  p = _plan()
  assert (p.sampling, p.relation, p.steps, p.participations, p.min_sep) == \
      ("cyclic", "zero_out", 24, 4, 6)
  # independent noise, 4 participations: one Gaussian of multiplier z / 2
  assert isinstance(p.event, dp_accounting.GaussianDpEvent)
  assert p.event.noise_multiplier == pytest.approx(p.noise_multiplier / 2)
  assert epsilon_of(p.event, delta=1e-5, relation="zero_out") == pytest.approx(2.0, rel=1e-3)
  one = _plan(epochs=1)
  assert p.noise_multiplier / one.noise_multiplier == pytest.approx(2.0, rel=1e-4)


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_mf_plan_event_is_the_strategy_sensitivity(kind):
  p = _plan(noise_mechanism=kind, mf_strategy="sqrt", bands=6)
  coefs = np.asarray(p.mf.coefs)
  sens = mf.participation_sensitivity(coefs, p.steps, participations=4, min_sep=6)
  assert p.mf.sensitivity == pytest.approx(sens)
  if kind == "banded":   # bands <= separation: disjoint columns, sens = sqrt(k) ||c|| = 2
    assert len(coefs) == 6 and sens == pytest.approx(2.0)
  else:                  # a BLT overlaps itself: strictly more than sqrt(k) ||c||
    assert sens > 2.0 * np.linalg.norm(coefs)
  assert p.event.noise_multiplier == pytest.approx(p.noise_multiplier / sens)
  assert epsilon_of(p.event, delta=1e-5, relation="zero_out") == pytest.approx(2.0, rel=1e-3)
  # the event of a prefix of the run, for progress reports
  assert p.event_after(p.steps).noise_multiplier == pytest.approx(p.event.noise_multiplier)
  assert p.event_after(6).noise_multiplier > p.event.noise_multiplier


def test_default_bands_fit_the_separation():
  assert len(_plan(noise_mechanism="banded", mf_strategy="sqrt").mf.coefs) == 6
  assert len(_plan(noise_mechanism="banded", mf_strategy="sqrt", epochs=1).mf.coefs) == 6
  full = _plan(noise_mechanism="banded", mf_strategy="sqrt", sampling="full", num_steps=8)
  assert len(full.mf.coefs) == 1   # every step: bands past 1 only add overlap


def test_refusals():
  with pytest.raises(ValueError, match="bounded-participation"):
    _plan(noise_mechanism="banded", sampling="poisson")
  with pytest.raises(ValueError, match="bounded-participation"):
    _plan(noise_mechanism="blt", sampling="fixed")
  with pytest.raises(ValueError, match="relation"):
    _plan(relation="add_remove")
  with pytest.raises(ValueError, match="noise_mechanism"):
    _plan(noise_mechanism="trie")   # (tree is a noise now: tests/test_dpsgd_tree_noise.py)
  cfg = DpSgdConfig(epsilon=1.0, delta=1e-5, sampling="cyclic", noise_mechanism="banded",
                       bands=4, mf_strategy="sqrt")
  assert cfg.noise_mechanism == "banded"


def test_cyclic_slots_visit_every_user_once_per_epoch_in_a_fixed_order():
  n, b = 23, 5
  slots, real = D.cyclic_slots(jax.random.key(3), n, b)
  slots, real = np.asarray(slots), np.asarray(real)
  assert slots.shape == (25,) and real.sum() == n
  assert sorted(slots[real].tolist()) == list(range(n))
  again, _ = D.cyclic_slots(jax.random.key(3), n, b)
  np.testing.assert_array_equal(slots, np.asarray(again))   # same order every epoch / run


def test_bands_one_equals_independent_and_noise_off_agrees(lsq):
  key = jax.random.key(4)
  ind = solve("dp_sgd_user", dict(BASE), lsq, key)
  b1 = solve("dp_sgd_user", dict(BASE, noise_mechanism="banded", bands=1), lsq, key)
  np.testing.assert_allclose(np.asarray(b1.params), np.asarray(ind.params), atol=1e-6)
  assert b1.record["mf_sensitivity"] == pytest.approx(2.0)
  cfg = dict(BASE, noise_mechanism="banded", bands=6, mf_strategy="sqrt")
  quiet = D.dp_sgd_releases(lsq, cfg, key, noise=False)
  quiet_ind = D.dp_sgd_releases(lsq, dict(BASE), key, noise=False)
  np.testing.assert_allclose(np.asarray(quiet), np.asarray(quiet_ind), atol=1e-6)


def test_released_noise_is_c_inverse_of_iid(lsq):
  """Driver releases minus noiseless aggregates = C^{-1} Z with Z i.i.d. N(0, sigma^2):
  whitening by C gives unit variance at the plan's noise_std."""
  cfg = dict(BASE, noise_mechanism="banded", bands=6, mf_strategy="sqrt", epochs=8)
  plan = dp_sgd_plan(lsq, cfg)
  C = mf.toeplitz_matrix(np.asarray(plan.mf.coefs), plan.steps)
  zs = []
  for s in range(20):
    key = jax.random.key(100 + s)
    w = np.asarray(D.dp_sgd_releases(lsq, cfg, key)) - np.asarray(
        D.dp_sgd_releases(lsq, cfg, key, noise=False))
    zs.append(C @ w.reshape(plan.steps, -1))
  z = np.concatenate(zs).ravel() / plan.noise_std
  assert abs(np.std(z) - 1.0) < 0.05 and abs(np.mean(z)) < 0.05


def test_driver_runs_each_noise_and_reports(lsq):
  for kind in ("independent", "banded", "blt"):
    res = solve("dp_sgd_user", dict(BASE, noise_mechanism=kind, mf_strategy="sqrt"), lsq,
                jax.random.key(1))
    assert np.all(np.isfinite(np.asarray(res.params)))
    assert res.privacy.epsilon == pytest.approx(2.0, rel=1e-3)
    assert res.record["noise_mechanism"] == kind and res.record["participations"] == 4
    if kind != "independent":
      assert "MF noise" in res.privacy.notes and math.isfinite(res.record["mf_sensitivity"])
