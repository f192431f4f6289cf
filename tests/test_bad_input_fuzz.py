"""Issue 23 part 5: bad input that used to be accepted is refused (found by fuzzing).

One group of tests per bullet: a private config without epsilon, YAML duplicate keys and
YAML 1.1 number spellings, seeds outside the range the key derivation honours, unknown
metrics, unbounded counts, and the low-level entry points (Laplace scales, negative int seeds
as keys, a subnormal delta, a tiny explicit noise multiplier refused without minutes of PLD).
Checkpoint forgery is in tests/test_checkpoint_seal.py."""

import dataclasses
import math
import time

import dp_accounting
import jax
import jax.numpy as jnp
import pytest

from dpsco_jax.config import schema as cs
import dpsco_jax as dp
from dpsco_jax import runner
from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.data import DataSpec
from dpsco_jax.runner import tuning as tuning
from dpsco_jax.__main__ import main as cli
from dpsco_jax._checks import check_seed_or_key
from dpsco_jax.privacy.ledger import (PrivacyBudgetExceeded, PrivacyLedger,
                                      epsilon_lower_bound)
from dpsco_jax.privacy.mechanisms import laplace
from dpsco_jax.runner.config import parse_compare
from dpsco_jax.transforms import tree_noise
from dpsco_jax.transforms.noise import add_gaussian_noise

SRGD = {"algorithm": "accelerated_dp_srgd", "problem": "least_squares", "n_users": 100, "m": 1,
        "d": 3, "delta": 1e-6}
DPSGD = {"algorithm": "dp_sgd_user", "problem": "logistic", "n_users": 100, "m": 2, "d": 3,
         "epsilon": 1.0, "delta": 1e-5}
PRIVATE = sorted(n for n, s in cs.ALGORITHM_SCHEMAS.items()
                 if {"epsilon", "delta"} <= {f.name for f in dataclasses.fields(s)})


# --- a private algorithm never runs non-private by omission ---------------------------------

def _without_epsilon(algorithm: str) -> dict:
  """A valid config of ``algorithm`` with delta and every required key, but no epsilon."""
  problem = ("ridge_tuning" if algorithm.startswith("dp_bilevel") else "l2_logistic"
             if "output_pert" in algorithm else "logistic")
  cfg = {"algorithm": algorithm, "problem": problem, "delta": 1e-6}
  for name, spec in cs.keys_of(algorithm, problem).items():
    if spec.required and name not in cfg and name != "epsilon":
      cfg[name] = 0.5 if spec.type is float else 20
  return cfg


@pytest.mark.parametrize("algorithm", PRIVATE)
def test_delta_without_epsilon_is_refused_for_every_private_algorithm(algorithm):
  with pytest.raises(cs.ConfigError, match="epsilon"):
    cs.validate(_without_epsilon(algorithm))


@pytest.mark.parametrize("algorithm", ["accelerated_dp_srgd", "single_epoch_dp_sgd",
                                       "dp_sgd_user"])
def test_non_private_is_said_out_loud_the_same_way_everywhere(algorithm):
  base = dict(SRGD if "srgd" in algorithm or "single" in algorithm else DPSGD,
              algorithm=algorithm)
  base.pop("epsilon", None)
  one_of = r"needs one of epsilon, noise_multiplier \(noise_multiplier: 0 is the one spelling"
  with pytest.raises(cs.ConfigError, match=one_of):
    cs.validate(base)
  # epsilon: null with a delta ran SRGD non-private without a word (DP-SGD refused it)
  with pytest.raises(cs.ConfigError, match=one_of):
    cs.validate(dict(base, epsilon=None, delta=1e-6))
  with pytest.raises(cs.ConfigError, match=one_of):
    algorithms()[algorithm].config(delta=1e-6)
  spec = DataSpec(n_users=100, max_items_per_user=base["m"])
  public_n = {"n_users": 100} if algorithm == "dp_sgd_user" else {}   # add_remove: declared
  plan = dp.plan(algorithm, {"delta": 1e-6, "noise_multiplier": 0.0, "clip_norm": 1.0,
                             **public_n}, spec,
                 num_params=3, constants={"lipschitz": 1.0, "smoothness": 1.0, "radius": 1.0})
  assert plan.privacy.provenance == "none" and plan.privacy.epsilon == float("inf")
  assert cs.validate(dict(base, noise_multiplier=1.0))["noise_multiplier"] == 1.0  # private


def test_cli_exits_2_on_delta_without_epsilon(tmp_path, capsys):
  cfg = tmp_path / "srgd.yaml"
  cfg.write_text("problem: least_squares\nn_users: 50\nm: 1\nd: 2\n"
                 "algorithm: accelerated_dp_srgd\ndelta: 1.0e-6\n")
  assert cli(["run", str(cfg), "--quiet"]) == 2
  assert "needs one of epsilon, noise_multiplier" in capsys.readouterr().err


# --- YAML: duplicate keys and YAML 1.1 number spellings --------------------------------------

def _load(tmp_path, text: str) -> dict:
  path = tmp_path / "c.yaml"
  path.write_text(text)
  return runner.load_config(str(path))


@pytest.mark.parametrize("text", [
    "epsilon: 1.0\ndelta: 1.0e-6\nepsilon: 100.0\n",            # would run at epsilon = 100
    "experiments:\n  - {algorithm: dp_sgd_user, epsilon: 1.0, epsilon: 100.0}\n",
    "problem:\n  name: logistic\n  n_users: 10\n  n_users: 1000\n",
])
def test_a_duplicated_key_is_refused(tmp_path, text):
  with pytest.raises(cs.ConfigError, match="given twice"):
    _load(tmp_path, text)


@pytest.mark.parametrize("spelling", ["010", "0x10", "0b11", "1_000", "1:30", "1:30.5",
                                      "1_000.5", "-010", "!!int '010'"])
def test_yaml_1_1_number_spellings_are_refused(tmp_path, spelling):
  with pytest.raises(cs.ConfigError, match="plain decimal"):
    _load(tmp_path, f"num_steps: {spelling}\n")


def test_plain_numbers_and_merge_keys_still_read(tmp_path):
  c = _load(tmp_path, "a: 10\nb: -0\nc: +7\nd: 1.0e-5\ne: 2e3\nf: .inf\n"
                      "base: &b {p: 1, q: 2}\ng:\n  <<: *b\n  q: 3\n")
  assert (c["a"], c["b"], c["c"], c["d"], c["e"]) == (10, 0, 7, 1e-5, 2000.0)
  assert c["f"] == math.inf and c["g"] == {"p": 1, "q": 3}  # a merged key may be overridden


# --- seeds in the range the key derivation honours -------------------------------------------

def test_jax_keeps_32_bits_of_a_seed():
  """Why the range: these pairs give one key (so one noise stream)."""
  same = lambda a, b: bool(jnp.all(jax.random.key_data(jax.random.key(a))
                                   == jax.random.key_data(jax.random.key(b))))
  assert same(0, 2 ** 32) and same(-1, 2 ** 32 - 1)


@pytest.mark.parametrize("seed", [-1, 2 ** 32, 2 ** 63 - 1])
def test_out_of_range_run_seeds_are_refused(seed):
  with pytest.raises(cs.ConfigError, match=r"seed .*\[0, 4294967295\]"):
    cs.validate(dict(DPSGD, seed=seed))
  assert cs.validate(dict(DPSGD, seed=2 ** 32 - 1))["seed"] == 2 ** 32 - 1


def test_tuning_and_eval_seeds_cannot_alias_one_key():
  select = {"over": ["learning_rate"]}
  with pytest.raises(cs.ConfigError, match="eval_seeds.*4294967295"):
    tuning.parse_phases({"tuning_seeds": [0], "eval_seeds": [2 ** 32], "select": select})
  with pytest.raises(cs.ConfigError, match="tuning_seeds.*4294967295"):
    tuning.parse_phases({"tuning_seeds": [-1], "eval_seeds": [1], "select": select})
  with pytest.raises(cs.ConfigError, match=r"compare.seed .*\[0, 4294967295\]"):
    parse_compare({"compare": {"baseline": "x", "seed": -1}})


@pytest.mark.parametrize("seed", [-1, 2 ** 32, -(2 ** 40)])
def test_noise_stages_refuse_int_seeds_outside_the_range(seed):
  for make in (lambda: check_seed_or_key(seed),
               lambda: add_gaussian_noise(1.0, seed),
               lambda: tree_noise.tree_prefix_sum_noise(1.0, 8, seed),
               lambda: tree_noise.prefix_sum_noise(1.0, 8, seed, mechanism="independent")):
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32 - 1\]"):
      make()
  add_gaussian_noise(1.0, 2 ** 32 - 1)  # the top of the range is fine


# --- metrics are fields of the records -------------------------------------------------------

@pytest.mark.parametrize("metric", ["algorithm", "provenance", "status", ""])
def test_non_numeric_metric_names_are_refused_before_anything_runs(metric):
  with pytest.raises(cs.ConfigError, match="metric"):
    tuning.parse_phases({"tuning_seeds": [0], "eval_seeds": [1],
                         "select": {"over": ["learning_rate"], "metric": metric}})
  with pytest.raises(cs.ConfigError, match="compare.metric"):
    parse_compare({"compare": {"baseline": "x", "metric": metric}})


TINY = {"problem": "least_squares", "n_users": 30, "m": 1, "d": 2, "algorithm": "nonprivate_sgd",
        "num_steps": 3, "batch_size": 5}


def test_a_misspelt_select_metric_stops_at_the_first_record():
  phases = tuning.parse_phases({**TINY, "learning_rate": [0.1, 0.2], "tuning_seeds": [0],
                                "eval_seeds": [1], "select": {"over": ["learning_rate"],
                                                              "metric": "excess_riks"}})
  with pytest.raises(cs.ConfigError, match=r"select.metric 'excess_riks'.*no such field.*"
                                           r"excess_risk"):
    runner.run_phases(phases, progress=False)


def test_a_misspelt_compare_metric_is_refused_listing_the_fields(tmp_path):
  cfg = tmp_path / "c.yaml"
  cfg.write_text("problem: least_squares\nn_users: 30\nm: 1\nd: 2\nnum_steps: 3\n"
                 "batch_size: 5\nalgorithm: nonprivate_sgd\nlearning_rate: [0.1, 0.2]\n"
                 "compare: {baseline: nonprivate_sgd, metric: wall_time}\n")
  with pytest.raises(cs.ConfigError, match=r"compare.metric 'wall_time'.*wall_time_s"):
    runner.main_run(str(cfg), progress=False)


# --- counts are bounded ----------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("num_steps", 1e20), ("num_steps", 10 ** 20),
                                       ("num_steps", 2 ** 31), ("num_steps", -1),
                                       ("batch_size", 10 ** 12), ("n_users", 2 ** 40)])
def test_counts_outside_int32_are_refused_naming_the_key(key, value):
  with pytest.raises(cs.ConfigError, match=rf"{key} is a count and must lie in "
                                           r"\[0, 2147483647\]"):
    cs.validate(dict(DPSGD, **{key: value}))


def test_count_bounds_hold_for_yaml_and_typed_configs(tmp_path):
  loaded = _load(tmp_path, "num_steps: 1e20\n")  # read as a float, as a YAML user writes it
  with pytest.raises(cs.ConfigError, match="num_steps is a count"):
    cs.validate(dict(DPSGD, **loaded))
  from dpsco_jax.algorithms.dpsgd.config import DpSgdConfig
  with pytest.raises(cs.ConfigError, match="num_steps is a count"):
    DpSgdConfig(epsilon=1.0, delta=1e-5, num_steps=10 ** 12)
  assert cs.validate(dict(DPSGD, num_steps=2 ** 31 - 1))["num_steps"] == 2 ** 31 - 1


def test_prefix_noise_stages_bound_their_int32_step_counter():
  for mechanism in ("tree", "independent"):
    with pytest.raises(ValueError, match="max_steps must be <= 2147483647"):
      tree_noise.prefix_sum_noise(1.0, 2 ** 31, 0, mechanism=mechanism)
    tree_noise.prefix_sum_noise(1.0, 2 ** 31 - 1, 0, mechanism=mechanism)


# --- low level -------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [-1, -1.0, math.nan, math.inf, "1", 0, 0.0, True, None])
def test_laplace_refuses_a_scale_that_is_not_a_finite_positive_number(scale):
  with pytest.raises((TypeError, ValueError), match="scale"):
    laplace(jax.random.key(0), (3,), scale)


def test_laplace_checks_array_scales_and_keeps_good_ones():
  with pytest.raises(ValueError, match="scale"):
    laplace(jax.random.key(0), (3,), jnp.array([1.0, -1.0, 2.0]))
  assert laplace(jax.random.key(0), (3,), jnp.array([1.0, 0.5, 2.0])).shape == (3,)
  assert jax.jit(lambda s: laplace(jax.random.key(0), (), s))(2.0).shape == ()  # traced


@pytest.mark.parametrize("event", [
    dp_accounting.GaussianDpEvent(1.0),
    dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0))])
@pytest.mark.parametrize("delta", [5e-324, 1e-320, 1e-300])
def test_a_subnormal_delta_gives_a_finite_epsilon(delta, event):
  """Gaussians used to raise "Failed to converge"; Poisson-sampled ones gave inf (PLD's
  truncated tails), where RDP, a valid bound too, is finite."""
  eps = PrivacyLedger(delta=delta).compose(event, label="g", count=10).epsilon(exact=True)
  assert math.isfinite(eps) and eps > PrivacyLedger(delta=1e-100).compose(
      event, label="g", count=10).epsilon(exact=True)


def test_a_tiny_explicit_noise_multiplier_is_refused_in_well_under_a_second():
  event = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(0.01))
  ledger = PrivacyLedger(delta=1e-6, epsilon_budget=1.0)
  t0 = time.perf_counter()
  with pytest.raises(PrivacyBudgetExceeded, match="at least.*nothing was released"):
    ledger.check(event, count=1000)  # an exact PLD of this takes minutes
  with pytest.raises(PrivacyBudgetExceeded, match="at least"):
    ledger.spend(event, label="step")
  assert time.perf_counter() - t0 < 1.0 and not ledger.events


@pytest.mark.parametrize("q,z,steps,delta", [
    (0.01, 0.3, 1000, 1e-6), (0.01, 1.0, 1000, 1e-6), (0.1, 1.0, 10, 1e-5),
    (0.5, 0.5, 1, 1e-6), (0.001, 0.8, 10000, 1e-8), (1.0, 1.0, 4, 1e-6), (0.3, 2.0, 50, 1e-3)])
def test_the_cheap_lower_bound_is_below_both_accountants(q, z, steps, delta):
  """Soundness of the refusal: the bound never exceeds the accountant's epsilon."""
  event = (dp_accounting.GaussianDpEvent(z) if q == 1 else
           dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
  low = epsilon_lower_bound(event, delta=delta, count=steps)
  for accountant in ("pld", "rdp"):
    exact = PrivacyLedger(delta=delta, accountant=accountant).compose(
        event, label="x", count=steps).epsilon(exact=True)
    assert 0 <= low <= exact, (accountant, low, exact)
  assert low > 0  # and it is not vacuous on these


def test_replace_one_is_not_bounded_from_below():
  event = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(0.01))
  assert epsilon_lower_bound(event, delta=1e-6, relation="replace_one", count=10) == 0.0
