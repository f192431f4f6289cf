"""Gaussian noise stage: KS calibration (accept sigma, reject 0.5x / 1.5x), freshness, keys."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from dpsco_jax import add_gaussian_noise

SIGMA = 0.7


@pytest.fixture(scope="module")
def samples():
  tx = add_gaussian_noise(SIGMA, jax.random.key(3))
  zeros = {"a": jnp.zeros((50, 20)), "b": jnp.zeros((1000,))}

  @jax.jit
  def run(state):
    def body(state, _):
      noisy, state = tx.update(zeros, state)
      return state, jnp.concatenate([noisy["a"].ravel(), noisy["b"]])
    return jax.lax.scan(body, state, None, length=10)

  _, draws = run(tx.init(zeros))
  return np.asarray(draws, dtype=np.float64)  # numpy float64: scipy must not see jax arrays


@pytest.mark.statistical
def test_ks_accepts_configured_std_and_rejects_wrong_ones(samples):
  # a frozen cdf, not "norm" + args: scipy 1.18 passes args straight to ndtr and crashes
  flat = samples.ravel()
  assert stats.kstest(flat, stats.norm(0.0, SIGMA).cdf).pvalue > 1e-3
  for wrong in (0.5, 1.5):
    assert stats.kstest(flat, stats.norm(0.0, wrong * SIGMA).cdf).pvalue < 1e-6
  # leaves are independent of each other
  assert abs(np.corrcoef(samples[:, :1000].ravel(), samples[:, 1000:2000].ravel())[0, 1]) < 0.02


def test_new_step_new_noise_same_key_same_noise(samples):
  for i in range(len(samples) - 1):
    assert not np.allclose(samples[i], samples[i + 1])
  tx = add_gaussian_noise(SIGMA, jax.random.key(3))
  zeros = {"a": jnp.zeros((50, 20)), "b": jnp.zeros((1000,))}
  first, _ = tx.update(zeros, tx.init(zeros))
  # same key, same stream (eager vs jit may differ in the last ulp)
  np.testing.assert_allclose(np.concatenate([first["a"].ravel(), first["b"]]), samples[0],
                             rtol=1e-5, atol=1e-6)
  other, _ = add_gaussian_noise(SIGMA, jax.random.key(4)).update(zeros, tx.init(zeros)._replace(
      key=jax.random.key(4)))
  assert not np.allclose(other["b"], first["b"])


def test_noise_is_added_not_replacing_and_validation():
  tx = add_gaussian_noise(0.0, 0)
  u = {"w": jnp.arange(4.0)}
  out, state = tx.update(u, tx.init(u))
  np.testing.assert_array_equal(out["w"], u["w"])
  assert int(state.count) == 1
  with pytest.raises(ValueError, match="stddev"):
    add_gaussian_noise(-1.0, 0)
  chained = optax.chain(add_gaussian_noise(1.0, 0))
  out, _ = chained.update(u, chained.init(u), u, user_mask=jnp.ones(3, bool))
  assert out["w"].shape == (4,)
