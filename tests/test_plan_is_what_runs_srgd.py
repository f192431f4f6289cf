"""Paper 003 (SRGD family): a run executes its plan and plans nothing (issue 47.1).

Each of the five registered runners is handed a plan made beforehand; with every planning,
calibrating, charging and config-reading function of the family made to raise, the run still
succeeds and reports exactly the plan's guarantee and noise (before issue 47.1 the driver
planned, calibrated and charged all over again from ``plan.config``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import api, problems
from dpsco_jax.algorithms.srgd import driver, plan as srgd_plan
from dpsco_jax.algorithms.srgd.config import SrgdConfig
from dpsco_jax.data import UserData
from plan_guard import forbid_planning

NAMES = ("accelerated_dp_srgd", "dp_srgd_unaccelerated", "accelerated_dp_srgd_independent_noise",
         "accelerated_dp_sgd", "single_epoch_dp_sgd")
CFG = {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0, "beta": 4.0}
# every function of the family that plans, calibrates, charges or reads a config
PLANNING = ("plan_srgd", "plan_for_problem", "config_view", "resolve_relation", "_schedule",
            "_noise_multiplier", "_calibrate", "calibrate_noise_multiplier", "charge",
            "PrivacyLedger",
            "scan_settings")   # the scan's settings are checked when planning only


def _forbid_planning(monkeypatch) -> None:
  forbid_planning(monkeypatch, (srgd_plan, driver, srgd_plan.SRGDPlan), PLANNING, schemas=(SrgdConfig,))


@pytest.mark.parametrize("name", NAMES)
def test_a_builtin_run_executes_its_plan_and_plans_nothing(monkeypatch, name):
  prob = problems.make("least_squares", n_users=16, m=1, d=2, key=jax.random.key(0))
  p = api.plan_problem(name, dict(CFG, debug=True), prob)
  _forbid_planning(monkeypatch)
  res = api.execute(p, prob, jax.random.key(1))
  assert res.privacy == p.privacy and res.privacy.epsilon <= 1.0 + 1e-9
  assert res.record["noise_multiplier"] == p.noise_multiplier == p.detail.params.noise_multiplier
  assert res.record["num_steps"] == p.schedule["num_steps"]
  assert res.debug is not None and "clipped_fraction" in res.debug   # plan.config's debug
  assert np.all(np.isfinite(np.asarray(res.params)))


def test_a_user_data_run_and_a_seed_batch_plan_nothing(monkeypatch):
  rng = np.random.default_rng(0)
  data = [UserData.from_arrays({"x": rng.normal(size=(16, 2)).astype(np.float32)},
                               np.arange(16), max_items_per_user=1) for _ in range(2)]
  loss = lambda w, ex: 0.5 * jnp.sum((w - ex["x"]) ** 2)   # noqa: E731
  p = dpsco_jax.plan("accelerated_dp_srgd", CFG, data[0].spec, num_params=2,
                     constants={"lipschitz": 1.0, "smoothness": 1.0})
  _forbid_planning(monkeypatch)
  one = dpsco_jax.run(p, loss, jnp.zeros(2), data[0], jax.random.key(2))
  batch = api.run_seeds(p, loss, jnp.zeros(2), data, [jax.random.key(2), jax.random.key(3)])
  assert one.privacy == p.privacy and [r.privacy for r in batch] == [p.privacy] * 2
  assert [r.record["batched"] for r in batch] == [True, True]
  np.testing.assert_allclose(np.asarray(batch[0].params), np.asarray(one.params), rtol=1e-5,
                             atol=1e-6)
