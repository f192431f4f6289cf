"""Findings of an outside review of the Python API, the transforms and the privacy primitives:
each test failed before its fix."""

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax as dp
from dpsco_jax import privacy


def _loss(p, ex):
  z = ex["x"] @ p["w"] + p["b"]
  return jax.nn.softplus(z) - ex["y"] * z


PARAMS = {"w": jnp.zeros(4), "b": jnp.zeros(())}
CONFIG = {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.1,
          "num_steps": 5, "sampling_rate": 0.5, "n_users": 6}


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(12, 4)).astype(np.float32)
  return dp.UserData.from_arrays({"x": x, "y": (x.sum(1) > 0).astype(np.float32)},
                                 np.repeat(np.arange(6), 2), max_items_per_user=2)


@pytest.mark.parametrize("key", [0, None, "seed", np.uint32(3)])
def test_run_refuses_a_key_that_is_not_a_prng_key_naming_it(key):
  # an int seed (what the transforms accept) reached the driver and failed in JAX's fold_in
  # ("invalid PRNG key data"), naming neither the parameter nor the fix
  data = _data()
  with pytest.raises(TypeError, match=r"key must be a jax PRNG key"):
    dp.fit("dp_sgd_user", CONFIG, _loss, PARAMS, data, key)
  p = dp.plan("dp_sgd_user", CONFIG, data.spec, num_params=5)
  with pytest.raises(TypeError, match=r"keys\[1\] must be a jax PRNG key"):
    dp.run_seeds(p, _loss, PARAMS, [data, data], [jax.random.key(0), 1])


@pytest.mark.parametrize("epsilon", [5.0, 10.0, 20.0])
def test_classic_gaussian_sigma_is_refused_where_it_is_not_private(epsilon):
  # Dwork-Roth's sigma is stated for epsilon < 1; at epsilon = 10 it returned 0.4845, whose
  # exact epsilon at the same delta is 10.39 > 10: a noise scale too small for its claim
  with pytest.raises(ValueError, match="epsilon"):
    privacy.gaussian_sigma_classic(1.0, epsilon, 1e-5)
  # where it is returned, it meets its claim
  sigma = privacy.gaussian_sigma_classic(1.0, 1.0, 1e-5)
  assert privacy.epsilon_of(dp_accounting.GaussianDpEvent(sigma), delta=1e-5) <= 1.0


@pytest.mark.parametrize("seed", [-1, 1.5, "0"])
def test_from_arrays_refuses_a_bad_selection_seed_naming_it(seed):
  # seed=-1 raised numpy's "expected non-negative integer" (no parameter named), and only
  # when some user had more items than the bound; dense data took any seed silently
  x = np.arange(12, dtype=np.float32).reshape(6, 2)
  for ids in (np.zeros(6, int), np.repeat(np.arange(3), 2)):
    with pytest.raises((TypeError, ValueError), match="seed"):
      dp.UserData.from_arrays({"x": x}, ids, max_items_per_user=2, seed=seed)
  data = dp.UserData.from_arrays({"x": x}, np.zeros(6, int), max_items_per_user=2, seed=2**70)
  assert data.n_items.tolist() == [2]      # a large seed stays valid


def test_more_rows_than_declared_is_refused_without_their_count():
  # The refusal said "the data has 199 rows": under add_remove the realized count is private,
  # and the runner writes the message into the failed record's error (results JSON).
  rng = np.random.default_rng(1)
  x = rng.normal(size=(199, 4)).astype(np.float32)
  data = dp.UserData.from_arrays({"x": x, "y": (x.sum(1) > 0).astype(np.float32)},
                                 np.arange(199), max_items_per_user=1)
  p = dp.plan("dp_sgd_user", {**CONFIG, "n_users": 10}, data.spec, num_params=5,
              constants={"lipschitz": 1.0, "radius": 1.0})
  with pytest.raises(ValueError, match="more rows than the declared n_users") as err:
    dp.run(p, _loss, PARAMS, data, jax.random.key(0))
  assert "199" not in str(err.value)
