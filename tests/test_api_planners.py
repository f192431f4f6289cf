"""dpsco_jax.plan for papers 001 (output perturbation), 002 (ReSQue private SCO) and 004
(DP-Loc-(S)GD): the plan from a DataSpec alone is the run's guarantee, an over-budget plan is
refused before any data, and missing constants are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import api
from dpsco_jax.data import DataSpec, MissingConstant, UserData
from dpsco_jax.planners import PLANNED
from dpsco_jax.privacy import PrivacyBudgetExceeded

L2 = 0.5   # ridge weight: the loss below is L2-strongly convex in (w, b)
# |x| <= 1: gradient norm <= sqrt(2) + L2 R on the ball of radius R = 2; smoothness <= 1/2 + L2
CONSTANTS = {"lipschitz": 2.5, "smoothness": 1.0, "radius": 2.0, "strong_convexity": L2}
PARAMS = {"w": jnp.zeros(4), "b": jnp.zeros(())}


def loss(p, ex):
  z = ex["x"] @ p["w"] + p["b"]
  return (jax.nn.softplus(z) - ex["y"] * z
          + 0.5 * L2 * (jnp.sum(p["w"] ** 2) + p["b"] ** 2))


def _users(n_users: int, m: int, seed: int = 0, even: bool = False) -> UserData:
  """``n_users * m`` rows, every user has one, the rest drawn at random (uneven users, cut at
  ``m``); ``even``: exactly ``m`` each (item-level guarantees refuse items dropped by a cut)."""
  rng = np.random.default_rng(seed)
  rows = n_users * m
  ids = (np.repeat(np.arange(n_users), m) if even else
         np.concatenate([np.arange(n_users), rng.integers(0, n_users, rows - n_users)]))
  x = rng.normal(size=(rows, 4)).astype(np.float32)
  x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
  y = (rng.random(rows) < 1 / (1 + np.exp(-3 * x @ np.linspace(-1, 1, 4)))).astype(np.float32)
  return UserData.from_arrays({"x": x, "y": y}, ids, max_items_per_user=m)


# exact stability test with an explicit Delta: every call can fall back to Alg. 1 (theorem)
EXACT = {"epsilon": 1.0, "delta": 1e-3, "stability_test": "exact", "Delta": 0.05,
         "max_exact_users": 4}
# Phased-SCO needs n >= 2 N0 = 68 users: certificate only (heuristic provenance)
CERT = {"delta": 0.05, "on_certificate_failure": "raise"}
LOC = {"epsilon": 2.0, "delta": 1e-5, "num_steps": 50, "rounds": 2}
CASES = {  # name: (n_users, m, config)
    "sc_output_pert": (4, 2, EXACT),
    "phased_erm_output_pert": (4, 2, EXACT),
    "sc_erm_output_pert": (4, 2, EXACT),
    "phased_sco_output_pert": (80, 4, {**CERT, "epsilon": 8.0}),
    "sc_sco_output_pert": (80, 4, {**CERT, "epsilon": 16.0, "delta": 0.1}),
    "naive_output_pert": (6, 3, {"epsilon": 1.0, "delta": 1e-3}),
    "resque_private_sco": (128, 2, {"epsilon": 2.0, "delta": 1e-5, "constants": "c_priv",
                                    "rho": 0.05, "rho_over_r": 2.0, "max_iter": 1,
                                    "max_bisection": 1, "phases": 1, "T_frac": 1 / 64}),
    "dp_loc_gd": (40, 3, LOC),
    "dp_loc_sgd": (40, 3, {**LOC, "batch_size": 20}),
}
BLOCKS = ("sc_output_pert", "phased_erm_output_pert", "sc_erm_output_pert",
          "phased_sco_output_pert", "sc_sco_output_pert")   # (eps, delta) blocks: exactly eps
SLOW = ("phased_erm_output_pert", "sc_erm_output_pert", "resque_private_sco")


def _plan(name, cfg=None, constants=CONSTANTS):
  n, m, base = CASES[name]
  return api.plan(name, base if cfg is None else cfg, DataSpec(n, m), num_params=5,
                  constants=constants)


def test_every_algorithm_of_papers_001_002_004_has_a_planner():
  assert set(CASES) <= set(PLANNED)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_plan_from_the_spec_is_the_guarantee_of_the_run(name):
  n, m, cfg = CASES[name]
  p = _plan(name)                                   # no data: sizes and constants only
  assert p.privacy.epsilon <= cfg["epsilon"] * (1 + 1e-6)
  if name in BLOCKS:
    assert p.privacy.epsilon == pytest.approx(cfg["epsilon"], rel=1e-12)
  data = _users(n, m, even=name in api.ITEM_GUARANTEE)
  res = api.run(p, loss, PARAMS, data, jax.random.key(0))
  got, want = res.privacy, p.privacy
  assert (got.epsilon, got.delta, got.relation, got.provenance, got.level) == (
      want.epsilon, want.delta, want.relation, want.provenance, want.level)
  assert got.relation == "replace_one"
  assert got.level == ("item" if name in api.ITEM_LEVEL else "user")
  # a user's loss: naive output perturbation rests on the declared L, mu, beta (issue 23.3)
  assert got.provenance == ("theorem" if cfg is EXACT else "declared"
                            if name == "naive_output_pert" else "accountant"
                            if name in ("dp_loc_gd", "dp_loc_sgd") else "heuristic")
  if "noise_multiplier" in res.record:
    assert res.record["noise_multiplier"] == p.noise_multiplier
  assert jax.tree.structure(res.params) == jax.tree.structure(PARAMS)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(res.params))


@pytest.mark.parametrize("name, extra", [
    ("sc_output_pert", {"epsilon_budget": 0.5}),         # blocks: the ledger's smaller budget
    ("phased_erm_output_pert", {"epsilon_budget": 0.5}),
    ("sc_erm_output_pert", {"epsilon_budget": 0.5}),
    ("phased_sco_output_pert", {"epsilon_budget": 4.0}),
    ("sc_sco_output_pert", {"epsilon_budget": 8.0}),
    ("naive_output_pert", {"noise_multiplier": 0.5}),   # an explicit z too small for epsilon
    ("dp_loc_gd", {"noise_multiplier": 0.5}),
    ("dp_loc_sgd", {"noise_multiplier": 0.3}),
])
def test_plan_over_budget_raises_before_any_data(name, extra):
  cfg = {**CASES[name][2], **extra}
  with pytest.raises(PrivacyBudgetExceeded):
    _plan(name, cfg)
  if "noise_multiplier" in extra:   # a large enough explicit z is kept and reported
    p = _plan(name, {**cfg, "noise_multiplier": 200.0})
    assert p.noise_multiplier == 200.0 and p.privacy.epsilon < cfg["epsilon"]


@pytest.mark.parametrize("name, drop, match", [
    ("sc_output_pert", "strong_convexity", "strong_convexity"),
    ("sc_output_pert", "lipschitz", "lipschitz"),
    ("naive_output_pert", "strong_convexity", "strong_convexity"),
    ("sc_erm_output_pert", "strong_convexity", "strong_convexity"),
    ("sc_sco_output_pert", "strong_convexity", "strong_convexity"),
    ("phased_erm_output_pert", "radius", "radius"),
    ("phased_sco_output_pert", "smoothness", "smoothness"),
    ("resque_private_sco", "lipschitz", "lipschitz"),
    ("resque_private_sco", "radius", "radius"),
    ("dp_loc_gd", "strong_convexity", "strong_convexity"),
    ("dp_loc_gd", "lipschitz", "lipschitz"),
    ("dp_loc_sgd", "radius", "radius0"),
])
def test_missing_constants_are_named(name, drop, match):
  with pytest.raises(MissingConstant, match=match):
    _plan(name, constants={k: v for k, v in CONSTANTS.items() if k != drop})


def test_dp_loc_gd_reads_constants_only_where_the_config_does_not_replace_them():
  cfg = {**LOC, "clip_norm": 1.0, "radius0": 4.0}
  a = _plan("dp_loc_gd", cfg, constants={"strong_convexity": L2})   # no L, no R
  b = _plan("dp_loc_gd", {**cfg, "mu": L2}, constants=None)          # mu from the config
  assert a.privacy == b.privacy and a.schedule == b.schedule
  assert a.schedule["mu"] == L2 and a.schedule["clip_norm"] == 1.0
