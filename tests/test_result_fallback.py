"""Issue 25.3: a halted or fallback release is a field of Result and a warning; issue 25:
``nonprivate_sgd`` with a learning rate given needs no Lipschitz constant."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import FallbackRelease
from dpsco_jax.data import UserData
from dpsco_jax.privacy.ledger import PrivacyReport
from dpsco_jax.result import Result

REPORT = PrivacyReport(epsilon=1.0, delta=1e-5, provenance="accountant", level="user")


def test_record_of_a_halted_run_sets_fallback_and_warns_once():
  with pytest.warns(FallbackRelease, match="halted in phase 2"):
    r = Result(params=jnp.zeros(2), privacy=REPORT, gradient_evaluations=0,
               record={"halted_phase": 2})
  assert "phase 2" in r.fallback
  import dataclasses
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # a copy (dpsco_jax.run unflattening) does not warn again
    assert dataclasses.replace(r, params=jnp.ones(2)).fallback == r.fallback
    ok = Result(params=jnp.zeros(2), privacy=REPORT, gradient_evaluations=0,
                record={"halted_phase": None})
  assert ok.fallback is None
  with pytest.warns(FallbackRelease, match="⊥"):
    assert Result(jnp.zeros(2), REPORT, 0, {"is_bottom": True}).fallback


def _data(users=120, seed=0):
  rng = np.random.default_rng(seed)
  ids = np.repeat(np.arange(users), 4)
  x = rng.normal(size=(ids.size, 3)).astype(np.float32) / 2
  y = (rng.random(ids.size) < 0.5).astype(np.float32)
  return UserData.from_arrays({"x": x, "y": y}, ids, max_items_per_user=4)


def loss(p, ex):
  z = ex["x"] @ p
  return jax.nn.softplus(z) - ex["y"] * z


@pytest.mark.slow
def test_algorithm_3_halting_on_few_users_is_a_fallback_of_the_result():
  # 120 users: phases of ~K = 40 users, an AboveThreshold margin below its noise: it halts
  cfg = {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0, "sensitivity": "typical"}
  consts = {"lipschitz": 1.0, "smoothness": 1.0, "radius": 2.0}
  with pytest.warns(FallbackRelease, match="halted"):
    res = dpsco_jax.fit("user_level_accelerated_erm", cfg, loss, jnp.zeros(3), _data(),
                        jax.random.key(0), constants=consts)
  assert res.fallback is not None and res.record["halted_phase"] is not None


def test_nonprivate_sgd_with_a_learning_rate_needs_no_lipschitz_constant():
  res = dpsco_jax.fit("nonprivate_sgd", {"learning_rate": 0.3, "num_steps": 5}, loss,
                      jnp.zeros(3), _data(), jax.random.key(0))
  assert res.fallback is None and res.record["learning_rate"] == 0.3
  with pytest.raises(dpsco_jax.MissingConstant, match="lipschitz"):   # the default reads L
    dpsco_jax.fit("nonprivate_sgd", {"num_steps": 5}, loss, jnp.zeros(3), _data(),
                  jax.random.key(0), constants={"radius": 1.0})
