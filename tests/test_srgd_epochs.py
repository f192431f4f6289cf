"""Multi-epoch SRGD (issue #27 leftover): ``epochs: k`` over one fixed public order.

The exact stream sensitivity of ``k`` participations ``P`` apart is checked against a brute
force over the materialized strategy matrix ``C`` (tree encoder, banded, BLT, identity), and
a twin accounted as one participation is caught; the run is checked to use exactly the
accounted pattern (a zeroed example changes increments ``p, p+P, ...`` and nothing else).
"""

import jax
import numpy as np
import pytest

from dpsco_jax import problems
from dpsco_jax.algorithms.srgd import driver as S
from dpsco_jax.algorithms.srgd.plan import plan_for_problem
from dpsco_jax.algorithms.srgd.config import SrgdConfig
from dpsco_jax.api import solve
from dpsco_jax.config.types import ConfigError
from dpsco_jax.privacy import cyclic_participation as cp
from dpsco_jax.privacy import matrix_factorization as mf
from dpsco_jax.privacy.ledger import epsilon_of
import dpsco_jax.privacy.calibrate as calibrate
from dpsco_jax.problems.ill_conditioned import ill_conditioned_least_squares
from dpsco_jax.transforms.tree_noise import tree_encode, tree_levels

CFG = dict(epsilon=1.0, delta=1e-5, mf_strategy="sqrt")


@pytest.fixture(scope="module")
def prob():
  return problems.make("least_squares", n_users=400, m=1, d=3, key=jax.random.key(7))


# ----------------------------------------------------------------------------- brute force
def _tree_matrix(T: int) -> np.ndarray:
  """The stage's own encoder (``tree_encode``) applied to unit streams: nodes x leaves."""
  cols = [tree_encode(np.eye(T)[:, [t]]) for t in range(T)]
  nodes = sorted(cols[0])
  return np.array([[cols[t][node][0] for t in range(T)] for node in nodes])


def _strategy(kind: str, T: int, P: int) -> tuple[np.ndarray, np.ndarray | None]:
  if kind == "tree":
    return _tree_matrix(T), None
  if kind == "independent":
    return np.eye(T), None
  if kind == "banded":
    coefs = mf.banded_strategy(T, min(5, T), strategy="sqrt").coefs
  else:
    b = mf.blt_strategy(T, 3, strategy="sqrt")
    coefs = mf.blt_coefs(b.buf_decay, b.output_scale, T)
  return mf.toeplitz_matrix(coefs, T), coefs


def _brute_force(C: np.ndarray, T: int, P: int, k: int) -> float:
  """max over the P public offsets of ||C 1_pattern|| (C >= 0: equal rows are the worst)."""
  best = 0.0
  for p in range(P):
    u = np.zeros(T)
    u[[p + i * P for i in range(k) if p + i * P < T]] = 1.0
    best = max(best, float(np.linalg.norm(C @ u)))
  return best


def _honest(kind, T, P, k, coefs):
  return cp.cyclic_sensitivity(kind, T, P, k, coefs=coefs)


def _broken_one_participation(kind, T, P, k, coefs):
  """The twin that accounts every example as participating once."""
  return cp.cyclic_sensitivity(kind, T, P, 1, coefs=coefs)


SHAPES = [(12, 4, 3), (16, 4, 4), (16, 8, 2), (20, 5, 4), (21, 7, 3), (48, 16, 3), (8, 8, 1)]


@pytest.mark.parametrize("kind", ["tree", "banded", "blt", "independent"])
def test_exact_sensitivity_matches_brute_force_and_catches_the_broken_twin(kind):
  for T, P, k in SHAPES:
    C, coefs = _strategy(kind, T, P)
    assert np.all(C >= 0)
    truth = _brute_force(C, T, P, k)
    assert _honest(kind, T, P, k, coefs) == pytest.approx(truth, rel=1e-12), (T, P, k)
    broken = _broken_one_participation(kind, T, P, k, coefs)
    if k > 1:   # the twin under-accounts whenever an example participates twice
      assert broken < truth * (1 - 1e-3), (kind, T, P, k)
    # no admissible contribution (rows of norm <= 1, any directions) exceeds the bound
    rng = np.random.default_rng(T + k)
    for _ in range(20):
      p = int(rng.integers(P))
      g = rng.normal(size=(k, 4))
      g /= np.linalg.norm(g, axis=1, keepdims=True)
      cols = [p + i * P for i in range(k) if p + i * P < T]
      assert np.linalg.norm(C[:, cols] @ g[:len(cols)]) <= truth * (1 + 1e-12)


def test_single_participation_is_lemma_5_6_levels():
  for T in (2, 7, 16, 100):
    assert cp.tree_cyclic_sensitivity(T, T, 1) ** 2 == pytest.approx(tree_levels(T))


@pytest.mark.parametrize("kind", ["tree", "banded", "blt", "independent"])
def test_plan_sensitivity_is_the_brute_force_of_its_own_strategy(prob, kind):
  plan = plan_for_problem("accelerated_dp_srgd", prob,
                            dict(CFG, noise_mechanism=kind, epochs=3, bands=5))
  T, P = plan.params.num_steps, plan.params.period
  assert (T, P, plan.epochs) == (60, 20, 3)
  if kind == "tree":
    C = _tree_matrix(T)
  elif kind == "independent":
    C = np.eye(T)
  elif kind == "banded":
    C = mf.toeplitz_matrix(np.asarray(plan.mf[1]), T)
  else:
    C = mf.toeplitz_matrix(mf.blt_coefs(np.asarray(plan.mf[1]), np.asarray(plan.mf[2]), T), T)
  assert plan.stream_sensitivity == pytest.approx(_brute_force(C, T, P, 3), rel=1e-12)
  assert plan.gdp_factor == plan.stream_sensitivity
  assert plan.event.noise_multiplier == pytest.approx(
      plan.params.noise_multiplier / plan.stream_sensitivity)
  assert epsilon_of(plan.event, delta=1e-5, relation="zero_out") == pytest.approx(1.0, rel=1e-3)


def test_the_run_uses_exactly_the_accounted_pattern(prob):
  """Noiseless releases at fixed query points, with and without example u: the increments
  differ at steps p, p+P, p+2P (p = u's batch) and nowhere else."""
  plan = plan_for_problem("accelerated_dp_srgd", prob, dict(CFG, epochs=3))
  T, P, B = plan.params.num_steps, plan.params.period, plan.params.batch_size
  key, x0 = jax.random.key(4), prob.init_params()
  pts = S.srgd_releases(plan, prob.loss_fn, prob.data, x0, key)["query"]
  u = 7 * B + 3
  mask = np.ones(prob.n_users, bool)
  mask[u] = False
  a = S.srgd_releases(plan, prob.loss_fn, prob.data, x0, key, points=pts, add_noise=False)
  b = S.srgd_releases(plan, prob.loss_fn, prob.data, x0, key, points=pts, add_noise=False,
                      user_mask=mask)
  inc = np.diff(np.asarray(a["release"]) - np.asarray(b["release"]), axis=0, prepend=0.0)
  # float32 prefix sums of norm ~10 round at ~1e-6; the example's own increments are >~1e-3
  changed = np.nonzero(np.linalg.norm(inc, axis=1) > 1e-5)[0]
  assert changed.tolist() == [7, 7 + P, 7 + 2 * P]
  assert np.all(np.linalg.norm(inc, axis=1) <= plan.params.clip_norm / B * (1 + 1e-5))


# ----------------------------------------------------------------------------- epochs = 1
def test_epochs_one_is_todays_plan_and_params(prob):
  """The plan and released params of epochs=1 are those without the key, and those recorded
  before multi-epoch existed (commit 6f04ded; same machine class, float32 CPU)."""
  for extra, golden in [
      ({}, [-0.9007797837257385, 0.29773807525634766, -0.6279428005218506]),
      (dict(noise_mechanism="blt"), [-0.45516613125801086, 0.37467920780181885,
                                     -0.7927999496459961])]:
    cfg = dict(CFG, **extra)
    plan0 = plan_for_problem("accelerated_dp_srgd", prob, cfg)
    plan1 = plan_for_problem("accelerated_dp_srgd", prob, dict(cfg, epochs=1))
    assert plan0 == plan1 and plan1.stream_sensitivity is None and plan1.epochs == 1
    r0 = solve("accelerated_dp_srgd", cfg, prob, jax.random.key(3))
    r1 = solve("accelerated_dp_srgd", dict(cfg, epochs=1), prob, jax.random.key(3))
    assert np.array_equal(np.asarray(r0.params), np.asarray(r1.params))
    np.testing.assert_allclose(np.asarray(r1.params), golden, rtol=1e-5, atol=1e-6)
    assert r1.record == r0.record and "epochs" not in r1.record
  # recorded with the earlier calibrator (Brent, xtol 1e-7 in log z); today's stops within
  # its RTOL / EPS_RTOL of 1e-6, so the recorded multipliers hold to that
  rel = 2 * max(calibrate.RTOL, calibrate.EPS_RTOL)
  assert plan0.params.noise_multiplier == pytest.approx(5.2969455656822975, rel=rel)
  tree = plan_for_problem("accelerated_dp_srgd", prob, dict(CFG, epochs=1))
  assert tree.params.noise_multiplier == pytest.approx(8.34194595718589, rel=rel)
  assert tree.event.noise_multiplier == pytest.approx(8.34194595718589 / tree_levels(20) ** .5)


# ----------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("kind", ["tree", "blt", "independent"])
def test_more_epochs_cost_more_privacy_and_need_more_noise(prob, kind):
  base = dict(CFG, noise_mechanism=kind)
  eps = [epsilon_of(plan_for_problem(
      "accelerated_dp_srgd", prob, dict(base, epsilon=None, noise_multiplier=8.0,
                                        epochs=k)).event, delta=1e-5, relation="zero_out")
         for k in (1, 2, 4)]
  assert eps[0] < eps[1] < eps[2]
  zs = [plan_for_problem("accelerated_dp_srgd", prob, dict(base, epochs=k)
                           ).params.noise_multiplier for k in (1, 2, 4)]
  assert zs[0] < zs[1] < zs[2]


def test_replace_one_is_accounted_from_the_same_event(prob):
  zo = plan_for_problem("accelerated_dp_srgd", prob, dict(CFG, epochs=2))
  ro = plan_for_problem("accelerated_dp_srgd", prob, dict(CFG, epochs=2,
                                                             relation="replace_one"))
  assert ro.stream_sensitivity == zo.stream_sensitivity
  assert ro.params.noise_multiplier > 1.5 * zo.params.noise_multiplier
  assert epsilon_of(ro.event, delta=1e-5, relation="replace_one") == pytest.approx(1.0, 1e-3)


# ----------------------------------------------------------------------------- utility
def test_two_epochs_reach_lower_excess_risk_in_the_noiseless_limit():
  """Label-noise-free ill-conditioned least squares (w* minimizes every example's loss), z
  tiny: the second pass keeps optimizing."""
  prob = ill_conditioned_least_squares(dict(n_users=900, d=4, noise=0.0, condition=100.0),
                                       jax.random.key(11))
  risks = {}
  for k in (1, 2):
    cfg = dict(delta=1e-5, noise_multiplier=1e-6, epochs=k, clip_norm=100.0, beta_scale=0.1)
    res = solve("accelerated_dp_srgd", cfg, prob, jax.random.key(2))
    risks[k] = prob.excess_risk(res.params)
    assert res.privacy.epsilon > 1e3   # the noiseless limit, said as such
  assert risks[2] < 0.5 * risks[1], risks


# ----------------------------------------------------------------------------- refusals
def test_refusals(prob):
  for bad in (0, -1, 1.5):
    with pytest.raises(ValueError, match="epochs"):
      plan_for_problem("accelerated_dp_srgd", prob, dict(CFG, epochs=bad))
  for bad in (True, "2"):
    with pytest.raises((TypeError, ValueError), match="epochs"):
      plan_for_problem("accelerated_dp_srgd", prob, dict(CFG, epochs=bad))
    with pytest.raises(ConfigError, match="epochs"):
      SrgdConfig(delta=1e-5, epochs=bad)
  with pytest.raises(ValueError, match="epochs=2 is outside its theorem"):
    S.plan_srgd("accelerated_dp_srgd", dict(CFG, preset="theory", epochs=2), n=10 ** 6, p=2,
                lipschitz=1.0, smoothness=1.0, radius=1.0)
  for name in ("accelerated_dp_sgd", "single_epoch_dp_sgd"):
    with pytest.raises(ValueError, match="epochs=2"):
      plan_for_problem(name, prob, dict(CFG, epochs=2))
  with pytest.raises(ValueError, match="add_remove"):
    plan_for_problem("accelerated_dp_srgd", prob, dict(CFG, epochs=2,
                                                        relation="add_remove"))
