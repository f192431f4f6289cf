"""Number keys are range-checked where a config is built (from YAML or from Python), naming the
key: ``DpSgdConfig(epsilon=-1.0)`` used to build, and the bad value was found (if at all) by a
planner. Every float key of every schema refuses NaN and +-inf unless its range says
otherwise (``radius`` and ``smoothness`` accept +inf as a declared fact)."""
import math

import pytest

from dpsco_jax.algorithms.dpsgd.config import DpSgdConfig
from dpsco_jax.config.schema import (CONFIG_ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS, ConfigError,
                                     validate)
from dpsco_jax.config.types import RANGES, check_type, specs


def _float_specs():
  out = {}
  for table in (CONFIG_ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS):
    for name, schema in table.items():
      for key, spec in specs(schema, "x").items():
        if "float" in str(spec.type) and "tuple" not in str(spec.type):
          out.setdefault(key, (name, spec))
  return out


FLOAT_SPECS = _float_specs()


def test_every_ranged_key_is_a_number_key_of_some_schema():
  # a range written for a key no schema has (a typo) would never be checked
  assert set(RANGES) <= set(FLOAT_SPECS), set(RANGES) - set(FLOAT_SPECS)


@pytest.mark.parametrize("key", sorted(FLOAT_SPECS))
def test_nan_is_refused_by_every_float_key(key):
  _, spec = FLOAT_SPECS[key]
  with pytest.raises(ConfigError, match=key):
    check_type(spec, math.nan)


@pytest.mark.parametrize("key", sorted(FLOAT_SPECS))
def test_infinity_is_refused_unless_the_range_allows_it(key):
  _, spec = FLOAT_SPECS[key]
  with pytest.raises(ConfigError, match=key):
    check_type(spec, -math.inf)
  if key in ("radius", "smoothness"):
    assert check_type(spec, math.inf) == math.inf
  else:
    with pytest.raises(ConfigError, match=key):
      check_type(spec, math.inf)


BAD = {"epsilon": [0.0, -1.0, -1], "epsilon_budget": [0.0], "delta": [0.0, 1.0, 2.0, -1e-6],
       "noise_multiplier": [-0.5, -1], "sampling_rate": [0.0, 1.5],
       "clip_norm": [0.0, -1.0], "learning_rate": [0.0, -3.0], "lipschitz": [0.0],
       "radius": [0.0, -2.0], "smoothness": [-1.0], "strong_convexity": [-0.1],
       "heterogeneity": [-1.0], "l2": [-0.1], "epochs": [0.0],
       "inner_clip_norm": [-1.0], "outer_clip_norm": [0.0], "inner_clip_norm_lam": [-1.0],
       "target_quantile": [0.0, 1.0, 1.5, -0.1], "clip_learning_rate": [0.0, -0.2],
       "initial_clip_norm": [0.0, -1.0], "count_stddev": [-1.0]}
GOOD = {"epsilon": [1e-3, 8, 1.0], "delta": [1e-12, 0.5], "noise_multiplier": [0.0, 0, 1.1],
        "sampling_rate": [1.0, 1e-4], "strong_convexity": [0.0], "heterogeneity": [0.0],
        "l2": [0.0], "radius": [2.0, math.inf], "smoothness": [1.0, math.inf],
        "target_quantile": [0.5, 0.99], "count_stddev": [0.0, 2.5]}


def test_the_bad_and_good_lists_cover_every_range():
  assert set(BAD) == set(RANGES)


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in BAD.items() for v in vs])
def test_an_out_of_range_value_is_refused_naming_the_key(key, value):
  _, spec = FLOAT_SPECS[key]
  # the argument checks' wording: "must be a finite number > 0", "must lie in (0, 1]", ...
  with pytest.raises(ConfigError, match=rf"^{key} must (be|lie in) "):
    check_type(spec, value)


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in GOOD.items() for v in vs])
def test_an_in_range_value_is_kept(key, value):
  _, spec = FLOAT_SPECS[key]
  assert check_type(spec, value) == value


@pytest.mark.parametrize("kw,key", [
    (dict(epsilon=-1.0, delta=1e-6), "epsilon"),
    (dict(epsilon=math.nan, delta=1e-6), "epsilon"),
    (dict(epsilon=1.0, delta=2.0), "delta"),
    (dict(epsilon=1.0, delta=1e-6, learning_rate=-3.0), "learning_rate"),
    (dict(epsilon=None, delta=1e-6, noise_multiplier=-1), "noise_multiplier"),
    (dict(epsilon=1.0, delta=1e-6, clip_norm=math.inf), "clip_norm"),
])
def test_a_typed_config_refuses_it_at_construction(kw, key):
  with pytest.raises(ConfigError, match=key):
    DpSgdConfig(**kw)


def test_yaml_and_the_api_refuse_it_before_anything_is_planned(monkeypatch):
  import dpsco_jax as dp
  from dpsco_jax.privacy import calibrate
  run = {"algorithm": "dp_sgd_user", "problem": "logistic", "n_users": 50, "m": 2, "d": 3,
         "epsilon": -1.0, "delta": 1e-6}
  with pytest.raises(ConfigError, match="epsilon must be a finite number > 0"):
    validate(run)
  called = []
  real = calibrate._calibrate
  monkeypatch.setattr(calibrate, "_calibrate",
                      lambda *a, **k: called.append(1) or real(*a, **k))
  spec = dp.DataSpec(n_users=50, max_items_per_user=2)
  with pytest.raises(ConfigError, match=r"delta must lie in the open interval \(0, 1\)"):
    dp.plan("dp_sgd_user", {"epsilon": 1.0, "delta": 1.5, "n_users": 50}, spec, num_params=3)
  assert called == []


@pytest.mark.parametrize("key,value", [("shares", (0.5, math.nan, 0.5)),
                                       ("omega_bounds", (1e-3, math.inf))])
def test_a_sequence_key_refuses_nan_and_infinity(key, value):
  spec = next(s for table in (CONFIG_ALGORITHM_SCHEMAS, PROBLEM_SCHEMAS)
              for schema in table.values() for k, s in specs(schema, "x").items() if k == key)
  with pytest.raises(ConfigError, match=rf"^{key} must be a list of finite numbers"):
    check_type(spec, value)
  assert check_type(spec, tuple(0.5 for _ in value)) == tuple(0.5 for _ in value)
