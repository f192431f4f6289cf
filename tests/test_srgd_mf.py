"""Paper 003's SRGD with matrix-factorization prefix noise (issue #27; single epoch)."""

import dp_accounting
import jax
import numpy as np
import pytest

from dpsco_jax import problems
from dpsco_jax.algorithms.srgd import driver as S
from dpsco_jax.algorithms.srgd.plan import plan_for_problem
from dpsco_jax.api import solve
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.privacy.ledger import epsilon_of


@pytest.fixture(scope="module")
def prob():
  return problems.make("least_squares", n_users=400, m=1, d=3, key=jax.random.key(7))


CFG = dict(epsilon=1.0, delta=1e-5, mf_strategy="sqrt")


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_plan_event_is_one_gaussian_of_z_over_norm_c(prob, kind):
  plan = plan_for_problem("accelerated_dp_srgd", prob, dict(CFG, noise_mechanism=kind))
  T = plan.params.num_steps
  assert plan.mf[0] == kind and plan.levels == 1
  coefs = (np.asarray(plan.mf[1]) if kind == "banded"
           else mf.blt_coefs(np.asarray(plan.mf[1]), np.asarray(plan.mf[2]), T))
  assert plan.mf_sensitivity == pytest.approx(np.linalg.norm(coefs[:T]))
  assert isinstance(plan.event, dp_accounting.GaussianDpEvent)
  assert plan.event.noise_multiplier == pytest.approx(
      plan.params.noise_multiplier / plan.mf_sensitivity)
  assert epsilon_of(plan.event, delta=1e-5, relation="zero_out") == pytest.approx(1.0, rel=1e-3)


def test_refusals(prob):
  with pytest.raises(ValueError, match="tree"):
    plan_for_problem("accelerated_dp_srgd", prob,
                       dict(CFG, noise_mechanism="banded", preset="theory"))
  with pytest.raises(ValueError, match="independent"):
    plan_for_problem("accelerated_dp_sgd", prob, dict(CFG, noise_mechanism="banded"))


def test_released_prefix_noise_is_a_c_inverse_z(prob):
  """Releases minus noiseless releases = A C^{-1} Z; C A^{-1} of it is i.i.d. at noise_std."""
  plan = plan_for_problem("accelerated_dp_srgd", prob,
                            dict(CFG, noise_mechanism="banded", bands=5))
  T = plan.params.num_steps
  C = mf.toeplitz_matrix(np.asarray(plan.mf[1]), T)
  Ainv = np.eye(T) - np.eye(T, k=-1)
  zs = []
  for s in range(30):
    key = jax.random.key(50 + s)
    # replay at fixed query points, so the two runs see the same increments
    pts = S.srgd_releases(plan, prob.loss_fn, prob.data, prob.init_params(), key)["query"]
    a = S.srgd_releases(plan, prob.loss_fn, prob.data, prob.init_params(), key, points=pts)
    b = S.srgd_releases(plan, prob.loss_fn, prob.data, prob.init_params(), key, points=pts,
                        add_noise=False)
    noise = np.asarray(a["release"]) - np.asarray(b["release"])
    zs.append(C @ Ainv @ noise.reshape(T, -1))
  z = np.concatenate(zs).ravel() / plan.noise_std
  assert abs(np.std(z) - 1.0) < 0.06 and abs(np.mean(z)) < 0.06


def test_driver_runs_and_reports(prob):
  for kind in ("banded", "blt"):
    res = solve("accelerated_dp_srgd", dict(CFG, noise_mechanism=kind), prob, jax.random.key(1))
    assert np.all(np.isfinite(np.asarray(res.params)))
    assert res.privacy.epsilon == pytest.approx(1.0, rel=1e-3)
    assert res.record["noise"] == kind and "mf_strategy" in res.record
    assert "MF" in res.privacy.mechanisms[0]
