"""Shifted truncated discrete Laplace (paper 001 Def. 3.4) and DelOutputPert calculators."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpsco_jax.privacy import discrete_laplace as tdl


@pytest.mark.parametrize("eps,delta", [(1.0, 1e-3), (0.5, 1e-6), (0.25, 0.2)])
def test_pmf_support_normalization_ratios_tails(eps, delta):
  k = tdl.kappa(eps, delta)
  p = tdl.tdlap_pmf(eps, delta)
  assert p.shape == (2 * k + 1,)
  assert np.all(p > 0)
  assert abs(p.sum() - 1.0) < 1e-12
  assert np.argmax(p) == k
  np.testing.assert_allclose(p, p[::-1], rtol=1e-12)  # symmetric about kappa
  ratios = p[1:] / p[:-1]
  # (P2) adjacent ratios within e^{+-eps}, attained exactly (the pmf is log-linear)
  assert np.all(ratios <= math.exp(eps) * (1 + 1e-12))
  assert np.all(ratios >= math.exp(-eps) * (1 - 1e-12))
  np.testing.assert_allclose(np.abs(np.log(ratios)), eps, rtol=1e-9)
  # (P1) tail masses at 0 and 2 kappa at most delta
  assert p[0] <= delta and p[-1] <= delta
  # unnormalised mass at 0 equals e^{-eps kappa} <= e^{-eps} delta (why kappa is rounded up)
  assert math.exp(-eps * k) <= math.exp(-eps) * delta * (1 + 1e-12)


def test_kappa_rounding_and_validation():
  # 1 + ln(1/delta)/eps exactly an integer: ceil keeps it
  assert tdl.kappa(1.0, math.exp(-3.0)) in (4, 5)
  assert tdl.kappa(1.0, 1e-6) == math.ceil(1 + math.log(1e6))
  for bad in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="epsilon"):
      tdl.kappa(bad, 1e-3)
  for bad in (0.0, 1.0, 2.0):
    with pytest.raises(ValueError, match="delta"):
      tdl.kappa(1.0, bad)
  with pytest.raises(ValueError, match="kappa"):
    tdl.tdlap_pmf_from_kappa(1.0, 0)


def test_realized_law_is_exact_to_2_pow_64():
  for eps, delta in [(1.0, 1e-3), (0.5, 2e-7)]:
    k = tdl.kappa(eps, delta)
    p = tdl.tdlap_pmf_from_kappa(eps, k)
    q = tdl.tdlap_realized_pmf(eps, k)
    assert np.max(np.abs(p - q)) <= 2.0 ** -63
    assert q[0] <= p[0] and q[-1] <= p[-1]  # end atoms rounded inward: (P1) exact
    assert abs(q.sum() - 1.0) < 1e-15


def test_calculators_match_hand_values():
  # spec §5 table: eps=1, delta=1e-6 -> kappa 32, min users 258; delta=1e-2 -> kappa 14
  p = tdl.del_output_pert_params(1.0, 1e-6)
  dp = 1e-6 / (math.e + 2.0)
  assert p.epsilon_prime == 0.5 and abs(p.delta_prime - dp) < 1e-20
  assert p.kappa == math.ceil(1 + math.log(1 / dp) / 0.5) == 32
  assert (p.depth, p.max_r1) == (128, 64)
  assert tdl.min_users(1.0, 1e-6) == 258
  assert tdl.deletion_depth(1.0, 1e-6) == 129
  assert tdl.del_output_pert_params(1.0, 1e-2).kappa == 14
  # kappa >= 4 always with the internal split (spec §3.3(a))
  assert tdl.del_output_pert_params(50.0, 0.9).kappa >= 4
  Delta = 0.37
  want = math.sqrt(2 * math.log(2 / dp)) * 8 * 32 * Delta / 0.5
  assert abs(tdl.sigma(Delta, 1.0, 1e-6) - want) < 1e-9 * want
  assert abs(tdl.chain_distance(Delta, 1.0, 1e-6) - 8 * 32 * Delta) < 1e-12
  with pytest.raises(ValueError, match="analytic"):
    tdl.sigma(Delta, 4.0, 1e-6, "paper")
  # the analytic calibration is tighter and valid for large epsilon
  assert tdl.sigma(Delta, 1.0, 1e-6, "analytic") < tdl.sigma(Delta, 1.0, 1e-6)
  assert tdl.sigma(Delta, 4.0, 1e-6, "analytic") > 0
  with pytest.raises(ValueError, match="calibration"):
    tdl.sigma(Delta, 1.0, 1e-6, "laplace")


_DRAW = jax.jit(lambda key: tdl.tdlap_sample(key, 1.0, 1e-3, (1_000_000,)))


def _chi2_pvalue(counts, probs):
  # merge bins with small expected counts into their neighbours (chi-square validity)
  exp = probs * counts.sum()
  c_m, e_m, acc_c, acc_e = [], [], 0.0, 0.0
  for c, e in zip(counts, exp):
    acc_c += c
    acc_e += e
    if acc_e >= 20:
      c_m.append(acc_c)
      e_m.append(acc_e)
      acc_c = acc_e = 0.0
  c_m[-1] += acc_c
  e_m[-1] += acc_e
  return stats.chisquare(np.asarray(c_m, dtype=np.float64),
                         np.asarray(e_m, dtype=np.float64)).pvalue


@pytest.mark.statistical
def test_chi_square_fit_of_a_million_draws():
  draws = np.asarray(_DRAW(jax.random.key(3)))
  chex.assert_shape(draws, (1_000_000,))
  k = tdl.kappa(1.0, 1e-3)
  assert draws.min() >= 0 and draws.max() <= 2 * k
  counts = np.bincount(draws, minlength=2 * k + 1).astype(float)
  assert _chi2_pvalue(counts, tdl.tdlap_pmf(1.0, 1e-3)) > 1e-3
  # power: the same draws reject a scale off by 0.8x / 1.2x and a shifted centre
  for wrong in (tdl.tdlap_pmf_from_kappa(0.8, k), tdl.tdlap_pmf_from_kappa(1.2, k)):
    assert _chi2_pvalue(counts, wrong) < 1e-10
  assert _chi2_pvalue(counts, np.roll(tdl.tdlap_pmf(1.0, 1e-3), 1)) < 1e-10


def test_sampler_is_jittable_deterministic_and_key_sensitive():
  f = jax.jit(lambda key: tdl.tdlap_sample_from_kappa(key, 0.5, 6, (4, 3)))
  a, b = f(jax.random.key(0)), f(jax.random.key(0))
  chex.assert_shape(a, (4, 3))
  assert a.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  c = jax.vmap(lambda k: tdl.tdlap_sample_from_kappa(k, 0.5, 6))(
      jax.random.split(jax.random.key(1), 256))
  assert len(np.unique(np.asarray(c))) > 3
  assert np.all((np.asarray(c) >= 0) & (np.asarray(c) <= 12))


def test_rare_tail_atoms_are_not_rounded_up():
  # a float32 inverse CDF would give atom 0 mass >= 2^-24 > delta; the fixed-point sampler
  # never draws it in 2^20 tries when its mass is ~1e-10
  k = tdl.kappa(1.0, 1e-10)
  draws = np.asarray(jax.jit(lambda key: tdl.tdlap_sample_from_kappa(
      key, 1.0, k, (1 << 20,)))(jax.random.key(7)))
  assert draws.min() > 0 and draws.max() < 2 * k
