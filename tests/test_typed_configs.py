"""Typed configs built from Python are validated at construction, like YAML (issue 13)."""

import dataclasses

import pytest

from dpsco_jax.algorithms.registry import algorithms
from dpsco_jax.config.families import PROBLEM_SCHEMAS, Schema
from dpsco_jax.config.schema import ConfigError


def _dp_sgd():
  return algorithms()["dp_sgd_user"].config


def test_valid_config_is_frozen_and_normalized():
  cfg = _dp_sgd()(epsilon=1.0, delta=1e-5, num_steps=1e3, clip_norm=1)
  assert cfg.num_steps == 1000 and isinstance(cfg.num_steps, int)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.epsilon = 2.0


@pytest.mark.parametrize("kwargs, match", [
    ({"epsilon": "1.0", "delta": 1e-5}, "epsilon must be a number.*without quotes"),
    ({"epsilon": True, "delta": 1e-5}, "epsilon must be.*booleans"),
    ({"epsilon": 1.0, "delta": 1e-5, "num_steps": 1.5}, "num_steps must be an integer"),
    ({"epsilon": 1.0, "delta": 1e-5, "relation": "add-remove"}, "relation must be one of"),
    ({"epsilon": 1.0}, "needs delta"),
    ({"delta": 1e-5}, "needs one of epsilon, noise_multiplier"),
])
def test_bad_values_raise_at_construction_naming_the_key(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    _dp_sgd()(**kwargs)


def test_every_registered_config_and_problem_schema_validates_on_construction():
  schemas = {e.config for e in algorithms().values()} | set(PROBLEM_SCHEMAS.values())
  checked = 0
  for schema in schemas:
    assert issubclass(schema, Schema), schema
    fields = {f.name: f for f in dataclasses.fields(schema)}
    numeric = [n for n, f in fields.items() if f.type in ("float", "Optional[float]", "int",
                                                          "Optional[int]")]
    if not numeric:
      continue
    bad = {numeric[0]: "1"}  # a string is never a number
    with pytest.raises(ConfigError, match=numeric[0]):
      schema(**bad)
    checked += 1
  assert checked >= 15, checked   # every family has a numeric key
