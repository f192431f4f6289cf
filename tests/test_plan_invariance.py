"""Issue 23.1: no plan rests on a fact measured on the private data.

For every planner and every relation it supports: the plan of D and of D with one item more
(``m`` -> ``m + 1``, a measured ``m``) is identical, or the plan refuses a measured ``m``
(``api.READS_M``); under ``add_remove`` the plan of D and of D with one user more is identical
(``n_users`` is read from the config's declaration). And the converse, so ``READS_M`` stays
minimal and complete: every algorithm in it does move with a declared ``m``."""

import warnings

import numpy as np
import pytest

from dpsco_jax import api
from dpsco_jax.data import DataSpec, UserData
from dpsco_jax.planners import PLANNED

from test_api_planners import CASES as PAPER_CASES
from test_api_planners import CONSTANTS as PAPER_CONSTANTS

CONSTANTS = {"lipschitz": 1.0, "smoothness": 1.0, "radius": 4.0, "strong_convexity": 0.5}
DPSGD = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "learning_rate": 0.5,
         "num_steps": 20, "batch_size": 30}
SRGD = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0}
FILTER = {"epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0, "sensitivity": "typical"}
CASES = {  # name: (n_users, m, config)
    "nonprivate_sgd": (120, 8, {"learning_rate": 0.5, "num_steps": 10}),
    "dp_sgd_user": (120, 8, DPSGD), "dp_sgd_item": (120, 8, DPSGD),
    "dp_sgd_group": (120, 8, {**DPSGD, "epsilon": 8.0}),
    **{k: (120, 8, SRGD) for k in ("accelerated_dp_srgd", "dp_srgd_unaccelerated",
                                   "accelerated_dp_srgd_independent_noise",
                                   "accelerated_dp_sgd", "single_epoch_dp_sgd")},
    "user_level_phased_sgd": (1200, 8, {"epsilon": 2.0, "delta": 1e-5,
                                        "sensitivity": "typical", "num_groups": 10}),
    **{k: (120, 8, FILTER) for k in ("user_level_accelerated_erm",
                                     "user_level_accelerated_erm_smoothed")},
    **PAPER_CASES,
}
RELATIONS = ("add_remove", "replace_one", "zero_out")


def _signature(p: api.Plan):
  return (p.privacy.epsilon, p.privacy.relation, p.privacy.provenance, p.noise_multiplier,
          repr(p.schedule))


def _plan(name, cfg, n, m, measured=()):
  consts = PAPER_CONSTANTS if name in PAPER_CASES else CONSTANTS
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return api.plan(name, cfg, DataSpec(n, m, measured=frozenset(measured)), num_params=5,
                    constants=consts)


def _supported(name, cfg, n, m):
  """``(relation, config, plan)`` for each relation ``name`` honours (the others are refused
  by its plan, as they should), with the plan of ``(n, m)`` that showed it: the tests use it as
  their base plan instead of planning (calibrating) the same config a second time."""
  out = []
  for rel in RELATIONS:
    c = {**cfg, "relation": rel, **({"n_users": n} if rel == "add_remove" else {})}
    if name == "nonprivate_sgd":
      return [(None, cfg, _plan(name, cfg, n, m))]
    try:
      p = _plan(name, c, n, m)
    except ValueError as err:
      if "cannot honour" in str(err) or "relation" in str(err):
        continue
      raise
    out.append((rel, c, p))
  assert out, f"{name} honours no relation"
  return out


def test_every_planner_has_a_case():
  assert set(CASES) == set(PLANNED)
  assert api.READS_M <= set(PLANNED)


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_plan_is_the_same_for_one_item_or_user_more_or_refuses_a_measured_fact(name):
  n, m, cfg = CASES[name]
  for rel, c, p in _supported(name, cfg, n, m):
    base = _signature(p)
    if rel == "add_remove":      # one user more: the declared n_users decides, not the data
      assert _signature(_plan(name, c, n + 1, m, measured={"n_users"})) == base, rel
    if name in api.READS_M:      # one item more moves the plan: a measured m is refused
      with pytest.raises(api.UndeclaredFact, match="max_items_per_user"):
        _plan(name, c, n, m, measured={"max_items_per_user"})
      assert _signature(_plan(name, c, n, m + 1)) != base, (name, rel)
    else:                        # ... or does not move it at all
      assert _signature(_plan(name, c, n, m + 1, measured={"max_items_per_user"})) == base, \
          (name, rel)


def test_the_reported_attack_is_refused():
  # issue 23: 20 users of one item, then user 0 gets a second item: the measured m doubled the
  # denominator q * n_users * m and halved the noise std (0.3435 -> 0.1718)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(21, 3)).astype(np.float32)
  ids = np.concatenate([np.arange(20), [0]])
  cfg = {**DPSGD, "n_users": 20, "batch_size": 10}
  for k in (20, 21):
    spec = UserData.from_arrays({"x": x[:k]}, ids[:k]).spec
    assert not spec.declared("max_items_per_user") and not spec.declared("n_users")
    with pytest.raises(api.UndeclaredFact, match="max_items_per_user"):
      api.plan("dp_sgd_item", cfg, spec, num_params=3)
  declared = [api.plan("dp_sgd_item", cfg,
                       UserData.from_arrays({"x": x[:k]}, ids[:k], max_items_per_user=2).spec,
                       num_params=3) for k in (20, 21)]
  assert _signature(declared[0]) == _signature(declared[1])


def test_dataspec_checks_its_facts():
  with pytest.raises(ValueError, match="n_users"):
    DataSpec(-5, 2)
  with pytest.raises(TypeError, match="n_users"):
    DataSpec(1.5, 2)
  with pytest.raises(TypeError, match="max_items_per_user"):
    DataSpec(3, True)
  with pytest.raises(ValueError, match="n_users"):
    DataSpec(0, 2)
  with pytest.raises(ValueError, match="unknown facts"):
    DataSpec(3, 2, measured={"m"})
  assert DataSpec(3, 2).declared("max_items_per_user")


def _count_calibrations(monkeypatch, module, name: str = "calibrate_noise_multiplier") -> list:
  """Wraps ``module.<name>`` (by default the calibrator as that module calls it); the
  returned list grows by one per call."""
  calls = []
  real = getattr(module, name)
  monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
  return calls


def _small_data(seed: int) -> UserData:
  """40 users x 2 items of 3 features (the fits' data)."""
  rng = np.random.default_rng(seed)
  return UserData.from_arrays({"x": rng.normal(size=(80, 3)).astype(np.float32)},
                              np.repeat(np.arange(40), 2), max_items_per_user=2)


def test_a_fit_calibrates_once(monkeypatch):
  import jax
  import jax.numpy as jnp
  from dpsco_jax.privacy import calibrate
  calibrate._keyed_calibration.cache_clear()   # (an earlier test may have calibrated this plan)
  calls = _count_calibrations(monkeypatch, calibrate, "_calibrate")   # bisections run
  data = _small_data(0)
  cfg = {**DPSGD, "n_users": 40, "num_steps": 3, "batch_size": 10}
  res = api.fit("dp_sgd_user", cfg, lambda p, ex: jnp.sum(ex["x"] * p), jnp.zeros(3), data,
                jax.random.key(0))
  assert len(calls) == 1 and res.privacy.epsilon <= 2.0 + 1e-9


def test_filter_phases_calibrate_once_per_fit_and_not_again_for_another_seed(monkeypatch):
  """Algorithm 3 calibrates one z per phase (different n_i, K_i, T_i): the plan computes them,
  the run executes the plan, and every further plan of the same config (another seed) reuses
  them (a pure function of public numbers, memoized by the calibrator in the one cache); the
  bisection was most of a fit's time."""
  import jax
  import jax.numpy as jnp
  from dpsco_jax.privacy import calibrate
  calibrate._keyed_calibration.cache_clear()
  calls = _count_calibrations(monkeypatch, calibrate, "_calibrate")   # bisections run
  rng = np.random.default_rng(0)
  ids = np.repeat(np.arange(120), 8)
  data = UserData.from_arrays({"x": rng.normal(size=(960, 3)).astype(np.float32)}, ids,
                              max_items_per_user=8)
  loss = lambda p, ex: jnp.sum(ex["x"] * p) ** 2
  fits = [api.fit("user_level_accelerated_erm", FILTER, loss, jnp.zeros(3), data,
                  jax.random.key(seed), constants=CONSTANTS) for seed in (0, 1)]
  planned = api.plan("user_level_accelerated_erm", FILTER, data.spec, num_params=3,
                     constants=CONSTANTS).schedule["phases"]
  phases = len(planned)                 # (a run's record lists the phases before a halt)
  assert phases >= 2 and len(calls) == phases   # 2 fits' plans + plan: once each
  assert fits[0].privacy == fits[1].privacy and fits[0].privacy.epsilon <= 2.0 + 1e-9
  assert [ph["noise_multiplier"] for ph in fits[1].record["phases"]] == [
      ph["noise_multiplier"] for ph in planned][:len(fits[1].record["phases"])]


def test_a_fit_composes_the_accountant_once(monkeypatch):
  """The driver re-derives and re-charges its plan (``run`` checks the two agree); the
  accountant's composition of the plan's events is a pure function of public numbers, memoized
  in the one cache, so the second charge is a lookup (it was a second PLD composition: 27 ms of
  a 47 ms warm run of a small DP-SGD fit)."""
  import jax
  import jax.numpy as jnp
  from dpsco_jax import cache
  from dpsco_jax.privacy import ledger
  cache.clear()
  calls = _count_calibrations(monkeypatch, ledger, "accountant_epsilon")
  data = _small_data(1)
  cfg = {**DPSGD, "n_users": 40, "num_steps": 7, "batch_size": 10}
  res = api.fit("dp_sgd_user", cfg, lambda p, ex: jnp.sum(ex["x"] * p), jnp.zeros(3), data,
                jax.random.key(0))
  first = len(calls)
  assert first >= 1 and res.privacy.epsilon <= 2.0 + 1e-9
  # the same plan for another seed: no new composition at all
  api.fit("dp_sgd_user", cfg, lambda p, ex: jnp.sum(ex["x"] * p), jnp.zeros(3), data,
          jax.random.key(1))
  assert len(calls) == first
  # another ledger charging other events composes again (the cache is keyed by the events)
  api.fit("dp_sgd_user", {**cfg, "num_steps": 9}, lambda p, ex: jnp.sum(ex["x"] * p),
          jnp.zeros(3), data, jax.random.key(0))
  assert len(calls) > first


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_same_plan_again_calibrates_nothing(monkeypatch, name):
  """One calibration per plan (issue 25): planning the same config for the same facts again,
  which is what a driver does inside ``dpsco_jax.run`` and every further seed does, runs no
  bisection. Before the calibrator's keyed memo, Algorithm 1, naive output perturbation,
  private ReSQue and DP-Loc-GD / SGD calibrated again in every run."""
  from dpsco_jax.privacy import calibrate
  n, m, cfg = CASES[name]
  cfg = {**cfg, "n_users": n}
  first = _plan(name, cfg, n, m)
  calls = _count_calibrations(monkeypatch, calibrate, "_solve")
  again = _plan(name, cfg, n, m)
  assert calls == [] and _signature(again) == _signature(first)


def test_the_calibrators_memo_is_keyed_by_the_family_and_the_fixed_events(monkeypatch):
  import dp_accounting
  from dpsco_jax import cache
  from dpsco_jax.privacy import calibrate
  from dpsco_jax.privacy.events import pure_dp_event
  cache.clear()
  calls = _count_calibrations(monkeypatch, calibrate, "_solve")
  gauss = lambda z: dp_accounting.GaussianDpEvent(z)
  kw = dict(epsilon=1.0, delta=1e-6, relation="replace_one")
  z = calibrate.calibrate_noise_multiplier(gauss, key=("g",), **kw)
  n = len(calls)
  assert calibrate.calibrate_noise_multiplier(lambda z: dp_accounting.GaussianDpEvent(z),
                                              key=("g",), **kw) == z and len(calls) == n
  # another fixed event, epsilon or key is another calibration, with its own answer
  z_fixed = calibrate.calibrate_noise_multiplier(gauss, key=("g",), fixed=[pure_dp_event(0.2)],
                                                 **kw)
  assert len(calls) > n and z_fixed > z
  twice = lambda z: [dp_accounting.GaussianDpEvent(z)] * 2
  z_twice = calibrate.calibrate_noise_multiplier(twice, key=("g", 2), **kw)
  assert z_twice > z
  # the memo's answer is the unmemoized one
  assert calibrate.calibrate_noise_multiplier(twice, **kw) == z_twice
  with pytest.raises(TypeError):
    calibrate.calibrate_noise_multiplier(gauss, key=("g", [1]), **kw)
