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


# ------------------------------------------------------------------ the typed config is what runs
# (issue 25: the typed config was checked, then flattened back to a dict and read again)


def test_schema_of_reads_a_run_mapping_and_returns_an_instance_as_it_is():
  schema = _dp_sgd()
  run = {"algorithm": "dp_sgd_user", "problem": "logistic", "m": 4, "epsilon": 1.0,
         "delta": 1e-6, "n_users": 100, "debug": False}
  cfg = schema.of(run)            # the problem's and the runner's other keys are not its own
  assert isinstance(cfg, schema) and cfg.n_users == 100 and cfg.epsilon == 1.0
  assert schema.of(cfg) is cfg    # an instance is not rebuilt (nor re-validated)
  with pytest.raises(ConfigError, match="epsilon must be a number"):
    schema.of({"epsilon": "1", "delta": 1e-6})   # a mapping is validated on the way in
  with pytest.raises(ConfigError, match="mapping or DpSgdConfig"):
    schema.of([("epsilon", 1.0)])


def test_a_typed_config_reads_as_a_mapping_of_its_set_fields():
  cfg = _dp_sgd()(epsilon=1.0, delta=1e-6)
  assert cfg["epsilon"] == 1.0 and cfg.get("relation", "derived") == "derived"
  assert cfg.get("sampling", "other") == "poisson"   # a literal default is the schema's
  assert "bands" not in cfg and "epsilon" in cfg and "no_such_key" not in cfg
  assert dict(cfg) == {k: getattr(cfg, k) for k in cfg} and None not in dict(cfg).values()
  with pytest.raises(KeyError, match="not a key of DpSgdConfig"):
    cfg.get("lr")     # a driver reading an undeclared key is a bug, not a default
  with pytest.raises(KeyError):
    cfg["clip"]
  assert hash(cfg) == hash(_dp_sgd()(epsilon=1.0, delta=1e-6)) and cfg == _dp_sgd()(
      epsilon=1.0, delta=1e-6)


def test_every_algorithm_schema_holds_n_users_and_debug_and_keys_of_keeps_their_owners():
  from dpsco_jax.config.schema import keys_of
  for name, entry in algorithms().items():
    fields = {f.name for f in dataclasses.fields(entry.config)}
    assert {"n_users", "debug"} <= fields, name
  keys = keys_of("dp_sgd_user", "logistic")
  assert keys["n_users"].owner == "problem" and keys["n_users"].required   # still required
  assert keys["debug"].owner == "runner"


def test_plan_holds_the_typed_config_and_run_hands_it_to_the_driver(monkeypatch):
  import jax
  import jax.numpy as jnp
  import dpsco_jax as dp
  from dpsco_jax import api
  from dpsco_jax.data.user_data import UserData
  schema = _dp_sgd()
  x = jax.random.normal(jax.random.key(0), (40, 2, 3))
  data = UserData.from_arrays({"x": x.reshape(80, 3)}, jnp.repeat(jnp.arange(40), 2),
                              max_items_per_user=2)
  loss = lambda w, ex: 0.5 * jnp.sum((w - ex["x"]) ** 2)
  p = dp.plan("dp_sgd_user", {"epsilon": 1.0, "delta": 1e-5, "n_users": 40, "num_steps": 3,
                              "clip_norm": 1.0, "learning_rate": 0.1, "batch_size": 8},
              data.spec, num_params=3)
  assert isinstance(p.config, schema) and p.config.noise_multiplier is None
  assert dp.algorithm_config("dp_sgd_user", p.config) is p.config
  seen = []
  entry = api._entry("dp_sgd_user")
  spy = dataclasses.replace(entry, driver=lambda plan, prob, key: (
      seen.append(plan), entry.driver(plan, prob, key))[1])
  monkeypatch.setattr(api, "_entry", lambda name, user_data=True: spy)
  dp.run(p, loss, jnp.zeros(3), data, jax.random.key(1))
  (given,) = seen
  # the plan itself, with its typed config and calibrated z (nothing is calibrated again)
  assert given is p and isinstance(given.config, schema)


def test_the_runner_hands_the_driver_its_typed_config():
  from dpsco_jax import runner
  algos, problems = runner.registry()
  seen = []
  spy = lambda plan, prob, key: (seen.append(plan.config),
                                 algos["dp_sgd_user"](plan, prob, key))[1]
  record = runner.run_one(
      {"algorithm": "dp_sgd_user", "problem": "logistic", "n_users": 40, "m": 2, "d": 3,
       "epsilon": 1.0, "delta": 1e-5, "num_steps": 3, "batch_size": 8, "seed": 0},
      algorithms={**algos, "dp_sgd_user": spy}, problems=problems)
  (given,) = seen
  assert isinstance(given, _dp_sgd()) and given.n_users == 40 and given.epsilon == 1.0
  assert record["target_epsilon"] == 1.0


def test_a_private_srgd_config_needs_delta_a_non_private_one_does_not():
  srgd = algorithms()["accelerated_dp_srgd"].config
  non_private = srgd(noise_multiplier=0.0)   # non-private, said out loud: no delta needed
  assert non_private.delta is None and non_private.epsilon is None
  for private in ({"epsilon": 1.0}, {"noise_multiplier": 2.0}):
    with pytest.raises(ConfigError, match="delta is required.*for a private run"):
      srgd(**private)
    assert srgd(**private, delta=1e-6).delta == 1e-6


def test_a_wrong_type_is_a_config_error_and_a_type_error():
  with pytest.raises(TypeError, match="debug must be true or false"):
    _dp_sgd()(epsilon=1.0, delta=1e-6, debug="false")
  with pytest.raises(ConfigError, match="epsilon must be a number"):
    _dp_sgd()(epsilon="1", delta=1e-6)
